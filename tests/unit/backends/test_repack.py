"""Weight repacking (llama.cpp's extra CPU buffer types): on where AMX is ruled out, off where the CPU or the build
has it or an x86 CPU's flags cannot be read, and for Q4_K models with an AVX-512 build; --repack/--no-repack either
way. The choice reaches llama.cpp's model params, and the load line says whether the weights were repacked."""

from __future__ import annotations

import argparse

import llama_cpp as ll
import pytest

from cobali.backends.llama_cpp import loading
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.repack import RepackChoice, choose_repack, cpu_flags, for_model, slow_for
from cobali.config.flags import add_backend_args, backend_config

ZEN = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n\n" * 2
SAPPHIRE_RAPIDS = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve i8mm\n"
BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | REPACK = 1 | "
AVX2_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 | "
AMX_BUILD = "CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | "


@pytest.mark.parametrize(("cpuinfo", "system_info", "machine", "on", "why"), [
    (ZEN, BUILD, "x86_64", True, "no AMX on this CPU"),
    (GRAVITON, BUILD, "aarch64", True, "no AMX on this CPU"),
    (SAPPHIRE_RAPIDS, BUILD, "x86_64", False, "the CPU has AMX (amx_bf16, amx_int8, amx_tile)"),
    (ZEN, AMX_BUILD, "x86_64", False, "this llama.cpp build has AMX"),
    (None, BUILD, "AMD64", False, "no /proc/cpuinfo to rule out AMX"),  # Windows, or a Mac with an Intel CPU
    (None, BUILD, "arm64", True, "no AMX on arm64"),
], ids=["zen", "arm", "sapphire-rapids", "amx-build", "x86-unknown", "arm-unknown"])
def test_repacking_is_on_by_default_only_where_amx_is_ruled_out(cpuinfo: str | None, system_info: str, machine: str,
                                                                on: bool, why: str) -> None:
    choice = choose_repack(None, cpuinfo, system_info, machine)
    assert choice.on is on and choice.why.startswith(why)
    if not on:
        assert "--repack turns it on" in choice.why


@pytest.mark.parametrize("asked", [True, False])
def test_the_flag_wins_either_way(asked: bool) -> None:
    for cpuinfo in (ZEN, SAPPHIRE_RAPIDS, None):
        assert choose_repack(asked, cpuinfo, AMX_BUILD, "x86_64").on is asked


def test_cpu_flags_are_read_from_x86_and_arm_lines() -> None:
    assert {"amx_tile", "amx_int8", "avx2"} <= cpu_flags(SAPPHIRE_RAPIDS)
    assert "i8mm" in cpu_flags(GRAVITON) and "amx_tile" not in cpu_flags(ZEN)


def test_q4_k_models_stay_unrepacked_with_an_avx512_build_unless_asked() -> None:
    on = RepackChoice(True, "no AMX on this CPU")
    slow = slow_for(BUILD)
    off = for_model(on, "Q4_K_M", slow)
    assert not off.on and off.why.startswith("Q4_K_M weights, whose prefill ran slower repacked with AVX-512")
    assert for_model(on, "Q4_0", slow) == on and for_model(on, None, slow) == on  # Q4_0 gains; unknown: as the CPU
    assert slow_for(AVX2_BUILD) == frozenset()  # measured on AVX-512 only: elsewhere as llama-server has it


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_backend_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "repack"), [((), None), (("--repack",), True), (("--no-repack",), False)])
def test_the_repack_flag_reaches_the_backend_config(argv: tuple[str, ...], repack: bool | None) -> None:
    assert backend_config(parsed(*argv)).repack is repack


@pytest.fixture
def this_cpu(monkeypatch: pytest.MonkeyPatch):
    """Make the load see `cpuinfo` as this machine's CPU, with an AVX-512 build without AMX, and model files of
    the type given (file_type's answer, recorded each time it is asked)."""
    asked: list[str] = []

    def use(cpuinfo: str | None, file_type: str = "Q4_0") -> list[str]:
        monkeypatch.setattr(loading, "read_cpuinfo", lambda: cpuinfo)
        monkeypatch.setattr(loading.ll, "llama_print_system_info", lambda: BUILD.encode())
        def read(path: str) -> str:
            asked.append(path)
            return file_type

        monkeypatch.setattr(loading, "file_type", read)
        loading.repack_choice.cache_clear()
        return asked

    yield use
    loading.repack_choice.cache_clear()


@pytest.mark.parametrize(("cpuinfo", "file_type", "repack", "extra_bufts"), [
    (ZEN, "Q4_0", None, True), (ZEN, "Q4_1", None, True), (ZEN, "Q4_K_M", None, False),
    (SAPPHIRE_RAPIDS, "Q4_0", None, False), (ZEN, "Q4_0", False, False), (SAPPHIRE_RAPIDS, "Q4_K_M", True, True),
], ids=["zen-q4_0", "zen-q4_1", "zen-q4_k_m", "amx-q4_0", "no-repack", "repack-on-amx"])
def test_the_choice_reaches_llamas_model_params(tmp_path, monkeypatch: pytest.MonkeyPatch, this_cpu, cpuinfo: str,
                                                file_type: str, repack: bool | None, extra_bufts: bool) -> None:
    probed = this_cpu(cpuinfo, file_type)
    seen = []
    monkeypatch.setattr(ll, "llama_model_load_from_file", lambda path, params: seen.append(params.use_extra_bufts))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="could not load"):  # the fake load returns no model
        loading.load_model(str(path), LlamaCppConfig(repack=repack))
    assert seen == [extra_bufts]
    # the file's type is read only where the CPU left the choice to it
    assert probed == ([str(path)] if repack is None and cpuinfo is ZEN else [])


REPACK_LOAD = [(3, "load_tensors:   CPU_Mapped model buffer size =    85.30 MiB"),
               (3, "load_tensors:   CPU_REPACK model buffer size =    56.95 MiB")]


def test_the_load_line_says_whether_the_weights_were_repacked() -> None:
    on = RepackChoice(True, "no AMX on this CPU")
    assert loading.repacked_mib(REPACK_LOAD) == pytest.approx(56.95)
    assert loading.repack_phrase(on, REPACK_LOAD) == "weights repacked for the CPU (57 MiB of them: no AMX on this CPU)"
    # a Q4_1 model: repacking on, and no tensor of its types moved
    assert loading.repack_phrase(on, REPACK_LOAD[:1]).startswith(
        "weights not repacked (none of this model's types repacks on this CPU")
    off = choose_repack(False, ZEN, BUILD, "x86_64")
    assert loading.repack_phrase(off, REPACK_LOAD[:1]) == "weights not repacked (--no-repack)"
