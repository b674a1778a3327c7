"""Committing to a node: the one optimistic loop every change goes through (`NodeCommits`), and
deploys gathered into batches (`DeployBatches`): many concurrent placements, one commit per node.

Every commit re-checks the node's version, so two commits to one node from the same worker race
and one of them must compute again. With `pack`, every request wants the most-used node: 64
concurrent requests made 64 racing commits, each loser reading the node and computing again, and
placements crawled. Here a worker keeps at most one commit per node in flight: deploys that arrive
meanwhile wait, then go together in the next commit, each computed on the state its predecessors
leave. A deploy that does not fit fails alone; the others commit. Races remain only between
workers, one batch each.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, TypeVar

from bus.callers import current_caller
from bus.outcome import Outcome, deciding
from bus.outcome import current as outcome_now
from bus.codec import encode
from bus.failpoints import failpoint
from bus.idempotency import Claim, own_claim, taken_over
from bus.outbox import VersionedOutboxes, journal
from schemas.allocation import Allocation, workload_events
from schemas.errors import BerthError
from services.allocation import telemetry
from services.allocation.errors import node_busy, node_moved, node_not_found, not_schedulable, workload_exists
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import Change, LeaseExpired, LedgerConflict, NodeRecord, StaleVersion
from services.allocation.store import NodeStore

log = logging.getLogger("berth.allocation")
OWN_COMMITS_KEPT = 4096  # this worker's latest commits remembered, to tell its own changes from others'
OWN_CHAIN = 8  # own commits between a plan and its commit that still count as the plan's node


@dataclass(eq=False)  # identity: two deploys are never the same one
class Deploy:
    """Instances to place on one node: their ids and the per-plugin request."""

    ids: list[str]
    requests: Keyed
    # The request's claim, whose lease fences the commit (a run taken over writes nothing).
    claim: Claim | None = field(default_factory=own_claim)
    # Whom the instances are placed for: the request's caller (a batch commits in another request's task).
    owner: str | None = field(default_factory=lambda: current_caller.get().name)
    # What the request may have changed, should its commit's reply be lost (bus.outcome).
    outcome: Outcome | None = field(default_factory=outcome_now)
    # Called once the deploy is committed or refused, in the same step as the views learn the
    # commit: the planner's reservation for it ends exactly when the record holds it.
    settled: Callable[[], None] = lambda: None
    # Only onto the node as its planner knew it, at this version (spread): a change since that is
    # not this worker's own refuses it (`NodeCommits.unmoved`).
    unmoved: int | None = None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def request_keys(self) -> dict[str, bytes]:
        return {name: encode(request) for name, request in self.requests.items()}


@dataclass
class Placed:
    """A committed deploy: one allocation per instance, and the node's version after it."""

    allocations: list[Allocation]
    version: int


T = TypeVar("T")

# Told of a landed commit: the node, the record the change was computed on (None: a new node), the
# change, and the node's version it made.
CommitHook = Callable[[str, NodeRecord | None, Change, int], None]


@dataclass
class Attempt(Generic[T]):
    """One try at changing a node: the record it was computed on (None: the node is new), the change
    (None: nothing to write, `result` is already the answer), and what the caller gets once it
    lands, with the node's version then."""

    record: NodeRecord | None
    change: Change | None
    result: T
    version: int = 0
    # The requests whose answer the commit decides (bus.outcome): the current one when None, the
    # requests of the deploys of a batch.
    deciding: list[Outcome | None] | None = None


