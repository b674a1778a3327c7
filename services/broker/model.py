"""The broker's records and the pure rules over them (crm reference §1–2).

Nothing here does I/O: the resource commands load records, ask these functions (and
`transitions`) what to change, and the store writes the change atomically.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, TypeVar

import msgspec

from schemas.broker import (
    AddBroker,
    BrokerConfig,
    InstanceFilter,
    ResourceParam,
    ResourceView,
    ServiceInfo,
)
from schemas.errors import InvalidArgument
from schemas.subjects import NAME_PATTERN as TOKEN
from services.broker import errors

INIT, DEPLOYING, RUNNING, RELEASED, DELETING = "init", "deploying", "running", "released", "deleting"
# The statuses a resource can be used in; released and deleting ones answer resource_not_found.
LIVE = (INIT, DEPLOYING, RUNNING)


S = TypeVar("S", bound=msgspec.Struct)


class Resource(ResourceView, kw_only=True):
    """One resource record: what `get-resource` shows of it (crm's TableResource, `ResourceView`)
    plus the fields the broker needs to recover. `new_record` makes one.

    `launched`: the launch was accepted; the status stays `init` until the operator has it.
    `pending`: a launch or scale has not reached the operator yet (the `launch` timer's work).
    `deadline`: unix time by which a deploying resource must be finished (the deploy trace timeout,
    or a broker resource's readiness deadline). `message`: why the last operator launch failed.
    `version` is bumped by the store on every write (compare-and-set).
    """

    created_at: float = 0.0
    launched: bool = False
    pending: bool = False
    deadline: float = 0.0
    version: int = 0

    @property
    def live(self) -> bool:
        return self.status in LIVE

    @property
    def in_pool(self) -> bool:
        """A broker's own resource that has not been sold."""
        return bool(self.broker_name) and not self.broker_sold

    def shown_as(self, struct: type[S], **others: Any) -> S:
        """`struct` with the record's fields of the same names, and `others`."""
        shared = {name: getattr(self, name) for name in struct.__struct_fields__ if name not in others}
        return struct(**shared, **others)

    def view(self) -> ResourceView:
        return self.shown_as(ResourceView)


# What the view's fields of a record start at: nothing launched, reserved or sold.
UNLAUNCHED: dict[str, Any] = {
    "status": INIT,
    "resource_block_key": "",
    "request_instance": 0,
    "no_ready_instance": 0,
    "broker_resource_id": "",
    "broker_name": "",
    "broker_sold": False,
    "updated_at": 0.0,
}


def new_record(user: str, resource_id: str, param: ResourceParam, **fields: Any) -> Resource:
    """A record of `user`'s `resource_id`: `fields`, the others as `UNLAUNCHED`."""
    return Resource(resource_id=resource_id, user=user, param=param, **{**UNLAUNCHED, **fields})


def broker_config(req: AddBroker) -> BrokerConfig:
    """The broker `req` adds: its resources carry its name in their param, as crm's do, and each fit
    field counts once."""
    fields = {name: getattr(req, name) for name in BrokerConfig.__struct_fields__}
    return BrokerConfig(
        **{
            **fields,
            "param": msgspec.structs.replace(req.param, broker_name=req.name),
            "fit_fields": list(dict.fromkeys(req.fit_fields)),
        }
    )


class BrokerState(msgspec.Struct, kw_only=True):
    """A broker's timers, stored beside its config so that a new lease holder continues them."""

    cooling_until: float = 0.0
    next_recycle: float = 0.0  # idle recycling may release its next resource from then on


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_param(param: ResourceParam) -> None:
    """Names a Struct cannot check with a clear field: env variables, ports and volumes."""
    for field, names, pattern, rule in (
        ("env", param.env, ENV_NAME, "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"),
        ("ports", param.ports, TOKEN, "a name of letters, digits, '_' and '-'"),
        ("volumes", param.volumes, TOKEN, "a name of letters, digits, '_' and '-'"),
    ):
        for name in names:
            if not pattern.match(name) or len(name) > 128:
                raise InvalidArgument(f"param.{field}", f"key {name!r} must be {rule}")


def pool_resource_id(broker_name: str) -> str:
    """The id of a new resource in a broker's pool: `b<broker>-<8 hex digits>`."""
    return f"b{broker_name}-{secrets.token_hex(4)}"


def pool_resource_id_length(broker_name: str) -> int:
    """How long every id `pool_resource_id` gives for this broker is."""
    return len(broker_name) + 10


def now() -> float:
    return time.time()


def check_filter(instance_filter: InstanceFilter) -> None:
    if instance_filter.least_instance > instance_filter.request_instance:
        raise InvalidArgument(
            "filter.least_instance",
            f"must not exceed request_instance ({instance_filter.request_instance})",
        )


def take_instances(instance_filter: InstanceFilter, available: int) -> int:
    """The instance filter: min(available, request) when available >= least (never 0)."""
    least = max(instance_filter.least_instance, 1)
    if available < least:
        raise errors.no_enough_resources(max(available, 0), least)
    return min(available, instance_filter.request_instance)


def fits(broker: BrokerConfig, request: ResourceParam) -> bool:
    """A broker serves a request when every one of its `fit_fields` is equal in both params."""
    return all(getattr(broker.param, field) == getattr(request, field) for field in broker.fit_fields)


def ready_enough(instance: int, endpoints: int) -> bool:
    """The readiness gate: more than half of the instances answer (1->1, 2->2, 3->2, 4->3)."""
    return endpoints > instance // 2


def lost_with_nodes(info: ServiceInfo, lost: int) -> bool:
    """Every instance that is not ready was lost with its node (`lost` of them): the platform's
    failure, not the resource's, so a pool replaces it without cooling down (a node can go at any
    time)."""
    return lost > 0 and info.current_instances + lost >= info.request_instances


def terminal(info: ServiceInfo) -> bool:
    """Deploying is over when the operator says running or failed (crm: "finished", not "healthy")."""
    return info.status in ("running", "failed")


def observed(record: Resource, info: ServiceInfo) -> Resource:
    """The record after the operator reported `info`: deploying -> running when finished, and the
    not-ready reservation shrinks as instances come up (all of it is returned once finished).
    While a launch or scale is pending, what the operator says is not about the new request yet."""
    if record.pending:
        return record
    no_ready = record.no_ready_instance
    if terminal(info):
        no_ready = 0
    else:
        waiting = record.request_instance - info.current_instances
        if 0 <= waiting < no_ready:
            no_ready = waiting
    status = RUNNING if record.status == DEPLOYING and terminal(info) else record.status
    if (status, no_ready) == (record.status, record.no_ready_instance):
        return record
    return msgspec.structs.replace(record, status=status, no_ready_instance=no_ready, updated_at=now())


def failed_launch(record: Resource) -> ServiceInfo:
    return ServiceInfo(status="failed", message=record.message, request_instances=record.request_instance)
