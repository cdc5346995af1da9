"""Loading a GGUF model and making its context: the memory they take, errors that say why they failed, and
the line that says what was loaded."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from dataclasses import dataclass

import llama_cpp as ll

from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.devices import accelerators, devices
from cobali.backends.llama_cpp.kv_size import kv_cell_bytes
from cobali.backends.llama_cpp.repack import RepackChoice, choose_repack, for_model, read_cpuinfo, slow_for
from cobali.backends.llama_cpp.tools import GGML_LOG_LEVEL_ERROR, llama_logs, silence_logs
from cobali.backends.memory import fit_cells, fmt_bytes, host_available

FLASH_ATTN_TYPES = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}
FILE_TYPES = {getattr(ll, name): name.removeprefix("LLAMA_FTYPE_MOSTLY_") for name in dir(ll)
              if name.startswith("LLAMA_FTYPE_MOSTLY_")}
KV_FIXES = "lower --ctx or --max-slots, quantize the cache (--cache-type-k/-v q8_0), or let --fit size it"


def ggml_type(name: str) -> int:
    return getattr(ll, f"GGML_TYPE_{name.upper()}", None) or {"bf16": 30}[name]  # the bindings lack BF16


def llama_said(lines: list[tuple[int, str]], most: int = 3) -> str:
    """llama.cpp's last error lines, as one string ('' when it logged none)."""
    errors = [text.strip() for level, text in lines
              if text.strip() and (level == GGML_LOG_LEVEL_ERROR or re.search(r"error|failed", text, re.I))]
    return " | ".join(dict.fromkeys(errors[-most:]))


def check_gguf(path: str) -> None:
    """Refuse what llama.cpp would fail on without saying why: no file, or a file that is not a GGUF."""
    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): llama.cpp loads GGUF "
                         "only (convert a Hugging Face checkpoint with llama.cpp's convert_hf_to_gguf.py)")


def gguf_architecture(path: str) -> str | None:
    """general.architecture from the file's header, read with the `gguf` package (None if unreadable)."""
    try:
        import gguf  # a few seconds on a large model: only on the way to an error

        return str(gguf.GGUFReader(path).fields["general.architecture"].contents())
    except Exception:  # a damaged header is what the caller reports
        return None


def load_model(path: str, options: LlamaCppConfig, vocab_only: bool = False):
    """The model at `path`; vocab_only: its vocabulary and metadata alone (no tensor is read or allocated)."""
    check_gguf(path)
    params = ll.llama_model_default_params()
    params.vocab_only = vocab_only
    gpu = options.n_gpu_layers
    params.n_gpu_layers = (999 if ll.llama_supports_gpu_offload() else 0) if gpu < 0 else gpu
    params.use_extra_bufts = not vocab_only and repack_choice(options.repack, path).on
    logs = llama_logs(options.verbose)
    mark = logs.count
    model = ll.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ValueError(load_failure(path, logs.since(mark)))
    return model


@functools.lru_cache(maxsize=64)
def repack_choice(asked: bool | None, path: str) -> RepackChoice:
    """--repack/--no-repack, or the choice for this CPU, llama.cpp build and model file (none of them changes)."""
    system_info = ll.llama_print_system_info().decode(errors="replace")
    choice = choose_repack(asked, read_cpuinfo(), system_info, platform.machine())
    if asked is None and choice.on and (slow := slow_for(system_info)):  # the file is read only where it counts
        choice = for_model(choice, file_type(path), slow)
    return choice


def repack_flag(path: str, asked: bool | None = None) -> str:
    """llama.cpp's tools' flag for the choice cobali makes on this model: benchmarks pass it to llama-server."""
    return "--repack" if repack_choice(asked, path).on else "--no-repack"


def file_type(path: str) -> str | None:
    """The file's llama_ftype name (general.file_type: Q4_0, Q4_K_M, ...), from a vocabulary-only load (a
    fraction of a second); None where the file does not say."""
    silence_logs()  # the load that follows sets its own verbosity
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(path.encode(), params)
    if not model:
        return None  # the full load that follows says why
    try:
        buf = ctypes.create_string_buffer(32)
        found = ll.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf)) >= 0
    finally:
        ll.llama_model_free(model)
    return FILE_TYPES.get(int(buf.value)) if found and buf.value.isdigit() else None


