"""The cpumem resource plugin: CPU binding with NUMA, and memory (eru reference §2; DESIGN.md §3, §8).

Every method is pure: it decodes the wire maps it is given into typed Structs, calculates, and
returns wire maps. The service layer loads and commits the records.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bus.errors import BerthError, InvalidArgument
from services.allocation.plugin import DeployCapacity, EngineInfo, Raw
from services.allocation.quantity import MAX_INT, saturating_add

from .plans import PlanRequest, count_cpu_plans, cpu_plans
from .requests import MAX_CORES, parse_node_request, parse_workload_request, validate_workload_request
from .resources import (
    availability,
    check_not_negative,
    combine,
    complete_usage,
    divide,
    placement,
    remove_empty_cores,
    share_pool,
    split_memory,
    total_of,
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
    encode,
    numeric_key,
)

# Share of the engine-reported memory a node offers when the operator gives none (eru: 80%).
ENGINE_MEMORY_PERCENT = 80
# Weight of one plugin's rate and usage in the manager's mean: binding dominates (eru: 100 vs 1).
BOUND_WEIGHT = 100.0
UNBOUND_WEIGHT = 1.0

_METRICS_DESCRIPTION = [
    {
        "name": "cpu_map",
        "help": "node available cpu.",
        "type": "gauge",
        "labels": ["podname", "nodename", "cpuid"],
    },
    {"name": "cpu_used", "help": "node used cpu.", "type": "gauge", "labels": ["podname", "nodename"]},
    {
        "name": "memory_capacity",
        "help": "node available memory.",
        "type": "gauge",
        "labels": ["podname", "nodename"],
    },
    {"name": "memory_used", "help": "node used memory.", "type": "gauge", "labels": ["podname", "nodename"]},
]


class CpuMemPlugin:
    name = "cpumem"
    priority = 100

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
        request = parse_node_request(resource, self.share_base, delta=False, field="resource")
        capacity = request.to_resource()
        if info is not None:
            capacity = self._fill_from_engine(capacity, request.numa, request.numa_memory, _engine_info(info))
        if capacity.numa and not capacity.numa_memory:
            capacity.numa_memory = split_memory(capacity.memory, capacity.numa)
        usage = complete_usage(capacity, NodeResource())
        try:
            validate_record(capacity, usage)
        except BerthError as error:
            raise _as_request_error(error) from None
        return encode(capacity), encode(usage)

    def validate_record(self, capacity: Raw, usage: Raw) -> None:
        validate_record(*self._record(capacity, usage))

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
            _check_unbound(node_capacity, node_usage, want, count)
            return (
                [encode(_engine_params(want, {}, "")) for _ in range(count)],
                [encode(_workload(want, {}, "", {})) for _ in range(count)],
            )
        plans = cpu_plans(availability(node_capacity, node_usage), self._plan_request(want), limit=count)
        if len(plans) < count:
            raise _insufficient("insufficient_capacity", "cpu", requested=count, available=len(plans))
        engines_params, workloads = [], []
        for plan in plans[:count]:
            cpu_map, numa_node, numa_memory = placement(plan, want.memory_request)
            engines_params.append(encode(_engine_params(want, cpu_map, numa_node)))
            workloads.append(encode(_workload(want, cpu_map, numa_node, numa_memory)))
        return engines_params, workloads

    def calculate_realloc(
        self, capacity: Raw, usage: Raw, workload_resource: Raw, request: Raw | None
    ) -> tuple[Raw, Raw, Raw]:
        """Re-place a workload after adding the request's deltas to what it holds (eru §2.10)."""
        delta = parse_workload_request(request, delta=True)
        current = decode_workload_resource(workload_resource, "workload_resource")
        # keep-cpu-bind follows the current binding; without it the request decides (so {} unbinds).
        bind = bool(current.cpu_map) if delta.keep_cpu_bind else delta.cpu_bind
        want = validate_workload_request(_add_delta(current, delta, bind))
        node_capacity, node_usage = self._record(capacity, usage)
        node_usage = combine(node_usage, current.as_usage(), -1)  # as if the workload were gone
        if bind:
            origin = {int(core): pieces for core, pieces in current.cpu_map.items()}
            plans = cpu_plans(
                availability(node_capacity, node_usage), self._plan_request(want), origin, limit=1
            )
            if not plans:
                raise _insufficient("insufficient_resource", "cpu", requested=1, available=0)
            cpu_map, numa_node, numa_memory = placement(plans[0], want.memory_request)
        else:
            _check_unbound(node_capacity, node_usage, want, 1)
            cpu_map, numa_node, numa_memory = {}, "", {}
        new = _workload(want, cpu_map, numa_node, numa_memory)
        return (
            encode(_engine_params(want, cpu_map, numa_node)),
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

    # -- record updates ----------------------------------------------------------------------

    def set_capacity(
        self, capacity: Raw, usage: Raw, resource: Raw | None, request: Raw | None, delta: bool, incr: bool
    ) -> tuple[Raw, Raw]:
        """New (capacity, usage) after a capacity change (eru §2.12).

        An absolute request keeps the keys it leaves out. New cores get zero usage; cores left with
        neither capacity nor usage disappear. Passing the old capacity back as an absolute
        `resource` (or request) restores both maps exactly.
        """
        _check_flags(delta, incr)
        node_capacity, node_usage = self._record(capacity, usage)
        origin = None if delta else node_capacity  # eru's LoadFromOrigin
        sources = self._sources(resource, request, None, delta, origin)
        new_capacity = _apply(node_capacity, sources, delta, incr)
        new_capacity = remove_empty_cores(new_capacity, node_usage)
        new_usage = complete_usage(new_capacity, node_usage)
        validate_record(new_capacity, new_usage)
        return encode(new_capacity), encode(new_usage)

    def set_usage(
        self,
        capacity: Raw,
        usage: Raw,
        resource: Raw | None,
        request: Raw | None,
        workloads: list[Raw],
        delta: bool,
        incr: bool,
    ) -> Raw:
        """New usage after a usage change (eru §2.12); the result must fit the capacity."""
        _check_flags(delta, incr)
        node_capacity, node_usage = self._record(capacity, usage)
        sources = self._sources(resource, request, workloads, delta, None)
        new_usage = complete_usage(node_capacity, _apply(node_usage, sources, delta, incr))
        validate_record(node_capacity, new_usage)
        return encode(new_usage)

    def apply_workloads(self, usage: Raw, workloads: list[Raw], incr: bool) -> Raw:
        """Usage plus (incr) or minus the workloads; it may not go below zero."""
        _check_bool("incr", incr)
        total = total_of(_workloads(workloads))
        new_usage = combine(decode_node_resource(usage, "usage"), total, 1 if incr else -1)
        check_not_negative(new_usage)
        return encode(new_usage)

    def usage_from_workloads(self, capacity: Raw, workloads: list[Raw]) -> Raw:
        node_capacity = decode_node_resource(capacity, "capacity")
        return encode(complete_usage(node_capacity, total_of(_workloads(workloads))))

    # -- reports -----------------------------------------------------------------------------

    def diffs(self, capacity: Raw, usage: Raw, workloads: list[Raw]) -> list[str]:
        """eru's diff lines, in its group order: cpu, cores ascending, NUMA nodes ascending, memory."""
        node_capacity, node_usage = self._record(capacity, usage)
        total = total_of(_workloads(workloads))
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
        return [dict(entry, labels=list(entry["labels"])) for entry in _METRICS_DESCRIPTION]

    def metrics(self, podname: str, nodename: str, capacity: Raw, usage: Raw) -> list[Raw]:
        """eru's gauges; `cpu_map` reports the *used* pieces of each core, despite its help text."""
        node_capacity, node_usage = self._record(capacity, usage)
        prefix = f"core.node.{nodename.replace('.', '_')}"
        labels = [podname, nodename]
        metrics = [
            _metric("memory_capacity", labels, f"{prefix}.memory", node_capacity.memory),
            _metric("memory_used", labels, f"{prefix}.memory.used", node_usage.memory),
            _metric("cpu_used", labels, f"{prefix}.cpu.used", node_usage.cpu),
        ]
        for core, used in sorted(node_usage.cpu_map.items(), key=numeric_key):
            metrics.append(_metric("cpu_map", [*labels, core], f"{prefix}.cpu.{core}", used))
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
        """The one input a set-* call uses, by priority: request, else resource, else workloads."""
        if request is not None:
            return [parse_node_request(request, self.share_base, delta=delta).to_resource(origin)]
        if resource is not None:
            return [decode_node_resource(resource, "resource")]
        return [workload.as_usage() for workload in _workloads(workloads or [])]

    def _fill_from_engine(
        self,
        capacity: NodeResource,
        requested_numa: dict[str, str] | None,
        requested_numa_memory: dict[str, int] | None,
        info: EngineInfo,
    ) -> NodeResource:
        """Cores and memory the operator left out, from what the engine reports.

        The engine's own cpumem resource, when present, overrides ncpu and memory_total. A requested
        topology (`numa-cpu`, `numa-memory`) wins over the engine's.
        """
        engine = decode_node_resource(info.resources.get("cpumem"), "info.resources.cpumem")
        ncpu = int(engine.cpu) if engine.cpu > 0 else info.ncpu
        memory_total = engine.memory if engine.memory > 0 else info.memory_total
        if not 0 <= ncpu <= MAX_CORES or memory_total < 0:
            raise InvalidArgument("info", f"ncpu must be in [0, {MAX_CORES}] and memory_total not negative")
        if not capacity.cpu_map:
            capacity.cpu_map = {str(core): self.share_base for core in range(ncpu)}
            capacity.cpu = float(ncpu)
            capacity.numa = dict(engine.numa if requested_numa is None else requested_numa)
        if capacity.memory == 0:
            capacity.memory = memory_total * ENGINE_MEMORY_PERCENT // 100
            if requested_numa_memory is None:
                capacity.numa_memory = {
                    node: memory * ENGINE_MEMORY_PERCENT // 100 for node, memory in engine.numa_memory.items()
                }
        return capacity


def _engine_info(info: EngineInfo | Raw) -> EngineInfo:
    if isinstance(info, EngineInfo):
        return info
    try:
        return msgspec.convert(info, EngineInfo, strict=True)
    except msgspec.ValidationError as error:
        raise InvalidArgument("info", str(error)) from None


def _workloads(workloads: list[Raw]) -> list[WorkloadResource]:
    if not isinstance(workloads, list):
        raise InvalidArgument("workloads_resource", f"must be a list, got {type(workloads).__name__}")
    return [
        decode_workload_resource(raw, f"workloads_resource[{index}]") for index, raw in enumerate(workloads)
    ]


def _apply(origin: NodeResource, sources: list[NodeResource], delta: bool, incr: bool) -> NodeResource:
    """eru's delta/incr matrix: a delta changes `origin`; an absolute write starts from empty and always adds.

    (An absolute write that subtracted would store negated values.) Without sources a delta keeps origin.
    """
    result = origin if delta else NodeResource()
    sign = 1 if incr or not delta else -1
    for source in sources:
        result = combine(result, source, sign)
    return result


def _add_delta(current: WorkloadResource, delta: WorkloadRequest, bind: bool) -> WorkloadRequest:
    return WorkloadRequest(
        cpu_bind=bind,
        cpu_request=round(current.cpu_request + delta.cpu_request, CPU_DIGITS),
        cpu_limit=round(current.cpu_limit + delta.cpu_limit, CPU_DIGITS),
        memory_request=saturating_add(current.memory_request, delta.memory_request),
        memory_limit=saturating_add(current.memory_limit, delta.memory_limit),
    )


def _check_unbound(capacity: NodeResource, usage: NodeResource, want: WorkloadRequest, count: int) -> None:
    """Unbound CPU is never capacity-checked, but one instance may not ask for more than the node's cores."""
    if want.cpu_request > len(capacity.cpu_map):
        raise _insufficient(
            "insufficient_capacity", "cpu", requested=want.cpu_request, available=len(capacity.cpu_map)
        )
    if want.memory_request > 0:
        fits = max((capacity.memory - usage.memory) // want.memory_request, 0)
        if fits < count:
            raise _insufficient("insufficient_capacity", "memory", requested=count, available=fits)


def _check_flags(delta: Any, incr: Any) -> None:
    _check_bool("delta", delta)
    _check_bool("incr", incr)


# The node-request key each capacity key comes from (add-node builds the record from the request).
_REQUEST_KEYS = {"cpu": "cpu", "cpu_map": "cpu", "memory": "memory", "numa": "numa-cpu", "numa_memory": "numa-memory"}


def _as_request_error(error: BerthError) -> BerthError:
    """A record validation error of add-node, naming the request key the operator sent instead."""
    field = error.field or ""
    key = field.split(".")[1] if field.startswith("capacity.") else None
    if key not in _REQUEST_KEYS:
        return error
    reason = error.message.split(": ", 1)[-1]
    return BerthError(f"resource.{_REQUEST_KEYS[key]}: {reason}", code=error.code, field=f"resource.{_REQUEST_KEYS[key]}")


def _check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(field, f"must be a boolean, got {type(value).__name__}")


def _engine_params(want: WorkloadRequest, cpu_map: dict[str, int], numa_node: str) -> EngineParams:
    return EngineParams(cpu=want.cpu_limit, cpu_map=cpu_map, numa_node=numa_node, memory=want.memory_limit)


def _workload(
    want: WorkloadRequest, cpu_map: dict[str, int], numa_node: str, numa_memory: dict[str, int]
) -> WorkloadResource:
    return WorkloadResource(
        cpu_request=want.cpu_request,
        cpu_limit=want.cpu_limit,
        memory_request=want.memory_request,
        memory_limit=want.memory_limit,
        cpu_map=cpu_map,
        numa_memory=numa_memory,
        numa_node=numa_node,
    )


def _insufficient(code: str, resource: str, **details: Any) -> BerthError:
    reason = "not enough nodes capacity" if code == "insufficient_capacity" else "not enough resource"
    return BerthError(
        f"{resource}: cannot alloc a plan, {reason}",
        code=code,
        details={"plugin": "cpumem", "resource": resource, **details},
    )


def _metric(name: str, labels: list[str], key: str, value: float) -> Raw:
    return {"name": name, "labels": labels, "key": key, "value": value}
