"""The metrics service's own error codes (DESIGN.md §5 and §8, "Metrics").

`invalid_argument` is the bus's (`schemas.errors.InvalidArgument`); the notifier's `notifier_not_found`
lives beside the notifier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.errors import BerthError

if TYPE_CHECKING:
    from schemas.metric_scopes import MetricValue


class MetricNotFound(BerthError):
    """Nothing is stored for the entity or the metric; the details say which is missing."""

    code = "metric_not_found"


class MetricExpired(BerthError):
    """The value exists but is older than the insurance period; it travels with the error."""

    code = "metric_expired"
    http_status = 412  # a precondition (fresh enough data) failed, the value is there

    def __init__(self, message: str, data: MetricValue, details: dict[str, Any]) -> None:
        super().__init__(message, details={**details, "value": data.value, "time": data.time})
        self.data = data
