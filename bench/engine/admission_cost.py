"""µs per admission on the slot pool (SlotPool.release then SlotPool.assign) against the slot count (issue 46).

    .venv/bin/python bench/engine/admission_cost.py                     # 16 to 4096 slots, every layout and mix
    .venv/bin/python bench/engine/admission_cost.py --slots 16 256 --cycles 200 --json out.json

Half the slots run and the other half are free, each of those holding a cached prefix (as after a burst of
chats); a cycle releases a random running slot, its KV kept, and admits a new request into the pool (its KV
operations taken, its cells held, as the scheduler does). Mixes of the new requests:
  nocache  no prefix cache: only which free slot
  cold     a new chat each, sharing nothing cached: the free slot whose cached prefix is worth least
  follow   a chat's next turn (a chat starts again after 8): its prefix is in a free slot, reused or copied
  system   one 256-token system prompt opens every prompt, and every cached prefix: all of them match as much
Layouts: per-sequence KV streams, compacted (the server's default), and a unified KV. Each figure is the best
of --repeats runs of --cycles cycles. Only SlotPool's public methods are used, so the same file measures an
older checkout: PYTHONPATH=/path/to/old/checkout .venv/bin/python bench/engine/admission_cost.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from cobali.backends.base import BackendInfo
from cobali.engine.kv import SlotPool

MIXES = ("nocache", "cold", "follow", "system")
LAYOUTS = ("streams", "unified")
PROMPT, OUTPUT, SYSTEM, TURNS = 48, 16, 256, 8
VOCAB = 30_000


@dataclass
class Row:
    layout: str
    mix: str
    slots: int
    cycle_us: float  # release + assign + taking the KV ops and holding the cells
    assign_us: float


class Workload:
    """The requests of one mix: each request's prompt, and the KV it leaves when it ends."""

    def __init__(self, mix: str, rng: random.Random) -> None:
        self.mix, self.rng = mix, rng
        self.system = self._tokens(SYSTEM)
        self.idle: list[list[int]] = []  # chats whose last turn ended: their KV is cached, if still anywhere

    def _tokens(self, n: int) -> list[int]:
        return self.rng.choices(range(1, VOCAB), k=n)

    def prompt(self) -> list[int]:
        if self.mix == "system":
            return self.system + self._tokens(PROMPT)
        if self.mix == "follow" and self.idle:
            chat = self.idle.pop(self.rng.randrange(len(self.idle)))
            if len(chat) < TURNS * (PROMPT + OUTPUT):
                return chat + self._tokens(PROMPT)
        return self._tokens(PROMPT)

    def ended(self, prompt: list[int]) -> list[int]:
        kv = prompt + self._tokens(OUTPUT)
        self.idle.append(kv)
        return kv


def make_pool(layout: str, mix: str, slots: int) -> SlotPool:
    ctx = 4096
    info = BackendInfo(n_vocab=VOCAB, n_ctx=ctx * slots, n_ctx_seq=ctx * slots if layout == "unified" else ctx,
                       n_seq_max=slots, n_batch=512, kv_unified=layout == "unified", description="bench")
    return SlotPool(info, slots, prefix_cache=mix != "nocache", compact=True)


def admit(pool: SlotPool, prompt: list[int]) -> tuple[int, int]:
    """Assign a slot to `prompt` as the scheduler does: the slot and the ns the assign took."""
    start = time.perf_counter_ns()
    slot = pool.assign(prompt).slot
    took = time.perf_counter_ns() - start
    pool.take_kv_ops()
    pool.accountant.hold(slot, len(prompt) + OUTPUT)
    return slot, took


def measure(layout: str, mix: str, slots: int, cycles: int, repeats: int, seed: int) -> Row:
    rng = random.Random(seed)
    work, pool = Workload(mix, rng), make_pool(layout, mix, slots)
    prompts = {admit(pool, p)[0]: p for p in [work.prompt() for _ in range(slots)]}
    for slot in rng.sample(sorted(prompts), slots // 2):
        pool.release(slot, work.ended(prompts.pop(slot)))
    running = list(prompts)
    best_cycle = best_assign = float("inf")
    for _ in range(repeats):
        cycle_ns = assign_ns = 0
        for _ in range(cycles):
            i, prompt = rng.randrange(len(running)), work.prompt()  # the workload's own time is not counted
            ending, running[i] = running[i], running[-1]
            kv = work.ended(prompts.pop(ending))
            start = time.perf_counter_ns()
            pool.release(ending, kv)
            slot, took = admit(pool, prompt)
            cycle_ns += time.perf_counter_ns() - start
            assign_ns += took
            running[-1], prompts[slot] = slot, prompt
        best_cycle, best_assign = min(best_cycle, cycle_ns / cycles / 1e3), min(best_assign, assign_ns / cycles / 1e3)
    return Row(layout, mix, slots, round(best_cycle, 2), round(best_assign, 2))


def table(rows: list[Row], slots: list[int], field: str) -> str:
    lines = [f"{field:<20}" + "".join(f"{n:>10}" for n in slots)]
    for layout in LAYOUTS:
        for mix in MIXES:
            values = {r.slots: getattr(r, field) for r in rows if (r.layout, r.mix) == (layout, mix)}
            if values:
                lines.append(f"{layout + ' ' + mix:<20}" + "".join(f"{values[n]:>10.1f}" for n in slots))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if min(args.slots) < 2 or args.cycles < 1 or args.repeats < 1:
        parser.error("--slots must be >= 2, --cycles and --repeats >= 1")
    rows = [measure(layout, mix, n, args.cycles, args.repeats, args.seed)
            for layout in args.layouts for mix in args.mixes for n in args.slots]
    print(table(rows, args.slots, "cycle_us"), "", table(rows, args.slots, "assign_us"), sep="\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
