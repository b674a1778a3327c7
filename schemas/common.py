"""Structs shared by every service: the error body and the event envelope (DESIGN.md §2)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec


# The codes of the bus itself, beside each service's own (DESIGN.md §2, §8).
BUS_ERROR_CODES = (
    "invalid_argument: malformed input, or a bound passed (400; nothing applied; names the field)",
    "permission_denied: the caller may not do this (403; nothing applied)",
    "busy: retry later, with the same request_id (429)",
    "unavailable: nothing of the request was applied, the store could not be reached or refused it (503)",
    "outcome_unknown: a decisive write may have landed and its reply was lost; send the same request_id "
    "again for the real answer (504)",
    "internal: an unexpected error (500)",
)


class ErrorInfo(msgspec.Struct):
    code: Annotated[str, msgspec.Meta(description="snake_case; the bus's own: " + "; ".join(BUS_ERROR_CODES))]
    message: str
    details: dict[str, Any] = {}


class ErrorBody(msgspec.Struct):
    """The body of every error reply: `{"error": {"code", "message", "details"}}`."""

    error: ErrorInfo


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """The base of a request, or of a part only requests carry: an unknown key is `invalid_argument`
    naming it, with the accepted keys (DESIGN.md §8: a typo of `nodenames` must not place on every
    node, nor one of `request_id` place twice).

    Replies, events and stored records stay lenient (a client ignores keys it does not know, and old
    records may carry keys no longer read): a Struct they share with requests (a broker's `param`, an
    agent's `owner`) keeps the default, and the bus checks a request's keys in it (`bus.codec.decode`).
    """


class Empty(msgspec.Struct):
    """A request or reply without fields (`{}`): lenient, as a reply; the bus refuses any key sent in
    a request."""


class Event(msgspec.Struct, kw_only=True):
    """The envelope of every event: `type` is the last subject token, `time` unix seconds.

    Services subclass it with their payload fields.
    """

    type: str
    time: float = msgspec.field(default_factory=time.time)
