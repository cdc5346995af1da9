"""With API keys, each key has its own prefix cache (issue 44, item 6): a prompt another key's requests cached
is prefilled afresh, so `cached_tokens` (and Anthropic's cache_read_input_tokens) tell a key nothing of another
key's prompts; a key still reuses its own, and cache_salt still parts users within a key. --shared-prefix-cache
shares the cache across keys again, for one tenant's keys."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

KEYS = ("key-a", "key-b")
PROMPT = "a prompt long enough to be worth keeping in the prefix cache"
BODIES = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "ignore_eos": True},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
    "/v1/responses": {"input": PROMPT, "max_output_tokens": 16},
}


@contextmanager
def served(**config: object) -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine(), "m", api_keys=KEYS, **config)) as client:
        wait_healthy(client)
        yield client


def cached(client: TestClient, key: str, path: str, salt: str | None = None) -> int:
    """The prompt tokens the reply says were cached, as each API reports them."""
    body = BODIES[path] | ({} if salt is None else {"cache_salt": salt})
    reply = client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    if path == "/v1/messages":
        return usage["cache_read_input_tokens"]
    if path == "/v1/responses":
        return usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", list(BODIES))
def test_a_key_sees_only_its_own_prefix_cache(path: str) -> None:
    a, b = KEYS
    with served() as client:
        assert cached(client, a, path) == 0
        reused = cached(client, a, path)
        assert reused > 0, "a key reuses its own prompt"
        assert cached(client, b, path) == 0, "another key's cached prompt is not this key's"
        assert cached(client, b, path) == reused, "and then it has its own"


def test_a_cache_salt_still_parts_users_within_a_key() -> None:
    a, _ = KEYS
    path = "/v1/completions"
    with served() as client:
        assert [cached(client, a, path, "user-1"), cached(client, a, path, "user-2")] == [0, 0]
        assert cached(client, a, path, "user-1") > 0 and cached(client, a, path) == 0


def test_the_keys_may_share_one_prefix_cache() -> None:
    a, b = KEYS
    path = "/v1/chat/completions"
    with served(shared_prefix_cache=True) as client:
        assert cached(client, a, path) == 0
        assert cached(client, b, path) > 0
