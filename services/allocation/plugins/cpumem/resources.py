"""Arithmetic on and validation of cpumem node records (eru reference §2.2, §2.5, §2.12).

A node record is a (capacity, usage) pair of NodeResources. berth keeps two invariants on top of
eru's checks: a usage lists every capacity core and NUMA node (zeros included) with a copy of the
capacity's topology, and nothing in a usage is negative.
"""

from __future__ import annotations

from schemas.errors import InvalidArgument
from services.allocation.quantity import saturating_add

from .plans import CpuPlan, NodeAvailability
from .types import CPU_DIGITS, NodeResource, WorkloadResource, numeric_key, sorted_by_id


def combine(base: NodeResource, other: NodeResource, sign: int) -> NodeResource:
    """base + other (sign 1) or base - other (sign -1), element-wise.

    As in eru, adding a resource with a topology replaces the topology; subtracting never touches it.
    """
    return NodeResource(
        cpu=round(base.cpu + sign * other.cpu, CPU_DIGITS),
        cpu_map=combine_maps(base.cpu_map, other.cpu_map, sign),
        memory=saturating_add(base.memory, sign * other.memory),
        numa_memory=combine_maps(base.numa_memory, other.numa_memory, sign),
        numa=dict(other.numa if sign > 0 and other.numa else base.numa),
    )


def combine_maps(base: dict[str, int], other: dict[str, int], sign: int) -> dict[str, int]:
    result = dict(base)
    for key, value in other.items():
        result[key] = saturating_add(result.get(key, 0), sign * value)
    # New keys would land at the end; restore the numeric order.
    return result if len(result) == len(base) else sorted_by_id(result)


def workload_delta(new: WorkloadResource, old: WorkloadResource) -> WorkloadResource:
    """new - old, field by field; maps keep only the entries that changed. `numa_node` is the new one."""
    return WorkloadResource(
        cpu_request=round(new.cpu_request - old.cpu_request, CPU_DIGITS),
        cpu_limit=round(new.cpu_limit - old.cpu_limit, CPU_DIGITS),
        memory_request=new.memory_request - old.memory_request,
        memory_limit=new.memory_limit - old.memory_limit,
        cpu_map=_changes(combine_maps(new.cpu_map, old.cpu_map, -1)),
        numa_memory=_changes(combine_maps(new.numa_memory, old.numa_memory, -1)),
        numa_node=new.numa_node,
    )


def complete_usage(capacity: NodeResource, usage: NodeResource) -> NodeResource:
    """The usage with an entry (0 if unused) for every capacity core and NUMA node, and their topology.

    Zero entries outside the capacity are dropped (a removed core, a rolled-back capacity change);
    non-zero ones are kept so that validation rejects them.
    """
    return NodeResource(
        cpu=usage.cpu,
        cpu_map=_complete(usage.cpu_map, capacity.cpu_map),
        memory=usage.memory,
        numa_memory=_complete(usage.numa_memory, capacity.numa_memory),
        numa=dict(capacity.numa),
    )


def remove_empty_cores(capacity: NodeResource, usage: NodeResource) -> NodeResource:
    """The capacity without cores that have neither capacity nor usage (eru's RemoveEmptyCores).

    capacity.cpu becomes the number of cores left.
    """
    cpu_map = {core: pieces for core, pieces in capacity.cpu_map.items() if pieces or usage.cpu_map.get(core)}
    return NodeResource(float(len(cpu_map)), cpu_map, capacity.memory, capacity.numa_memory, capacity.numa)


def validate_record(capacity: NodeResource, usage: NodeResource) -> None:
    """eru's Validate, made strict: nothing negative, nothing used beyond capacity or outside it.

    A capacity without cores is valid only when it is entirely empty: a node without cpumem resources.
    Total memory usage is not checked against capacity (eru lets unbound memory be oversubscribed
    by a capacity change); the deploy calculations never add beyond it.
    """
    if not capacity.cpu_map and not capacity.is_empty():
        raise InvalidArgument(
            "capacity.cpu_map", "a node with cpumem resources needs cores", code="invalid_cpu_map"
        )
    _check_amount(capacity.cpu, "capacity.cpu", "invalid_cpu")
    _check_amount(capacity.memory, "capacity.memory", "invalid_memory")
    check_not_negative(usage)
    for core, pieces in capacity.cpu_map.items():
        _check_amount(pieces, f"capacity.cpu_map.{core}", "invalid_cpu_map")
    _check_within(usage.cpu_map, capacity.cpu_map, "usage.cpu_map", "invalid_cpu_map")
    for node, memory in capacity.numa_memory.items():
        _check_amount(memory, f"capacity.numa_memory.{node}", "invalid_numa_memory")
    _check_within(usage.numa_memory, capacity.numa_memory, "usage.numa_memory", "invalid_numa_memory")
    if capacity.numa:
        for core in capacity.cpu_map:
            if core not in capacity.numa:
                raise InvalidArgument(
                    "capacity.numa", f"core {core} has no NUMA node", code="invalid_numa_cpu"
                )
            if capacity.numa[core] not in capacity.numa_memory:
                node = capacity.numa[core]
                raise InvalidArgument(
                    "capacity.numa_memory",
                    f"NUMA node {node} has no memory entry",
                    code="invalid_numa_memory",
                )


