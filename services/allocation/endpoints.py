"""The allocation service's transport: which command answers on which subject, and how.

Plugin level: `resource.<plugin>.<command>` takes and returns that plugin's maps.
Manager level: `resource.<command>` takes and returns maps keyed by plugin name, and adds the
committed-allocation commands. One `AllocationEndpoints` class serves both: it only translates
between the wire shape and the manager's per-plugin values (it splits keyed maps and picks or keys
the answers), and the manager does the work.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import msgspec

from bus.callers import current_caller
from bus.codec import decode_stored, encode
from bus.idempotency import current_claim
from bus.service import REPLY_HEADROOM
from schemas.allocation import (
    NULL,
    AddNode,
    AgentReport,
    AllocateReply,
    AllocateWire,
    AllocationsReply,
    BeforeAfter,
    CalculateDeploy,
    CalculateDeployReply,
    CalculateRealloc,
    CalculateReallocReply,
    CalculateRemap,
    CalculateRemapReply,
    CapacityUsage,
    GetAllocations,
    GetMetrics,
    GetMostIdleNode,
    GetNodeResourceInfo,
    GetNodesDeployCapacityReply,
    GetNodesDeployCapacityWire,
    HeartbeatReply,
    ListNodes,
    ListNodesReply,
    MetricsDescriptionReply,
    MetricsReply,
    MostIdleNode,
    NodeDeployCapacityMsg,
    NodeHeartbeat,
    NodeLease,
    NodeRequest,
    NodeResourceInfo,
    NodeSummary,
    PluginsReply,
    Realloc,
    ReallocReply,
    ReleaseReply,
    ReleaseWorkloads,
    SetNodeLabels,
    SetNodeResourceCapacity,
    SetNodeResourceInfo,
    SetNodeResourceUsage,
    WorkloadAllocation,
)
from schemas.common import Empty
from schemas.errors import BerthError, InvalidArgument
from services.allocation.commands import PLUGIN_NAMES
from services.allocation.committer import workload_ids
from services.allocation.errors import reply_too_large
from services.allocation.manager import AllocationManager
from services.allocation.placement import total_capacity
from services.allocation.plugins.interface import EngineInfo, keyed_field
from services.allocation.plugins.plugin_set import Keyed, PluginSet, States, capacities, usages
from services.allocation.records import Lease
from services.allocation.selection import NodeSet, Selection

Raw = dict[str, Any]


def node_lease(lease: Lease) -> NodeLease:
    """A lease as list-nodes shows it (seconds, where the store keeps ms)."""
    agent = decode_stored(lease.agent, AgentReport) if lease.agent else AgentReport()
    return NodeLease(lease.ends / 1000, lease.beat / 1000, lease.ttl / 1000, agent)


def selection(nodenames: msgspec.Raw, labels: dict[str, str] | None) -> Selection:
    """The nodes a request selects: a list kept raw (absent or null: none), labels, or every node."""
    listed = NodeSet(nodenames) if bytes(nodenames) != bytes(NULL) else None
    if listed is not None and len(listed) == 0:
        raise InvalidArgument("nodenames", "must name at least one node")
    return Selection(listed, labels)


def keyed(value: Raw | None, names: list[str], field: str, plugins: PluginSet) -> Keyed:
    """Split a manager-level map keyed by plugin into one value per selected plugin."""
    value = value or {}
    for key, sub in value.items():
        if key not in plugins:
            # `plugin_not_found` (not invalid_argument): the contract pins this code for a plugin key.
            raise BerthError(
                f"{field}.{key}: unknown plugin {key!r}; accepted: {', '.join(plugins)}",
                code="plugin_not_found", field=f"{field}.{key}", details={"accepted": list(plugins)},
            )
        if sub is not None and not isinstance(sub, dict):
            raise BerthError(f"{field}.{key}: must be a map", code="invalid_argument", field=f"{field}.{key}")
    return {name: value.get(name) for name in names}


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
class AllocationEndpoints:
    """Handlers for one plugin (`plugin` set) or for the manager (all plugins, keyed maps)."""

    def __init__(
        self, manager: AllocationManager, plugin: str | None = None, *, max_payload: int = 1 << 20,
        max_deploy_count: int = 10000,
    ) -> None:
        self.manager = manager
        self.plugin = plugin
        self.names = [plugin] if plugin else list(manager.plugins)
        self.reply_bytes = max_payload - REPLY_HEADROOM  # what a listing's entries may take
        self.max_deploy_count = max_deploy_count

    def _deploy_count(self, count: int) -> int:
        """A bound checked before any work: the plugins' calculations grow with the count."""
        if count > self.max_deploy_count:
            raise InvalidArgument(
                "deploy_count", f"at most {self.max_deploy_count} (--max-deploy-count), got {count}"
            )
        return count

    def _in(self, value: Raw | None, field: str) -> Keyed:
        """Per-plugin values from the wire: the plugin's own map, or a map keyed by plugin."""
        if self.plugin:
            return {self.plugin: value}
        return keyed(value, self.names, field, self.manager.plugins)

    def _workloads_in(self, value: Raw | None, field: str) -> Keyed:
        """A workload resource a client sends (not one read from a ledger): `_in`, with each plugin
        refusing keys it does not read."""
        per_plugin = self._in(value, field)
        for name, workload in per_plugin.items():
            self.manager.plugins[name].check_workload_keys(workload, field)
        return per_plugin

    def _out(self, per_plugin: Raw) -> Any:
        """A per-plugin value for the wire: the plugin's own, or the map keyed by plugin."""
        return per_plugin.get(self.plugin) if self.plugin else per_plugin

    def _capacity_usage(self, states: States) -> tuple[Any, Any]:
        return self._out(capacities(states)), self._out(usages(states))

    # -- eru plugin commands ----------------------------------------------------------------

    async def calculate_deploy(self, req: CalculateDeploy) -> CalculateDeployReply:
        count = self._deploy_count(req.deploy_count)
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        deployment = await self.manager.calculate_deploy(self.names, req.nodename, count, requests)
        reply = CalculateDeployReply(
            [self._out(e) for e in deployment.engines_params], [self._out(w) for w in deployment.workloads_resource]
        )
        size = len(encode(reply))
        if size > self.reply_bytes:  # nothing was committed: refuse rather than send what NATS would drop
            raise reply_too_large("deploy_count", size, self.reply_bytes, "calculate fewer instances at once")
        return reply

    async def calculate_realloc(self, req: CalculateRealloc) -> CalculateReallocReply:
        current = self._workloads_in(req.workload_resource, "workload_resource")
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        result = await self.manager.calculate_realloc(self.names, req.nodename, current, requests)
        return CalculateReallocReply(
            self._out(result.engine_params), self._out(result.delta_resource), self._out(result.workload_resource)
        )

    async def calculate_remap(self, req: CalculateRemap) -> CalculateRemapReply:
        workloads = {
            wid: self._workloads_in(w, f"workloads_resource.{wid}")
            for wid, w in req.workloads_resource.items()
        }
        remapped = await self.manager.calculate_remap(self.names, req.nodename, workloads)
        return CalculateRemapReply({wid: self._out(params) for wid, params in remapped.items()})

    async def add_node(self, req: AddNode) -> CapacityUsage:
        if self.plugin is None and req.resource is None and req.info is None:
            raise InvalidArgument(
                "resource", "a node needs `resource` (a map keyed by plugin) or `info` (what its engine "
                "reports); without either it would have no capacity at all",
            )
        if req.info is not None:
            self._check_info_plugins(req.info.resources)
        info = EngineInfo(req.info.ncpu, req.info.memory_total, req.info.storage_total, req.info.resources) if req.info else None
        created = await self.manager.add_node(
            self.names, req.nodename, self._in(req.resource, "resource"), info, req.labels
        )
        return CapacityUsage(*self._capacity_usage(created))

    def _check_info_plugins(self, resources: dict[str, Raw]) -> None:
        """Engine `info.resources` is keyed by plugin at both levels: a name no plugin has is a typo."""
        known = set(PLUGIN_NAMES) | set(self.manager.plugins)
        for name in resources:
            if name not in known:
                raise InvalidArgument(
                    f"info.resources.{name}",
                    f"unknown plugin {name!r}; accepted: {', '.join(sorted(known))}",
                    accepted=sorted(known),
                )

    async def remove_node(self, req: NodeRequest) -> Empty:
        await self.manager.remove_node(self.names, req.nodename)
        return Empty()

    async def get_nodes_deploy_capacity(self, req: GetNodesDeployCapacityWire) -> GetNodesDeployCapacityReply:
        requests = self._in(req.workload_resource_request, "workload_resource_request")
        nodes = selection(req.nodenames, req.labels)
        capacities = await self.manager.deploy_capacity(self.names, nodes, requests)
        reply = GetNodesDeployCapacityReply(
            {node: NodeDeployCapacityMsg(c.capacity, c.usage, c.rate, c.weight) for node, c in capacities.items()},
            total_capacity(capacities),
        )
        size = len(encode(reply))
        if size > self.reply_bytes:
            field = "nodenames" if nodes.names is not None else "labels"
            raise reply_too_large(field, size, self.reply_bytes, f"{len(capacities)} nodes answered; select fewer at once")
        return reply

    async def set_node_resource_capacity(self, req: SetNodeResourceCapacity) -> BeforeAfter:
        changed = await self.manager.set_capacity(
            self.names, req.nodename, self._in(req.resource, "resource"),
            self._in(req.resource_request, "resource_request"), req.delta, req.incr,
        )
        return BeforeAfter(self._out(capacities(changed.before)) or {}, self._out(capacities(changed.after)) or {})

    async def get_node_resource_info(self, req: GetNodeResourceInfo) -> NodeResourceInfo:
        info = await self.manager.node_info(self.names, req.nodename, self._workloads(req))
        return NodeResourceInfo(*self._capacity_usage(info.states), info.diffs)

    async def fix_node_resource(self, req: GetNodeResourceInfo) -> NodeResourceInfo:
        info = await self.manager.fix(self.names, req.nodename, self._workloads(req))
        return NodeResourceInfo(*self._capacity_usage(info.states), info.diffs)

    def _workloads(self, req) -> list[Raw] | None:
        """Workloads as manager-level maps; None means "the node's ledger"."""
        if req.workloads_resource is None:
            return None
        return [
            self._workloads_in(w, f"workloads_resource[{i}]") for i, w in enumerate(req.workloads_resource)
        ]

    async def set_node_resource_info(self, req: SetNodeResourceInfo) -> Empty:
        await self.manager.set_info(
            self.names, req.nodename, self._in(req.capacity, "capacity"), self._in(req.usage, "usage")
        )
        return Empty()

    async def set_node_resource_usage(self, req: SetNodeResourceUsage) -> BeforeAfter:
        changed = await self.manager.set_usage(
            self.names, req.nodename, self._in(req.resource, "resource"),
            self._in(req.resource_request, "resource_request"), self._workloads(req) or [], req.delta, req.incr,
        )
        return BeforeAfter(self._out(usages(changed.before)), self._out(usages(changed.after)))

    async def get_most_idle_node(self, req: GetMostIdleNode) -> MostIdleNode:
        listed = NodeSet.of(req.nodenames) if req.nodenames is not None else None
        node, priority = await self.manager.most_idle(self.names, Selection(listed, req.labels))
        return MostIdleNode(node, priority)

    async def get_metrics_description(self, req: Empty) -> MetricsDescriptionReply:
        return MetricsDescriptionReply(self.manager.metrics_description(self.names))

    async def get_metrics(self, req: GetMetrics) -> MetricsReply:
        return MetricsReply(await self.manager.metrics(self.names, req.podname, req.nodename))

    # -- manager-only commands ----------------------------------------------------------------

    async def allocate(self, req: AllocateWire) -> AllocateReply:
        self._deploy_count(req.deploy_count)
        if req.nodename is not None:
            if bytes(req.nodenames) != bytes(NULL) or req.labels is not None:
                raise InvalidArgument("nodename", "give one nodename, or nodenames and/or labels, not both")
            nodes = Selection(NodeSet.of([req.nodename]))
        else:
            nodes = selection(req.nodenames, req.labels)
        placed = await self.manager.allocate(
            nodes, req.strategy, req.deploy_count, self._in(req.workload_resource_request, "workload_resource_request"),
            req.workload_ids, req.request_id, dry_run=req.dry_run, reply_bytes=self.reply_bytes,
        )
        return AllocateReply(placed)

    @staticmethod
    def kept_allocate(req: AllocateWire, reply: AllocateReply) -> bytes:
        """The ledger holds what an allocate placed, under the ids it was given or derived from its
        request id and run: keep the run and how many, not the placements (a few bytes, not ~500
        per instance)."""
        claim = current_claim.get()
        return encode([claim.attempt if claim is not None else 0, len(reply.allocations)])

    async def recall_allocate(self, req: AllocateWire, kept: bytes) -> AllocateReply:
        """A retry's answer: the placements as the ledger holds them now (a realloc since shows its
        new resources; an instance released since is left out)."""
        run, count = decode_stored(kept, tuple[int, int])
        ids = req.workload_ids if req.workload_ids is not None else workload_ids(count, None, req.request_id, run)
        return AllocateReply(await self.manager.placements(ids))

    @staticmethod
    def kept_release(req: ReleaseWorkloads, reply: ReleaseReply) -> bytes:
        """What a release removed is some of the ids it names: keep which (nothing: all of them)."""
        if reply.released == sorted(set(req.workload_ids)):
            return b""
        released = set(reply.released)
        return encode(sorted({i for i, wid in enumerate(req.workload_ids) if wid in released}))

    async def recall_release(self, req: ReleaseWorkloads, kept: bytes) -> ReleaseReply:
        if not kept:
            return ReleaseReply(sorted(set(req.workload_ids)))
        return ReleaseReply(sorted({req.workload_ids[i] for i in decode_stored(kept, list[int])}))

    async def undo_allocate(self, req: AllocateWire, answer: bytes) -> None:
        """Give back what this run placed when its answer could not be kept (see Command.undo).
        Only this run's own ids: an answer found placed by another run of the request (a run
        stalled before it looked, and resumed after the run that took it over had placed) is that
        run's, and may be the one its caller was answered."""
        placed = [a.workload_id for a in decode_stored(answer, AllocateReply).allocations]
        if req.workload_ids is None:
            claim = current_claim.get()
            mine = set(workload_ids(len(placed), None, req.request_id, claim.attempt if claim is not None else 0))
            placed = [wid for wid in placed if wid in mine]
        await self.manager.give_back(placed, current_caller.get().name)

    async def release(self, req: ReleaseWorkloads) -> ReleaseReply:
        return ReleaseReply(await self.manager.release(req.workload_ids))

    async def realloc(self, req: Realloc) -> ReallocReply:
        node, result = await self.manager.realloc(
            req.workload_id, self._in(req.workload_resource_request, "workload_resource_request")
        )
        return ReallocReply(
            req.workload_id, node, result.engine_params, result.workload_resource, result.delta_resource
        )

    async def list_nodes(self, req: ListNodes) -> ListNodesReply:
        records, leases, total = await self.manager.list_nodes(req.nodenames, req.labels, req.offset, req.limit)
        nodes = []
        room = self.reply_bytes
        for record in records:
            states = dict(sorted(record.plugins.items()))
            lease = node_lease(leases[record.name]) if record.name in leases else None
            node = NodeSummary(record.name, record.labels, capacities(states), usages(states), record.status, lease)
            room -= len(encode(node))
            if room < 0 and nodes:  # no reply may exceed the server's max payload: the page ends here
                break
            nodes.append(node)
        end = req.offset + len(nodes)
        return ListNodesReply(nodes, total, end if end < total else None)

    async def get_allocations(self, req: GetAllocations) -> AllocationsReply:
        ledger = await self.manager.allocations(req.nodename)
        return AllocationsReply([WorkloadAllocation(wid, resource) for wid, resource in ledger.items()])

    async def node_heartbeat(self, req: NodeHeartbeat) -> HeartbeatReply:
        report = encode(req.agent)
        beat = await self.manager.heartbeat(req.nodename, req.ttl_seconds, req.draining, report)
        return HeartbeatReply(req.nodename, beat.status, beat.was, beat.lease_ends_ms / 1000)

    async def set_node_labels(self, req: SetNodeLabels) -> Empty:
        await self.manager.set_labels(req.nodename, req.labels)
        return Empty()

    async def list_plugins(self, req: Empty) -> PluginsReply:
        return PluginsReply(list(self.manager.plugins))
