"""Regular expressions the grammar cannot hold are refused by name; those Python itself refuses are refused too.
(Which texts a translated pattern allows is tested against llama.cpp in tests/integration.)"""

from __future__ import annotations

import re

import pytest

from cobali.server.regex_grammar import MAX_REPEAT, json_string_expression, regex_grammar


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


@pytest.mark.parametrize("pattern", ["a**", "(", "a)", "[a", "*a", "a|*", "[z-a]", "a\\", "a{2}{3}"])
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
