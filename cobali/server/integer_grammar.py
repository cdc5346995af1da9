"""JSON integers within bounds, as GBNF: JSON Schema's minimum, maximum, exclusiveMinimum and exclusiveMaximum on
an integer, held digit by digit (no leading zeros, no "-0"). Like the unbounded `integer` rule, at most 16
digits: a model cannot write digits forever. Bounds that leave only integers of more than MAX_BOUND_DIGITS digits
are refused (ValueError).
"""

from __future__ import annotations

import math
from typing import Any

from cobali.server.gbnf import alternatives

MAX_DIGITS = 16
MAX_BOUND_DIGITS = 100  # bounds that leave only longer integers are refused (and each digit is a recursion)


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The least and greatest integer the schema allows (None: unbounded); ValueError for an empty range."""
    low = _bound(schema.get("minimum"), math.ceil, 0)
    high = _bound(schema.get("maximum"), math.floor, 0)
    exclusive_low = _bound(schema.get("exclusiveMinimum"), math.floor, 1)
    exclusive_high = _bound(schema.get("exclusiveMaximum"), math.ceil, -1)
    low = max((b for b in (low, exclusive_low) if b is not None), default=None)
    high = min((b for b in (high, exclusive_high) if b is not None), default=None)
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer lies between the schema's bounds ({low} > {high})")
    return low, high


def _bound(value: Any, to_integer, step: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):  # math.isfinite of an int past floats overflows
        return None
    return int(to_integer(value)) + step


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF expression for the JSON integers in [low, high] (None: unbounded on that side)."""
    options = []
    if low is None or low < 0:  # negatives: "-" and their magnitudes, which run the other way
        top = -1 if high is None else min(high, -1)
        if top >= (low if low is not None else top):
            options.append('"-" ' + _naturals(-top, None if low is None else -low))
    if high is None or high >= 0:
        options.append(_naturals(max(low or 0, 0), high))
    return alternatives(options)


def _naturals(low: int, high: int | None) -> str:
    """The naturals in [low, high], up to MAX_DIGITS digits."""
    shortest = len(str(low))
    if shortest > MAX_BOUND_DIGITS:
        raise ValueError(f"the schema's integer bounds leave only integers of more than {MAX_BOUND_DIGITS} digits")
    longest = max(shortest, MAX_DIGITS if high is None else min(len(str(high)), MAX_DIGITS))
    options = []
    for n in range(shortest, longest + 1):
        lo = str(low) if n == shortest else "1" + "0" * (n - 1)
        hi = str(high) if high is not None and n == len(str(high)) else "9" * n
        options.append(_same_length(lo, hi))
    return alternatives(options)


def _same_length(lo: str, hi: str) -> str:
    """The numbers from lo to hi, both written with the same count of digits."""
    if lo == hi:
        return f'"{lo}"'
    if lo[0] == hi[0]:
        return f'"{lo[0]}" {_same_length(lo[1:], hi[1:])}'
    rest = len(lo) - 1
    first, last = int(lo[0]), int(hi[0])
    options = []
    if lo[1:] != "0" * rest:  # the first digit's own numbers do not start at ...000
        options.append(f'"{lo[0]}" {_same_length(lo[1:], "9" * rest)}')
        first += 1
    tail = []
    if hi[1:] != "9" * rest:
        tail.append(f'"{hi[0]}" {_same_length("0" * rest, hi[1:])}')
        last -= 1
    if first <= last:
        digits = f"[{first}-{last}]" if first < last else f'"{first}"'
        options.append(f"{digits} [0-9]{{{rest}}}" if rest else digits)
    options += tail
    return alternatives(options)
