"""berth on a NATS cluster and on a Redis Cluster, with failures: one nats-server killed, one Redis
primary killed (a replica takes over), while three allocation workers serve 48 clients that retry
every request with its request_id until it is answered.

After each run: every request was answered, nothing is over-committed, usage equals the ledger on
every node, and (NATS) every answered placement and nothing else is in a ledger. A broker replica and a
metrics agent keep answering through the NATS failure.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from berth.servers import start_nats_cluster, start_redis_cluster
from bus import discovery
from bus.client import BusClient
from bus.connection import connect
from tests.allocation_helpers import allocate_until_answered, check_invariants
from tests.cluster_helpers import ask, replica_of, restart, role, slot_owner, wait_until
from tests.conftest import clean_namespace, new_prefix
from tests.worker_helpers import start_worker, stop_workers

NODES = [f"f{i}" for i in range(8)]
CORES = 8
CLIENTS = 48
REQUESTS = 144  # more than the 64 that fit: the rest are answered insufficient_capacity
# No answer yet: send the same request again. `unavailable` is a worker that lost Redis mid-request
# (a failover); it keeps nothing for the id, so the retry runs again.
RETRIED = {"timeout", "no_responders", "busy", "unavailable", "outcome_unknown"}
# The fault strikes once this many requests are answered: early enough that placements are still
# being made on every node, and reached even while a third of the slots answer only `unavailable`.
FAULT_AFTER = REQUESTS // 6


@pytest.fixture(scope="module")
def nats_cluster3(tmp_path_factory):
    cluster = start_nats_cluster(tmp_path_factory.mktemp("nats-faults"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster6(tmp_path_factory):
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-faults"))
    yield cluster
    cluster.stop()




async def load_with_a_fault(client: BusClient, fault) -> tuple[dict[str, dict | str], list[str]]:
    """REQUESTS allocates from CLIENTS clients; `fault()` runs once FAULT_AFTER have been sent
    (answered or retried: while the fault's effect refuses them, no answer may come). Asserts that
    requests were answered after the fault struck: it struck under load."""
    answers: dict[str, dict | str] = {}
    retries: list[str] = []
    answered_before: list[int] = []
    slots = asyncio.Semaphore(CLIENTS)

    async def one(index: int) -> None:
        async with slots:
            answers[f"req-{index}"] = await allocate_until_answered(
                client, NODES, f"req-{index}", retries, retried=RETRIED, connection_may_move=True
            )

    async def strike() -> None:
        while len(answers) + len(retries) < FAULT_AFTER:
            await asyncio.sleep(0.01)
        answered_before.append(len(answers))
        await fault()

    await asyncio.gather(strike(), *(one(i) for i in range(REQUESTS)))
    assert answered_before[0] < REQUESTS
    return answers, retries


async def check_answers(client: BusClient, answers: dict[str, dict | str]) -> tuple[set[str], set[str]]:
    """(placed, held): what answered requests own, and what the ledgers hold. Asserts that every
    refusal is for capacity, and that no node is over-committed and usage equals the ledger."""
    placed = {a["workload_id"] for reply in answers.values() if isinstance(reply, dict) for a in reply["allocations"]}
    assert {reply for reply in answers.values() if not isinstance(reply, dict)} <= {"insufficient_capacity"}
    held = set()
    for node in NODES:
        ledger = await client.request("resource.get-allocations", {"nodename": node}, dict)
        held |= {a["workload_id"] for a in ledger["allocations"]}
    await check_invariants(client, NODES)  # no over-commit; usage == ledger
    return placed, held


async def add_nodes(client: BusClient) -> None:
    for node in NODES:
        resource = {"cpumem": {"cpu": CORES, "memory": "64G"}}
        await client.request("resource.add-node", {"nodename": node, "resource": resource})


@pytest.mark.slow
async def test_a_nats_server_dies_under_load(nats_cluster3, redis_url, redis):
    """The server every worker is connected to dies: each worker is given only its URL, so their
    connections are on it for sure (they learn the others from it). The clients are on the other
    two. The same worker instances answer afterwards: they reconnected, and were not restarted."""
    prefix = new_prefix()
    doomed, survivors = nats_cluster3.members[0], nats_cluster3.members[1:]
    workers = [start_worker("services.allocation.worker", doomed.url, redis_url, prefix) for _ in range(3)]
    workers += [
        start_worker("services.broker.worker", doomed.url, redis_url, prefix),
        start_worker("services.metrics.worker", doomed.url, redis_url, prefix, "--node", "fault-node",
                     "--interval", "1", "--cgroup-path", "/"),
    ]
    nc = await connect(",".join(m.url for m in survivors), name="faults-client", worker=True)
    client = BusClient(nc, prefix=prefix, timeout=5)
    try:
        await add_nodes(client)
        instances = {worker.instance_id for worker in workers}
        assert await live_instances(nc, prefix) == instances

        async def kill_the_workers_server() -> None:
            doomed.proc.send_signal(signal.SIGKILL)

        answers, _ = await load_with_a_fault(client, kill_the_workers_server)
        assert doomed.proc.wait(5) == -signal.SIGKILL
        # Every worker process lived through it and answers again through a surviving server (so
        # the requests answered after the kill were answered by reconnected workers).
        assert all(worker.proc.poll() is None for worker in workers)
        assert await live_instances(nc, prefix) == instances
        placed, held = await check_answers(client, answers)
        assert placed == held and len(placed) == len(NODES) * CORES  # no orphan, nothing lost
        assert (await client.request("broker.list-brokers", {"user": "u1"}, dict, timeout=10)) == {"brokers": []}
        synced = await client.request("metrics.fault-node.has-synced", {}, dict, timeout=10)
        assert synced["synced"] is True
    finally:
        stop_workers(workers)
        await nc.close()
        await clean_namespace_on(nats_cluster3, redis, prefix)


async def live_instances(nc, prefix: str) -> set[str]:
    """The instance ids of the namespace's services that answer $SRV.PING (each once reconnected)."""
    services = (f"{prefix}-allocation", f"{prefix}-broker", f"{prefix}-metrics")
    found: set[str] = set()
    for _ in range(100):  # a reconnecting worker answers once its subscriptions are back
        found = {p.id for name in services for p in await discovery.ping(nc, name)}
        if len(found) == 5:
            break
    return found


@pytest.fixture
def redis_cluster_to_fail(tmp_path):
    """A Redis Cluster of the test's own: its failover leaves another member primary."""
    cluster = start_redis_cluster(tmp_path / "redis-cluster")
    yield cluster
    cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("wait_replicas", [1, 0], ids=["wait-replicas-1", "no-wait"])
async def test_a_redis_primary_fails_over_under_load(
    redis_cluster_to_fail, nats_url, nc, redis, wait_replicas, record_property
):
    """The replica of one primary lags (stopped, its link cut) from the start of the load; some way in,
    the primary dies, the replica resumes and is promoted, and the dead primary comes back as its
    replica. What the lagging replica never received is lost with the primary: with
    --wait-replicas 1 nothing answered was (those answers were `outcome_unknown` and retried); without,
    the placements answered on that primary's nodes before it died are gone (the loss window)."""
    cluster, prefix = redis_cluster_to_fail, new_prefix()
    options = ("--wait-replicas", str(wait_replicas)) if wait_replicas else ()
    # The cluster is made before the NATS connection, and workers start and stop in threads: a test
    # whose event loop is stuck for seconds misses the server's pings, and its connection is
    # dropped with a request in it (CI saw add-node go unanswered so).
    workers = [await asyncio.to_thread(start_worker, "services.allocation.worker", nats_url, cluster.url, prefix,
                                       *options) for _ in range(3)]
    client = BusClient(nc, prefix=prefix, timeout=5)
    try:
        await add_nodes(client)
        victim = slot_owner(cluster, node_key(prefix, NODES[0]))
        replica = replica_of(cluster, victim)
        on_victim = {node for node in NODES if slot_owner(cluster, node_key(prefix, node)) is victim}
        # The replica lags: stopped, and cut off from its primary (else it would read, once resumed,
        # what its primary had already sent into the socket, and miss nothing).
        replica.proc.send_signal(signal.SIGSTOP)
        assert ask(victim, "CLIENT", "KILL", "TYPE", "replica") == 1

        async def fail_over() -> None:
            victim.proc.send_signal(signal.SIGKILL)
            replica.proc.send_signal(signal.SIGCONT)
            await asyncio.to_thread(wait_until, lambda: role(replica) == "master", "the replica's promotion")
            await asyncio.to_thread(restart, victim)

        answers, retries = await load_with_a_fault(client, fail_over)
        # The failover happened: the replica serves the victim's slots, the victim replicates it.
        assert slot_owner(cluster, node_key(prefix, NODES[0])) is replica and role(victim) == "slave"
        # A run that stalled in the failover may still hold what it placed after a retry took its
        # claim over and answered; it gives that back once it finds its claim gone. Drain the
        # workers so every such run has finished, then check what is left with a fresh one.
        await asyncio.to_thread(stop_workers, workers)
        workers = [await asyncio.to_thread(start_worker, "services.allocation.worker", nats_url, cluster.url, prefix)]
        placed, held = await check_answers(client, answers)
        lost = placed - held  # answered, then lost with writes the replica had not received
        # The loss window, for the README (--junitxml keeps these): answered placements lost, of
        # all; and placements no answer names (a run whose claim the failover took back: not
        # item 5's, see the README).
        record_property("placed", len(placed))
        record_property("lost", len(lost))
        record_property("orphans", len(held - placed))
        if wait_replicas:
            assert lost == set()
            assert "outcome_unknown" in retries  # answers the lagging replica could not confirm
        else:
            assert lost, "the stopped replica missed writes: answered placements must be lost"
            assert {placement_node(answers, wid) for wid in lost} <= on_victim
    finally:
        await asyncio.to_thread(stop_workers, workers)
        await clean_namespace(nc, redis, prefix)  # its events streams (the cluster goes with the test)


def node_key(prefix: str, node: str) -> str:
    return f"{prefix}:allocation:{{node:{node}}}:node"


def placement_node(answers: dict[str, dict | str], workload_id: str) -> str:
    return next(a["nodename"] for reply in answers.values() if isinstance(reply, dict)
                for a in reply["allocations"] if a["workload_id"] == workload_id)


async def clean_namespace_on(cluster, redis, prefix: str) -> None:
    nc = await connect(cluster.url, worker=False)
    try:
        await clean_namespace(nc, redis, prefix)
    finally:
        await nc.close()
