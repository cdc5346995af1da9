"""JSON Schema -> llama.cpp GBNF grammar, so that the output is a JSON text the schema accepts.

Held exactly:
- "type" (object, array, string, integer, number, boolean, null, or a list of these; object and array implied
  by "properties" and "items"), "anyOf" and "allOf" (merged: schema_merge), with the keywords beside them;
- "enum" and "const": the listed values that meet the rest of the schema (checked with jsonschema);
- "$ref" to the schema itself or into it ("#", "#/$defs/Name", "#/definitions/Name"; recursion included), as
  pydantic and the openai client's `parse` write them, with keywords beside it (as an allOf); a cycle of $refs
  that never reaches a schema is a ValueError; an anyOf branch referring back to the $ref being written before
  anything is written adds no value, and is left out (back through other $refs' rules it is a ValueError);
- objects: "properties" in schema order, those not "required" optional, a required key not among them as any
  value (its additionalProperties schema, if any); without "properties", an "additionalProperties" schema gives
  a map of any keys to it, and `false` the empty object;
- arrays: "items", "prefixItems", "minItems", "maxItems";
- strings: "pattern" (see regex_grammar), "minLength", "maxLength", "format" date, time, date-time, uuid;
- integers: "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" (integer_grammar).

Loosened (the output is still JSON, and holds the rest of the schema): "oneOf" (as anyOf), bounds of non-integer
numbers, multiples, remote "$ref"s, "patternProperties", a "pattern" regex_grammar refuses, "minLength"/"maxLength"
beside a "pattern" (the pattern is held) and either beside a "format" (the format is), length and item bounds past
MAX_BOUND, and any other keyword. Objects get no properties beyond those declared or required, each at most once.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from referencing.exceptions import Unresolvable

from cobali.server.gbnf import JSON_FORMATS, JSON_RULES, alternatives, counted, json_literal, repeat, repeat_fits
from cobali.server.integer_grammar import integer_bounds, integer_range
from cobali.server.regex_grammar import json_string_expression
from cobali.server.schema_merge import NoValue, asserts, merge, resolve

JSON_OBJECT_GRAMMAR = "root ::= object" + JSON_RULES  # JSON_RULES: llama.cpp's json.gbnf, in gbnf

_INTEGER_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})  # each has a rule of that name
MAX_BOUND = 500  # length and item bounds above this are dropped: llama.cpp caps repetitions
MAX_SCHEMA_DEPTH = 64  # nesting refused past this (ValueError), before Python's recursion limit is


def json_schema_grammar(schema: Any) -> str:
    converter = SchemaConverter()
    root = converter.visit_document(schema)
    return f"root ::= {root}\n{converter.rules_text()}{JSON_RULES}"


def _bound(schema: dict, key: str) -> int | None:
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BOUND else None


def _valid(validator: Any, value: Any) -> bool:
    try:
        return validator.is_valid(value)
    except (Unresolvable, OverflowError):
        return True  # a remote $ref, or jsonschema's multipleOf on an integer past floats: loosened
    except RecursionError:  # {"enum": [1], "anyOf": [{"$ref": "#"}]}: validators loop on it too
        raise ValueError("the schema's $refs recurse without end when its enum or const is checked") from None


class SchemaConverter:
    """Schemas to GBNF rules, one namespace of rules for several schemas (a tool call's functions)."""

    def __init__(self) -> None:
        self.root: Any = None  # the document "$ref"s point into
        self.rules: dict[str, str] = {}
        self.refs: dict[tuple[int, str], str | NoValue] = {}  # a NoValue: the referenced schema allows none
        self.depth = 0
        self.left: tuple[int, str] | None = None  # the $ref whose rule is being built with nothing written yet
        self.firsts: dict[tuple[int, str], set[tuple[int, str]]] = {}  # the $refs each one's rule may start with

    def visit_document(self, schema: Any) -> str:
        """A schema with its own "$ref" namespace; one rule for it, as for "#"."""
        self.root = schema
        return self.visit({"$ref": "#"})

    def rules_text(self) -> str:
        return "".join(f"{name} ::= {body}\n" for name, body in self.rules.items())

    def visit(self, schema: Any) -> str:
        """A GBNF expression for `schema`; objects, arrays and references get rules of their own."""
        self.depth += 1
        try:
            if self.depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"response_format schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            return self._visit(schema)
        finally:
            self.depth -= 1

    def _visit(self, schema: Any) -> str:
        if schema is False:
            raise NoValue("the schema allows no value (false, or allOf members no value meets together)")
        if not isinstance(schema, dict):
            return "value"  # true, {} or anything unreadable: any JSON value
        if isinstance(schema.get("$ref"), str) and not asserts(schema, "$ref"):
            return self._ref(schema["$ref"])
        if isinstance(schema.get("$ref"), str) or isinstance(schema.get("allOf"), list):
            return self.visit(self._merged(schema, ()))
        if "const" in schema or isinstance(schema.get("enum"), list):
            return self._values(schema)
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return self._branches(schema, key)
        kind = schema.get("type") or ("object" if "properties" in schema else
                                      "array" if "items" in schema or "prefixItems" in schema else None)
        if isinstance(kind, list) and kind:
            return alternatives([self.visit({**schema, "type": k}) for k in kind])
        if kind in ("object", "array"):  # "{" or "[" written first: no rule recurses to the left past it
            outer, self.left = self.left, None
            try:
                return self._object(schema) if kind == "object" else self._array(schema)
            finally:
                self.left = outer
        if kind == "string":
            return self._string(schema)
        if kind == "integer" and _INTEGER_BOUNDS & schema.keys():
            return f"{integer_range(*integer_bounds(schema))} ws"
        return kind if kind in _SCALARS else "value"

    def _rule(self, body: str) -> str:
        name = f"schema{len(self.rules)}"
        self.rules[name] = body
        return name

    def _ref(self, ref: str) -> str:
        key = (id(self.root), ref)
        if isinstance(self.refs.get(key), NoValue):
            raise self.refs[key]
        self._starts_with(key)
        if key not in self.refs:
            target = resolve(self.root, ref)
            if target is None:
                return "value"
            self.refs[key] = name = f"ref{len(self.refs)}"
            self.rules[name] = ""  # the name is taken before the body is built: the body may refer to it
            outer, self.left = self.left, key
            try:
                self.rules[name] = self.visit(self._merged(target, (ref,)))
            except NoValue as err:  # refused alike wherever it is referred to again
                self.refs[key], self.firsts[key] = err, set()
                del self.rules[name]
                raise
            finally:
                self.left = outer
        return self.refs[key]

    def _starts_with(self, key: tuple[int, str]) -> None:
        """The rule being built starts with `key`'s (an anyOf branch): llama.cpp refuses a left recursion. Back to
        itself, the branch adds no value the others don't (the least fixed point): a NoValue, which anyOf leaves
        out; back through other $refs' rules, which may be referred to elsewhere too: refused."""
        if self.left is None:
            return
        if key == self.left:
            raise NoValue(f"$ref {key[1]!r} refers back to itself before writing anything")
        seen, todo = set(), [key]
        while todo:
            if (step := todo.pop()) == self.left:
                raise ValueError(f"$ref {step[1]!r} refers back to itself through $ref {key[1]!r} before writing "
                                 "anything (a left recursion through several $refs is not held)")
            seen.add(step)
            todo.extend(self.firsts.get(step, set()) - seen)
        self.firsts.setdefault(self.left, set()).add(key)

    def _merged(self, schema: Any, path: tuple[str | None, ...]) -> Any:
        """`schema` with its top-level $ref and allOf merged in (`path`: the $refs followed to reach it)."""
        return merge(self._conjuncts(schema, path))

    def _conjuncts(self, schema: Any, path: tuple[str | None, ...]) -> list[Any]:
        """The schemas that must all hold for `schema` to: itself less $ref and allOf, its $ref's target and
        allOf's members, flattened. `path` holds the $refs followed (None for an allOf): one met again is a
        cycle that never reaches a schema (validators loop on it too)."""
        if not isinstance(schema, dict):
            return [schema]
        if len(path) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"allOf and $ref nest deeper than {MAX_SCHEMA_DEPTH} levels")
        parts = [{key: value for key, value in schema.items() if key not in ("$ref", "allOf")}]
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in path:
                raise ValueError(f"$ref {ref!r} refers back to itself without reaching a schema")
            target = resolve(self.root, ref)
            parts += [] if target is None else self._conjuncts(target, (*path, ref))  # remote: loosened
        for member in schema["allOf"] if isinstance(schema.get("allOf"), list) else []:
            parts += self._conjuncts(member, (*path, None))
        return parts

    def _values(self, schema: dict) -> str:
        """const or enum: the values that meet the whole schema, as literals."""
        validator = jsonschema.Draft202012Validator(self.root).evolve(schema=schema)  # $refs read in the root
        values = [schema["const"]] if "const" in schema else schema["enum"]
        kept = [value for value in values if _valid(validator, value)]
        if not kept:
            raise NoValue("no value of the schema's enum or const meets the rest of it")
        return alternatives([json_literal(value) for value in kept]) + " ws"

    def _branches(self, schema: dict, key: str) -> str:
        """anyOf or oneOf: each branch with the keywords beside it (as an allOf of both)."""
        rest = {k: v for k, v in schema.items() if k != key}
        branches = schema[key]
        if asserts(rest):
            branches = [self._merged({"allOf": [rest, branch]}, ()) for branch in branches]
        options, reasons = [], []
        for branch in branches:
            try:
                options.append(self.visit(branch))
            except NoValue as err:  # a branch no value meets is left out
                reasons.append(str(err))
        if not options:
            raise NoValue(f"no {key} branch allows a value: {'; '.join(dict.fromkeys(reasons))}")
        return alternatives(options)

    def _object(self, schema: dict) -> str:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        extra = schema.get("additionalProperties", True)
        # A required key not declared is written too: as additionalProperties allows (loosened beside patterns).
        named = {**properties, **{key: True if "patternProperties" in schema else extra
                                  for key in required if isinstance(key, str) and key not in properties}}
        if named:
            members = []
            for key, sub in named.items():
                if sub is False and key in required:
                    raise NoValue(f"required property {key!r} is not allowed by the schema")
                if sub is not False:
                    members.append((f'{json_literal(key)} ws ":" ws {self.visit(sub)}', key in required))
            return self._rule(f'"{{" ws {self._members(members)} "}}" ws') if members else '"{" ws "}" ws'
        if extra is False:
            return '"{" ws "}" ws'
        if isinstance(extra, dict):
            pair = f'string ":" ws {self.visit(extra)}'
            return self._rule(f'"{{" ws ( {pair} ( "," ws {pair} )* )? "}}" ws')
        return "object"

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """Members in order, commas between those written; optional ones may be left out. A rule names each
        `then` (the members after one, when something was written before), so the text grows linearly."""
        if all(needed for _, needed in members):
            return ' "," ws '.join(text for text, _ in members)
        then, first = "", ""  # `first`: the members from here on, when nothing was written before
        for index in reversed(range(len(members))):
            text, needed = members[index]
            written = f"{text} {then}".strip()
            first = written if needed else f"( {written} | {first} )" if first else f"( {written} )?"
            if index:  # the first member's `then` would be read by nothing
                then = self._rule((f'"," ws {text} {then}' if needed else f'( "," ws {text} )? {then}').strip())
        return first

    def _array(self, schema: dict) -> str:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        rest = schema.get("items", True)
        low, high = _bound(schema, "minItems") or 0, _bound(schema, "maxItems")
        if rest is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and high < low:
            raise NoValue(f"the array needs {low} items but allows at most {high}")
        items = [self.visit(sub) for sub in prefix[:high]]
        tail = ""  # the items past the prefix, as many as the bounds leave
        if high is None or high > len(items):
            item, n = self.visit(rest), len(items)
            item = item if repeat_fits(item, counted(0, MAX_BOUND)) else self._rule(item)  # repeat one name
            if n:
                tail = repeat(f'"," ws {item}', max(low - n, 0), None if high is None else high - n)
            else:
                more = repeat(f'"," ws {item}', max(low - 1, 0), None if high is None else high - 1)
                tail = f"{item} {more}" if low else f"( {item} {more} )?"
        for index in reversed(range(len(items))):  # the prefix, its first minItems written
            comma = '"," ws ' if index else ""
            written = f"{comma}{items[index]} {tail}".strip()
            tail = written if index < low else f"( {written} )?"
        return self._rule(f'"[" ws {tail} "]" ws') if tail else '"[" ws "]" ws'

    def _string(self, schema: dict) -> str:
        form = schema.get("format")
        if form in JSON_FORMATS:
            for name in ("date", "time") if form == "date-time" else (form,):
                self.rules.setdefault(f"format-{name}", JSON_FORMATS[name])
            self.rules.setdefault(f"format-{form}", JSON_FORMATS[form])
            return f'"\\"" format-{form} "\\"" ws'
        if isinstance(schema.get("pattern"), str):
            try:
                return f'"\\"" {json_string_expression(schema["pattern"], "char")} "\\"" ws'
            except ValueError:
                pass  # a pattern with no grammar: any string, as documented
        low, high = _bound(schema, "minLength"), _bound(schema, "maxLength")
        if low is None and high is None:
            return "string"
        if high is not None and high < (low or 0):
            raise NoValue(f"minLength {low} exceeds maxLength {high}")
        return f'"\\"" {repeat("char", low or 0, high)} "\\"" ws'

