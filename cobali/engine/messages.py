"""The engine's boundary, as messages: what a frontend sends an engine core, and what the core sends back. The
same messages drive a core on a thread of the server's process (passed as objects) and one in a process of its
own (msgpack over a socket, decoded into these types and checked: no pickle of anything a client sent)."""

from __future__ import annotations

import msgspec
import numpy as np

from cobali.engine.outputs import EngineStats, RequestOutput
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.views import ModelInfo, SlotState

# ---- frontend -> core -----------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    """A request whose prompt the frontend has tokenized and checked; its id is the frontend's to choose."""

    request_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    arrival_time: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process of the machine)
    priority: int = 0
    stream_interval: int | None = None  # its text goes out every this many tokens; None: at its end only
    lora: int = 0  # its adapter; 0: none


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: int


class Call(msgspec.Struct, tag=True, frozen=True):
    """A named question for the engine, answered between two ticks by a CallDone with the same id."""

    call_id: int


class ReadSlots(Call, tag=True, frozen=True):
    """Every slot and the request in it (/slots)."""


class LoadAdapter(Call, tag=True, frozen=True):
    path: str


class UnloadAdapter(Call, tag=True, frozen=True):
    index: int


class Embed(Call, tag=True, frozen=True):
    """Pooled embeddings of token lists, each within the model's embedding limits (the frontend checked)."""

    inputs: list[list[int]]


class ReadRoutingReport(Call, tag=True, frozen=True):
    """What this replica holds and how busy it is, for a router: its prefixes' hashes in blocks of block_tokens
    (engine/prefix_digest.py), at most max_blocks of them."""

    block_tokens: int
    max_blocks: int


class AbortAll(msgspec.Struct, tag=True, frozen=True):
    """The drain's grace period is over: every request still running ends now."""


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """End every request, then stop."""


Question = ReadSlots | LoadAdapter | UnloadAdapter | Embed | ReadRoutingReport
ToCore = (AddRequest | AbortRequest | ReadSlots | LoadAdapter | UnloadAdapter | Embed | ReadRoutingReport | AbortAll
          | Shutdown)

# ---- core -> frontend -----------------------------------------------------------------------------------


class TickSummary(msgspec.Struct, frozen=True, array_like=True):
    """One tick as the metrics see it."""

    n_tokens: int
    n_requests: int
    seconds: float

    @classmethod
    def of(cls, record: TickRecord) -> TickSummary:
        return cls(record.plan.n_tokens, len(record.plan.chunks), record.end - record.start)


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The model has loaded; its limits, as requests are checked against them."""

    model: ModelInfo


class Outputs(msgspec.Struct, tag=True, frozen=True):
    """What one or more ticks made: a message per request whose text is due or that ended; the ticks; the
    engine's gauges now (None where they were sent a moment ago)."""

    outputs: list[RequestOutput]
    ticks: list[TickSummary] = []
    stats: EngineStats | None = None


class RoutingReport(msgspec.Struct, frozen=True):
    """A replica's routing report (ReadRoutingReport's answer), between two ticks."""

    hashes: list[int]  # chained block hashes of every prefix it holds, most valuable first, <= max_blocks
    kv_use: float  # share of KV cells in use (by running requests), 0..1
    waiting_tokens: int  # prompt tokens queued or running but not yet computed
    n_waiting: int  # requests added and not holding a slot yet
    n_running: int


class CallDone(msgspec.Struct, tag=True, frozen=True):
    """A Call's answer, or the refusal it raised: its kind (an exception's class name) and message."""

    call_id: int
    slots: list[SlotState] | None = None
    index: int | None = None  # a loaded adapter's
    vectors: bytes | None = None  # embeddings, float32, a row per input
    n_rows: int = 0
    report: RoutingReport | None = None
    error_kind: str | None = None
    error: str | None = None

    def embeddings(self) -> np.ndarray:
        assert self.vectors is not None
        return np.frombuffer(self.vectors, dtype=np.float32).reshape(self.n_rows, -1)


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The core cannot go on (its model failed to load, or a tick raised): why, for the log."""

    error: str
    loading: bool = False


FromCore = Ready | Outputs | CallDone | Failed

ENCODER = msgspec.msgpack.Encoder()
TO_CORE = msgspec.msgpack.Decoder(ToCore)
FROM_CORE = msgspec.msgpack.Decoder(FromCore)
