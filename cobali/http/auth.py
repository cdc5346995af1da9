"""The API key, checked before a single byte of the body is read, and the prefix cache kept apart per key.

A pure ASGI middleware, outside BodyLimit: a client without a key is answered 401 from its headers alone, so it
cannot make the server buffer (up to --max-body-bytes) a body nobody will read. /health and /metrics stay open
for probes and scrapers; everything else (/v1/*, /tokenize, /detokenize, /slots, the docs) needs the key.

Keys are looked up by their SHA-256 digest: one hash of the offered key and one dict lookup, whatever the number
of keys. The lookup's timing depends on the digest of what was sent, which tells nothing of any key (what a
constant-time comparison of the keys themselves guarded against).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from cobali.frontend.errors import APIError

if TYPE_CHECKING:  # the module's weight (tokenizers, templates) is the routes', not the gateway's
    from cobali.frontend.inputs import Choices

OPEN_PATHS = frozenset({"/health", "/metrics"})
KEY_ID = "cobali_api_key_id"  # in scope["state"]: which key the request bore (its digest's first 16 hex digits)
KEY_ID_CHARS = 16
UNAUTHORIZED = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                        "authentication_error", code="invalid_api_key")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def offered_keys(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes, ...]:
    """The first `Authorization: Bearer` token and the first `x-api-key` (Anthropic's SDKs send the key there):
    at most two, however many headers a client repeats."""
    bearer: bytes | None = None
    x_api_key: bytes | None = None
    for name, value in headers:  # ASGI's header names are lower case
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.partition(b" ")
            bearer = token.strip() if scheme.lower() == b"bearer" else b""  # another scheme: no bearer token
        elif name == b"x-api-key" and x_api_key is None:
            x_api_key = value
    return tuple(key for key in (bearer, x_api_key) if key is not None)


class ApiKeyAuth:
    """ASGI middleware: 401 unless the request bears one of `keys`; the key's id then rides on scope["state"]."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        digests = map(_digest, (key.encode() for key in keys))
        self.ids = {digest: digest.hex()[:KEY_ID_CHARS] for digest in digests}
        assert self.ids, "with no key the server is open: add no ApiKeyAuth"

    def key_id(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        for key in offered_keys(headers):
            if (found := self.ids.get(_digest(key))) is not None:
                return found
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key_id = self.key_id(scope["headers"])
        if key_id is None:
            await UNAUTHORIZED.response()(scope, receive, send)
            return
        scope.setdefault("state", {})[KEY_ID] = key_id
        await self.app(scope, receive, send)


def keyed_choices(scope: Scope, choices: Choices, shared: bool) -> Choices:
    """The choices salted with the key the request bore: a key's requests reuse only that key's cached prefixes
    (in the slots and in host memory, which the engine keys by cache_salt), so `cached_tokens` and the speed of
    a reply tell nothing of another key's prompts; a request's own cache_salt still parts users within its key.
    The id has a fixed length and no ':', so no two (key, salt) pairs give one salt. Unchanged on an open server
    or with --shared-prefix-cache (`shared`)."""
    key_id = None if shared else scope.get("state", {}).get(KEY_ID)
    if key_id is None:
        return choices
    return [(tokens, dataclasses.replace(params, cache_salt=key_id if params.cache_salt is None
                                         else f"{key_id}:{params.cache_salt}")) for tokens, params in choices]
