"""`cobali bench serve`: a streaming load generator for any OpenAI-compatible `/v1/completions` (cobali,
llama-server, vLLM). Latencies are measured client-side per SSE chunk, so they include the network and the
server's HTTP layer, and are comparable across servers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from cobali.harness.driver import user_cpu_seconds
from cobali.harness.latency import RequestTiming, summarize_timings, timing_from_times
from cobali.harness.workloads import WorkItem, arrival_offsets


@dataclass(frozen=True)
class ServeOptions:
    url: str
    concurrency: int = 1
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    max_new: int = 64
    model: str | None = None  # None: the first model the server lists at /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass
class ClientRecord:
    index: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    end: float | None = None
    text: str = ""
    prompt_tokens: int = 0  # from the final usage; 0 when the server sends none
    output_tokens: int = 0  # from the final usage, else the number of text chunks
    error: str | None = None
    served_by: str | None = None  # the replica that answered, where the server names it (x-cobali-replica)

    def timing(self) -> RequestTiming:
        if self.error is not None:
            return timing_from_times(self.start, None, [], None)  # a failed request has no latencies
        return timing_from_times(self.start, None, self.chunk_times, self.end, self.output_tokens)

    def as_dict(self) -> dict:
        t = self.timing()
        return {"index": self.index, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "text": self.text, "error": self.error, "ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms,
                "e2el_ms": t.e2el_ms, "itl_ms": list(t.itl_ms)}


@dataclass
class ServeResult:
    records: list[ClientRecord]
    wall_s: float
    user_cpu_s: float

    def summary(self) -> dict:
        return summarize_timings(
            [r.timing() for r in self.records],
            prompt_tokens=sum(r.prompt_tokens for r in self.records),
            generated_tokens=sum(r.output_tokens for r in self.records if r.error is None),
            failed=sum(r.error is not None for r in self.records),
            wall_s=self.wall_s, user_cpu_s=self.user_cpu_s,
        )


def endpoints(url: str) -> tuple[str, str]:
    """(completions URL, models URL) from a server root, a .../v1 base, or the full completions URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r}: expected http://HOST:PORT")
    base = url.rstrip("/")
    base = base.removesuffix("/completions").removesuffix("/v1")
    return f"{base}/v1/completions", f"{base}/v1/models"


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, other fields and blank separators."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def apply_chunk(record: ClientRecord, data: str, now: float) -> bool:
    """Fold one SSE payload into the record; False once the stream is over."""
    if data == "[DONE]":
        return False
    chunk = json.loads(data)
    if chunk.get("error"):
        record.error = f"server error: {chunk['error']}"
        return False
    choices = chunk.get("choices") or []
    texts = [c.get("text") or "" for c in choices]
    # A chunk is a token's arrival when it has text or ends nothing: a token without text (an end token that
    # ignore_eos lets through, as vLLM and cobali stream it) came then too. Some servers end with an empty chunk
    # carrying finish_reason, which is not a token and would add a fake inter-token gap.
    if any(texts) or (choices and not any(c.get("finish_reason") for c in choices)):
        record.chunk_times.append(now)
        record.text += "".join(texts)
    if usage := chunk.get("usage"):
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.output_tokens = int(usage.get("completion_tokens") or 0)
    return True


def request_body(item: WorkItem, options: ServeOptions, model: str | None) -> dict:
    # ignore_eos and a fixed max_tokens make every server generate the same number of tokens.
    body = {"prompt": item.prompt, "max_tokens": item.max_tokens or options.max_new, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return body


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, record: ClientRecord,
                     headers: dict[str, str] | None = None) -> ClientRecord:
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
                return record
            record.served_by = response.headers.get("x-cobali-replica")
            async for line in response.aiter_lines():
                data = sse_data(line)
                if data is not None and not apply_chunk(record, data, time.perf_counter()):
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        record.error = f"{type(err).__name__}: {err}"
    record.end = time.perf_counter()
    if not record.output_tokens:
        record.output_tokens = len(record.chunk_times)
    return record


async def first_model(client: httpx.AsyncClient, models_url: str) -> str | None:
    """The server's first listed model (vLLM rejects requests without one); None when it lists none."""
    try:
        response = await client.get(models_url)
        response.raise_for_status()
        models = response.json().get("data") or []
        return models[0].get("id") if models else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def run_serve(items: Sequence[WorkItem], options: ServeOptions,
                    transport: httpx.AsyncBaseTransport | None = None, progress: bool = True) -> ServeResult:
    """At most `concurrency` requests in flight; each starts no earlier than its scheduled arrival."""
    completions_url, models_url = endpoints(options.url)
    offsets = arrival_offsets(len(items), options.request_rate, options.burstiness, options.seed)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
    gate = asyncio.Semaphore(options.concurrency)
    bar = tqdm(total=len(items), desc="serve", unit="req", leave=False, disable=not progress)
    async with httpx.AsyncClient(transport=transport, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(options.timeout_s, connect=10.0)) as client:
        model = options.model or await first_model(client, models_url)
        cpu0, wall0 = user_cpu_seconds(), time.perf_counter()

        async def one(index: int, item: WorkItem) -> ClientRecord:
            await asyncio.sleep(max(0.0, wall0 + offsets[index] - time.perf_counter()))
            async with gate:
                record = await stream_one(client, completions_url, request_body(item, options, model),
                                          ClientRecord(index))
            bar.update()
            return record

        try:
            records = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
        finally:
            bar.close()
        wall = time.perf_counter() - wall0
    return ServeResult(list(records), wall, user_cpu_seconds() - cpu0)
