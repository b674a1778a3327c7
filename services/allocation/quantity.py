"""Strict parsing of the CPU quantities that allocation requests carry, and saturating totals
(DESIGN.md §8; byte sizes are every service's: schemas/sizes.py).

eru coerces leniently (a size that does not parse becomes 0); berth rejects it with an
`invalid_argument` error naming the field instead.
"""

from __future__ import annotations

import math

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT

def parse_cpu(value: object, field: str, *, allow_negative: bool = False) -> float:
    """A CPU quantity: an int or a finite float, never a string or a boolean."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(field, f"a CPU quantity must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value!r}")
    if value < 0 and not allow_negative:
        raise InvalidArgument(field, f"must not be negative, got {value}")
    if abs(value) > 1e12:
        raise InvalidArgument(field, f"{value} is unreasonably large")
    return float(value)


def saturating_add(a: int, b: int) -> int:
    """a + b clamped to [-MAX_INT, MAX_INT]: totals saturate instead of overflowing."""
    return max(-MAX_INT, min(MAX_INT, a + b))
