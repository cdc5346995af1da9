"""Regenerate the shipped workloads from text that ships with Python (stdlib docstrings, the Zen of Python).

Run `.venv/bin/python workloads/make_workloads.py`. Output is deterministic for a given Python version
(the files in the repo were made with CPython 3.11); token counts use the embedded SmolLM2 tokenizer.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import inspect
import io
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

OUT = Path(__file__).resolve().parent
SEED = 20240611
MODULE_NAMES = (
    "abc argparse asyncio base64 bisect builtins calendar codecs collections concurrent.futures configparser "
    "contextlib copy csv dataclasses datetime decimal difflib email.message enum fractions ftplib functools "
    "gettext glob gzip heapq hmac html.parser http.client http.cookiejar http.server imaplib inspect io "
    "ipaddress itertools json logging logging.handlers mailbox mimetypes multiprocessing.pool os pathlib "
    "pickle pkgutil platform poplib pprint queue random re sched secrets selectors shelve shlex shutil "
    "smtplib socket socketserver statistics string subprocess tarfile tempfile textwrap threading timeit "
    "tokenize traceback typing unittest urllib.parse urllib.request uuid warnings weakref zipfile"
)
BAD = re.compile(r">>>|::|[`|\\{}]|\.\. ")
SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
LONG = (
    "Summarize the following documentation in two sentences: {text}",
    "Explain what this does in plain English: {text}",
    "Read this passage from the Python documentation and list its three most important points. {text}",
    "Rewrite the following text so that a beginner programmer can understand it: {text}",
    "Here is some reference documentation. {text} Based on it, write a short usage guide.",
    "Find anything unclear or ambiguous in the following documentation and suggest better wording: {text}",
)
SHORT = (
    "What is {name} used for in Python?",
    "Give one example of when to use {name}.",
    "Explain this in simple words: {first}",
    "Is the following statement about {name} true? {first}",
    "Summarize in five words: {first}",
    "Write a one-line comment describing this behaviour: {first}",
    "What does the Zen of Python mean by this line? {zen}",
)
Doc = tuple[str, list[str]]
Counter = Callable[[str], int]


def prose_paragraphs(doc: str) -> list[str]:
    """The plain-prose paragraphs of a docstring (no code, lists, markup or non-ASCII), each on one line."""
    out: list[str] = []
    for para in doc.split("\n\n"):
        lines = para.strip("\n").splitlines()
        if any(line[:1].isspace() or line.lstrip()[:1] in "-*+" for line in lines):
            continue
        text = " ".join(para.split())
        if len(text) < 40 or not text.isascii() or BAD.search(text) or not text.endswith("."):
            continue
        if sum(c.isalpha() or c.isspace() for c in text) < 0.9 * len(text):
            continue
        out.append(text)
    return out


def prose(doc: str) -> list[str]:
    """Sentences of the plain-prose paragraphs of a docstring."""
    return [s for text in prose_paragraphs(doc) for s in SPLIT.split(text) if len(s) >= 20]


def collect_docs() -> list[list[Doc]]:
    """Per module, in a fixed order: the module's docstring, then its classes, methods and functions."""
    seen: set[str] = set()
    modules: list[list[Doc]] = []
    for modname in MODULE_NAMES.split():
        docs: list[Doc] = []
        mod = importlib.import_module(modname)
        objs: list[tuple[str, object]] = [(modname, mod)]
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != modname:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                objs.append((f"{modname}.{attr}", obj))
            if inspect.isclass(obj):
                methods = sorted((m, f) for m, f in vars(obj).items() if inspect.isfunction(f))
                objs += [(f"{modname}.{attr}.{m}", f) for m, f in methods if not m.startswith("_")]
        for name, obj in objs:
            doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                if sents := prose(doc):
                    docs.append((name, sents))
        modules.append(docs)
    return modules


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    lines = codecs.decode(this.s, "rot13").splitlines()[2:]
    return [line for line in lines if line.strip()]


