"""What every part of the broker's resource commands works with (`resources.BrokerResources`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.broker import errors
from services.broker.config import Timing
from services.broker.model import Resource
from services.broker.operators.base import Operator
from services.broker.publisher import Publisher
from services.broker.store import BrokerStore

# A record changed by someone else between our read and our write is read again this many times.
RETRIES = 5


@dataclass(frozen=True)
class Context:
    store: BrokerStore
    operator: Operator
    publish: Publisher
    timing: Timing


class Part:
    """A part of the resource commands: the context's pieces as attributes, and the common read."""

    def __init__(self, context: Context) -> None:
        self.store = context.store
        self.operator = context.operator
        self.publish = context.publish
        self.timing = context.timing

    async def live(self, user: str, resource_id: str) -> Resource:
        """A record in use (init, deploying, running); resource_not_found for any other."""
        record = await self.store.load(user, resource_id)
        if record is None or not record.live:
            raise errors.resource_not_found(resource_id)
        return record
