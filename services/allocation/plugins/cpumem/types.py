"""Typed shapes of the cpumem plugin (DESIGN.md §3; eru reference §2.2).

Records, workload resources and engine params keep their wire keys, so `msgspec.convert` decodes
them and `msgspec.to_builtins` encodes them back. Core ids and NUMA node ids are strings on the
wire, but they must be canonical non-negative integers ("0", "17", never "01" or "a"): berth
orders them numerically, and two spellings of one core must not exist.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any

import msgspec

from schemas.errors import InvalidArgument
from services.allocation.plugins import kit

# Float sums are rounded to 1e-9 (eru's Round) so that adding and removing workloads cancels out.
CPU_DIGITS = 9

_CANONICAL_ID = re.compile(r"0|[1-9][0-9]*")
# Many ids joined by NUL, checked in one regex call: records are decoded on every calculation, and
# checking 64 cores one by one costs more than the whole msgspec decode.
_CANONICAL_IDS = re.compile(r"(?:0|[1-9][0-9]*)(?:\x00(?:0|[1-9][0-9]*))*")


class NodeResource(msgspec.Struct):
    """A node's capacity or usage. In usage, `cpu_map` holds the pieces of bound workloads only."""

    cpu: float = 0.0
    cpu_map: dict[str, int] = {}
    memory: int = 0
    numa_memory: dict[str, int] = {}
    # core id -> NUMA node id; meaningful on capacity, usage carries a copy.
    numa: dict[str, str] = {}

    def is_empty(self) -> bool:
        return not (self.cpu or self.cpu_map or self.memory or self.numa_memory or self.numa)


class WorkloadResource(msgspec.Struct):
    """What one workload holds. `cpu_map` is empty when unbound; `numa_node` is "" unless NUMA-local."""

    cpu_request: float = 0.0
    cpu_limit: float = 0.0
    memory_request: int = 0
    memory_limit: int = 0
    cpu_map: dict[str, int] = {}
    numa_memory: dict[str, int] = {}
    numa_node: str = ""

    def as_usage(self) -> NodeResource:
        """The share of a node's usage this workload accounts for."""
        return NodeResource(
            cpu=self.cpu_request,
            cpu_map=self.cpu_map,
            memory=self.memory_request,
            numa_memory=self.numa_memory,
        )


class EngineParams(msgspec.Struct):
    """What the engine receives: `cpu` becomes the quota, `cpu_map` the cpuset."""

    cpu: float = 0.0
    cpu_map: dict[str, int] = {}
    numa_node: str = ""
    memory: int = 0
    remap: bool = False


class WorkloadRequest(msgspec.Struct):
    """A parsed workload request (wire keys `cpu-bind`, `cpu-request`, ...); values may be deltas."""

    cpu_bind: bool = False
    keep_cpu_bind: bool = False
    cpu_request: float = 0.0
    cpu_limit: float = 0.0
    memory_request: int = 0
    memory_limit: int = 0


def numeric_key(item: tuple[str, Any]) -> int:
    """Sort key for map items keyed by a canonical id."""
    return int(item[0])


def sorted_by_id(mapping: dict[str, Any]) -> dict[str, Any]:
    """The map with its keys in ascending numeric order (berth's deterministic order)."""
    return dict(sorted(mapping.items(), key=numeric_key))


def check_ids(ids: Collection[str], field: str, code: str) -> None:
    """Reject any id that is not a canonical non-negative integer string."""
    joined = "\x00".join(ids)
    # The count guards against an id that itself contains a NUL between digits.
    if not ids or (_CANONICAL_IDS.fullmatch(joined) and joined.count("\x00") == len(ids) - 1):
        return
    bad = next(i for i in ids if not _CANONICAL_ID.fullmatch(i))
    raise InvalidArgument(
        field, f"{bad!r} should be a whole number such as '0' or '17' (digits only, no leading zeros)",
        code=code,
    )


def decode_node_resource(raw: Any, field: str) -> NodeResource:
    """A stored NodeResource from its wire map; None or {} is the all-zero resource."""
    if not raw:
        return NodeResource()
    resource = _convert(raw, NodeResource, field)
    _check_cpu(resource.cpu, f"{field}.cpu")
    check_ids(resource.cpu_map, f"{field}.cpu_map", "invalid_cpu_map")
    check_ids(resource.numa_memory, f"{field}.numa_memory", "invalid_numa_memory")
    check_ids(resource.numa, f"{field}.numa", "invalid_numa_cpu")
    check_ids(resource.numa.values(), f"{field}.numa", "invalid_numa_cpu")
    return resource


def decode_workload_resource(raw: Any, field: str) -> WorkloadResource:
    """A WorkloadResource from its wire map. Values may be negative: a realloc delta is one too."""
    resource = _convert(raw or {}, WorkloadResource, field)
    _check_cpu(resource.cpu_request, f"{field}.cpu_request")
    _check_cpu(resource.cpu_limit, f"{field}.cpu_limit")
    check_ids(resource.cpu_map, f"{field}.cpu_map", "invalid_cpu_map")
    check_ids(resource.numa_memory, f"{field}.numa_memory", "invalid_numa_memory")
    if resource.numa_node:
        check_ids([resource.numa_node], f"{field}.numa_node", "invalid_numa_cpu")
    return resource


def _convert(raw: Any, kind: type, field: str) -> Any:
    if not isinstance(raw, dict):
        raise InvalidArgument(field, f"must be a map, got {type(raw).__name__}")
    try:
        return msgspec.convert(raw, kind)  # fast: records this plugin wrote hold plain ints
    except msgspec.ValidationError:
        # JSON clients send integral floats; the shared decoder accepts those and names a bad path.
        return kit.decode(raw, kind, field)


def _check_cpu(value: float, field: str) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value!r}", code="invalid_cpu")
