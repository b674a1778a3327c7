"""Contract tests of the allocation service: DESIGN.md §2, §3 and §8 ("All services", "Allocation").

Each test is named after the contract detail it pins and quotes the line. Requests are plain
`msgpack` maps sent with nats-py to one real allocation worker process started for the module;
replies, headers, Redis keys, events and the JetStream stream are read raw. Nothing here imports
berth's Structs, codec or client, so a test fails when the wire changes. Tests keep apart by
using their own node names (`unique`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable

import msgpack
import pytest
from nats.js.api import DeliverPolicy

from tests.contract.allocation_wire import (
    ANY,
    GPU,
    INVALID,
    PLUGIN_RESOURCE,
    PLUGINS,
    WRR,
    assert_error,
    changes_nothing,
    full_resource,
    new_node,
    until_sentinel,
)
from tests.contract.conftest import (
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    Wire,
    send_from_processes,
    unique,
)

GiB = 1 << 30
MAX_INT = 2**63 - 1
GHOST = "ghost-never-added"  # no test creates a node of this name

# §8 "Event body fields: `nodename`, and where they apply `plugin`, `before`, `after`, `workload_ids`"
# (and, README, `version`).
EVENT_FIELDS = {"type", "time", "nodename", "version", "plugin", "before", "after", "workload_ids"}

# What the standard held workload takes: one bound core and 1 GiB, a 10 GiB volume, one card.
HELD_REQUEST = {
    "cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": GiB},
    "storage": {"volumes": ["AUTO:/v:rw:10G"]},
    "gpu": {"prod_count_map": {GPU: 1}},
}
BOUND = {"cpu-bind": True, "cpu-request": 1}
BOUND_ONE = {"cpumem": BOUND}


@pytest.fixture(scope="module", autouse=True)
def allocation_worker(module_workers):
    """One allocation worker process serves the whole module."""
    return module_workers("services.allocation.worker")


# -- helpers ---------------------------------------------------------------------------------------


def deploy(node: str, request: dict | None, count: Any = 1) -> dict:
    return {"nodename": node, "deploy_count": count, WRR: request}


async def allocate(wire: Wire, node: str, request: dict | None = None, count: int = 1, **extra) -> list[dict]:
    payload = deploy(node, HELD_REQUEST if request is None else request, count)
    return (await wire.ok("resource.allocate", {**payload, **extra}))["allocations"]


@dataclass
class Held:
    """A node of PLUGIN_RESOURCE holding one workload of HELD_REQUEST."""

    node: str
    workload: dict

    @property
    def wid(self) -> str:
        return self.workload["workload_id"]

    def realloc(self, plugin: str, request: dict) -> dict:
        """A plugin-level calculate-realloc of the held workload."""
        held = self.workload["workload_resource"][plugin]
        return {"nodename": self.node, "workload_resource": held, WRR: request}

    def realloc_all(self, request: dict) -> dict:
        """A manager-level realloc of the held workload."""
        return {"workload_id": self.wid, WRR: request}


async def held_node(wire: Wire) -> Held:
    node = await new_node(wire, "held")
    [workload] = await allocate(wire, node)
    return Held(node, workload)


async def events_of(wire: Wire, action: Callable[[], Awaitable[Any]]) -> tuple[Any, list, float, float]:
    """(what `action` returned, exactly the events it published in order, time before, time after)."""
    capture = await wire.capture("resource.>")
    try:
        t0 = time.time()
        result = await action()
        events = await until_sentinel(wire, capture)
        return result, events, t0, time.time()
    finally:
        await capture.close()


async def stored_replies(redis, prefix: str, request_id: str) -> list[dict]:
    """The answers kept under `<prefix>:idem:*` for a request id, as maps with `headers` (bus/idempotency.py
    keeps a success its endpoint rebuilds as `\\x01` and a recipe, any other answer as [body, headers])."""
    found: list[dict] = []
    async for key in redis.scan_iter(match=f"{prefix}:idem:*:{request_id}", count=1000):
        raw = await redis.hget(key, "r")  # the kept answer
        if raw is None:
            continue
        if raw[:1] == b"\x01":
            found.append({"recipe": raw[1:], "headers": None})
        else:
            body, headers = msgpack.unpackb(raw, strict_map_key=False)
            found.append({"body": body, "headers": headers})
    return found


def is_success(stored: dict) -> bool:
    return ERROR_CODE_HEADER not in (stored.get("headers") or {})


def check_event(wire: Wire, subject: str, body: dict, node: str, kind: str, t0: float, t1: float) -> None:
    """§3/§8: subject `<prefix>.events.resource.<node>.<kind>`; body `{type, time, ...}` where `type`
    is the last subject token and `time` unix seconds (float); the rest are the named fields."""
    assert subject == wire.subject(f"events.resource.{node}.{kind}")
    assert body["type"] == kind
    assert isinstance(body["time"], float) and t0 <= body["time"] <= t1
    assert body["nodename"] == node
    assert set(body) <= EVENT_FIELDS, body


def record_key(prefix: str, node: str) -> str:
    return f"{prefix}:allocation:{{node:{node}}}:node"


# -- §2 wire conventions ---------------------------------------------------------------------------


async def test_success_reply_is_the_response_map_and_unknown_keys_are_refused(wire):
    """§2: "Success: the reply is the response map." "Unknown keys ... are rejected with
    `invalid_argument` naming the field"; §8: "Unknown keys are refused at every level" (the top
    here, a plugin's map below and in TYPOS)."""
    held = await held_node(wire)
    plain = await wire.request("resource.calculate-deploy", deploy(held.node, BOUND_ONE))
    padded = await wire.request("resource.calculate-deploy", {
        **deploy(held.node, BOUND_ONE), "comment": [1, {"x": None}],
    })
    assert plain.ok and ERROR_HEADER not in plain.headers and isinstance(plain.body, dict)
    assert_error(padded, INVALID, "comment")
    typo = deploy(held.node, {"cpumem": {**BOUND, "colour": "red"}})
    inside = await wire.request("resource.calculate-deploy", typo)
    assert_error(inside, INVALID, f"{WRR}.cpumem.colour")


async def test_payload_map_keys_must_be_strings(wire):
    """§2: "Every payload is a MessagePack **map** with string keys"."""
    held = await held_node(wire)
    data = msgpack.packb({1: "one", "nodename": held.node, "deploy_count": 1})
    assert_error(await wire.request("resource.calculate-deploy", data), INVALID, "$")


async def test_events_stream_keeps_the_events_for_replay(wire, nc, namespace):
    """§2: "A JetStream stream ... keeps them for replay": change events in `<prefix>-events`, 24 h."""
    node = unique("replay")
    capture = await wire.capture(f"resource.{node}.*")
    try:
        await wire.ok("resource.add-node", {"nodename": node, "resource": full_resource()})
        await wire.ok("resource.set-node-labels", {"nodename": node, "labels": {"city": "sz"}})
        [placed] = await allocate(wire, node, BOUND_ONE)
        await wire.ok("resource.release", {"workload_ids": [placed["workload_id"]]})
        await wire.ok("resource.remove-node", {"nodename": node})
        live = list(await capture.wait_for(9))
    finally:
        await capture.close()
    kinds = [subject.rsplit(".", 1)[-1] for subject, _ in live]
    assert kinds == ["added"] * 3 + ["labels", "allocated", "released"] + ["removed"] * 3

    js = nc.jetstream()
    info = await js.stream_info(f"{namespace}-events")
    assert info.config.subjects == [f"{namespace}.events.resource.>"]  # the change events of this service
    subject = wire.subject(f"events.resource.{node}.>")
    sub = await js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        replayed = [await sub.next_msg(timeout=5) for _ in live]
    finally:
        await sub.unsubscribe()
    assert [(m.subject, msgpack.unpackb(m.data, strict_map_key=False)) for m in replayed] == live


# -- §8 All services -------------------------------------------------------------------------------

PLUGIN_COMMANDS = [
    "calculate-deploy", "calculate-realloc", "calculate-remap", "add-node", "remove-node",
    "get-nodes-deploy-capacity", "set-node-resource-capacity", "get-node-resource-info",
    "set-node-resource-info", "set-node-resource-usage", "get-most-idle-node", "fix-node-resource",
    "get-metrics-description", "get-metrics",
]
MANAGER_ONLY = [
    "allocate", "release", "realloc", "list-nodes", "get-allocations", "set-node-labels", "plugins",
    "node-heartbeat",
]


async def test_one_endpoint_per_command_and_srv_info_lists_every_subject(wire, nc, namespace):
    """§8: "Micro service names: `berth-allocation` ...; one endpoint per command (no wildcard
    endpoints), so `$SRV.INFO` lists every subject"."""
    msg = await nc.request(f"$SRV.INFO.{namespace}-allocation", b"", timeout=5)
    info = json.loads(msg.data)  # the NATS services API answers in JSON
    subjects = [endpoint["subject"] for endpoint in info["endpoints"]]
    expected = [wire.subject(f"resource.{c}") for c in PLUGIN_COMMANDS + MANAGER_ONLY]
    expected += [wire.subject(f"resource.{p}.{c}") for p in PLUGINS for c in PLUGIN_COMMANDS]
    assert sorted(subjects) == sorted(expected)
    assert not any("*" in s or ">" in s for s in subjects)
    assert info["name"] == f"{namespace}-allocation"  # `berth-allocation` under the default prefix


BAD_NAMES = ["a.b", "a*", "a>", "a b", "a\tb", "a%b", "", "ü", "a\n"]


def _named(command: str, plugin: str | None) -> Callable[[str], dict]:
    """A payload for `command` that is valid but for the node name under test."""
    resource = PLUGIN_RESOURCE[plugin] if plugin else full_resource()
    return {
        "calculate-deploy": lambda n: {"nodename": n, "deploy_count": 1},
        "calculate-realloc": lambda n: {"nodename": n, "workload_resource": {}},
        "calculate-remap": lambda n: {"nodename": n, "workloads_resource": {}},
        "add-node": lambda n: {"nodename": n, "resource": resource},
        "remove-node": lambda n: {"nodename": n},
        "set-node-resource-capacity": lambda n: {"nodename": n, "resource_request": {}, "delta": True},
        "get-node-resource-info": lambda n: {"nodename": n},
        "set-node-resource-info": lambda n: {"nodename": n, "capacity": {}, "usage": {}},
        "set-node-resource-usage": lambda n: {"nodename": n, "resource_request": {}, "delta": True},
        "fix-node-resource": lambda n: {"nodename": n},
        "get-metrics": lambda n: {"podname": "pod", "nodename": n},
        "get-allocations": lambda n: {"nodename": n},
        "set-node-labels": lambda n: {"nodename": n, "labels": {}},
        "allocate": lambda n: {"nodename": n, "deploy_count": 1},
    }[command]


NODENAME_COMMANDS = [
    c for c in PLUGIN_COMMANDS
    if c not in ("get-nodes-deploy-capacity", "get-most-idle-node", "get-metrics-description")
]
NAMED_SUBJECTS = [
    (f"resource.{p}.{c}" if p else f"resource.{c}", _named(c, p))
    for p in (None, *PLUGINS)
    for c in NODENAME_COMMANDS
] + [(f"resource.{c}", _named(c, None)) for c in ("get-allocations", "set-node-labels", "allocate")]


@pytest.mark.parametrize("subject,payload", NAMED_SUBJECTS, ids=[s for s, _ in NAMED_SUBJECTS])
async def test_node_name_is_a_subject_token_else_invalid_argument(wire, subject, payload):
    """§8: "Names used as subject tokens (node names, ...) match `[A-Za-z0-9_-]+`; anything else is
    `invalid_argument`" (a node name becomes the token of `events.resource.<node>.<kind>`)."""
    for name in BAD_NAMES:
        assert_error(await wire.request(subject, payload(name)), INVALID, "nodename")


async def test_a_bad_name_is_refused_in_words_not_with_a_regex(wire):
    """A refusal says what a name may hold, not the pattern that checks it (issue 20, item 8)."""
    for name in ("a.b", "a b", "ü", "a\n"):
        reply = await wire.request("resource.get-node-resource-info", {"nodename": name})
        assert_error(reply, INVALID, "nodename")
        assert reply.error["message"] == "nodename: must be letters, digits, '_' and '-' only"
    reply = await wire.request("resource.allocate", {"nodenames": ["a", "b"], "deploy_count": 1, "strategy": "fill"})
    assert_error(reply, INVALID, "strategy")
    assert reply.error["message"] == "strategy: must be spread, pack or each"


async def test_allocate_nodenames_entries_are_subject_tokens(wire):
    """§8: node names match `[A-Za-z0-9_-]+`, "anything else is `invalid_argument`": the entries of
    allocate's `nodenames` become event subject tokens too."""
    node = await new_node(wire)
    for name in BAD_NAMES:
        payload = {"nodenames": [node, name], "deploy_count": 1, "strategy": "spread"}
        assert_error(await wire.request("resource.allocate", payload), INVALID, "nodenames[1]")


# -- refusals: every error code, its status, body and field; bad input changes nothing -------------

M, CPU, STO, GPU_ = "resource.", "resource.cpumem.", "resource.storage.", "resource.gpu."
DEPLOY = "calculate-deploy"


@dataclass
class Refusal:
    id: str
    subject: str
    payload: Callable[[Held], Any]  # a map (sent with a request_id where the command takes one) or raw bytes
    code: str
    field: Any = ANY


