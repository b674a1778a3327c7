"""Requests, replies and events of the broker service (DESIGN.md §4 and §8, "Broker").

Every request carries `user` (crm's handler user): a tenant may name only itself (see
`endpoints.py`). Commands that change state accept an optional `request_id` (a retry with the same
id replays the first answer). Types are strict: a wrong type, a missing key or a value out of range
is `invalid_argument` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType, field

from schemas.common import Event, Request
from schemas.patterns import printable
from schemas.subjects import ShortName as Token

# Any printable text: ids go into subjects escaped, and into launched processes' environment.
ResourceId = printable(min_length=1, max_length=256)
RequestId = Annotated[str, Meta(max_length=200)]
Instances = Annotated[int, Meta(ge=1, le=10_000)]
Seconds = Annotated[float, Meta(ge=0, le=30 * 24 * 3600)]
Offset = Annotated[int, Meta(ge=0)]
Limit = Annotated[int, Meta(ge=1, le=1000)]

Status = Literal["init", "deploying", "running", "released", "deleting"]
ServiceStatus = Literal["staging", "running", "failed"]
# Ports are probed with TCP, so only TCP-based protocols can be declared.
Protocol = Literal["tcp", "http"]
# The param fields a broker can be matched on (`fit_fields`).
FitField = Literal["city", "platform", "env", "ports", "volumes", "image", "worker_version"]


# -- shared shapes ----------------------------------------------------------------------------


class Volume(Struct):
    host_dir: str
    container_dir: str = ""


class ResourceParam(Struct):
    """crm's ResourceParam. For the `process` operator, `image` names an image of its catalog.

    Names of env variables, ports and volumes are checked by `model.check_param` (which names the key).
    """

    city: str = ""
    platform: str = ""
    env: dict[str, str] = {}
    ports: dict[str, Protocol] = {}
    volumes: dict[str, Volume] = {}
    image: str = ""
    worker_version: str = ""
    broker_name: str = ""


class InstanceFilter(Request):
    """crm's instance filter callback as data: take min(available, request) when available >= least."""

    least_instance: Annotated[int, Meta(ge=0, le=10_000)]
    request_instance: Instances


class ConstStrategy(Struct, tag="const", tag_field="type"):
    """Keep `num` unsold resources (warming and idle)."""

    num: Annotated[int, Meta(ge=0, le=10_000)]


class ReactiveStrategy(Struct, tag="reactive", tag_field="type"):
    """Follow demand: as many unsold resources as applies (hits and misses) in the last window.

    Never fewer than `min` nor more than `max`; a surplus idle resource is released once it has
    been idle for `keep_seconds` (docs/broker.md, "Strategies").
    """

    max: Annotated[int, Meta(ge=0, le=10_000)]
    min: Annotated[int, Meta(ge=0, le=10_000)] = 0
    window_seconds: Annotated[float, Meta(gt=0, le=24 * 3600)] = 60.0
    keep_seconds: Seconds = 60.0


Strategy = ConstStrategy | ReactiveStrategy


class Endpoint(Struct):
    ip: str
    ports: dict[str, int]
    name: str


class ServiceInfo(Struct):
    status: ServiceStatus
    message: str = ""
    request_instances: int = 0
    current_instances: int = 0
    available_endpoints: list[Endpoint] = []


# -- resource commands ------------------------------------------------------------------------


class Init(Request):
    user: Token
    resource_id: ResourceId
    param: ResourceParam
    request_id: RequestId = ""


class Launch(Request):
    user: Token
    resource_id: ResourceId
    filter: InstanceFilter
    city: str | UnsetType = UNSET  # absent: the city of the resource's param (null is not a city)
    request_id: RequestId = ""


class Scale(Request):
    user: Token
    resource_id: ResourceId
    filter: InstanceFilter
    request_id: RequestId = ""


class ResourceRef(Request):
    user: Token
    resource_id: ResourceId


class Release(Request):
    user: Token
    resource_id: ResourceId
    request_id: RequestId = ""


class Apply(Request):
    user: Token
    resource_id: ResourceId
    param: ResourceParam
    filter: InstanceFilter
    request_id: RequestId = ""


