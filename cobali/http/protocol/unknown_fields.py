"""The unknown-fields policy: accepted (SDKs send extras meant for other servers) but never silently.

Each response names the top-level fields this server ignored in an `X-Cobali-Ignored-Fields` header, and the
server logs them once per request at WARNING, so a misspelt parameter shows up on both sides.
"""

from __future__ import annotations

import heapq
import logging

from cobali.http.protocol.bodies import RequestBody

IGNORED_FIELDS_HEADER = "X-Cobali-Ignored-Fields"

log = logging.getLogger("cobali.http.ignored")


MAX_NAMED = 20  # a body with thousands of unknown fields must not make a header too large to send


def ignored_fields_headers(body: RequestBody) -> dict[str, str]:
    extra = body.model_extra or {}
    if not extra:
        return {}
    # The first names only: sorting and escaping all of a body's thousands would hold the event loop. Names are
    # client text: ASCII-escaped so the header stays valid whatever they contain.
    named = [name.encode("unicode_escape").decode("ascii").replace(",", "\\x2c")
             for name in heapq.nsmallest(MAX_NAMED, extra)]
    named += [f"... {len(extra) - MAX_NAMED} more"] if len(extra) > MAX_NAMED else []
    log.warning("ignored unknown request fields: %s", ", ".join(named))
    return {IGNORED_FIELDS_HEADER: ",".join(named)}
