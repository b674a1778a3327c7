"""Byte sizes as every service takes them (DESIGN.md §8 "Sizes"): an integer, or a string with a
case-insensitive suffix ("4G", "512MiB", "16Gi", "1.5K"), exact up to 2^63-1; and as berth prints
them (`format_size`), which parses back to the same number.

eru coerces leniently (a size that does not parse becomes 0); berth refuses it with an
`invalid_argument` error naming the field instead.
"""

from __future__ import annotations

import math
import re

from schemas.errors import InvalidArgument

# Saturation bound for totals: eru's MaxInt, and the largest value a signed MessagePack int holds.
MAX_INT = 2**63 - 1

# A multiplier K, M, G, T or P, alone or followed by "i" (as berth prints it), "B" or "iB"; without
# one, "B" or "iB" alone.
_SIZE = re.compile(r"^\s*(-?)(\d+)(?:\.(\d+))?\s*(?:([KMGTP])(?:iB?|B)?|(?:i?B)?)\s*$", re.IGNORECASE)
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}
_UNITS = (("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))
_NOT_A_SIZE = ("is not a byte size: use an integer, or a number with a suffix K, M, G, T or P, alone or "
               "followed by i, B or iB ('16Gi', '512MiB', '1.5K')")


def parse_size(value: object, field: str, *, allow_negative: bool = False) -> int:
    """Bytes from an int, an integral float, or a string such as "4G", "512MiB", "16Gi", "1.5K", "1024".

    Strings are parsed in exact integer arithmetic (a float would round integers above 2^53), so
    every integer up to MAX_INT parses exactly. One leading "-" is accepted only where the request
    is a delta (`allow_negative`).
    """
    if isinstance(value, bool):
        raise InvalidArgument(field, "a byte size must be an integer or a string like '4G', not a boolean")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise InvalidArgument(field, f"a byte size must be integral, got {value!r}")
        value = int(value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = _parse_size_text(value, field)
    else:
        raise InvalidArgument(field, f"a byte size must be an integer or a string, got {type(value).__name__}")
    if size < 0 and not allow_negative:
        raise InvalidArgument(field, f"must not be negative, got {size}")
    if abs(size) > MAX_INT:
        raise InvalidArgument(field, f"{size} is larger than {MAX_INT}")
    return size


def _parse_size_text(text: str, field: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise InvalidArgument(field, f"{text[:40]!r} {_NOT_A_SIZE}")
    sign, whole, fraction, suffix = match.groups()
    fraction = (fraction or "").rstrip("0")
    # Bound the digits before int() (Python refuses > 4300): past 19 the size exceeds MAX_INT, and
    # a fraction of more than 50 significant digits is never a whole number of bytes (2^50 at most).
    if len(whole.lstrip("0")) > 19 or len(fraction) > 50:
        raise InvalidArgument(field, f"{text[:40]!r} is not a byte size of at most {MAX_INT}")
    scale = 1 << _SHIFT[(suffix or "").upper()]
    # whole.fraction * scale, exactly: the fraction's digits over 10^len must come out whole.
    numerator = (int(whole) * 10 ** len(fraction) + int(fraction or "0")) * scale
    size, remainder = divmod(numerator, 10 ** len(fraction))
    if remainder:
        raise InvalidArgument(field, f"{text!r} is not a whole number of bytes")
    return -size if sign else size


def format_size(size: int) -> str:
    """`size` bytes as berth prints them: in the largest binary unit that writes it exactly with at
    most two decimals ("16Gi", "1.5Ki", "1.25Mi"), else in bytes ("1000"). `parse_size` reads each
    back to `size`, so whatever berth shows can be sent back."""
    sign, size = ("-" if size < 0 else ""), abs(size)
    for unit, shift in _UNITS:
        hundredths, remainder = divmod(size * 100, 1 << shift)
        if size >> shift and not remainder:
            whole, cents = divmod(hundredths, 100)
            return f"{sign}{whole}" + (f".{cents:02d}".rstrip("0") if cents else "") + unit
    return f"{sign}{size}"
