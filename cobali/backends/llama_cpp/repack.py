"""Whether llama.cpp repacks the weights for the CPU (its "extra buffer types", llama-server's --repack): the
choice, from the flag or from what this CPU and build are, and the reason the load line gives for it.

Repacking interleaves Q4_0, Q4_K, IQ4_NL and MXFP4 rows (Q2_K too with AVX-512; Q5_K, Q6_K and Q8_0 only on
ARM) for ggml's tiled matmul; other types, Q4_1 and Q5_0 among them, stay as they are. On an AVX-512 CPU
(docs/results.md, "Weight repacking on the CPU") it about doubles a Q4_0 model's prefill, and cuts a Q4_K one's
by 40 % or more: ggml's repacked Q4_K kernel for AVX-512 is slow. The extra buffer types also hold ggml's AMX
one, listed before the repacking one where the build has AMX, and its matmul segfaulted on the Sapphire Rapids
VMs this project ran on. So, unless asked: off wherever the CPU or the build has AMX, or an x86 CPU's flags
cannot be read (no run there showed it safe), and for Q4_K models with an AVX-512 build; on elsewhere, as
llama-server has it."""

from __future__ import annotations

from dataclasses import dataclass

# The CPU flags Linux lists for AMX, and the feature llama.cpp's system info lists when its build has AMX code.
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
AMX_BUILD_FEATURE = "AMX_INT8 = 1"
AVX512_BUILD_FEATURE = "AVX512 = 1"
# llama_ftype names of the files mostly in Q4_K: the ones whose prefill repacking slowed with AVX-512.
Q4_K_FILES = frozenset({"Q4_K_S", "Q4_K_M"})
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})  # platform.machine()'s names for x86


@dataclass(frozen=True)
class RepackChoice:
    on: bool
    why: str  # for the load line: "--no-repack", "no AMX on this CPU", ...


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo's text (x86's "flags" lines; ARM lists "Features", never AMX)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def choose_repack(asked: bool | None, cpuinfo: str | None, system_info: str, machine: str) -> RepackChoice:
    """--repack/--no-repack as asked; without either (None), on where AMX is ruled out. cpuinfo: /proc/cpuinfo's
    text, None where there is none (not Linux); system_info: llama_print_system_info's; machine: platform's.
    The model's weights may still turn it off: for_model."""
    if asked is not None:
        return RepackChoice(asked, "--repack" if asked else "--no-repack")
    if AMX_BUILD_FEATURE in system_info:
        return RepackChoice(False, "this llama.cpp build has AMX, whose matmul segfaulted on Sapphire Rapids; "
                                   "--repack turns it on")
    if cpuinfo is None:
        if machine.lower() in X86_MACHINES:  # it may be an AMX CPU, where repacking was never shown safe
            return RepackChoice(False, "no /proc/cpuinfo to rule out AMX on this x86 CPU; --repack turns it on")
        return RepackChoice(True, f"no AMX on {machine or 'this CPU'}")
    amx = sorted(cpu_flags(cpuinfo) & AMX_CPU_FLAGS)
    if amx:
        return RepackChoice(False, f"the CPU has AMX ({', '.join(amx)}), whose matmul segfaulted on Sapphire "
                                   "Rapids; --repack turns it on")
    return RepackChoice(True, "no AMX on this CPU")


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:  # not Linux, or no /proc
        return None


def slow_for(system_info: str) -> frozenset[str]:
    """The model file types whose prefill repacking slows with this build: the ones for_model needs told apart."""
    return Q4_K_FILES if AVX512_BUILD_FEATURE in system_info else frozenset()


def for_model(choice: RepackChoice, file_type: str | None, slow: frozenset[str]) -> RepackChoice:
    """The choice the CPU left on without being asked, for a model whose file type (llama_ftype's name: Q4_K_M;
    None if unknown) is `file_type`: off where that type's prefill measured slower repacked (`slow`, slow_for's)."""
    if file_type in slow:
        return RepackChoice(False, f"{file_type} weights, whose prefill ran slower repacked with AVX-512; "
                                   "--repack turns it on")
    return choice
