"""Structured-output coverage on the schema corpus (issue 36): each schema in tests/schemas/ goes to
/v1/chat/completions as a strict `response_format` json_schema, greedy, and the reply is counted.

    .venv/bin/python bench/structured/schema_coverage.py --out results/schema_coverage.json    # starts `cobali serve`
    .venv/bin/python bench/structured/schema_coverage.py --url http://127.0.0.1:8000 --out results/x.json

Per schema: the HTTP status (a 400 is a schema the server refused: counted apart, with its message), whether the
output parses as JSON, whether it validates against the schema (jsonschema, the draft the schema names or 2020-12,
with format checks: jsonschema's own (date, email, uuid, ipv4, ...), and date-time, time, duration and uri by
the RFCs' grammars here when the packages jsonschema would use for them are not installed), and
finish_reason "length" (cut off by max_tokens: counted apart, since then the output cannot be whole). The figure
is valid outputs / schemas.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "schemas"
COBALI = str(Path(sys.executable).with_name("cobali"))

# RFC 3339 date-time and full-time (offset required), for jsonschema's format checks when rfc3339-validator,
# which jsonschema needs for them, is not installed.
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DATE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ]" + _TIME)
_FULL_TIME = re.compile(_TIME)
# RFC 3339 appendix A (ISO 8601) durations, fractional seconds allowed as pydantic writes them (PT1.5S).
_DURATION = re.compile(r"P(?!$)([0-9]+Y)?([0-9]+M)?([0-9]+W)?([0-9]+D)?(T(?=[0-9])([0-9]+H)?([0-9]+M)?"
                       r"([0-9]+(\.[0-9]+)?S)?)?")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s\"<>\\^`{|}]*")  # RFC 3986's shape: a scheme, then no spaces


def format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    if "date-time" not in checker.checkers:
        def is_date_time(value: object) -> bool:
            if not isinstance(value, str):
                return True
            if not _DATE_TIME.fullmatch(value):
                return False
            dt.date.fromisoformat(value[:10])  # the day exists (raises ValueError, a format error, if not)
            return True
        checker.checks("date-time", raises=ValueError)(is_date_time)
    # jsonschema falls back to draft 3's HH:MM:SS for "time" without rfc3339-validator: drafts 7+ mean RFC 3339.
    checker.checkers["time"] = (lambda v: not isinstance(v, str) or bool(_FULL_TIME.fullmatch(v)), ())
    for name, pattern in (("duration", _DURATION), ("uri", _URI)):
        if name not in checker.checkers:
            checker.checkers[name] = (lambda v, p=pattern: not isinstance(v, str) or bool(p.fullmatch(v)), ())
    return checker


@dataclass
class Outcome:
    name: str
    status: int = 0  # 0: no HTTP answer (transport error, timeout)
    finish_reason: str | None = None
    completion_tokens: int = 0
    parsed: bool = False
    valid: bool = False
    error: str = ""  # the 400's message, the parse or validation error
    output: str | None = None
    seconds: float = 0.0


def load_corpus(folder: Path) -> list[tuple[str, dict]]:
    schemas = []
    for path in sorted(folder.rglob("*.json")):
        if path.name == "sources.json":
            continue
        schemas.append((f"{path.parent.name}/{path.stem}", json.loads(path.read_text())))
    return schemas


def prompt(name: str, schema: dict) -> str:
    """A short instruction, as a user would write it: what to fill, not the schema itself (the grammar holds
    the shape; a whole schema in the prompt would crowd a small model's context)."""
    title = schema.get("title") or name.split("/")[-1].replace("_", " ")
    about = schema.get("description")
    about = f" ({about.strip().splitlines()[0][:200]})" if isinstance(about, str) and about.strip() else ""
    return f"Write a realistic example of a {title}{about} as JSON. Reply with the JSON only."


def validator_for(schema: dict, checker: jsonschema.FormatChecker) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=checker)


