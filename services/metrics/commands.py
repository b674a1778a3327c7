"""The metrics service's commands and events: which subject takes which message (DESIGN.md §5).

Only the contract's tables: the exporters (`berth schema`) and clients read them without starting a
worker. endpoints.py binds each command's `handler` to the code that answers it.
"""

from __future__ import annotations

from bus.callers import Role
from bus.events import StreamSpec
from bus.service import Command
from schemas.common import Empty
from schemas.metric_scopes import MetricValue
from schemas.metrics import (
    Aggregate,
    Deregistered,
    EVENT_PATTERN,
    Entries,
    Get,
    Lease,
    ListMetrics,
    MetricEvent,
    NotifierRequest,
    Put,
    RegisterNotifier,
    Synced,
)

def commands(node: str) -> list[Command]:
    """The commands of one node's agent (`node` is "<node>" in the exported schema)."""
    group = f"metrics.{node}"
    return [
        Command(f"{group}.get", Get, MetricValue, "get"),
        Command(f"{group}.aggregate", Aggregate, MetricValue, "aggregate"),
        # Every agent of the node keeps its own store, so every one of them must receive a put (and
        # each keeps its own answers to request ids: see `Service._idempotency_scope`).
        Command(f"{group}.put", Put, MetricValue, "put", idempotent=True, broadcast=True),
        Command(f"{group}.register-notifier", RegisterNotifier, Lease, "register_notifier", idempotent=True,
                role=Role.READER),
        Command(f"{group}.renew-notifier", NotifierRequest, Lease, "renew_notifier", idempotent=True,
                role=Role.READER),
        Command(
            f"{group}.deregister-notifier", NotifierRequest, Deregistered, "deregister_notifier", idempotent=True,
            role=Role.READER,
        ),
        Command(f"{group}.has-synced", Empty, Synced, "has_synced"),
        Command(f"{group}.list", ListMetrics, Entries, "list"),
    ]


COMMANDS = commands("<node>")
EVENTS = {EVENT_PATTERN: MetricEvent}
# A watched metric publishes a sample a second: samples get a stream of their own, kept an hour and
# at most 600 per metric (ten minutes at 1 s), so they never crowd out the day of change events.
STREAM = StreamSpec("metrics", ("metrics.>",), max_age=3600, max_bytes=256 << 20, max_msgs_per_subject=600)