def repacked_mib(lines: list[tuple[int, str]]) -> float:
    """MiB of weights llama.cpp moved to a repacking buffer (ggml's CPU_REPACK, or AMX's) while loading."""
    return sum(float(found[1]) for _, text in lines
               if (found := re.search(r"\b(?:CPU_REPACK|AMX) model buffer size\s*=\s*([\d.]+) MiB", text)))


def load_failure(path: str, lines: list[tuple[int, str]]) -> str:
    said = llama_said(lines)
    arch = gguf_architecture(path)
    version = f"llama.cpp {ll.llama_version().decode()} (llama-cpp-python {ll.__version__})"
    if arch is None:
        why = "its GGUF header cannot be read: the file is damaged or cut short"
    elif "unknown model architecture" in said:
        why = f"its architecture {arch!r} is unknown to {version}: a newer llama-cpp-python may know it"
    else:
        size, available = os.path.getsize(path), host_available()
        why = (f"its weights take {fmt_bytes(size)} and {fmt_bytes(available)} of memory is available"
               if available is not None and size > available else f"architecture {arch!r}, {fmt_bytes(size)}")
    return f"could not load a GGUF model from {path}: {why}" + (f" (llama.cpp: {said})" if said else "")


@dataclass(frozen=True)
class KvPlan:
    """The context about to be made: its cells, what a cell takes, and the memory it goes to."""

    n_ctx: int
    cell_bytes: int
    place: str  # "host memory" or the GPUs' names
    free: int | None  # bytes free there; None where unknown
    fits: int = 0  # the cells --fit makes (or would make) of that

    @property
    def kv_bytes(self) -> int:
        return self.n_ctx * self.cell_bytes

    def describe(self, options: LlamaCppConfig) -> str:
        return (f"n_ctx={self.n_ctx} cells for {options.n_seq_max} slots, K cache {options.cache_type_k}, "
                f"V cache {options.cache_type_v}, flash attention {options.flash_attn}: KV ~{fmt_bytes(self.kv_bytes)}"
                + (f", {fmt_bytes(self.free)} free in {self.place}" if self.free is not None else ""))


def plan_kv(model, options: LlamaCppConfig) -> KvPlan:
    """The cells to make (--ctx, its default, or what --fit leaves room for) and where they go: a GPU build with
    layers offloaded keeps them in device memory (already net of the weights there), else in host memory."""
    cell = kv_cell_bytes(model, options)
    n_ctx_train = ll.llama_model_n_ctx_train(model)
    gpus = accelerators() if ll.llama_supports_gpu_offload() and options.n_gpu_layers != 0 else []
    n_gpu, n_layers = options.n_gpu_layers, ll.llama_model_n_layer(model) + 1
    if gpus and 0 < n_gpu < n_layers:  # the KV split between host and GPUs: no one number to check it against
        place, free, reserved = "host memory and " + ", ".join(d.name for d in gpus), None, 0
    elif gpus:
        place, free, reserved = ", ".join(d.name for d in gpus), sum(d.free for d in gpus), 0
    else:
        place, free, reserved = "host memory", host_available() or _cpu_memory(), ll.llama_model_size(model)
    n_ctx = options.total_cells(n_ctx_train)
    if free is None:
        if options.fit:
            raise ValueError(f"--fit: the KV goes to {place}; it fits the context to one of them: offload every "
                             "layer or none (--n-gpu-layers)")
        return KvPlan(n_ctx, cell, place, free)
    reserved += 2 * options.n_batch * ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model)) * 4  # logits
    wanted = options.n_ctx or n_ctx_train * options.n_seq_max
    fits = fit_cells(free, reserved, cell, wanted, 1 if options.kv_unified else options.n_seq_max)
    if options.fit and fits == 0:
        raise ValueError(f"--fit: no context fits: {fmt_bytes(free)} free in {place}, {fmt_bytes(reserved)} taken "
                         f"by the weights and compute buffers, {fmt_bytes(cell)} a KV cell; lower --max-slots or "
                         "quantize the cache (--cache-type-k/-v q8_0)")
    return KvPlan(fits if options.fit else n_ctx, cell, place, free, fits)


def _cpu_memory() -> int | None:
    """ggml's CPU device memory, where the OS gave no MemAvailable (all of the memory, on POSIX)."""
    return next((d.free for d in devices() if d.is_cpu), None)


