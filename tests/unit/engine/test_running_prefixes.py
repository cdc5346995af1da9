"""An admission finds a running request to copy a prefix from in one bucket, and reads a bounded number of them."""

from __future__ import annotations

from cobali.engine.plan import CopyPrefix
from cobali.engine.request import Request
from cobali.engine.running_prefixes import MAX_LOOKS, MAX_SOURCES, RunningPrefixes
from cobali.engine.sampling_params import SamplingParams
from tests.unit.engine.test_scheduler_plan import SYSTEM, executed, make_scheduler, request


def running(request_id: int, tokens: list[int], computed: int | None = None, salt: str | None = None,
            lora: int = 0) -> Request:
    made = Request(request_id, tokens, SamplingParams(cache_salt=salt), lora=lora)
    made.slot = request_id
    made.computed_tokens = len(tokens) if computed is None else computed
    return made


def test_sources_share_the_first_tokens_salt_and_adapter() -> None:
    index = RunningPrefixes(16)
    sources = [running(0, [*SYSTEM, 1]), running(1, [*SYSTEM, 2], salt="tenant"), running(2, [*SYSTEM, 3], lora=1),
               running(3, [9, *SYSTEM]), running(4, SYSTEM[:8])]  # the last: too short to lend
    for source in sources:
        index.add(source)
    assert [r.id for r in index.sources_for(running(9, [*SYSTEM, 5]), skip=())] == [0]
    assert [r.id for r in index.sources_for(running(9, [*SYSTEM, 5], salt="tenant"), skip=())] == [1]
    assert [r.id for r in index.sources_for(running(9, [*SYSTEM, 5], lora=1), skip=())] == [2]
    assert list(index.sources_for(running(9, SYSTEM[:8]), skip=())) == []
    assert list(index.sources_for(running(9, [*SYSTEM, 5]), skip=(0,))) == [], "admitted this tick: no KV yet"
    index.discard(sources[0])
    assert list(index.sources_for(running(9, [*SYSTEM, 5]), skip=())) == []


def test_an_admission_reads_a_bounded_number_of_sources_however_many_share_its_head() -> None:
    index = RunningPrefixes(16)
    for i in range(4096):
        index.add(running(i, [*SYSTEM, i]))
    assert len(list(index.sources_for(running(5000, [*SYSTEM, 1, 2]), skip=()))) == MAX_SOURCES
    for i in range(4096):  # none can lend yet: the look stops all the same
        index.discard(running(i, [*SYSTEM, i]))
        index.add(running(i, [*SYSTEM, i], computed=0))
    looked = 0

    class Counting(list[int]):
        def __contains__(self, item: object) -> bool:
            nonlocal looked
            looked += 1
            return False

    assert list(index.sources_for(running(5000, [*SYSTEM, 1, 2]), skip=Counting())) == []
    assert looked <= MAX_LOOKS


def test_a_running_request_still_lends_among_many_sharing_a_system_prompt() -> None:
    scheduler = make_scheduler(slots=64, n_batch=4096, chunk=4096)
    for i in range(60):
        scheduler.add(request(i, [*SYSTEM, 100 + i]))
    executed(scheduler, scheduler.schedule())
    scheduler.add(request(99, [*SYSTEM, 7, 8]))
    plan = scheduler.schedule()
    copies = [op for op in plan.kv_ops if isinstance(op, CopyPrefix)]
    assert len(copies) == 1 and copies[0].n_tokens == 32 and copies[0].source < 60
