"""What a JSON schema grows to once llguidance has inlined it: a `$ref` with keywords beside it (or as an
`allOf` member) is merged with a copy of the schema it names, so refs that each copy the level below twice grow
the schema exponentially. llguidance's own size limit is checked only after that expansion (seconds to minutes
for a few hundred bytes), so the size is estimated here first, in time linear in the schema."""

from __future__ import annotations

from typing import Any

MAX_INLINED_NODES = 100_000  # JSON values in the schema once inlined: real schemas stay far below
MAX_INLINE_DEPTH = 256  # refs inlined within refs
# Keywords that annotate and constrain nothing: beside a $ref they need no merge.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$id", "$schema", "$anchor"})
DEFINITIONS = ("$defs", "definitions")


def check_inlined_size(schema: Any) -> None:
    """ValueError when the schema would inline to more than MAX_INLINED_NODES values."""
    _Sizer(schema).size(schema, 0)


class _Sizer:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.sizes: dict[str, int] = {}  # inlined size of each ref target, by its pointer
        self.inlining: set[str] = set()  # targets being inlined now: a ref back to one is a recursive rule

    def size(self, value: Any, depth: int) -> int:
        if isinstance(value, list):
            return self._bounded(1 + sum(self.size(item, depth) for item in value))
        if not isinstance(value, dict):
            return 1
        ref = value.get("$ref")
        total = 1
        for key, child in value.items():
            if key in DEFINITIONS:
                continue  # counted where they are used
            if key == "allOf" and isinstance(child, list):
                total += sum(self._inlined(m["$ref"], depth) if _is_bare_ref(m) else self.size(m, depth)
                             for m in child)
            elif key != "$ref":
                total += self.size(child, depth)
        if isinstance(ref, str) and any(key not in ANNOTATIONS and key != "$ref" for key in value):
            total += self._inlined(ref, depth)
        return self._bounded(total)

    def _inlined(self, ref: str, depth: int) -> int:
        if ref in self.inlining:
            return 1  # recursion: llguidance writes a rule that refers back
        if depth >= MAX_INLINE_DEPTH:
            raise ValueError(f"the schema inlines $refs more than {MAX_INLINE_DEPTH} deep")
        if ref not in self.sizes:
            target = _resolve(self.root, ref)
            self.inlining.add(ref)
            try:
                self.sizes[ref] = self.size(target, depth + 1)
            finally:
                self.inlining.discard(ref)
        return self.sizes[ref]

    @staticmethod
    def _bounded(total: int) -> int:
        if total > MAX_INLINED_NODES:
            raise ValueError(f"the schema grows past {MAX_INLINED_NODES} values once its $refs with keywords "
                             "beside them (and allOf members) are merged in: flatten it or drop those keywords")
        return total


def _is_bare_ref(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("$ref"), str)


def _resolve(root: Any, ref: str) -> Any:
    """A local ref's target ("#/$defs/x"); anything else (remote, or missing) counts as one value here, and
    llguidance refuses it with its own message."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