def new_context(model, options: LlamaCppConfig, plan: KvPlan, eval_callback=None):
    """The context; `eval_callback` (a ggml_backend_sched_eval_callback) sees every graph node computed."""
    if plan.free is not None and plan.kv_bytes > plan.free:
        # llama.cpp clears the whole cache when it makes it: past the memory there is, the process is killed.
        raise ValueError(f"the KV cache does not fit: {plan.describe(options)}; {KV_FIXES}")
    params = ll.llama_context_default_params()
    threads = options.n_threads or os.cpu_count() or 1
    params.n_ctx = plan.n_ctx
    params.n_batch = params.n_ubatch = options.n_batch  # one decode = one compute graph
    params.n_seq_max = options.n_seq_max
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = options.kv_unified
    params.n_outputs_max_per_seq = options.max_outputs_per_seq
    params.type_k, params.type_v = ggml_type(options.cache_type_k), ggml_type(options.cache_type_v)
    params.flash_attn_type = FLASH_ATTN_TYPES[options.flash_attn]
    params.no_perf = True
    if eval_callback is not None:
        params.cb_eval = eval_callback
    logs = llama_logs(options.verbose)
    mark = logs.count
    ctx = ll.llama_init_from_model(model, params)
    if not ctx:
        said = llama_said(logs.since(mark))
        raise ValueError(f"could not create a llama.cpp context ({plan.describe(options)})"
                         + (f": llama.cpp: {said}" if said else f"; {KV_FIXES}"))
    return ctx


def flash_attention(lines: list[tuple[int, str]], asked: str) -> str:
    """What llama.cpp made of --flash-attn, from the lines it logged while making the context."""
    text = "\n".join(t for _, t in lines)
    found = re.findall(r"flash.?att(?:n|ention)\w*\b[^\n]*?\b(enabled|disabled)\b", text, re.I)
    return found[-1].lower() if found else asked


def offloaded_layers(model, options: LlamaCppConfig, lines: list[tuple[int, str]]) -> tuple[int, int]:
    """(layers offloaded, of all): llama.cpp's own count where it logged one, else what was asked of it."""
    for _, text in reversed(lines):
        found = re.search(r"offloaded (\d+)/(\d+) layers", text)
        if found:
            return int(found[1]), int(found[2])
    total = ll.llama_model_n_layer(model) + 1  # llama.cpp counts the output layer as one more
    if not ll.llama_supports_gpu_offload() or not accelerators():
        return 0, total
    return (total if options.n_gpu_layers < 0 else min(options.n_gpu_layers, total)), total


def model_desc(model) -> str:
    buf = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, buf, len(buf))
    return buf.value.decode(errors="replace")


def load_line(model, ctx, options: LlamaCppConfig, plan: KvPlan, lines: list[tuple[int, str]], build: str,
              repack: RepackChoice) -> str:
    """What was loaded, where, and what it takes: the one line every face logs at load."""
    done, total = offloaded_layers(model, options, lines)
    n_ctx, per_slot, slots = ll.llama_n_ctx(ctx), ll.llama_n_ctx_seq(ctx), ll.llama_n_seq_max(ctx)
    layout = "one pool any slot may fill" if options.kv_unified else "a stream per slot"
    line = (f"loaded {model_desc(model)} ({build}): {done}/{total} layers offloaded to a GPU, weights "
            f"{fmt_bytes(ll.llama_model_size(model))}, KV {fmt_bytes(n_ctx * plan.cell_bytes)} ({n_ctx} cells x "
            f"{plan.cell_bytes} B, K {options.cache_type_k} / V {options.cache_type_v}, {layout}), "
            f"{per_slot} tokens of context per slot x {slots} slots, flash attention "
            f"{flash_attention(lines, options.flash_attn)}")
    line += ", " + repack_phrase(repack, lines)
    if per_slot > (n_ctx_train := ll.llama_model_n_ctx_train(model)):
        line += f" (past the model's training context of {n_ctx_train}: expect worse text there)"
    if plan.free is not None:
        fit = "--fit made" if options.fit else "--fit would make"
        line += f"; {fmt_bytes(plan.free)} free in {plan.place} ({fit} {plan.fits} cells)"
    return line


def repack_phrase(choice: RepackChoice, lines: list[tuple[int, str]]) -> str:
    """Whether the weights were repacked, and why (or why not), from llama.cpp's load lines."""
    if mib := repacked_mib(lines):
        return f"weights repacked for the CPU ({mib:.0f} MiB of them: {choice.why})"
    if choice.on:  # Q4_1, Q5_0, Q8_0 and the rest keep their layout (repack.py)
        return f"weights not repacked (none of this model's types repacks on this CPU; {choice.why})"
    return f"weights not repacked ({choice.why})"
