"""The metrics service over a real nats-server and Redis: every command, every error, bad input.

Most tests run the agent in this process (fast, and its store can be inspected); one runs it as a
worker process the way `berth up` does. Values are written with `put` where a test needs exact
numbers, and read from the kernel where it checks the provisioners' plumbing.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import msgpack
import pytest

from schemas.errors import BusError
from schemas.metric_scopes import PodRef
from services.metrics.client import MetricsClient
from services.metrics.commands import COMMANDS
from services.metrics.config import MetricsServiceConfig
from services.metrics.provisioners import Provisioner
from services.metrics.worker import MetricsWorker
from tests.bus_helpers import eventually, idempotency_keys, with_request_id

NODE = "n1"


@pytest.fixture
async def start_agent(nc, redis, prefix, serve):
    """Start an in-process agent for node n1 (options and provisioners as the test asks)."""
    workers: list[MetricsWorker] = []

    async def start(provisioners=None, **options) -> MetricsWorker:
        worker = MetricsWorker(nc, redis, prefix, MetricsServiceConfig(node=NODE, **options), provisioners=provisioners)
        worker.start()
        workers.append(worker)
        await serve(worker.service)
        return worker

    yield start
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def agent(start_agent) -> MetricsWorker:
    """An agent with no provisioners: only what the test puts is stored."""
    return await start_agent(provisioners=[], insurance_seconds=60)


@pytest.fixture
def metrics(nc, prefix) -> MetricsClient:
    return MetricsClient(nc, NODE, prefix=prefix)


async def wait_synced(metrics: MetricsClient, timeout: float = 10.0):
    """has-synced, polled until the first round is done. Every endpoint answers from the start (a
    worker prints "ready" only once its subscriptions are in place: bus/runner.py)."""

    async def synced():
        answer = await metrics.has_synced()
        return answer if answer.synced else None

    return await eventually(synced, timeout=timeout)


async def error_of(call) -> BusError:
    with pytest.raises(BusError) as caught:
        await call
    return caught.value


# -- has-synced and the kernel's values ---------------------------------------------------------


class Gated(Provisioner):
    """A provisioner whose first round says it started, then waits until the test opens the gate."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__(interval=1.0)
        self.started = threading.Event()
        self.gate = threading.Event()

    def _collect(self, batch, now) -> None:
        self.started.set()
        self.gate.wait(10)
        batch.add("node", (), "gated.metric", 1.0)


class Broken(Provisioner):
    name = "broken"

    def _collect(self, batch, now) -> None:
        raise OSError("cannot read /proc/broken")


async def test_has_synced_turns_true_after_the_first_round_and_names_the_failed(start_agent, metrics):
    gated = Gated()
    await start_agent(provisioners=[gated, Broken()], interval=2.0)
    assert await asyncio.to_thread(gated.started.wait, 10)  # the first round is under way ...
    assert (await metrics.has_synced()).synced is False  # ... so it is not done
    gated.gate.set()
    synced = await wait_synced(metrics)
    assert (synced.failed, synced.interval_seconds) == (["broken"], 2.0)
    assert (await metrics.get("node", "gated.metric")).value == 1.0


async def test_get_reads_node_metrics_from_the_kernel(start_agent, metrics):
    before = time.time()
    await start_agent(interval=1.0)
    assert (await wait_synced(metrics)).failed == []
    cpus = await metrics.get("node", "cpu.total.system")
    with open("/proc/stat") as f:
        assert cpus.value == sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())
    assert before <= cpus.time <= time.time()
    assert (await metrics.get("node", "mem.total.system")).value > 0
    # Rates need a second round: one interval later the node's CPU usage is there too.
    async def usage():
        try:
            return await metrics.get("node", "cpu.usage.ratio.system")
        except BusError as error:
            assert error.code == "metric_not_found"
            return None

    assert 0 <= (await eventually(usage, timeout=10, interval=0.2)).value <= 1


# -- put, get, list -------------------------------------------------------------------------------

EVERY_SCOPE = [
    ("node", {}),
    ("numa", {"numa_id": 0}),
    ("cpu", {"core_id": 3}),
    ("device", {"device": "vda"}),
    ("network", {"nic": "eth0"}),
    ("container", {"pod_uid": "p1", "container": "c1"}),
    ("container-numa", {"pod_uid": "p1", "container": "c1", "numa_id": 1}),
    ("pod-volume", {"pod_uid": "p1", "volume": "data"}),
    ("cgroup", {"cgroup_path": "/kubepods/burstable"}),
    ("cgroup-numa", {"cgroup_path": "/kubepods/burstable", "numa_id": 0}),
]


