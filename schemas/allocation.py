"""Requests and replies of the allocation service (DESIGN.md §3 and §8).

One Struct per command serves both levels: at plugin level (`resource.<plugin>.<command>`) the
resource fields hold that plugin's map; at manager level (`resource.<command>`) they hold a map
keyed by plugin name. Plugin-specific contents are validated by each plugin, which names the field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from schemas.common import Event, Request
from schemas.patterns import END, matching
from schemas.subjects import NodeName

Raw = dict[str, Any]
# The server decodes a long candidate list as its MessagePack bytes and decodes the names once
# per distinct list (see services/allocation/selection.py NodeSet): the *Wire subclasses below.
NULL = msgspec.Raw(b"\xc0")
WorkloadId = Annotated[str, Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, Meta(max_length=200)]
DeployCount = Annotated[int, Meta(ge=1, le=1_000_000)]
MAX_LABELS = 128  # labels per node (and per selector): each node's labels are matched on every selection
Labels = Annotated[
    dict[Annotated[str, Meta(min_length=1, max_length=256)], Annotated[str, Meta(max_length=1024)]],
    Meta(max_length=MAX_LABELS),
]
Strategy = matching(f"^(spread|pack|each){END}", "spread, pack or each")

# -- the eru plugin commands (both levels) --------------------------------------------------


class CalculateDeploy(Request):
    nodename: NodeName
    deploy_count: DeployCount
    workload_resource_request: Raw | None = None


class CalculateDeployReply(Struct):
    engines_params: list[Raw]
    workloads_resource: list[Raw]


class CalculateRealloc(Request):
    nodename: NodeName
    workload_resource: Raw
    workload_resource_request: Raw | None = None


class CalculateReallocReply(Struct):
    engine_params: Raw
    delta_resource: Raw
    workload_resource: Raw


class CalculateRemap(Request):
    nodename: NodeName
    workloads_resource: dict[WorkloadId, Raw] = {}


class CalculateRemapReply(Struct):
    engine_params_map: dict[str, Raw]


class EngineInfoMsg(Request):
    ncpu: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    memory_total: Annotated[int, Meta(ge=0)] = 0
    storage_total: Annotated[int, Meta(ge=0)] = 0
    resources: dict[str, Raw] = {}


class AddNode(Request):
    nodename: NodeName
    resource: Raw | None = None
    info: EngineInfoMsg | None = None
    labels: Labels = {}
    request_id: RequestId = ""


class CapacityUsage(Struct):
    capacity: Raw
    usage: Raw


class NodeRequest(Request):
    nodename: NodeName
    request_id: RequestId = ""


class GetNodesDeployCapacity(Request):
    """`nodenames` lists the nodes, `labels` selects those whose labels match; neither: every node."""

    nodenames: list[NodeName] | None = None
    labels: Labels | None = None
    workload_resource_request: Raw | None = None


class GetNodesDeployCapacityWire(GetNodesDeployCapacity):
    nodenames: msgspec.Raw = NULL


class NodeDeployCapacityMsg(Struct):
    capacity: int
    usage: float
    rate: float
    weight: float


class GetNodesDeployCapacityReply(Struct):
    nodes_deploy_capacity_map: dict[str, NodeDeployCapacityMsg]
    total: int


class SetNodeResourceCapacity(Request):
    nodename: NodeName
    resource: Raw | None = None
    resource_request: Raw | None = None
    delta: bool = False
    incr: bool = True
    request_id: RequestId = ""


class BeforeAfter(Struct):
    before: Raw
    after: Raw


class GetNodeResourceInfo(Request):
    nodename: NodeName
    workloads_resource: list[Raw] | None = None
    request_id: RequestId = ""


class NodeResourceInfo(Struct):
    capacity: Raw
    usage: Raw
    diffs: list[str]


class SetNodeResourceInfo(Request):
    nodename: NodeName
    capacity: Raw
    usage: Raw
    request_id: RequestId = ""


class SetNodeResourceUsage(Request):
    nodename: NodeName
    resource: Raw | None = None
    resource_request: Raw | None = None
    workloads_resource: list[Raw] = []
    delta: bool = False
    incr: bool = True
    request_id: RequestId = ""


class GetMostIdleNode(Request):
    """`nodenames` lists the nodes, `labels` selects those whose labels match; neither: every node."""

    nodenames: Annotated[list[NodeName], Meta(min_length=1, max_length=100_000)] | None = None
    labels: Labels | None = None


class MostIdleNode(Struct):
    nodename: str
    priority: int


class MetricDescription(Struct):
    name: str
    help: str
    type: str
    labels: list[str]


class MetricsDescriptionReply(Struct):
    descriptions: list[MetricDescription]


class GetMetrics(Request):
    podname: Annotated[str, Meta(max_length=256)]
    nodename: NodeName


class Metric(Struct):
    name: str
    labels: list[str]
    key: str
    value: float


class MetricsReply(Struct):
    metrics: list[Metric]


# -- manager-only commands ------------------------------------------------------------------


class Allocate(Request, omit_defaults=True):
    """One `nodename`; or `nodenames` and/or `labels` (the listed nodes, those whose labels match, or
    the listed ones that match); or neither: every node. `dry_run`: answer the plan (the nodes and
    the resources each instance would get) and commit nothing; its request id is neither claimed
    nor kept, and no workload id is minted (`workload_id` is the given one, else "")."""

    deploy_count: DeployCount
    nodename: NodeName | None = None
    nodenames: list[NodeName] | None = None
    labels: Labels | None = None
    strategy: Strategy = "spread"
    workload_resource_request: Raw | None = None
    workload_ids: list[WorkloadId] | None = None
    request_id: RequestId = ""
    dry_run: bool = False


class AllocateWire(Allocate):
    nodenames: msgspec.Raw = NULL


class Allocation(Struct):
    workload_id: str
    nodename: str
    workload_resource: Raw
    engine_params: Raw


class AllocateReply(Struct):
    allocations: list[Allocation]


class ReleaseWorkloads(Request):
    workload_ids: Annotated[list[WorkloadId], Meta(min_length=1, max_length=10_000)]
    request_id: RequestId = ""


class ReleaseReply(Struct):
    released: list[str]


class Realloc(Request):
    workload_id: WorkloadId
    workload_resource_request: Raw | None = None
    request_id: RequestId = ""


class ReallocReply(Struct):
    workload_id: str
    nodename: str
    engine_params: Raw
    workload_resource: Raw
    delta_resource: Raw


class GetAllocations(Request):
    nodename: NodeName


class WorkloadAllocation(Struct):
    workload_id: str
    workload_resource: Raw


class AllocationsReply(Struct):
    allocations: list[WorkloadAllocation]


class ListNodes(Request):
    nodenames: list[NodeName] | None = None
    labels: Labels = {}
    offset: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


class AgentReport(Struct, frozen=True):
    """What a node's agent says of itself in its heartbeats (shown by list-nodes)."""

    address: str = ""
    instances: Annotated[int, Meta(ge=0)] = 0
    running: Annotated[int, Meta(ge=0)] = 0
    pinning: str = ""
    started_at: float = 0.0


