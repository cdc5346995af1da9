"""Flags shared by the faces (engine, backend, workload), and the typed configs built from them."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import TypeVar

from cobali.backends.hf_model import HF_EXTRA, resolve_hf_model
from cobali.backends.llama_cpp.config import FLASH_ATTN_MODES, KV_CACHE_TYPES, LlamaCppConfig
from cobali.engine.engine_config import EngineConfig
from cobali.engine.policies import BATCH_POLICIES, KV_POLICIES
from cobali.engine.queue import QUEUE_ORDERS
from cobali.engine.setup import EngineSetup
from cobali.engine.speculative import SpecConfig
from cobali.harness.workloads import WorkItem, load_items

Number = TypeVar("Number", int, float)


def number_type(cast: Callable[[str], Number], minimum: Number, what: str) -> Callable[[str], Number]:
    """An argparse `type` that names the bad value: int/float parsing with a lower bound (NaN rejected)."""

    def parse(text: str) -> Number:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


positive_int = number_type(int, 1, "a positive integer")
non_negative_int = number_type(int, 0, "an integer >= 0")
positive_float = number_type(float, 1e-300, "a number > 0")
non_negative_float = number_type(float, 0.0, "a number >= 0")


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--hf-repo", default=None, metavar="OWNER/NAME[:QUANT]",
                        help="a GGUF from a Hugging Face repository instead of --model, fetched into huggingface_hub's "
                             "cache and picked as llama-server's -hf picks it: the file whose name holds QUANT, "
                             f"without one Q4_K_M, else Q8_0, else the first (the hf extra: {HF_EXTRA})")
    parser.add_argument("--hf-file", default=None, metavar="FILE", help="with --hf-repo: this file of the repository")
    parser.add_argument("--max-slots", type=positive_int, default=16, help="concurrent sequences (KV slots)")
    parser.add_argument("--n-batch", type=positive_int, default=512, help="token budget of one decode call")
    parser.add_argument("--ctx", type=non_negative_int, default=0,
                        help="total KV cells (like llama-server -c); 0 = 2048 per slot")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="CPU threads (0 = all cores)")
    parser.add_argument("--kv-unified", action="store_true",
                        help="one KV buffer shared by all sequences instead of per-sequence streams")
    parser.add_argument("--n-gpu-layers", type=int, default=-1,
                        help="layers to offload in a GPU build (-1 = all when offload is available)")
    parser.add_argument("--backend-sampling", action="store_true",
                        help="pick greedy tokens inside llama.cpp's graph (its experimental backend sampling) "
                             "for requests that ask no logprobs: their logits never reach the host")
    parser.add_argument("--cache-type-k", choices=tuple(KV_CACHE_TYPES), default="f16",
                        help="KV cache type of K, as llama-server's (q8_0: ~0.53x the bytes of f16, q4_0: ~0.28x)")
    parser.add_argument("--cache-type-v", choices=tuple(KV_CACHE_TYPES), default="f16",
                        help="KV cache type of V; a quantized one needs flash attention (auto turns it on)")
    parser.add_argument("--flash-attn", choices=FLASH_ATTN_MODES, default="auto",
                        help="llama.cpp's flash attention: auto lets it decide per device (default %(default)s)")
    parser.add_argument("--fit", action="store_true",
                        help="size the KV context to the memory there is: --ctx, or without it the model's training "
                             "context for every slot, cut to what free memory (a GPU's, when layers are offloaded) "
                             "holds beside the weights, with a margin; the load line says what it made")
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                        help="repack Q4_0/Q4_K weights for the CPU's tiled matmul, as llama-server does by default "
                             "(about 2x prefill); default: on unless the CPU or llama.cpp build has AMX, whose "
                             "matmul segfaulted on Sapphire Rapids (the load line says which)")
    parser.add_argument("--verbose", action="store_true", help="let llama.cpp's own log lines through to stderr")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags; every face defaults to the fixed budget (see --itl-target-ms)."""
    add_backend_args(parser)
    parser.add_argument("--prefill-chunk-tokens", type=positive_int, default=512,
                        help="longest prefill chunk per request per tick (cont mode)")
    parser.add_argument("--policy", choices=BATCH_POLICIES, default="decode-max",
                        help="how decode rows and prefill chunks share a tick")
    parser.add_argument("--kv-admission", choices=KV_POLICIES, default="reserve",
                        help="reserve: admit only what fits to max_tokens; optimistic: admit on prompt, preempt")
    parser.add_argument("--queue", choices=QUEUE_ORDERS, default="fifo",
                        help="waiting order (priority: lower `priority` first; srpf: shortest remaining prompt "
                             "first with aging, also for prompts being prefilled)")
    parser.add_argument("--itl-target-ms", type=non_negative_float, default=0.0,
                        help="adaptive chunking: size each tick's prefill to keep the predicted tick under this, "
                             "for a lower ITL tail under load at the cost of TTFT (default 0 = fixed budget: "
                             "--n-batch and --prefill-chunk-tokens, prompts whole as llama-server takes them)")
    parser.add_argument("--tpot-slo-ms", type=non_negative_float, default=0.0,
                        help="deadline budget: size each tick's prefill so every decoding request keeps its next "
                             "token on a schedule of one per this many ms since its first, and never below what "
                             "--itl-target-ms allows (0 there: no floor; 0 here = off)")
    parser.add_argument("--itl-max-ms", type=non_negative_float, default=0.0,
                        help="with --tpot-slo-ms: no gap between two tokens longer than this, whatever slack a "
                             "request banked (0 = only the schedule and --n-batch bound it)")
    parser.add_argument("--profile", default=None,
                        help="cost profile (`cobali calibrate`'s JSON or a bundled name): seeds the tick costs an ITL "
                             "target learns online (default: learn from scratch); `cobali simulate` runs on it "
                             "(default there: this CPU's bundled profile)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="do not reuse KV of earlier prompts sharing a prefix")
    # The default is resolved in engine_config, not here: building the parser (--help included) must not ask
    # the OS anything, and os.sysconf does not exist on Windows.
    parser.add_argument("--host-cache-mib", type=non_negative_int, default=None,
                        help="host memory (MiB) for cached prefixes evicted from their KV slots: a prompt that "
                             "shares one later restores it (~1 ms) instead of prefilling it again, like "
                             "llama-server's --cache-ram (default 8192, at most a quarter of this machine's "
                             "memory where the OS reports it; per engine: each of --replicas has its own; 0 = off)")
    parser.add_argument("--no-compact-slots", dest="compact_slots", action="store_false",
                        help="leave a gap when a slot between running ones frees (per-sequence KV "
                             "streams: every gap in the running slots costs llama.cpp one more forward pass a tick)")
    parser.add_argument("--two-pass-ticks", action=argparse.BooleanOptionalAction, default=False,
                        help="per-sequence KV streams: a prompt chunk joins a tick only where llama.cpp still runs "
                             "it in two forward passes (default off: every chunk the tick's budget allows)")
    parser.add_argument("--num-speculative-tokens", type=non_negative_int, default=0,
                        help="speculative decoding by prompt lookup (vLLM's ngram method): up to this many tokens "
                             "guessed from a greedy request's own context ride behind its decode row, and those the "
                             "model agrees with are kept; the output is what greedy decoding gives (0 = off)")
    parser.add_argument("--prompt-lookup-min", type=positive_int, default=2,
                        help="shortest run of last tokens a guess is looked up by (default %(default)s)")
    parser.add_argument("--prompt-lookup-max", type=positive_int, default=4,
                        help="longest run of last tokens a guess is looked up by, tried first (default %(default)s)")
    parser.add_argument("--speculative-max-batch", type=positive_int, default=1,
                        help="guess only in ticks with at most this many decoding requests (default 1: on this "
                             "CPU a guessed row costs what a prompt token does, which pays only for a lone request)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="plan and fill the next batch while the current decode runs (for a GPU, whose decode "
                             "leaves the host idle; on CPU the host work competes with the kernels). A request "
                             "that stops on a stop string or end of generation rides one extra row")


def default_host_cache_mib() -> int:
    """llama-server's --cache-ram default, but never more than a quarter of the memory: the tier fills as prompts
    come and go, and a small machine would run out long before 8 GiB of them. Where the OS does not report its
    memory (no os.sysconf on Windows), llama-server's default as it is."""
    sysconf = getattr(os, "sysconf", None)
    if sysconf is None:
        return 8192
    try:
        physical_mib = sysconf("SC_PHYS_PAGES") * sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError):  # not reported here
        return 8192
    return min(8192, physical_mib // 4)


def model_path(args: argparse.Namespace) -> str | None:
    """--model, or the file --hf-repo names: resolved here, at the edge, so every config built from the flags (and
    each of --replicas) loads the same local file."""
    if args.hf_repo is None:
        if args.hf_file is not None:
            raise ValueError("--hf-file needs --hf-repo")
        return args.model
    if args.model is not None:
        raise ValueError("--model and --hf-repo are exclusive")
    return _hf_model(args.hf_repo, args.hf_file)


@functools.lru_cache(maxsize=8)
def _hf_model(spec: str, hf_file: str | None) -> str:
    return resolve_hf_model(spec, hf_file)  # once a process: a face may build several configs from its flags


def backend_config(args: argparse.Namespace, n_seq_max: int | None = None) -> LlamaCppConfig:
    """llama.cpp's settings from the flags; n_seq_max: sequences to size it for (default --max-slots)."""
    return LlamaCppConfig(model_path=model_path(args), n_ctx=args.ctx, n_seq_max=n_seq_max or args.max_slots,
                          n_batch=args.n_batch, n_threads=args.threads, kv_unified=args.kv_unified,
                          n_gpu_layers=args.n_gpu_layers, backend_sampling=args.backend_sampling,
                          cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, flash_attn=args.flash_attn,
                          fit=args.fit, verbose=args.verbose, repack=args.repack,
                          # calibrate takes no engine flags, and guesses nothing; only serve loads adapters
                          max_outputs_per_seq=1 + getattr(args, "num_speculative_tokens", 0),
                          lora_paths=tuple(path for _, path in getattr(args, "lora_modules", ())))


def host_cache_mib(args: argparse.Namespace) -> int:
    """--host-cache-mib, or its default for this machine when not given."""
    return default_host_cache_mib() if args.host_cache_mib is None else args.host_cache_mib


def engine_config(args: argparse.Namespace, mode: str = "cont", **overrides) -> EngineConfig:
    return EngineConfig(mode=mode, max_slots=args.max_slots, prefill_chunk_tokens=args.prefill_chunk_tokens,
                        n_batch=args.n_batch, policy=args.policy, kv_admission=args.kv_admission,
                        queue=args.queue, prefix_cache=args.prefix_cache, host_cache_mib=host_cache_mib(args),
                        compact_slots=args.compact_slots, two_pass_ticks=args.two_pass_ticks,
                        itl_target_ms=args.itl_target_ms,
                        tpot_slo_ms=args.tpot_slo_ms, itl_max_ms=args.itl_max_ms,
                        async_scheduling=args.async_scheduling, spec=SpecConfig(
                            args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max,
                            args.speculative_max_batch),
                        lora_updates=getattr(args, "allow_runtime_lora_updating", False), **overrides)


def engine_setup(args: argparse.Namespace, mode: str = "cont", **overrides) -> EngineSetup:
    """The typed configs of one engine from the flags: the only place engine flags are read."""
    return EngineSetup(engine_config(args, mode, **overrides), backend_config(args), args.profile)


# ---- workload flags (bench, simulate) ----------------------------------------------------------------


def add_load_args(parser: argparse.ArgumentParser, prompts_required: bool = False) -> None:
    parser.add_argument("--prompts", required=prompts_required,
                        help="prompts file (.txt/.jsonl/.json) or a scenario name (e.g. mixed_length)")
    parser.add_argument("--num-prompts", type=positive_int, default=None,
                        help="use the first N prompts of the file; the count of random prompts (default 100)")
    parser.add_argument("--max-new", type=positive_int, default=64, help="max new tokens per request")
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="open-loop arrivals per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="gamma shape of inter-arrival times; 1 = Poisson, < 1 burstier")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed for arrivals and random prompts")
    parser.add_argument("--out", default=None, help="directory for summary.json, request records and plots")


def add_random_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--random-input-len", type=positive_int, default=None, help="random token prompts")
    parser.add_argument("--random-output-len", type=positive_int, default=None,
                        help="max new tokens of random prompts (default --max-new)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random lengths uniform in [len*(1-r), len*(1+r)]")


def file_items(args: argparse.Namespace) -> list[WorkItem] | None:
    """The prompts file's items, or None for a random workload (drawn once the vocabulary is known)."""
    if args.random_input_len is None:
        if args.prompts is None:
            raise ValueError("give --prompts FILE|SCENARIO or --random-input-len N")
        return load_items(args.prompts, args.num_prompts)
    if args.prompts is not None:
        raise ValueError("--prompts and --random-input-len are exclusive")
    return None


def flags_record(args: argparse.Namespace) -> dict:
    """The flags as JSON can hold them: no Infinity (the default request rate is written as "inf")."""
    return {k: "inf" if v == float("inf") else v for k, v in vars(args).items() if k != "func"}