@pytest.mark.parametrize("scope,ids", EVERY_SCOPE, ids=[scope for scope, _ in EVERY_SCOPE])
async def test_put_then_get_and_list_in_every_scope(agent, metrics, scope, ids):
    stored = await metrics.put(scope, "ext.metric", 2.5, time=1_700_000_000.5, **ids)
    assert (stored.value, stored.time) == (2.5, 1_700_000_000.5)
    # The insurance period is on (60 s): so old a value comes back with metric_expired (below);
    # a fresh one is read normally.
    now = time.time()
    await metrics.put(scope, "ext.fresh", 7, time=now, **ids)
    got = await metrics.get(scope, "ext.fresh", **ids)
    assert (got.value, got.time) == (7.0, now)
    listing = await metrics.list(scope)
    assert listing.total == 2
    assert [(e.scope, e.metric, e.ids(), e.value) for e in listing.entries] == [
        (scope, "ext.fresh", ids, 7.0),
        (scope, "ext.metric", ids, 2.5),
    ]


async def test_put_without_time_is_stamped_now_and_a_ttl_makes_it_expire(nc, redis, prefix, serve, metrics):
    # The agent's store reads the test's clock: "now" and "later" are what the test says, not sleeps.
    now = time.time()
    worker = MetricsWorker(nc, redis, prefix, MetricsServiceConfig(node=NODE), provisioners=[], clock=lambda: now)
    worker.start()
    try:
        await serve(worker.service)
        stored = await metrics.put("node", "ext.short", 1.0, ttl_seconds=0.5)
        assert stored.time == now
        now += 0.25
        assert (await metrics.get("node", "ext.short")) == stored  # within its TTL
        now += 0.25
        error = await error_of(metrics.get("node", "ext.short"))  # the TTL is over
        assert (error.code, error.details["missing"]) == ("metric_not_found", "metric")
    finally:
        await worker.stop()


async def test_list_pages_in_order_and_filters_by_scope(agent, metrics):
    now = time.time()
    for core in (2, 0, 1):
        await metrics.put("cpu", "ext.load", core, core_id=core, time=now)
    await metrics.put("node", "ext.one", 1, time=now)
    everything = await metrics.list()
    assert everything.total == 4
    # Scopes in the order of metrics_list.SCOPES, then ids, then metric names.
    assert [(e.scope, e.ids()) for e in everything.entries] == [
        ("node", {}), ("cpu", {"core_id": 0}), ("cpu", {"core_id": 1}), ("cpu", {"core_id": 2}),
    ]
    page = await metrics.list("cpu", offset=1, limit=1)
    assert (page.total, [e.core_id for e in page.entries]) == (3, [1])


async def test_missing_entity_and_missing_metric_are_told_apart(agent, metrics, nc, prefix):
    await metrics.put("container", "ext.m", 1, pod_uid="p1", container="c1", time=time.time())
    cases = [
        ({"pod_uid": "p2", "container": "c1"}, "ext.m", {"missing": "entity", "entity": "pod"}),
        ({"pod_uid": "p1", "container": "c2"}, "ext.m", {"missing": "entity", "entity": "container"}),
        ({"pod_uid": "p1", "container": "c1"}, "ext.other", {"missing": "metric"}),
    ]
    for ids, metric, expected in cases:
        error = await error_of(metrics.get("container", metric, **ids))
        assert (error.code, error.status) == ("metric_not_found", 404)
        assert expected.items() <= error.details.items()
        assert error.details["metric"] == metric and error.details["pod_uid"] == ids["pod_uid"]
    node_error = await error_of(metrics.get("node", "no.such.metric"))
    assert node_error.details["missing"] == "metric" and "no.such.metric" in node_error.message
    # The reply is plain MessagePack with the error headers of DESIGN.md §2.
    request = msgpack.packb({"scope": "cpu", "metric": "x", "core_id": 9})
    raw = await nc.request(f"{prefix}.metrics.{NODE}.get", request)
    assert raw.headers["Nats-Service-Error-Code"] == "404"
    body = msgpack.unpackb(raw.data)
    assert body["error"]["code"] == "metric_not_found" and body["error"]["details"]["entity"] == "cpu"


