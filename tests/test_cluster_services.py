"""The broker and the metrics agent on a real Redis Cluster (3 primaries, 3 replicas): their main
flows, and a Redis primary that fails over while they work.

Worker processes are started with the cluster's `redis+cluster://` URL, so every script and every
transaction they run goes through redis-py's `RedisCluster`, which refuses a script or a MULTI whose
keys span slots (and the servers refuse keys of a slot they do not own). The main-flow tests run
on the session's cluster; the failover tests on a cluster of their own, since a failover leaves the
whole cluster refusing commands for a few seconds. A failover test SIGKILLs the primary that owns
the service's slot once its replica has every write so far (WAIT), shows the service answering
again once the replica took over, and then restarts the killed server, which rejoins as a replica,
so the next test again has a replica to fail over to.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from berth.servers import ServerCluster, ServerProcess, start_redis_cluster
from bus.client import BusClient
from bus.redis import connect_redis
from schemas.errors import BusError
from services.broker.layout import key_base
from services.metrics.notifier_store import node_base
from tests.broker_fixtures import Broker
from tests.broker_helpers import FAST_ARGS, const_broker, kill_marked, marked, param
from tests.bus_helpers import EventLog, eventually
from tests.conftest import clean_namespace, new_prefix
from tests.worker_helpers import Worker, start_worker, stop_workers

BROKER = "services.broker.worker"
METRICS = "services.metrics.worker"
U = "team-c"
ONE = {"least_instance": 1, "request_instance": 1}
# Answers that mean "not served yet" or "not known yet" while Redis fails over: the request is sent
# again with the same request_id.
RETRIED = {"unavailable", "outcome_unknown", "internal", "timeout", "no_responders", "busy"}


def port_of(member: ServerProcess) -> int:
    return int(member.url.rsplit(":", 1)[1].split("/")[0])


def restart(member: ServerProcess) -> None:
    """Start a server that was killed with its own command line: same port, directory, node id."""
    member.proc = subprocess.Popen(
        member.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )


class OnCluster:
    """One test's namespace on a Redis Cluster: worker processes pointed at it, a cluster client,
    and failovers of its primaries (the killed servers are restarted at the end)."""

    def __init__(self, cluster: ServerCluster, nats_url: str, nc) -> None:
        self.cluster = cluster
        self.nats_url = nats_url
        self.nc = nc
        self.prefix = new_prefix()
        self.redis = connect_redis(cluster.url)
        self.client = BusClient(nc, prefix=self.prefix, timeout=10)
        self.workers: list[Worker] = []
        self.killed: list[ServerProcess] = []  # SIGKILLed, started again at the end

    def spawn(self, module: str, *args: str) -> Worker:
        self.workers.append(start_worker(module, self.nats_url, self.cluster.url, self.prefix, *args))
        return self.workers[-1]

    def member(self, port: int) -> ServerProcess:
        return next(m for m in self.cluster.members if port_of(m) == port)

    def plain(self, member: ServerProcess) -> Redis:
        """A plain (non-cluster) client of one server, for CLUSTER commands."""
        return Redis(port=port_of(member), socket_timeout=2)

    async def cluster_command(self, *args: Any) -> Any:
        """A CLUSTER command answered by any live server."""
        for member in self.cluster.members:
            if member in self.killed:
                continue
            client = self.plain(member)
            try:
                return await client.execute_command(*args)
            except (OSError, RedisError):
                continue
            finally:
                await client.aclose()
        raise AssertionError("no live server in the cluster")

    async def shard_of(self, slot: int) -> tuple[int, list[int]]:
        """(port of the primary serving `slot`, ports of its replicas), from CLUSTER SHARDS."""
        for shard in await self.cluster_command("CLUSTER SHARDS"):
            ranges = shard[b"slots"]
            if any(ranges[i] <= slot <= ranges[i + 1] for i in range(0, len(ranges), 2)):
                nodes = shard[b"nodes"]
                primary = [n[b"port"] for n in nodes if n[b"role"] == b"master" and n[b"health"] == b"online"]
                replicas = [n[b"port"] for n in nodes if n[b"role"] == b"replica"]
                return (primary[0] if primary else 0), replicas
        raise AssertionError(f"no shard serves slot {slot}")

    async def fail_over(self, key: str) -> tuple[int, int, list[int]]:
        """SIGKILL the primary that serves `key`'s slot, once its replica has acknowledged every write
        so far; (slot, the killed primary's port, its replicas' ports)."""
        slot = await self.cluster_command("CLUSTER KEYSLOT", key)
        port, replicas = await self.shard_of(slot)
        assert port and replicas, f"slot {slot} has no online primary with a replica"
        victim = self.member(port)
        primary = self.plain(victim)
        try:
            # A write in the slot, then WAIT: the replication stream is ordered, so the replica has
            # everything the service wrote before it (Redis replicates asynchronously: writes still
            # in flight at a crash can be lost, which is not what this test is about).
            await primary.set(f"{key}:failover-mark", "1")
            assert await primary.execute_command("WAIT", 1, 5000) >= 1
        finally:
            await primary.aclose()
        self.killed.append(victim)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        return slot, port, replicas

    async def promoted(self, slot: int, replicas: list[int]) -> int:
        """Wait until a former replica serves `slot` as primary; its port."""

        async def served_by_a_replica():
            port, _ = await self.shard_of(slot)
            return port if port in replicas else None

        return await eventually(served_by_a_replica, timeout=30)

    async def healthy_again(self) -> None:
        """Start every killed server again (same command line: same port, directory and node id);
        wait until every server says `cluster_state:ok` and sees every node up and every shard with
        a primary and a replica, and every replica is in sync with its primary (a server restarted
        before its replica took over stays the primary)."""
        for member in self.killed:
            restart(member)
        self.killed = []

        async def healthy() -> bool:
            for member in self.cluster.members:
                client = self.plain(member)
                try:
                    if (await client.execute_command("CLUSTER INFO"))["cluster_state"] != "ok":
                        return False
                    # this server's view: every node up, every shard a primary and a replica
                    for shard in await client.execute_command("CLUSTER SHARDS"):
                        nodes = shard[b"nodes"]
                        if any(node[b"health"] == b"fail" for node in nodes):
                            return False
                        roles = sorted(node[b"role"] for node in nodes)
                        if shard[b"slots"] and roles[:1] + roles[-1:] != [b"master", b"replica"]:
                            return False
                    role = await client.execute_command("ROLE")
                    if role[0] == b"slave" and role[3] != b"connected":
                        return False
                    if role[0] == b"master" and not role[2]:
                        return False
                except (OSError, RedisError):
                    return False  # still starting, or loading its data
                finally:
                    await client.aclose()
            return True

        await eventually(healthy, timeout=30)

    async def close(self) -> None:
        stop_workers(self.workers)
        try:
            await self.healthy_again()
            keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}:*")]
            for key in keys:
                await self.redis.delete(key)
            await clean_namespace(self.nc, self.redis, self.prefix)  # the events streams
        finally:
            await self.redis.aclose()
            # Processes a broker launched and nobody released, killed even when the cluster did
            # not come back: a test must not leave a server running on this machine.
            left = kill_marked(self.prefix)
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def failover_cluster(tmp_path_factory):
    """A Redis Cluster of this module's own for the failover tests."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-failover"))
    yield cluster
    cluster.stop()


