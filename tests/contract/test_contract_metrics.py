"""Contract: DESIGN.md §2, §5 and §8 ("All services", "Metrics") against a metrics agent process.

Every request is a plain `msgpack` map sent with nats-py; every reply and event is read raw. One
agent (`--node <name> --interval 1 --insurance-seconds 60 --cgroup-path /`) serves the module and
reads the real kernel; tests keep apart by metric names and entity ids of their own.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import pytest_asyncio

from tests.bus_helpers import EventLog
from tests.contract.conftest import ERROR_HEADER, Wire, WireReply, send_from_processes, unique

INSURANCE_SECONDS = 60


@dataclass
class Agent:
    wire: Wire
    node: str
    instance_id: str


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def agent(module_workers, wire: Wire):
    node = unique("node")
    worker = module_workers(
        "services.metrics.worker", "--node", node, "--interval", "1",
        "--insurance-seconds", str(INSURANCE_SECONDS), "--cgroup-path", "/",
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while True:  # until the first round is done (no responders can come right after "ready")
        try:
            if (await wire.ok(f"metrics.{node}.has-synced", {}, timeout=2))["synced"]:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the metrics agent did not finish its first round"
        await asyncio.sleep(0.05)
    return Agent(wire, node, worker.instance_id)


@dataclass
class Ctx:
    m: Wire
    redis: Any
    ns: str
    node: str
    instance_id: str
    cap: EventLog

    async def call(self, command: str, payload: Any) -> WireReply:
        return await self.m.request(f"metrics.{self.node}.{command}", payload)

    async def ok(self, command: str, payload: Any) -> Any:
        return (await self.call(command, payload)).expect_ok()

    async def put(self, scope: str, metric: str, value: float, **fields: Any) -> dict:
        return await self.ok("put", {"scope": scope, "metric": metric, "value": value, **fields})

    async def register(self, scope: str, metric: str, **fields: Any) -> str:
        return (await self.ok("register-notifier", {"scope": scope, "metric": metric, **fields}))["key"]

    def subject(self, scope: str, metric: str, *ids: str) -> str:
        return self.m.subject(".".join(["events.metrics", self.node, scope, *ids, metric]))

    async def event(self, subject: str, start: int = 0, timeout: float = 15.0) -> tuple[int, dict]:
        """The first event on `subject` at index `start` or later (waits for it)."""
        index = await self.cap.first(subject, after=start, timeout=timeout)
        return index, self.cap.events[index][1]

    async def sentinel(self) -> str:
        """A fresh metric, registered and then put: its event's subject, for `EventLog.before`."""
        metric = f"sentinel.{unique('s')}"
        await self.register("node", metric)
        await self.put("node", metric, 1.0)
        return self.subject("node", metric)

    async def quiet_since(self, mark: int) -> list[tuple[str, dict]]:
        return (await self.cap.before(await self.sentinel()))[mark:]

    # Redis keys of the agent (services/metrics/notifier_store.py), for the corruption tests.
    @property
    def index_key(self) -> str:
        return f"{self.ns}:metrics:{{{self.node}}}:notifiers"

    def registration_key(self, key: str) -> str:
        return f"{self.ns}:metrics:{{{self.node}}}:notifier:{key}"

    async def registrations(self) -> list[bytes]:
        return sorted(await self.redis.smembers(self.index_key))


@pytest_asyncio.fixture
async def ctx(agent, redis, namespace):
    cap = await agent.wire.capture(f"metrics.{agent.node}.>")
    yield Ctx(agent.wire, redis, namespace, agent.node, agent.instance_id, cap)
    await cap.close()


def assert_error(reply: WireReply, status: int, code: str, field: str | None = None) -> dict:
    """§2: headers `Nats-Service-Error-Code` (status) and `Nats-Service-Error` (message), body
    `{"error": {"code", "message", "details"}}`; `details.field` names the field when given."""
    assert not reply.ok, f"expected {code}, got success {reply.body!r}"
    assert (reply.status, reply.code) == (status, code), reply.body
    assert set(reply.body) == {"error"} and set(reply.error) == {"code", "message", "details"}
    assert isinstance(reply.error["message"], str) and reply.error["message"]
    assert reply.headers[ERROR_HEADER] == reply.error["message"]
    assert isinstance(reply.details, dict)
    if field is not None:
        assert reply.details.get("field") == field, reply.details
    return reply.details


def metric_name() -> str:
    return f"ext.{unique('m')}"


# -- worker options, has-synced, list -----------------------------------------------------------------


