"""berth on a NATS cluster and on a Redis Cluster, with failures: one nats-server killed, one Redis
primary killed (a replica takes over), while three allocation workers serve 48 clients that retry
every request with its request_id until it is answered.

After each run: every request was answered, nothing is over-committed, usage equals the ledger on
every node, and no ledger holds a workload that no answered request owns. A broker replica and a
metrics agent keep answering through the NATS failure.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from bus.client import BusClient
from bus.connection import connect
from services.servers import start_nats_cluster, start_redis_cluster
from tests.conftest import clean_namespace, new_prefix, start_worker, stop_workers
from tests.test_allocation_concurrency import allocate_until_answered, check_invariants

NODES = [f"f{i}" for i in range(8)]
CORES = 8
CLIENTS = 48
REQUESTS = 144  # more than the 64 that fit: the rest are answered insufficient_capacity
# No answer yet: send the same request again. `unavailable` is a worker that lost Redis mid-request
# (a failover); it keeps nothing for the id, so the retry runs again.
RETRIED = {"timeout", "no_responders", "busy", "unavailable"}


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
    """REQUESTS allocates from CLIENTS clients; `fault()` runs once a third have been answered."""
    answers: dict[str, dict | str] = {}
    retries: list[str] = []
    slots = asyncio.Semaphore(CLIENTS)
    struck = asyncio.Event()

    async def one(index: int) -> None:
        async with slots:
            answers[f"req-{index}"] = await allocate_until_answered(
                client, NODES, f"req-{index}", retries, retried=RETRIED, connection_may_move=True
            )
        if len(answers) >= REQUESTS // 3 and not struck.is_set():
            struck.set()
            await fault()

    await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    assert struck.is_set()
    return answers, retries


async def check_no_orphans(client: BusClient, answers: dict[str, dict | str]) -> tuple[set[str], set[str]]:
    """(placed, held): what answered requests own, and what the ledgers hold; asserts the invariants."""
    placed = {a["workload_id"] for reply in answers.values() if isinstance(reply, dict) for a in reply["allocations"]}
    assert {reply for reply in answers.values() if not isinstance(reply, dict)} <= {"insufficient_capacity"}
    held = set()
    for node in NODES:
        ledger = await client.request("resource.get-allocations", {"nodename": node}, dict)
        held |= {a["workload_id"] for a in ledger["allocations"]}
    assert held - placed == set(), "a ledger holds workloads no answered request owns"
    await check_invariants(client, NODES)  # no over-commit; usage == ledger
    return placed, held


async def add_nodes(client: BusClient) -> None:
    for node in NODES:
        resource = {"cpumem": {"cpu": CORES, "memory": "64G"}}
        await client.request("resource.add-node", {"nodename": node, "resource": resource})


@pytest.mark.slow
async def test_a_nats_server_dies_under_load(nats_cluster3, redis_url, redis):
    prefix = new_prefix()
    workers = [start_worker("services.allocation.worker", nats_cluster3.url, redis_url, prefix) for _ in range(3)]
    workers += [
        start_worker("services.broker.worker", nats_cluster3.url, redis_url, prefix),
        start_worker("services.metrics.worker", nats_cluster3.url, redis_url, prefix, "--node", "fault-node",
                     "--interval", "1", "--cgroup-path", "/"),
    ]
    nc = await connect(nats_cluster3.url, name="faults-client", worker=True)
    client = BusClient(nc, prefix=prefix, timeout=5)
    try:
        await add_nodes(client)

        async def kill_a_server() -> None:
            nats_cluster3.members[0].proc.send_signal(signal.SIGKILL)

        answers, retries = await load_with_a_fault(client, kill_a_server)
        placed, held = await check_no_orphans(client, answers)
        assert placed == held and len(placed) == len(NODES) * CORES  # nothing lost either
        # The broker replica and the metrics agent moved to another server and answer.
        assert (await client.request("broker.list-brokers", {"user": "u1"}, dict, timeout=10)) == {"brokers": []}
        synced = await client.request("metrics.fault-node.has-synced", {}, dict, timeout=10)
        assert synced["synced"] is True
    finally:
        stop_workers(workers)
        await nc.close()
        await clean_namespace_on(nats_cluster3, redis, prefix)


@pytest.mark.slow
async def test_a_redis_primary_fails_over_under_load(nats_url, nc, redis, redis_cluster6, capsys):
    prefix = new_prefix()
    workers = [start_worker("services.allocation.worker", nats_url, redis_cluster6.url, prefix) for _ in range(3)]
    client = BusClient(nc, prefix=prefix, timeout=5)
    try:
        await add_nodes(client)
        victim = redis_cluster6.members[0]  # a primary: it owns a third of the slots, so of the nodes

        async def kill_a_primary() -> None:
            victim.proc.send_signal(signal.SIGKILL)

        answers, retries = await load_with_a_fault(client, kill_a_primary)
        # A run that stalled in the failover may still hold what it placed after a retry took its
        # claim over and answered; it gives that back once it finds its claim gone. Drain the
        # workers so every such run has finished, then check what is left with a fresh one.
        stop_workers(workers)
        workers = [start_worker("services.allocation.worker", nats_url, redis_cluster6.url, prefix)]
        placed, held = await check_no_orphans(client, answers)
        lost = placed - held  # answered, then lost with writes the replica had not received yet
        with capsys.disabled():
            print(f"\nRedis failover: {len(placed)} placed, {len(lost)} lost, {len(retries)} retries")
    finally:
        stop_workers(workers)
        await clean_namespace(nc, redis, prefix)  # its events streams (the cluster goes with the module)


async def clean_namespace_on(cluster, redis, prefix: str) -> None:
    nc = await connect(cluster.url, worker=False)
    try:
        await clean_namespace(nc, redis, prefix)
    finally:
        await nc.close()