async def one(client: httpx.AsyncClient, url: str, name: str, schema: dict, args: argparse.Namespace,
              checker: jsonschema.FormatChecker, gate: asyncio.Semaphore) -> Outcome:
    outcome = Outcome(name)
    body: dict = {"messages": [{"role": "user", "content": prompt(name, schema)}],
            "temperature": 0, "max_tokens": args.max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64], "schema": schema, "strict": True}}}
    if args.model:
        body["model"] = args.model
    async with gate:
        start = time.perf_counter()
        try:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
        except httpx.HTTPError as err:
            outcome.error = f"{type(err).__name__}: {err}"
            return outcome
        finally:
            outcome.seconds = time.perf_counter() - start
    outcome.status = response.status_code
    if response.status_code != 200:
        try:
            outcome.error = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            outcome.error = response.text[:500]
        return outcome
    reply = response.json()
    choice = reply["choices"][0]
    outcome.finish_reason = choice["finish_reason"]
    outcome.completion_tokens = reply.get("usage", {}).get("completion_tokens", 0)
    outcome.output = choice["message"]["content"]
    try:
        value = json.loads(outcome.output or "")
    except json.JSONDecodeError as err:
        outcome.error = f"not JSON: {err}"
        return outcome
    outcome.parsed = True
    error = jsonschema.exceptions.best_match(validator_for(schema, checker).iter_errors(value))
    if error is None:
        outcome.valid = True
    else:
        outcome.error = f"invalid at {error.json_path}: {error.message[:300]}"
    return outcome


async def run_all(url: str, corpus: list[tuple[str, dict]], args: argparse.Namespace) -> list[Outcome]:
    checker = format_checker()
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        return list(await asyncio.gather(*(one(client, url, name, schema, args, checker, gate)
                                           for name, schema in corpus)))


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    return {"schemas": len(outcomes), "ok_200": sum(o.status == 200 for o in outcomes),
            "parsed": sum(o.parsed for o in outcomes), "valid": sum(o.valid for o in outcomes),
            "refused_400": sum(o.status == 400 for o in outcomes),
            "truncated": sum(o.finish_reason == "length" for o in outcomes),
            "invalid_untruncated": sum(o.status == 200 and not o.valid and o.finish_reason != "length"
                                       for o in outcomes),
            "other_errors": sum(o.status not in (200, 400) for o in outcomes)}


def verdict(o: Outcome) -> str:
    if o.status == 400:
        return "REFUSED"
    if o.status != 200:
        return f"ERROR {o.status}"
    if o.valid:
        return "valid"
    if o.finish_reason == "length":
        return "TRUNCATED"
    return "INVALID" if o.parsed else "NOT JSON"


def print_table(outcomes: list[Outcome]) -> None:
    width = max(len(o.name) for o in outcomes)
    for o in sorted(outcomes, key=lambda o: (o.valid, verdict(o), o.name)):
        print(f"{o.name:<{width}}  {verdict(o):<9} {o.completion_tokens:>4} tok {o.seconds:6.1f}s  "
              f"{o.error[:110]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def started_server(flags: list[str], startup_s: float = 180) -> Iterator[str]:
    """`cobali serve` on a free loopback port until /health answers 200; SIGTERM on exit."""
    port = free_port()
    proc = subprocess.Popen([COBALI, "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy (exit status {proc.poll()})")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (default: start `cobali serve`)")
    parser.add_argument("--serve-flags", default="--threads 1 --max-slots 8",
                        help="flags for the server this script starts")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--only", help="a regex: only the schemas whose name (folder/stem) it finds")
    parser.add_argument("--model", help="the request's model field (default: none, the server's model)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per request")
    parser.add_argument("--out", type=Path, help="write the summary and every outcome as JSON here")
    args = parser.parse_args()
    corpus = [(n, s) for n, s in load_corpus(args.corpus) if not args.only or re.search(args.only, n)]
    start = time.perf_counter()
    if args.url:
        outcomes = asyncio.run(run_all(args.url.rstrip("/"), corpus, args))
    else:
        with started_server(shlex.split(args.serve_flags)) as url:
            outcomes = asyncio.run(run_all(url, corpus, args))
    elapsed = time.perf_counter() - start
    summary = summarize(outcomes)
    print_table(outcomes)
    print(json.dumps(summary))
    print(f"valid outputs / schemas: {summary['valid']}/{summary['schemas']} "
          f"(refused {summary['refused_400']}, truncated {summary['truncated']}, "
          f"invalid though not truncated {summary['invalid_untruncated']}, other errors {summary['other_errors']}) "
          f"in {elapsed:.0f} s")
    # The grammar's own share: a reply cut by max_tokens says more about the model (a runaway string) than the
    # constraint, so the valid share of the replies that ended is printed beside it.
    complete = summary["ok_200"] - summary["truncated"]
    print(f"valid / complete replies: {summary['valid']}/{complete}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": shlex.join(sys.argv), "url": args.url,
                                        "serve_flags": None if args.url else args.serve_flags,
                                        "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                                        "elapsed_s": round(elapsed, 1), "summary": summary,
                                        "outcomes": [asdict(o) for o in outcomes]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