R = Refusal


def _new(resource: dict, **extra: Any) -> Callable[[Held], dict]:
    """An add-node of a fresh node."""
    return lambda h: {"nodename": unique("x"), "resource": resource, **extra}


def _numa_without_core_1(_: Any = None) -> dict:
    """A cpumem record whose core 1 has no NUMA node."""
    return {
        "cpu": 2, "cpu_map": {"0": 100, "1": 100}, "memory": GiB,
        "numa_memory": {"0": GiB}, "numa": {"0": "0"},
    }


SHORT_NUMA = {"cpu": 2, "memory": "2G", "numa-cpu": ["0", "1"], "numa-memory": ["1G"]}

REFUSALS = [
    # §2 "missing required keys, wrong types, negative or NaN quantities are rejected with
    # `invalid_argument` naming the field"; §8 "Types are strict".
    R("missing-deploy_count", M + DEPLOY, lambda h: {"nodename": h.node}, INVALID, "deploy_count"),
    R("missing-nodename", M + "add-node", lambda h: {"resource": full_resource()}, INVALID, "nodename"),
    R("nodename-not-a-string", M + "get-node-resource-info", lambda h: {"nodename": 7}, INVALID, "nodename"),
    R("deploy_count-bool", M + DEPLOY, lambda h: deploy(h.node, None, True), INVALID, "deploy_count"),
    R("deploy_count-string", M + DEPLOY, lambda h: deploy(h.node, None, "1"), INVALID, "deploy_count"),
    R("deploy_count-negative", M + DEPLOY, lambda h: deploy(h.node, None, -1), INVALID, "deploy_count"),
    R("deploy_count-huge", M + DEPLOY, lambda h: deploy(h.node, None, 2**63), INVALID, "deploy_count"),
    R("cpu-request-string", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-request": "1"}), INVALID, f"{WRR}.cpu-request"),
    R("cpu-request-nan", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-request": math.nan}), INVALID, f"{WRR}.cpu-request"),
    R("cpu-request-inf", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-request": math.inf}), INVALID, f"{WRR}.cpu-request"),
    R("cpu-request-huge", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-request": 1e300}), INVALID, f"{WRR}.cpu-request"),
    R("cpu-request-negative", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-request": -1}), INVALID, f"{WRR}.cpu-request"),
    R("cpu-limit-nan-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"cpumem": {"cpu-limit": math.nan}}), INVALID, f"{WRR}.cpumem.cpu-limit"),
    R("memory-request-negative", CPU + DEPLOY,
      lambda h: deploy(h.node, {"memory-request": -1}), INVALID, f"{WRR}.memory-request"),
    R("memory-request-huge", CPU + DEPLOY,
      lambda h: deploy(h.node, {"memory-request": 2**64 - 1}), INVALID, f"{WRR}.memory-request"),
    R("memory-request-not-a-size", CPU + DEPLOY,
      lambda h: deploy(h.node, {"memory-request": "lots"}), INVALID, f"{WRR}.memory-request"),
    R("storage-request-negative", STO + DEPLOY,
      lambda h: deploy(h.node, {"storage-request": -1}), INVALID, f"{WRR}.storage-request"),
    R("storage-request-nan", STO + DEPLOY,
      lambda h: deploy(h.node, {"storage-request": math.nan}), INVALID, f"{WRR}.storage-request"),
    R("gpu-count-negative", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"prod_count_map": {GPU: -1}}), INVALID, f"{WRR}.prod_count_map.{GPU}"),
    R("cpu-bind-null", CPU + DEPLOY,
      lambda h: deploy(h.node, {**BOUND, "cpu-bind": None}), INVALID, f"{WRR}.cpu-bind"),
    R("keep-cpu-bind-null", CPU + "calculate-realloc",
      lambda h: h.realloc("cpumem", {"keep-cpu-bind": None}), INVALID, f"{WRR}.keep-cpu-bind"),
    R("delta-null", M + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"cpumem": {"memory": "1G"}}, "delta": None},
      INVALID, "delta"),
    R("delta-string", CPU + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"memory": "1G"}, "delta": "true"},
      INVALID, "delta"),
    R("incr-null", M + "set-node-resource-usage",
      lambda h: {**_memory_delta(h.node, 1), "incr": None},
      INVALID, "incr"),
    R("node-cpu-string", CPU + "add-node", _new({"cpu": "4", "memory": "1G"}), INVALID, "resource.cpu"),
    R("node-cpu-fraction", CPU + "add-node", _new({"cpu": 1.5, "memory": "1G"}), INVALID, "resource.cpu"),
    R("node-memory-fraction", CPU + "add-node", _new({"cpu": 1, "memory": 1024.5}), INVALID, "resource.memory"),
    R("node-memory-negative", CPU + "add-node", _new({"cpu": 1, "memory": -5}), INVALID, "resource.memory"),
    R("malformed-msgpack", M + DEPLOY, lambda h: b"\xc1", INVALID, "$"),
    R("truncated-msgpack", M + DEPLOY, lambda h: msgpack.packb(deploy(h.node, None))[:-3], INVALID, "$"),
    R("payload-not-a-map", M + DEPLOY, lambda h: msgpack.packb([h.node, 1]), INVALID, "$"),
    R("empty-payload", M + DEPLOY, lambda h: b"", INVALID, "$"),
    R("info-ncpu-string", M + "add-node",
      lambda h: {"nodename": unique("x"), "info": {"ncpu": "4", "memory_total": GiB}}, INVALID, "info.ncpu"),
    R("info-resources-json-bytes", M + "add-node",
      lambda h: {"nodename": unique("x"), "info": {"ncpu": 1, "resources": b'{"gpu": {}}'}},
      INVALID, "info.resources"),
    # §8 "Sending both `nodename` and `nodenames` is `invalid_argument`"; the other manager keys.
    R("nodename-and-nodenames", M + "allocate",
      lambda h: {"nodename": h.node, "nodenames": [h.node], "deploy_count": 1}, INVALID, "nodename"),
    R("strategy-unknown", M + "allocate",
      lambda h: {"nodenames": [h.node], "strategy": "random", "deploy_count": 1}, INVALID, "strategy"),
    R("strategy-trailing-newline", M + "allocate",
      lambda h: {"nodenames": [h.node], "strategy": "pack\n", "deploy_count": 1}, INVALID, "strategy"),
    R("workload_ids-count", M + "allocate",
      lambda h: {**deploy(h.node, {}), "workload_ids": ["w-a", "w-b"]}, INVALID, "workload_ids"),
    R("release-empty", M + "release", lambda h: {"workload_ids": []}, INVALID, "workload_ids"),
    R("release-not-a-list", M + "release", lambda h: {"workload_ids": h.wid}, INVALID, "workload_ids"),
    R("labels-not-a-map", M + "set-node-labels",
      lambda h: {"nodename": h.node, "labels": ["a"]}, INVALID, "labels"),
    R("list-nodes-limit-1001", M + "list-nodes", lambda h: {"limit": 1001}, INVALID, "limit"),
    R("list-nodes-limit-0", M + "list-nodes", lambda h: {"limit": 0}, INVALID, "limit"),
    R("list-nodes-offset-negative", M + "list-nodes", lambda h: {"offset": -1}, INVALID, "offset"),
    # §2 the field of a bad map value is named by its key, never msgspec's `[...]` placeholder.
    R("labels-value-not-a-string", M + "set-node-labels",
      lambda h: {"nodename": h.node, "labels": {"a": "x", "b": 1}}, INVALID, "labels.b"),
    R("cpu_map-value-not-a-number-plugin", CPU + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {"cpu": 2.0, "cpu_map": {"0": 100, "1": "x"}}, "usage": {}},
      INVALID, "capacity.cpu_map.1"),
    R("cpu_map-value-not-a-number-manager", M + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {"cpumem": {"cpu": 1.0, "cpu_map": {"0": "x"}}}, "usage": {}},
      INVALID, "capacity.cpumem.cpu_map.0"),
    R("volume-size-not-a-number-manager", M + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {"storage": {"volumes": {"/data": [1]}}}, "usage": {}},
      INVALID, "capacity.storage.volumes./data"),
    # §8 "malformed gpu maps, IO parameters and disks are `invalid_argument` naming the field".
    R("gpu-count-not-a-number", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"prod_count_map": {GPU: "1"}}), INVALID, f"{WRR}.prod_count_map.{GPU}"),
    R("gpu-map-not-a-map", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"prod_count_map": [GPU]}), INVALID, f"{WRR}.prod_count_map"),
    R("gpu-product-blank", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"prod_count_map": {" ": 1}}), INVALID, f"{WRR}.prod_count_map"),
    R("io-parameter-negative", STO + DEPLOY,
      lambda h: deploy(h.node, {"volumes": ["AUTO:/x:rw:1G:-1"]}), INVALID, f"{WRR}.volumes[0]"),
    R("disk-malformed", STO + "add-node", _new({"disks": ["sda:/:1:2:3"]}), INVALID, "resource.disks[0]"),
    # §2 codes `invalid_cpu` ... `invalid_storage`, plugin level and manager level.
    R("invalid_cpu-bind-without-request-plugin", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu-bind": True}), "invalid_cpu", f"{WRR}.cpu-request"),
    R("invalid_cpu-bind-without-request-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"cpumem": {"cpu-bind": True}}), "invalid_cpu", f"{WRR}.cpumem.cpu-request"),
    R("invalid_cpu-realloc-below-zero-plugin", CPU + "calculate-realloc",
      lambda h: h.realloc("cpumem", {"keep-cpu-bind": True, "cpu-request": -2}),
      "invalid_cpu", f"{WRR}.cpu-request"),
    R("invalid_cpu-realloc-below-zero-manager", M + "realloc",
      lambda h: h.realloc_all({"cpumem": {"keep-cpu-bind": True, "cpu-request": -2}}),
      "invalid_cpu", f"{WRR}.cpumem.cpu-request"),
    R("invalid_memory-realloc-below-zero-plugin", CPU + "calculate-realloc",
      lambda h: h.realloc("cpumem", {"keep-cpu-bind": True, "memory-request": -2 * GiB}),
      "invalid_memory", f"{WRR}.memory-request"),
    R("invalid_memory-realloc-below-zero-manager", M + "realloc",
      lambda h: h.realloc_all({"cpumem": {"keep-cpu-bind": True, "memory-request": "-2G"}}),
      "invalid_memory", f"{WRR}.cpumem.memory-request"),
    R("invalid_memory-capacity-below-zero-plugin", CPU + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"memory": "-100G"}, "delta": True},
      "invalid_memory", "capacity.memory"),
    R("invalid_memory-capacity-below-zero-manager", M + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"cpumem": {"memory": "-100G"}}, "delta": True},
      "invalid_memory", "capacity.cpumem.memory"),
    R("invalid_cpu_map-no-cores-plugin", CPU + "add-node",
      _new({"memory": "1G"}), "invalid_cpu_map", "resource.cpu"),
    R("invalid_cpu_map-no-cores-manager", M + "add-node",
      _new({"cpumem": {"memory": "1G"}}), "invalid_cpu_map", "resource.cpumem.cpu"),
    R("invalid_cpu_map-usage-beyond-capacity", CPU + "set-node-resource-usage",
      lambda h: {"nodename": h.node, "resource_request": {"cpu": "0:200"}},
      "invalid_cpu_map", "usage.cpu_map.0"),
    R("invalid_numa_cpu-plugin", CPU + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": _numa_without_core_1(), "usage": {}},
      "invalid_numa_cpu", "capacity.numa"),
    R("invalid_numa_cpu-manager", M + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {"cpumem": _numa_without_core_1()}, "usage": {}},
      "invalid_numa_cpu", "capacity.cpumem.numa"),
    R("invalid_numa_memory-plugin", CPU + "add-node",
      _new(SHORT_NUMA), "invalid_numa_memory", "resource.numa-memory"),
    R("invalid_numa_memory-manager", M + "add-node",
      _new({"cpumem": SHORT_NUMA}), "invalid_numa_memory", "resource.cpumem.numa-memory"),
    R("invalid_volume-plugin", STO + DEPLOY,
      lambda h: deploy(h.node, {"volumes": ["bad::::"]}), "invalid_volume", f"{WRR}.volumes[0]"),
    R("invalid_volume-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"storage": {"volumes": ["bad::::"]}}), "invalid_volume", f"{WRR}.storage.volumes[0]"),
    R("invalid_volume-node-request", STO + "add-node",
      _new({"volumes": ["sda"]}), "invalid_volume", "resource.volumes[0]"),
    R("storage-request-not-a-size-plugin", STO + DEPLOY,
      lambda h: deploy(h.node, {"storage-request": "lots"}), INVALID, f"{WRR}.storage-request"),
    R("storage-request-not-a-size-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"storage": {"storage-request": "lots"}}), INVALID, f"{WRR}.storage.storage-request"),
    R("invalid_storage-usage-beyond-capacity-plugin", STO + "set-node-resource-usage",
      lambda h: {"nodename": h.node, "resource_request": {"storage": "500G"}}, "invalid_storage", "usage.storage"),
    R("invalid_storage-usage-beyond-capacity-manager", M + "set-node-resource-usage",
      lambda h: {"nodename": h.node, "resource_request": {"storage": {"storage": "500G"}}},
      "invalid_storage", "usage.storage.storage"),
    R("invalid_storage-realloc-below-zero", M + "realloc",
      lambda h: h.realloc_all({"storage": {"storage-request": "-1T"}}), "invalid_storage", f"{WRR}.storage.storage-request"),
    # §8 "a missing node is `node_not_found`"; 404 `*_not_found`, `plugin_not_found`.
    R("node_not_found-plugin", CPU + "get-node-resource-info",
      lambda h: {"nodename": GHOST}, "node_not_found", "nodename"),
    R("node_not_found-manager", M + "get-node-resource-info",
      lambda h: {"nodename": GHOST}, "node_not_found", "nodename"),
    R("node_not_found-deploy", M + DEPLOY, lambda h: deploy(GHOST, BOUND_ONE), "node_not_found", "nodename"),
    R("node_not_found-allocate", M + "allocate",
      lambda h: deploy(GHOST, BOUND_ONE), "node_not_found", "nodename"),
    R("node_not_found-labels", M + "set-node-labels",
      lambda h: {"nodename": GHOST, "labels": {}}, "node_not_found", "nodename"),
    R("node_not_found-allocations", M + "get-allocations",
      lambda h: {"nodename": GHOST}, "node_not_found", "nodename"),
    R("node_not_found-capacity-list", M + "get-nodes-deploy-capacity",
      lambda h: {"nodenames": [h.node, GHOST]}, "node_not_found"),
    R("node_not_found-most-idle", M + "get-most-idle-node",
      lambda h: {"nodenames": [h.node, GHOST]}, "node_not_found"),
    R("plugin_not_found-request", M + DEPLOY,
      lambda h: deploy(h.node, {"tpu": {}}), "plugin_not_found", f"{WRR}.tpu"),
    R("plugin_not_found-resource", M + "add-node",
      _new({**full_resource(), "tpu": {}}), "plugin_not_found", "resource.tpu"),
    R("workload_not_found", M + "realloc",
      lambda h: {"workload_id": "no-such-workload"}, "workload_not_found", "workload_id"),
    # 409 `*_exists`, `node_not_empty`.
    R("node_exists-plugin", CPU + "add-node",
      lambda h: {"nodename": h.node, "resource": PLUGIN_RESOURCE["cpumem"]}, "node_exists", "nodename"),
    R("node_exists-manager", M + "add-node",
      lambda h: {"nodename": h.node, "resource": full_resource()}, "node_exists", "nodename"),
    R("node_not_empty", M + "remove-node", lambda h: {"nodename": h.node}, "node_not_empty", "nodename"),
    R("workload_exists", M + "allocate",
      lambda h: {**deploy(h.node, {}), "workload_ids": [h.wid]}, "workload_exists", "workload_ids"),
    # §8 "eru's split is kept: deploy and unbound realloc fail with `insufficient_capacity`, ...".
    R("insufficient_capacity-deploy-plugin", CPU + DEPLOY,
      lambda h: deploy(h.node, BOUND, 2), "insufficient_capacity"),
    R("insufficient_capacity-deploy-manager", M + DEPLOY,
      lambda h: deploy(h.node, BOUND_ONE, 2), "insufficient_capacity"),
    R("insufficient_capacity-allocate", M + "allocate",
      lambda h: deploy(h.node, BOUND_ONE, 2), "insufficient_capacity"),
    R("insufficient_capacity-unbound-deploy-memory", CPU + DEPLOY,
      lambda h: deploy(h.node, {"memory-request": "4G"}), "insufficient_capacity"),
    R("insufficient_capacity-unbound-realloc-plugin", CPU + "calculate-realloc",
      lambda h: h.realloc("cpumem", {"memory-request": "10G"}), "insufficient_capacity"),
    R("insufficient_capacity-unbound-realloc-manager", M + "realloc",
      lambda h: h.realloc_all({"cpumem": {"memory-request": "10G"}}), "insufficient_capacity"),
    # "... bound realloc, storage and gpu with `insufficient_resource`".
    R("insufficient_resource-bound-realloc-plugin", CPU + "calculate-realloc",
      lambda h: h.realloc("cpumem", {"keep-cpu-bind": True, "cpu-request": 5}), "insufficient_resource"),
    R("insufficient_resource-bound-realloc-manager", M + "realloc",
      lambda h: h.realloc_all({"cpumem": {"keep-cpu-bind": True, "cpu-request": 5}}),
      "insufficient_resource"),
    R("insufficient_resource-storage-realloc-plugin", STO + "calculate-realloc",
      lambda h: h.realloc("storage", {"volumes": ["AUTO:/v:rw:500G"]}), "insufficient_resource"),
    R("insufficient_resource-storage-realloc-manager", M + "realloc",
      lambda h: h.realloc_all({"storage": {"volumes": ["AUTO:/v:rw:500G"]}}), "insufficient_resource"),
    R("insufficient_resource-gpu-realloc-plugin", GPU_ + "calculate-realloc",
      lambda h: h.realloc("gpu", {"prod_count_map": {GPU: 5}}), "insufficient_resource"),
    R("insufficient_resource-gpu-realloc-manager", M + "realloc",
      lambda h: h.realloc_all({"gpu": {"prod_count_map": {GPU: 5}}}), "insufficient_resource"),
    R("insufficient_resource-storage-deploy-plugin", STO + DEPLOY,
      lambda h: deploy(h.node, {"storage-request": "1T"}), "insufficient_resource"),
    R("insufficient_resource-storage-deploy-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"storage": {"storage-request": "1T"}}), "insufficient_resource"),
    R("insufficient_resource-storage-allocate", M + "allocate",
      lambda h: deploy(h.node, {"storage": {"storage-request": "1T"}}), "insufficient_resource"),
    R("insufficient_resource-volume-plans-plugin", STO + DEPLOY,
      lambda h: deploy(h.node, {"volumes": ["AUTO:/x:rw:200G"]}), "insufficient_resource"),
    R("insufficient_resource-volume-plans-allocate", M + "allocate",
      lambda h: deploy(h.node, {"storage": {"volumes": ["AUTO:/x:rw:200G"]}}), "insufficient_resource"),
    R("insufficient_resource-gpu-deploy-plugin", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"prod_count_map": {GPU: 1}}, 2), "insufficient_resource"),
    R("insufficient_resource-gpu-deploy-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"gpu": {"prod_count_map": {GPU: 1}}}, 2), "insufficient_resource"),
    R("insufficient_resource-gpu-allocate", M + "allocate",
      lambda h: deploy(h.node, {"gpu": {"prod_count_map": {GPU: 1}}}, 2), "insufficient_resource"),
]


# §8 (pinned for the next work): "Unknown keys inside a plugin's maps (`workload_resource_request`,
# `resource`, `capacity`, `usage`, node `info.resources`) are `invalid_argument` naming the key, with the
# accepted keys in the message: a typo must never place an empty workload or register an empty node."
CPUMEM_NODE = {"cpu": 2, "cpu_map": {"0": 100, "1": 100}, "memory": GiB}
TYPOS = [
    R("typo-cpumem-request-plugin", CPU + DEPLOY,
      lambda h: deploy(h.node, {"cpu_request": 1}), INVALID, f"{WRR}.cpu_request"),
    R("typo-cpumem-request-manager", M + DEPLOY,
      lambda h: deploy(h.node, {"cpumem": {"cpu_request": 1}}), INVALID, f"{WRR}.cpumem.cpu_request"),
    R("typo-cpumem-allocate", M + "allocate",
      lambda h: deploy(h.node, {"cpumem": {"cpu-bind": True, "cpu_request": 1}}), INVALID,
      f"{WRR}.cpumem.cpu_request"),
    R("typo-cpumem-realloc", M + "realloc",
      lambda h: h.realloc_all({"cpumem": {"memory_request": "1G"}}), INVALID, f"{WRR}.cpumem.memory_request"),
    R("typo-storage-request-manager", M + "allocate",
      lambda h: deploy(h.node, {"storage": {"volume_request": ["AUTO:/v:rw:1G"]}}), INVALID,
      f"{WRR}.storage.volume_request"),
    R("typo-storage-request-plugin", STO + DEPLOY,
      lambda h: deploy(h.node, {"storage_request": "1G"}), INVALID, f"{WRR}.storage_request"),
    R("typo-gpu-request-manager", M + "allocate",
      lambda h: deploy(h.node, {"gpu": {"prod_count": {GPU: 1}}}), INVALID, f"{WRR}.gpu.prod_count"),
    R("typo-gpu-request-plugin", GPU_ + DEPLOY,
      lambda h: deploy(h.node, {"count": 1}), INVALID, f"{WRR}.count"),
    R("typo-add-node-resource", M + "add-node",
      _new({**full_resource(), "cpumem": {"cpu": 2, "memroy": "4G"}}), INVALID, "resource.cpumem.memroy"),
    R("typo-add-node-resource-storage", M + "add-node",
      _new({**full_resource(), "storage": {"volume": ["/data:100G"]}}), INVALID, "resource.storage.volume"),
    R("typo-add-node-resource-plugin", GPU_ + "add-node",
      _new({"prod_count_maps": {GPU: 2}}), INVALID, "resource.prod_count_maps"),
    R("typo-add-node-info-resources", M + "add-node",
      lambda h: {"nodename": unique("x"), "info": {"resources": {"cpumem": {**CPUMEM_NODE, "numa_mem": {}}}}},
      INVALID, "info.resources.cpumem.numa_mem"),
    R("typo-add-node-info-resources-storage", M + "add-node",
      lambda h: {"nodename": unique("x"),
                 "info": {"resources": {"storage": {"volumes": {"/d": GiB}, "storge": 1}}}},
      INVALID, "info.resources.storage.storge"),
    R("typo-add-node-info-plugin", M + "add-node",
      lambda h: {"nodename": unique("x"), "info": {"ncpu": 2, "resources": {"cpu_mem": CPUMEM_NODE}}},
      INVALID, "info.resources.cpu_mem"),
    R("typo-set-capacity-request", M + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"cpumem": {"cpus": 4}}}, INVALID,
      "resource_request.cpumem.cpus"),
    R("typo-set-capacity-request-plugin", STO + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource_request": {"volume": ["/more:1G"]}}, INVALID,
      "resource_request.volume"),
    R("typo-set-capacity-resource", M + "set-node-resource-capacity",
      lambda h: {"nodename": h.node, "resource": {"cpumem": {**CPUMEM_NODE, "numa_memroy": {}}}}, INVALID,
      "resource.cpumem.numa_memroy"),
    R("typo-set-capacity-resource-nested", M + "set-node-resource-capacity",
      lambda h: {"nodename": h.node,
                 "resource": {"storage": {"disks": [{"device": "/dev/a", "read_iops": 1}]}}},
      INVALID, "resource.storage.disks[0].read_iops"),
    R("typo-set-usage-request", M + "set-node-resource-usage",
      lambda h: {"nodename": h.node, "resource_request": {"gpu": {"prod_count_mapp": {GPU: 1}}}}, INVALID,
      "resource_request.gpu.prod_count_mapp"),
    R("typo-set-info-capacity", CPU + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {**CPUMEM_NODE, "mem": 1}, "usage": {}}, INVALID,
      "capacity.mem"),
    R("typo-set-info-usage", M + "set-node-resource-info",
      lambda h: {"nodename": h.node, "capacity": {"gpu": {"prod_count_map": {GPU: 2}}},
                 "usage": {"gpu": {"prod_count_map": {}, "x": 1}}}, INVALID, "usage.gpu.x"),
    R("typo-workloads-resource", M + "fix-node-resource",
      lambda h: {"nodename": h.node, "workloads_resource": [{"cpumem": {"cpu_requests": 1}}]}, INVALID,
      "workloads_resource[0].cpumem.cpu_requests"),
    R("typo-workload-resource-realloc", CPU + "calculate-realloc",
      lambda h: {**h.realloc("cpumem", {}), "workload_resource": {"cpu_requets": 1}}, INVALID,
      "workload_resource.cpu_requets"),
    # A manager-level add-node without `resource` or `info` would register a node with no capacity.
    R("add-node-without-resource-or-info", M + "add-node", lambda h: {"nodename": unique("x")}, INVALID,
      "resource"),
    # §8: "Unknown keys are refused at every level": the top of any request, and its nested maps.
    R("typo-top-add-node-resources", M + "add-node",
      lambda h: {"nodename": unique("x"), "resources": full_resource()}, INVALID, "resources"),
    R("typo-top-add-node-labels", M + "add-node",
      lambda h: {"nodename": unique("x"), "resource": full_resource(), "lables": {"pool": "a"}}, INVALID,
      "lables"),
    R("typo-top-add-node-info", M + "add-node",
      lambda h: {"nodename": unique("x"), "info": {"ncpu": 2, "memory_totl": GiB}}, INVALID,
      "info.memory_totl"),
    R("typo-top-allocate-nodenames", M + "allocate",
      lambda h: {"nodesnames": [h.node], "deploy_count": 1}, INVALID, "nodesnames"),
    R("typo-top-allocate-request-id", M + "allocate",
      lambda h: {**deploy(h.node, BOUND_ONE), "requestId": unique("rid")}, INVALID, "requestId"),
    R("typo-top-plugin-deploy", CPU + DEPLOY,
      lambda h: {**deploy(h.node, {}), "deploy_cont": 2}, INVALID, "deploy_cont"),
    R("typo-top-release", M + "release", lambda h: {"workload_ids": ["w"], "workloadids": []}, INVALID,
      "workloadids"),
]
REFUSALS += TYPOS


