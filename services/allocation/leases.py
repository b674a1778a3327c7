"""Node liveness: an agent's heartbeats keep its node's lease; a node whose lease lapsed is down.

A node that an agent registered is `up` while its agent renews the lease (every heartbeat, for a
TTL of a few heartbeats), `draining` while its agent asks for that, and `down` once the lease ended
without a renewal. A node that is not `up` takes no new workloads: it leaves every selection (by
names, by labels, capacity queries) and a deploy that names it is refused. Its workloads stay in
its ledger: releasing them is their owners' call (the broker fails its instances over), and the
agent that comes back stops the instances whose workload was released meanwhile.

A node no agent ever beat for (one added by hand) has no lease and is always up.

The lease lives beside the record, not in it (`NodeStore.renew_lease`): a heartbeat costs one
script and one ZADD and never changes the node's version, so capacity views stay as they are.
Only a change of status is a commit (with its event: `resource.<node>.<down|up|draining>`), and
the lease's end decides it on the Redis server's clock, in the same step: the sweeper marks a
node down only while its lease has lapsed, an agent marks it up only while its lease is live.
Any number of allocation workers sweep; the version check lets one of them write each change.
"""

from __future__ import annotations

import logging

import msgspec

from schemas.allocation import NodeEvent
from services.allocation import telemetry
from services.allocation.committer import Committer
from services.allocation.errors import node_not_found
from services.allocation.records import DOWN, DRAINING, UP, Change, LedgerConflict
from services.allocation.store import NodeStore

log = logging.getLogger("berth.allocation.leases")


class Heartbeat(msgspec.Struct):
    """What a heartbeat left: the node's status now and before it, and when its lease ends
    (ms of the Redis server's clock)."""

    status: str
    was: str
    lease_ends_ms: int


class Leases:
    def __init__(self, store: NodeStore, committer: Committer) -> None:
        self.store = store
        self.committer = committer

    async def heartbeat(self, node: str, ttl_seconds: float, draining: bool, agent: bytes) -> Heartbeat:
        """Renew the node's lease; bring it up (or draining, as asked) if it was not."""
        renewed = await self.store.renew_lease(node, round(ttl_seconds * 1000), agent)
        if renewed is None:
            raise node_not_found(node)
        was, ends = renewed
        wanted = DRAINING if draining else UP
        if was != wanted:
            try:
                was = await self._change(node, wanted, lease="live") or was
            except LedgerConflict:  # the lease lapsed again before the change (a TTL shorter than a round trip)
                return Heartbeat(DOWN, was, ends)
        return Heartbeat(wanted, was, ends)

    async def sweep(self) -> list[str]:
        """Mark down every node whose lease lapsed; the nodes this worker marked."""
        marked = []
        for node, ends in (await self.store.lapsed_leases()).items():
            try:
                if await self._change(node, DOWN, lease="lapsed") is not None:
                    marked.append(node)
                    log.warning("node %s is down: its agent's lease lapsed", node)
            except LedgerConflict:  # renewed since we read it: its agent is back
                continue
            await self.store.forget_lease(node, ends)
        return marked

    async def _change(self, node: str, status: str, *, lease: str) -> str | None:
        """Set the node's status if it differs, with its lease `lapsed` or `live` checked in the
        same commit; the status before (None: unchanged, or the node is gone)."""

        async def compute():
            record = await self.store.load(node)
            if record is None or record.status == status:
                return record, Change(), None
            return record, Change(status=status, lease=lease), record.status

        def events(before: str | None) -> list:
            return [(f"resource.{node}.{status}",
                     NodeEvent(nodename=node, before={"status": before}, after={"status": status}))]

        before, _ = await self.committer.mutate(node, compute, events=events)
        if before is not None:
            telemetry.NODE_STATUS.labels(status).inc()
        return before
