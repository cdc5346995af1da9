"""Structured outputs through the official openai client's `chat.completions.parse` with pydantic models, on the
embedded model behind a real `cobali serve` (issue 36).

`parse` sends the model's strict schema (every field required, `additionalProperties: false`, `$defs` and `$ref`s)
and validates the reply into the model: each case here must come back as an instance, whatever a 135M model
would write unconstrained, so every keyword the schema carries (enum, Literal, nullable, minItems/maxItems,
maxLength, format date, number minimum/maximum, recursion) has to be held by the server's grammar.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from enum import Enum
from typing import Annotated, Literal

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.integration.test_server_openai import running_server


class Priority(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: Literal["FR", "DE", "US"]


class Contact(BaseModel):
    """Nested objects and an Optional field (nullable but required, as strict schemas have it)."""
    name: str = Field(max_length=20)
    address: Address
    nickname: str | None = Field(max_length=12)


class Task(BaseModel):
    """An enum, a date and a bounded list of bounded strings."""
    title: str = Field(max_length=30)
    priority: Priority
    due: datetime.date
    tags: list[Annotated[str, Field(max_length=10)]] = Field(min_length=1, max_length=3)


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: int = Field(ge=1, le=10)


class Square(BaseModel):
    kind: Literal["square"]
    side: int = Field(ge=1, le=10)


class Drawing(BaseModel):
    """A union of Literal-tagged objects."""
    title: str = Field(max_length=20)
    shapes: list[Circle | Square] = Field(min_length=1, max_length=3)


class Node(BaseModel):
    """Recursion: a tree, its children bounded per node."""
    name: str = Field(max_length=10)
    children: list[Node] = Field(max_length=2)


class Review(BaseModel):
    """A bounded float beside a Literal union of plain values and an Optional date."""
    verdict: Literal["good", "bad"] | Literal[1, 2, 3]
    score: float = Field(ge=0, le=1)
    watched_on: datetime.date | None


class Score(BaseModel):
    score: float = Field(ge=0, le=1)


CASES: list[tuple[type[BaseModel], str]] = [
    (Contact, "Give the contact details of a friend in Paris."),
    (Task, "Create a task for next week: buy groceries."),
    (Drawing, "Describe a drawing with a small circle and a big square."),
    # Greedy, a 135M model nests children without end unless told where the leaves are.
    (Node, 'A tree: root "Ann" has children "Bob" and "Cy"; Bob and Cy have no children (empty lists).'),
    (Review, "Review the film Casablanca."),
]


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with running_server("--max-slots", "4", "--served-model-name", "smol") as (base, _proc):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def parsed(client: OpenAI, model: type[BaseModel], prompt: str, **sampling: float) -> BaseModel:
    """The reply as `parse` reads it; a finish other than "stop" (cut by max_tokens) raises in `parse` itself."""
    reply = client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=256, response_format=model,
        **sampling).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    assert isinstance(reply.message.parsed, model), reply.message.content
    # Validated once more from the raw text, strictly: the instance did not come from a lenient path.
    assert model.model_validate_json(reply.message.content or "") == reply.message.parsed
    return reply.message.parsed


@pytest.mark.parametrize(("model", "prompt"), CASES, ids=[m.__name__ for m, _ in CASES])
def test_parse_gets_a_valid_instance(client: OpenAI, model: type[BaseModel], prompt: str) -> None:
    parsed(client, model, prompt, temperature=0)


def test_parse_holds_its_schema_under_sampling(client: OpenAI) -> None:
    """Sampled replies wander further from the likely text than greedy ones: the bounds must still hold."""
    for seed in (1, 2):
        parsed(client, Drawing, "Draw some shapes.", temperature=1.0, seed=seed)


@pytest.mark.parametrize("prompt", ["Rate the film from 0 to 100. It deserves 100.",
                                    "On a scale of 1 to 10, how good is pizza? Score:"])
def test_a_float_keeps_its_bounds(client: OpenAI, prompt: str) -> None:
    """`Field(ge=0, le=1)` is minimum/maximum on a number: a reply of 100 or 200 must be impossible, not only
    rejected by pydantic afterwards."""
    score = parsed(client, Score, prompt, temperature=0)
    assert isinstance(score, Score) and 0 <= score.score <= 1
