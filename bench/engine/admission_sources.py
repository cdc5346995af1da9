"""µs the scheduler spends admitting one request while hundreds run on one system prompt (issue 46).

    .venv/bin/python bench/engine/admission_sources.py                  # 16 to 2048 slots
    PYTHONPATH=/path/to/old/checkout .venv/bin/python bench/engine/admission_sources.py   # an older checkout

Every running request opens with the same 256-token system prompt and goes on with 48 tokens of its own, as a
burst of chats on one agent does. A new one can copy the system prompt's KV from any of them; it cannot find all
of its prompt anywhere, so a search that reads every running request's keys reads them all. A cycle ends one
running request (its KV dropped, so no free slot caches a prefix: the running ones are the only sources) and
admits a new one in the next tick. The figure is that tick's time less the next one's (no admission), the
median of --cycles cycles, the best of --repeats runs. Only the scheduler's public methods are used.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cobali.backends.base import BackendInfo
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.scheduler import Scheduler

SYSTEM, OWN, VOCAB, CELLS = 256, 48, 30_000, 1024


class Cluster:
    """One scheduler with every slot but one running, and the requests it runs."""

    def __init__(self, slots: int, rng: random.Random) -> None:
        info = BackendInfo(n_vocab=VOCAB, n_ctx=CELLS * slots, n_ctx_seq=CELLS, n_seq_max=slots,
                           n_batch=slots * (SYSTEM + OWN), kv_unified=False, description="bench")
        config = EngineConfig(max_slots=slots, n_batch=info.n_batch, prefill_chunk_tokens=info.n_batch)
        self.scheduler = Scheduler(config, SlotPool(info, slots, prefix_cache=True))
        self.rng = rng
        self.system = rng.choices(range(1, VOCAB), k=SYSTEM)
        self.next_id = 0
        for _ in range(slots - 1):
            self.scheduler.add(self.new_request())
        while any(r.computed_tokens < len(r.prompt_tokens) for r in self.scheduler.running) or self.scheduler.waiting:
            self.tick()

    def new_request(self) -> Request:
        self.next_id += 1
        prompt = self.system + self.rng.choices(range(1, VOCAB), k=OWN)
        return Request(self.next_id, prompt, SamplingParams(max_tokens=10**6, ignore_eos=True))

    def tick(self) -> int:
        """One tick planned and its tokens taken as the engine would; the ns the planning took."""
        start = time.perf_counter_ns()
        plan = self.scheduler.schedule()
        took = time.perf_counter_ns() - start
        by_id = {r.id: r for r in self.scheduler.running}
        for chunk in plan.chunks:
            if chunk.yields_token:
                by_id[chunk.request_id].add_token(7)
        return took

    def admission_us(self, cycles: int) -> float:
        """The median over cycles of a tick with the admission less the next tick's, in µs: the difference is a
        small part of a tick of thousands of rows, so a sum would carry every slow moment's noise."""
        differences = []
        for _ in range(cycles):
            ending = self.scheduler.running[self.rng.randrange(len(self.scheduler.running))]
            self.scheduler.remove(ending)
            self.scheduler.add(self.new_request())
            admitting = self.tick()
            differences.append(admitting - self.tick())  # the new one's prompt is done: the same rows, no admission
        return statistics.median(differences) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.slots) < 2 or args.cycles < 1 or args.repeats < 1:
        parser.error("--slots must be >= 2, --cycles and --repeats >= 1")
    print(f"{'slots':>6} {'µs per admission':>18}")
    for slots in args.slots:
        cluster = Cluster(slots, random.Random(args.seed))
        best = min(cluster.admission_us(args.cycles) for _ in range(args.repeats))
        print(f"{slots:>6} {best:>18.1f}")


if __name__ == "__main__":
    main()
