"""Whether every reply parser costs time linear in the reply: each tool-call and reasoning parser over replies
made of its own tags (its openers, closers and markers repeated, partial tags, a run of spaces after an opener,
`[[[[` JSON deep inside a call, complete calls or messages back to back), read whole and streamed in 4-character
pieces, at two sizes (64k and 128k characters by default).

    .venv/bin/python bench/parsers/linearity.py [--sizes 65536 131072] [--json OUT] [--cap 20]
    .venv/bin/python bench/parsers/linearity.py --smoke          # tiny sizes: runs everything, proves nothing
    PYTHONPATH=/work/before .venv/bin/python bench/parsers/linearity.py   # an older checkout (the same commands)

Each measurement runs in a forked child (the best of --repeat, fewer where one run is slow), killed after --cap
seconds and reported as ">CAP s", so a quadratic parser on an older checkout still lets the table end. The ratio
is per doubling of the size (`(t_large / t_small) ** (1 / log2(large / small))`); the verdict is `linear` where,
whole and streamed, it is at most 2.5 and the large size takes at most 1 s (a ratio under a time of 50 ms is
noise and is not held against it), else `SLOW`; `error` where the parser raised. Only the registries and the
stream API that every checkout since the parsers' split shares are used (`TOOL_PARSERS`, `DEFAULT_TOOL_PARSER`,
`REASONING_PARSERS`, `.parse`, `.stream`, `.feed`, `.finish`, `.special_tags`, `.call_head`, `.call_tail`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from typing import Any

import cobali
from cobali.frontend.parsers.reasoning import REASONING_PARSERS
from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS

TOOLS = ["f"]  # the one tool a call may name
PIECE = 4  # characters a streamed feed
NOISE_S = 0.05  # below this, a ratio is mostly noise (a shared machine, the timer)
MAX_S, MAX_RATIO = 1.0, 2.5
# Formats whose calls are no JSON arguments after a head: a whole call, written out.
WHOLE_CALLS = {"tools/qwen3_coder": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
                                    "</tool_call>"}
MESSAGES = {"reasoning/openai_gptoss": "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final"
                                       "<|message|>y<|end|><|start|>assistant"}


def parsers() -> dict[str, tuple[str, Any]]:
    """Every parser, as `KIND/NAME` (a tool-call and a reasoning parser may share a name): (its kind, it)."""
    found: dict[str, tuple[str, Any]] = {f"tools/{name}": ("tools", p) for name, p in TOOL_PARSERS.items()}
    found[f"tools/{DEFAULT_TOOL_PARSER.name}"] = ("tools", DEFAULT_TOOL_PARSER)
    found.update({f"reasoning/{name}": ("reasoning", p) for name, p in REASONING_PARSERS.items()})
    return found


def call_head(parser: Any) -> str | None:
    try:
        return str(parser.call_head("f"))
    except (NotImplementedError, AttributeError):
        return None


def cases(name: str, kind: str, parser: Any) -> dict[str, tuple[str, str]]:
    """Each case: (a head written once, a unit repeated to the size)."""
    tags = tuple(parser.special_tags)
    opener, closer = tags[0], tags[1] if len(tags) > 1 else tags[0]
    head = call_head(parser) if kind == "tools" else None
    made = {
        "all tags": ("", "".join(tags)),
        "openers": ("", opener),
        "closers": ("", closer),
        "tag prefixes": ("", "".join(t[:-1] for t in tags)),
        "opener, spaces": (opener, " "),
        "deep [[[": (head or opener, "["),
    }
    if head is not None:
        made["calls"] = ("", f"{head}{{}}{parser.call_tail}")
    elif name in WHOLE_CALLS:
        made["calls"] = ("", WHOLE_CALLS[name])
    elif kind == "reasoning":
        made["messages"] = ("", MESSAGES.get(name, f"{opener}x{closer}"))
    return made


def reply(case: tuple[str, str], size: int) -> str:
    head, unit = case
    return (head + unit * (size // len(unit) + 1))[:size]


def runner(kind: str, parser: Any, text: str, streamed: bool) -> Callable[[], object]:
    """One read of `text`: whole, or fed in PIECE-character pieces, then finished."""
    if not streamed:
        return (lambda: parser.parse(text, TOOLS)) if kind == "tools" else (lambda: parser.parse(text))
    pieces = [text[i:i + PIECE] for i in range(0, len(text), PIECE)]

    def feed() -> object:
        stream = parser.stream(TOOLS) if kind == "tools" else parser.stream()
        for piece in pieces:
            stream.feed(piece)
        return stream.finish()

    return feed


def _child(name: str, case: str, size: int, streamed: bool, repeat: int, budget_s: float, out: Any) -> None:
    kind, parser = parsers()[name]
    run = runner(kind, parser, reply(cases(name, kind, parser)[case], size), streamed)
    best, spent = math.inf, 0.0
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
            if spent > budget_s:
                break
        out.send(("ok", best))
    except Exception as err:  # a parser that raises on hostile text is a finding, not the end of the table
        out.send(("error", f"{type(err).__name__}: {str(err)[:60]}"))


def measure(name: str, case: str, size: int, streamed: bool, repeat: int, cap_s: float) -> float | str:
    """Seconds (the best run), or a string: over the cap, or the parser's error."""
    context = multiprocessing.get_context("fork")  # the parsers are imported once, in this process
    ours, theirs = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(name, case, size, streamed, repeat, cap_s / 4, theirs))
    child.start()
    theirs.close()
    got = ours.poll(cap_s)
    if not got:
        child.kill()
    child.join()
    if not got:
        return f">{cap_s:g} s"
    status, value = ours.recv()
    return value if status == "ok" else f"error {value}"