@pytest.mark.parametrize("case", REFUSALS, ids=[r.id for r in REFUSALS])
async def test_refusal_has_its_status_code_and_field_and_changes_nothing(wire, redis, namespace, case):
    """§2 error shape and codes; §8 statuses (400 `invalid_*`, 404 `*_not_found`, 409 conflicts);
    a refused request changes no record, ledger or listing, stores no success, publishes nothing."""
    held = await held_node(wire)
    payload = case.payload(held)
    request_id = unique("rid")
    if isinstance(payload, dict) and case.subject in {change.subject for change in CHANGES}:
        payload = {**payload, "request_id": request_id}  # only commands that change state take one
    async with changes_nothing(wire, held.node):
        reply = await wire.request(case.subject, payload)
    assert_error(reply, case.code, case.field)
    assert not [stored for stored in await stored_replies(redis, namespace, request_id) if is_success(stored)]


@pytest.mark.parametrize("case", TYPOS, ids=[r.id for r in TYPOS])
async def test_a_typo_is_named_with_the_accepted_keys_and_creates_no_node(wire, case):
    """§8: a typo is `invalid_argument` "naming the key, with the accepted keys in the message"; a
    refused add-node registers no node (the table above checks that nothing else changed)."""
    held = await held_node(wire)
    payload = case.payload(held)
    async with changes_nothing(wire, held.node):
        reply = await wire.request(case.subject, payload)
    assert_error(reply, case.code, case.field)
    message = reply.error["message"]
    if case.field == "resource":
        assert "needs `resource`" in message and "or `info`" in message
    else:
        key = case.field.rsplit(".", 1)[-1]
        what = "plugin" if case.id == "typo-add-node-info-plugin" else "key"
        assert f"unknown {what} {key!r}; accepted: " in message
        assert reply.details["accepted"] and ", ".join(reply.details["accepted"]) in message
    if payload.get("nodename", held.node) != held.node:
        gone = await wire.request("resource.get-node-resource-info", {"nodename": payload["nodename"]})
        assert_error(gone, "node_not_found", "nodename")


