"""Time to the first content token of a streamed chat reply, with tools on against off, on the embedded model.

    .venv/bin/python bench/serving/ttft_tools.py [--rounds 6] [--requests 4] [--threads 1]
    .venv/bin/python bench/serving/ttft_tools.py --checkout /work/before   # the server from an older checkout

Starts `cobali serve` on the embedded model (its own chat template) and sends streamed chat requests one at a
time, greedy, each reply forced by a regex so that every checkout writes the same text, in two shapes: prose, and
a reply that opens with a JSON object (as code or data does). With tools on the request carries one tool the reply
never calls. TTFT: from sending the request to the first chunk with content. Each round sends --requests requests
per shape with tools off and on, the order reversed every other round; after a warm-up request each, the server
holds every prompt's KV. Prints, per shape, the TTFT p50 with tools off and on, their ratio, and the p50 time to
the reply's end.

--checkout DIR runs the server from another checkout (DIR first on its PYTHONPATH; this client is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx
from soak import started_server

from cobali.config.flags import positive_int

SHAPES = {
    "prose": r"Paris is( [a-z]{2,8}){12,16}\.",
    "json first": r'\{"city": "Paris", "rank": [1-9]\}( [a-z]{2,8}){12,16}\.',
}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def timed_stream(client: httpx.Client, url: str, regex: str, tools: bool) -> tuple[float, float, str]:
    """(seconds to the first content, seconds to the end, the content) of one streamed reply."""
    body = {"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 96, "temperature": 0,
            "stream": True, "structured_outputs": {"regex": regex}, **({"tools": [TOOL]} if tools else {})}
    start, first, content = time.perf_counter(), None, ""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                first = first if first is not None else time.perf_counter() - start
                content += text
    assert first is not None, "the reply had no content"
    return first, time.perf_counter() - start, content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--requests", type=positive_int, default=4, help="per shape and tools setting, per round")
    parser.add_argument("--threads", type=positive_int, default=1, help="the server's --threads")
    parser.add_argument("--checkout", default=None, help="serve from this checkout (e.g. /work/before)")
    args = parser.parse_args()
    if args.checkout is not None:  # the server's processes only: this one has imported its own cobali already
        os.environ["PYTHONPATH"] = os.path.abspath(args.checkout)
    cases = [(shape, tools) for shape in SHAPES for tools in (False, True)]
    first: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
    whole: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
    with started_server(["--threads", str(args.threads)]) as (url, _), httpx.Client(timeout=120) as client:
        for shape, tools in cases:  # warm-up: the prompt's KV, the grammar compiled
            print(f"{shape}, tools {'on' if tools else 'off'}: {timed_stream(client, url, SHAPES[shape], tools)[2]!r}")
        for round_ in range(args.rounds):
            for shape, tools in cases if round_ % 2 == 0 else cases[::-1]:
                for _ in range(args.requests):
                    to_first, to_end, _text = timed_stream(client, url, SHAPES[shape], tools)
                    first[shape, tools].append(to_first)
                    whole[shape, tools].append(to_end)
    for shape in SHAPES:
        off, on = (statistics.median(first[shape, tools]) * 1000 for tools in (False, True))
        end = statistics.median(whole[shape, True]) * 1000
        print(f"{shape}: TTFT p50 tools off {off:.1f} ms, on {on:.1f} ms, on/off {on / off:.2f}x "
              f"(reply's end p50, tools on: {end:.1f} ms; {len(first[shape, True])} requests each)")


if __name__ == "__main__":
    main()
