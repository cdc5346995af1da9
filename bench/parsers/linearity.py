"""Whether every reply parser costs time linear in the reply: each tool-call and reasoning parser over replies
made of its own tags (its openers, closers and markers repeated, partial tags, a run of spaces or `[[[[` JSON
after an opener or inside a call, complete calls or messages back to back), and over attacks on one format's own
grammar that were slow or raised before (SPECIFIC: `<parameter=` repeated in a Qwen3-Coder call, a long name
after `[TOOL_CALLS]`, spaces after a DeepSeek call's opener, ...), read whole and streamed in 4-character
pieces, at two sizes (64k and 128k characters by default).

    .venv/bin/python bench/parsers/linearity.py [--sizes 65536 131072] [--json OUT] [--cap 20]
    .venv/bin/python bench/parsers/linearity.py --smoke          # tiny sizes: runs everything, proves nothing
    PYTHONPATH=/work/before .venv/bin/python bench/parsers/linearity.py   # an older checkout (the same commands)

Each measurement runs in a forked child (the best of --repeat, fewer where one run is slow), killed after --cap
seconds and reported as ">CAP s" (the larger size then is not run), so a quadratic parser on an older checkout
still lets the table end. The ratio is per doubling of the size (`(t_large / t_small) ** (1 / log2(large /
small))`); the verdict is `linear` where, whole and streamed, it is at most 2.5 and the large size takes at most
1 s (a ratio under a time of 50 ms is noise and is not held against it), else `SLOW`; `error` where the parser
raised. Only the registries and the stream API that every checkout since the parsers' split shares are used
(`TOOL_PARSERS`, `DEFAULT_TOOL_PARSER`, `REASONING_PARSERS`, `.parse`, `.stream`, `.feed`, `.finish`,
`.special_tags`, `.call_head`, `.call_tail`, `.opening`, `.separator`, `.closing`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import cobali
from cobali.frontend.parsers.reasoning import REASONING_PARSERS
from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS

# The one tool a call may name; its parameter `a` typed, so that a Qwen3-Coder call reads its value as JSON.
TOOLS = {"f": {"type": "object", "properties": {"a": {"type": "array"}}}}
PIECE = 4  # characters a streamed feed
NOISE_S = 0.05  # below this, a ratio is mostly noise (a shared machine, the timer)
MAX_S, MAX_RATIO = 1.0, 2.5


class Case(NamedTuple):
    head: str  # written once, first
    unit: str  # repeated to the size
    tail: str = ""  # written once, last (a call or block closed after the run)


QWEN_CALL = "<tool_call>\n<function=f>\n"
DS_BLOCK, DS_CALL, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁calls▁end｜>"
HARMONY_CALL = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
# Formats whose calls are no JSON arguments after a head: a whole call, written out.
WHOLE_CALLS = {"tools/qwen3_coder": f"{QWEN_CALL}<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"}
MESSAGES = {"reasoning/openai_gptoss": "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final"
                                       "<|message|>y<|end|><|start|>assistant"}
# Attacks on one format's grammar past what its tags and call head make (cases() writes those for every parser):
# each was slow (over 20 s at 128k for some) or raised before issue 44.
SPECIFIC: dict[str, dict[str, Case]] = {
    "tools/hermes": {"opener, text": Case("<tool_call>", "abcd")},
    "tools/qwen3_coder": {
        "<parameter= repeated": Case(QWEN_CALL, "<parameter=", "</function></tool_call>"),
        "<parameter= repeated, open": Case(QWEN_CALL, "<parameter="),
        "parameters": Case(QWEN_CALL, "<parameter=a>x", "</tool_call>"),
        "<function= repeated": Case("<tool_call>\n", "<function=", "</tool_call>"),
        "parameter, deep [[[": Case(f"{QWEN_CALL}<parameter=a>\n", "[", "</tool_call>"),
    },
    "tools/llama3_json": {"spaces": Case("", " "), "{, spaces": Case("{", " "), "[, spaces": Case("[", " ")},
    "tools/mistral": {"long name": Case("[TOOL_CALLS]", "a")},
    "tools/deepseek_v3": {"call openers": Case(DS_BLOCK, DS_CALL, DS_END),
                          "call opener, spaces": Case(DS_BLOCK + DS_CALL, " ", DS_END)},
    "tools/openai": {"markers": Case("", "<|start|>assistant<|channel|>"),
                     "calls, <|call|>": Case("", HARMONY_CALL + '{"a": 1}<|call|>')},
}
SPECIFIC["tools/deepseek_v31"] = SPECIFIC["tools/deepseek_v3"]
SPECIFIC["tools/hermes_or_llama3_json"] = SPECIFIC["tools/hermes"] | SPECIFIC["tools/llama3_json"]


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


def cases(name: str, kind: str, parser: Any) -> dict[str, Case]:
    """The cases every parser gets, from its tags and call head, then those of SPECIFIC that are its own."""
    tags = tuple(parser.special_tags)
    opener, closer = tags[0], tags[1] if len(tags) > 1 else tags[0]
    head = call_head(parser) if kind == "tools" else None
    made = {
        "all tags": Case("", "".join(tags)),
        "openers": Case("", opener),
        "closers": Case("", closer),
        "tag prefixes": Case("", "".join(t[:-1] for t in tags)),
        "opener, spaces": Case(opener, " "),
        "deep [[[": Case(opener, "["),
    }
    if head is not None:  # inside a call, as a forced one is written: the block's opening, the call's head
        made["call head, spaces"] = Case(parser.opening + head, " ")
        made["call head, deep [[["] = Case(parser.opening + head, "[")
        made["calls"] = Case(parser.opening, f"{head}{{}}{parser.call_tail}{parser.separator}", parser.closing)
    elif name in WHOLE_CALLS:
        made["calls"] = Case("", WHOLE_CALLS[name])
    elif kind == "reasoning":
        made["messages"] = Case("", MESSAGES.get(name, f"{opener}x{closer}"))
    return made | SPECIFIC.get(name, {})


def reply(case: Case, size: int) -> str:
    body = size - len(case.head) - len(case.tail)
    return case.head + (case.unit * (body // len(case.unit) + 1))[:body] + case.tail


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
            times: list[float | str] = []
            for streamed in (False, True):
                times.append(measure(name, case, small, streamed, repeat, cap))
                over = isinstance(times[-1], str) and times[-1].startswith(">")
                times.append(times[-1] if over else measure(name, case, large, streamed, repeat, cap))
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