async def test_unknown_plugin_in_a_keyed_map_is_named_with_the_plugins(wire):
    """§8 (`plugin_not_found`, kept): `{"cpu_mem": ...}` names the key and lists the plugins."""
    held = await held_node(wire)
    async with changes_nothing(wire, held.node):
        reply = await wire.request("resource.allocate", deploy(held.node, {"cpu_mem": {"cpu-request": 1}}))
    assert_error(reply, "plugin_not_found", f"{WRR}.cpu_mem")
    assert "unknown plugin 'cpu_mem'; accepted: cpumem, storage, gpu" in reply.error["message"]


async def test_node_not_found_when_one_plugin_lacks_the_node(wire):
    """§8: "a missing node is `node_not_found`", at manager level also when one plugin has no record."""
    node = unique("partial")
    await wire.ok("resource.cpumem.add-node", {"nodename": node, "resource": PLUGIN_RESOURCE["cpumem"]})
    async with changes_nothing(wire, node):
        reply = await wire.request("resource.calculate-deploy", deploy(node, BOUND_ONE))
    assert_error(reply, "node_not_found", "nodename")


async def test_plugin_level_remove_node_does_not_look_at_the_ledger(wire):
    """§8: "Manager `remove-node` refuses a node whose ledger is not empty (`node_not_empty`);
    plugin-level `remove-node` does not look at the ledger"."""
    held = await held_node(wire)
    refused = await wire.request("resource.remove-node", {"nodename": held.node})
    assert_error(refused, "node_not_empty", "nodename")
    assert await wire.ok("resource.gpu.remove-node", {"nodename": held.node}) == {}
    gone = await wire.request("resource.gpu.get-node-resource-info", {"nodename": held.node})
    assert_error(gone, "node_not_found", "nodename")
    cpumem = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": held.node})
    assert cpumem["usage"]["cpu"] == 1


# -- §2 request_id on every state-changing command ----------------------------------------------------


@dataclass
class Change:
    """A state-changing command and what the request_id tests need of it."""

    id: str
    subject: str
    prepare: Callable[[Wire], Awaitable[dict]]  # a context: "node" (the node the request touches), ...
    payload: Callable[[dict], dict]  # succeeds and changes state
    variant: Callable[[dict], dict]  # another payload
    failing: Callable[[dict], dict] | None = None  # fails with an error that is stored (not `internal`)
    unblock: Callable[[Wire, dict], Awaitable[Any]] | None = None  # after it, `failing` would succeed
    watched: tuple[str, ...] = ("node",)  # context keys of the nodes a replay must not change


async def _node_and_missing(wire: Wire) -> dict:
    return {"node": await new_node(wire), "blocked": unique("blocked")}


async def _add_blocked(wire: Wire, ctx: dict) -> None:
    await wire.ok("resource.add-node", {"nodename": ctx["blocked"], "resource": full_resource()})


def _add_blocked_to(plugin: str) -> Callable[[Wire, dict], Awaitable[Any]]:
    return lambda w, c: w.ok(
        f"resource.{plugin}.add-node", {"nodename": c["blocked"], "resource": PLUGIN_RESOURCE[plugin]}
    )


async def _prepare_add(wire: Wire) -> dict:
    return {"node": unique("new"), "blocked": await new_node(wire)}


async def _prepare_remove(wire: Wire) -> dict:
    busy = await held_node(wire)
    node, other = await new_node(wire), await new_node(wire)
    return {"node": node, "other": other, "blocked": busy.node, "wid": busy.wid}


async def _prepare_info(wire: Wire) -> dict:
    node = await new_node(wire)
    info = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    return {"node": node, "capacity": info["capacity"], "usage": info["usage"]}


async def _prepare_drift(wire: Wire) -> dict:
    ctx = await _node_and_missing(wire)
    await wire.ok("resource.set-node-resource-usage", _memory_delta(ctx["node"], 1))
    return ctx


async def _prepare_allocate(wire: Wire) -> dict:
    return {"node": await new_node(wire), "blocked": await new_node(wire)}


async def _prepare_release(wire: Wire) -> dict:
    node = await new_node(wire)
    first, second = await allocate(wire, node, BOUND_ONE, 2)
    return {"node": node, "first": first["workload_id"], "second": second["workload_id"]}


async def _prepare_realloc(wire: Wire) -> dict:
    held = await held_node(wire)
    return {"node": held.node, "wid": held.wid, "blocked": unique("wl")}


def _memory_delta(node: str, gib: int) -> dict:
    request = {"cpumem": {"memory": f"{gib}G"}}
    return {"nodename": node, "resource_request": request, "delta": True, "incr": True}


def _more_memory(ctx: dict, gib: int) -> dict:
    cpumem = ctx["capacity"]["cpumem"]
    capacity = {**ctx["capacity"], "cpumem": {**cpumem, "memory": cpumem["memory"] + gib * GiB}}
    return {"nodename": ctx["node"], "capacity": capacity, "usage": ctx["usage"]}


def _realloc_memory(wid: str, gib: int) -> dict:
    return {"workload_id": wid, WRR: {"cpumem": {"keep-cpu-bind": True, "memory-request": gib * GiB}}}


def _labels(node: str, role: str) -> dict:
    return {"nodename": node, "labels": {"role": role}}


MANAGER_CHANGES = [
    Change("add-node", "resource.add-node", _prepare_add,
           lambda c: {"nodename": c["node"], "resource": full_resource()},
           lambda c: {"nodename": c["node"], "resource": full_resource(cpu=3)},
           lambda c: {"nodename": c["blocked"], "resource": full_resource()},
           lambda w, c: w.ok("resource.remove-node", {"nodename": c["blocked"]}), ("node", "blocked")),
    Change("remove-node", "resource.remove-node", _prepare_remove,
           lambda c: {"nodename": c["node"]}, lambda c: {"nodename": c["other"]},
           lambda c: {"nodename": c["blocked"]},
           lambda w, c: w.ok("resource.release", {"workload_ids": [c["wid"]]}), ("node", "other", "blocked")),
    Change("set-node-resource-capacity", "resource.set-node-resource-capacity", _node_and_missing,
           lambda c: _memory_delta(c["node"], 1), lambda c: _memory_delta(c["node"], 2),
           lambda c: _memory_delta(c["blocked"], 1), _add_blocked, ("node", "blocked")),
    # set-node-resource-info creates what is missing: it fails only on malformed input, which is
    # not kept (test_request_id_malformed_request_is_not_kept).
    Change("set-node-resource-info", "resource.set-node-resource-info", _prepare_info,
           lambda c: _more_memory(c, 1), lambda c: _more_memory(c, 2)),
    Change("set-node-resource-usage", "resource.set-node-resource-usage", _node_and_missing,
           lambda c: _memory_delta(c["node"], 1), lambda c: _memory_delta(c["node"], 2),
           lambda c: _memory_delta(c["blocked"], 1), _add_blocked, ("node", "blocked")),
    Change("fix-node-resource", "resource.fix-node-resource", _prepare_drift,
           lambda c: {"nodename": c["node"]}, lambda c: {"nodename": c["node"], "workloads_resource": []},
           lambda c: {"nodename": c["blocked"]}, _add_blocked, ("node", "blocked")),
    Change("allocate", "resource.allocate", _prepare_allocate,
           lambda c: deploy(c["node"], BOUND_ONE), lambda c: deploy(c["node"], BOUND_ONE, 2),
           lambda c: deploy(c["blocked"], BOUND_ONE, 3),
           lambda w, c: w.ok("resource.set-node-resource-capacity",
                             {"nodename": c["blocked"], "resource_request": {"cpumem": {"cpu": 4}}}),
           ("node", "blocked")),
    Change("release", "resource.release", _prepare_release,
           lambda c: {"workload_ids": [c["first"]]}, lambda c: {"workload_ids": [c["second"]]}),
    Change("realloc", "resource.realloc", _prepare_realloc,
           lambda c: _realloc_memory(c["wid"], 1), lambda c: _realloc_memory(c["wid"], 2),
           lambda c: _realloc_memory(c["blocked"], 1),
           lambda w, c: allocate(w, c["node"], {}, workload_ids=[c["blocked"]])),
    Change("set-node-labels", "resource.set-node-labels", _node_and_missing,
           lambda c: _labels(c["node"], "a"), lambda c: _labels(c["node"], "b"),
           lambda c: _labels(c["blocked"], "a"), _add_blocked, ("node", "blocked")),
]

PLUGIN_DELTA = {
    "cpumem": lambda n: {"memory": f"{n}G"},
    "storage": lambda n: {"storage": f"{n}G"},
    "gpu": lambda n: {"prod_count_map": {GPU: n}},
}
OTHER_RESOURCE = {
    "cpumem": {"cpu": 3, "memory": "4G"},
    "storage": {"storage": "300G"},
    "gpu": {"prod_count_map": {GPU: 3}},
}


def _grown(plugin: str, capacity: dict, n: int) -> dict:
    if plugin == "cpumem":
        return {**capacity, "memory": capacity["memory"] + n * GiB}
    if plugin == "storage":
        return {**capacity, "storage": capacity["storage"] + n * GiB}
    return {"prod_count_map": {GPU: capacity["prod_count_map"][GPU] + n}}


def _plugin_changes(p: str) -> list[Change]:
    at = f"resource.{p}."

    def delta(node: str, n: int) -> dict:
        return {"nodename": node, "resource_request": PLUGIN_DELTA[p](n), "delta": True, "incr": True}

    def grown(ctx: dict, n: int) -> dict:
        return {"nodename": ctx["node"], "capacity": _grown(p, ctx["capacity"], n), "usage": ctx["usage"]}

    async def prepare_info(wire: Wire) -> dict:
        node = await new_node(wire)
        info = await wire.ok(at + "get-node-resource-info", {"nodename": node})
        return {"node": node, "capacity": info["capacity"], "usage": info["usage"]}

    async def prepare_drift(wire: Wire) -> dict:
        ctx = await _node_and_missing(wire)
        await wire.ok(at + "set-node-resource-usage", delta(ctx["node"], 1))
        return ctx

    async def prepare_remove(wire: Wire) -> dict:
        return {"node": await new_node(wire), "other": await new_node(wire)}

    return [
        Change(f"{p}.add-node", at + "add-node", _prepare_add,
               lambda c: {"nodename": c["node"], "resource": PLUGIN_RESOURCE[p]},
               lambda c: {"nodename": c["node"], "resource": OTHER_RESOURCE[p]},
               lambda c: {"nodename": c["blocked"], "resource": PLUGIN_RESOURCE[p]},
               lambda w, c: w.ok(at + "remove-node", {"nodename": c["blocked"]}), ("node", "blocked")),
        Change(f"{p}.remove-node", at + "remove-node", prepare_remove,
               lambda c: {"nodename": c["node"]}, lambda c: {"nodename": c["other"]},
               watched=("node", "other")),
        Change(f"{p}.set-node-resource-capacity", at + "set-node-resource-capacity", _node_and_missing,
               lambda c: delta(c["node"], 1), lambda c: delta(c["node"], 2), lambda c: delta(c["blocked"], 1),
               _add_blocked_to(p), ("node", "blocked")),
        Change(f"{p}.set-node-resource-info", at + "set-node-resource-info", prepare_info,
               lambda c: grown(c, 1), lambda c: grown(c, 2)),
        Change(f"{p}.set-node-resource-usage", at + "set-node-resource-usage", _node_and_missing,
               lambda c: delta(c["node"], 1), lambda c: delta(c["node"], 2), lambda c: delta(c["blocked"], 1),
               _add_blocked_to(p), ("node", "blocked")),
        Change(f"{p}.fix-node-resource", at + "fix-node-resource", prepare_drift,
               lambda c: {"nodename": c["node"]}, lambda c: {"nodename": c["node"], "workloads_resource": []},
               lambda c: {"nodename": c["blocked"]}, _add_blocked_to(p), ("node", "blocked")),
    ]


