"""MessagePack encoding with typed decoding (msgspec).

A payload that fails to decode or validate raises `InvalidArgument` naming the field, so the
service runtime can answer `invalid_argument` instead of losing the endpoint to an exception.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from bus.errors import InvalidArgument

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}

# msgspec reports the failing path as "... - at `$.a.b[0]`", or "... - at `key` in `$.a`" for a
# map key; we turn that into the field name "a.b[0]" (and "a" with "map key" in the reason).
_PATH = re.compile(r"^(?P<reason>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def _decoder(type_: Any) -> msgspec.msgpack.Decoder:
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return decoder


def decode(data: bytes, type_: type[T]) -> T:
    """Decode `data` as `type_`; any failure is an `InvalidArgument` naming the field at fault."""
    try:
        return _decoder(type_).decode(data)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error) from None
    except msgspec.DecodeError as error:
        raise InvalidArgument("$", f"not a MessagePack map: {error}") from None


def decode_as(data: bytes, type_: type[T], field: str) -> T:
    """Decode a part of a payload kept raw (`msgspec.Raw`) so that errors name its field."""
    try:
        return _decoder(type_).decode(data)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error, prefix=field) from None
    except msgspec.DecodeError as error:
        raise InvalidArgument(field, f"malformed: {error}") from None


def convert(value: Any, type_: type[T], *, path: str = "") -> T:
    """Validate an already-decoded value (for example one plugin's sub-map) as `type_`."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error, prefix=path) from None


def invalid_argument_from(error: msgspec.ValidationError, prefix: str = "") -> InvalidArgument:
    match = _PATH.match(str(error))
    reason = match.group("reason") if match else str(error)
    path = (match.group("path") or "") if match else ""
    if match and match.group("key"):
        reason = f"map key: {reason}"
    field = (prefix + path).lstrip(".") or "$"
    if reason.startswith("Object missing required field"):
        # "Object missing required field `x`": the missing key is the field, not its parent.
        missing = reason.split("`")[1]
        field = f"{field}.{missing}" if field != "$" else missing
        reason = "required field is missing"
    return InvalidArgument(field, reason)