def make_counter() -> tuple[Counter, str]:
    try:
        from cobali.backends.llama_cpp import LlamaCppBackend
        from cobali.backends.llama_cpp.config import LlamaCppConfig

        backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=1, n_batch=64))
        return (lambda text: len(backend.tokenize(text))), "SmolLM2-135M-Instruct tokenizer"
    except Exception as exc:  # no engine build: approximate, and say so
        print(f"tokenizer unavailable ({exc}); counting len(text)//4", file=sys.stderr)
        return (lambda text: len(text) // 4), "approximation len(text)//4 (tokenizer unavailable)"


class Workload:
    """One file's source feed: modules in a file-specific shuffled order, each document used at most once."""

    def __init__(self, name: str, modules: list[list[Doc]], zen: list[str], count: Counter) -> None:
        self.rng = random.Random(f"{SEED}-{name}")
        self.docs: Iterator[Doc] = (doc for docs in self.rng.sample(modules, len(modules)) for doc in docs)
        self.zen = self.rng.sample(zen, len(zen))
        self.count = count
        self.carry = 0  # target tokens minus tokens made so far: keeps the file total on target

    def long(self, target: int, lo: int, hi: int) -> str:
        """A task over whole sentences of successive documents, as near `target` tokens as they allow."""
        want = max(lo, min(hi, target + self.carry))
        template = self.rng.choice(LONG)
        parts: list[str] = []
        best, best_n = "", 0
        while True:
            name, sents = next(self.docs)
            for i, sentence in enumerate(sents):
                piece = f"On {name}: {sentence}" if i == 0 else sentence
                text = template.format(text=" ".join([*parts, piece]))
                n = self.count(text)
                if n > want:
                    if not parts and n - want > max(8, want // 5):
                        break  # the document opens with too long a sentence: try the next one
                    if parts and best_n >= lo and (want - best_n < n - want or n > hi):
                        text, n = best, best_n
                    self.carry += target - n
                    return text
                parts.append(piece)
                best, best_n = text, n

    def short(self, lo: int, hi: int) -> str:
        """A short chat-like question within [lo, hi] tokens."""
        while True:
            template = self.rng.choice(SHORT)
            if "{zen}" in template:
                if not self.zen:
                    continue
                text = template.format(zen=self.zen.pop())
            else:
                name, sents = next(self.docs)
                text = template.format(name=name, first=sents[0])
            if lo <= self.count(text) <= hi:
                return text

    def max_tokens(self, n: int, lo: int, hi: int, total: int) -> list[int]:
        """n values in [lo, hi] summing exactly to `total`."""
        values = [self.rng.randint(lo, hi) for _ in range(n)]
        while (gap := total - sum(values)) != 0:
            i = self.rng.randrange(n)
            values[i] = max(lo, min(hi, values[i] + (1 if gap > 0 else -1)))
        return values


def spread(rng: random.Random, n: int, lo: int, hi: int, mean: float) -> list[int]:
    """n log-normal lengths clipped to [lo, hi], rescaled until their mean is `mean`."""
    values = [rng.lognormvariate(0.0, 0.6) for _ in range(n)]
    for _ in range(50):
        scale = mean * n / sum(values)
        values = [min(hi, max(lo, v * scale)) for v in values]
    return [round(v) for v in values]


SCENARIOS = {  # name: (default max_tokens, description)
    "short_burst": (32, "32 short chat-like questions (10-40 prompt tokens), 32 new tokens each."),
    "long_context": (64, "8 long documentation tasks (1000-1500 prompt tokens each), 64 new tokens each."),
    "mixed_length": (128, "64 requests, 40 short chat-like and 24 long document tasks: ~13.4k prompt tokens, "
                     "~5.1k output tokens (per-request max_tokens 16-200)."),
    "stress": (32, "128 requests: 64 short, 48 medium (80-300 tokens), 16 long (400-900); max_tokens 16-64."),
}


def build(docs: list[list[Doc]], zen: list[str], count: Counter) -> dict[str, list[dict]]:
    files: dict[str, list[dict]] = {}
    w = Workload("prompts_16", docs, zen, count)
    targets = [round(40 * (700 / 40) ** (i / 15)) for i in range(16)]
    files["prompts_16"] = [{"prompt": w.long(t, 30, 720)} for t in w.rng.sample(targets, 16)]
    w = Workload("prompts_186", docs, zen, count)
    files["prompts_186"] = [{"prompt": w.long(t, 40, 400)} for t in spread(w.rng, 186, 40, 400, 150)]
    w = Workload("short_burst", docs, zen, count)
    files["short_burst"] = [{"prompt": w.short(10, 40)} for _ in range(32)]
    w = Workload("long_context", docs, zen, count)
    files["long_context"] = [{"prompt": w.long(w.rng.randint(1000, 1500), 1000, 1500)} for _ in range(8)]
    w = Workload("mixed_length", docs, zen, count)
    reqs = [{"prompt": w.short(10, 60)} for _ in range(40)]
    targets = spread(w.rng, 24, 200, 1000, 500)
    w.carry = 13400 - sum(count(r["prompt"]) for r in reqs) - sum(targets)
    reqs += [{"prompt": w.long(t, 150, 1000)} for t in targets]
    w.rng.shuffle(reqs)
    outs = w.max_tokens(64, 16, 200, 5100)
    files["mixed_length"] = [{**r, "max_tokens": m} for r, m in zip(reqs, outs, strict=True)]
    w = Workload("stress", docs, zen, count)
    reqs = [{"prompt": w.short(10, 40)} for _ in range(64)]
    reqs += [{"prompt": w.long(w.rng.randint(80, 300), 60, 320)} for _ in range(48)]
    reqs += [{"prompt": w.long(w.rng.randint(400, 900), 380, 920)} for _ in range(16)]
    w.rng.shuffle(reqs)
    files["stress"] = [{**r, "max_tokens": w.rng.randint(16, 64)} for r in reqs]
    return files


def main() -> None:
    docs, zen = collect_docs(), zen_lines()
    count, counted_with = make_counter()
    rows = ["| file | prompts | prompt tokens | min | mean | max | total max_tokens |", "|---" * 7 + "|"]
    for name, reqs in build(docs, zen, count).items():
        assert all("\n" not in r["prompt"] for r in reqs)
        if name in SCENARIOS:
            default, description = SCENARIOS[name]
            body = {"name": name, "description": description, "max_tokens": default, "requests": reqs}
            path = OUT / f"{name}.json"
            path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
            outputs = str(sum(r.get("max_tokens", default) for r in reqs))
        else:
            path = OUT / f"{name}.txt"
            path.write_text("".join(r["prompt"] + "\n" for r in reqs), encoding="utf-8")
            outputs = "(--max-new)"
        n = [count(r["prompt"]) for r in reqs]
        rows.append(f"| `{path.name}` | {len(n)} | {sum(n)} | {min(n)} | {sum(n) / len(n):.0f} | {max(n)} "
                    f"| {outputs} |")
    table = "\n".join(rows) + f"\n\nCounted with the {counted_with}, Python {sys.version.split()[0]}.\n"
    print(table)
    readme, start, end = OUT / "README.md", "<!-- stats -->\n", "<!-- /stats -->"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if start in text and end in text:  # refresh the measured table in the README
        head, rest = text.split(start, 1)
        readme.write_text(head + start + table + end + rest.split(end, 1)[1], encoding="utf-8")


if __name__ == "__main__":
    main()
