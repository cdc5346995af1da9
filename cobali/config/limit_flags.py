"""`serve`'s and `run-batch`'s flags for what one request may cost (docs/configuration.md, "Bounded cost"), and
the limits built from them. Argparse-level imports only, as flags.py."""

from __future__ import annotations

import argparse
from dataclasses import fields

from cobali.config.flags import positive_float, positive_int
from cobali.frontend.request_limits import GRAMMAR_FLAGS, LIMIT_FLAGS, PreprocessLimits, RequestLimits
from cobali.structured.limits import GrammarLimits

_HELP = {
    "max_choices": "choices per request (prompts x n); each holds a slot",
    "max_logprobs": "alternatives per token for logprobs, top_logprobs and prompt_logprobs (vLLM's flag)",
    "max_prompt_logprobs": "prompt positions whose logprobs one request asks: prompt tokens x choices (each a full "
                           "logits row)",
    "max_stop_strings": "stop strings per request; each is looked for in every token's text",
    "max_stop_string_chars": "characters of one stop string",
    "max_tools": "tools per request",
    "max_tools_bytes": "bytes of a request's tools as JSON (all rendered into the prompt)",
    "max_logit_bias": "logit_bias entries per request",
    "max_stop_token_ids": "stop_token_ids per request",
    "max_template_depth": "nesting depth of a JSON value a chat template is given: a tool's parameters, a tool "
                          "call's arguments, a chat_template_kwargs value",
    "max_template_kwargs_bytes": "bytes of the chat_template_kwargs the chat template reads, as JSON (those it "
                                 "does not read are dropped)",
    "max_bytes": "bytes of one schema, regex, grammar or choice list as sent (JSON text for an object)",
    "max_gbnf_rules": "rules of one GBNF grammar (its conversion to llguidance's Lark costs their square)",
    "max_grammar_size": "llguidance: symbols in a grammar's productions",
    "max_lexer_states": "llguidance: lexer states one grammar may build (memory)",
    "initial_lexer_fuel": "llguidance: work building a grammar's lexer",
    "step_lexer_fuel": "llguidance: lexer work for one token's mask",
    "step_max_items": "llguidance: parser items in one token's mask",
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (each a 400 naming its flag)")
    for limits, flags in ((RequestLimits(), LIMIT_FLAGS), (GrammarLimits(), GRAMMAR_FLAGS)):
        for name, flag in flags.items():
            default = getattr(limits, name)
            kind = positive_float if isinstance(default, float) else positive_int
            group.add_argument(flag, dest=f"limit_{name}", type=kind, default=default,
                               help=f"{_HELP[name]} (default {default})")
    pool = parser.add_argument_group("request preparation (tokenizing, chat templates, grammars)")
    defaults = PreprocessLimits()
    pool.add_argument("--preprocess-workers", type=positive_int, default=defaults.workers,
                      help="threads that tokenize, render chat templates and compile grammars off the event loop; "
                           f"one client uses at most half of them (default {defaults.workers})")
    pool.add_argument("--preprocess-timeout", type=positive_float, default=defaults.timeout_s, metavar="S",
                      help="a request's preparation must get a worker within S seconds (else 503) and finish "
                           f"within S more (else 400) (default {defaults.timeout_s:g})")
    pool.add_argument("--preprocess-client-queue", type=positive_int, default=defaults.client_queue, metavar="N",
                      help="requests one client may have being prepared or waiting to be; beyond it a 429 "
                           f"(default {defaults.client_queue})")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f"limit_{f.name}") for f in fields(RequestLimits)})


def grammar_limits(args: argparse.Namespace) -> GrammarLimits:
    return GrammarLimits(**{name: getattr(args, f"limit_{name}") for name in GRAMMAR_FLAGS})


def preprocess_limits(args: argparse.Namespace, client_queue: bool = True) -> PreprocessLimits:
    """client_queue False: no per-client bound (run-batch is one client that bounds itself)."""
    return PreprocessLimits(args.preprocess_workers, args.preprocess_timeout,
                            args.preprocess_client_queue if client_queue else None)
