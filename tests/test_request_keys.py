"""Unknown keys are refused at every level of every request (DESIGN.md §8): `invalid_argument`
naming the key by its path, with the keys accepted there, as inside the allocation plugins' maps.

Every request type of every service's command table (`berth.registry.contracts()`) decodes its
minimal payload below, and refuses it with an unknown key added at the top and in each map that a
Struct reads; a command whose request type has no payload here fails the coverage test. Replies,
events and stored records stay lenient. Over real servers: the issue's typos (`nodesnames` placed on
every node, `requestId` placed twice, `lables` made a node without labels) change nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as inspect
import pytest

from bus.codec import decode, decode_stored, encode
from schemas import agent, allocation, broker, metrics
from schemas.common import Empty
from schemas.errors import BusError, InvalidArgument
from schemas.metric_scopes import PodRef
from berth.registry import contracts
from tests.allocation_helpers import requester

TYPO = "typo_key"
PARAM = {"image": "app", "volumes": {"data": {"host_dir": "/d"}}}
FILTER = {"least_instance": 1, "request_instance": 1}
USER = {"user": "u1"}
REF = {**USER, "resource_id": "r1"}
METRIC = {"scope": "node", "metric": "cpu.usage"}

# Each request type's smallest valid payloads, holding every Struct the type may carry (so that the
# keys of each are checked too).
MINIMAL: dict[type, list[dict[str, Any]]] = {
    Empty: [{}],
    allocation.CalculateDeploy: [{"nodename": "n1", "deploy_count": 1}],
    allocation.CalculateRealloc: [{"nodename": "n1", "workload_resource": {}}],
    allocation.CalculateRemap: [{"nodename": "n1"}],
    allocation.AddNode: [{"nodename": "n1", "info": {"ncpu": 1}}],
    allocation.NodeRequest: [{"nodename": "n1"}],
    allocation.GetNodesDeployCapacity: [{}],
    allocation.GetNodesDeployCapacityWire: [{"nodenames": ["n1"]}],
    allocation.SetNodeResourceCapacity: [{"nodename": "n1"}],
    allocation.GetNodeResourceInfo: [{"nodename": "n1"}],
    allocation.SetNodeResourceInfo: [{"nodename": "n1", "capacity": {}, "usage": {}}],
    allocation.SetNodeResourceUsage: [{"nodename": "n1"}],
    allocation.GetMostIdleNode: [{}],
    allocation.GetMetrics: [{"podname": "p", "nodename": "n1"}],
    allocation.Allocate: [{"deploy_count": 1}],
    allocation.AllocateWire: [{"deploy_count": 1, "nodenames": ["n1"]}],
    allocation.ReleaseWorkloads: [{"workload_ids": ["w1"]}],
    allocation.Realloc: [{"workload_id": "w1"}],
    allocation.GetAllocations: [{"nodename": "n1"}],
    allocation.ListNodes: [{}],
    allocation.SetNodeLabels: [{"nodename": "n1", "labels": {}}],
    allocation.NodeHeartbeat: [{"nodename": "n1", "ttl_seconds": 1, "agent": {"address": "h:1"}}],
    broker.Init: [{**REF, "param": PARAM}],
    broker.Launch: [{**REF, "filter": FILTER}],
    broker.Scale: [{**REF, "filter": FILTER}],
    broker.ResourceRef: [REF],
    broker.Release: [REF],
    broker.Apply: [{**REF, "param": PARAM, "filter": FILTER}],
    broker.AddBroker: [
        {**USER, "name": "b1", "strategy": {"type": "const", "num": 1}, "param": PARAM},
        {**USER, "name": "b1", "strategy": {"type": "reactive", "max": 2}, "param": PARAM},
    ],
    broker.RemoveBroker: [{**USER, "name": "b1"}],
    broker.ListBrokers: [{}],
    broker.GetInstanceType: [USER],
    broker.GetNamespace: [USER],
    broker.GetResourceDetail: [USER],
    broker.ListResources: [{}],
    metrics.Get: [METRIC],
    metrics.Aggregate: [{"kind": "pods", "agg": "sum", "metric": "cpu.usage", "pods": [{"uid": "p1"}]}],
    metrics.Put: [{**METRIC, "value": 1.0}],
    metrics.RegisterNotifier: [METRIC],
    metrics.NotifierRequest: [{"key": "0" * 32}],
    metrics.ListMetrics: [{}],
    agent.StartInstance: [{"instance": "i1", "param": PARAM, "owner": {"user": "u1"}}],
    agent.InstanceRequest: [{"instance": "i1"}],
    agent.InstancesRequest: [{"instances": ["i1"]}],
    agent.ListInstances: [{}],
    agent.Drain: [{}],
}


def request_types() -> dict[type, list[str]]:
    """Every type a service decodes a request as (the documented one and its wire form), with the
    subjects that take it."""
    found: dict[type, list[str]] = {}
    for service, module in contracts().items():
        for command in module.COMMANDS:
            for type_ in {command.request, command.wire or command.request}:
                found.setdefault(type_, []).append(f"{service}: {command.subject}")
    return found


REQUEST_TYPES = request_types()


def cases() -> Iterator[Any]:
    for type_ in REQUEST_TYPES:
        for index, payload in enumerate(MINIMAL.get(type_, [])):
            yield pytest.param(type_, payload, id=f"{type_.__name__}-{index}")


def struct_maps(payload: Any, info: inspect.Type, path: str = "") -> Iterator[tuple[str, dict, list[str]]]:
    """Each map of `payload` a Struct reads: (its path, the map, the keys accepted there by wire name)."""
    if isinstance(info, inspect.StructType) and isinstance(payload, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        yield path, payload, sorted([*fields, *([info.tag_field] if info.tag_field else [])])
        for key, value in payload.items():
            if key in fields:
                yield from struct_maps(value, fields[key], f"{path}.{key}" if path else key)
    elif isinstance(info, (inspect.ListType, inspect.VarTupleType)) and isinstance(payload, list):
        for index, item in enumerate(payload):
            yield from struct_maps(item, info.item_type, f"{path}[{index}]")
    elif isinstance(info, inspect.DictType) and isinstance(payload, dict):
        for key, item in payload.items():
            yield from struct_maps(item, info.value_type, f"{path}.{key}" if path else key)
    elif isinstance(info, inspect.UnionType):
        for member in info.types:
            tag = getattr(member, "tag_field", None)
            if isinstance(member, inspect.StructType) and (tag is None or payload.get(tag) == member.tag):
                yield from struct_maps(payload, member, path)
            elif not isinstance(member, inspect.StructType):
                yield from struct_maps(payload, member, path)


def refused(data: bytes, type_: type) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        decode(data, type_)
    return caught.value


def test_every_request_type_has_a_minimal_payload():
    missing = {type_.__name__: subjects for type_, subjects in REQUEST_TYPES.items() if type_ not in MINIMAL}
    assert not missing, f"add a minimal payload to MINIMAL for: {missing}"


@pytest.mark.parametrize("type_,payload", list(cases()))
def test_an_unknown_key_is_refused_at_every_level(type_, payload):
    decode(encode(payload), type_)  # the payload itself is valid
    info = inspect.type_info(type_)
    maps = list(struct_maps(payload, info))
    assert maps[0][0] == ""  # the top level first, then every map a Struct reads inside
    for index, (path, _, accepted) in enumerate(maps):
        sent = copy.deepcopy(payload)
        list(struct_maps(sent, info))[index][1][TYPO] = 1
        error = refused(encode(sent), type_)
        field = f"{path}.{TYPO}" if path else TYPO
        assert (error.code, error.status, error.field) == ("invalid_argument", 400, field)
        assert error.details["accepted"] == accepted
        listed = f"accepted: {', '.join(accepted)}" if accepted else "it takes no keys"
        assert error.message == f"{field}: unknown key {TYPO!r}; {listed}"


@pytest.mark.parametrize("type_,payload", list(cases()))
def test_the_unknown_key_is_named_wherever_it_comes(type_, payload):
    """msgspec stops at the first unknown key; first or last in the map, the answer is the same."""
    error = refused(encode({TYPO: 1, **payload}), type_)
    top_accepted = next(struct_maps(payload, inspect.type_info(type_)))[2]
    assert (error.field, error.details["accepted"]) == (TYPO, top_accepted)


def test_the_issues_typos_name_the_key_and_the_accepted_ones():
    error = refused(encode({"deploy_count": 1, "nodesnames": ["n1"]}), allocation.AllocateWire)
    assert error.message == (
        "nodesnames: unknown key 'nodesnames'; accepted: deploy_count, dry_run, labels, nodename, nodenames, "
        "request_id, strategy, workload_ids, workload_resource_request"
    )
    assert refused(encode({"deploy_count": 1, "requestId": "r"}), allocation.Allocate).field == "requestId"
    assert refused(encode({"nodename": "n1", "lables": {}}), allocation.AddNode).field == "lables"


class Renamed(msgspec.Struct, forbid_unknown_fields=True):
    cpu_request: int = msgspec.field(default=0, name="cpu-request")


class Shared(msgspec.Struct):  # lenient, as a Struct that replies share
    inner: Renamed = msgspec.field(default_factory=Renamed)
    memory: int = msgspec.field(default=0, name="memory-request")


def test_a_key_is_listed_by_its_wire_name():
    assert decode(encode({"cpu-request": 1}), Renamed).cpu_request == 1
    assert refused(encode({"cpu_request": 1}), Renamed).details["accepted"] == ["cpu-request"]
    error = refused(encode({"inner": {"cpu-request": 1}, "memory": 1}), Shared)
    assert (error.field, error.details["accepted"]) == ("memory", ["inner", "memory-request"])
    assert refused(encode({"inner": {"cpu": 1}}), Shared).field == "inner.cpu"


def test_a_wrong_type_before_an_unknown_key_is_named_first():
    error = refused(encode({"deploy_count": "one", "nodesnames": []}), allocation.Allocate)
    assert error.field == "deploy_count"


def test_replies_events_and_records_stay_lenient():
    """A client ignores keys it does not know in replies and events; old records may carry keys."""
    assert decode_stored(encode({"allocations": [], "later": 1}), allocation.AllocateReply).allocations == []
    event = decode_stored(encode({"type": "added", "nodename": "n1", "later": 1}), allocation.NodeEvent)
    assert event.nodename == "n1"
    view = decode_stored(encode({"image": "app", "later": 1}), broker.ResourceParam)
    assert view.image == "app"
    owner = decode_stored(encode({"user": "u1", "later": 1}), agent.Owner)
    assert owner.user == "u1"
    assert decode_stored(encode({"uid": "p", "later": 1}), dict)["later"] == 1
    with pytest.raises(msgspec.ValidationError):  # a request part that nothing else shares is strict
        decode_stored(encode({"uid": "p", "later": 1}), PodRef)


# -- over real servers ------------------------------------------------------------------------------


@pytest.fixture
async def call(serve_allocation, client):
    await serve_allocation()
    return requester(client)


async def refused_call(call, command: str, payload: dict) -> BusError:
    with pytest.raises(BusError) as caught:
        await call(command, payload)
    return caught.value


async def test_allocate_with_a_typo_of_nodenames_places_nothing(call):
    for node in ("n1", "n2"):
        await call("add-node", {"nodename": node, "resource": {"cpumem": {"cpu": 2, "memory": "4G"}}})
    error = await refused_call(call, "allocate", {"nodesnames": ["n1"], "deploy_count": 1})
    assert (error.code, error.status, error.details["field"]) == ("invalid_argument", 400, "nodesnames")
    assert "nodenames" in error.details["accepted"] and "accepted: deploy_count, " in error.message
    for node in ("n1", "n2"):
        assert (await call("get-allocations", {"nodename": node}))["allocations"] == []


async def test_allocate_with_a_typo_of_request_id_places_nothing(call):
    await call("add-node", {"nodename": "n1", "resource": {"cpumem": {"cpu": 2, "memory": "4G"}}})
    payload = {"nodename": "n1", "deploy_count": 1, "requestId": "once"}
    for _ in range(2):
        error = await refused_call(call, "allocate", payload)
        assert (error.code, error.details["field"]) == ("invalid_argument", "requestId")
        assert "request_id" in error.details["accepted"]
    assert (await call("get-allocations", {"nodename": "n1"}))["allocations"] == []


async def test_add_node_with_a_typo_of_labels_makes_no_node(call):
    error = await refused_call(call, "add-node", {
        "nodename": "n1", "resource": {"cpumem": {"cpu": 2, "memory": "4G"}}, "lables": {"pool": "a"},
    })
    assert (error.code, error.details["field"]) == ("invalid_argument", "lables")
    assert error.message == "lables: unknown key 'lables'; accepted: info, labels, nodename, request_id, resource"
    assert (await call("list-nodes", {}))["nodes"] == []
    missing = await refused_call(call, "get-node-resource-info", {"nodename": "n1"})
    assert missing.code == "node_not_found"


async def test_a_nested_typo_is_refused_over_the_bus(call):
    error = await refused_call(call, "add-node", {
        "nodename": "n1", "info": {"ncpu": 2, "memory_totl": 1 << 30},
    })
    assert (error.code, error.details["field"]) == ("invalid_argument", "info.memory_totl")
    assert (await call("list-nodes", {}))["nodes"] == []