async def test_stale_value_comes_back_with_metric_expired(agent, metrics):
    sampled = time.time() - 120  # older than the 60 s insurance period
    await metrics.put("numa", "ext.old", 42.0, numa_id=0, time=sampled)
    error = await error_of(metrics.get("numa", "ext.old", numa_id=0))
    assert (error.code, error.status) == ("metric_expired", 412)
    assert (error.details["value"], error.details["time"]) == (42.0, sampled)
    # Aggregations never check staleness (katalyst's rule).
    await metrics.put("cpu", "ext.old", 1.0, core_id=0, time=sampled)
    assert (await metrics.aggregate("cores", "sum", "ext.old", cpuset="0")).value == 1.0


# -- aggregate ----------------------------------------------------------------------------------


async def test_aggregate_follows_katalysts_divisor_rules(agent, metrics):
    now = time.time()
    for pod, container, value in (("p1", "c1", 1), ("p1", "c2", 1), ("p2", "c3", 1)):
        await metrics.put("container", "ext.cpu", value, pod_uid=pod, container=container, time=now)
        await metrics.put(
            "container-numa", "ext.mem", value * 10, pod_uid=pod, container=container, numa_id=0, time=now
        )
    p1 = PodRef("p1", ["c1", "c2"])
    pods = [p1, PodRef("p2", ["c3"]), PodRef("p3", ["c9"]), p1]
    # A pod listed twice counts once; a pod without data does not count in the average.
    assert (await metrics.aggregate("pods", "sum", "ext.cpu", pods=pods)).value == 3
    assert (await metrics.aggregate("pods", "avg", "ext.cpu", pods=pods)).value == 1.5
    assert (await metrics.aggregate("pods-numa", "sum", "ext.mem", pods=pods, numa_id=0)).value == 30
    for cpu, value in ((0, 1), (1, 2), (2, 1)):
        await metrics.put("cpu", "ext.ratio", value, core_id=cpu, time=now)
    assert (await metrics.aggregate("cores", "sum", "ext.ratio", cpuset="0-3")).value == 4
    assert (await metrics.aggregate("cores", "avg", "ext.ratio", cpuset="0-3")).value == 4 / 3
    before = time.time()
    empty = await metrics.aggregate("cores", "avg", "ext.absent", cpuset="0-3,8")
    assert empty.value == 0 and empty.time >= before


# -- notifier registrations ----------------------------------------------------------------------


async def test_register_renew_deregister(agent, metrics):
    ids = {"pod_uid": "p1", "container": "c1"}
    lease = await metrics.register("container", "cpu.usage.container", lease_seconds=5, **ids)
    assert lease.key.isalnum() and lease.key.isascii() and lease.lease_seconds == 5
    assert (await metrics.renew(lease.key)).lease_seconds == 5
    assert await metrics.deregister(lease.key) is True
    error = await error_of(metrics.renew(lease.key))
    assert (error.code, error.status, error.details["field"]) == ("notifier_not_found", 404, "key")
    assert await metrics.deregister(lease.key) is False
    default = await metrics.register("node", "cpu.usage.system")
    assert default.lease_seconds == 30 and default.key != lease.key


async def test_register_with_a_request_id_is_idempotent(agent, client):
    request = {"scope": "node", "metric": "cpu.usage.system", "request_id": "r-1"}
    first = await client.request(f"metrics.{NODE}.register-notifier", request)
    again = await client.request(f"metrics.{NODE}.register-notifier", request)
    assert first == again


# -- bad input ------------------------------------------------------------------------------------

NAN = float("nan")