class NodeHeartbeat(Request):
    """An agent renews its node's lease for `ttl_seconds`; past it, without another heartbeat,
    the node is down. `draining` takes it out of new placements while it stays alive."""

    nodename: NodeName
    ttl_seconds: Annotated[float, Meta(ge=0.1, le=3600)]
    draining: bool = False
    agent: AgentReport = AgentReport()


class HeartbeatReply(Struct):
    """The node's status now and before this heartbeat (`was: "down"`: the agent had been away),
    and when its lease ends (unix seconds, by the Redis server's clock)."""

    nodename: str
    status: str
    was: str
    lease_expires: float


class NodeLease(Struct):
    """A node's lease as its agent's last heartbeat left it (unix seconds, Redis server's clock)."""

    expires: float
    last_heartbeat: float
    ttl_seconds: float
    agent: AgentReport


class NodeSummary(Struct):
    """`status`: `up`, `draining` or `down` (only `up` nodes take new workloads); `lease`: for a
    node an agent keeps alive, its lease (None for a node added by hand)."""

    nodename: str
    labels: dict[str, str]
    capacity: Raw
    usage: Raw
    status: str = "up"
    lease: NodeLease | None = None


class ListNodesReply(Struct):
    """One page. It holds fewer than `limit` nodes when more would not fit in one NATS message:
    `next_offset` says where the next page starts (None after the last)."""

    nodes: list[NodeSummary]
    total: int
    next_offset: int | None = None


class SetNodeLabels(Request):
    nodename: NodeName
    labels: Labels
    request_id: RequestId = ""


class PluginsReply(Struct):
    plugins: list[str]


# -- events ---------------------------------------------------------------------------------


class NodeEvent(Event, kw_only=True, omit_defaults=True):
    """`berth.events.resource.<node>.<added|removed|capacity|usage|allocated|released|labels|down|up|draining>`.

    A status change (`down`, `up`, `draining`) has `before` and `after` of the form {status}."""

    type: str = ""
    nodename: str
    version: int = 0  # the node's version after the change: a consumer can skip what it has seen
    plugin: str | None = None
    before: Raw | None = None
    after: Raw | None = None
    workload_ids: list[str] | None = None


def node_event(node: str, kind: str, **fields: Any) -> tuple[str, NodeEvent]:
    """An event of a node's change and the subject it goes on (under `<prefix>.events.`); its version
    is set when the change is committed."""
    return f"resource.{node}.{kind}", NodeEvent(nodename=node, **fields)


# Below `resource.`, the events of one owner's workloads: `resource.workload.<owner>.<node>.<kind>`
# (five tokens, so no node's `resource.<node>.<kind>` matches them, nor they `resource.*.*`).
WORKLOAD_EVENTS = "workload"


def workload_events(
    node: str, kind: str, workload_ids: list[str], owners: dict[str, str], **fields: Any
) -> list[tuple[str, NodeEvent]]:
    """The node's event of a change to `workload_ids` (`allocated`, `released`, `usage`), and for each
    owner named in `owners` (workload id -> the identity that placed it) the same event on its own
    subject with its own ids only: a tenant, who may not see the node's event (it names everyone's
    workloads), follows its own there."""
    events = [node_event(node, kind, workload_ids=workload_ids, **fields)]
    by_owner: dict[str, list[str]] = {}
    for wid in workload_ids:
        if owner := owners.get(wid):
            by_owner.setdefault(owner, []).append(wid)
    for owner, ids in by_owner.items():
        events.append((f"resource.{WORKLOAD_EVENTS}.{owner}.{node}.{kind}",
                       NodeEvent(nodename=node, workload_ids=ids, **fields)))
    return events
