"""Parsing of workload requests and node requests (eru reference §2.3 and §2.4), strictly typed.

eru reads these maps leniently (a string where a number belongs silently becomes 0); berth
rejects every bad value with an error naming the wire key.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from schemas.errors import InvalidArgument
from schemas.sizes import parse_size
from services.allocation.plugins.kit import refuse_unknown_fields, refuse_unknown_keys
from services.allocation.quantity import parse_cpu

from .types import NodeResource, WorkloadRequest, check_ids, decode_node_resource, sorted_by_id

# Sanity bounds: a typo must not build a billion-entry map. eru parses pieces as int32.
MAX_CORES = 1 << 16
MAX_PIECES = 2**31 - 1
_PIECES = re.compile(r"-?[0-9]+")
# The keys each map is read with (eru reference §2.3, §2.4); any other is a typo, refused.
WORKLOAD_REQUEST_KEYS = frozenset({
    "cpu-bind", "keep-cpu-bind", "cpu-request", "cpu-limit", "memory-request", "memory-limit",
})
NODE_REQUEST_KEYS = frozenset({"cpu", "share", "memory", "numa-cpu", "numa-memory"})


def parse_workload_request(raw: Any, *, delta: bool = False, field: str = "workload_resource_request") -> WorkloadRequest:
    """The raw values of a workload request; None or {} is the empty request (unbound, nothing asked).

    A negative quantity is `invalid_argument` (DESIGN.md §2) except in a delta (a realloc request),
    where it subtracts; `validate_workload_request` then rejects a negative total with eru's
    invalid_cpu / invalid_memory codes.
    """
    raw = _as_map(raw, field)
    refuse_unknown_keys(raw, WORKLOAD_REQUEST_KEYS, field)
    # Memory is read first: eru validates memory before cpu (step 2 before step 3).
    memory_request = _size(raw, field, "memory-request", allow_negative=delta)
    memory_limit = _size(raw, field, "memory-limit", allow_negative=delta)
    return WorkloadRequest(
        cpu_bind=_bool(raw, field, "cpu-bind"),
        keep_cpu_bind=_bool(raw, field, "keep-cpu-bind"),
        cpu_request=_cpu(raw, field, "cpu-request", allow_negative=delta),
        cpu_limit=_cpu(raw, field, "cpu-limit", allow_negative=delta),
        memory_request=memory_request,
        memory_limit=memory_limit,
    )


def validate_workload_request(request: WorkloadRequest, field: str = "workload_resource_request") -> WorkloadRequest:
    """eru's eight validation steps, in their order; returns the normalised request."""
    cpu_request, cpu_limit = request.cpu_request, request.cpu_limit
    memory_request, memory_limit = request.memory_request, request.memory_limit
    if cpu_request == 0 and cpu_limit > 0:
        cpu_request = cpu_limit
    if memory_limit < 0 or memory_request < 0:
        key = "memory-limit" if memory_limit < 0 else "memory-request"
        raise InvalidArgument(f"{field}.{key}", "limit or request less than 0", code="invalid_memory")
    if cpu_request < 0 or cpu_limit < 0:
        key = "cpu-limit" if cpu_limit < 0 else "cpu-request"
        raise InvalidArgument(f"{field}.{key}", "limit or request less than 0", code="invalid_cpu")
    if cpu_request == 0 and request.cpu_bind:
        raise InvalidArgument(f"{field}.cpu-request", "unlimited request with bind", code="invalid_cpu")
    if memory_request == 0 and memory_limit > 0:
        memory_request = memory_limit
    if memory_request > 0 and memory_limit > 0 and memory_limit < memory_request:
        memory_limit = memory_request
    if cpu_request > 0 and cpu_limit > 0 and cpu_limit < cpu_request:
        cpu_limit = cpu_request
    if request.cpu_bind and cpu_request > 0 and cpu_limit > cpu_request:
        cpu_request = cpu_limit  # a bound workload reserves its whole limit (eru PR #334)
    return msgspec.structs.replace(
        request,
        cpu_request=cpu_request,
        cpu_limit=cpu_limit,
        memory_request=memory_request,
        memory_limit=memory_limit,
    )


class NodeRequest(msgspec.Struct):
    """An operator's node request; None marks a key the request leaves out."""

    cpu_map: dict[str, int] | None = None
    memory: int | None = None
    numa: dict[str, str] | None = None
    numa_memory: dict[str, int] | None = None

    def to_resource(self, origin: NodeResource | None = None) -> NodeResource:
        """The NodeResource this request describes; omitted keys come from `origin` (eru's LoadFromOrigin)."""
        origin = origin or NodeResource()
        cpu_map = origin.cpu_map if self.cpu_map is None else self.cpu_map
        return NodeResource(
            cpu=float(len(cpu_map)),
            cpu_map=dict(cpu_map),
            memory=origin.memory if self.memory is None else self.memory,
            numa_memory=dict(origin.numa_memory if self.numa_memory is None else self.numa_memory),
            numa=dict(origin.numa if self.numa is None else self.numa),
        )


