"""The allocation service's transport: which command answers on which subject, and how.

Plugin level: `resource.<plugin>.<command>` takes and returns that plugin's maps.
Manager level: `resource.<command>` takes and returns maps keyed by plugin name, and adds the
committed-allocation commands. One `Endpoints` class serves both: it only translates between the
wire shape and the manager, which does the work.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import msgspec

from bus.errors import BerthError, InvalidArgument
from bus.events import StreamSpec
from bus.service import Command
from schemas.common import Empty
from services.allocation.manager import ResourceManager
from services.allocation.messages import (
    NULL,
    AddNode,
    Allocate,
    AllocateReply,
    AllocateWire,
    Allocation,
    AllocationsReply,
    BeforeAfter,
    CalculateDeploy,
    CalculateDeployReply,
    CalculateRealloc,
    CalculateReallocReply,
    CalculateRemap,
    CalculateRemapReply,
    CapacityUsage,
    Done,
    GetAllocations,
    GetMetrics,
    GetMostIdleNode,
    GetNodeResourceInfo,
    GetNodesDeployCapacity,
    GetNodesDeployCapacityReply,
    GetNodesDeployCapacityWire,
    ListNodes,
    ListNodesReply,
    MetricsDescriptionReply,
    MetricsReply,
    MostIdleNode,
    NodeDeployCapacityMsg,
    NodeRequest,
    NodeResourceInfo,
    NodeSummary,
    PluginsReply,
    Realloc,
    ReallocReply,
    Release,
    ReleaseReply,
    ResourceEvent,
    SetNodeLabels,
    SetNodeResourceCapacity,
    SetNodeResourceInfo,
    SetNodeResourceUsage,
    WorkloadAllocation,
)
from services.allocation.placement import total_capacity
from services.allocation.plugin import EngineInfo, keyed_field
from services.allocation.view import NodeSet, Selection

Raw = dict[str, Any]

PLUGIN_NAMES = ("cpumem", "storage", "gpu")

# The eru plugin commands, served at both levels: (command, request, reply, handler, changes state).
PLUGIN_COMMANDS = [
    ("calculate-deploy", CalculateDeploy, CalculateDeployReply, "calculate_deploy", False),
    ("calculate-realloc", CalculateRealloc, CalculateReallocReply, "calculate_realloc", False),
    ("calculate-remap", CalculateRemap, CalculateRemapReply, "calculate_remap", False),
    ("add-node", AddNode, CapacityUsage, "add_node", True),
    ("remove-node", NodeRequest, Done, "remove_node", True),
    ("get-nodes-deploy-capacity", GetNodesDeployCapacity, GetNodesDeployCapacityReply, "get_nodes_deploy_capacity", False),
    ("set-node-resource-capacity", SetNodeResourceCapacity, BeforeAfter, "set_node_resource_capacity", True),
    ("get-node-resource-info", GetNodeResourceInfo, NodeResourceInfo, "get_node_resource_info", False),
    ("set-node-resource-info", SetNodeResourceInfo, Done, "set_node_resource_info", True),
    ("set-node-resource-usage", SetNodeResourceUsage, BeforeAfter, "set_node_resource_usage", True),
    ("get-most-idle-node", GetMostIdleNode, MostIdleNode, "get_most_idle_node", False),
    ("fix-node-resource", GetNodeResourceInfo, NodeResourceInfo, "fix_node_resource", True),
    ("get-metrics-description", Empty, MetricsDescriptionReply, "get_metrics_description", False),
    ("get-metrics", GetMetrics, MetricsReply, "get_metrics", False),
]

# Requests whose node list the service keeps raw (see messages.py).
WIRE_TYPES = {GetNodesDeployCapacity: GetNodesDeployCapacityWire}

MANAGER_ONLY_COMMANDS = [
    Command("resource.allocate", Allocate, AllocateReply, "allocate", idempotent=True, wire=AllocateWire,
            undo="undo_allocate"),
    Command("resource.release", Release, ReleaseReply, "release", idempotent=True),
    Command("resource.realloc", Realloc, ReallocReply, "realloc", idempotent=True),
    Command("resource.list-nodes", ListNodes, ListNodesReply, "list_nodes"),
    Command("resource.get-allocations", GetAllocations, AllocationsReply, "get_allocations"),
    Command("resource.set-node-labels", SetNodeLabels, Done, "set_node_labels", idempotent=True),
    Command("resource.plugins", Empty, PluginsReply, "list_plugins"),
]


def plugin_commands(plugin: str | None) -> list[Command]:
    """The eru commands on `resource.<plugin>.<command>`, or on `resource.<command>` for the manager."""
    group = f"resource.{plugin}" if plugin else "resource"
    return [
        Command(f"{group}.{name}", request, reply, handler, idempotent=changes, wire=WIRE_TYPES.get(request))
        for name, request, reply, handler, changes in PLUGIN_COMMANDS
    ]


COMMANDS = plugin_commands(None) + MANAGER_ONLY_COMMANDS + [
    command for plugin in PLUGIN_NAMES for command in plugin_commands(plugin)
]
EVENTS = {"resource.<node>.<added|removed|capacity|usage|allocated|released|labels>": ResourceEvent}
# Change events are kept a day for replay, in the stream all services' change events share.
STREAM = StreamSpec("events", ("resource.>",), max_age=24 * 3600, max_bytes=1 << 30)


def selection(nodenames: msgspec.Raw, labels: dict[str, str] | None) -> Selection:
    """The nodes a request selects: a list kept raw (absent or null: none), labels, or every node."""
    listed = NodeSet(nodenames) if bytes(nodenames) != bytes(NULL) else None
    if listed is not None and len(listed) == 0:
        raise InvalidArgument("nodenames", "must name at least one node")
    return Selection(listed, labels)


def naming_keyed_fields(cls: type) -> type:
    """Every handler of a manager-level instance names a plugin's field by its whole path (the
    plugin's key included), as the keyed request spells it."""

    def wrap(handler):
        @functools.wraps(handler)
        async def handle(self, *args):
            try:
                return await handler(self, *args)
            except BerthError as error:
                if self.plugin is None and "plugin" in error.details and error.field:
                    rename_field(error, keyed_field(error.field, error.details["plugin"]))
                raise

        return handle

    for name, member in list(vars(cls).items()):
        if inspect.iscoroutinefunction(member) and not name.startswith("_"):
            setattr(cls, name, wrap(member))
    return cls


