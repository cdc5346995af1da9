"""What one constraint may cost: the operator's limits on its text and on llguidance's work compiling and
running it. Built once at the CLI edge (cobali serve's flags), passed whole. Time is bounded by the server's
--preprocess-timeout (a compile runs on its workers) and by llguidance's fuel per token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 256 * 1024  # a schema's, regex's, grammar's or choice list's text, as sent
    max_gbnf_rules: int = 512  # rules of a GBNF grammar: llguidance's converter (Python) is quadratic in them
    max_grammar_size: int = 500_000  # llguidance: symbols in the grammar's productions
    max_lexer_states: int = 250_000  # llguidance: lexer states built (memory: 1-2 kB each, its docs say)
    initial_lexer_fuel: int = 1_000_000  # llguidance: work building the lexer's regexes
    step_lexer_fuel: int = 200_000  # llguidance: lexer work to compute one token's mask
    step_max_items: int = 50_000  # llguidance: Earley items in one token's mask

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_gbnf_rules", "max_grammar_size", "max_lexer_states", "initial_lexer_fuel",
                     "step_lexer_fuel", "step_max_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"grammar limit {name} must be at least 1, got {getattr(self, name)}")
