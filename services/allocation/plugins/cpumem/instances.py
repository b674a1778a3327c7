"""What one cpumem instance gets from a request and its placement: engine params and workload resource;
the realloc arithmetic; and eru's shortfall errors (`insufficient_capacity` / `insufficient_resource`)."""

from __future__ import annotations

from typing import Any

from schemas.errors import BerthError
from services.allocation.quantity import saturating_add

from .types import CPU_DIGITS, EngineParams, NodeResource, WorkloadRequest, WorkloadResource


def engine_params(want: WorkloadRequest, cpu_map: dict[str, int], numa_node: str) -> EngineParams:
    return EngineParams(cpu=want.cpu_limit, cpu_map=cpu_map, numa_node=numa_node, memory=want.memory_limit)


def workload(
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


def add_delta(current: WorkloadResource, delta: WorkloadRequest, bind: bool) -> WorkloadRequest:
    """The request a realloc re-places: what the workload holds plus the request's deltas."""
    return WorkloadRequest(
        cpu_bind=bind,
        cpu_request=round(current.cpu_request + delta.cpu_request, CPU_DIGITS),
        cpu_limit=round(current.cpu_limit + delta.cpu_limit, CPU_DIGITS),
        memory_request=saturating_add(current.memory_request, delta.memory_request),
        memory_limit=saturating_add(current.memory_limit, delta.memory_limit),
    )


def check_unbound(capacity: NodeResource, usage: NodeResource, want: WorkloadRequest, count: int) -> None:
    """Unbound CPU is never capacity-checked, but one instance may not ask for more than the node's cores."""
    if want.cpu_request > len(capacity.cpu_map):
        raise insufficient(
            "insufficient_capacity", "cpu", requested=want.cpu_request, available=len(capacity.cpu_map),
            unit="cores",
        )
    if want.memory_request > 0:
        free = max(capacity.memory - usage.memory, 0)
        fits = free // want.memory_request
        if fits < count:
            raise insufficient(
                "insufficient_capacity", "memory", requested=count, available=fits,
                note=f" ({want.memory_request} bytes each, {free} bytes free)",
                memory_request=want.memory_request, memory_free=free,
            )


def insufficient(
    code: str, resource: str, *, requested: float, available: float, unit: str = "instances", note: str = "",
    **details: Any,
) -> BerthError:
    """eru's shortfall error. `requested` and `available` count `unit` (also in details): `instances`
    (how many were asked, how many fit) or `cores` (one instance's request, the node's cores)."""
    reason = "not enough nodes capacity" if code == "insufficient_capacity" else "not enough resource"
    if unit == "instances":
        counts = f"{requested:g} instances wanted, room for {available:g}"
    else:
        counts = f"{requested:g} {unit} wanted by one instance, the node has {available:g}"
    return BerthError(
        f"{resource}: cannot alloc a plan, {reason}: {counts}{note}",
        code=code,
        details={
            "plugin": "cpumem", "resource": resource, "requested": requested, "available": available,
            "unit": unit, **details,
        },
    )
