"""The base of every request body: strict types, unknown fields kept aside to be reported, one clear error for
a union, and OpenAI's batch of texts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError


def one_of(expected: str) -> WrapValidator:
    """One clear error for a union, instead of pydantic's one per member (loc 'prompt.str', ...)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", "expected {expected}", {"expected": expected}) from None

    return WrapValidator(validate)


def text_batch(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A batch of texts as OpenAI sends it (`prompt`, `input`): a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


class Body(BaseModel):
    # allow_inf_nan: Python's json accepts the NaN / Infinity literals; say so instead of a misleading range error.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class RequestBody(Body):
    """A request body: unknown fields are kept aside (model_extra) to be reported, not dropped unseen."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())
