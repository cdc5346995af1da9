"""`cobali serve --replicas 2`: two engines on the embedded model behind one Ray Serve endpoint, driven by the
official openai client. Each replica runs --threads 1 and reserves one of the machine's two cores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_server_openai import running_server

pytest.importorskip("ray.serve")

N_REQUESTS = 16


def served_per_replica(base: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "cobali:request_success_total":
                replica = sample.labels["replica"]
                counts[replica] = counts.get(replica, 0) + sample.value
    return counts


def stream_one(client: OpenAI, i: int) -> str | None:
    """Half completions, half chats, all streamed; returns the finish reason of the last chunk."""
    if i % 2:
        chunks = list(client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8, stream=True))
    else:
        chunks = list(client.completions.create(model="smol", prompt=f"{i}, {i + 1},", max_tokens=8, stream=True))
    return chunks[-1].choices[0].finish_reason


@pytest.mark.timeout(240)  # starts a local Ray cluster (several processes): 20-30 s on 2 cores
def test_two_replicas_share_concurrent_streams() -> None:
    with running_server("--replicas", "2", "--max-slots", "4", "--served-model-name", "smol",
                        "--shutdown-grace", "5") as (base, proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(N_REQUESTS) as pool:
            reasons = list(pool.map(lambda i: stream_one(client, i), range(N_REQUESTS)))
        assert all(reason in ("length", "stop") for reason in reasons), reasons

        raw = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=60)
        assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400

        counts = served_per_replica(base)
        assert sum(counts.values()) == N_REQUESTS + 1, counts
        assert sorted(counts) == ["0", "1"] and min(counts.values()) > 0, counts  # both replicas served
        assert httpx.get(f"{base}/health", timeout=30).json()["replicas"] == {"0": "ok", "1": "ok"}
    assert proc.returncode == 0  # SIGTERM: Serve drained and Ray shut down