def check_not_negative(usage: NodeResource) -> None:
    """Usage never goes below zero: releasing more than was taken is an error, not a silent negative."""
    _check_amount(usage.cpu, "usage.cpu", "invalid_cpu")
    _check_amount(usage.memory, "usage.memory", "invalid_memory")
    for core, pieces in usage.cpu_map.items():
        _check_amount(pieces, f"usage.cpu_map.{core}", "invalid_cpu_map")
    for node, memory in usage.numa_memory.items():
        _check_amount(memory, f"usage.numa_memory.{node}", "invalid_numa_memory")


def availability(capacity: NodeResource, usage: NodeResource) -> NodeAvailability:
    """capacity - usage, keyed by integer ids, with each NUMA node's cores grouped in ascending order."""
    cores = {int(core): pieces - usage.cpu_map.get(core, 0) for core, pieces in capacity.cpu_map.items()}
    numa_cores: dict[str, list[int]] = {}
    for core, node in capacity.numa.items():
        if core in capacity.cpu_map:
            numa_cores.setdefault(node, []).append(int(core))
    numa_memory = capacity.numa_memory
    return NodeAvailability(
        cores=cores,
        memory=capacity.memory - usage.memory,
        numa_memory={
            int(node): memory - usage.numa_memory.get(node, 0) for node, memory in numa_memory.items()
        },
        numa_cores={int(node): sorted(cores) for node, cores in sorted(numa_cores.items(), key=numeric_key)},
    )


def share_pool(capacity: NodeResource, usage: NodeResource, share_base: int) -> dict[str, int]:
    """The cpuset of unbound workloads: cores with a whole CPU free, else every core (eru §2.11)."""
    free = {
        core: share_base
        for core, pieces in capacity.cpu_map.items()
        if pieces - usage.cpu_map.get(core, 0) >= share_base
    }
    return sorted_by_id(free or dict.fromkeys(capacity.cpu_map, share_base))


def placement(plan: CpuPlan, memory_request: int) -> tuple[dict[str, int], str, dict[str, int]]:
    """(cpu_map, numa_node, numa_memory) of a workload placed by `plan`."""
    cpu_map = {str(core): pieces for core, pieces in plan.cores}
    if plan.numa_node is None:
        return cpu_map, "", {}
    node = str(plan.numa_node)
    return cpu_map, node, {node: memory_request}


def split_memory(memory: int, numa: dict[str, str]) -> dict[str, int]:
    """Memory per NUMA node: an equal floor share each, the remainder to the lowest NUMA id."""
    nodes = sorted(set(numa.values()), key=int)
    share, remainder = divmod(memory, len(nodes))
    split = dict.fromkeys(nodes, share)
    split[nodes[0]] += remainder
    return split


def divide(numerator: float, denominator: float) -> float:
    """eru's AdvancedDivide: 0 when either side is 0."""
    if numerator == 0 or denominator == 0:
        return 0.0
    return numerator / denominator


def _complete(used: dict[str, int], capacity: dict[str, int]) -> dict[str, int]:
    completed = {key: used.get(key, 0) for key in capacity}
    completed.update((key, amount) for key, amount in used.items() if amount and key not in capacity)
    return sorted_by_id(completed)


def _changes(mapping: dict[str, int]) -> dict[str, int]:
    return {key: value for key, value in mapping.items() if value}


def _check_amount(value: float, field: str, code: str) -> None:
    if value < 0:
        raise InvalidArgument(field, f"must not be negative, got {value}", code=code)


def _check_within(used: dict[str, int], capacity: dict[str, int], field: str, code: str) -> None:
    for key, amount in used.items():
        if key not in capacity:
            raise InvalidArgument(f"{field}.{key}", "is not in the capacity", code=code)
        if amount > capacity[key]:
            raise InvalidArgument(
                f"{field}.{key}", f"{amount} used exceeds the capacity {capacity[key]}", code=code
            )