async def test_has_synced_reply_and_interval_option(ctx):
    # §8: "`has-synced` -> `{synced, failed: [provisioner names], interval_seconds}`"; "Worker option
    # `--node NAME`, `--interval SECONDS`" (this agent: --interval 1, answering on its node's subjects).
    reply = await ctx.ok("has-synced", {})
    assert set(reply) == {"synced", "failed", "interval_seconds"}
    assert reply["synced"] is True and reply["interval_seconds"] == 1.0
    assert isinstance(reply["failed"], list) and all(isinstance(name, str) for name in reply["failed"])


async def test_list_entries_shape(ctx):
    # §8: "`list` {scope?} -> `{entries: [{scope, metric, <ids>, value, time}]}`; `time` is unix
    # seconds (float) of the sample".
    metric, pod = metric_name(), unique("pod")
    await ctx.put("container", metric, 2.5, pod_uid=pod, container="c1", time=1_700_000_000.25)
    reply = await ctx.ok("list", {"scope": "container"})
    mine = [e for e in reply["entries"] if e["metric"] == metric]
    assert mine == [
        {"scope": "container", "metric": metric, "pod_uid": pod, "container": "c1", "value": 2.5,
         "time": 1_700_000_000.25}
    ]  # fmt: skip
    for entry in reply["entries"]:
        assert entry["scope"] == "container" and isinstance(entry["time"], float)
        assert set(entry) == {"scope", "metric", "pod_uid", "container", "value", "time"}


async def test_list_without_scope_lists_every_scope(ctx):
    # §8 `list` {scope?}: without a scope, every scope; each entry carries the ids its scope needs
    # (README: a page at a time, with the `total`).
    metric = metric_name()
    await ctx.put("cpu", metric, 1.0, core_id=7)
    await ctx.put("node", metric, 2.0)
    entries: list[dict] = []
    while True:
        page = await ctx.ok("list", {"offset": len(entries), "limit": 500})
        entries += page["entries"]
        if not page["entries"] or len(entries) >= page["total"]:
            break
    mine = sorted((e["scope"], e.get("core_id"), e["value"]) for e in entries if e["metric"] == metric)
    assert mine == [("cpu", 7, 1.0), ("node", None, 2.0)]
    node_entry = next(e for e in entries if e["metric"] == metric and e["scope"] == "node")
    assert set(node_entry) == {"scope", "metric", "value", "time"}


EVERY_SCOPE = {
    "node": {},
    "numa": {"numa_id": 500},
    "cpu": {"core_id": 500},
    "device": {"device": "disk-x"},
    "network": {"nic": "nic-x"},
    "container": {"pod_uid": "pod-x", "container": "c-x"},
    "container-numa": {"pod_uid": "pod-x", "container": "c-x", "numa_id": 500},
    "pod-volume": {"pod_uid": "pod-x", "volume": "vol-x"},
    "cgroup": {"cgroup_path": "/x"},
    "cgroup-numa": {"cgroup_path": "/x", "numa_id": 500},
}


@pytest.mark.parametrize("scope", EVERY_SCOPE)
async def test_every_scope_with_the_ids_it_needs(ctx, scope):
    # §5: "Scopes: node, numa, cpu, device, network, container, container-numa, pod-volume, cgroup,
    # cgroup-numa"; "The id keys are `numa_id`, `core_id`, `device`, `nic`, `pod_uid`, `container`,
    # `volume`, `cgroup_path`, as the scope needs them"; `get` {scope, metric, <ids>} -> {value, time}.
    metric, ids, sampled = metric_name(), EVERY_SCOPE[scope], time.time() - 1
    stored = await ctx.put(scope, metric, 1.5, time=sampled, **ids)
    assert stored == {"value": 1.5, "time": sampled}
    assert await ctx.ok("get", {"scope": scope, "metric": metric, **ids}) == stored
    [entry] = [e for e in (await ctx.ok("list", {"scope": scope}))["entries"] if e["metric"] == metric]
    assert entry == {"scope": scope, "metric": metric, **ids, **stored}
    for name in ids:  # each id is needed
        missing = {k: v for k, v in ids.items() if k != name}
        reply = await ctx.call("get", {"scope": scope, "metric": metric, **missing})
        assert_error(reply, 400, "invalid_argument", name)


