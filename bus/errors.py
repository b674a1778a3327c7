"""Domain errors and their wire form (DESIGN.md §2 and §8).

A handler raises a `BerthError` (or a subclass); the service runtime turns it into the
`Nats-Service-Error-Code` / `Nats-Service-Error` headers and the `{"error": {...}}` body.
The client turns such a reply back into a `BusError` carrying the same code.

This module imports nothing from nats so that pure calculation code can raise these errors.
"""

from __future__ import annotations

from typing import Any

# HTTP-like status per error code. Codes not listed fall back by their shape (see `status_of`).
_STATUS: dict[str, int] = {
    "invalid_argument": 400,
    "node_not_found": 404,
    "plugin_not_found": 404,
    "resource_not_found": 404,
    "application_not_found": 404,
    "metric_not_found": 404,
    "node_exists": 409,
    "node_not_empty": 409,
    "insufficient_capacity": 409,
    "insufficient_resource": 409,
    "no_enough_resources": 409,
    "broker_not_enough_resources": 409,
    "broker_param_not_fit": 409,
    "resource_not_running": 412,
    "metric_expired": 412,
    "busy": 429,
    "manager_not_running": 503,
    "unavailable": 503,
    "broker_cooling": 503,
    "not_leader": 503,
    "timeout": 504,
    "internal": 500,
}


def status_of(code: str) -> int:
    """The HTTP-like status for an error code (DESIGN.md §8)."""
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
        return status_of(self.code)

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


class NotFound(BerthError):
    code = "not_found"


class Conflict(BerthError):
    code = "conflict"


class BusError(BerthError):
    """Raised by the client for an error reply; carries the code, status and details sent."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None, status: int | None = None):
        super().__init__(message, code=code, details=details)
        self._status = status if status is not None else status_of(code)

    @property
    def status(self) -> int:
        return self._status


class RequestTimeout(BusError):
    """No reply within the client's explicit timeout."""

    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__("timeout", f"no reply on {subject} within {timeout} s", {"subject": subject})


class NoResponders(BusError):
    """Nobody listens on the subject (no worker of that service is running)."""

    def __init__(self, subject: str) -> None:
        super().__init__("no_responders", f"no service answers on {subject}", {"subject": subject}, status=503)
