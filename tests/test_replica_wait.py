"""bus.replicas against real servers: WAIT covers only its own connection's writes (why a fence is
written first), a confirmed write is on the replica of the primary that took it, and a replica that
does not confirm turns the answer into `outcome_unknown` (the write is on the primary, and a failover may lose it)."""

from __future__ import annotations

import signal
import time

import pytest
import redis as sync_redis

from bus.redis import connect_redis, ready
from bus.replicas import ReplicaWait, collecting, landed, wrote
from schemas.errors import OutcomeUnknown
from tests.cluster_helpers import port, read_on_replica, replica_of, slot_owner

KEY = "replicas-test:{node:n1}:node"


@pytest.fixture
async def cluster_client(redis_cluster):
    client = await ready(connect_redis(redis_cluster.url))
    yield client
    await client.aclose()


def test_wait_on_another_connection_does_not_cover_a_write(redis_cluster):
    """The reason for the fence: WAIT on a pooled connection that did not write returns at once,
    though another connection's write is not on the replica (it is stopped)."""
    primary = slot_owner(redis_cluster, KEY)
    replica = replica_of(redis_cluster, primary)
    with sync_redis.Redis(port=port(primary)) as writer, sync_redis.Redis(port=port(primary)) as waiter:
        writer.ping(), waiter.ping()  # both connected before the write, as a pool's connections are
        # The replica is linked and caught up first (an earlier test may have restarted it).
        deadline = time.monotonic() + 30
        while writer.set(KEY, "caught-up") and writer.execute_command("WAIT", 1, 100) != 1:
            assert time.monotonic() < deadline, "the replica never caught up"
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            writer.set(KEY, "unreplicated")
            assert waiter.execute_command("WAIT", 1, 100) == 1
            assert writer.execute_command("WAIT", 1, 100) == 0  # the writer's own WAIT sees it
        finally:
            replica.proc.send_signal(signal.SIGCONT)


async def test_a_noted_write_is_confirmed_once_on_the_replica_of_its_primary(redis_cluster, cluster_client):
    waits = ReplicaWait(cluster_client, "replicas-test", replicas=1, timeout_ms=5000)
    with collecting() as writes:
        await cluster_client.set(KEY, "confirmed")
        wrote(cluster_client, KEY)
    assert writes == {landed(cluster_client, KEY)}
    await waits.confirm(writes)
    replica = replica_of(redis_cluster, slot_owner(redis_cluster, KEY))
    assert read_on_replica(replica, KEY) == b"confirmed"


async def test_a_replica_that_does_not_confirm_leaves_the_outcome_unknown(redis_cluster, cluster_client):
    waits = ReplicaWait(cluster_client, "replicas-test", replicas=1, timeout_ms=200)
    replica = replica_of(redis_cluster, slot_owner(redis_cluster, KEY))
    replica.proc.send_signal(signal.SIGSTOP)
    try:
        await cluster_client.set(KEY, "unconfirmed")
        with pytest.raises(OutcomeUnknown, match="0 of 1 replicas"):
            await waits.confirm([landed(cluster_client, KEY)])
    finally:
        replica.proc.send_signal(signal.SIGCONT)
    await waits.confirm([landed(cluster_client, KEY)])  # and once it is back, it confirms


async def test_a_single_redis_without_replicas_never_confirms(redis, prefix):
    waits = ReplicaWait(redis, prefix, replicas=1, timeout_ms=50)
    await redis.set(f"{prefix}:k", 1)
    with pytest.raises(OutcomeUnknown):
        await waits.confirm([landed(redis, f"{prefix}:k")])
    await waits.confirm([])  # a request that wrote nothing waits for nothing
