"""The broker's transport: which command answers on which subject (`broker.<command>`), and how.

Each handler only translates between the wire Structs and the resource commands or the pool keeper.

Who may act for which user (DESIGN.md §8): every request names the `user` it acts for (crm's
handler user), and every record, broker and pool is kept under its user, so a request reaches only
what belongs to the user it names. A tenant may name only itself, the identity NATS authenticated;
a reader reads for anyone (the runtime refuses its changes); an admin, and a service asking from
the services' own account, act for anyone. `for_callers` makes that check once, before every
handler; listings that name no user show only what the caller may see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from msgspec import UNSET, UnsetType

from bus.callers import Role, current_caller
from bus.service import Command
from schemas.broker import (
    AddBroker,
    Apply,
    ApplyReply,
    BrokerList,
    BrokerView,
    GetInstanceType,
    GetNamespace,
    GetResourceDetail,
    Init,
    InstanceType,
    Launch,
    LaunchReply,
    ListBrokers,
    ListResources,
    Namespace,
    Preparing,
    Release,
    RemoveBroker,
    RemovedBroker,
    ResourceDetailReply,
    ResourceList,
    ResourceRef,
    ResourceView,
    Scale,
    ServiceInfo,
)
from schemas.common import Empty
from schemas.errors import PermissionDenied
from services.broker.commands import COMMANDS
from services.broker.config import InstanceTypes
from services.broker.pools import PoolKeeper
from services.broker.resources import BrokerResources



class BrokerEndpoints:
    def __init__(
        self,
        resources: BrokerResources,
        keeper: PoolKeeper,
        instance_types: InstanceTypes,
        namespace: str = "",
    ) -> None:
        self.resources = resources
        self.keeper = keeper
        self.instance_types = instance_types
        self.namespace = namespace

    async def init(self, req: Init) -> Empty:
        await self.resources.launching.init(req.user, req.resource_id, req.param)
        return Empty()

    async def launch(self, req: Launch) -> LaunchReply:
        launching = self.resources.launching
        record = await launching.launch(req.user, req.resource_id, req.city or None, req.filter)
        return LaunchReply(record.request_instance, record.broker_resource_id)

    async def scale(self, req: Scale) -> LaunchReply:
        record = await self.resources.launching.scale(req.user, req.resource_id, req.filter)
        return LaunchReply(record.request_instance, record.broker_resource_id)

    async def get_service_info(self, req: ResourceRef) -> ServiceInfo:
        return await self.resources.queries.service_info(req.user, req.resource_id)

    async def is_service_preparing(self, req: ResourceRef) -> Preparing:
        return Preparing(await self.resources.queries.is_preparing(req.user, req.resource_id))

    async def release(self, req: Release) -> Empty:
        await self.resources.releasing.release(req.user, req.resource_id)
        return Empty()

    async def apply(self, req: Apply) -> ApplyReply:
        record = await self.resources.launching.apply(req.user, req.resource_id, req.param, req.filter)
        return ApplyReply(record.broker_resource_id)

    async def add_broker(self, req: AddBroker) -> BrokerView:
        return await self.keeper.add(req)

    async def remove_broker(self, req: RemoveBroker) -> RemovedBroker:
        return RemovedBroker(await self.keeper.remove(req.user, req.name))

    async def list_brokers(self, req: ListBrokers) -> BrokerList:
        return BrokerList(await self.keeper.views(req.user or None, visible))

    async def get_instance_type(self, req: GetInstanceType) -> InstanceType:
        return self.instance_types.get(req.platform, req.group)

    async def get_namespace(self, req: GetNamespace) -> Namespace:
        return Namespace(self.namespace or req.user)

    async def get_resource_detail(self, req: GetResourceDetail) -> ResourceDetailReply:
        return await self.resources.queries.detail(req.offset, req.limit, visible)

    async def list_resources(self, req: ListResources) -> ResourceList:
        return await self.resources.queries.list_resources(req, visible)

    async def get_resource(self, req: ResourceRef) -> ResourceView:
        return (await self.resources.queries.get(req.user, req.resource_id)).view()


def visible(user: str) -> bool:
    """Whether the caller may see what `user` owns: a listing shows only that."""
    return current_caller.get().sees(user)


def check_user(user: str | UnsetType, changes: bool) -> None:
    """Refuse a request for `user` unless the caller may act for that user (the module docstring);
    a listing that names no user is narrowed by its handler instead."""
    caller = current_caller.get()
    if user is UNSET or (caller.owns(user) if changes else caller.sees(user)):
        return
    raise PermissionDenied(f"{caller} may not act for user {user}", field="user", details={"user": user})


Handler = Callable[[Any], Awaitable[Any]]


def _checked(command: Command, handler: Handler) -> Handler:
    changes = command.least_role > Role.READER  # what readers may not call changes: owners only

    async def checked(req: Any) -> Any:
        check_user(req.user, changes)
        return await handler(req)

    return checked


def for_callers(endpoints: BrokerEndpoints) -> SimpleNamespace:
    """The handlers `Service.bind` serves COMMANDS with: each of `endpoints`, behind `check_user`
    (one check for every command, so that a new command cannot go without it)."""
    return SimpleNamespace(**{c.handler: _checked(c, getattr(endpoints, c.handler)) for c in COMMANDS})