CHANGES = MANAGER_CHANGES + [change for p in PLUGINS for change in _plugin_changes(p)]
FAILING_CHANGES = [change for change in CHANGES if change.failing is not None]


def watched_nodes(case: Change, ctx: dict) -> list[str]:
    return [ctx[key] for key in case.watched]


@pytest.mark.parametrize("case", CHANGES, ids=[c.id for c in CHANGES])
async def test_request_id_retry_returns_the_first_answer_and_changes_nothing(wire, redis, namespace, case):
    """§2: "Commands that change state accept an optional `request_id`; a retry with the same id within
    24 h returns the first answer and changes nothing"."""
    ctx = await case.prepare(wire)
    payload = {**case.payload(ctx), "request_id": unique("rid")}
    first = await wire.request(case.subject, payload)
    first.expect_ok()
    async with changes_nothing(wire, *watched_nodes(case, ctx)):
        retry = await wire.request(case.subject, payload)
    assert (retry.data, retry.headers) == (first.data, first.headers)
    stored = await stored_replies(redis, namespace, payload["request_id"])
    assert stored and all(is_success(s) for s in stored)


@pytest.mark.parametrize("case", FAILING_CHANGES, ids=[c.id for c in FAILING_CHANGES])
async def test_request_id_error_answer_is_replayed(wire, redis, namespace, case):
    """§2: a retry "returns the first answer" also when that answer was an error (other than
    `internal` and a refusal of malformed input), even once the request would succeed; no success
    is stored for the id."""
    ctx = await case.prepare(wire)
    payload = {**case.failing(ctx), "request_id": unique("rid")}
    first = await wire.request(case.subject, payload)
    assert not first.ok and first.status != 500, first.body
    if case.unblock is not None:
        await case.unblock(wire, ctx)
    async with changes_nothing(wire, *watched_nodes(case, ctx)):
        retry = await wire.request(case.subject, payload)
    assert (retry.data, retry.headers) == (first.data, first.headers)
    stored = await stored_replies(redis, namespace, payload["request_id"])
    assert stored and not any(is_success(s) for s in stored)  # the error is the stored first answer


@pytest.mark.parametrize("case", CHANGES, ids=[c.id for c in CHANGES])
async def test_request_id_malformed_request_is_not_kept(wire, redis, namespace, case):
    """§2 request_id, refined: a request refused as malformed (400) did nothing, so nothing is kept
    for its id: the corrected request with the same id runs (it is not "another payload")."""
    ctx = await case.prepare(wire)
    request_id = unique("rid")
    malformed = await wire.request(case.subject, {"request_id": request_id})  # required keys missing
    assert (malformed.status, malformed.code) == (400, INVALID), malformed.body
    assert await stored_replies(redis, namespace, request_id) == []
    corrected = await wire.request(case.subject, {**case.payload(ctx), "request_id": request_id})
    corrected.expect_ok()
    assert [is_success(s) for s in await stored_replies(redis, namespace, request_id)] == [True]


@pytest.mark.parametrize("case", CHANGES, ids=[c.id for c in CHANGES])
async def test_request_id_reused_with_another_payload_is_refused(wire, case):
    """§2 request_id: an id names one request; reused with another payload it is `invalid_argument`
    naming `request_id`, changes nothing, and the first answer stays."""
    ctx = await case.prepare(wire)
    request_id = unique("rid")
    payload = {**case.payload(ctx), "request_id": request_id}
    first = await wire.request(case.subject, payload)
    first.expect_ok()
    async with changes_nothing(wire, *watched_nodes(case, ctx)):
        other = await wire.request(case.subject, {**case.variant(ctx), "request_id": request_id})
    assert_error(other, INVALID, "request_id")
    assert (await wire.request(case.subject, payload)).data == first.data


@pytest.mark.parametrize("case", CHANGES, ids=[c.id for c in CHANGES])
async def test_request_id_internal_error_is_not_stored(wire, redis, namespace, case):
    """§2 request_id: an `internal` (500) answer is not stored, so the retry of a repaired fault succeeds."""
    ctx = await case.prepare(wire)
    payload = {**case.payload(ctx), "request_id": unique("rid")}
    key = record_key(namespace, ctx["node"])
    saved = await redis.hget(key, "v")
    await redis.hset(key, "v", b"\x00not-a-version")  # the node's record no longer reads
    try:
        broken = await wire.request(case.subject, payload)
    finally:
        if saved is None:
            await redis.delete(key)
        else:
            await redis.hset(key, "v", saved)
    assert_error(broken, "internal")
    fixed = await wire.request(case.subject, payload)
    fixed.expect_ok()
    assert (await wire.request(case.subject, payload)).data == fixed.data


async def test_request_id_retry_from_two_processes_at_once_has_one_effect(wire, nats_url):
    """§2 request_id: the same request sent from two OS processes at once is placed once and both
    processes get the same answer."""
    node = await new_node(wire)
    payload = msgpack.packb({**deploy(node, BOUND_ONE), "request_id": unique("rid")})
    capture = await wire.capture("resource.>")
    try:
        replies = await send_from_processes(nats_url, wire.subject("resource.allocate"), payload)
        events = await until_sentinel(wire, capture)
    finally:
        await capture.close()
    assert replies[0].data == replies[1].data
    [placed] = replies[0].expect_ok()["allocations"]
    held = await wire.ok("resource.get-allocations", {"nodename": node})
    assert [a["workload_id"] for a in held["allocations"]] == [placed["workload_id"]]
    assert [subject for subject, _ in events] == [wire.subject(f"events.resource.{node}.allocated")]


# -- events ----------------------------------------------------------------------------------------


async def test_event_added_one_per_plugin_with_after(wire):
    """§3: `berth.events.resource.<node>.added`, with `plugin` and `after` (the new record)."""
    node = unique("ev")
    payload = {"nodename": node, "resource": full_resource()}
    reply, events, t0, t1 = await events_of(wire, lambda: wire.ok("resource.add-node", payload))
    assert sorted(body["plugin"] for _, body in events) == sorted(PLUGINS)
    for subject, body in events:
        check_event(wire, subject, body, node, "added", t0, t1)
        plugin = body["plugin"]
        assert body["after"] == {"capacity": reply["capacity"][plugin], "usage": reply["usage"][plugin]}
        assert isinstance(body["version"], int) and body["version"] > 0


async def test_event_removed_with_before(wire):
    """§3: `events.resource.<node>.removed`, with `plugin` and `before` (the record that went)."""
    node = await new_node(wire)
    info = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    _, events, t0, t1 = await events_of(wire, lambda: wire.ok("resource.remove-node", {"nodename": node}))
    assert sorted(body["plugin"] for _, body in events) == sorted(PLUGINS)
    for subject, body in events:
        check_event(wire, subject, body, node, "removed", t0, t1)
        plugin = body["plugin"]
        assert body["before"] == {"capacity": info["capacity"][plugin], "usage": info["usage"][plugin]}


async def test_event_capacity_with_before_and_after(wire):
    """§3: `events.resource.<node>.capacity` for each plugin whose capacity changed."""
    node = await new_node(wire)
    change = {"nodename": node, "resource_request": {"cpumem": {"memory": "1G"}}, "delta": True}
    set_capacity = partial(wire.ok, "resource.set-node-resource-capacity", change)
    reply, events, t0, t1 = await events_of(wire, set_capacity)
    [(subject, body)] = events
    check_event(wire, subject, body, node, "capacity", t0, t1)
    assert body["plugin"] == "cpumem" and isinstance(body["version"], int)
    assert body["before"]["capacity"] == reply["before"]["cpumem"]
    assert body["after"]["capacity"] == reply["after"]["cpumem"]
    assert body["after"]["capacity"]["memory"] == body["before"]["capacity"]["memory"] + GiB


async def test_event_usage_with_before_and_after(wire):
    """§3: `events.resource.<node>.usage`, with `plugin`, `before`, `after`."""
    node = await new_node(wire)
    change = {"nodename": node, "resource_request": {"memory": "1G"}, "delta": True}
    set_usage = partial(wire.ok, "resource.cpumem.set-node-resource-usage", change)
    reply, events, t0, t1 = await events_of(wire, set_usage)
    [(subject, body)] = events
    check_event(wire, subject, body, node, "usage", t0, t1)
    assert body["plugin"] == "cpumem" and isinstance(body["version"], int)
    assert (body["before"]["usage"], body["after"]["usage"]) == (reply["before"], reply["after"])


async def test_event_labels_with_before_and_after(wire):
    """§8: "`set-node-labels` {nodename, labels}" answers {} and publishes `events.resource.<node>.labels`."""
    node = await new_node(wire, labels={"city": "sz"})
    relabel = {"nodename": node, "labels": {"city": "bj"}}
    reply, events, t0, t1 = await events_of(wire, lambda: wire.ok("resource.set-node-labels", relabel))
    assert reply == {}
    [(subject, body)] = events
    check_event(wire, subject, body, node, "labels", t0, t1)
    assert (body["before"], body["after"]) == ({"labels": {"city": "sz"}}, {"labels": {"city": "bj"}})
    assert isinstance(body["version"], int)


async def test_event_allocated_and_released_with_workload_ids(wire):
    """§3/§8: `allocated` and `released` events carry `workload_ids`."""
    node = await new_node(wire)
    placed, events, t0, t1 = await events_of(wire, lambda: allocate(wire, node, BOUND_ONE, 2))
    ids = [a["workload_id"] for a in placed]
    [(subject, body)] = events
    check_event(wire, subject, body, node, "allocated", t0, t1)
    assert body["workload_ids"] == ids and isinstance(body["version"], int)

    reply, events, t0, t1 = await events_of(wire, lambda: wire.ok("resource.release", {"workload_ids": ids}))
    [(subject, body)] = events
    check_event(wire, subject, body, node, "released", t0, t1)
    assert sorted(body["workload_ids"]) == sorted(ids) == reply["released"]


async def test_event_version_is_the_nodes_version_after_the_change(wire):
    """README: events carry `version`, "the node's version after the change": it grows with each
    change, also across a removal and a new add."""
    node = unique("ver")
    add = {"nodename": node, "resource": full_resource()}
    _, added, _, _ = await events_of(wire, lambda: wire.ok("resource.add-node", add))
    relabel = {"nodename": node, "labels": {"a": "b"}}
    _, labels, _, _ = await events_of(wire, lambda: wire.ok("resource.set-node-labels", relabel))
    placed, allocated, _, _ = await events_of(wire, lambda: allocate(wire, node, BOUND_ONE))
    release = {"workload_ids": [placed[0]["workload_id"]]}
    _, released, _, _ = await events_of(wire, lambda: wire.ok("resource.release", release))
    assert len({body["version"] for _, body in added}) == 1  # one commit creates every plugin's record
    # Removed and added again, a node goes on counting: a consumer skipping versions it has seen
    # skips nothing new.
    _, removed, _, _ = await events_of(wire, lambda: wire.ok("resource.remove-node", {"nodename": node}))
    _, again, _, _ = await events_of(wire, lambda: wire.ok("resource.add-node", add))
    versions = [events[0][1]["version"] for events in (added, labels, allocated, released, removed, again)]
    assert versions == sorted(set(versions))


# -- §3 plugin level: commands, keys and shapes -------------------------------------------------------

