"""Every command in the docs runs as written (issue 45).

Each `cobali ...` command of a fenced `sh` block in README.md and docs/*.md parses with the real parser. A block
whose first line is the marker `# runs in the tests` is also run, line by line, in a fresh directory: those are
the short ones (seconds each, on the embedded model, no network and no server). Every relative link in those
pages, bench/README.md and docs/results.md lands on a file, and a link into a markdown page on one of its
headings. docs/results.md's commands are records of past runs, with placeholders for what varied: only its
fences and links are checked."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cobali.faces.cli import build_parser
from tests.conftest import require_embedded_model

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md"))
LINKED = (*PAGES, ROOT / "docs" / "results.md", ROOT / "bench" / "README.md")
RUN_MARKER = "# runs in the tests"
# Doc commands run from the checkout's root: the scratch directory they run in sees these of its folders.
LINKED_DIRS = ("workloads", "cobali")
# Files some flags read while the command line is parsed (--api-key-file, --lora-modules): a doc's placeholder
# for one must be named here (a folder's too, --models-dir's, by a file in it). Each holds one line (a key, for a
# key file).
PLACEHOLDER_FILES = ("keys.txt", "lora.gguf", "chat.gguf", "coder.gguf", "models/chat.gguf")
RUN_TIMEOUT_S = 180  # a marked command takes seconds; this is for a loaded 2-core machine
SEPARATORS = frozenset({"&&", "||", ";", "|", "&"})
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str  # as written, continuation lines joined

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's
    language: str
    body: tuple[tuple[int, str], ...]  # (line number, line)

    @property
    def runs(self) -> bool:
        return bool(self.body) and self.body[0][1].strip().startswith(RUN_MARKER)

    def commands(self) -> Iterator[Command]:
        """The block's commands, a line ending in a backslash joined to the next; comment lines skipped."""
        pending: list[str] = []
        start = 0
        for number, line in self.body:
            start = start if pending else number
            if line.rstrip().endswith("\\"):
                pending.append(line.rstrip()[:-1])
                continue
            text = " ".join(part.strip() for part in [*pending, line]).strip()
            pending = []
            if text and not text.startswith("#"):
                yield Command(self.page, start, text)
        assert not pending, f"{self.page.relative_to(ROOT)}:{start}: a continued line ends the block"


def fenced_blocks(page: Path) -> list[Block]:
    """The page's fenced code blocks; a fence left open is an error naming its line."""
    blocks: list[Block] = []
    opened: tuple[int, str, str] | None = None  # line, fence, language
    body: list[tuple[int, str]] = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if opened is None and match:
            opened, body = (number, match.group(1), (match.group(2).split() or [""])[0]), []
        elif opened is not None and match and match.group(1).startswith(opened[1]) and not match.group(2).strip():
            blocks.append(Block(page, opened[0], opened[2], tuple(body)))
            opened = None
        elif opened is not None:
            body.append((number, line))
    assert opened is None, f"{page.relative_to(ROOT)}:{opened[0]}: a code fence is never closed"
    return blocks


def argvs(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell line (split at &&, ||, ;, | and &), less its leading VAR=value words."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token not in SEPARATORS:
            words.append(token)
            continue
        while words and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)
        if words:
            yield words
        words = []


def cobali_commands() -> list[tuple[Command, list[str]]]:
    found = []
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.language == "sh":
                found += [(c, argv[1:]) for c in block.commands() for argv in argvs(c.text) if argv[0] == "cobali"]
    return found


def run_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page) if b.language == "sh" and b.runs]


def scratch_checkout(directory: Path) -> Path:
    """A directory where doc commands find what they name: the checkout's workloads and package folders, and the
    placeholder files."""
    for name in LINKED_DIRS:
        (directory / name).symlink_to(ROOT / name)
    for name in PLACEHOLDER_FILES:
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_text("placeholder\n")
    return directory


@pytest.mark.parametrize(("command", "argv"), [pytest.param(c, a, id=str(c)) for c, a in cobali_commands()])
def test_every_cobali_command_parses(command: Command, argv: list[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scratch_checkout(tmp_path))
    errors = io.StringIO()
    code: str | int | None = 0
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as done:  # --help exits 0; an unknown flag, a bad choice or value exits 2
        code = done.code
    if code:
        pytest.fail(f"{command}: `{command.text}` does not parse: {errors.getvalue().strip().splitlines()[-1]}")


@pytest.mark.parametrize("block", [pytest.param(b, id=f"{b.page.relative_to(ROOT)}:{b.line}") for b in run_blocks()])
def test_marked_blocks_run(block: Block, tmp_path: Path) -> None:
    """The block's lines in order, in one fresh directory (a line may use what the one before wrote)."""
    require_embedded_model()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    directory = scratch_checkout(tmp_path)
    for command in block.commands():
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command.text], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, (f"{command}: `{command.text}` exited {done.returncode}:\n"
                                      f"{(done.stdout + done.stderr)[-3000:]}")


def test_the_docs_have_commands_to_check() -> None:
    """The extraction finds what the pages hold: a parser that found nothing would pass every check above."""
    assert len(cobali_commands()) >= 20
    assert {b.page.name for b in run_blocks()} >= {"README.md", "scale-out.md", "benchmarks.md"}


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN").replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    in_block = {n for b in fenced_blocks(page) for n, _ in b.body}
    lines = page.read_text().splitlines()
    return {slug(line.lstrip("#")) for n, line in enumerate(lines, 1) if line.startswith("#") and n not in in_block}


def prose(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) outside code blocks, inline code taken out."""
    in_block = {n for b in fenced_blocks(page) for n, _ in b.body}
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if number not in in_block:
            yield number, re.sub(r"`[^`]*`", "", line)


def links(page: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition."""
    for number, line in prose(page):
        for target in re.findall(r"\]\(([^)\s]+)[^)]*\)", line) + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", line):
            yield number, target


@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in LINKED])
def test_relative_links_land(page: Path) -> None:
    broken = []
    for number, target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target}: no heading #{anchor} in {file.name}")
    defined = {label.lower() for _, line in prose(page) for label in re.findall(r"^\s*\[([^\]]+)\]:", line)}
    broken += [f"{page.relative_to(ROOT)}:{number}: [{label}]: no such reference" for number, line in prose(page)
               for label in re.findall(r"\]\[([^\]]+)\]", line) if label.lower() not in defined]
    assert not broken, "\n".join(broken)


def test_the_readme_maps_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's map of docs/ leaves out {missing}"
