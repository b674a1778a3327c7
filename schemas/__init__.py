"""The Structs every service shares (error body, event envelope) and the schema exports: `berth schema`
(or `python -m schemas.export`) writes JSON Schema of every message, `--asyncapi` an AsyncAPI document."""

from schemas.common import Empty, ErrorBody, ErrorInfo, Event

__all__ = ["Empty", "ErrorBody", "ErrorInfo", "Event"]
