"""What the allocation contract tests share (tests/contract/test_contract_allocation.py and
test_contract_bounds.py): nodes made over the wire, the error shape §2 pins, and "nothing changed"."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from tests.bus_helpers import EventLog
from tests.contract.conftest import ERROR_HEADER, Wire, WireReply, unique

PLUGINS = ("cpumem", "storage", "gpu")
GPU = "nv-a"
WRR = "workload_resource_request"
INVALID = "invalid_argument"
ANY = object()  # "do not check details.field": the error names no field (insufficient_*, internal)

# §8 "HTTP-like statuses": every code an allocation command can answer, with its status.
STATUS = {
    "invalid_argument": 400, "invalid_cpu": 400, "invalid_memory": 400, "invalid_cpu_map": 400,
    "invalid_numa_cpu": 400, "invalid_numa_memory": 400, "invalid_volume": 400, "invalid_storage": 400,
    "node_not_found": 404, "plugin_not_found": 404, "workload_not_found": 404,
    "node_exists": 409, "workload_exists": 409, "node_not_empty": 409, "node_down": 409, "node_draining": 409,
    "insufficient_capacity": 409, "insufficient_resource": 409,
    "internal": 500,
}

# One node request per plugin: 2 cores and 4 GiB; a 100 GiB volume plus a 200 GiB budget; 2 cards.
PLUGIN_RESOURCE = {
    "cpumem": {"cpu": 2, "memory": "4G"},
    "storage": {"volumes": ["/data:100G"], "storage": "200G"},
    "gpu": {"prod_count_map": {GPU: 2}},
}


def full_resource(cpu: int = 2) -> dict:
    return {**PLUGIN_RESOURCE, "cpumem": {**PLUGIN_RESOURCE["cpumem"], "cpu": cpu}}


async def new_node(wire: Wire, stem: str = "n", resource: dict | None = None, **extra: Any) -> str:
    node = unique(stem)
    resource = full_resource() if resource is None else resource
    await wire.ok("resource.add-node", {"nodename": node, "resource": resource, **extra})
    return node


async def node_state(wire: Wire, node: str) -> list:
    """Everything a client can read about a node: each plugin's record, the ledger and its listing."""
    state = [
        (await wire.request(f"resource.{plugin}.get-node-resource-info", {"nodename": node})).body
        for plugin in PLUGINS
    ]
    state.append((await wire.request("resource.get-allocations", {"nodename": node})).body)
    state.append(await wire.ok("resource.list-nodes", {"nodenames": [node]}))
    return state


async def until_sentinel(wire: Wire, capture: EventLog) -> list[tuple[str, dict]]:
    """The events `capture` got before a sentinel change made now; one worker publishes in order."""
    sentinel = unique("sentinel")
    await wire.ok("resource.gpu.add-node", {"nodename": sentinel, "resource": {}})
    return await capture.before(wire.subject(f"events.resource.{sentinel}.added"))


@asynccontextmanager
async def changes_nothing(wire: Wire, *nodes: str):
    """The block changes no node's state and publishes no event."""
    capture = await wire.capture("resource.>")
    try:
        before = [await node_state(wire, node) for node in nodes]
        yield
        assert [await node_state(wire, node) for node in nodes] == before
        assert await until_sentinel(wire, capture) == []
    finally:
        await capture.close()


def assert_error(reply: WireReply, code: str, field: Any = ANY) -> None:
    """§2: header `Nats-Service-Error-Code` (§8 status of the code) and `Nats-Service-Error` (the
    message); body `{"error": {"code", "message", "details"}}`; `details.field` names the field."""
    assert not reply.ok, f"expected {code}, got a success: {reply.body!r}"
    assert (reply.status, reply.code) == (STATUS[code], code), reply.body
    assert set(reply.body) == {"error"} and set(reply.error) == {"code", "message", "details"}, reply.body
    assert isinstance(reply.error["message"], str) and reply.error["message"]
    assert reply.headers[ERROR_HEADER] == reply.error["message"]
    assert isinstance(reply.details, dict)
    if field is not ANY:
        assert reply.details.get("field") == field, reply.body
