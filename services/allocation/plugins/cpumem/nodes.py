"""A new node's cpumem record: the node request, completed from what the engine reports (eru §2.6)."""

from __future__ import annotations

from bus.codec import convert
from schemas.errors import BerthError, InvalidArgument
from services.allocation.plugins.interface import EngineInfo, Raw
from services.allocation.plugins.kit import refuse_unknown_fields

from .requests import MAX_CORES, parse_node_request
from .resources import complete_usage, split_memory, validate_record
from .types import NodeResource, decode_node_resource

# Share of the engine-reported memory a node offers when the operator gives none (eru: 80%).
ENGINE_MEMORY_PERCENT = 80

# The node-request key each capacity key comes from (add-node builds the record from the request).
_REQUEST_KEYS = {
    "cpu": "cpu", "cpu_map": "cpu", "memory": "memory", "numa": "numa-cpu", "numa_memory": "numa-memory"
}


def new_node(
    resource: Raw | None, info: EngineInfo | Raw | None, share_base: int
) -> tuple[NodeResource, NodeResource]:
    """(capacity, usage) of a new node; a record that must not be stored names the request key at fault."""
    request = parse_node_request(resource, share_base, delta=False, field="resource")
    capacity = request.to_resource()
    if info is not None:
        engine_info = info if isinstance(info, EngineInfo) else convert(info, EngineInfo, path="info")
        capacity = _fill_from_engine(capacity, request.numa, request.numa_memory, engine_info, share_base)
    if capacity.numa and not capacity.numa_memory:
        capacity.numa_memory = split_memory(capacity.memory, capacity.numa)
    usage = complete_usage(capacity, NodeResource())
    try:
        validate_record(capacity, usage)
    except BerthError as error:
        raise _as_request_error(error) from None
    return capacity, usage


def _fill_from_engine(
    capacity: NodeResource,
    requested_numa: dict[str, str] | None,
    requested_numa_memory: dict[str, int] | None,
    info: EngineInfo,
    share_base: int,
) -> NodeResource:
    """Cores and memory the operator left out, from what the engine reports.

    The engine's own cpumem resource, when present, overrides ncpu and memory_total. A requested
    topology (`numa-cpu`, `numa-memory`) wins over the engine's.
    """
    refuse_unknown_fields(info.resources.get("cpumem"), NodeResource, "info.resources.cpumem")
    engine = decode_node_resource(info.resources.get("cpumem"), "info.resources.cpumem")
    ncpu = int(engine.cpu) if engine.cpu > 0 else info.ncpu
    memory_total = engine.memory if engine.memory > 0 else info.memory_total
    if not 0 <= ncpu <= MAX_CORES or memory_total < 0:
        raise InvalidArgument("info", f"ncpu must be in [0, {MAX_CORES}] and memory_total not negative")
    if not capacity.cpu_map:
        capacity.cpu_map = {str(core): share_base for core in range(ncpu)}
        capacity.cpu = float(ncpu)
        capacity.numa = dict(engine.numa if requested_numa is None else requested_numa)
    if capacity.memory == 0:
        capacity.memory = memory_total * ENGINE_MEMORY_PERCENT // 100
        if requested_numa_memory is None:
            capacity.numa_memory = {
                node: memory * ENGINE_MEMORY_PERCENT // 100 for node, memory in engine.numa_memory.items()
            }
    return capacity


def _as_request_error(error: BerthError) -> BerthError:
    """A record validation error of add-node, naming the request key the operator sent instead."""
    field = error.field or ""
    key = field.split(".")[1] if field.startswith("capacity.") else None
    if key not in _REQUEST_KEYS:
        return error
    field, reason = f"resource.{_REQUEST_KEYS[key]}", error.message.split(": ", 1)[-1]
    return BerthError(f"{field}: {reason}", code=error.code, field=field)
