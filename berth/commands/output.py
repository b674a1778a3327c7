"""What the everyday commands print: JSON (bytes as base64), tables, one flushed line at a time."""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from bus.codec import decode_stored


def _enc_hook(value: Any) -> Any:
    if isinstance(value, msgspec.msgpack.Ext):  # no berth message has any; shown rather than lost
        return {"msgpack_ext": value.code, "data": msgspec.json.decode(msgspec.json.encode(value.data))}
    raise NotImplementedError(f"cannot print a {type(value).__name__}")


_json = msgspec.json.Encoder(enc_hook=_enc_hook)


def to_json(value: Any, *, pretty: bool = False) -> str:
    """JSON text of a decoded MessagePack value: bytes as base64, maps with any scalar keys."""
    data = _json.encode(value)
    return (msgspec.json.format(data, indent=2) if pretty else data).decode()


def decode_msgpack(data: bytes) -> Any:
    """A MessagePack body as Python values; an empty body is None."""
    return decode_stored(data) if data else None


def emit(text: str) -> None:
    """A line on standard output, flushed (a reader of a live tail sees it at once)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