async def test_kernel_metrics_carry_katalysts_names(ctx):
    # §5: "Metric names follow katalyst's (`cpu.usage.ratio.cpu`, `mem.total.system`, ...)";
    # "Provisioners read the kernel directly: /proc ...".
    with open("/proc/meminfo") as meminfo:
        total_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    assert (await ctx.ok("get", {"scope": "node", "metric": "mem.total.system"}))["value"] == total_kib * 1024
    deadline = time.monotonic() + 10  # a ratio needs two rounds
    ratio = {"scope": "cpu", "metric": "cpu.usage.ratio.cpu", "core_id": 0}
    while not (reply := await ctx.call("get", ratio)).ok:
        assert time.monotonic() < deadline, reply.body
        await asyncio.sleep(0.2)
    assert 0 <= reply.body["value"] <= 1


async def test_register_renew_and_deregister_replies(ctx):
    # §5: "`register-notifier` {scope, metric, <ids>} -> {key, lease_seconds}; `renew-notifier` /
    # `deregister-notifier` {key}" (README: renew -> {key, lease_seconds}, deregister -> {removed}).
    lease = await ctx.ok("register-notifier", {"scope": "node", "metric": metric_name(), "lease_seconds": 20})
    assert set(lease) == {"key", "lease_seconds"} and lease["lease_seconds"] == 20
    assert await ctx.ok("renew-notifier", {"key": lease["key"]}) == lease
    assert await ctx.ok("deregister-notifier", {"key": lease["key"]}) == {"removed": True}
    assert_error(await ctx.call("renew-notifier", {"key": lease["key"]}), 404, "notifier_not_found", "key")


async def test_put_without_time_uses_now(ctx):
    # §8: "`put` without `time` uses now".
    metric = metric_name()
    before = time.time()
    reply = await ctx.put("node", metric, 4.0)
    after = time.time()
    assert set(reply) == {"value", "time"} and reply["value"] == 4.0
    assert before <= reply["time"] <= after
    assert await ctx.ok("get", {"scope": "node", "metric": metric}) == reply


async def test_put_entries_are_never_removed_by_discovery_clean_up(ctx):
    # §8: "Entries written with `put` are never removed by discovery clean-up": a put for a cgroup
    # and a pod that do not exist survives the cgroup rounds (which forget cgroups and pods they
    # did not find) that come after it.
    metric, pod, path = metric_name(), unique("ghost"), f"/{unique('no-such-cgroup')}"
    put = await ctx.put("cgroup", metric, 1.0, cgroup_path=path)
    await ctx.put("container", metric, 2.0, pod_uid=pod, container="c1")

    rounds: set[float] = set()  # sample times of the sampled cgroup "/" seen after the put
    deadline = time.monotonic() + 15
    while len(rounds) < 2:  # two cgroup rounds, each followed by its clean-up
        assert time.monotonic() < deadline, "the cgroup provisioner ran no round after the put"
        await asyncio.sleep(0.1)
        entries = (await ctx.ok("list", {"scope": "cgroup", "limit": 2000}))["entries"]
        rounds |= {e["time"] for e in entries if e["cgroup_path"] == "/" and e["time"] > put["time"]}
    assert (await ctx.ok("get", {"scope": "cgroup", "metric": metric, "cgroup_path": path}))["value"] == 1.0
    got = await ctx.ok("get", {"scope": "container", "metric": metric, "pod_uid": pod, "container": "c1"})
    assert got["value"] == 2.0


async def test_put_with_ttl_seconds_expires(ctx):
    # §8: "`put` with `ttl_seconds` makes them expire".
    metric = metric_name()
    await ctx.put("node", metric, 1.0, ttl_seconds=3)
    assert (await ctx.ok("get", {"scope": "node", "metric": metric}))["value"] == 1.0
    deadline = time.monotonic() + 15
    while (reply := await ctx.call("get", {"scope": "node", "metric": metric})).ok:
        assert time.monotonic() < deadline, "the value did not expire"
        await asyncio.sleep(0.2)
    assert_error(reply, 404, "metric_not_found")
    listed = await ctx.ok("list", {"scope": "node"})
    assert metric not in [e["metric"] for e in listed["entries"]]


async def test_unknown_keys_are_refused_and_ids_the_scope_does_not_need_ignored(ctx):
    # §2: "Unknown keys ... are rejected with `invalid_argument` naming the field"; §8: "Unknown keys
    # are refused at every level". An id key the scope does not need is known, so ignored.
    metric = metric_name()
    reply = await ctx.call("put", {"scope": "node", "metric": metric, "value": 1, "colour": "red"})
    assert_error(reply, 400, "invalid_argument", "colour")
    assert "accepted: " in reply.error["message"] and "metric" in reply.details["accepted"]
    assert_error(await ctx.call("get", {"scope": "node", "metric": metric}), 404, "metric_not_found")
    await ctx.ok("put", {"scope": "node", "metric": metric, "value": 1, "pod_uid": "x"})
    assert (await ctx.ok("get", {"scope": "node", "metric": metric, "pod_uid": "y"}))["value"] == 1.0
    pods = [{"uid": "p", "container": ["c"]}]
    reply = await ctx.call("aggregate", {"kind": "pods", "agg": "sum", "metric": metric, "pods": pods})
    assert_error(reply, 400, "invalid_argument", "pods[0].container")


