"""allOf in one schema: the conjunction of JSON schemas, keyword by keyword, so that json_schema_grammar writes
one grammar for it. Exact for the keywords the grammar holds; a keyword two members give different values that
cannot be combined is a ValueError naming it, never a looser schema."""

from __future__ import annotations

import json
from typing import Any

# Keywords that constrain no value: left out of the merged schema.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "$dynamicAnchor", "$defs", "definitions",
                         "$vocabulary", "contentMediaType", "contentEncoding"})
_LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"})
_PER_MEMBER = frozenset({"additionalProperties", "items", "prefixItems"})  # read against their member's siblings


class NoValue(ValueError):  # a ValueError: the server answers 400
    """A schema no value meets (false; allOf members with types that share no value, different consts, enums
    with no value in common): refused, unless it is one branch of an anyOf, which is then left out."""


def merge(parts: list[Any]) -> dict | bool:
    """One schema that holds exactly when every one of `parts` does (none has a $ref or an allOf at its top);
    False when no value can."""
    if any(part is False for part in parts):
        return False
    members = [part for part in parts if isinstance(part, dict)]  # true, or unreadable: no constraint
    merged: dict = {}
    try:
        for member in members:
            for key, value in member.items():
                if key not in ANNOTATIONS and key not in _PER_MEMBER:
                    merged[key] = _combine(key, merged[key], value) if key in merged else value
    except NoValue:
        return False
    _merge_extras(merged, members)
    _merge_items(merged, members)
    return merged


def asserts(schema: dict, *besides: str) -> bool:
    """Whether `schema` has a keyword that constrains values, other than `besides`."""
    return any(key not in ANNOTATIONS and key not in besides for key in schema)


def resolve(root: Any, ref: str) -> Any:
    """The schema a local reference points at in `root`; None for any other reference."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise ValueError(f"$ref {ref!r} points at nothing in the schema")
        target = target[part]
    return target


def all_of(schemas: list[Any]) -> Any:
    """A schema for all of `schemas`, as small as it can be written."""
    if any(schema is False for schema in schemas):
        return False
    kept = [schema for schema in schemas if schema is not True and schema != {}]
    return True if not kept else kept[0] if len(kept) == 1 else {"allOf": kept}


def _same(a: Any, b: Any) -> bool:
    """JSON equality (true is not 1, as JSON Schema reads them)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _combine(key: str, a: Any, b: Any) -> Any:
    if _same(a, b):
        return a
    if key in _LOWER:
        return max(a, b)
    if key in _UPPER:
        return min(a, b)
    if key == "type":
        return _types(a, b)
    if key == "required" and isinstance(a, list) and isinstance(b, list):
        return [*a, *(name for name in b if name not in a)]
    if key == "properties" and isinstance(a, dict) and isinstance(b, dict):
        return {name: all_of([a[name], b[name]]) if name in a and name in b else a.get(name, b.get(name))
                for name in {**a, **b}}
    if key in ("anyOf", "oneOf") and isinstance(a, list):
        return [{"allOf": [branch, {key: b}]} for branch in a]  # one of a's branches, and one of b's
    if key == "enum" and isinstance(a, list) and isinstance(b, list):
        common = [value for value in a if any(_same(value, other) for other in b)]
        if not common:
            raise NoValue("allOf members no value meets together")
        return common
    if key == "const":
        raise NoValue("allOf members no value meets together")
    raise ValueError(f"allOf members give {key!r} different values, which are not merged: {a!r} and {b!r}")


def _types(a: Any, b: Any) -> list[str]:
    left, right = ([t] if isinstance(t, str) else list(t) for t in (a, b))
    both = [t for t in left if t in right or (t == "integer" and "number" in right)]  # integers are numbers
    both += [t for t in right if t == "integer" and "number" in left and t not in both]
    if not both:
        raise NoValue("allOf members no value meets together")
    return both


def _merge_extras(merged: dict, members: list[dict]) -> None:
    """A member's additionalProperties holds for every key it does not declare itself, those other members
    declare included (false: the key may not appear). With patternProperties beside it, it is loosened."""
    properties = dict(merged.get("properties", {})) if isinstance(merged.get("properties"), dict) else {}
    extras = []
    for member in members:
        if "additionalProperties" not in member:
            continue
        extra = True if "patternProperties" in member else member["additionalProperties"]
        extras.append(extra)
        own = member.get("properties") if isinstance(member.get("properties"), dict) else {}
        properties = {name: sub if name in own else all_of([sub, extra]) for name, sub in properties.items()}
    if extras:
        merged["additionalProperties"] = all_of(extras)
    if properties:
        merged["properties"] = properties


def _merge_items(merged: dict, members: list[dict]) -> None:
    """Item i meets item i of every member: its prefixItems[i], or its items past its prefixItems."""
    arrays = [member for member in members if "items" in member or "prefixItems" in member]
    if not arrays:
        return
    shapes = [(member.get("prefixItems") if isinstance(member.get("prefixItems"), list) else [],
               member.get("items", True)) for member in arrays]
    length = max(len(prefix) for prefix, _ in shapes)
    if length:
        merged["prefixItems"] = [all_of([prefix[i] if i < len(prefix) else rest for prefix, rest in shapes])
                                 for i in range(length)]
    merged["items"] = all_of([rest for _, rest in shapes])