@pytest_asyncio.fixture
async def on_cluster(redis_cluster, nats_url, nc):
    namespace = OnCluster(redis_cluster, nats_url, nc)
    yield namespace
    await namespace.close()


@pytest_asyncio.fixture
async def on_failover_cluster(failover_cluster, nats_url, nc):
    namespace = OnCluster(failover_cluster, nats_url, nc)
    yield namespace
    await namespace.close()


async def answered(call: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """`call()`'s answer, sent again while the answer says Redis is not serving yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except BusError as error:
            if error.code not in RETRIED or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


def ref(resource_id: str) -> dict[str, str]:
    return {"user": U, "resource_id": resource_id}


def apply(resource_id: str, **extra: Any) -> dict[str, Any]:
    return {**ref(resource_id), "param": param(), "filter": ONE, **extra}


async def lease_holder_pid(redis, prefix: str, name: str) -> int | None:
    holder = await redis.get(f"{key_base(prefix)}:lease:{U}:{name}")
    return int(holder.decode().split(":")[1]) if holder else None


async def release_all(b: Broker, prefix: str, callers: list[str], brokers: list[str]) -> None:
    """Release the callers (each takes its sold broker resource along), remove the brokers (they
    release their unsold ones); back once no launched process is left."""
    for caller in callers:
        await b("release", ref(caller))
    for name in brokers:
        await b("remove-broker", {"user": U, "name": name})

    async def none_left():
        return not marked(prefix)

    await eventually(none_left, timeout=20)


# -- main flows ------------------------------------------------------------------------------------


async def test_broker_serves_init_launch_apply_release_and_remove_on_a_redis_cluster(on_cluster):
    ns = on_cluster
    worker = ns.spawn(BROKER, *FAST_ARGS, "--max-instances", "6")
    b = Broker(ns.client)
    base = key_base(ns.prefix)

    # init (a retry with the same request id is answered from the idempotency key), launch, running
    init = {**ref("cold"), "param": param(), "request_id": "init-cold"}
    assert await b("init", init) == {}
    assert await b("init", init) == {}  # replayed: a second init would be resource_already_init
    await b("launch", {**ref("cold"), "filter": ONE})
    info = await b.wait_running(U, "cold")
    assert info["status"] == "running" and len(info["available_endpoints"]) == 1
    assert (await b("get-resource", ref("cold")))["status"] == "running"

    # a warm pool of a const broker, whose pool loop this worker leads under a lease
    await b("add-broker", const_broker(U, "warm", 1))
    await b.wait_idle(U, "warm", 1)
    assert await lease_holder_pid(ns.redis, ns.prefix, "warm") == worker.proc.pid

    # apply: sold from the pool at once, the caller running and linked to it; the pool refills
    sold = (await b("apply", apply("caller")))["broker_resource_id"]
    caller = await b("get-resource", ref("caller"))
    assert (caller["status"], caller["broker_resource_id"], caller["broker_name"]) == ("running", sold, "")
    assert (await b("get-service-info", ref("caller")))["status"] == "running"
    pool = await b.wait_idle(U, "warm", 1)
    assert pool["sold"] == 1
    listed = (await b("list-resources", {"user": U}))["resources"]
    assert {r["resource_id"] for r in listed} >= {"cold", "caller", sold}

    # every broker key starts with <prefix>:broker: and all of them share one slot
    keys = sorted([key.decode() async for key in ns.redis.scan_iter(match=f"{ns.prefix}:*")])
    broker_keys = [key for key in keys if key.startswith(f"{ns.prefix}:broker:")]
    assert (
        set(keys) - set(broker_keys)
        == {key for key in keys if key.startswith(f"{ns.prefix}:idem:") and key.endswith(":init-cold")}
        != set()
    )
    assert all(key.startswith(f"{base}:") for key in broker_keys)
    assert {
        f"{base}:res:{U}:cold",
        f"{base}:res:{U}:caller",
        f"{base}:res:{U}:{sold}",
        f"{base}:index",
        f"{base}:brokers",
        f"{base}:brokers-version",
        f"{base}:broker:{U}:warm",
        f"{base}:lease:{U}:warm",
        f"{base}:pool:{U}:warm:sold",
        f"{base}:pool:{U}:warm:idle",
        f"{base}:proc:{U}:cold",
        f"{base}:proc-slots",
        f"{base}:ports",
    } <= set(broker_keys)
    assert len({ns.redis.keyslot(key) for key in broker_keys}) == 1

    # release (the caller takes its broker resource along), remove the broker (it releases its
    # unsold one and its lease goes)
    await b("release", ref("caller"))
    assert (await b("get-resource", ref("caller")))["status"] == "released"
    assert (await b("get-resource", ref(sold)))["status"] == "released"
    await b("release", ref("cold"))
    assert (await b("get-resource", ref("cold")))["status"] == "released"
    removed = await b("remove-broker", {"user": U, "name": "warm"})
    assert len(removed["released"]) == 1
    assert (await b("list-brokers", {"user": U}))["brokers"] == []

    async def lease_gone():
        return await lease_holder_pid(ns.redis, ns.prefix, "warm") is None

    await eventually(lease_gone)

    async def none_left():
        return not marked(ns.prefix)

    await eventually(none_left, timeout=20)


async def test_metrics_notifier_registers_publishes_renews_and_deregisters_on_a_redis_cluster(on_cluster):
    ns = on_cluster
    node = f"n-{ns.prefix}"
    ns.spawn(METRICS, "--node", node, "--interval", "5")
    log = await EventLog.open(ns.nc, ns.prefix, f"metrics.{node}.>")

    async def call(command: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await ns.client.request(f"metrics.{node}.{command}", payload, dict)

    watched = {"scope": "node", "metric": "ext.load", "lease_seconds": 30, "request_id": "reg-load"}
    lease = await call("register-notifier", watched)
    assert await call("register-notifier", watched) == lease  # replayed from the idempotency key
    sentinel = await call("register-notifier", {"scope": "node", "metric": "ext.sentinel"})

    # a put: its change event arrives
    await call("put", {"scope": "node", "metric": "ext.load", "value": 1.5})
    first = await log.first(lambda e: e[1]["metric"] == "ext.load")
    subject, body = log.events[first]
    assert subject == f"{ns.prefix}.events.metrics.{node}.node.ext.load"
    assert (body["type"], body["value"]) == ("metric", 1.5)

    # renew: the registration's lease starts again
    base = node_base(ns.prefix, node)
    assert await call("renew-notifier", {"key": lease["key"]}) == {"key": lease["key"], "lease_seconds": 30}
    assert 0 < await ns.redis.pttl(f"{base}:notifier:{lease['key']}") <= 30_000

    # every key of the node starts with <prefix>:metrics:{<node>}: and all share one slot
    keys = sorted([key.decode() async for key in ns.redis.scan_iter(match=f"{ns.prefix}:*")])
    metrics_keys = [key for key in keys if not key.startswith(f"{ns.prefix}:idem:")]
    assert {
        f"{base}:notifiers",
        f"{base}:notifier:{lease['key']}",
        f"{base}:notifier:{sentinel['key']}",
        f"{base}:publisher",
    } <= set(metrics_keys)
    assert all(key.startswith(f"{base}:") for key in metrics_keys)
    assert len({ns.redis.keyslot(key) for key in metrics_keys}) == 1

    # deregister: nothing more is published for it (the sentinel's event comes after the put that
    # would have been published first), and it leaves Redis
    assert await call("deregister-notifier", {"key": lease["key"]}) == {"removed": True}
    start = len(log.events)
    await call("put", {"scope": "node", "metric": "ext.load", "value": 2.5})
    await call("put", {"scope": "node", "metric": "ext.sentinel", "value": 1.0})
    before = await log.before(log.subject(f"metrics.{node}.node.ext.sentinel"), after=start)
    assert [e for e in before if e[1]["metric"] == "ext.load"] == []
    assert await ns.redis.smembers(f"{base}:notifiers") == {sentinel["key"].encode()}
    assert not await ns.redis.exists(f"{base}:notifier:{lease['key']}")
    assert await call("deregister-notifier", {"key": sentinel["key"]}) == {"removed": True}
    assert not await ns.redis.exists(f"{base}:notifiers")
    await log.close()


# -- a Redis primary fails over --------------------------------------------------------------------


async def test_broker_keeps_selling_and_refilling_when_its_redis_primary_fails_over(on_failover_cluster):
    ns = on_failover_cluster
    worker = ns.spawn(BROKER, *FAST_ARGS, "--max-instances", "6")
    b = Broker(ns.client)
    await b("add-broker", const_broker(U, "ha", 1))
    await b.wait_idle(U, "ha", 1)
    first = (await b("apply", apply("before")))["broker_resource_id"]
    await b.wait_idle(U, "ha", 1)

    slot, _, replicas = await ns.fail_over(f"{key_base(ns.prefix)}:index")

    # The next apply is answered (sent again, with its request id, until Redis serves again): the
    # claim script runs on the promoted replica and sells the resource that was idle.
    second = (await answered(lambda: b("apply", apply("after", request_id="apply-after"))))[
        "broker_resource_id"
    ]
    assert second != first
    await ns.promoted(slot, replicas)  # served by the killed primary's replica now
    caller = await b("get-resource", ref("after"))
    assert (caller["status"], caller["broker_resource_id"]) == ("running", second)

    # The pool loop goes on on the new primary: the worker holds the lease and refills the pool.
    pool = await b.wait_idle(U, "ha", 1)
    assert pool["sold"] == 2
    assert await lease_holder_pid(ns.redis, ns.prefix, "ha") == worker.proc.pid
    await release_all(b, ns.prefix, ["before", "after"], ["ha"])
    assert (await b("get-resource", ref(second)))["status"] == "released"


async def test_metrics_notifier_keeps_working_when_its_redis_primary_fails_over(on_failover_cluster):
    ns = on_failover_cluster
    node = f"n-{ns.prefix}"
    ns.spawn(METRICS, "--node", node, "--interval", "5")
    log = await EventLog.open(ns.nc, ns.prefix, f"metrics.{node}.>")
    base = node_base(ns.prefix, node)

    async def call(command: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await ns.client.request(f"metrics.{node}.{command}", payload, dict)

    lease = await call("register-notifier", {"scope": "node", "metric": "ext.load", "lease_seconds": 60})
    await call("put", {"scope": "node", "metric": "ext.load", "value": 1.0})
    await log.first(lambda e: e[1]["metric"] == "ext.load" and e[1]["value"] == 1.0)

    slot, _, replicas = await ns.fail_over(f"{base}:notifiers")

    # The registration made before the failover is renewed on the promoted replica.
    renewed = await answered(lambda: call("renew-notifier", {"key": lease["key"], "request_id": "renew-1"}))
    assert renewed == {"key": lease["key"], "lease_seconds": 60}
    await ns.promoted(slot, replicas)  # served by the killed primary's replica now

    # Publishing goes on (the agent holds the publisher lease on the new primary): a new sample's
    # event arrives, and a registration made and removed now changes Redis as before.
    start = len(log.events)
    await call("put", {"scope": "node", "metric": "ext.load", "value": 2.0})
    await log.first(lambda e: e[1]["metric"] == "ext.load" and e[1]["value"] == 2.0, after=start, timeout=15)

    async def publisher_lease_held():
        return await ns.redis.pttl(f"{base}:publisher") > 0

    await eventually(publisher_lease_held)
    other = await call("register-notifier", {"scope": "node", "metric": "ext.other"})
    assert await ns.redis.smembers(f"{base}:notifiers") == {lease["key"].encode(), other["key"].encode()}
    for key in (lease["key"], other["key"]):
        assert await call("deregister-notifier", {"key": key}) == {"removed": True}
    assert not await ns.redis.exists(f"{base}:notifiers")
    await log.close()