# -- aggregations ---------------------------------------------------------------------------------------


async def put_containers(ctx: Ctx, metric: str, values: dict[tuple[str, str], float]) -> None:
    for (pod, container), value in values.items():
        await ctx.put("container", metric, value, pod_uid=pod, container=container)


async def aggregate(ctx: Ctx, kind: str, agg: str, metric: str, **fields: Any) -> dict:
    return await ctx.ok("aggregate", {"kind": kind, "agg": agg, "metric": metric, **fields})


async def test_aggregate_counts_a_pod_listed_twice_once(ctx):
    # §8: "Aggregations follow katalyst: a pod listed twice counts once".
    metric, pod = metric_name(), unique("pod")
    await put_containers(ctx, metric, {(pod, "c1"): 1.0, (pod, "c2"): 2.0})
    pods = [{"uid": pod, "containers": ["c1", "c2"]}] * 2
    assert (await aggregate(ctx, "pods", "sum", metric, pods=pods))["value"] == 3.0
    assert (await aggregate(ctx, "pods", "avg", metric, pods=pods))["value"] == 3.0


async def test_aggregate_avg_divides_by_those_with_data(ctx):
    # §8: "`avg` divides by the pods (or CPUs) that had data".
    metric, a, b, c = metric_name(), unique("pod"), unique("pod"), unique("pod")
    await put_containers(ctx, metric, {(a, "c1"): 1.0, (a, "c2"): 2.0, (c, "c1"): 5.0})
    pods = [{"uid": a, "containers": ["c1", "c2"]}, {"uid": b, "containers": ["c1"]}]
    pods.append({"uid": c, "containers": ["c1"]})
    assert (await aggregate(ctx, "pods", "avg", metric, pods=pods))["value"] == 4.0  # (3 + 5) / 2
    await ctx.put("container-numa", metric, 6.0, pod_uid=a, container="c1", numa_id=0)
    reply = await aggregate(ctx, "pods-numa", "avg", metric, pods=pods, numa_id=0)
    assert reply["value"] == 6.0  # only pod a has data on NUMA node 0
    cores = 100_000  # ids no kernel CPU has
    await ctx.put("cpu", metric, 1.0, core_id=cores)
    await ctx.put("cpu", metric, 3.0, core_id=cores + 1)
    cpuset = f"{cores}-{cores + 3}"
    assert (await aggregate(ctx, "cores", "avg", metric, cpuset=cpuset))["value"] == 2.0
    assert (await aggregate(ctx, "cores", "sum", metric, cpuset=cpuset))["value"] == 4.0


@pytest.mark.parametrize("kind", ["pods", "pods-numa", "cores"])
async def test_aggregate_without_data_is_zero_now(ctx, kind):
    # §8: "no data gives `{value: 0, time: now}`".
    fields = {
        "pods": {"pods": [{"uid": unique("pod"), "containers": ["c1"]}]},
        "pods-numa": {"pods": [{"uid": unique("pod"), "containers": ["c1"]}], "numa_id": 0},
        "cores": {"cpuset": "0-1"},
    }[kind]
    before = time.time()
    reply = await aggregate(ctx, kind, "avg", metric_name(), **fields)
    assert reply["value"] == 0 and before <= reply["time"] <= time.time()
    assert set(reply) == {"value", "time"}


