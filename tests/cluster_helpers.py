"""Looking into a Redis Cluster of `berth.servers.start_redis_cluster`: who owns a key's slot, who
replicates it, what role a member plays now. Plain synchronous redis-py, one short connection each."""

from __future__ import annotations

import subprocess
import time

import redis as sync_redis
from redis.crc import key_slot

from berth.servers import ServerCluster, ServerProcess, wait_for_port


def port(member: ServerProcess) -> int:
    return int(member.url.rsplit(":", 1)[1].split("/")[0])


def ask(member: ServerProcess, *command):
    with sync_redis.Redis(port=port(member), socket_timeout=5) as client:
        return client.execute_command(*command)


def read_on_replica(replica: ServerProcess, key: str) -> bytes | None:
    """GET on a replica: READONLY first, on the same connection."""
    with sync_redis.Redis(port=port(replica), socket_timeout=5) as client:
        client.execute_command("READONLY")
        return client.get(key)


def role(member: ServerProcess) -> str:
    """`master` or `slave`, as the member itself says (ROLE)."""
    return ask(member, "ROLE")[0].decode()


def slot_owner(cluster: ServerCluster, key: str) -> ServerProcess:
    """The member serving `key`'s slot now, as a live primary's CLUSTER SLOTS says."""
    slot = key_slot(key.encode())
    for member in cluster.members:
        if member.proc.poll() is None and role(member) == "master":
            for first, last, owner, *_ in ask(member, "CLUSTER SLOTS"):
                if first <= slot <= last:
                    return next(m for m in cluster.members if port(m) == owner[1])
    raise LookupError(f"no live primary serves slot {slot}")


def replica_of(cluster: ServerCluster, primary: ServerProcess) -> ServerProcess:
    """The live member that replicates `primary` (ROLE names its primary's port)."""
    for member in cluster.members:
        if member is not primary and member.proc.poll() is None:
            said = ask(member, "ROLE")
            if said[0] == b"slave" and said[2] == port(primary):
                return member
    raise LookupError(f"{primary.name} has no live replica")


def restart(member: ServerProcess) -> None:
    """Start a member that was killed again, with its own arguments (its state folder tells it
    which cluster it belongs to); a primary that was failed over comes back as a replica."""
    member.proc = subprocess.Popen(member.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    wait_for_port(port(member), member.proc)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll `condition` (a few times a second) until it holds; `timeout` only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.1)