BAD_INPUT = [
    ("get", b"\xc1garbage", "$"),
    ("get", msgpack.packb(["node", "m"]), "$"),
    ("get", {"metric": "m"}, "scope"),
    ("get", {"scope": "galaxy", "metric": "m"}, "scope"),
    ("get", {"scope": "node", "metric": 5}, "metric"),
    ("get", {"scope": "node", "metric": "two words"}, "metric"),
    ("get", {"scope": "node", "metric": "a..b"}, "metric"),
    ("get", {"scope": "numa", "metric": "m"}, "numa_id"),
    ("get", {"scope": "numa", "metric": "m", "numa_id": "0"}, "numa_id"),
    ("get", {"scope": "numa", "metric": "m", "numa_id": True}, "numa_id"),
    ("get", {"scope": "cpu", "metric": "m", "core_id": -1}, "core_id"),
    ("get", {"scope": "container", "metric": "m", "pod_uid": "p"}, "container"),
    ("get", {"scope": "container", "metric": "m", "pod_uid": None, "container": "c"}, "pod_uid"),
    ("get", {"scope": "device", "metric": "m", "device": ""}, "device"),
    ("put", {"scope": "node", "metric": "m", "value": NAN}, "value"),
    ("put", {"scope": "node", "metric": "m", "value": math.inf}, "value"),
    ("put", {"scope": "node", "metric": "m", "value": "1"}, "value"),
    ("put", {"scope": "node", "metric": "m"}, "value"),
    ("put", {"scope": "node", "metric": "m", "value": 1, "time": NAN}, "time"),
    ("put", {"scope": "node", "metric": "m", "value": 1, "time": -5}, "time"),
    ("put", {"scope": "node", "metric": "m", "value": 1, "ttl_seconds": 0}, "ttl_seconds"),
    ("aggregate", {"kind": "racks", "agg": "sum", "metric": "m"}, "kind"),
    ("aggregate", {"kind": "pods", "agg": "max", "metric": "m"}, "agg"),
    ("aggregate", {"kind": "cores", "agg": "sum", "metric": "m"}, "cpuset"),
    ("aggregate", {"kind": "cores", "agg": "sum", "metric": "m", "cpuset": "0-x"}, "cpuset"),
    ("aggregate", {"kind": "pods-numa", "agg": "sum", "metric": "m", "pods": []}, "numa_id"),
    ("aggregate", {"kind": "pods", "agg": "sum", "metric": "m", "pods": [{"uid": ""}]}, "pods[0].uid"),
    ("aggregate", {"kind": "pods", "agg": "sum", "metric": "m", "pods": [{"uid": "p", "containers": "c"}]},
     "pods[0].containers"),
    ("register-notifier", {"scope": "node", "metric": "m", "lease_seconds": 0.5}, "lease_seconds"),
    ("register-notifier", {"scope": "node", "metric": "m.*"}, "metric"),
    ("register-notifier", {"scope": "cgroup", "metric": "m"}, "cgroup_path"),
    ("renew-notifier", {"key": "../../etc"}, "key"),
    ("deregister-notifier", {}, "key"),
    ("list", {"scope": "galaxy"}, "scope"),
    ("list", {"limit": 0}, "limit"),
    ("list", {"limit": 100_000}, "limit"),
]  # fmt: skip


@pytest.mark.parametrize("command,payload,field", BAD_INPUT)
async def test_bad_input_is_invalid_argument_naming_the_field(
    agent, metrics, nc, redis, prefix, command, payload, field
):
    sent = payload if isinstance(payload, bytes) else with_request_id(COMMANDS, command, payload, "bad")
    data = sent if isinstance(sent, bytes) else msgpack.packb(sent)
    msg = await nc.request(f"{prefix}.metrics.{NODE}.{command}", data, timeout=5)
    assert msg.headers["Nats-Service-Error-Code"] == "400"
    error = msgpack.unpackb(msg.data)["error"]
    assert (error["code"], error["details"]["field"]) == ("invalid_argument", field)
    assert error["message"].startswith(f"{field}: ") and len(error["message"]) > len(field) + 2  # a reason
    again = await nc.request(f"{prefix}.metrics.{NODE}.{command}", data, timeout=5)  # a retry
    assert (again.headers, again.data) == (msg.headers, msg.data)  # answers the same
    assert (await metrics.has_synced()).synced  # the agent keeps serving
    # Nothing changed: nothing stored, no registration, no answer kept for the request id.
    assert (await metrics.list()).total == 0
    assert [k async for k in redis.scan_iter(match=f"{prefix}:metrics:{{{NODE}}}:notifier*")] == []
    assert await idempotency_keys(redis, prefix) == []


# -- several agents, and the worker process ------------------------------------------------------


async def test_put_reaches_every_agent_of_the_node(start_agent, metrics):
    first = await start_agent(provisioners=[])
    second = await start_agent(provisioners=[])
    await metrics.put("node", "ext.shared", 3.0, time=1_700_000_000.0)
    for worker in (first, second):
        assert worker.store.get("node", "ext.shared").value == 3.0


async def test_worker_process_serves_its_node(spawn_worker, nc, prefix):
    spawn_worker("services.metrics.worker", "--node", "proc-node", "--interval", "1", "--cgroup-path", "/")
    metrics = MetricsClient(nc, "proc-node", prefix=prefix)
    assert (await wait_synced(metrics)).interval_seconds == 1.0
    assert (await metrics.get("node", "mem.total.system")).value > 0
    cgroups = await metrics.list("cgroup")
    assert {e.cgroup_path for e in cgroups.entries} == {"/"}
    # Another node's subjects have no responder.
    error = await error_of(MetricsClient(nc, "other-node", prefix=prefix, timeout=1).has_synced())
    assert error.code == "no_responders"
