"""What `berth.Client` raises: one class per family of error replies, so that `except` reads well.

    try:
        await berth.allocation.allocate(nodenames=["n1"], deploy_count=2, workload_resource_request=...)
    except berth.Conflict as error:           # insufficient_capacity, workload_exists, node_down...
        print(error.code, error.status, error.details)
    except berth.Error:                       # every other error reply, timeout or lost server
        raise

Every class carries the reply's snake_case `code`, its HTTP-like `status`, the `message` and the
`details` map (DESIGN.md §2). They are `schemas.errors.BusError`s, which `bus.client.BusClient`
raises, so code written against the bus keeps catching them. The family follows the status:

| class | status | codes, for example |
|---|---|---|
| `InvalidInput` | 400 | invalid_argument, invalid_cpu, invalid_memory |
| `PermissionDenied` | 403 | permission_denied (the caller's role or identity) |
| `NotFound` | 404 | node_not_found, resource_not_found, metric_not_found |
| `Conflict` | 409, 412 | insufficient_capacity, workload_exists, node_down; metric_expired |
| `Unavailable` | 429, 503, 504 | busy, unavailable, outcome_unknown, not_leader, no_responders, timeout |
| `Internal` | 500, any other | internal |

An `Unavailable` said nothing definite, or nothing was applied: the same call later may succeed (a
state change is sent again with its `request_id` while the answer is busy, outcome_unknown or no
reply, so that it is applied once; see `bus.client`).
"""

from __future__ import annotations

from typing import Any

from schemas.errors import BusError


class Error(BusError):
    """An error reply of a berth service, or no reply: `code`, `status`, `message`, `details`."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None,
                 status: int | None = None) -> None:
        super().__init__(code, message, details, status=status)

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.message}"


class InvalidInput(Error):
    """The request was refused as it is (400): a field missing, unknown, of the wrong type or out of
    range; `details["field"]` names it where the service could."""


class PermissionDenied(Error):
    """The caller may not do this (403): a command above its role, or someone else's work."""


class NotFound(Error):
    """What the request names does not exist (404)."""


class Conflict(Error):
    """The state does not allow it (409: no capacity, already there, a node down or draining), or a
    precondition failed (412: a metric too old, a resource not running)."""


class Unavailable(Error):
    """Nothing definite came back, or nothing was applied (429 busy, 503, 504): retry later."""


class Internal(Error):
    """The service failed (500)."""


_FAMILIES: dict[int, type[Error]] = {
    400: InvalidInput, 403: PermissionDenied, 404: NotFound, 409: Conflict, 412: Conflict,
    429: Unavailable, 503: Unavailable, 504: Unavailable,
}


def family(status: int) -> type[Error]:
    """The class of an error reply with this status."""
    return _FAMILIES.get(status, Internal)


def from_bus(error: BusError) -> Error:
    """The `Error` of its family for an error the bus client raised."""
    if isinstance(error, Error):
        return error
    return family(error.status)(error.code, error.message, error.details, status=error.status)


def make(code: str, message: str, details: dict[str, Any] | None = None) -> Error:
    """An error of the client's own, of the family its code's status says (schemas/errors.py)."""
    error = BusError(code, message, details)
    return family(error.status)(code, message, details)
