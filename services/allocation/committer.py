"""Committing changes to nodes: single changes (`mutate`), releases, and multi-node placements
that either all land or are rolled back, even when their worker dies half way.

A change is computed on a fresh record and committed with `NodeStore.commit`, which refuses if the
record changed meanwhile; then we compute again on the fresh record. Calculation and commit are
therefore one atomic step per node, with any number of workers. Every change goes through the
one loop of commits.py (`NodeCommits`); deploys through `DeployBatches` there, one commit per node
in flight per worker. A rollback gives back what it placed through this module's own `give_back`:
nothing on the commit path calls back into the manager, nor into the fleet: the views learn of a
commit through the hooks the fleet registers on `NodeCommits` (`Fleet.follow_commits`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

from bus.callers import current_caller
from bus.codec import decode_stored, encode
from bus.idempotency import Claim, own_claim, taken_over
from bus.outbox import VersionedOutboxes, journal
from schemas.allocation import Allocation, workload_events
from schemas.common import Event
from schemas.errors import BerthError
from services.allocation import telemetry
from services.allocation.commits import Attempt, DeployBatches, NodeCommits
from services.allocation.errors import not_placeable_now
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import (
    AlreadyApplied,
    Change,
    Intent,
    LeaseExpired,
    LedgerConflict,
    Located,
    NodeRecord,
    encode_states,
)
from services.allocation.store import NodeStore
from services.allocation.view import Reservation

log = logging.getLogger("berth.allocation")

T = TypeVar("T")

# Workload ids derived from a request_id are stable, so a retried allocate names the same workloads.
_WORKLOAD_NAMESPACE = uuid.UUID("6f1d3c2e-8a4b-4e55-9a37-3b0f1c7d2e91")
_NAMESPACE_BYTES = _WORKLOAD_NAMESPACE.bytes


class Committer:
    """Writes changes to nodes: computes each on a fresh record, commits it with the record's version
    (computing again when another worker changed the node first), publishes its events through the
    node's outbox, and places a multi-node allocation all or nothing (an intent first, then one
    batched commit per node, rolled back if a node refuses)."""

    def __init__(
        self,
        store: NodeStore,
        plugins: PluginSet,
        outbox: VersionedOutboxes,
        *,
        all_nodes: Callable[[], Awaitable[list[str]]],
        attempts: int = 200,
        intent_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.plugins = plugins
        self.all_nodes = all_nodes  # every node's name (searched when an index entry may be lost)
        self.outbox = outbox
        self.intent_timeout = intent_timeout
        self.commits = NodeCommits(store, attempts)
        self.deploys = DeployBatches(self.commits, plugins, outbox, release=self.give_back)

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
        run = own_claim() if once is not None else None
        if run is not None and run.attempt:  # an earlier run may have applied it and died unanswered
            kept = (await self.store.applied([node], run.marker)).get(node)
            if kept is not None:
                return await self._replayed(node, kept, once)
        ledger_retries = 0

        async def attempt() -> Attempt[T]:
            record, change, result = await compute()
            if change.is_empty():
                return Attempt(record, None, result, record.version if record else 0)
            change.journal = journal(announced) if (announced := events(result)) else None
            if run is not None:
                change.once, change.fence = (run.marker, encode(result), run.window), run.lease_end
            return Attempt(record, change, result)

        async def conflict(error: BaseException, step: Attempt[T]) -> Attempt[T] | None:
            nonlocal ledger_retries
            if isinstance(error, AlreadyApplied):  # an earlier run applied it: its answer is the answer
                return Attempt(step.record, None, *await self._replayed(node, error, once))
            if isinstance(error, LeaseExpired) and run is not None:
                if not await run.still_held():
                    raise taken_over(run) from None
                return None
            if isinstance(error, LedgerConflict) and retry_ledger:
                telemetry.RETRY_LEDGER.inc()
                ledger_retries += 1  # someone else moved the entry: a short random pause spreads us out
                await asyncio.sleep(random.uniform(0, 0.002 * min(ledger_retries, 10)))
                return None
            raise error

        step = await self.commits.run(node, attempt, conflict)
        if step.change is not None and step.change.journal is not None:
            await self.outbox.deliver(self.store.outbox_key(node), step.version, step.change.journal)
        return step.result, step.version

    async def _replayed(self, node: str, kept: AlreadyApplied, result_type: type) -> tuple[Any, int]:
        """The answer an earlier run kept; its events go out now if that run died before they did."""
        await self.outbox.deliver(self.store.outbox_key(node), kept.version)
        return decode_stored(kept.answer, result_type), kept.version

    # -- releases ---------------------------------------------------------------------------------

    async def give_back(self, ids: list[str], owner: str | None) -> list[str]:
        """Release workloads that no answer named (a rolled-back or unanswered placement) placed for
        `owner`: an id that someone else holds by then stays theirs."""
        return await self.release(ids, await self.store.located(ids), lambda held: held == owner, once=False)

    async def release(
        self, ids: list[str], located: Located, mine: Callable[[str | None], bool], *, once: bool
    ) -> list[str]:
        """Release the `located` ids whose owner `mine` accepts; those of other owners stay, indexed.
        `once`: as the answer to the request this task runs under (see `mutate`)."""
        released: list[str] = []
        run = own_claim() if once else None
        unknown = set(ids) - set(located.entries)
        if run is not None and run.attempt and unknown:
            released += await self._released_before(run, unknown)
        others: set[str] = set()
        for node, held_ids in sorted(located.nodes.items()):
            gone, theirs = await self._release_on(node, held_ids, mine, once)
            released += gone
            others |= theirs
        await self.store.unindex({wid: entry for wid, entry in located.entries.items() if wid not in others})
        return sorted(set(released))

    async def _released_before(self, run: Claim, ids: set[str]) -> list[str]:
        """Which of `ids` (no longer indexed) an earlier run of this request removed: the nodes'
        kept answers say. Only a retry after a run that died unanswered pays for this search."""
        kept = await self.store.applied(await self.all_nodes(), run.marker)
        return [wid for answer in kept.values() for wid in decode_stored(answer.answer, list[str])
                if wid in ids]

    async def _release_on(
        self, node: str, ids: list[str], mine: Callable[[str | None], bool], once: bool
    ) -> tuple[list[str], set[str]]:
        """Release those of `ids` the node holds for an owner `mine` accepts; returns them, and the
        ids it holds for other owners (as the computation that committed saw them)."""
        theirs: set[str] = set()  # not part of the result: a retry's kept answer names only what went
        owners: dict[str, str] = {}  # of the ids read, for their owners' own events

        async def compute():
            record, ledger = await self.store.load_with_ledger(node, ids)
            theirs.clear()
            theirs.update(wid for wid in ledger.resources if not mine(ledger.owner(wid)))
            owners.update(ledger.owners)
            ours = [wid for wid in ledger.resources if wid not in theirs]
            if record is None or not ours:
                return record, Change(), []
            after = self.plugins.released(record.plugins, [ledger.resources[wid] for wid in ours])
            change = Change(plugins=encode_states(after), ledger_remove=ours, owners=ledger.owners)
            return record, change, sorted(ours)

        released, _ = await self.mutate(
            node, compute, retry_ledger=True, once=list[str] if once else None,
            events=lambda ids: workload_events(node, "released", ids, owners),
        )
        telemetry.RELEASED.inc(len(released))
        return released, theirs

    # -- placements over several nodes ---------------------------------------------------------

    async def place(
        self, plan: dict[str, int], ids: list[str], requests: Keyed, reservation: Reservation, *,
        unmoved: bool = False,
    ) -> list[Allocation]:
        """Commit a plan node by node. Over several nodes an intent records the ids first: if this
        worker dies half way, a reaper on any worker releases them (see `reap_intents`).
        `unmoved`: a node another writer changed since the plan saw it is refused (`DeployBatches.deploy`)."""
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
                        node, ids[start:start + plan[node]], requests, settled=partial(reservation.settle, node),
                        unmoved=reservation.versions.get(node) if unmoved else None,
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
        released = await self.give_back(ids, owner)
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
        if rounds % index_every == 0 and (repaired := await self.store.repair_index(await self.all_nodes())):
            log.warning("indexed %d workloads the ledgers hold and the index had lost", repaired)

    async def reap_intents(self) -> None:
        """Release the instances of multi-node allocations whose worker died before finishing."""
        for intent_id, intent in (await self.store.expired_intents(time.time())).items():
            if await self.store.take_intent(intent_id):
                ids = intent.workload_ids
                log.warning("allocate %s never finished: releasing its %d instances", intent_id, len(ids))
                await self.give_back(ids, intent.owner)

    async def find_runs(self, request_id: str, runs: range, count: int, nodes: list[str] | None = None) -> list[str]:
        """The ids these runs of the request derive, each indexed where a node holds it. `nodes`:
        where they can be (default: every node)."""
        ids = [wid for run in runs for wid in workload_ids(count, None, request_id, run)]
        if len(await self.store.locate(ids)) < len(ids):
            # Not all were placed, or some lost their index entry with a Redis failover: look in the
            # ledgers (this reads the nodes' ledgers for these ids once).
            await self.store.repair_index(nodes if nodes is not None else await self.all_nodes(), ids)
        return ids

    async def forget_runs(
        self, request_id: str, attempt: int, count: int, nodes: list[str] | None = None
    ) -> int:
        """Release what earlier runs of this very request placed without answering (their worker
        died, and this run took their claim over); how many. Their ids derive from the request id
        (the caller's own) and the run, so they are this caller's; no caller ever saw them: a run
        answers only once its answer is kept, and then no later run starts."""
        earlier = await self.find_runs(request_id, range(attempt), count, nodes)
        released = await self.give_back(earlier, current_caller.get().name)
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
        return [_uuid5(f"{run}{i}") for i in range(count)]
    return [str(uuid.uuid4()) for _ in range(count)]


def _uuid5(name: str) -> str:
    """`str(uuid.uuid5(_WORKLOAD_NAMESPACE, name))` in a third of its time (every allocate derives
    the ids of its run and of the runs it looks for)."""
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

