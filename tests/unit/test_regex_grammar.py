"""Regular expressions the grammar cannot hold are refused by name; those Python itself refuses are refused too.
(Which texts a translated pattern allows is tested against llama.cpp in tests/integration.)"""

from __future__ import annotations

import re

import pytest

from cobali.server.json_schema_grammar import json_schema_grammar
from cobali.server.regex_grammar import MAX_NESTING, MAX_REPEAT, json_string_expression, regex_grammar


@pytest.mark.parametrize("pattern, named", [
    ("(?=a)b", "lookahead"), ("(?!a)b", "negative lookahead"), ("(?<=a)b", "lookbehind"),
    ("(?<!a)b", "negative lookbehind"), (r"(a)\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"),
    ("(?>a)", "atomic group"), ("(?(1)a|b)", "conditional"), ("(?i)a", "inline flags"), ("a++", "possessive"),
    (r"\bword\b", "word boundary"), ("a^b", "not at the start"), ("a$b", "not at the end"),
    (r"a\Ab", "not at the start"),
    ("[\\D]", "inside a character class"), ("a\0b", "NUL"), (f"a{{{MAX_REPEAT + 1}}}", "repeat counts above"),
    ("a{3,2}", "exceeds its maximum"), (r"\q", "unknown escape"), (r"\x4", "bad \\x escape"),
])
def test_what_a_grammar_cannot_hold_is_refused_by_name(pattern: str, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        regex_grammar(pattern)


@pytest.mark.parametrize("pattern", ["a**", "(", "a)", "[a", "*a", "a|*", "[z-a]", "a\\", "a{2}{3}", "{2}", "{,}",
                                     "a|{2}", "^{2}", "(?:{1,2})"])
def test_what_python_refuses_is_refused(pattern: str) -> None:
    with pytest.raises(re.error):
        re.compile(pattern)
    with pytest.raises(ValueError, match="regex"):
        regex_grammar(pattern)


def test_a_json_pattern_is_searched_unless_anchored() -> None:
    assert json_string_expression("ab", "char") == 'char* ( "ab" ) char*'
    assert json_string_expression("^ab$", "char") == '( "ab" )'
    assert json_string_expression("^ab", "char") == '( "ab" ) char*'
    with pytest.raises(ValueError, match="anchors inside an alternation"):
        json_string_expression("^a|b$", "char")


@pytest.mark.parametrize("pattern, expected", [
    ("a{{2}", '"a" ( "{" ){2,2}'), ("a{,}", '( "a" ){0,}'), ("a{}", '"a{}"'), ("{}", '"{}"'),
    ("a{\u0663}", '"a{\\u0663}"'), ("a{\u00b2}", '"a{\\xB2}"'), ("a{2}{", '( "a" ){2,2} "{"'),
])
def test_braces_are_read_as_python_reads_them(pattern: str, expected: str) -> None:
    """A brace repeats only as `{m}`, `{m,}`, `{,n}`, `{m,n}` or `{,}` of ASCII digits; otherwise it is itself."""
    re.compile(pattern)
    assert regex_grammar(pattern) == f"root ::= {expected}\n"


def test_deep_nesting_is_refused_by_name() -> None:
    deep = "(" * 300 + "a" + ")" * 300
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_NESTING}"):
        regex_grammar(deep)
    with pytest.raises(ValueError, match="nested deeper"):
        json_string_expression(deep, "char")
    assert "string" in json_schema_grammar({"type": "string", "pattern": deep})  # loosened, as documented
    shallow = "(" * MAX_NESTING + "a" + ")" * MAX_NESTING
    assert regex_grammar(shallow)


def test_control_characters_in_a_json_string_are_escaped_alike_in_text_and_classes() -> None:
    """As json.dumps writes them: \\u0001 in a literal and in a class alike, short escapes where JSON has them."""
    assert json_string_expression("^\\x01\\x08$", "char") == '( "\\\\u0001\\\\b" )'
    assert json_string_expression("^[\\x01]$", "char") == '( "\\\\u000" [1] )'
    assert json_string_expression("^[\\x08\\x1f]$", "char") == '( ( "\\\\b" | "\\\\u001" [f] ) )'
    assert json_string_expression("^\\x00$", "char") == '( "\\\\u0000" )'  # no NUL byte in the JSON text


@pytest.mark.parametrize("pattern", ["((a)){1000}", "(a{0,2}){700}", "(?:(a)?){3,1000}", r"((\s)\s){1000}$"])
def test_a_repeat_llama_cpp_would_refuse_is_refused_by_name(pattern: str) -> None:
    re.compile(pattern)
    with pytest.raises(ValueError, match=r"a repeat of more than llama\.cpp's grammars hold"):
        regex_grammar(pattern)


def test_a_repeat_within_llama_cpps_limit_is_kept() -> None:
    assert regex_grammar("(a){1000}") == 'root ::= ( ( "a" ) ){1000,1000}\n'  # 2 rules x 1000
    assert regex_grammar("(a{0,2}){400}")  # 5 rules x 400