INVALID = [
    ("agg", "aggregate", {"kind": "pods", "agg": "max", "metric": "m", "pods": []}, "agg"),
    ("kind", "aggregate", {"kind": "racks", "agg": "sum", "metric": "m"}, "kind"),
    ("get-scope", "get", {"scope": "galaxy", "metric": "m"}, "scope"),
    ("put-scope", "put", {"scope": "galaxy", "metric": "m", "value": 1}, "scope"),
    ("list-scope", "list", {"scope": "galaxy"}, "scope"),
    ("nan-value", "put", {"scope": "node", "metric": "m", "value": math.nan}, "value"),
    ("missing-value", "put", {"scope": "node", "metric": "m"}, "value"),
    ("string-value", "put", {"scope": "node", "metric": "m", "value": "1"}, "value"),
    ("negative-core", "get", {"scope": "cpu", "metric": "m", "core_id": -1}, "core_id"),
    ("missing-id", "get", {"scope": "container", "metric": "m", "pod_uid": "p"}, "container"),
    ("null-id", "get", {"scope": "numa", "metric": "m", "numa_id": None}, "numa_id"),
    ("nan-time", "put", {"scope": "node", "metric": "m", "value": 1, "time": math.nan}, "time"),
    ("not-a-map", "get", b"\x92\xa4node\xa1m", "$"),
]  # fmt: skip


