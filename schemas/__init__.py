"""The wire contract (docs/DESIGN.md): every message Struct (`common.py` for what all services share,
one module per service: `allocation.py`, `broker.py`, `metrics.py` with `metric_scopes.py`,
`agent.py`), the subject grammar and name rules (`subjects.py`, `patterns.py`), the error
vocabulary (`errors.py`) and byte sizes (`sizes.py`). It imports nothing of berth: `berth schema`
exports it as JSON Schema (`export.py`) or AsyncAPI (`asyncapi.py`) from the services' command
tables."""

from schemas.common import Empty, ErrorBody, ErrorInfo, Event

__all__ = ["Empty", "ErrorBody", "ErrorInfo", "Event"]
