"""JSON Schema -> llama.cpp GBNF grammar, so that the output is a JSON text the schema accepts.

Held exactly:
- "type" (object, array, string, integer, number, boolean, null, or a list of these; object and array implied
  by "properties" and "items"), "enum", "const", "anyOf", "oneOf", "allOf" (of objects, merged);
- "$ref" to the schema itself or into it ("#", "#/$defs/Name", "#/definitions/Name"; recursion included), as
  pydantic and the openai client's `parse` write them;
- objects: "properties" in schema order, those not "required" optional; without "properties", an
  "additionalProperties" schema gives a map of any keys to it, and `false` the empty object;
- arrays: "items", "prefixItems" (all of them written), "minItems", "maxItems";
- strings: "pattern" (see regex_grammar), "minLength", "maxLength", "format" date, time, date-time, uuid;
- integers: "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" (integer_grammar).

Loosened (the output is still JSON, and holds the rest of the schema): bounds of non-integer numbers, multiples, remote
"$ref"s, a "pattern" with a feature regex_grammar refuses, length and item bounds past MAX_BOUND, and any other
keyword. Objects never get properties beyond those declared (always valid); a declared property is written
at most once, in schema order.
"""

from __future__ import annotations

import json
from typing import Any

from cobali.server.integer_grammar import integer_bounds, integer_range
from cobali.server.regex_grammar import json_string_expression

# llama.cpp's grammars/json.gbnf, with bounded whitespace so a model cannot pad forever.
JSON_RULES = r"""
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" char* "\"" ws
char ::= [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )? ws
integer ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ws
boolean ::= ( "true" | "false" ) ws
null ::= "null" ws
ws ::= | " " | "\n" [ \t]{0,20}
"""

JSON_OBJECT_GRAMMAR = "root ::= object" + JSON_RULES

# RFC 3339 as JSON Schema's formats read it; no 29 February (the grammar cannot tell leap years).
_FORMATS = {
    "date": '[1-9] [0-9]{3} "-" ( ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | "1" [0-9] | "2" [0-8] ) '
            '| ( "0" [13-9] | "1" [0-2] ) "-" ( "29" | "30" ) | ( "0" [13578] | "1" [02] ) "-31" )',
    "time": '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
            '( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": 'format-date "T" format-time',
    "uuid": '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{12}',
}
_INTEGER_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})  # each has a rule of that name
MAX_BOUND = 500  # length and item bounds above this are dropped: llama.cpp caps repetitions
MAX_SCHEMA_DEPTH = 64  # nesting refused past this (ValueError), before Python's recursion limit is


def json_schema_grammar(schema: Any) -> str:
    converter = SchemaConverter()
    root = converter.visit_document(schema)
    return f"root ::= {root}\n{converter.rules_text()}{JSON_RULES}"


def literal(value: Any) -> str:
    """A GBNF literal matching `value` serialized as JSON (ASCII only, so only \\ and " need escaping)."""
    text = json.dumps(value, ensure_ascii=True)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def alternatives(options: list[str]) -> str:
    return options[0] if len(options) == 1 else "( " + " | ".join(options) + " )"


def _bound(schema: dict, key: str) -> int | None:
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BOUND else None


def _repeat(item: str, low: int, high: int | None) -> str:
    return f"( {item} ){{{low},{'' if high is None else high}}}"


