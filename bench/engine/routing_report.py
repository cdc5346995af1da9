"""What one routing report (issue 47: EngineCore.routing_report, a ReadRoutingReport call's answer) costs the
engine's tick thread: hashing what the engine holds (engine/prefix_digest.py), its load, and the answer's msgpack.

    .venv/bin/python bench/engine/routing_report.py        # 256 slots of 2048-token prefixes, 256 in host memory
    .venv/bin/python bench/engine/routing_report.py --slots 4 --prefix-tokens 128 --host-prefixes 2    # smallest

Two states of one engine, on the simulator's backend (model-free, its KV bookkeeping the fake's):
  idle  every slot's KV cached (a distinct prompt of --prefix-tokens each), --host-prefixes more in host memory
  busy  then as many requests again, each a cached prefix's next turn, decoding: the running requests' keys are
        made anew for each report, and hashed again (the cached arrays' hashes come from the last report)
One core answers every report, as a server's does: a report reuses the hashes of the arrays the last one saw (the
idle state's first report hashes everything; the busy state's first, what changed).
"""

from __future__ import annotations

import argparse
import random
import time

from cobali.engine.core import EngineCore
from cobali.engine.costs import CostProfile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.messages import ENCODER, CallDone
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.sim.backend import SimBackend

HOST_TOKENS_PER_MIB = 2**20 // 4  # the fake backend's KV: 4 bytes a token
PROFILE = CostProfile(t0_s=0.001, prefill_s_per_token=1e-5, decode_s_per_row=1e-4, decode_s_per_kv_token=0.0)


def build(args: argparse.Namespace) -> tuple[Engine, list[list[int]]]:
    """An engine whose slots hold a prefix each, and host memory --host-prefixes more; those slots' prompts."""
    rng = random.Random(0)
    backend = SimBackend(PROFILE, n_seq_max=args.slots, n_ctx_seq=2 * args.prefix_tokens + 64, n_batch=2048)
    host_mib = -(-(args.host_prefixes + 1) * args.prefix_tokens // HOST_TOKENS_PER_MIB)
    engine = Engine(backend, EngineConfig(max_slots=args.slots, n_batch=2048, host_cache_mib=host_mib,
                                          record_ticks=False), clock=backend.clock)
    prompts = [[rng.randrange(1, backend.n_vocab) for _ in range(args.prefix_tokens)]
               for _ in range(args.host_prefixes + args.slots)]
    for start in range(0, len(prompts), args.slots):  # a slot's prefix goes to host memory as the next takes it
        LLM(engine).generate(prompts[start : start + args.slots], SamplingParams(max_tokens=1, ignore_eos=True))
    return engine, prompts[-args.slots :]


def timed(core: EngineCore, args: argparse.Namespace, repeats: int) -> tuple[float, int, int, int]:
    """The best of `repeats` reports' ms (the first's when 1), the blocks the last hashed, its hashes, its bytes."""
    builder = core.digest_builder(args.block_tokens, args.max_blocks)  # the one the reports use: its count
    best = float("inf")
    for _ in range(repeats):
        before = builder.hashed_blocks
        start = time.perf_counter()
        report = core.routing_report(args.block_tokens, args.max_blocks)
        best = min(best, time.perf_counter() - start)
    size = len(ENCODER.encode(CallDone(0, report=report)))
    return best * 1e3, builder.hashed_blocks - before, len(report.hashes), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--host-prefixes", type=int, default=256)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--max-blocks", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine, prompts = build(args)
    print(f"{args.slots} slots, {args.prefix_tokens}-token prefixes, {args.host_prefixes} in host memory; blocks of "
          f"{args.block_tokens}, at most {args.max_blocks}")
    print(f"{'state':>5} {'report':>7} {'ms':>8} {'hashed':>7} {'hashes':>7} {'bytes':>8}")
    core = EngineCore(engine, lambda message: None)  # its reports' digests go on from one state to the next
    for state in ("idle", "busy"):
        if state == "busy":  # each slot's next turn: its cached prefix reused, then decoding
            for prompt in prompts:
                engine.add_request([*prompt, 1, 2, 3], SamplingParams(max_tokens=1_000_000, ignore_eos=True))
            while engine.n_running < args.slots or engine.waiting_tokens():
                engine.step()
        for name, repeats in (("first", 1), ("repeat", args.repeats)):
            ms, hashed, n_hashes, size = timed(core, args, repeats)
            print(f"{state:>5} {name:>7} {ms:>8.2f} {hashed:>7} {n_hashes:>7} {size:>8}")
        print(f"{state:>5} load: kv_use {engine.kv_use():.2f}, waiting_tokens {engine.waiting_tokens()}, "
              f"running {engine.n_running}, waiting {engine.n_queued}")

if __name__ == "__main__":
    main()
