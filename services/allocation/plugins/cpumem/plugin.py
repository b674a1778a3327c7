"""The cpumem resource plugin: CPU binding with NUMA, and memory (eru reference §2; DESIGN.md §3, §8).

Every method is pure: it decodes the wire maps it is given into typed Structs, calculates, and
returns wire maps. The service layer loads and commits the records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, Raw, Shortfall
from services.allocation.plugins.kit import (
    MatrixUpdates,
    chosen_source,
    encode,
    metric,
    metric_description,
    refuse_unknown_fields,
    safe_name,
)

from .instances import add_delta, check_unbound, engine_params, insufficient, workload
from .nodes import new_node
from .plans import PlanRequest, count_cpu_plans, cpu_plans
from .requests import parse_node_request, parse_workload_request, validate_workload_request
from .resources import (
    availability,
    check_not_negative,
    combine,
    complete_usage,
    divide,
    placement,
    remove_empty_cores,
    share_pool,
    validate_record,
    workload_delta,
)
from .types import (
    CPU_DIGITS,
    EngineParams,
    NodeResource,
    WorkloadRequest,
    WorkloadResource,
    decode_node_resource,
    decode_workload_resource,
    numeric_key,
)

# Weight of one plugin's rate and usage in the manager's mean: binding dominates (eru: 100 vs 1).
BOUND_WEIGHT = 100.0
UNBOUND_WEIGHT = 1.0

class CpuMemPlugin(MatrixUpdates[NodeResource]):
    name = "cpumem"
    priority = 100
    _record_shape, _workload_shape = NodeResource, WorkloadResource

    def __init__(self, share_base: int = 100, max_share: int = -1, max_deploy_count: int = 10000) -> None:
        if share_base < 1:
            raise ValueError(f"share_base must be positive, got {share_base}")
        if max_share < -1:
            raise ValueError(f"max_share must be -1 (no limit) or >= 0, got {max_share}")
        if max_deploy_count < 1:
            raise ValueError(f"max_deploy_count must be positive, got {max_deploy_count}")
        self.share_base = share_base
        self.max_share = max_share
        self.max_deploy_count = max_deploy_count

    # -- node records ------------------------------------------------------------------------

    def add_node(self, resource: Raw | None, info: EngineInfo | Raw | None) -> tuple[Raw, Raw]:
        """A new node's record from its node request, completed from engine info (eru §2.6)."""
        capacity, usage = new_node(resource, info, self.share_base)
        return encode(capacity), encode(usage)

    def _validate(self, capacity: NodeResource, usage: NodeResource) -> None:
        validate_record(capacity, usage)  # decoding a cpumem record checks nothing by itself

    # -- calculations ------------------------------------------------------------------------

    def calculate_deploy(
        self, capacity: Raw, usage: Raw, deploy_count: int, request: Raw | None
    ) -> tuple[list[Raw], list[Raw]]:
        count = self._deploy_count(deploy_count)
        want = validate_workload_request(parse_workload_request(request))
        node_capacity, node_usage = self._record(capacity, usage)
        if count == 0:
            return [], []  # zero instances fit anywhere, so a deploy capacity of 0 can be deployed
        if not want.cpu_bind:
            check_unbound(node_capacity, node_usage, want, count)
            return (
                [encode(engine_params(want, {}, "")) for _ in range(count)],
                [encode(workload(want, {}, "", {})) for _ in range(count)],
            )
        plans = cpu_plans(availability(node_capacity, node_usage), self._plan_request(want), limit=count)
        if len(plans) < count:
            raise insufficient("insufficient_capacity", "cpu", requested=count, available=len(plans))
        engines_params, workloads = [], []
        for plan in plans[:count]:
            cpu_map, numa_node, numa_memory = placement(plan, want.memory_request)
            engines_params.append(encode(engine_params(want, cpu_map, numa_node)))
            workloads.append(encode(workload(want, cpu_map, numa_node, numa_memory)))
        return engines_params, workloads

    def engine_params(self, workload_resource: Raw) -> Raw:
        held = decode_workload_resource(workload_resource, "workload_resource")
        want = WorkloadRequest(cpu_limit=held.cpu_limit, memory_limit=held.memory_limit)
        return encode(engine_params(want, held.cpu_map, held.numa_node))

    def calculate_realloc(
        self, capacity: Raw, usage: Raw, workload_resource: Raw, request: Raw | None
    ) -> tuple[Raw, Raw, Raw]:
        """Re-place a workload after adding the request's deltas to what it holds (eru §2.10)."""
        delta = parse_workload_request(request, delta=True)
        current = decode_workload_resource(workload_resource, "workload_resource")
        # keep-cpu-bind follows the current binding; without it the request decides (so {} unbinds).
        bind = bool(current.cpu_map) if delta.keep_cpu_bind else delta.cpu_bind
        want = validate_workload_request(add_delta(current, delta, bind))
        node_capacity, node_usage = self._record(capacity, usage)
        node_usage = combine(node_usage, current.as_usage(), -1)  # as if the workload were gone
        if bind:
            origin = {int(core): pieces for core, pieces in current.cpu_map.items()}
            plans = cpu_plans(
                availability(node_capacity, node_usage), self._plan_request(want), origin, limit=1
            )
            if not plans:
                raise insufficient(
                    "insufficient_resource", "cpu", requested=1, available=0,
                    note=" (no cores free for the new binding)",
                )
            cpu_map, numa_node, numa_memory = placement(plans[0], want.memory_request)
        else:
            check_unbound(node_capacity, node_usage, want, 1)
            cpu_map, numa_node, numa_memory = {}, "", {}
        new = workload(want, cpu_map, numa_node, numa_memory)
        return (
            encode(engine_params(want, cpu_map, numa_node)),
            encode(workload_delta(new, current)),
            encode(new),
        )

    def calculate_remap(self, capacity: Raw, usage: Raw, workloads: dict[str, Raw]) -> dict[str, Raw]:
        """Unbound workloads get the share pool as cpuset (eru §2.11); bound ones are left out."""
        if not workloads:
            return {}
        if not isinstance(workloads, dict) or not all(isinstance(key, str) for key in workloads):
            raise InvalidArgument("workloads_resource", "must be a map from workload id to resource")
        node_capacity, node_usage = self._record(capacity, usage)
        pool = share_pool(node_capacity, node_usage, self.share_base)
        remapped = {}
        for workload_id in sorted(workloads):
            workload = decode_workload_resource(workloads[workload_id], f"workloads_resource.{workload_id}")
            if not workload.cpu_map:
                params = EngineParams(
                    workload.cpu_limit, dict(pool), workload.numa_node, workload.memory_limit, True
                )
                remapped[workload_id] = encode(params)
        return remapped

    def deploy_capacity(self, capacity: Raw, usage: Raw, request: Raw | None) -> DeployCapacity:
        """How many more instances fit (eru §2.9); always what calculate_deploy can place."""
        want = validate_workload_request(parse_workload_request(request))
        node_capacity, node_usage = self._record(capacity, usage)
        if want.cpu_bind:
            count = count_cpu_plans(availability(node_capacity, node_usage), self._plan_request(want))
            usage_ratio = divide(node_usage.cpu, node_capacity.cpu)
            return DeployCapacity(
                count, usage_ratio, divide(want.cpu_request, node_capacity.cpu), BOUND_WEIGHT
            )
        if want.cpu_request > len(node_capacity.cpu_map):
            count = 0
        elif want.memory_request == 0:
            count = MAX_INT
        else:
            count = max((node_capacity.memory - node_usage.memory) // want.memory_request, 0)
        usage_ratio = divide(node_usage.memory, node_capacity.memory)
        return DeployCapacity(
            count, usage_ratio, divide(want.memory_request, node_capacity.memory), UNBOUND_WEIGHT
        )

    def shortfalls(self, capacity: Raw, usage: Raw, request: Raw | None, count: int) -> dict[str, Shortfall]:
        """`cpu` (cores) and `memory` (bytes) that keep `count` instances off the node. Unbound CPU
        is short only when one instance asks for more than the node's cores; bound CPU when the
        cores cannot form `count` bindings (memory aside); memory when `count` instances ask for
        more than is free, or, bound, when the cores would do but the NUMA nodes' memory does not."""
        want = validate_workload_request(parse_workload_request(request))
        node_capacity, node_usage = self._record(capacity, usage)
        memory_free = max(node_capacity.memory - node_usage.memory, 0)
        memory_short = count * want.memory_request - memory_free
        short: dict[str, Shortfall] = {}
        if not want.cpu_bind:
            cores = len(node_capacity.cpu_map)
            if want.cpu_request > cores:
                short["cpu"] = Shortfall(round(want.cpu_request - cores, CPU_DIGITS), "cores")
            if memory_short > 0:
                short["memory"] = Shortfall(min(memory_short, MAX_INT), "bytes")
            return short
        free = availability(node_capacity, node_usage)
        bindings = count_cpu_plans(free, PlanRequest.of(want.cpu_request, 0, self.share_base, self.max_share))
        if bindings < count:
            free_cores = sum(max(pieces, 0) for pieces in free.cores.values()) / self.share_base
            missing = count * want.cpu_request - free_cores
            cores = missing if missing > 0 else (count - bindings) * want.cpu_request
            short["cpu"] = Shortfall(round(cores, CPU_DIGITS), "cores")
        if want.memory_request and (memory_short > 0 or bindings >= count):
            fits = count_cpu_plans(free, self._plan_request(want))
            if memory_short > 0 or fits < count:
                missing = memory_short if memory_short > 0 else (count - fits) * want.memory_request
                short["memory"] = Shortfall(min(missing, MAX_INT), "bytes")
        return short

    # -- record updates ----------------------------------------------------------------------

    # set-node-resource-capacity and -usage (eru §2.12) are MatrixUpdates'; these are their cpumem steps.
    _empty = NodeResource
    _combine = staticmethod(combine)

    def _capacity_sources(
        self, capacity: NodeResource, resource: Raw | None, request: Raw | None, delta: bool
    ) -> tuple[NodeResource, list[NodeResource]]:
        """An absolute request keeps the keys it leaves out (eru's LoadFromOrigin)."""
        return capacity, self._sources(resource, request, None, delta, None if delta else capacity)

    def _settled_capacity(self, capacity: NodeResource, usage: NodeResource, delta: bool) -> tuple[Raw, Raw]:
        """New cores get zero usage; cores left with neither capacity nor usage disappear. Passing the old
        capacity back as an absolute `resource` (or request) restores both maps exactly."""
        new_capacity = remove_empty_cores(capacity, usage)
        new_usage = complete_usage(new_capacity, usage)
        validate_record(new_capacity, new_usage)
        return encode(new_capacity), encode(new_usage)

    def _usage_sources(
        self, resource: Raw | None, request: Raw | None, workloads: list[Raw], delta: bool
    ) -> list[NodeResource]:
        return self._sources(resource, request, workloads, delta, None)

    def _settled_usage(self, capacity: NodeResource, usage: NodeResource) -> Raw:
        """The new usage lists every capacity core and NUMA node, and must fit the capacity."""
        new_usage = complete_usage(capacity, usage)
        validate_record(capacity, new_usage)
        return encode(new_usage)

    # apply_workloads and usage_from_workloads are MatrixUpdates' too; these are their cpumem steps.

    def _holding(self, raw: object, field: str) -> NodeResource:
        return decode_workload_resource(raw, field).as_usage()

    def _usage(self, usage: Raw) -> NodeResource:
        return decode_node_resource(usage, "usage")

    def _charges(self, holdings: list[NodeResource]) -> list[NodeResource]:
        """The workloads' total, combined once: memory saturates and the CPU rounds on the total, and
        even no workloads round and saturate the stored usage."""
        return [self._total(holdings)]

    def _applied_usage(self, usage: NodeResource) -> Raw:
        """Usage never goes below zero; it is not checked against a capacity (none is given)."""
        check_not_negative(usage)
        return encode(usage)

    def _usage_shape(self, capacity: Raw) -> Callable[[NodeResource], Raw]:
        """The usage lists every capacity core and NUMA node."""
        node_capacity = decode_node_resource(capacity, "capacity")
        return lambda usage: encode(complete_usage(node_capacity, usage))

    # -- reports -----------------------------------------------------------------------------

    def diffs(self, capacity: Raw, usage: Raw, workloads: list[Raw]) -> list[str]:
        """eru's diff lines, in its group order: cpu, cores ascending, NUMA nodes ascending, memory."""
        node_capacity, node_usage = self._record(capacity, usage)
        total = self._explained(workloads)
        diffs = []
        if round(node_usage.cpu, CPU_DIGITS) != total.cpu:
            diffs.append(f"node.CPUUsed != sum(workload.CPURequest): {node_usage.cpu:.2f} != {total.cpu:.2f}")
        for core in sorted(node_capacity.cpu_map, key=int):
            used, summed = node_usage.cpu_map.get(core, 0), total.cpu_map.get(core, 0)
            if used != summed:
                diffs.append(f"node.CPUMap[{core}] != sum(workload.CPUMap[{core}]): {used} != {summed}")
        for node in sorted(node_capacity.numa_memory, key=int):
            used, summed = node_usage.numa_memory.get(node, 0), total.numa_memory.get(node, 0)
            if used != summed:
                diffs.append(
                    f"node.NUMAMemory[{node}] != sum(workload.NUMAMemory[{node}]: {used} != {summed})"
                )
        if node_usage.memory != total.memory:
            diffs.append(
                f"node.MemoryUsed != sum(workload.MemoryRequest): {node_usage.memory} != {total.memory}"
            )
        return diffs

    def load(self, capacity: Raw, usage: Raw) -> float:
        """Used share of the pieces plus used share of the memory (eru §2.14); smaller is idler."""
        node_capacity, node_usage = self._record(capacity, usage)
        pieces = divide(sum(node_usage.cpu_map.values()), sum(node_capacity.cpu_map.values()))
        return pieces + divide(node_usage.memory, node_capacity.memory)

    def metrics_description(self) -> list[Raw]:
        node = ["podname", "nodename"]
        return [
            metric_description("cpu_map", "node available cpu.", [*node, "cpuid"]),
            metric_description("cpu_used", "node used cpu.", node),
            metric_description("memory_capacity", "node available memory.", node),
            metric_description("memory_used", "node used memory.", node),
        ]

    def metrics(self, podname: str, nodename: str, capacity: Raw, usage: Raw) -> list[Raw]:
        """eru's gauges; `cpu_map` reports the *used* pieces of each core, despite its help text."""
        node_capacity, node_usage = self._record(capacity, usage)
        prefix = f"core.node.{safe_name(nodename)}"
        labels = [podname, nodename]
        metrics = [
            metric("memory_capacity", labels, f"{prefix}.memory", node_capacity.memory),
            metric("memory_used", labels, f"{prefix}.memory.used", node_usage.memory),
            metric("cpu_used", labels, f"{prefix}.cpu.used", node_usage.cpu),
        ]
        for core, used in sorted(node_usage.cpu_map.items(), key=numeric_key):
            metrics.append(metric("cpu_map", [*labels, core], f"{prefix}.cpu.{core}", used))
        return metrics

    # -- helpers -----------------------------------------------------------------------------

    def _record(self, capacity: Raw, usage: Raw) -> tuple[NodeResource, NodeResource]:
        return decode_node_resource(capacity, "capacity"), decode_node_resource(usage, "usage")

    def _plan_request(self, want: WorkloadRequest) -> PlanRequest:
        return PlanRequest.of(want.cpu_request, want.memory_request, self.share_base, self.max_share)

    def _deploy_count(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument("deploy_count", f"must be an integer, got {type(value).__name__}")
        if not 0 <= value <= self.max_deploy_count:
            raise InvalidArgument(
                "deploy_count", f"must be between 0 and {self.max_deploy_count}, got {value}"
            )
        return value

    def _sources(
        self, resource: Raw | None, request: Raw | None, workloads: list[Raw] | None, delta: bool, origin: Any
    ) -> list[NodeResource]:
        """The one input a set-* call uses, by priority: request, else resource, else workloads (only
        the chosen one is decoded, so an unused input is never an error)."""
        requested = given = None
        if request is not None:
            requested = parse_node_request(request, self.share_base, delta=delta).to_resource(origin)
        elif resource is not None:
            refuse_unknown_fields(resource, NodeResource, "resource")
            given = decode_node_resource(resource, "resource")
        held = self._holdings(workloads or []) if requested is None and given is None else []
        return chosen_source(requested, given, held)
