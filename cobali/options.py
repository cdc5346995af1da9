"""Engine flags shared by every face (run, bench, serve), and building an engine from them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from cobali.backends.base import Backend
from cobali.costs import CostProfile, load_profile
from cobali.engine.engine import Engine, EngineConfig
from cobali.engine.policies import BATCH_POLICIES, KV_POLICIES
from cobali.engine.queue import QUEUE_ORDERS


def number_type(cast: Callable[[str], float], minimum: float, what: str) -> Callable[[str], float]:
    """An argparse `type` that names the bad value: int/float parsing with a lower bound (NaN rejected)."""

    def parse(text: str):
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
    parser.add_argument("--max-slots", type=positive_int, default=16, help="concurrent sequences (KV slots)")
    parser.add_argument("--n-batch", type=positive_int, default=512, help="token budget of one decode call")
    parser.add_argument("--ctx", type=non_negative_int, default=0,
                        help="total KV cells (like llama-server -c); 0 = 2048 per slot")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="CPU threads (0 = all cores)")
    parser.add_argument("--kv-unified", action="store_true",
                        help="one KV buffer shared by all sequences instead of per-sequence streams")
    parser.add_argument("--n-gpu-layers", type=int, default=-1,
                        help="layers to offload in a GPU build (-1 = all when offload is available)")


def add_engine_args(parser: argparse.ArgumentParser, itl_target_ms: float = 0.0) -> None:
    """Engine flags. `itl_target_ms`: the face's default ITL target (0: the paper's fixed budget)."""
    add_backend_args(parser)
    parser.add_argument("--prefill-chunk-tokens", type=positive_int, default=512,
                        help="longest prefill chunk per request per tick (cont mode)")
    parser.add_argument("--policy", choices=BATCH_POLICIES, default="decode-max",
                        help="how decode rows and prefill chunks share a tick")
    parser.add_argument("--kv-admission", choices=KV_POLICIES, default="reserve",
                        help="reserve: admit only what fits to max_tokens; optimistic: admit on prompt, preempt")
    parser.add_argument("--queue", choices=QUEUE_ORDERS, default="fifo",
                        help="waiting order (priority: lower `priority` first)")
    parser.add_argument("--itl-target-ms", type=non_negative_float, default=itl_target_ms,
                        help="adaptive chunking: size each tick's prefill to keep the predicted tick under this "
                             f"(0 = fixed budget: --n-batch and --prefill-chunk-tokens; default {itl_target_ms:g})")
    parser.add_argument("--profile", default=None,
                        help="cost profile (`cobali calibrate`'s JSON or a bundled name): seeds the tick costs an ITL "
                             "target learns online (default: learn from scratch); `cobali simulate` runs on it "
                             "(default there: this CPU's bundled profile)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="do not reuse KV of earlier prompts sharing a prefix")


def build_backend(args: argparse.Namespace) -> Backend:
    from cobali.backends.llama_cpp import LlamaCppBackend, LlamaCppOptions
    from cobali.model import embedded_model_path

    if args.n_batch < args.max_slots:
        raise ValueError(f"--n-batch ({args.n_batch}) must be >= --max-slots ({args.max_slots})")
    options = LlamaCppOptions(
        model_path=args.model or embedded_model_path(),
        n_ctx=args.ctx,
        n_seq_max=args.max_slots,
        n_batch=args.n_batch,
        n_threads=args.threads,
        kv_unified=args.kv_unified,
        n_gpu_layers=args.n_gpu_layers,
    )
    return LlamaCppBackend(options)


def engine_config(args: argparse.Namespace, mode: str = "cont", **overrides) -> EngineConfig:
    return EngineConfig(mode=mode, max_slots=args.max_slots, prefill_chunk_tokens=args.prefill_chunk_tokens,
                        n_batch=args.n_batch, policy=args.policy, kv_admission=args.kv_admission,
                        queue=args.queue, prefix_cache=args.prefix_cache, itl_target_ms=args.itl_target_ms,
                        **overrides)


def load_costs(args: argparse.Namespace, backend: Backend | None = None) -> CostProfile | None:
    """The --profile that seeds the tick costs an ITL target learns online; None without a target or a
    profile (the engine then learns from scratch). A profile measured on another device or model still
    runs, with a note: its first predictions are off until the engine has re-learned them."""
    if args.itl_target_ms <= 0 or args.profile is None:
        return None
    profile = load_profile(args.profile)
    if backend is not None and profile.device != backend.info.description:
        print(f"note: the cost profile is for '{profile.device}', not '{backend.info.description}'; "
              "the engine re-learns its tick costs over the first ticks", file=sys.stderr)
    return profile


def build_engine(args: argparse.Namespace, backend: Backend | None = None, mode: str = "cont",
                 **overrides) -> Engine:
    config = engine_config(args, mode, **overrides)
    backend = backend or build_backend(args)
    return Engine(backend, config, costs=load_costs(args, backend))