class LaunchReply(Struct):
    request_instance: int
    broker_resource_id: str = ""


class ApplyReply(Struct):
    broker_resource_id: str


class Preparing(Struct):
    preparing: bool


class ResourceView(Struct):
    """A resource record as `get-resource` and `list-resources` answer it (crm's TableResource)."""

    resource_id: str
    user: str
    param: ResourceParam
    status: Status
    resource_block_key: str
    request_instance: int
    no_ready_instance: int
    broker_resource_id: str
    broker_name: str
    broker_sold: bool
    updated_at: float
    message: str = ""


class ListResources(Request):
    """Filters that are absent match everything the caller may see; a present one is typed
    strictly (null is invalid)."""

    user: Token | UnsetType = UNSET
    status: Status | UnsetType = UNSET
    broker_name: Token | UnsetType = UNSET
    broker_sold: bool | UnsetType = UNSET
    offset: Offset = 0
    limit: Limit = 100


class ResourceList(Struct):
    resources: list[ResourceView]
    total: int


class GetResourceDetail(Request):
    user: Token
    offset: Offset = 0
    limit: Limit = 100


class BlockDetail(Struct):
    """One capacity block: instances the operator can still run, and how many are reserved."""

    block: str
    total_instance: int
    used_instance: int
    report_instance: int  # free according to the operator
    available_instance: int  # report_instance - not_ready_instance
    not_ready_instance: int
    cpu_total: float = 0.0
    cpu_used: float = 0.0
    mem_total: int = 0
    mem_used: int = 0


class ResourceDetail(Struct):
    resource_id: str
    user: str
    status: Status
    broker_resource_id: str
    broker_name: str
    broker_sold: bool
    request_instance: int
    not_ready_instance: int
    block: str
    image: str
    created_at: float


class ResourceDetailReply(Struct):
    blocks: list[BlockDetail]
    resources: list[ResourceDetail]
    total: int


class GetInstanceType(Request):
    user: Token
    platform: str = ""
    group: str = ""


class InstanceType(Struct):
    cpu_per_instance: float
    mem_per_instance: int


class GetNamespace(Request):
    user: Token


class Namespace(Struct):
    namespace: str


# -- broker commands --------------------------------------------------------------------------


class BrokerConfig(Struct):
    """A broker: what `add-broker` asks for and the store keeps (crm's BrokerParam, with the fit
    function and strategy as data). `model.broker_config` makes one from the request."""

    user: Token
    name: Token
    strategy: Strategy
    param: ResourceParam
    instance: Instances = 1
    fit_fields: list[FitField] = field(default_factory=lambda: ["city", "worker_version"])
    release_loop: bool = False
    idle_keep_seconds: Seconds = 0.0


class AddBroker(BrokerConfig, Request):
    request_id: RequestId = ""


class RemoveBroker(Request):
    user: Token
    name: Token
    request_id: RequestId = ""


class RemovedBroker(Struct):
    released: list[str]


class ListBrokers(Request):
    user: Token | UnsetType = UNSET  # absent: every user the caller may see (a tenant: itself)


class BrokerView(Struct):
    user: str
    name: str
    strategy: Strategy
    target: int
    warming: int
    idle: int
    sold: int
    cooling_until: float
    deleting: int
    instance: int
    param: ResourceParam
    fit_fields: list[str]
    release_loop: bool
    idle_keep_seconds: float


class BrokerList(Struct):
    brokers: list[BrokerView]


# -- events -----------------------------------------------------------------------------------


class BrokerEvent(Event, kw_only=True, omit_defaults=True):
    """`berth.events.broker.<user>.<broker>.<launched|ready|sold|released|cooling|hit|miss>`.

    `resource_id` is the broker's resource (for `miss`, the caller's resource, as none was sold);
    `caller_id` is the caller's resource for `sold` and `hit`.
    """

    type: str = ""
    resource_id: str
    caller_id: str | None = None


class ResourceEvent(Event, kw_only=True, omit_defaults=True):
    """`berth.events.broker.resource.<user>.<resource_id>.<status>` (the id escaped)."""

    type: str = ""
    resource_id: str
    user: str
    broker_resource_id: str | None = None
    broker_name: str | None = None
