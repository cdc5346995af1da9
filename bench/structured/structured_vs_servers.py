"""Structured outputs against other OpenAI-compatible servers: the same chat requests, all at once,
unconstrained, under a JSON schema (`response_format`: each server builds its own grammar), and under one GBNF
grammar (`grammar`, llama-server's field: FILM_GBNF, the schema written by hand, so the same constraint on both),
each server in turn, several rounds.

    # one server up at a time, each on the same threads and slots, e.g.:
    llama-server -m MODEL.gguf -np 8 -c 16384 -t 2 -tb 2 --port 8081
    cobali serve --max-slots 8 --ctx 16384 --threads 2 --port 8082
    .venv/bin/python bench/structured/structured_vs_servers.py --url llama-server=http://127.0.0.1:8081 --rounds 2
    .venv/bin/python bench/structured/structured_vs_servers.py --url cobali=http://127.0.0.1:8082 --rounds 2

Every reply under the schema is checked against it (jsonschema); a reply that does not hold it is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import jsonschema

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "genres": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "genres"], "additionalProperties": False}
# SCHEMA's objects as GBNF, written as cobali writes JSON (the keys in order, one space after ':' and ','), in the
# syntax both llama.cpp and llguidance's converter read (no \u escapes: the converter misreads them).
FILM_GBNF = r"""root ::= "{\"title\": " string ", \"year\": " integer ", \"genres\": [" genres "]}"
genres ::= ( string ( ", " string )* )?
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} )
"""
CONSTRAINTS: dict[str, dict] = {"none": {}, "json_schema": {"response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "film", "schema": SCHEMA}}},
               "grammar": {"grammar": FILM_GBNF}}


async def one(client: httpx.AsyncClient, url: str, seed: int, constraint: dict, args: argparse.Namespace
              ) -> tuple[int, bool]:
    body = {"messages": [{"role": "user", "content": "Describe a film you like, as JSON."}], "seed": seed,
            "temperature": args.temperature, "max_tokens": args.max_tokens, **constraint}
    reply = (await client.post(f"{url}/v1/chat/completions", json=body)).raise_for_status().json()
    choice = reply["choices"][0]
    valid = True
    if constraint:
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = choice["finish_reason"] == "length"  # cut short by max_tokens: not the grammar's fault
    return reply["usage"]["completion_tokens"], valid


async def run(url: str, constraint: dict, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, seed, constraint, args) for seed in range(args.requests)))
    wall = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "invalid": sum(not v for _, v in results)}


def server(spec: str) -> tuple[str, str]:
    """A --url value: the server's name in the output, and its address."""
    name, _, url = spec.partition("=")
    if not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {spec!r}")
    return name, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, metavar="NAME=URL", type=server)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    servers: list[tuple[str, str]] = args.url
    asyncio.run(run(servers[0][1], {}, argparse.Namespace(**{**vars(args), "requests": 2, "max_tokens": 8})))
    for _ in range(args.rounds):
        for name, url in servers:
            for kind, constraint in CONSTRAINTS.items():
                result = asyncio.run(run(url, constraint, args))
                print(f"{name:<14} {kind:<12} {result['tokens']:>5} tokens {result['wall_s']:7.2f} s "
                      f"{result['tok_per_s']:7.1f} tok/s  invalid {result['invalid']}", flush=True)


if __name__ == "__main__":
    main()
