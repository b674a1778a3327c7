"""Committing changes to nodes: the optimistic-concurrency loop, and multi-node placements that
either all land or are rolled back, even when their worker dies half way.

A change is computed on a fresh record and committed with `NodeStore.commit`, which refuses if the
record changed meanwhile; then we compute again on the fresh record. Calculation and commit are
therefore one atomic step per node, with any number of workers. Deploys go through `DeployBatches`
(commits.py): one commit per node in flight per worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

import msgspec

from bus.callers import current_caller
from bus.failpoints import failpoint
from bus.idempotency import own_claim, taken_over
from bus.outbox import VersionedOutboxes, journal
from schemas.common import Event
from schemas.errors import BerthError
from services.allocation import telemetry
from services.allocation.commits import DeployBatches
from services.allocation.errors import node_busy, not_placeable_now
from services.allocation.fleet import Fleet
from services.allocation.messages import Allocation
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import (
    UP,
    AlreadyApplied,
    Change,
    Intent,
    LeaseExpired,
    LedgerConflict,
    NodeRecord,
    StaleVersion,
)
from services.allocation.store import NodeStore
from services.allocation.view import Reservation

log = logging.getLogger("berth.allocation")

T = TypeVar("T")

# Workload ids derived from a request_id are stable, so a retried allocate names the same workloads.
_WORKLOAD_NAMESPACE = uuid.UUID("6f1d3c2e-8a4b-4e55-9a37-3b0f1c7d2e91")


class Committer:
    """Writes changes to nodes: computes each on a fresh record, commits it with the record's version
    (computing again when another worker changed the node first), publishes its events through the
    node's outbox, and places a multi-node allocation all or nothing (an intent first, then one
    batched commit per node, rolled back if a node refuses)."""

    def __init__(
        self,
        store: NodeStore,
        plugins: PluginSet,
        fleet: Fleet,
        outbox: VersionedOutboxes,
        *,
        release: Callable[[list[str], str | None], Awaitable[list[str]]],
        attempts: int = 200,
        intent_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.outbox = outbox
        self.release = release  # gives back workloads (by id) placed for an owner to their nodes
        self.attempts = attempts
        self.intent_timeout = intent_timeout
        self.deploys = DeployBatches(
            store, plugins, latest=fleet.views.take_record, committed=self.committed, outbox=outbox,
            release=release, contend=fleet.views.contend, attempts=attempts,
        )

    async def mutate(
        self,
        node: str,
        compute: Callable[[], Awaitable[tuple[NodeRecord | None, Change, T]]],
        *,
        retry_ledger: bool = False,
        once: type | None = None,
        events: Callable[[T], list[tuple[str, Event]]] = lambda result: [],
    ) -> tuple[T, int]:
        """Compute a change on fresh data and commit it; if the node changed meanwhile, do it again.

        `compute` reads what it needs and returns (the record it read, None for a new node; the
        change; the result); it raises to refuse. `retry_ledger` also retries when a ledger entry
        it relied on moved. Returns the result and the node's new version. `events(result)` are
        the change's events: written in the same commit, into the node's outbox, and published
        from there (`bus.outbox`), so that a worker dying after the commit loses none.

        `once` (the result's type): the change is the answer to the request whose claim the task
        runs under, applied to the node at most once whatever dies between its commit and its
        answer. The commit keeps the result beside the record; a retry of the request finds it and
        returns it instead of applying the change again (a delta applied twice, a release that no
        longer finds what its first run removed). The commit is also fenced by the run's lease: a
        run paused past it, whose request a retry took over, writes nothing.
        """
        retry_on: tuple[type[Exception], ...] = (StaleVersion, LedgerConflict) if retry_ledger else (StaleVersion,)
        run = own_claim() if once is not None else None
        if run is not None and run.attempt:  # an earlier run may have applied it and died unanswered
            kept = (await self.store.applied([node], run.marker)).get(node)
            if kept is not None:
                return await self._replayed(node, kept, once)
        for attempt in range(self.attempts):
            record, change, result = await compute()
            version = record.version if record else 0
            if change.is_empty():
                return result, version
            change.journal = journal(announced) if (announced := events(result)) else None
            if run is not None:
                change.once, change.fence = (run.marker, msgspec.msgpack.encode(result)), run.lease_end
            failpoint("before-commit")
            try:
                version = await self.store.commit(node, version, change, record.tag if record else "")
            except AlreadyApplied as kept:  # an earlier run applied it: its answer is the answer
                return await self._replayed(node, kept, once)
            except LeaseExpired:
                if not await run.still_held():
                    raise taken_over(run) from None
                continue
            except retry_on as error:
                (telemetry.RETRY_VERSION if isinstance(error, StaleVersion) else telemetry.RETRY_LEDGER).inc()
                # Someone else changed the node; a short random pause spreads the contenders out.
                await asyncio.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
                continue
            failpoint("after-commit")
            self.committed(node, record, change, version)
            if change.journal is not None:
                await self.outbox.deliver(self.store.outbox_key(node), version, change.journal)
            return result, version
        raise node_busy(node)

    async def _replayed(self, node: str, kept: AlreadyApplied, result_type: type) -> tuple[Any, int]:
        """The answer an earlier run kept; its events go out now if that run died before they did."""
        await self.outbox.deliver(self.store.outbox_key(node), kept.version)
        return msgspec.msgpack.decode(kept.answer, type=result_type), kept.version

    def committed(self, node: str, record: NodeRecord | None, change: Change, version: int) -> None:
        """Show our own commit to the views and the directory at once, instead of waiting for its
        event and a reload."""
        fleet = self.fleet
        if not fleet.watching:
            return
        if change.delete:
            after = None
            fleet.views.invalidate(node)
        else:
            raw = {} if record is None else {n: v for n, v in record.raw.items() if n not in change.remove_plugins}
            raw.update(change.plugins)
            labels = change.labels if change.labels is not None else record.labels if record else {}
            status = change.status if change.status is not None else record.status if record else UP
            after = NodeRecord(node, version, labels, raw, change.tag, status)
            fleet.views.committed(after)
        if fleet.directory.note(after, node):
            fleet.views.relabelled(node, fleet.directory.selectable(node))

    # -- placements over several nodes ---------------------------------------------------------

    async def place(
        self, plan: dict[str, int], ids: list[str], requests: Keyed, reservation: Reservation
    ) -> list[Allocation]:
        """Commit a plan node by node. Over several nodes an intent records the ids first: if this
        worker dies half way, a reaper on any worker releases them (see `reap_intents`)."""
        owner = current_caller.get().name
        intent = uuid.uuid4().hex if len(plan) > 1 else None
        if intent:
            await self.store.begin_intent(intent, Intent(time.time() + self.intent_timeout, ids, owner))
        placed: list[Allocation] = []
        start = 0
        try:
            for node in sorted(plan):
                try:
                    deployed = await self.deploys.deploy(
                        node, ids[start:start + plan[node]], requests, settled=partial(reservation.settle, node)
                    )
                    placed += deployed.allocations
                except BerthError as error:
                    if not_placeable_now(error):
                        raise NodeFilledUp(node, error) from None
                    raise
                start += plan[node]
            if intent and not await self.store.take_intent(intent):
                # A reaper judged us dead and is releasing these ids: report failure, not a placement.
                raise BerthError("allocate took too long and was rolled back; retry", code="busy")
        except BaseException as error:
            # Release every id of the plan, not only those known placed: a commit interrupted by a
            # cancellation may have landed. Only the caller's own go (another's stay theirs), and not
            # the one found held already: it may be an earlier placement of this caller's.
            taken = error.details.get("workload_id") if isinstance(error, BerthError) and error.code == "workload_exists" else None
            await asyncio.shield(self._roll_back([i for i in ids if i != taken], owner, intent))
            raise
        return placed

    async def _roll_back(self, ids: list[str], owner: str | None, intent: str | None) -> None:
        released = await self.release(ids, owner)
        if released:
            log.info("allocate failed after placing %d instances: rolled them back", len(released))
        if intent:
            await self.store.take_intent(intent)

    async def recover(self, rounds: int, index_every: int = 12) -> None:
        """Publish the events dead workers committed but never published, reap the allocations
        they left half done, and every `index_every` rounds index what the ledgers hold that the
        workload index lost."""
        if delivered := await self.outbox.sweep():
            log.warning("published the events of %d changes whose worker had not", delivered)
        await self.reap_intents()
        if rounds % index_every == 0 and (repaired := await self.store.repair_index(await self.fleet.all_nodes())):
            log.warning("indexed %d workloads the ledgers hold and the index had lost", repaired)

    async def reap_intents(self) -> None:
        """Release the instances of multi-node allocations whose worker died before finishing."""
        for intent_id, intent in (await self.store.expired_intents(time.time())).items():
            if await self.store.take_intent(intent_id):
                ids = intent.workload_ids
                log.warning("allocate %s never finished: releasing its %d instances", intent_id, len(ids))
                await self.release(ids, intent.owner)

    async def forget_runs(
        self, request_id: str, attempt: int, count: int, nodes: list[str] | None = None
    ) -> int:
        """Release what earlier runs of this very request placed without answering (their worker
        died, and this run took their claim over); how many. Their ids derive from the request id
        (the caller's own) and the run, so they are this caller's; no caller ever saw them.
        `nodes`: where they can be (default: every node)."""
        earlier = [wid for run in range(attempt) for wid in workload_ids(count, None, request_id, run)]
        if len(await self.store.locate(earlier)) < len(earlier):
            # Not all were placed, or some lost their index entry with a Redis failover: look in the
            # ledgers (this reads the nodes' ledgers for these ids once).
            await self.store.repair_index(nodes if nodes is not None else await self.fleet.all_nodes(), earlier)
        released = await self.release(earlier, current_caller.get().name)
        if released:
            log.info("request %s: released %d instances an unanswered run had placed", request_id, len(released))
        return len(released)


class NodeFilledUp(Exception):
    """A node planned for an allocate had no room left at its commit (or stopped taking workloads)."""

    def __init__(self, node: str, error: BerthError) -> None:
        super().__init__(node)
        self.node = node
        self.error = error


def workload_ids(count: int, given: list[str] | None, request_id: str, attempt: int = 0) -> list[str]:
    """The caller's ids, else ids derived from the request id and its run (so a later run can find
    what an unanswered one placed), else fresh ones."""
    if given is not None:
        if len(given) != count or len(set(given)) != count:
            raise BerthError(
                f"workload_ids: need {count} distinct ids, got {len(given)}", code="invalid_argument",
                field="workload_ids",
            )
        return list(given)
    if request_id:
        run = f"{request_id}/{attempt}/" if attempt else f"{request_id}/"
        return [str(uuid.uuid5(_WORKLOAD_NAMESPACE, f"{run}{i}")) for i in range(count)]
    return [str(uuid.uuid4()) for _ in range(count)]

