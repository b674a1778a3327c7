"""Structs shared by every service: the error body and the event envelope (DESIGN.md §2)."""

from __future__ import annotations

import time
from typing import Any

import msgspec


class ErrorInfo(msgspec.Struct):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorBody(msgspec.Struct):
    """The body of every error reply: `{"error": {"code", "message", "details"}}`."""

    error: ErrorInfo


class Empty(msgspec.Struct):
    """A request or reply without fields (`{}`)."""


class Event(msgspec.Struct, kw_only=True):
    """The envelope of every event: `type` is the last subject token, `time` unix seconds.

    Services subclass it with their payload fields.
    """

    type: str
    time: float = msgspec.field(default_factory=time.time)