def per_doubling(small: float | str, large: float | str, ratio_sizes: float) -> float | None:
    if isinstance(small, str) or isinstance(large, str):
        return None
    return (large / max(small, 1e-9)) ** (1 / math.log2(ratio_sizes))


def verdict(times: list[float | str], ratios: list[float | None]) -> str:
    if any(isinstance(t, str) and t.startswith("error") for t in times):
        return "error"
    for large, ratio in zip(times[1::2], ratios, strict=True):
        if isinstance(large, str) or large > MAX_S or (ratio is not None and ratio > MAX_RATIO and large >= NOISE_S):
            return "SLOW"
    return "linear"


def shown(value: float | str | None, digits: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value.split(":")[0]  # an error's name: its message is in the JSON
    return format(value, digits)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--sizes", type=int, nargs=2, default=[65536, 131072], metavar=("SMALL", "LARGE"),
                     help="reply sizes in characters (default: 64k and 128k)")
    cli.add_argument("--cap", type=float, default=20.0, help="seconds a measurement may take (default 20)")
    cli.add_argument("--repeat", type=int, default=5, help="runs a measurement, the best kept (default 5)")
    cli.add_argument("--only", nargs="*", default=None, metavar="PARSER",
                     help="these parsers alone (KIND/NAME, as the table names them)")
    cli.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON here")
    cli.add_argument("--smoke", action="store_true", help="tiny sizes, one run, a short cap: for CI")
    args = cli.parse_args()
    small, large = (256, 512) if args.smoke else args.sizes
    repeat, cap = (1, 5.0) if args.smoke else (args.repeat, args.cap)
    rows = []
    header = ["parser", "case", f"whole {small}", f"whole {large}", "ratio", f"streamed {small}",
              f"streamed {large}", "ratio", "verdict"]
    print(f"parsers of {cobali.__file__.removesuffix('/__init__.py')}, Python {sys.version.split()[0]}\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for name, (kind, parser) in parsers().items():
        if args.only is not None and name not in args.only:
            continue
        for case in cases(name, kind, parser):
            times = [measure(name, case, size, streamed, repeat, cap)
                     for streamed in (False, True) for size in (small, large)]
            ratios = [per_doubling(times[0], times[1], large / small), per_doubling(times[2], times[3], large / small)]
            judged = verdict(times, ratios)
            rows.append({"parser": name, "case": case, "sizes": [small, large], "whole_s": times[:2],
                         "streamed_s": times[2:], "ratios": ratios, "verdict": judged})
            cells = [name, case, *(shown(t, ".4f") for t in times[:2]), shown(ratios[0], ".2f"),
                     *(shown(t, ".4f") for t in times[2:]), shown(ratios[1], ".2f"), judged]
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.json is not None:
        with open(args.json, "w") as out:
            json.dump({"python": sys.version, "cobali": cobali.__file__, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
