"""Multi-turn conversations over long shared contexts: the workload where routing by the KV pays.

llm-d's test of its prefix scorer had 150 customers, each with a 6k-token context that all its users' requests
start with. Here C customers each have a context of random tokens; each of a customer's U users holds a
conversation of T turns, turn k's prompt being the context, then k questions with the answers between them:

    context | q1                      (turn 1)
    context | q1 a1 q2                (turn 2: turn 1's prompt, then more)

Requests arrive as a Poisson process at `rate`; which user speaks next is drawn at random among those with turns
left (a random interleaving of every user's turns, each user's in order), so conversations overlap as they would
online. The answers are random tokens, not what the engine generated on the turn before (open-loop arrivals
cannot wait for them): a turn shares with the KV its previous turn left its whole prompt, not that turn's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cobali.harness.workloads import arrival_offsets
from cobali.sim.cluster import SimItem


@dataclass(frozen=True)
class ConversationShape:
    customers: int = 32
    users_per_customer: int = 4
    turns: int = 4
    context_tokens: int = 4096  # each customer's, at the start of all its users' prompts
    question_tokens: int = 128
    answer_tokens: int = 128  # of each earlier turn's answer, in the later turns' prompts
    max_tokens: int = 64  # generated per turn
    rate: float = 8.0  # requests per second

    def __post_init__(self) -> None:
        if min(self.customers, self.users_per_customer, self.turns, self.question_tokens, self.max_tokens) < 1:
            raise ValueError("customers, users, turns, question tokens and max tokens must be >= 1")
        if min(self.context_tokens, self.answer_tokens) < 0 or not self.rate > 0:
            raise ValueError("context and answer tokens must be >= 0, the rate > 0")

    @property
    def n_requests(self) -> int:
        return self.customers * self.users_per_customer * self.turns


def conversations(shape: ConversationShape, n_vocab: int, seed: int = 0) -> tuple[list[SimItem], list[float]]:
    """The requests in arrival order, and their arrival times (s, from 0). Tokens are in [1, n_vocab): 0 is the
    simulated backend's end of generation."""
    rng = np.random.default_rng(seed)
    s = shape

    def tokens(n: int) -> list[int]:
        return rng.integers(1, n_vocab, n).tolist()

    contexts = [tokens(s.context_tokens) for _ in range(s.customers)]
    users = s.customers * s.users_per_customer
    # A user's prompt so far (its context, then each turn's question and answer), and its turns taken.
    prompts = [list(contexts[user // s.users_per_customer]) for user in range(users)]
    speaker = rng.permutation(np.repeat(np.arange(users), s.turns)).tolist()
    items = []
    for user in speaker:
        prompt = prompts[user]
        if len(prompt) > s.context_tokens:  # not the first turn: the answer to the question before
            prompt += tokens(s.answer_tokens)
        prompt += tokens(s.question_tokens)
        customer, of_customer = divmod(user, s.users_per_customer)
        items.append(SimItem(list(prompt), s.max_tokens, session=f"{customer}/{of_customer}"))
    return items, arrival_offsets(len(items), s.rate, seed=seed).tolist()
