"""The ingress's routing hint is the prompt as the replica makes it: its blocks are among those the replica
reports holding once it has served the request (the same template, tokens, key salt), and a body that does not
parse routes with no hint."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from cobali.frontend.client import EngineState
from cobali.http.config import ServerConfig
from cobali.ray.asgi import HTTPRequest, call_app
from cobali.ray.hints import Hinter
from cobali.ray.policy import RoutingHint
from tests.unit.ray.test_ray_gateway import replica_app

BLOCK = 4  # tokens a block: the fake vocabulary's short prompts span several
CHAT: dict[str, Any] = {"messages": [{"role": "system", "content": "You are a terse assistant. " * 4},
                     {"role": "user", "content": "Say hi."}], "max_tokens": 1}


def post(path: str, body: Any, *headers: tuple[bytes, bytes], key: str | None = None) -> HTTPRequest:
    auth = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return HTTPRequest("POST", path, b"", [(b"content-type", b"application/json"), *auth, *headers],
                       json.dumps(body).encode())


def served_then_held(request: HTTPRequest, hint_of: Any, api_key: str | None = None) -> tuple[Any, set[int]]:
    """hint_of(hinter) on a fake replica's text side, then the request served by that replica, and the block
    hashes the replica reports holding after it."""

    async def run() -> tuple[Any, set[int]]:
        app = replica_app(api_key)
        async with app.router.lifespan_context(app):
            client = app.state.server.client
            while client.state is not EngineState.READY:
                await asyncio.sleep(0.01)
            config = ServerConfig(api_keys=(api_key,) if api_key else ())
            hinted = hint_of(Hinter(app.state.server.inputs(), config, "kv", BLOCK))
            messages = [m async for m in call_app(app, request)]
            assert messages[0]["status"] == 200, messages
            report = await client.routing_report(BLOCK, 10_000)
            return hinted, set(report.hashes)

    return asyncio.run(run())


def test_a_chat_s_hint_is_what_the_replica_then_holds() -> None:
    request = post("/v1/chat/completions", CHAT)
    hint, held = served_then_held(request, lambda hinter: hinter.hint(request, None))
    assert len(hint.blocks) >= 4 and hint.n_tokens >= 4 * BLOCK
    assert set(hint.blocks) <= held


def test_completions_messages_and_responses_are_hinted() -> None:
    bodies = {"/v1/completions": {"prompt": "Once upon a time, in a land far away,", "max_tokens": 1},
              "/v1/messages": {"model": "fake-model", "max_tokens": 1, "messages": CHAT["messages"][1:],
                               "system": CHAT["messages"][0]["content"]},
              "/v1/responses": {"input": "Once upon a time, in a land far away,", "max_output_tokens": 1}}
    for path, body in bodies.items():
        request = post(path, body)
        hint, held = served_then_held(request, lambda hinter, r=request: hinter.hint(r, None))
        assert hint.blocks and set(hint.blocks) <= held, path


def test_the_key_salts_the_hint_as_it_salts_the_replica_s_cache() -> None:
    request = post("/v1/chat/completions", CHAT, key="k")
    key_id = hashlib.sha256(b"k").hexdigest()[:16]  # as cobali.http.auth names a key

    def both(hinter: Hinter) -> tuple[RoutingHint, RoutingHint]:
        return hinter.hint(request, key_id), hinter.hint(request, None)

    (keyed, open_), held = served_then_held(request, both, api_key="k")
    assert keyed.blocks and set(keyed.blocks) <= held
    assert not set(open_.blocks) & held  # unsalted: another tenant's prefix


def test_sessions_and_bodies_that_do_not_parse() -> None:
    async def run() -> None:
        app = replica_app()
        async with app.router.lifespan_context(app):
            while app.state.server.client.state is not EngineState.READY:
                await asyncio.sleep(0.01)
            hinter = Hinter(app.state.server.inputs(), ServerConfig(), "kv", BLOCK)
            with_user = post("/v1/chat/completions", {**CHAT, "user": "u1"})
            assert hinter.hint(with_user, None).session == "u1"
            header = post("/v1/chat/completions", {**CHAT, "user": "u1"}, (b"x-session-id", b"s9"))
            assert hinter.hint(header, None).session == "s9"
            for bad in (b"{", json.dumps({"messages": "none"}).encode()):
                request = HTTPRequest("POST", "/v1/chat/completions", b"", [(b"content-type", b"application/json")],
                                      bad, None)
                assert hinter.hint(request, None) == RoutingHint()
            text = Hinter(app.state.server.inputs(), ServerConfig(), "text", BLOCK).hint(with_user, None)
            assert "Say hi." in text.text and not text.blocks and text.session == "u1"
            assert Hinter(None, ServerConfig(), "kv", BLOCK).hint(with_user, None) == RoutingHint(session="u1")

    asyncio.run(run())
