"""A replica's routing report through the engine's message boundary (EngineClient.routing_report), from a core on a
thread of this process (ThreadCore) and from one in a process of its own (ProcessCore, msgpack): the blocks of a
prompt it served, as a router hashes that prompt, capped at max_blocks; a repeat hashes no cached prefix again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine import prefix_digest
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.messages import RoutingReport
from cobali.engine.prefix_digest import prompt_blocks
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.engine_process import ProcessCore
from cobali.frontend.transports import ThreadCore
from tests.unit.frontend.test_engine_process import READY_WITHIN_S, finals, text_side, until

B = 4
PROMPT = [1 + (i * 7) % 90 for i in range(41)]  # 40 keys hashed: 10 blocks


def fake_engine() -> Engine:
    """Module-level: ProcessCore builds it in the engine's process, by name."""
    return Engine(FakeBackend(n_seq_max=2, n_batch=64), EngineConfig(max_slots=2, n_batch=64))


def served(client: EngineClient, scenario: Callable[[EngineClient], Awaitable[None]]) -> None:
    """Once PROMPT was served (its KV cached in a free slot), the scenario."""
    async def main() -> None:
        client.start()
        try:
            await until(lambda: client.state is EngineState.READY, READY_WITHIN_S)
            await finals(client.submit([(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))]))
            await scenario(client)
        finally:
            await asyncio.to_thread(client.stop)

    asyncio.run(main())


async def check_report(client: EngineClient) -> RoutingReport:
    report = await asyncio.wait_for(client.routing_report(B, 1000), READY_WITHIN_S)
    assert report.hashes[:10] == prompt_blocks(PROMPT, B), "what a router hashes of the prompt, leading"
    assert (report.n_waiting, report.n_running, report.waiting_tokens) == (0, 0, 0)
    assert (await client.routing_report(B, 3)).hashes == report.hashes[:3], "capped at max_blocks"
    with pytest.raises(ValueError, match="block_tokens and max_blocks"):  # the engine's refusal, raised here
        await client.routing_report(B, 0)
    return report


def test_a_report_from_a_core_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    counted = prefix_digest.block_hashes

    def block_hashes(keys, block_tokens: int) -> list[int]:
        hashes = counted(keys, block_tokens)
        hashed.append(len(hashes))
        return hashes

    monkeypatch.setattr(prefix_digest, "block_hashes", block_hashes)

    async def scenario(client: EngineClient) -> None:
        report = await check_report(client)
        before = len(hashed)
        assert before and await client.routing_report(B, 1000) == report
        assert len(hashed) == before, "the cached prefix's hashes came from the last report"

    served(EngineClient(ThreadCore(fake_engine)), scenario)


def test_a_report_from_a_core_in_its_own_process() -> None:
    async def scenario(client: EngineClient) -> None:
        await check_report(client)

    served(EngineClient(ProcessCore(fake_engine, lambda: text_side)), scenario)