def parse_node_request(raw: Any, share_base: int, *, delta: bool, field: str = "resource_request") -> NodeRequest:
    """A node request: `cpu` (a count or "id:pieces,..."), `share`, `memory`, `numa-cpu`, `numa-memory`.

    A map carrying `cpu_map` is a NodeResource snapshot (what set_capacity returned as `before`) and
    is taken verbatim, so replaying it restores a custom or oversold cpu map exactly.
    Negative values are accepted only in a delta request.
    """
    raw = _as_map(raw, field)
    if "cpu_map" in raw:
        refuse_unknown_fields(raw, NodeResource, field)
        snapshot = decode_node_resource(raw, field)
        return NodeRequest(snapshot.cpu_map, snapshot.memory, snapshot.numa, snapshot.numa_memory)
    refuse_unknown_keys(raw, NODE_REQUEST_KEYS, field)
    return NodeRequest(
        cpu_map=_cpu_map(raw, share_base, delta, field) if "cpu" in raw else None,
        memory=_size(raw, field, "memory", allow_negative=delta) if "memory" in raw else None,
        numa=_numa_cpu(raw["numa-cpu"], f"{field}.numa-cpu") if "numa-cpu" in raw else None,
        numa_memory=_numa_memory(raw["numa-memory"], delta, f"{field}.numa-memory") if "numa-memory" in raw else None,
    )


def _cpu_map(raw: dict[str, Any], share_base: int, delta: bool, field: str) -> dict[str, int]:
    cpu = raw["cpu"]
    if isinstance(cpu, str):
        return _cpu_list(cpu, delta, f"{field}.cpu")
    count = _whole_number(cpu, f"{field}.cpu", MAX_CORES)
    share = _whole_number(raw["share"], f"{field}.share", MAX_PIECES) if "share" in raw else 0
    return {str(core): share or share_base for core in range(count)}


def _cpu_list(text: str, delta: bool, field: str) -> dict[str, int]:
    """The list form "0:100,1:200,3:50"; "" means no cores."""
    cpu_map: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        core, sep, pieces = (part.strip() for part in entry.partition(":"))
        if not sep:
            raise InvalidArgument(field, f"{entry!r} should be '<cpu id>:<pieces>', such as '3:100'")
        check_ids([core], field, "invalid_argument")
        if core in cpu_map:
            raise InvalidArgument(field, f"core {core} is listed twice")
        if not _PIECES.fullmatch(pieces) or abs(int(pieces)) > MAX_PIECES:
            raise InvalidArgument(field, f"pieces of core {core} must be an int32, got {pieces!r}")
        if int(pieces) < 0 and not delta:
            raise InvalidArgument(field, f"pieces of core {core} must not be negative")
        cpu_map[core] = int(pieces)
    return sorted_by_id(cpu_map)


def _numa_cpu(value: Any, field: str) -> dict[str, str]:
    """Element i lists the cores of NUMA node i, e.g. ["0,1,2,3", "4,5,6,7"]."""
    numa: dict[str, str] = {}
    for node, cores in enumerate(_string_list(value, field)):
        for core in (part.strip() for part in cores.split(",")):
            check_ids([core], f"{field}[{node}]", "invalid_argument")
            if core in numa:
                raise InvalidArgument(field, f"core {core} is in NUMA nodes {numa[core]} and {node}")
            numa[core] = str(node)
    return sorted_by_id(numa)


def _numa_memory(value: Any, delta: bool, field: str) -> dict[str, int]:
    """Element i is the memory of NUMA node i, an integer or a size string."""
    if not isinstance(value, list):
        raise InvalidArgument(field, f"must be a list, got {type(value).__name__}")
    return {str(node): parse_size(size, f"{field}[{node}]", allow_negative=delta) for node, size in enumerate(value)}


def _as_map(raw: Any, field: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(field, f"must be a map, got {type(raw).__name__}")
    return raw


def _bool(raw: dict[str, Any], field: str, key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field}.{key}", f"must be a boolean, got {type(value).__name__}")
    return value


def _cpu(raw: dict[str, Any], field: str, key: str, *, allow_negative: bool) -> float:
    return parse_cpu(raw[key], f"{field}.{key}", allow_negative=allow_negative) if key in raw else 0.0


def _size(raw: dict[str, Any], field: str, key: str, *, allow_negative: bool) -> int:
    return parse_size(raw[key], f"{field}.{key}", allow_negative=allow_negative) if key in raw else 0


def _whole_number(value: Any, field: str, maximum: int) -> int:
    """An integer in [0, maximum]; an integral float is accepted (JSON clients send those)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(field, f"must be a whole number, got {value!r}")
    if not 0 <= value <= maximum:
        raise InvalidArgument(field, f"must be between 0 and {maximum}, got {value}")
    return value


def _string_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidArgument(
            field, "must be a list of strings, one per NUMA node listing its cores, such as ['0,1', '2,3']"
        )
    return value