class NodeCommits:
    """The one optimistic loop every change to a node goes through: compute it on the record as it
    is, commit it with that record's version, and compute again when another writer changed the
    node first. What else a refused commit means (a ledger entry moved, a lease ended, the change
    was applied already) is the caller's `conflict` to say: compute again (None), that is the
    outcome (an Attempt), or give up (raise).

    The loop knows nothing of who keeps what this worker knows of the nodes (fleet.py's views and
    directory): that keeper registers its hooks here. `on_commit` are told of every commit that
    lands, `on_contended` of every node another writer committed to first, each in the same step;
    `recall(node)` may offer a record remembered of the node, to save a read (None: read it)."""

    def __init__(self, store: NodeStore, attempts: int = 200) -> None:
        self.store = store
        self.attempts = attempts
        self.on_commit: list[CommitHook] = []
        self.on_contended: list[Callable[[str], None]] = []
        self.recall: Callable[[str], NodeRecord | None] = lambda node: None
        # This worker's latest commits: (node, the version it was computed on) -> the version it made.
        self._own: OrderedDict[tuple[str, int], int] = OrderedDict()

    async def run(
        self,
        node: str,
        compute: Callable[[], Awaitable[Attempt[T]]],
        conflict: Callable[[BaseException, Attempt[T]], Awaitable[Attempt[T] | None]],
    ) -> Attempt[T]:
        for attempt in range(self.attempts):
            step = await compute()
            if step.change is None:
                return step
            record = step.record
            failpoint("before-commit")
            try:
                version = await deciding(self.store.commit(
                    node, record.version if record else 0, step.change, record.tag if record else ""
                ), step.deciding)
            except StaleVersion:
                telemetry.RETRY_VERSION.inc()
                for contended in self.on_contended:
                    contended(node)
                # Reading the node again is pause enough the first times; after that a short random
                # pause spreads the contenders out.
                if attempt >= 2:
                    await asyncio.sleep(random.uniform(0, 0.001 * min(attempt, 10)))
                continue
            except BaseException as error:
                outcome = await conflict(error, step)
                if outcome is not None:
                    return outcome
                continue
            failpoint("after-commit")
            step.version = version
            self._own[(node, record.version if record else 0)] = version
            if len(self._own) > OWN_COMMITS_KEPT:
                self._own.popitem(last=False)
            for committed in self.on_commit:
                committed(node, record, step.change, version)
            return step
        raise node_busy(node)

    def unmoved(self, node: str, planned: int, current: int) -> bool:
        """Whether every change that took `node` from version `planned` to `current` was this
        worker's own commit (those its planner counted on as reserved): no other writer's."""
        version: int | None = planned
        for _ in range(OWN_CHAIN):
            if version is None or version >= current:
                return version == current
            version = self._own.get((node, version))
        return False