class SchemaConverter:
    """Schemas to GBNF rules, one namespace of rules for several schemas (a tool call's functions)."""

    def __init__(self) -> None:
        self.root: Any = None  # the document "$ref"s point into
        self.rules: dict[str, str] = {}
        self.refs: dict[tuple[int, str], str] = {}
        self.depth = 0

    def visit_document(self, schema: Any) -> str:
        """A schema with its own "$ref" namespace; one rule for it, as for "#"."""
        outer, self.root = self.root, schema
        try:
            return self.visit({"$ref": "#"})
        finally:
            self.root = outer

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
        if not isinstance(schema, dict):
            return "value"  # true, {} or anything unreadable: any JSON value
        if isinstance(schema.get("$ref"), str):
            return self._ref(schema["$ref"])
        if isinstance(schema.get("allOf"), list) and schema["allOf"]:
            return self.visit(self._merged(schema))
        if "const" in schema:
            return f"{literal(schema['const'])} ws"
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return alternatives([literal(v) for v in schema["enum"]]) + " ws"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return alternatives([self.visit(s) for s in schema[key]])
        kind = schema.get("type") or ("object" if "properties" in schema else
                                      "array" if "items" in schema or "prefixItems" in schema else None)
        if isinstance(kind, list) and kind:
            return alternatives([self.visit({**schema, "type": k}) for k in kind])
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind == "integer" and _INTEGER_BOUNDS & schema.keys():
            return f"{integer_range(*integer_bounds(schema))} ws"
        return kind if kind in _SCALARS else "value"

    def _rule(self, body: str, name: str | None = None) -> str:
        name = name or f"schema{len(self.rules)}"
        self.rules[name] = body
        return name

    def _resolve(self, ref: str) -> Any:
        """The schema a local reference points at; None for any other reference."""
        if ref != "#" and not ref.startswith("#/"):
            return None
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} points at nothing in the schema")
            target = target[part]
        return target

    def _ref(self, ref: str) -> str:
        key = (id(self.root), ref)
        if key not in self.refs:
            target = self._resolve(ref)
            if target is None:
                return "value"
            self.refs[key] = name = f"ref{len(self.refs)}"
            self.rules[name] = ""  # the name is taken before the body is built: the body may refer to it
            self.rules[name] = self.visit(target)
        return self.refs[key]

    def _merged(self, schema: dict) -> dict:
        """allOf's members merged into one schema: properties and required united, other keywords first-set."""
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        for member in schema["allOf"]:
            while isinstance(member, dict) and isinstance(member.get("$ref"), str):
                member = self._resolve(member["$ref"])
            if not isinstance(member, dict):
                continue
            for key, value in member.items():
                if key == "properties" and isinstance(value, dict):
                    merged["properties"] = {**merged.get("properties", {}), **value}
                elif key == "required" and isinstance(value, list):
                    merged["required"] = [*merged.get("required", []), *value]
                else:
                    merged.setdefault(key, value)
        return merged

    def _object(self, schema: dict) -> str:
        properties = schema.get("properties")
        if isinstance(properties, dict) and properties:
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            members = [(f'{literal(str(key))} ws ":" ws {self.visit(sub)}', key in required)
                       for key, sub in properties.items()]
            return self._rule(f'"{{" ws {self._members(members)} "}}" ws')
        extra = schema.get("additionalProperties")
        if extra is False:
            return '"{" ws "}" ws'
        if isinstance(extra, dict):
            pair = f'string ":" ws {self.visit(extra)}'
            return self._rule(f'"{{" ws ( {pair} ( "," ws {pair} )* )? "}}" ws')
        return "object"

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """Members in order, commas between those written; optional ones may be left out. Rules name the tails
        (`then`: something was written before; `first`: nothing yet), so the text grows linearly."""
        if all(needed for _, needed in members):
            return ' "," ws '.join(text for text, _ in members)
        then, first = "", ""
        for text, needed in reversed(members):
            written = f"{text} {then}".strip()
            then_here = f'"," ws {text} {then}' if needed else f'( "," ws {text} )? {then}'
            first = written if needed else f"( {written} | {first} )" if first else f"( {written} )?"
            then = self._rule(then_here.strip())
            first = self._rule(first)
        return first

    def _array(self, schema: dict) -> str:
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            rest = schema.get("items", True)
            parts = ' "," ws '.join(self.visit(s) for s in prefix)
            more = "" if rest is False else f' ( "," ws {self.visit(rest)} )*'
            return self._rule(f'"[" ws {parts}{more} "]" ws')
        item = self.visit(schema.get("items", True))
        low, high = _bound(schema, "minItems") or 0, _bound(schema, "maxItems")
        if high is not None and high < low:
            raise ValueError(f"minItems {low} exceeds maxItems {high}")
        if high == 0:
            return '"[" ws "]" ws'
        more = _repeat(f'"," ws {item}', max(low - 1, 0), None if high is None else high - 1)
        items = f"{item} {more}" if low else f"( {item} {more} )?"
        return self._rule(f'"[" ws {items} "]" ws')

    def _string(self, schema: dict) -> str:
        form = schema.get("format")
        if form in _FORMATS:
            for name in ("date", "time") if form == "date-time" else (form,):
                self.rules.setdefault(f"format-{name}", _FORMATS[name])
            self.rules.setdefault(f"format-{form}", _FORMATS[form])
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
            raise ValueError(f"minLength {low} exceeds maxLength {high}")
        return f'"\\"" {_repeat("char", low or 0, high)} "\\"" ws'
