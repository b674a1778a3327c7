"""msgspec Structs for every message; `python -m schemas` (or `berth schema`) writes JSON Schema."""

from schemas.common import Empty, ErrorBody, ErrorInfo, Event

__all__ = ["Empty", "ErrorBody", "ErrorInfo", "Event"]