@pytest.mark.parametrize("command,payload,field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
async def test_bad_agg_scope_kind_and_nan_are_invalid_argument(ctx, command, payload, field):
    # §8: "an `agg` other than `sum`/`avg`, an unknown `scope` or `kind`, and a NaN value are
    # `invalid_argument`"; §2: "missing required keys, wrong types, negative or NaN quantities are
    # rejected with `invalid_argument` naming the field".
    assert_error(await ctx.call(command, payload), 400, "invalid_argument", field)


# -- errors -------------------------------------------------------------------------------------------


MISSING = {
    # case: pod uid -> (scope, stored ids, asked ids, metric asked is the stored one, expected details)
    "pod": lambda p: ("container", {"pod_uid": p, "container": "c1"},
                      {"pod_uid": f"{p}-2", "container": "c1"}, True,
                      {"missing": "entity", "entity": "pod", "pod_uid": f"{p}-2"}),
    "container": lambda p: ("container", {"pod_uid": p, "container": "c1"}, {"pod_uid": p, "container": "c2"},
                            True, {"missing": "entity", "entity": "container", "container": "c2"}),
    "core": lambda p: ("cpu", {"core_id": 200_000}, {"core_id": 200_001}, True,
                       {"missing": "entity", "entity": "cpu", "core_id": 200_001}),
    "metric": lambda p: ("container", {"pod_uid": p, "container": "c1"}, {"pod_uid": p, "container": "c1"},
                         False, {"missing": "metric"}),
    "node-metric": lambda p: ("node", {}, {}, False, {"missing": "metric"}),
}  # fmt: skip


@pytest.mark.parametrize("case", MISSING)
async def test_metric_not_found_says_whether_entity_or_metric_is_missing_and_names_it(ctx, case):
    # §8: "`metric_not_found` details say whether the entity (node, pod, container, core...) or the
    # metric is missing, and name it."
    scope, stored, asked, same_metric, expected = MISSING[case](unique("pod"))
    metric = metric_name()
    await ctx.put(scope, metric, 1.0, **stored)
    wanted = metric if same_metric else f"{metric}.other"
    reply = await ctx.call("get", {"scope": scope, "metric": wanted, **asked})
    details = assert_error(reply, 404, "metric_not_found")
    assert expected.items() <= details.items(), details
    assert details["metric"] == wanted


async def test_metric_expired_after_the_insurance_period(ctx):
    # §5: "Staleness: an optional insurance period returns the value with `metric_expired`" (this
    # agent: --insurance-seconds 60); a fresher value is answered normally.
    metric = metric_name()
    sampled = time.time() - 2 * INSURANCE_SECONDS
    await ctx.put("numa", metric, 42.0, numa_id=0, time=sampled)
    reply = await ctx.call("get", {"scope": "numa", "metric": metric, "numa_id": 0})
    details = assert_error(reply, 412, "metric_expired")
    assert (details["value"], details["time"]) == (42.0, sampled)
    fresh = await ctx.put("numa", metric, 43.0, numa_id=0, time=time.time() - INSURANCE_SECONDS / 2)
    assert await ctx.ok("get", {"scope": "numa", "metric": metric, "numa_id": 0}) == fresh


async def test_notifier_not_found(ctx):
    # §2/README: renewing an unknown registration is `notifier_not_found` (404) naming `key`.
    reply = await ctx.call("renew-notifier", {"key": "0" * 32})
    assert_error(reply, 404, "notifier_not_found", "key")


async def test_notifier_key_with_a_trailing_newline_is_invalid(ctx):
    reply = await ctx.call("renew-notifier", {"key": "0" * 32 + "\n"})
    assert_error(reply, 400, "invalid_argument", "key")


async def test_internal_error_is_500(ctx):
    # §8: "500 `internal`" (a registration that Redis cannot read as one).
    key = await ctx.register("node", metric_name(), lease_seconds=60)
    async with corrupted(ctx.redis, ctx.registration_key(key)):
        assert_error(await ctx.call("renew-notifier", {"key": key}), 500, "internal")


@asynccontextmanager
async def corrupted(redis, key: str):
    """Replace `key` by a string (so every command on it fails), and put it back afterwards."""
    dumped, ttl = await redis.dump(key), await redis.pttl(key)
    await redis.set(key, b"not what the agent wrote")
    try:
        yield
    finally:
        await redis.delete(key)
        if dumped is not None:
            await redis.restore(key, max(ttl, 0), dumped)


# -- events -------------------------------------------------------------------------------------------


EVENT_SCOPES = {
    # scope: (ids, their subject tokens in order)
    "node": ({}, []),
    "cpu": ({"core_id": 300_000}, ["300000"]),
    "container": ({"pod_uid": "pod-a", "container": "web"}, ["pod-a", "web"]),
    "container-numa": ({"pod_uid": "pod-a", "container": "web", "numa_id": 1}, ["pod-a", "web", "1"]),
    "cgroup-numa": ({"cgroup_path": "/kubepods/besteffort", "numa_id": 0}, ["/kubepods/besteffort", "0"]),
}


@pytest.mark.parametrize("scope", EVENT_SCOPES)
async def test_metric_event_subject_and_body(ctx, scope):
    # §5: "Change events: `berth.events.metrics.<node>.<scope>[.<id>...].<metric name tokens>`";
    # §8: "Event body: `{type: "metric", time, scope, metric, value, sample_time, <ids>}`".
    ids, tokens = EVENT_SCOPES[scope]
    metric = f"{metric_name()}.usage.rate"  # a name of several tokens
    await ctx.register(scope, metric, **ids)
    sampled = time.time() - 1
    await ctx.put(scope, metric, 7.5, time=sampled, **ids)
    _, body = await ctx.event(ctx.subject(scope, metric, *tokens))
    assert set(body) == {"type", "time", "scope", "metric", "value", "sample_time", *ids}
    assert (body["type"], body["scope"], body["metric"], body["value"]) == ("metric", scope, metric, 7.5)
    assert body["sample_time"] == sampled and isinstance(body["time"], float) and body["time"] >= sampled
    assert {name: body[name] for name in ids} == ids


async def test_a_second_sample_with_the_same_timestamp_publishes_nothing(ctx):
    # §8: "A second sample with the same timestamp publishes nothing, whatever its value."
    metric = metric_name()
    await ctx.register("node", metric)
    sampled = time.time()
    await ctx.put("node", metric, 1.0, time=sampled)
    index, _ = await ctx.event(ctx.subject("node", metric))
    await ctx.put("node", metric, 2.0, time=sampled)
    assert await ctx.quiet_since(index + 1) == []
    await ctx.put("node", metric, 3.0, time=sampled + 1)  # a new timestamp is published
    _, body = await ctx.event(ctx.subject("node", metric), index + 1)
    assert (body["value"], body["sample_time"]) == (3.0, sampled + 1)


async def test_no_event_where_nobody_registered_interest(ctx):
    # §5: change events are published "only where someone registered interest".
    metric = metric_name()
    mark = len(ctx.cap.events)
    await ctx.put("node", metric, 1.0)
    assert await ctx.quiet_since(mark) == []


async def test_registrations_are_leases(ctx):
    # §5: "(registrations are leases)": a registration not renewed ends, and its events with it.
    metric = metric_name()
    key = await ctx.register("node", metric, lease_seconds=1)
    deadline = time.monotonic() + 10
    while await ctx.redis.exists(ctx.registration_key(key)):  # (asking the agent would renew it)
        assert time.monotonic() < deadline, "the lease did not end"
        await asyncio.sleep(0.1)
    assert_error(await ctx.call("renew-notifier", {"key": key}), 404, "notifier_not_found", "key")
    mark = len(ctx.cap.events)
    await ctx.put("node", metric, 1.0)
    assert await ctx.quiet_since(mark) == []


async def test_events_are_replayed_from_the_stream(ctx, nc, namespace):
    # §2: "A JetStream stream ... keeps them for replay": metric samples in `<prefix>-metrics` (an
    # hour, at most 600 per metric: a sample a second must not crowd out the day of change events).
    metric = metric_name()
    await ctx.register("cpu", metric, core_id=400_000)
    await ctx.put("cpu", metric, 9.0, core_id=400_000)
    subject = ctx.subject("cpu", metric, "400000")
    _, body = await ctx.event(subject)
    info = await nc.jetstream().stream_info(f"{namespace}-metrics")
    assert (info.config.subjects, info.config.max_msgs_per_subject) == ([f"{namespace}.events.metrics.>"], 600)
    replay = await nc.jetstream().subscribe(subject, stream=f"{namespace}-metrics", ordered_consumer=True)
    try:
        stored = await replay.next_msg(timeout=5)
    finally:
        await replay.unsubscribe()
    assert msgpack.unpackb(stored.data) == body


# -- request_id on every state-changing command -------------------------------------------------------


@dataclass
class Idempotent:
    """How to exercise one state-changing command's `request_id` (see the broker module).

    prepare: the payload of a successful request (making what it needs).
    settle: after the first success, wait for what it publishes.
    state: what a retry must leave unchanged, read after the first answer (`same` compares).
    failing: a payload refused by the command's handler (None: the command refuses nothing but
             malformed input, which is refused before its request id is read).
    """

    prepare: Callable[[Ctx], Awaitable[dict]]
    state: Callable[[Ctx, dict], Awaitable[Any]]
    other: Callable[[dict], dict]
    corrupt: Callable[[Ctx, dict], str]
    failing: Callable[[Ctx], Awaitable[dict]] | None = None
    settle: Callable[[Ctx, dict, int], Awaitable[None]] | None = None
    same: Callable[[Any, Any], bool] = lambda before, after: before == after


async def _register_prepare(c: Ctx) -> dict:
    return {"scope": "node", "metric": metric_name(), "lease_seconds": 60}


async def _registered(c: Ctx) -> dict:
    return {"key": await c.register("node", metric_name(), lease_seconds=60)}


async def _lease_left(c: Ctx, payload: dict) -> Any:
    """Registrations, and the time left on this registration's lease (a renewal restarts it)."""
    return await c.registrations(), await c.redis.pttl(c.registration_key(payload["key"]))


async def _lease_running_down(c: Ctx, payload: dict, mark: int) -> None:
    """Until the renewed lease has visibly run down a little, so that a restart would show."""
    deadline = time.monotonic() + 5
    while await c.redis.pttl(c.registration_key(payload["key"])) >= 60_000 - 50:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def _put_prepare(c: Ctx) -> dict:
    metric = metric_name()
    await c.register("node", metric)
    return {"scope": "node", "metric": metric, "value": 1.0}


async def _put_published(c: Ctx, payload: dict, mark: int) -> None:
    await c.event(c.subject("node", payload["metric"]), mark)


async def _stored_value(c: Ctx, payload: dict) -> Any:
    return await c.ok("get", {"scope": "node", "metric": payload["metric"]})


async def _registrations(c: Ctx, payload: dict) -> Any:
    return await c.registrations()


async def _renew_failing(c: Ctx) -> dict:
    key = await c.register("node", metric_name())
    await c.ok("deregister-notifier", {"key": key})
    return {"key": key}  # notifier_not_found


def _idem_key(c: Ctx, payload: dict) -> str:
    # `put` keeps nothing in Redis but its answer to the request id (one per agent instance: see
    # bus/service.py); corrupting that entry is the way to make it fail with `internal`.
    return f"{c.ns}:idem:{c.ns}-metrics:metrics.{c.node}.put@{c.instance_id}:{payload['request_id']}"


IDEMPOTENT = {
    "register-notifier": Idempotent(
        _register_prepare, _registrations, lambda p: {**p, "lease_seconds": 30},
        lambda c, p: c.index_key,
    ),
    "renew-notifier": Idempotent(
        _registered, _lease_left, lambda p: {**p, "key": "f" * 32},
        lambda c, p: c.registration_key(p["key"]), failing=_renew_failing, settle=_lease_running_down,
        # The lease keeps running down: a second renewal would have restarted it.
        same=lambda before, after: after[0] == before[0] and after[1] <= before[1],
    ),
    "deregister-notifier": Idempotent(
        _registered, _registrations, lambda p: {**p, "key": "f" * 32}, lambda c, p: c.index_key,
    ),
    "put": Idempotent(
        _put_prepare, _stored_value, lambda p: {**p, "value": 2.0}, _idem_key,
        settle=_put_published,
    ),
}  # fmt: skip


async def request_id_payload(c: Ctx, case: Idempotent) -> dict:
    return {**await case.prepare(c), "request_id": unique("rid")}


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_retry_replays_the_first_answer_and_changes_nothing(ctx, command):
    # §2: "Commands that change state accept an optional `request_id`; a retry with the same id
    # within 24 h returns the first answer and changes nothing."
    case = IDEMPOTENT[command]
    payload = await request_id_payload(ctx, case)
    mark = len(ctx.cap.events)
    first = await ctx.call(command, payload)
    assert first.ok, first.body
    if case.settle:
        await case.settle(ctx, payload, mark)
    before = await case.state(ctx, {**payload, **first.body})
    mark = len(ctx.cap.events)
    again = await ctx.call(command, payload)
    assert (again.data, again.headers) == (first.data, first.headers)
    after = await case.state(ctx, {**payload, **first.body})
    assert case.same(before, after), (before, after)
    assert await ctx.quiet_since(mark) == []


async def test_request_id_deregister_retry_still_says_removed(ctx):
    # The first answer, not a second run's: a deregistration retried says `removed: true` again.
    key = await ctx.register("node", metric_name())
    payload = {"key": key, "request_id": unique("rid")}
    assert await ctx.ok("deregister-notifier", payload) == {"removed": True}
    assert await ctx.ok("deregister-notifier", payload) == {"removed": True}
    assert await ctx.ok("deregister-notifier", {"key": key}) == {"removed": False}


@pytest.mark.parametrize("command", [command for command, case in IDEMPOTENT.items() if case.failing])
async def test_request_id_error_reply_is_replayed(ctx, command):
    # §2 "returns the first answer": an error answer is kept and replayed too. (deregister-notifier
    # answers every well-formed request; `internal` and malformed requests are not kept: below.)
    payload = {**await IDEMPOTENT[command].failing(ctx), "request_id": unique("rid")}
    first = await ctx.call(command, payload)
    assert not first.ok
    again = await ctx.call(command, payload)
    assert (again.data, again.headers) == (first.data, first.headers)
    stored = [k async for k in ctx.redis.scan_iter(match=f"{ctx.ns}:idem:*:{payload['request_id']}")]
    assert len(stored) == 1


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_malformed_request_is_not_kept(ctx, command):
    # §2 request_id, refined: a request refused as malformed (400) did nothing, so nothing is kept
    # for its id, and the corrected request with the same id runs.
    payload = await request_id_payload(ctx, IDEMPOTENT[command])
    malformed = {**payload, "scope": "no-such-scope"} if "scope" in payload else {"request_id": payload["request_id"]}
    assert_error(await ctx.call(command, malformed), 400, "invalid_argument")
    assert [k async for k in ctx.redis.scan_iter(match=f"{ctx.ns}:idem:*:{payload['request_id']}")] == []
    corrected = await ctx.call(command, payload)
    assert corrected.ok, corrected.body


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_reused_with_another_payload_is_refused(ctx, command):
    # A request id names one request: reused for another payload it is refused, changing nothing.
    case = IDEMPOTENT[command]
    payload = await request_id_payload(ctx, case)
    mark = len(ctx.cap.events)
    first = await ctx.call(command, payload)
    assert first.ok
    if case.settle:
        await case.settle(ctx, payload, mark)
    other = case.other(payload)
    registrations = await ctx.registrations()
    mark = len(ctx.cap.events)
    assert_error(await ctx.call(command, other), 400, "invalid_argument", "request_id")
    assert await ctx.registrations() == registrations
    if command == "put":
        assert await _stored_value(ctx, payload) == first.body
    assert await ctx.quiet_since(mark) == []


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_internal_error_is_not_stored(ctx, command):
    # An `internal` error is not the answer to keep: once the cause is repaired, the retry runs.
    case = IDEMPOTENT[command]
    payload = await request_id_payload(ctx, case)
    async with corrupted(ctx.redis, case.corrupt(ctx, payload)):
        assert_error(await ctx.call(command, payload), 500, "internal")
    retried = await ctx.call(command, payload)
    assert retried.ok, retried.body


async def test_request_id_retries_from_two_processes_at_once_have_one_effect(ctx, nats_url):
    # §2 request_id across clients: one registration sent by two processes at once registers once,
    # and both get the same answer.
    before = await ctx.registrations()
    payload = {"scope": "node", "metric": metric_name(), "request_id": unique("rid")}
    subject = ctx.m.subject(f"metrics.{ctx.node}.register-notifier")
    replies = await send_from_processes(nats_url, subject, msgpack.packb(payload))
    assert replies[0].data == replies[1].data
    key = replies[0].expect_ok()["key"]
    after = await ctx.registrations()
    assert sorted(set(after) - set(before)) == [key.encode()]