class DeployBatches:
    """Deploys to the same node, gathered while a commit to it is in flight and then committed
    together: one version check and one write for many requests (a busy node is one hot key)."""

    def __init__(
        self,
        commits: NodeCommits,
        plugins: PluginSet,
        outbox: VersionedOutboxes,
        release: Callable[[list[str], str | None], Awaitable[Any]],
    ) -> None:
        self.commits = commits
        self.store = commits.store
        self.plugins = plugins
        self.outbox = outbox
        self.release = release  # gives back what was placed for a caller (by name) that went away
        self._waiting: dict[str, list[Deploy]] = {}  # node -> deploys for its next commit

    async def deploy(
        self, node: str, ids: list[str], requests: Keyed, *, settled: Callable[[], None] = lambda: None,
        unmoved: int | None = None,
    ) -> Placed:
        """Place `ids` on `node`, in this worker's next commit to it; raises what the plugins refuse
        (`unmoved`, the version the plan saw: also `node_moved` when another writer changed it since)."""
        deploy = Deploy(ids, requests, settled=settled, unmoved=unmoved)
        if node in self._waiting:
            self._waiting[node].append(deploy)  # a commit to it is in flight: go with the next one
        else:
            self._waiting[node] = []
            try:
                await self._commit([deploy], node)
            finally:
                self._next(node)
        placed = await deploy.done
        self.store.wrote(node)  # committed in whichever request's task ran the batch: note it for ours
        return placed

    def _next(self, node: str) -> None:
        """Start the next batch for `node` in a task of its own (the caller answers its client now)."""
        batch = self._waiting[node]
        if not batch:
            del self._waiting[node]
            return
        self._waiting[node] = []
        task = asyncio.get_running_loop().create_task(self._commit(batch, node))
        task.add_done_callback(lambda _: self._next(node))

    async def _commit(self, batch: list[Deploy], node: str) -> None:
        """Commit as many deploys of `batch` as fit, in one step; settle every one's future."""
        try:
            placed, refused, version, announced = await self._commit_fitting(node, batch)
        except BaseException as error:
            for deploy in batch:
                deploy.settled()
                if not deploy.done.done():
                    deploy.done.set_exception(error if isinstance(error, Exception) else asyncio.CancelledError())
            if not isinstance(error, Exception):
                raise
            return
        for deploy in batch:
            deploy.settled()
        for deploy, error in refused.items():
            deploy.done.set_exception(error)
        abandoned = []
        for deploy, allocations in placed.items():
            if deploy.done.cancelled():  # its caller went away while waiting: give the room back
                abandoned.append(deploy)
            else:
                deploy.done.set_result(Placed(allocations, version))
        if announced is not None:
            await self.outbox.deliver(self.store.outbox_key(node), version, announced)
        for deploy in abandoned:
            log.info("releasing %d instances placed for a caller that went away", len(deploy.ids))
            await self.release(deploy.ids, deploy.owner)

    async def _commit_fitting(
        self, node: str, batch: list[Deploy]
    ) -> tuple[dict[Deploy, list[Allocation]], dict[Deploy, BaseException], int, bytes | None]:
        """The deploys committed, those refused, the node's version, and the commit's events."""

        async def compute() -> Attempt[tuple]:
            # A record this worker already holds saves a read (the commit checks its version).
            record = self.commits.recall(node) or await self.store.load(node)
            if record is None:
                return Attempt(None, None, ({}, {d: node_not_found(node) for d in batch}, 0, None))
            if not record.schedulable:  # a node going down after this read fails the commit's version check
                refused = {d: not_schedulable(node, record.status) for d in batch}
                return Attempt(record, None, ({}, refused, record.version, None))
            placed, refused, after = self._fit(record, batch)
            if not placed:
                return Attempt(record, None, ({}, refused, record.version, None))
            ids = [i for d in placed for i in d.ids]
            ledger = {a.workload_id: a.workload_resource for allocations in placed.values() for a in allocations}
            owners = {wid: d.owner for d in placed if d.owner is not None for wid in d.ids}
            fence = min((d.claim.lease_end for d in placed if d.claim is not None), default=0)
            change = Change(plugins=after, ledger_add=ledger, owners=owners, index=ids, fence=fence,
                            journal=journal(workload_events(node, "allocated", ids, owners)))
            return Attempt(record, change, (placed, refused), deciding=[d.outcome for d in placed])

        async def conflict(error: BaseException, step: Attempt[tuple]) -> None:
            nonlocal batch
            placed: dict[Deploy, list[Allocation]] = step.result[0]
            ids = [i for d in placed for i in d.ids]
            if isinstance(error, LeaseExpired):
                # A run's lease ended (its worker paused?): renew each; a run taken over is refused.
                await self._unindex(node, step.change, ids)
                claimed = [d for d in placed if d.claim is not None]
                held = await asyncio.gather(*(d.claim.still_held() for d in claimed))
                for deploy in (d for d, alive in zip(claimed, held) if not alive):
                    batch = [d for d in batch if d is not deploy]
                    deploy.done.set_exception(taken_over(deploy.claim))
                return None
            if isinstance(error, LedgerConflict):
                # A workload id is taken already: refuse the deploy that named it, try the rest again.
                culprit = next(d for d in placed if error.subject in d.ids)
                await self._unindex(node, step.change, [i for i in culprit.ids if i != error.subject])
                batch = [d for d in batch if d is not culprit]
                culprit.done.set_exception(workload_exists(error.subject))
                return None
            await self._unindex(node, step.change, ids)
            raise error

        step = await self.commits.run(node, compute, conflict)
        if step.change is None:
            return step.result
        placed, refused = step.result
        telemetry.PLACEMENTS.inc(sum(len(d.ids) for d in placed))
        telemetry.COMMIT_DEPLOYS.observe(len(placed))
        return placed, refused, step.version, step.change.journal

    async def _unindex(self, node: str, change: Change, ids: list[str]) -> None:
        """Take back the index entries a refused commit wrote for `ids` (not those written since)."""
        await self.store.unindex(dict.fromkeys(ids, self.store.index_entry(node, change.tag)))

    def _fit(
        self, record: NodeRecord, batch: list[Deploy]
    ) -> tuple[dict[Deploy, list[Allocation]], dict[Deploy, BaseException], dict[str, bytes]]:
        """Each deploy in turn on the state the ones before it leave; those that do not fit are refused,
        and so is one that names an id a deploy before it places (the ledger holds an id once)."""
        state = dict(record.raw)
        placed: dict[Deploy, list[Allocation]] = {}
        refused: dict[Deploy, BaseException] = {}
        taken: set[str] = set()
        for deploy in batch:
            if deploy.unmoved is not None and not self.commits.unmoved(record.name, deploy.unmoved, record.version):
                refused[deploy] = node_moved(record.name)
                continue
            twice = next((wid for wid in deploy.ids if wid in taken), None)
            if twice is not None:
                refused[deploy] = workload_exists(twice)
                continue
            try:
                deployment, after = self.plugins.deploy_stored(
                    record.name, state, len(deploy.ids), deploy.requests, deploy.request_keys
                )
            except BerthError as error:
                refused[deploy] = error
                continue
            state.update(after)
            taken.update(deploy.ids)
            placed[deploy] = [
                Allocation(wid, record.name, workload, engine)
                for wid, workload, engine in zip(deploy.ids, deployment.workloads_resource, deployment.engines_params)
            ]
        return placed, refused, {name: state[name] for name in self.plugins if state[name] is not record.raw.get(name)}
