"""The error vocabulary and its wire form (DESIGN.md §2 and §8): part of the contract, so it lives
in schemas/ and imports nothing of berth.

A handler raises a `BerthError` (or a subclass); the service runtime turns it into the
`Nats-Service-Error-Code` / `Nats-Service-Error` headers and the `{"error": {...}}` body.
The client turns such a reply back into a `BusError` carrying the same code.

Here are the errors every service shares: `InvalidArgument`, `PermissionDenied`, the runtime's
`Unavailable`, `OutcomeUnknown` and `internal`, and the client's `RequestTimeout` and
`NoResponders`. Each service owns its own codes and defines them next to its code
(`services/broker/errors.py`, `services/metrics/errors.py`; the allocation service raises
`BerthError(code=...)` where it refuses); their statuses follow §8.

It imports nothing from nats either, so that pure calculation code can raise these errors.
"""

from __future__ import annotations

from typing import Any

# The HTTP-like status of a code that its shape does not give (see `status_of`). Bus-level codes are
# the runtime's and the client's own; the others are DESIGN.md §8's table, which every service
# follows (a code a service owns keeps that status whichever service's runtime answers it).
_STATUS: dict[str, int] = {
    # bus level
    "busy": 429,  # a retry later may succeed (a claim or a version changed meanwhile)
    "unavailable": 503,  # nothing of the request was applied: the store could not be reached, or refused it
    "outcome_unknown": 504,  # a decisive write may have landed; a retry with the same request_id tells
    "not_leader": 503,
    "no_responders": 503,  # nobody listens on the subject (the client's own)
    "timeout": 504,  # no reply in time (the client's own)
    "permission_denied": 403,  # the caller's role or identity may not do this (bus.callers)
    # DESIGN.md §8 "HTTP-like statuses", where the shape alone would say 500
    "node_not_empty": 409,
    "node_down": 409,  # its agent's lease lapsed: it takes no new workloads (services/allocation/leases.py)
    "node_draining": 409,
    "insufficient_capacity": 409,
    "insufficient_resource": 409,
    "no_enough_resources": 409,
    "broker_not_enough_resources": 409,
    "broker_param_not_fit": 409,
    "resource_not_running": 412,
    "manager_not_running": 503,
    "broker_cooling": 503,
}


def status_of(code: str) -> int:
    """The HTTP-like status for an error code (DESIGN.md §8): `_STATUS`, else by the code's shape
    (`invalid_*` 400, `*_not_found` 404, `*_exists` and `*_already_*` 409), else 500 (`internal`)."""
    if code in _STATUS:
        return _STATUS[code]
    if code.startswith("invalid_"):
        return 400
    if code.endswith("_not_found"):
        return 404
    if code.endswith("_exists") or "_already_" in code:
        return 409
    return 500


class BerthError(Exception):
    """An error with a stable snake_case code, a human message and structured details.

    `field`, when given, names the request field at fault; it goes into `details["field"]`.
    """

    code: str = "internal"
    # The status of a code that neither `_STATUS` nor its shape gives: set by the error class of the
    # service that owns the code (metrics' `metric_expired`), or from the reply's header (`BusError`).
    http_status: int | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        if field is not None:
            self.details["field"] = field

    @property
    def status(self) -> int:
        return status_of(self.code) if self.http_status is None else self.http_status

    @property
    def field(self) -> str | None:
        return self.details.get("field")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}: {self.message})"


class InvalidArgument(BerthError):
    """A request field is missing, of the wrong type or out of range. Always names the field."""

    code = "invalid_argument"

    def __init__(self, field: str, reason: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(f"{field}: {reason}", code=code, field=field, details=details)


class PermissionDenied(BerthError):
    """The caller may not do this: a command above its role, or someone else's work (bus.callers)."""

    code = "permission_denied"


class Unavailable(BerthError):
    """Nothing of the request was applied: its store could not be reached (no decisive write was
    sent), or refused the write (out of memory). Retry."""

    code = "unavailable"


class OutcomeUnknown(BerthError):
    """A decisive write of the request may have reached the store, and its reply did not come back:
    the change may or may not be made. The request's `request_id` (sent again) gives the real answer."""

    code = "outcome_unknown"


class BusError(BerthError):
    """Raised by the client for an error reply; carries the code, status and details sent."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None, status: int | None = None):
        super().__init__(message, code=code, details=details)
        self.http_status = status


class RequestTimeout(BusError):
    """No reply within the client's explicit timeout."""

    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__("timeout", f"no reply on {subject} within {timeout} s", {"subject": subject})


class NoResponders(BusError):
    """Nobody listens on the subject: no worker of that service is running, or, on a subject only a
    node's agent answers (`node`: `schemas.subjects.served_node`), no agent of that node."""

    def __init__(self, subject: str, node: str | None = None) -> None:
        if node is None:
            super().__init__("no_responders", f"no service answers on {subject}", {"subject": subject})
        else:
            super().__init__("no_responders", f"no agent serves node {node} (nobody answers on {subject}: is "
                             "`berth agent` running there?)", {"subject": subject, "node": node})


def answered_nothing(error: BusError) -> bool:
    """Whether a call failed for want of an answer, so that the same call later may succeed: nobody
    listened, no reply came in time, or the service could not reach its store (before or after
    its change: the next call finds what is there)."""
    return error.code in ("no_responders", "timeout", "unavailable", "outcome_unknown")