PLUGIN_REPLY_KEYS = {
    "calculate-deploy": (lambda n, p, i: deploy(n, {}), {"engines_params", "workloads_resource"}),
    "calculate-realloc": (lambda n, p, i: {"nodename": n, "workload_resource": {}, WRR: {}},
                          {"engine_params", "delta_resource", "workload_resource"}),
    "calculate-remap": (lambda n, p, i: {"nodename": n, "workloads_resource": {"w1": {}}},
                        {"engine_params_map"}),
    "add-node": (lambda n, p, i: {"nodename": unique("k"), "resource": PLUGIN_RESOURCE[p], "info": {}},
                 {"capacity", "usage"}),
    "remove-node": (lambda n, p, i: {"nodename": n}, set()),
    "get-nodes-deploy-capacity": (lambda n, p, i: {"nodenames": [n], WRR: {}},
                                  {"nodes_deploy_capacity_map", "total"}),
    "set-node-resource-capacity": (
        lambda n, p, i: {"nodename": n, "resource": None, "resource_request": {}, "delta": True,
                         "incr": True},
        {"before", "after"}),
    "get-node-resource-info": (lambda n, p, i: {"nodename": n, "workloads_resource": []},
                               {"capacity", "usage", "diffs"}),
    "set-node-resource-info": (
        lambda n, p, i: {"nodename": n, "capacity": i["capacity"], "usage": i["usage"]}, set()),
    "set-node-resource-usage": (
        lambda n, p, i: {"nodename": n, "resource": None, "resource_request": {}, "workloads_resource": [],
                         "delta": True, "incr": True},
        {"before", "after"}),
    "get-most-idle-node": (lambda n, p, i: {"nodenames": [n]}, {"nodename", "priority"}),
    "fix-node-resource": (lambda n, p, i: {"nodename": n, "workloads_resource": []},
                          {"capacity", "usage", "diffs"}),
    "get-metrics-description": (lambda n, p, i: {}, {"descriptions"}),
    "get-metrics": (lambda n, p, i: {"podname": "pod", "nodename": n}, {"metrics"}),
}


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("command", list(PLUGIN_REPLY_KEYS))
async def test_plugin_command_request_and_reply_keys_follow_the_table(wire, plugin, command):
    """§3 table: `berth.resource.<plugin>.<command>` takes the request keys and answers the reply keys."""
    node = await new_node(wire)
    info = await wire.ok(f"resource.{plugin}.get-node-resource-info", {"nodename": node})
    build, keys = PLUGIN_REPLY_KEYS[command]
    reply = await wire.ok(f"resource.{plugin}.{command}", build(node, plugin, info))
    assert set(reply) == keys
    if command == "get-nodes-deploy-capacity":
        # "capacity entries use lower-case `capacity`/`usage`/`rate`/`weight`"
        assert set(reply["nodes_deploy_capacity_map"][node]) == {"capacity", "usage", "rate", "weight"}
    if command == "get-metrics-description":
        assert all(set(d) == {"name", "help", "type", "labels"} for d in reply["descriptions"])
    if command == "get-metrics":
        assert reply["metrics"]
        assert all(set(m) == {"name", "labels", "key", "value"} for m in reply["metrics"])


async def test_deploy_capacity_request_key_is_workload_resource_request(wire):
    """§3: "get-nodes-deploy-capacity's request key is `workload_resource_request`" (eru's
    `workload_resource` is an unknown key, so refused: §8 "Unknown keys are refused at every level")."""
    node = await new_node(wire)
    ours = await wire.ok("resource.cpumem.get-nodes-deploy-capacity", {"nodenames": [node], WRR: BOUND})
    erus = await wire.request(
        "resource.cpumem.get-nodes-deploy-capacity", {"nodenames": [node], "workload_resource": BOUND}
    )
    assert ours["nodes_deploy_capacity_map"][node]["capacity"] == 2 and ours["total"] == 2
    assert_error(erus, INVALID, "workload_resource")
    assert WRR in erus.details["accepted"]


async def test_resource_shapes_per_plugin_are_erus(wire):
    """§3: "Resource shapes per plugin are eru's": node resources, workload resources, engine params."""
    held = await held_node(wire)
    info = await wire.ok("resource.get-node-resource-info", {"nodename": held.node})
    for half in ("capacity", "usage"):
        assert set(info[half]["cpumem"]) == {"cpu", "cpu_map", "memory", "numa_memory", "numa"}
        assert set(info[half]["storage"]) == {"volumes", "disks", "storage"}
        assert set(info[half]["gpu"]) == {"prod_count_map"}
    workload, engine = held.workload["workload_resource"], held.workload["engine_params"]
    assert set(workload["cpumem"]) == {
        "cpu_request", "cpu_limit", "memory_request", "memory_limit", "cpu_map", "numa_memory", "numa_node",
    }
    assert set(engine["cpumem"]) == {"cpu", "cpu_map", "numa_node", "memory", "remap"}
    assert set(workload["storage"]) == {
        "volumes_request", "volumes_limit", "volume_plan_request", "volume_plan_limit",
        "storage_request", "storage_limit", "disks_request", "disks_limit",
    }
    assert set(engine["storage"]) == {"volumes", "volume_changed", "storage", "iops_options"}
    assert workload["gpu"] == engine["gpu"] == {"prod_count_map": {GPU: 1}}
    disk = {"nodename": unique("disk"), "resource": {"disks": ["sda:/data:1:2:3K:4K"]}}
    assert (await wire.ok("resource.storage.add-node", disk))["capacity"]["disks"] == [
        {"device": "sda", "mounts": ["/data"], "read_IOPS": 1, "write_IOPS": 2,
         "read_bps": 3072, "write_bps": 4096},
    ]


async def test_node_request_cpu_count_or_list_and_share(wire):
    """§3: node requests `cpu` (count or `"id:pieces,..."`), `share`, `memory`."""
    counted = {"nodename": unique("c"), "resource": {"cpu": 2, "share": 200, "memory": "1G"}}
    listed = {"nodename": unique("c"), "resource": {"cpu": "0:100,3:50", "memory": 1024}}
    counted = (await wire.ok("resource.cpumem.add-node", counted))["capacity"]
    listed = (await wire.ok("resource.cpumem.add-node", listed))["capacity"]
    assert (counted["cpu_map"], counted["cpu"]) == ({"0": 200, "1": 200}, 2)
    assert (listed["cpu_map"], listed["memory"]) == ({"0": 100, "3": 50}, 1024)


# -- §3 and §8 sizes and quantities ------------------------------------------------------------------

SIZES = [
    ("1G", GiB), ("1GiB", GiB), ("1GB", GiB), ("1K", 1 << 10), ("1KiB", 1 << 10), ("1M", 1 << 20),
    ("2MB", 2 << 20), ("1T", 1 << 40), ("1P", 1 << 50), ("1024", 1024), (1024, 1024), (1024.0, 1024),
    ("9007199254740993", 9007199254740993), ("9223372036854775807", MAX_INT), (MAX_INT, MAX_INT),
    ("9223372036854775808", None), (2**63, None), ("--1G", None), ("lots", None), ("1E", None),
    (1024.5, None), ("1.0001", None), (True, None), (None, None),
    # §8 (pinned): "Sizes also accept the IEC spelling berth itself prints (`"16Gi"`, `"512Mi"`)".
    ("16Gi", 16 * GiB), ("512Mi", 512 << 20), ("1.5Ki", 1536), ("2Ti", 2 << 40), ("1Pi", 1 << 50),
    ("16Gx", None), ("Gi", None), ("16i", None), ("1.3Gi", None),
]


@pytest.mark.parametrize("size,expected", SIZES, ids=[repr(s) for s, _ in SIZES])
async def test_byte_sizes_parse_exactly_or_are_refused(wire, size, expected):
    """§8: "Byte sizes are integers (an integral float is accepted) or strings with a binary suffix: `K`,
    `M`, `G`, `T`, `P`, optionally followed by `B` or `iB` (`"1G"` = `"1GiB"` = 2^30)"; §3 "a value that
    does not parse is an error, never a silent 0"; the largest is 2^63-1."""
    node = unique("size")
    payload = {"nodename": node, "resource": {"cpu": 1, "memory": size}}
    reply = await wire.request("resource.cpumem.add-node", payload)
    if expected is None:
        assert_error(reply, INVALID, "resource.memory")
        missing = await wire.request("resource.cpumem.get-node-resource-info", {"nodename": node})
        assert_error(missing, "node_not_found")
    else:
        assert reply.expect_ok()["capacity"]["memory"] == expected


async def test_storage_sizes_follow_the_same_rules(wire):
    """§3: "Sizes accept integer bytes or human strings" in every plugin; "never a silent 0"."""
    sized = {"nodename": unique("size"), "resource": {"storage": "1GiB"}}
    reply = await wire.ok("resource.storage.add-node", sized)
    assert reply["capacity"]["storage"] == GiB
    lots = {"nodename": unique("size"), "resource": {"storage": "lots"}}
    assert_error(await wire.request("resource.storage.add-node", lots), INVALID, "resource.storage")


async def test_cpu_quantities_are_numbers_int_or_float(wire):
    """§8: "CPU quantities are numbers (int or float), never strings"."""
    node = await new_node(wire)
    for cpu in (1, 0.5):
        reply = await wire.ok("resource.cpumem.calculate-deploy", deploy(node, {**BOUND, "cpu-request": cpu}))
        assert reply["workloads_resource"][0]["cpu_request"] == cpu
    text = await wire.request("resource.cpumem.calculate-deploy", deploy(node, {"cpu-request": "0.5"}))
    assert_error(text, INVALID, f"{WRR}.cpu-request")


async def test_negative_values_subtract_in_delta_requests(wire):
    """§8: "Quantities are non-negative, except in requests that are deltas (calculate-realloc and
    realloc requests, set-* with `delta: true`), where a negative value subtracts; a result below zero
    is an error"."""
    held = await held_node(wire)
    shrink = {"nodename": held.node, "resource_request": {"memory": "-1G"}}
    shrunk = await wire.ok("resource.cpumem.set-node-resource-capacity", {**shrink, "delta": True})
    assert shrunk["after"]["memory"] == shrunk["before"]["memory"] - GiB
    assert_error(await wire.request("resource.cpumem.set-node-resource-capacity", shrink), INVALID, "resource_request.memory")
    less = held.realloc("cpumem", {"keep-cpu-bind": True, "memory-request": "-512M"})
    realloc = await wire.ok("resource.cpumem.calculate-realloc", less)
    assert realloc["workload_resource"]["memory_request"] == GiB // 2
    assert realloc["delta_resource"]["memory_request"] == -GiB // 2
    below = held.realloc("cpumem", {"keep-cpu-bind": True, "memory-request": "-2G"})
    below_zero = await wire.request("resource.cpumem.calculate-realloc", below)
    assert_error(below_zero, "invalid_memory", f"{WRR}.memory-request")


async def test_totals_saturate_at_max_int(wire):
    """§3: "totals saturate instead of overflowing" (at 2^63-1)."""
    nodes = [await new_node(wire), await new_node(wire)]
    reply = await wire.ok("resource.cpumem.get-nodes-deploy-capacity", {"nodenames": nodes, WRR: {}})
    assert [reply["nodes_deploy_capacity_map"][n]["capacity"] for n in nodes] == [MAX_INT, MAX_INT]
    assert reply["total"] == MAX_INT


# -- §3 deliberate differences from eru -----------------------------------------------------------------


async def test_realloc_delta_carries_the_new_numa_memory(wire):
    """§3: "realloc deltas carry the new NUMA memory"."""
    node = await new_node(wire, resource={"cpumem": {"cpu": 2, "memory": "4G", "numa-cpu": ["0", "1"]}})
    [placed] = await allocate(wire, node, {"cpumem": {**BOUND, "memory-request": GiB}})
    current = placed["workload_resource"]["cpumem"]
    assert current["numa_node"] == "0" and current["numa_memory"] == {"0": GiB}
    more = {"keep-cpu-bind": True, "memory-request": GiB}
    grow = {"nodename": node, "workload_resource": current, WRR: more}
    reply = await wire.ok("resource.cpumem.calculate-realloc", grow)
    assert reply["workload_resource"]["numa_memory"] == {"0": 2 * GiB}
    assert reply["delta_resource"]["numa_memory"] == {"0": GiB}


async def test_capacity_rollback_is_exact(wire):
    """§3: "capacity rollback is exact": replaying `before` as eru core does (an absolute request)
    restores a custom, oversold cpu map."""
    node = unique("rb")
    oversold = {"cpu": "0:200,2:100", "memory": "2G"}
    await wire.ok("resource.cpumem.add-node", {"nodename": node, "resource": oversold})
    original = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node})
    grow = {"nodename": node, "resource_request": {"cpu": 2, "memory": "1G"}, "delta": True}
    changed = await wire.ok("resource.cpumem.set-node-resource-capacity", grow)
    assert changed["after"] != changed["before"]
    rollback = {"nodename": node, "resource_request": changed["before"], "delta": False, "incr": False}
    await wire.ok("resource.cpumem.set-node-resource-capacity", rollback)
    restored = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node})
    assert (restored["capacity"], restored["usage"]) == (original["capacity"], original["usage"])


async def test_metrics_keys_are_distinct_and_values_are_numbers(wire):
    """§3: "GetMetrics keys are distinct (`.storage.capacity`)"; §8 "Metrics `value` is a number"."""
    held = await held_node(wire)
    metrics = (await wire.ok("resource.get-metrics", {"podname": "pod", "nodename": held.node}))["metrics"]
    keys = [m["key"] for m in metrics]
    assert len(keys) == len(set(keys))
    assert {f"core.node.{held.node}.storage.capacity", f"core.node.{held.node}.storage.used"} <= set(keys)
    assert all(isinstance(m["value"], (int, float)) and not isinstance(m["value"], bool) for m in metrics)


async def test_worker_configuration_defaults(wire):
    """§8: "Worker configuration: `--share-base` (100), `--max-share` (-1), `--max-deploy-count` (10000)"."""
    node = await new_node(wire, resource={"cpumem": {"cpu": 4, "memory": "4G"}})
    info = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node})
    assert set(info["capacity"]["cpu_map"].values()) == {100}
    halves = {"nodenames": [node], WRR: {"cpu-bind": True, "cpu-request": 0.5}}
    # no limit on fragment cores: every core splits in two
    assert (await wire.ok("resource.cpumem.get-nodes-deploy-capacity", halves))["total"] == 8
    storage = await wire.ok("resource.storage.get-nodes-deploy-capacity", {"nodenames": [node], WRR: {}})
    assert storage["total"] == 10000


# -- §3 and §8 manager level ------------------------------------------------------------------------------