def rename_field(error: BerthError, field: str) -> None:
    if error.message.startswith(f"{error.field}:"):
        error.message = field + error.message[len(error.field):]
        error.args = (error.message,)
    error.details["field"] = field


@naming_keyed_fields
class Endpoints:
    """Handlers for one plugin (`plugin` set) or for the manager (all plugins, keyed maps)."""

    def __init__(self, manager: ResourceManager, plugin: str | None = None, *, max_payload: int = 1 << 20) -> None:
        self.m = manager
        self.plugin = plugin
        self.names = [plugin] if plugin else list(manager.plugins)
        self.reply_bytes = max_payload - 4096  # what a listing's entries may take (headers, envelope)

    def _in(self, value: Raw | None, field: str) -> dict[str, Raw | None]:
        """Per-plugin values from the wire: the plugin's own map, or a map keyed by plugin."""
        if self.plugin:
            return {self.plugin: value}
        return self.m.keyed(value, self.names, field)

    def _out(self, keyed: Raw) -> Any:
        return keyed.get(self.plugin) if self.plugin else keyed

    # -- eru plugin commands ----------------------------------------------------------------

    async def calculate_deploy(self, req: CalculateDeploy) -> CalculateDeployReply:
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        engines, workloads = await self.m.calculate_deploy(self.names, req.nodename, req.deploy_count, requests)
        return CalculateDeployReply([self._out(e) for e in engines], [self._out(w) for w in workloads])

    async def calculate_realloc(self, req: CalculateRealloc) -> CalculateReallocReply:
        current = self._in(req.workload_resource, "workload_resource")
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        engine, delta, resource = await self.m.calculate_realloc(self.names, req.nodename, current, requests)
        return CalculateReallocReply(self._out(engine), self._out(delta), self._out(resource))

    async def calculate_remap(self, req: CalculateRemap) -> CalculateRemapReply:
        workloads = {wid: self._in(w, f"workloads_resource.{wid}") for wid, w in req.workloads_resource.items()}
        remapped = await self.m.calculate_remap(self.names, req.nodename, workloads)
        return CalculateRemapReply({wid: self._out(params) for wid, params in remapped.items()})

    async def add_node(self, req: AddNode) -> CapacityUsage:
        info = EngineInfo(req.info.ncpu, req.info.memory_total, req.info.storage_total, req.info.resources) if req.info else None
        capacity, usage = await self.m.add_node(
            self.names, req.nodename, self._in(req.resource, "resource"), info, req.labels
        )
        return CapacityUsage(self._out(capacity), self._out(usage))

    async def remove_node(self, req: NodeRequest) -> Done:
        await self.m.remove_node(self.names, req.nodename)
        return Done()

    async def get_nodes_deploy_capacity(self, req: GetNodesDeployCapacityWire) -> GetNodesDeployCapacityReply:
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        capacities = await self.m.deploy_capacity(self.names, selection(req.nodenames, req.labels), requests)
        return GetNodesDeployCapacityReply(
            {node: NodeDeployCapacityMsg(c.capacity, c.usage, c.rate, c.weight) for node, c in capacities.items()},
            total_capacity(capacities),
        )

    async def set_node_resource_capacity(self, req: SetNodeResourceCapacity) -> BeforeAfter:
        before, after = await self.m.set_capacity(
            self.names, req.nodename, self._in(req.resource, "resource"),
            self._in(req.resource_request, "resource_request"), req.delta, req.incr,
        )
        return BeforeAfter(self._out(before) or {}, self._out(after) or {})

    async def get_node_resource_info(self, req: GetNodeResourceInfo) -> NodeResourceInfo:
        capacity, usage, diffs = await self.m.node_info(self.names, req.nodename, self._workloads(req))
        return NodeResourceInfo(self._out(capacity), self._out(usage), diffs)

    async def fix_node_resource(self, req: GetNodeResourceInfo) -> NodeResourceInfo:
        capacity, usage, diffs = await self.m.fix(self.names, req.nodename, self._workloads(req))
        return NodeResourceInfo(self._out(capacity), self._out(usage), diffs)

    def _workloads(self, req) -> list[Raw] | None:
        """Workloads as manager-level maps; None means "the node's ledger"."""
        if req.workloads_resource is None:
            return None
        return [self._in(w, f"workloads_resource[{i}]") for i, w in enumerate(req.workloads_resource)]

    async def set_node_resource_info(self, req: SetNodeResourceInfo) -> Done:
        await self.m.set_info(
            self.names, req.nodename, self._in(req.capacity, "capacity"), self._in(req.usage, "usage")
        )
        return Done()

    async def set_node_resource_usage(self, req: SetNodeResourceUsage) -> BeforeAfter:
        before, after = await self.m.set_usage(
            self.names, req.nodename, self._in(req.resource, "resource"),
            self._in(req.resource_request, "resource_request"), self._workloads(req) or [], req.delta, req.incr,
        )
        return BeforeAfter(self._out(before), self._out(after))

    async def get_most_idle_node(self, req: GetMostIdleNode) -> MostIdleNode:
        listed = NodeSet.of(req.nodenames) if req.nodenames is not None else None
        node, priority = await self.m.most_idle(self.names, Selection(listed, req.labels))
        return MostIdleNode(node, priority)

    async def get_metrics_description(self, req: Empty) -> MetricsDescriptionReply:
        return MetricsDescriptionReply(self.m.metrics_description(self.names))

    async def get_metrics(self, req: GetMetrics) -> MetricsReply:
        return MetricsReply(await self.m.metrics(self.names, req.podname, req.nodename))

    # -- manager-only commands ----------------------------------------------------------------

    async def allocate(self, req: AllocateWire) -> AllocateReply:
        if req.nodename is not None:
            if bytes(req.nodenames) != bytes(NULL) or req.labels is not None:
                raise InvalidArgument("nodename", "give one nodename, or nodenames and/or labels, not both")
            nodes = Selection(NodeSet.of([req.nodename]))
        else:
            nodes = selection(req.nodenames, req.labels)
        placed = await self.m.allocate(
            nodes, req.strategy, req.deploy_count, self._in(req.workload_resource_request, "workload_resource_request"),
            req.workload_ids, req.request_id,
        )
        return AllocateReply([Allocation(**a) for a in placed])

    async def undo_allocate(self, req: AllocateWire, answer: bytes) -> None:
        """Give back what an allocate placed when its answer could not be kept (see Command.undo)."""
        placed = msgspec.msgpack.decode(answer, type=AllocateReply).allocations
        await self.m.release([a.workload_id for a in placed])

    async def release(self, req: Release) -> ReleaseReply:
        return ReleaseReply(await self.m.release(req.workload_ids))

    async def realloc(self, req: Realloc) -> ReallocReply:
        reply = await self.m.realloc(req.workload_id, self._in(req.workload_resource_request, "workload_resource_request"))
        return ReallocReply(**reply)

    async def list_nodes(self, req: ListNodes) -> ListNodesReply:
        records, total = await self.m.list_nodes(req.nodenames, req.labels, req.offset, req.limit)
        nodes = []
        room = self.reply_bytes
        for r in records:
            node = NodeSummary(
                r.name, r.labels,
                {name: s.capacity for name, s in sorted(r.plugins.items())},
                {name: s.usage for name, s in sorted(r.plugins.items())},
            )
            room -= len(msgspec.msgpack.encode(node))
            if room < 0 and nodes:  # no reply may exceed the server's max payload: the page ends here
                break
            nodes.append(node)
        end = req.offset + len(nodes)
        return ListNodesReply(nodes, total, end if end < total else None)

    async def get_allocations(self, req: GetAllocations) -> AllocationsReply:
        ledger = await self.m.allocations(req.nodename)
        return AllocationsReply([WorkloadAllocation(wid, res) for wid, res in ledger.items()])

    async def set_node_labels(self, req: SetNodeLabels) -> Done:
        await self.m.set_labels(req.nodename, req.labels)
        return Done()

    async def list_plugins(self, req: Empty) -> PluginsReply:
        return PluginsReply(list(self.m.plugins))
