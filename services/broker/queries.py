"""The read commands: `get-resource`, `is-service-preparing`, `get-service-info`,
`list-resources` and `get-resource-detail`."""

from __future__ import annotations

from collections.abc import Callable

from schemas.broker import (
    ListResources,
    ResourceDetailReply,
    ResourceList,
    ServiceInfo,
)
from services.broker import errors, views
from services.broker.context import Context, Part
from services.broker.model import INIT, RELEASED, Resource
from services.broker.tracking import Tracking

# Whether the caller may see what a user owns (`bus.callers.Caller.sees`): listings show only that.
Visible = Callable[[str], bool]


class Queries(Part):
    def __init__(self, context: Context, tracking: Tracking) -> None:
        super().__init__(context)
        self.tracking = tracking

    async def get(self, user: str, resource_id: str) -> Resource:
        """Any record, released ones included (they stay readable for the idempotency window)."""
        record = await self.store.load(user, resource_id)
        if record is None:
            raise errors.resource_not_found(resource_id)
        return record

    async def is_preparing(self, user: str, resource_id: str) -> bool:
        # crm answers (false, nil) for an id it does not know, and a released record is one it has
        # deleted: so unknown and released both read "not preparing", never resource_not_found.
        record = await self.store.load(user, resource_id)
        return record is not None and record.status == INIT

    async def service_info(self, user: str, resource_id: str) -> ServiceInfo:
        record = await self.live(user, resource_id)
        if record.broker_resource_id:
            target = await self.store.load(user, record.broker_resource_id)
            if target is None or not target.live:
                raise errors.resource_not_found(record.broker_resource_id, field="broker_resource_id")
            return await self.operator.status(user, target.resource_id)
        if record.status == INIT:
            if not record.launched:
                raise errors.not_launched(resource_id, "it was initialized but not launched")
            return ServiceInfo(
                "staging", "preparing: the launch has not reached the operator yet", record.request_instance
            )
        _, info = await self.tracking.refresh(record)
        return info

    async def forget_expired(self, user: str, resource_id: str) -> None:
        """The `forget` timer: a released record has expired, and its index entry goes. The id may
        live again meanwhile (`init` or `apply` on a released id): then it stays; a record still
        released (Redis has not expired it yet) brings the timer back after a claim."""
        record = await self.store.load(user, resource_id)
        if record is None:
            await self.store.forget([(user, resource_id)])
        if record is None or record.status != RELEASED:
            await self.store.drop_timer("forget", user, resource_id)

    async def all_records(self) -> list[Resource]:
        """Every record in the index; index entries of records that expired are dropped."""
        refs = await self.store.index_refs()
        records = await self.store.load_many(refs)
        await self.store.forget([ref for ref, record in zip(refs, records) if record is None])
        return [record for record in records if record is not None]

    async def list_resources(self, req: ListResources, visible: Visible) -> ResourceList:
        matching = [r for r in await self.all_records() if visible(r.user) and views.matches(req, r)]
        page = matching[req.offset : req.offset + req.limit]
        return ResourceList([r.view() for r in page], len(matching))

    async def detail(self, offset: int, limit: int, visible: Visible) -> ResourceDetailReply:
        """The capacity blocks (everyone's, as the operator reports them) and the live resources."""
        blocks = views.block_details(await self.operator.blocks(), await self.store.reservations())
        live = [r for r in await self.all_records() if visible(r.user) and r.status != RELEASED]
        resources = [views.resource_detail(r) for r in live[offset : offset + limit]]
        return ResourceDetailReply(blocks, resources, len(live))