async def test_manager_payloads_and_replies_are_keyed_by_plugin(wire):
    """§8: "Manager payloads keep the plugin-level keys at the top and key each resource value by plugin";
    "replies likewise"; "`engines_params` is a list of `{plugin: params}`"."""
    node = unique("keyed")
    added = await wire.ok("resource.add-node", {"nodename": node, "resource": full_resource()})
    assert set(added) == {"capacity", "usage"}
    assert set(added["capacity"]) == set(added["usage"]) == set(PLUGINS)
    deployed = await wire.ok("resource.calculate-deploy", deploy(node, HELD_REQUEST, 2))
    assert set(deployed) == {"engines_params", "workloads_resource"}
    assert isinstance(deployed["engines_params"], list) and len(deployed["engines_params"]) == 2
    assert all(set(e) == set(PLUGINS) for e in deployed["engines_params"] + deployed["workloads_resource"])
    info = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    assert set(info) == {"capacity", "usage", "diffs"} and set(info["capacity"]) == set(PLUGINS)


async def test_engine_info_is_node_level(wire):
    """§8: "Engine `info` is node-level: `ncpu`, `memory_total`, `storage_total`, `resources` (a map
    plugin -> node resource, not JSON bytes)"."""
    reply = await wire.ok("resource.add-node", {
        "nodename": unique("info"),
        "info": {"ncpu": 2, "memory_total": 10 * GiB, "storage_total": 100 * GiB,
                 "resources": {"gpu": {"prod_count_map": {"a100": 2}}}},
    })
    capacity = reply["capacity"]
    assert capacity["cpumem"]["cpu_map"] == {"0": 100, "1": 100}
    assert capacity["cpumem"]["memory"] == 8 * GiB  # eru offers 80 % of what the engine reports
    assert capacity["storage"]["storage"] == 80 * GiB
    assert capacity["gpu"] == {"prod_count_map": {"a100": 2}}


async def test_manager_add_node_gives_a_missing_plugin_info_defaults_else_empty_capacity(wire):
    """§8: "Manager `add-node` creates a record in every plugin: a plugin missing from `resource` gets its
    defaults from `info`, else an empty capacity (so the node still takes part in manager-level capacity
    for requests that do not need that plugin)"."""
    bare = unique("bare")
    cpumem_only = {"cpumem": PLUGIN_RESOURCE["cpumem"]}
    reply = await wire.ok("resource.add-node", {"nodename": bare, "resource": cpumem_only})
    assert reply["capacity"]["storage"] == {"volumes": {}, "disks": [], "storage": 0}
    assert reply["capacity"]["gpu"] == {"prod_count_map": {}}
    informed = {"nodename": unique("informed"), "resource": {"cpumem": PLUGIN_RESOURCE["cpumem"]},
                "info": {"storage_total": 10 * GiB}}
    assert (await wire.ok("resource.add-node", informed))["capacity"]["storage"]["storage"] == 8 * GiB
    capacity = await wire.ok("resource.get-nodes-deploy-capacity", {"nodenames": [bare], WRR: BOUND_ONE})
    assert capacity["nodes_deploy_capacity_map"][bare]["capacity"] == 2 and capacity["total"] == 2


async def test_manager_capacity_merge_intersection_minimum_weighted_mean(wire):
    """§3: "merged as core merges them (node intersection, minimum capacity, a proper weighted mean of
    rate/usage ...)"."""
    held = await held_node(wire)
    cardless = await new_node(wire, resource={"cpumem": PLUGIN_RESOURCE["cpumem"]})
    request = {"cpumem": BOUND, "gpu": {"prod_count_map": {GPU: 1}}}
    both = {"nodenames": [held.node, cardless], WRR: request}
    merged = await wire.ok("resource.get-nodes-deploy-capacity", both)
    parts = []
    for plugin in PLUGINS:
        part = {"nodenames": [held.node], WRR: request.get(plugin, {})}
        parts.append((await wire.ok(f"resource.{plugin}.get-nodes-deploy-capacity", part))
                     ["nodes_deploy_capacity_map"][held.node])
    assert list(merged["nodes_deploy_capacity_map"]) == [held.node]  # the card-less node cannot serve it
    entry = merged["nodes_deploy_capacity_map"][held.node]
    assert entry["capacity"] == min(p["capacity"] for p in parts) == merged["total"] == 1
    weight = sum(p["weight"] for p in parts)
    assert math.isclose(entry["rate"], sum(p["rate"] * p["weight"] for p in parts) / weight)
    assert math.isclose(entry["usage"], sum(p["usage"] * p["weight"] for p in parts) / weight)


async def test_manager_diffs_are_the_plugin_diffs_concatenated(wire):
    """§3: merged "as core merges them (... highest-priority idle node, concatenated diffs)"."""
    node = await new_node(wire)
    drift = {"cpumem": {"memory": "1G"}, "gpu": {"prod_count_map": {GPU: 1}}}
    drifted = {"nodename": node, "resource_request": drift, "delta": True}
    await wire.ok("resource.set-node-resource-usage", drifted)
    merged = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    parts = [await wire.ok(f"resource.{p}.get-node-resource-info", {"nodename": node}) for p in PLUGINS]
    assert merged["diffs"] == [diff for part in parts for diff in part["diffs"]]
    assert parts[0]["diffs"] and parts[2]["diffs"]


async def test_allocate_reply_and_get_allocations_shape(wire):
    """§8: "`allocate` reply `{allocations: [{workload_id, nodename, workload_resource: {plugin: ...},
    engine_params: {plugin: ...}}]}`"; "`get-allocations` {nodename} -> `{allocations: [{workload_id,
    workload_resource}]}`"."""
    node = await new_node(wire)
    reply = await wire.ok("resource.allocate", {**deploy(node, HELD_REQUEST), "workload_ids": ["shape-w1"]})
    [placed] = reply["allocations"]
    assert set(reply) == {"allocations"}
    assert set(placed) == {"workload_id", "nodename", "workload_resource", "engine_params"}
    assert (placed["workload_id"], placed["nodename"]) == ("shape-w1", node)
    assert set(placed["workload_resource"]) == set(placed["engine_params"]) == set(PLUGINS)
    held = await wire.ok("resource.get-allocations", {"nodename": node})
    entry = {"workload_id": "shape-w1", "workload_resource": placed["workload_resource"]}
    assert held == {"allocations": [entry]}


async def test_allocate_is_all_or_nothing(wire):
    """§3: "`allocate` ...: calculate and commit in one atomic step per node; all or nothing"."""
    roomy, held = await new_node(wire), await held_node(wire)
    payload = {"nodenames": [roomy, held.node], "strategy": "each", "deploy_count": 2, WRR: BOUND_ONE}
    async with changes_nothing(wire, roomy, held.node):
        reply = await wire.request("resource.allocate", payload)
    assert_error(reply, "insufficient_capacity")


async def test_realloc_commits_the_new_placement_and_reply_keys_are_keyed_by_plugin(wire):
    """§3: "`realloc` {request_id, workload_id, workload_resource_request} -> new placement committed";
    §8 "`realloc` -> `{workload_id, nodename, engine_params, workload_resource, delta_resource}` (each
    keyed by plugin)"."""
    held = await held_node(wire)
    more = {"cpumem": {"keep-cpu-bind": True, "memory-request": GiB}}
    realloc = partial(wire.ok, "resource.realloc", held.realloc_all(more))
    reply, events, t0, t1 = await events_of(wire, realloc)
    assert set(reply) == {"workload_id", "nodename", "engine_params", "workload_resource", "delta_resource"}
    assert (reply["workload_id"], reply["nodename"]) == (held.wid, held.node)
    for key in ("engine_params", "workload_resource", "delta_resource"):
        assert set(reply[key]) == set(PLUGINS)
    assert reply["workload_resource"]["cpumem"]["memory_request"] == 2 * GiB
    ledger = await wire.ok("resource.get-allocations", {"nodename": held.node})
    entry = {"workload_id": held.wid, "workload_resource": reply["workload_resource"]}
    assert ledger["allocations"] == [entry]
    info = await wire.ok("resource.get-node-resource-info", {"nodename": held.node})
    assert info["usage"]["cpumem"]["memory"] == 2 * GiB and info["diffs"] == []
    [(subject, body)] = events  # the committed change is published as the node's usage change
    check_event(wire, subject, body, held.node, "usage", t0, t1)
    assert body["workload_ids"] == [held.wid]


async def test_release_may_name_workloads_on_several_nodes(wire):
    """§8: "`release` -> `{released: [workload_id]}`"; "`release` may name workloads on several nodes"."""
    first, second = await held_node(wire), await held_node(wire)
    release = {"workload_ids": [second.wid, first.wid, "unknown-workload"]}
    reply, events, _, _ = await events_of(wire, lambda: wire.ok("resource.release", release))
    assert reply == {"released": sorted([first.wid, second.wid])}
    expected = [wire.subject(f"events.resource.{held.node}.released") for held in (first, second)]
    assert sorted(subject for subject, _ in events) == sorted(expected)
    for held in (first, second):
        assert (await wire.ok("resource.get-allocations", {"nodename": held.node}))["allocations"] == []


async def test_plugins_reply(wire):
    """§8: "`plugins` -> `{plugins: [names]}`"."""
    assert await wire.ok("resource.plugins", {}) == {"plugins": list(PLUGINS)}


async def test_list_nodes_pages_default_100_at_most_1000_sorted_by_name_with_total(wire):
    """§8: "`list-nodes` {nodenames?, labels?, offset?, limit? (default 100, at most 1000)} -> `{nodes:
    [{nodename, labels, capacity, usage}], total}` (sorted by name ...)"."""
    batch = unique("page")
    names = [f"{batch}-{i:03d}" for i in range(101)]
    small = {"cpumem": {"cpu": 1, "memory": "1G"}}
    await asyncio.gather(*(
        wire.ok("resource.add-node", {"nodename": n, "resource": small, "labels": {"batch": batch}})
        for n in reversed(names)
    ))
    page = await wire.ok("resource.list-nodes", {"labels": {"batch": batch}})
    assert [n["nodename"] for n in page["nodes"]] == names[:100] and page["total"] == 101
    assert set(page["nodes"][0]) == {"nodename", "labels", "capacity", "usage", "status", "lease"}
    assert (page["nodes"][0]["status"], page["nodes"][0]["lease"]) == ("up", None)  # no agent keeps it
    assert page["nodes"][0]["labels"] == {"batch": batch}
    assert set(page["nodes"][0]["capacity"]) == set(PLUGINS)
    rest = await wire.ok("resource.list-nodes", {"labels": {"batch": batch}, "offset": 100})
    assert [n["nodename"] for n in rest["nodes"]] == names[100:] and rest["total"] == 101
    whole = await wire.ok("resource.list-nodes", {"labels": {"batch": batch}, "limit": 1000})
    assert [n["nodename"] for n in whole["nodes"]] == names
    picked = await wire.ok("resource.list-nodes", {"nodenames": [names[5], names[2]]})
    assert [n["nodename"] for n in picked["nodes"]] == [names[2], names[5]] and picked["total"] == 2


async def test_ledger_beside_the_node_record_explains_usage_and_repairs_drift(wire, redis, namespace):
    """§3: "The ledger ... lives in Redis beside the node record, so usage always equals the sum of the
    ledger and `fix-node-resource` can repair drift from it"; "keys carry a hash tag per node"."""
    held = await held_node(wire)
    ledger_key = f"{namespace}:allocation:{{node:{held.node}}}:ledger"
    assert await redis.exists(record_key(namespace, held.node), ledger_key) == 2
    good = await wire.ok("resource.get-node-resource-info", {"nodename": held.node})
    assert good["diffs"] == []
    drift = {"nodename": held.node, "resource_request": {"memory": "1G"}, "delta": True}
    await wire.ok("resource.cpumem.set-node-resource-usage", drift)
    drifted = await wire.ok("resource.get-node-resource-info", {"nodename": held.node})
    assert drifted["diffs"]
    fixed = await wire.ok("resource.fix-node-resource", {"nodename": held.node})
    assert fixed["diffs"] == drifted["diffs"] and fixed["usage"] == good["usage"]
    assert (await wire.ok("resource.get-node-resource-info", {"nodename": held.node}))["diffs"] == []


async def test_commits_never_over_commit(wire):
    """§3: "Commits are Lua scripts that re-check capacity (or a version) and write in one step: no
    over-commit"."""
    node = await new_node(wire)
    payload = deploy(node, BOUND_ONE)
    replies = await asyncio.gather(*(wire.request("resource.allocate", payload) for _ in range(6)))
    assert sum(reply.ok for reply in replies) == 2
    for reply in replies:
        if not reply.ok:
            assert_error(reply, "insufficient_capacity")
    assert len((await wire.ok("resource.get-allocations", {"nodename": node}))["allocations"]) == 2
    assert (await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node}))["usage"]["cpu"] == 2


# -- §8 order -----------------------------------------------------------------------------------------


async def test_core_ids_ascend_numerically(wire):
    """§8: "core ids ascend numerically" (core "2" before core "10")."""
    listed = {"nodename": unique("ord"), "resource": {"cpu": "10:100,2:100", "memory": "1G"}}
    reply = await wire.ok("resource.cpumem.add-node", listed)
    assert list(reply["capacity"]["cpu_map"]) == ["2", "10"]
    assert list(reply["usage"]["cpu_map"]) == ["2", "10"]
    eleven = {"nodename": unique("ord"), "resource": {"cpu": 11, "memory": "1G"}}
    reply = await wire.ok("resource.cpumem.add-node", eleven)
    assert list(reply["capacity"]["cpu_map"]) == [str(i) for i in range(11)]


