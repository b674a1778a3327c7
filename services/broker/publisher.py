"""The broker's events (DESIGN.md §4, §8): pool events per broker, status events per resource."""

from __future__ import annotations

from bus.events import EventBus
from schemas.broker import BrokerEvent, ResourceEvent
from schemas.subjects import escape_token
from services.broker.model import Resource


def pool_event(
    user: str, broker: str, kind: str, resource_id: str, caller_id: str | None = None
) -> tuple[str, BrokerEvent]:
    """`broker.<user>.<broker>.<launched|ready|sold|released|cooling|hit|miss>`."""
    return f"broker.{user}.{broker}.{kind}", BrokerEvent(resource_id=resource_id, caller_id=caller_id)


def status_event(record: Resource) -> tuple[str, ResourceEvent]:
    """`broker.resource.<user>.<resource_id>.<status>`: a resource entered `record.status`."""
    event = ResourceEvent(
        resource_id=record.resource_id,
        user=record.user,
        broker_resource_id=record.broker_resource_id or None,
        broker_name=record.broker_name or None,
    )
    return f"broker.resource.{record.user}.{escape_token(record.resource_id)}.{record.status}", event


class Publisher:
    """Events that no record write carries (those go through the store's outbox, `status_event`
    and `pool_event` with the write): an apply's hits, misses and sale, a broker cooling down."""

    def __init__(self, events: EventBus) -> None:
        self.events = events

    async def pool(
        self, user: str, broker: str, kind: str, resource_id: str, caller_id: str | None = None
    ) -> None:
        await self.events.publish(*pool_event(user, broker, kind, resource_id, caller_id))

    async def status(self, record: Resource) -> None:
        await self.events.publish(*status_event(record))
