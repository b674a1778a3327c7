"""berth's Python client (the product's face, DESIGN.md §1).

    from berth import Client

    async with await Client.connect() as berth:
        nodes = await berth.allocation.list_nodes(labels={"pool": "a"})

See berth/client.py for how it connects, berth/errors.py for what it raises.
"""

from berth.client import Client, Metrics
from berth.errors import Conflict, Error, Internal, InvalidInput, NotFound, PermissionDenied, Unavailable
from berth.events import Event, Events

__all__ = [
    "Client",
    "Conflict",
    "Error",
    "Event",
    "Events",
    "Internal",
    "InvalidInput",
    "Metrics",
    "NotFound",
    "PermissionDenied",
    "Unavailable",
]
