"""The client half of bench/serving/many_models.py: a router's endpoints (GET /models, POST /models/unload,
/metrics' load and eviction counters), closed-loop streams that each name their model, and a watcher that
samples resident memory every ~100 ms: the server's own account (cobali's GET /models `memory`) and the real
RSS of the server's child processes (one per loaded model in both cobali and llama-server)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import httpx
from proc_tree import tree_rss

from cobali.harness.driver import user_cpu_seconds
from cobali.harness.serve_client import ClientRecord, ServeOptions, ServeResult, endpoints, request_body, stream_one
from cobali.harness.workloads import WorkItem

PROMPT = "Name three colors."
RESIDENT = ("loaded", "loading", "unloading", "sleeping")  # a model process is up (llama-server also sleeps)
LOADS, EVICTIONS = "cobali:model_loads_total", "cobali:model_evictions_total"


class Missing(Exception):
    """An endpoint the server lacks or answers in another shape: the phase that needs it is skipped, saying so."""


def root_url(url: str) -> str:
    return endpoints(url)[1].removesuffix("/v1/models")


@dataclass(frozen=True)
class ModelsPage:
    status: dict[str, str]  # model id -> status value
    budget_bytes: int | None  # cobali's extension: memory.budget_bytes
    resident_bytes: int | None


async def models_page(client: httpx.AsyncClient) -> ModelsPage:
    response = await client.get("/models")
    if response.status_code != 200:
        raise Missing(f"GET /models answered HTTP {response.status_code}: {response.text[:160]!r} "
                      "(is the server in many-model mode?)")
    try:
        body = response.json()
        status = {m["id"]: m["status"]["value"] for m in body["data"]}
    except (ValueError, KeyError, TypeError):
        raise Missing(f"GET /models: no list of models with a status.value each: {response.text[:160]!r}") from None
    memory = body.get("memory") or {}
    return ModelsPage(status, memory.get("budget_bytes"), memory.get("resident_bytes"))


async def reported_budget(url: str) -> float | None:
    """cobali's own budget, from GET /models; None where the server tells none."""
    try:
        async with httpx.AsyncClient(base_url=root_url(url), timeout=30) as client:
            budget = (await models_page(client)).budget_bytes
    except (Missing, httpx.HTTPError):
        return None
    return None if budget is None else budget / 2**20


async def unload_all(client: httpx.AsyncClient, names: Sequence[str], timeout_s: float = 120) -> None:
    """POST /models/unload for every resident model of `names`, then wait until GET /models lists none resident."""
    page = await models_page(client)
    unknown = [name for name in names if name not in page.status]
    if unknown:
        raise Missing(f"GET /models does not list {unknown} (it lists {sorted(page.status)})")
    for name in names:
        if page.status[name] in RESIDENT:
            response = await client.post("/models/unload", json={"model": name})
            if response.status_code >= 300:
                raise Missing(f"POST /models/unload {name!r} answered HTTP {response.status_code}: "
                              f"{response.text[:160]!r}")
    deadline = time.monotonic() + timeout_s
    while any(status in RESIDENT for name, status in page.status.items() if name in names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"models still resident {timeout_s:.0f} s after unloading: {page.status}")
        await asyncio.sleep(0.05)
        page = await models_page(client)


async def model_counters(client: httpx.AsyncClient) -> dict[str, float] | None:
    """Loads and evictions summed over models from /metrics; None where it has no such counters (llama-server's
    router answers /metrics only for one model, and counts neither)."""
    response = await client.get("/metrics")
    if response.status_code != 200 or LOADS.removesuffix("_total") not in response.text:
        return None
    totals = {LOADS: 0.0, EVICTIONS: 0.0}
    for line in response.text.splitlines():
        name, _, rest = line.partition("{")
        if name in totals:
            totals[name] += float(rest.rpartition("}")[2].split()[0])
    return totals


@dataclass
class Watch:
    """What one phase saw of the server's memory and model processes."""

    max_reported_bytes: int | None = None  # GET /models memory.resident_bytes
    max_children_rss_bytes: int | None = None
    samples: int = 0
    started: set[int] = field(default_factory=set)  # child processes that appeared during the phase
    ended: set[int] = field(default_factory=set)
    counters: dict[str, float] | None = None  # /metrics loads and evictions over the phase, where counted

    def loads_evictions(self) -> tuple[int, int, str]:
        """(loads, evictions, where they were counted)."""
        if self.counters is not None:
            return int(self.counters[LOADS]), int(self.counters[EVICTIONS]), "metrics"
        return len(self.started), len(self.ended), "child processes"


async def _sample(client: httpx.AsyncClient, pid: int | None, watch: Watch, interval_s: float) -> None:
    known: set[int] | None = None
    while True:
        try:
            reported = (await models_page(client)).resident_bytes
        except (Missing, httpx.HTTPError):
            reported = None
        if reported is not None:
            watch.max_reported_bytes = max(watch.max_reported_bytes or 0, reported)
        if pid is not None:
            rss = tree_rss(pid)
            watch.max_children_rss_bytes = max(watch.max_children_rss_bytes or 0, sum(rss.values()))
            if known is not None:
                watch.started |= rss.keys() - known
                watch.ended |= known - rss.keys()
            known = set(rss)
        watch.samples += 1
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def watching(url: str, pid: int | None, interval_s: float = 0.1) -> AsyncIterator[Watch]:
    """Samples the server in the background while the block runs (its own connection: the load's pool is full)."""
    watch = Watch()
    async with httpx.AsyncClient(base_url=root_url(url), timeout=30) as client:
        before = await model_counters(client)
        task = asyncio.create_task(_sample(client, pid, watch, interval_s))
        try:
            yield watch
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        after = await model_counters(client)
        if before is not None and after is not None:
            watch.counters = {k: after[k] - before[k] for k in after}


async def stream(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, index: int = 0) -> ClientRecord:
    body = request_body(WorkItem(PROMPT, max_tokens), ServeOptions(url=url, max_new=max_tokens), model)
    return await stream_one(client, endpoints(url)[0], body, ClientRecord(index))


def new_client(concurrency: int, timeout_s: float = 600) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0))


async def closed_loop(url: str, plans: Sequence[Sequence[str]], max_tokens: int) -> ServeResult:
    """One client per plan, each sending its plan's models' requests one after another."""
    async with new_client(len(plans)) as client:
        cpu0, wall0 = user_cpu_seconds(), time.perf_counter()

        async def run(plan: Sequence[str], first: int) -> list[ClientRecord]:
            return [await stream(client, url, model, max_tokens, first + j) for j, model in enumerate(plan)]

        starts = accumulate((len(p) for p in plans), initial=0)  # each request's index, unique over the run
        done = await asyncio.gather(*(run(plan, start) for plan, start in zip(plans, starts, strict=False)))
        wall = time.perf_counter() - wall0
    return ServeResult([r for records in done for r in records], wall, user_cpu_seconds() - cpu0)


def lost(records: Sequence[ClientRecord], max_tokens: int) -> Counter[str]:
    """Why requests were lost: anything but a 200 stream of all max_tokens tokens (ignore_eos), by status or error
    kind. Tokens, not text: most of a synth model's vocabulary is padding that decodes to no text."""
    reasons: Counter[str] = Counter()
    for record in records:
        if record.error is not None:
            reasons[record.error.split(":")[0][:60]] += 1
        elif record.output_tokens != max_tokens:
            reasons[f"200 with {record.output_tokens} of {max_tokens} tokens"] += 1
    return reasons
