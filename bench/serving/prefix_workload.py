"""The shared-prefix chat workload of bench/serving/prefix_routing.py: llm-d's test of its prefix scorer (150
customers, each a 6k-token context, 8 pods) scaled down, as chat requests.

Each of C customers has a system prompt of about `context_tokens` tokens: synthetic text that reads like a support
desk's instructions (sentences of common English words, so a BPE tokenizer cuts it as it cuts prose). Each of its U
users holds a conversation of T turns: turn k sends the system prompt, then k short questions with an answer
between each two (the answers are written here, not the model's: open-loop arrivals cannot wait for them, as in
cobali/sim/conversations.py). Requests arrive as a Poisson process; which user speaks next is drawn among those
with turns left. Every request of a user carries its session (x-session-id).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from cobali.harness.workloads import arrival_offsets

WORDS = (
    "account", "order", "refund", "delivery", "payment", "invoice", "customer", "support", "policy", "product",
    "service", "return", "shipping", "team", "request", "issue", "answer", "price", "discount", "warranty",
    "repair", "replace", "contact", "email", "phone", "hours", "week", "day", "business", "store", "online",
    "address", "card", "balance", "plan", "upgrade", "cancel", "renew", "subscription", "member", "points",
    "reward", "code", "offer", "always", "never", "please", "check", "confirm", "explain", "describe", "verify",
    "update", "note", "that", "the", "a", "an", "of", "to", "in", "for", "with", "on", "by", "from", "is", "are",
    "be", "can", "may", "should", "must", "will", "when", "if", "before", "after", "within", "each", "every", "any",
    "all", "most", "new", "old", "first", "last", "next", "same", "other", "clear", "short", "polite", "friendly",
    "careful", "quick", "simple", "full", "standard", "express", "local",
)


@dataclass(frozen=True)
class ChatShape:
    customers: int = 8
    users: int = 4  # per customer
    turns: int = 2  # per user
    context_tokens: int = 1500
    question_words: int = 12
    answer_words: int = 24
    max_tokens: int = 16
    rate: float = 0.5  # requests/s

    def __post_init__(self) -> None:
        if min(self.customers, self.users, self.turns, self.context_tokens, self.question_words,
               self.max_tokens) < 1 or self.answer_words < 0 or not self.rate > 0:
            raise ValueError("every count must be >= 1 (answer words >= 0) and the rate > 0")

    @property
    def n_requests(self) -> int:
        return self.customers * self.users * self.turns


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    session: str  # "customer/user"
    max_tokens: int


def sentences(rng: random.Random, n_words: int) -> str:
    """About n_words words of prose: sentences of 6 to 16 words, capitalised, each ending with a full stop."""
    out, count = [], 0
    while count < n_words:
        length = min(rng.randint(6, 16), n_words - count)
        words = [rng.choice(WORDS) for _ in range(length)]
        out.append(" ".join(words).capitalize() + ".")
        count += length
    return " ".join(out)


def context(customer: int, n_words: int, seed: int) -> str:
    rng = random.Random(f"{seed}/context/{customer}")
    return (f"You are the support assistant of customer {customer}. Follow these instructions in every answer. "
            + sentences(rng, n_words))


def contexts(shape: ChatShape, count_tokens: Callable[[str], int], seed: int) -> list[str]:
    """Each customer's system prompt, sized to shape.context_tokens by the tokenizer's count of the first: one
    guess at the tokens per word, then one correction (the others come out within a few percent)."""
    words = max(1, round(shape.context_tokens / 1.3))
    first = count_tokens(context(0, words, seed))
    words = max(1, round(words * shape.context_tokens / first))
    return [context(c, words, seed) for c in range(shape.customers)]


def chat_requests(shape: ChatShape, count_tokens: Callable[[str], int],
                  seed: int = 0) -> tuple[list[ChatRequest], list[float]]:
    """The requests in arrival order and their arrival times (s, from 0)."""
    rng = random.Random(seed)
    systems = contexts(shape, count_tokens, seed)
    n_users = shape.customers * shape.users
    chats = [[{"role": "system", "content": systems[u // shape.users]}] for u in range(n_users)]
    speakers = [u for u in range(n_users) for _ in range(shape.turns)]
    rng.shuffle(speakers)
    requests = []
    for user in speakers:
        chat = chats[user]
        if len(chat) > 1:  # not the first turn: the answer to the question before
            chat.append({"role": "assistant", "content": sentences(rng, shape.answer_words)})
        question = sentences(rng, shape.question_words).removesuffix(".") + "?"
        chat.append({"role": "user", "content": question})
        customer, of_customer = divmod(user, shape.users)
        requests.append(ChatRequest(list(chat), f"{customer}/{of_customer}", shape.max_tokens))
    return requests, arrival_offsets(len(requests), shape.rate, seed=seed).tolist()