async def test_numa_ids_ascend_numerically(wire):
    """§8: "NUMA ids ... ascend numerically"; §3 deterministic order (NUMA-local plans by NUMA id)."""
    node = unique("numa")
    ids = [str(i) for i in range(11)]
    resource = {"cpu": 11, "memory": "11G", "numa-cpu": ids}
    reply = await wire.ok("resource.cpumem.add-node", {"nodename": node, "resource": resource})
    assert list(reply["capacity"]["numa_memory"]) == ids and list(reply["usage"]["numa_memory"]) == ids
    deployed = await wire.ok("resource.cpumem.calculate-deploy", deploy(node, BOUND, 11))
    assert [engine["numa_node"] for engine in deployed["engines_params"]] == ids


async def test_most_idle_ties_go_to_the_smallest_node_name(wire):
    """§8: "most-idle ties go to the smallest node name"."""
    batch = unique("idle")
    for suffix in ("b", "a", "c"):
        await wire.ok("resource.add-node", {"nodename": f"{batch}-{suffix}", "resource": full_resource()})
    names = {"nodenames": [f"{batch}-c", f"{batch}-b", f"{batch}-a"]}
    assert await wire.ok("resource.get-most-idle-node", names) == {"nodename": f"{batch}-a", "priority": 100}
    assert (await wire.ok("resource.cpumem.get-most-idle-node", names))["nodename"] == f"{batch}-a"


async def test_diffs_come_in_eru_group_order(wire):
    """§8: "diffs come in eru's group order (cpu, cores ascending, NUMA ascending, memory)"."""
    node = unique("diff")
    resource = {"cpu": "10:100,2:100", "memory": "2G", "numa-cpu": ["2", "10"], "numa-memory": ["1G", "1G"]}
    await wire.ok("resource.cpumem.add-node", {"nodename": node, "resource": resource})
    usage = {
        "cpu": 2, "cpu_map": {"10": 100, "2": 100}, "memory": 2 * GiB, "numa_memory": {"1": GiB, "0": GiB},
    }
    await wire.ok("resource.cpumem.set-node-resource-usage", {"nodename": node, "resource": usage})
    against_none = {"nodename": node, "workloads_resource": []}
    info = await wire.ok("resource.cpumem.get-node-resource-info", against_none)
    assert [diff.split(" != ")[0] for diff in info["diffs"]] == [
        "node.CPUUsed", "node.CPUMap[2]", "node.CPUMap[10]", "node.NUMAMemory[0]", "node.NUMAMemory[1]",
        "node.MemoryUsed",
    ]


# -- §8 maps, AddNode, deltas, round trips --------------------------------------------------------------


async def test_usage_maps_list_every_core_and_numa_node_workload_map_only_its_cores(wire):
    """§8: "a node's usage `cpu_map` and `numa_memory` list every capacity core and NUMA node (zeros
    included); a workload's `cpu_map` lists only cores it holds"."""
    node = await new_node(wire, resource={"cpumem": {"cpu": 4, "memory": "4G", "numa-cpu": ["0,1", "2,3"]}})
    empty = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node})
    assert empty["usage"]["cpu_map"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert empty["usage"]["numa_memory"] == {"0": 0, "1": 0}
    [placed] = await allocate(wire, node, {"cpumem": {**BOUND, "memory-request": GiB}})
    [(core, pieces)] = placed["workload_resource"]["cpumem"]["cpu_map"].items()
    assert pieces == 100
    used = (await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node}))["usage"]
    assert used["cpu_map"] == {c: (100 if c == core else 0) for c in ("0", "1", "2", "3")}
    assert set(used["numa_memory"]) == {"0", "1"} and sum(used["numa_memory"].values()) == GiB


async def test_add_node_from_engine_info_keeps_numa_cpu_and_splits_memory_floor_remainder_lowest(wire):
    """§8: "AddNode from engine info keeps a requested `numa-cpu`; memory split over NUMA nodes is the floor
    of memory / NUMA nodes each, the remainder to the lowest NUMA id"."""
    reply = await wire.ok("resource.add-node", {
        "nodename": unique("split"),
        "resource": {"cpumem": {"numa-cpu": ["0", "1", "2"]}},
        "info": {"ncpu": 3, "memory_total": 1000},
    })
    cpumem = reply["capacity"]["cpumem"]
    assert cpumem["numa"] == {"0": "0", "1": "1", "2": "2"}
    assert cpumem["memory"] == 800  # 80 % of the engine's memory
    assert cpumem["numa_memory"] == {"0": 268, "1": 266, "2": 266}


async def test_delta_resource_memory_limit_is_a_difference(wire):
    """§8: "`delta_resource.memory_limit` is a difference"."""
    node = await new_node(wire)
    reply = await wire.ok("resource.cpumem.calculate-realloc", {
        "nodename": node, "workload_resource": {"memory_request": GiB, "memory_limit": 2 * GiB},
        WRR: {"memory-limit": GiB},
    })
    assert reply["workload_resource"]["memory_limit"] == 3 * GiB
    assert reply["delta_resource"]["memory_limit"] == GiB


async def test_set_node_resource_info_round_trip_is_exact(wire):
    """§8: "`set-node-resource-info` stores exactly what it is given (storage included), so a get ->
    remove -> set round trip is exact"."""
    node = await new_node(wire)
    used = {"cpumem": {"memory": "1G"}, "storage": {"storage": "5G"}, "gpu": {"prod_count_map": {GPU: 1}}}
    await wire.ok("resource.set-node-resource-usage", 
                  {"nodename": node, "resource_request": used, "delta": True})
    before = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    await wire.ok("resource.remove-node", {"nodename": node})
    put_back = {"nodename": node, "capacity": before["capacity"], "usage": before["usage"]}
    assert await wire.ok("resource.set-node-resource-info", put_back) == {}
    after = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    assert (after["capacity"], after["usage"]) == (before["capacity"], before["usage"])
    assert after["capacity"]["storage"]["storage"] == 300 * GiB  # the volume is not counted twice


async def test_set_node_resource_info_creates_a_missing_node_at_plugin_level(wire):
    """§8 `set-node-resource-info` "stores exactly what it is given", for a node that does not exist
    too (eru: "it also creates records"): only that plugin's record, listed, one `added` event."""
    node = unique("created")
    capacity = {"cpu": 1, "cpu_map": {"0": 100}, "memory": GiB, "numa_memory": {}, "numa": {}}
    usage = {"cpu": 0, "cpu_map": {"0": 0}, "memory": 0, "numa_memory": {}, "numa": {}}
    payload = {"nodename": node, "capacity": capacity, "usage": usage}
    set_info = partial(wire.request, "resource.cpumem.set-node-resource-info", payload)
    reply, events, t0, t1 = await events_of(wire, set_info)
    assert reply.expect_ok() == {}
    created = await wire.ok("resource.cpumem.get-node-resource-info", {"nodename": node})
    assert created["capacity"]["memory"] == GiB
    other = await wire.request("resource.storage.get-node-resource-info", {"nodename": node})
    assert_error(other, "node_not_found")
    listed = await wire.ok("resource.list-nodes", {"nodenames": [node]})
    assert [n["nodename"] for n in listed["nodes"]] == [node]
    [(subject, body)] = events
    check_event(wire, subject, body, node, "added", t0, t1)
    assert body["plugin"] == "cpumem"


async def test_set_node_resource_info_creates_a_missing_node_at_manager_level(wire):
    """§8 `set-node-resource-info` for a node that does not exist creates it in every plugin."""
    info = await wire.ok("resource.get-node-resource-info", {"nodename": await new_node(wire)})
    node = unique("created")
    payload = {"nodename": node, "capacity": info["capacity"], "usage": info["usage"]}
    set_info = partial(wire.request, "resource.set-node-resource-info", payload)
    reply, events, t0, t1 = await events_of(wire, set_info)
    assert reply.expect_ok() == {}
    again = await wire.ok("resource.get-node-resource-info", {"nodename": node})
    assert (again["capacity"], again["usage"]) == (info["capacity"], info["usage"])
    assert (await wire.ok("resource.list-nodes", {"nodenames": [node]}))["total"] == 1
    assert sorted(body["plugin"] for _, body in events) == sorted(PLUGINS)
    for subject, body in events:
        check_event(wire, subject, body, node, "added", t0, t1)


@pytest.mark.parametrize("subject", ["resource.remove-node", *(f"resource.{p}.remove-node" for p in PLUGINS)])
async def test_remove_node_of_a_missing_node_succeeds_and_publishes_nothing(wire, subject):
    """§3 `remove-node` {nodename} -> {} (eru: "Deleting a missing node is not an error")."""
    reply, events, _, _ = await events_of(wire, lambda: wire.request(subject, {"nodename": unique("absent")}))
    assert reply.expect_ok() == {}
    assert events == []


async def test_calculate_remap_without_workloads_answers_empty_even_for_a_missing_node(wire):
    """§8: "calculate-remap with no workloads answers `{engine_params_map: {}}` even for a missing node"."""
    for subject in ("resource.calculate-remap", *(f"resource.{p}.calculate-remap" for p in PLUGINS)):
        for payload in ({"nodename": GHOST, "workloads_resource": {}}, {"nodename": GHOST}):
            assert await wire.ok(subject, payload) == {"engine_params_map": {}}


async def test_absent_workload_resource_request_means_empty_request(wire):
    """§8: "An absent `workload_resource_request` means an empty request (each plugin's empty-request
    rule)": cpumem unbound without limit (2^63-1), storage `--max-deploy-count`, gpu 1,000,000."""
    node = await new_node(wire)
    absent = await wire.request("resource.calculate-deploy", {"nodename": node, "deploy_count": 2})
    empty = await wire.request("resource.calculate-deploy", deploy(node, {}, 2))
    assert absent.expect_ok() and absent.data == empty.data
    for plugin, capacity in {"cpumem": MAX_INT, "storage": 10000, "gpu": 1_000_000}.items():
        reply = await wire.ok(f"resource.{plugin}.get-nodes-deploy-capacity", {"nodenames": [node]})
        assert reply["nodes_deploy_capacity_map"][node]["capacity"] == capacity
    merged = await wire.ok("resource.get-nodes-deploy-capacity", {"nodenames": [node]})
    assert merged["nodes_deploy_capacity_map"][node]["capacity"] == 10000


# -- node liveness (README "Agents": the lease and what "down" means) ------------------------------


async def test_a_heartbeat_renews_a_lease_and_a_lapsed_one_takes_the_node_out_until_the_next(wire):
    """`resource.node-heartbeat {nodename, ttl_seconds, draining?, agent?}` -> `{nodename, status,
    was, lease_expires}`; a node without a heartbeat past its TTL is `down` (an event
    `resource.<node>.down` with `before`/`after` `{status}`), refused `node_down` (409) by a deploy
    that names it, listed with its `status` and `lease`; the next heartbeat brings it `up`."""
    node = await new_node(wire, "beat")
    capture = await wire.capture(f"resource.{node}.*")
    t0 = time.time()
    beat = await wire.ok("resource.node-heartbeat", {"nodename": node, "ttl_seconds": 0.5,
                                                     "agent": {"address": "10.9.8.7", "running": 1}})
    assert set(beat) == {"nodename", "status", "was", "lease_expires"}
    assert (beat["nodename"], beat["status"], beat["was"]) == (node, "up", "up")
    assert isinstance(beat["lease_expires"], float) and beat["lease_expires"] > t0
    listed = (await wire.ok("resource.list-nodes", {"nodenames": [node]}))["nodes"][0]
    assert listed["status"] == "up" and set(listed["lease"]) == {"expires", "last_heartbeat", "ttl_seconds", "agent"}
    assert listed["lease"]["agent"]["address"] == "10.9.8.7"
    down = capture.events[await capture.first(wire.subject(f"events.resource.{node}.down"), timeout=15)][1]
    check_event(wire, wire.subject(f"events.resource.{node}.down"), down, node, "down", t0, time.time())
    assert (down["before"], down["after"]) == ({"status": "up"}, {"status": "down"})
    assert_error(await wire.request("resource.allocate", deploy(node, BOUND_ONE)), "node_down", "nodename")
    back = await wire.ok("resource.node-heartbeat", {"nodename": node, "ttl_seconds": 600})
    assert (back["status"], back["was"]) == ("up", "down")
    await capture.first(wire.subject(f"events.resource.{node}.up"), timeout=15)
    assert (await wire.ok("resource.list-nodes", {"nodenames": [node]}))["nodes"][0]["status"] == "up"


@pytest.mark.parametrize("payload, field", [
    ({"ttl_seconds": 5}, "nodename"),
    ({"nodename": "x"}, "ttl_seconds"),
    ({"nodename": "x", "ttl_seconds": "5"}, "ttl_seconds"),
    ({"nodename": "x", "ttl_seconds": 5, "draining": None}, "draining"),
    ({"nodename": "x", "ttl_seconds": 5, "agent": {"running": -1}}, "agent.running"),
])
async def test_a_malformed_heartbeat_is_invalid_argument_naming_the_field(wire, payload, field):
    assert_error(await wire.request("resource.node-heartbeat", payload), "invalid_argument", field)
