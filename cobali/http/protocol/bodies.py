"""The base of every request body: strict types, unknown fields kept aside to be reported, one clear error for
a union, text that UTF-8 can carry, and OpenAI's batch of texts."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
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
        return [list(value)]
    return list(value)  # type: ignore[arg-type]  # texts or token lists: mypy cannot narrow a list by its first item


def _encodes(text: str) -> bool:
    if text.isascii():  # a flag lookup: most text needs no encoding to know
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON's "\ud800" parses, but no UTF-8 can carry it
        return False
    return True


_SCALARS = frozenset({int, float, bool, type(None)})


def unencodable_text(data: Any) -> tuple[str, bool] | None:
    """Where parsed JSON holds text UTF-8 cannot encode: (the dotted path, whether it is an object key there),
    or None. One pass over the strings, without recursion (JSON may nest as deep as the parser allows)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return ".".join(map(str, path)), False
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    return ".".join(map(str, path)), True
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, key)))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):  # token ids: read in C
            stack.extend((item, (*path, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


class Body(BaseModel):
    # allow_inf_nan: Python's json accepts the NaN / Infinity literals; say so instead of a misleading range error.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class RequestBody(Body):
    """A request body: unknown fields are kept aside (model_extra) to be reported, not dropped unseen."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        """Every string of the body, keys too, before any field: text that cannot be encoded would otherwise fail
        wherever it is first written out (an error message naming it, an echoed prompt after the generation)."""
        where = unencodable_text(data)
        if where is not None:
            field, is_key = where
            what = "an object key" if is_key else "text"
            raise PydanticCustomError("unencodable_text", "{what} must be valid Unicode: a lone surrogate cannot be "
                                      "encoded as UTF-8", {"what": what, "field": field})
        return data

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())
