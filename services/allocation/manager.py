"""The allocation service's orchestration: each command loads what it needs, asks the plugins, commits.

Every command works on a selection of plugins (`names`): a plugin-level endpoint selects one, a
manager-level endpoint all of them. Values come and go per plugin (`Keyed`, `States` and the typed
results of plugin_set.py); the transport (endpoints.py) translates them from and to the wire.
The parts: `PluginSet` (plugin_set.py) calculates, `Fleet` (fleet.py) knows the nodes and keeps the
capacity views, `Committer` (committer.py) commits changes and multi-node placements.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable


from bus.callers import Caller, current_caller
from bus.codec import encode
from bus.events import EventBus
from bus.failpoints import failpoint
from bus.idempotency import current_claim
from bus.outbox import VersionedOutboxes
from bus.tasks import cancel_and_wait, every
from schemas.allocation import Allocation, node_event
from schemas.errors import BerthError
from services.allocation.committer import Committer, NodeFilledUp, workload_ids
from services.allocation.dry_run import preview
from services.allocation.errors import (
    no_node_matches,
    no_room,
    node_not_found,
    not_yours,
    reply_too_large,
    workload_exists,
    workload_not_found,
)
from services.allocation.explain import Explainer
from services.allocation.fleet import Fleet
from services.allocation.leases import Heartbeat, Leases
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, ResourcePlugin
from services.allocation.plugins.plugin_set import (
    Deployment,
    Keyed,
    NodeInfo,
    PluginSet,
    Reallocation,
    StateChange,
    States,
)
from services.allocation.records import (
    Change,
    Lease,
    Ledger,
    LedgerConflict,
    NodeRecord,
    PluginState,
    encode_states,
)
from services.allocation.refusal import explains
from services.allocation.selection import Selection
from services.allocation.shards import Shards
from services.allocation.store import NodeStore
from services.allocation.view import Reservation, SpreadSample

log = logging.getLogger("berth.allocation")

Raw = dict[str, Any]

# Runs of a request an allocate looks for placements of before it places (after the idempotency
# window a retry starts again at run 0, and its first answer may have come from a later run).
LOOKED_BACK_RUNS = 4


class AllocationManager:
    """What every allocation command does, whatever level (plugin or manager) it came through:
    reads the nodes it needs (from the fleet's views or the store), asks the plugins, and hands
    every change to the committer, which writes it with a version check. The endpoints translate
    the wire to and from its per-plugin values; it never sees MessagePack or NATS."""

    def __init__(
        self,
        store: NodeStore,
        plugins: dict[str, ResourcePlugin],
        events: EventBus | None = None,
        *,
        attempts: int = 200,
        intent_timeout: float = 30.0,
        spread_sample: SpreadSample | None = None,
    ) -> None:
        self.store = store
        self.spread_sample = spread_sample or SpreadSample()
        self.plugins = PluginSet(plugins)
        self.events = events
        self.shards = Shards(store)
        self.fleet = Fleet(store, self.plugins, self.shards)
        self.committer = Committer(
            store, self.plugins, VersionedOutboxes(events, store.batch, store.pending_key, store.outbox_key),
            all_nodes=self.fleet.all_nodes, attempts=attempts, intent_timeout=intent_timeout,
        )
        self.fleet.follow_commits(self.committer.commits)
        self.deploys = self.committer.deploys
        self.leases = Leases(store, self.committer)
        self.explainer = Explainer(store, self.fleet, self.plugins)  # says why, once a request is refused
        self._chores: list[asyncio.Task] = []

    async def watch(self, sweep_interval: float = 5.0, lease_interval: float = 0.5) -> None:
        """Follow every worker's change events to keep views fresh; reap what dead workers left;
        every `lease_interval` mark down the nodes whose agent's lease lapsed; every second renew
        this worker's share of the nodes (shards.py)."""
        await self.fleet.watch(self.events, sweep_interval, self.committer.recover)
        if not self._chores:
            await self._reshard()
            self._chores = [
                asyncio.create_task(every(lease_interval, self.leases.sweep, "lease sweep")),
                asyncio.create_task(every(1.0, self._reshard, "worker membership")),
            ]

    async def _reshard(self) -> None:
        if await self.shards.renew():
            log.info("%d allocation workers: this one plans first on its share of the nodes",
                     len(self.shards.workers))
            self.fleet.views.resharded()

    async def unwatch(self) -> None:
        if self._chores:
            await cancel_and_wait(*self._chores)
            self._chores = []
            await self.shards.leave()
        await self.fleet.unwatch()

    async def _existing(self, node: str) -> NodeRecord:
        record = await self.store.load(node)
        if record is None:
            raise node_not_found(node)
        return record

    async def _load(self, node: str, names: list[str]) -> States:
        return self.plugins.states(await self._existing(node), names)

    def _state_events(self, node: str, kind: str, after: States, before: States | None = None) -> list:
        """One `kind` event per plugin in `after`; a plugin without a `before` state is `added`."""
        return [
            node_event(node, kind, plugin=name, before=as_map(before[name]), after=as_map(state))
            if before is not None and name in before
            else node_event(node, "added", plugin=name, after=as_map(state))
            for name, state in after.items()
        ]

    # -- calculations over stored nodes --------------------------------------------------------

    async def calculate_deploy(self, names: list[str], node: str, count: int, requests: Keyed) -> Deployment:
        record = await self._existing(node)
        states = self.plugins.states(record, names)
        try:
            return self.plugins.deploy(states, count, requests)
        except BerthError as error:
            if not no_room(error) or not self.plugins.covers(names):  # a plugin's own answer stays eru's
                raise
            raise self.explainer.calculation(error, record, count, requests) from None

    async def calculate_realloc(self, names: list[str], node: str, workload: Keyed, requests: Keyed) -> Reallocation:
        return self.plugins.realloc(await self._load(node, names), workload, requests)

    async def calculate_remap(self, names: list[str], node: str, workloads: dict[str, Keyed]) -> dict[str, Raw]:
        if not workloads:
            return {}
        return self.plugins.remap(await self._load(node, names), workloads)

    async def deploy_capacity(self, names: list[str], nodes: Selection, requests: Keyed) -> dict[str, DeployCapacity]:
        view = await self.fleet.view(names, nodes, requests)
        return dict(sorted(view.capacities().items()))

    async def most_idle(self, names: list[str], nodes: Selection) -> tuple[str, int]:
        """The most idle node by the highest-priority plugin; ties go to the smallest name."""
        records = await self.store.load_many(sorted(set(await self.fleet.members(nodes))))
        if not nodes.dynamic:
            for node, record in records.items():
                if record is None:
                    raise node_not_found(node)
                self.plugins.states(record, names)
        usable = {
            n: r.plugins for n, r in records.items()
            if r is not None and r.schedulable and all(name in r.plugins for name in names)
        }
        if not usable:
            raise no_node_matches(nodes)
        return self.plugins.most_idle(names, usable)

    def metrics_description(self, names: list[str]) -> list[Raw]:
        return self.plugins.metrics_description(names)

    async def metrics(self, names: list[str], podname: str, node: str) -> list[Raw]:
        return self.plugins.metrics(await self._load(node, names), podname, node)

    async def _with_workloads(
        self, names: list[str], node: str, workloads: list[Raw] | None
    ) -> tuple[NodeRecord, States, list[Raw]]:
        """A node's record, the selected states, and the given workloads or else its ledger's."""
        record, ledger = await self.store.load_with_ledger(node)
        if record is None:
            raise node_not_found(node)
        source = list(ledger.resources.values()) if workloads is None else workloads
        return record, self.plugins.states(record, names), source

    async def node_info(self, names: list[str], node: str, workloads: list[Raw] | None) -> NodeInfo:
        """Capacity, usage and the diffs against `workloads` (or the ledger, when none are given)."""
        _, states, source = await self._with_workloads(names, node, workloads)
        return NodeInfo(states, self.plugins.diffs(states, source))

    # -- node administration ---------------------------------------------------------------------

    async def fix(self, names: list[str], node: str, workloads: list[Raw] | None) -> NodeInfo:
        """Rewrite usage from the given workloads, or from the node's ledger when none are given."""

        async def compute():
            record, states, source = await self._with_workloads(names, node, workloads)
            diffs = self.plugins.diffs(states, source)
            fixed = self.plugins.fixed(states, source)
            return record, Change(plugins=encode_states(fixed) if diffs else {}), (states, fixed, diffs)

        (before, fixed, diffs), _ = await self.committer.mutate(
            node, compute, once=tuple[States, States, list[Raw]],
            events=lambda fixing: self._state_events(node, "usage", fixing[1], fixing[0]),
        )
        return NodeInfo(fixed, diffs)

    async def add_node(
        self, names: list[str], node: str, resources: Keyed, info: EngineInfo | None, labels: dict[str, str] | None
    ) -> States:
        created = self.plugins.added(names, resources, info)
        whole = self.plugins.covers(names)

        async def compute():
            record = await self.store.load(node)
            # A plugin may join an existing node; a manager-level add needs a new node.
            if record is not None and (whole or any(name in record.plugins for name in names)):
                raise BerthError(
                    f"node {node} already exists", code="node_exists", field="nodename", details={"nodename": node}
                )
            change = Change(plugins=encode_states(created), labels=labels if record is None else None)
            return record, change, None

        await self.store.add_to_index(node)  # before the record: a crash leaves an entry readers skip
        await self.committer.mutate(
            node, compute, once=type(None), events=lambda _: self._state_events(node, "added", created)
        )
        return created

    async def remove_node(self, names: list[str], node: str) -> None:
        """Manager level (all plugins) removes a node no workload holds; plugin level one plugin's record.

        Removing what does not exist succeeds and changes nothing (eru: "deleting a missing node is
        not an error"), so a retried or replayed removal is harmless."""
        whole = self.plugins.covers(names)

        async def compute():
            record = await self.store.load(node)
            if record is None:
                return None, Change(), ({}, True)
            present = {name: record.plugins[name] for name in names if name in record.plugins}
            if whole:
                return record, Change(delete="delete_if_empty"), (present, True)
            if set(record.plugins) <= set(names):  # the last plugins leave: the node goes
                return record, Change(delete="delete"), (present, True)
            return record, Change(remove_plugins=list(present)), (present, False)

        try:
            (_, gone), _ = await self.committer.mutate(
                node, compute, once=tuple[States, bool],
                events=lambda removal: [node_event(node, "removed", plugin=name, before=as_map(state))
                                        for name, state in removal[0].items()],
            )
        except LedgerConflict as conflict:
            raise BerthError(
                f"node {node} still holds {conflict.subject} workloads", code="node_not_empty",
                field="nodename", details={"nodename": node, "workloads": int(conflict.subject)},
            ) from None
        if gone:
            await self.store.remove_from_index(node)
            await self.store.forget_lease(node, ends=2**62)  # its lease went with the record

    async def _change_states(
        self, node: str, names: list[str], kind: str, update: Callable[[States], States]
    ) -> StateChange:
        """Replace the selected plugins' states with `update(states)`."""

        async def compute():
            record = await self._existing(node)
            states = self.plugins.states(record, names)
            after = update(states)
            return record, Change(plugins=encode_states(after)), StateChange(states, after)

        changed, _ = await self.committer.mutate(
            node, compute, once=StateChange,
            events=lambda change: self._state_events(node, kind, change.after, change.before),
        )
        return changed

    async def set_capacity(
        self, names: list[str], node: str, resources: Keyed, requests: Keyed, delta: bool, incr: bool
    ) -> StateChange:
        # As in eru, only the plugins that were given a resource or a request change.
        touched = [name for name in names if resources[name] is not None or requests[name] is not None]
        if not touched:
            unchanged = await self._load(node, names)
            return StateChange(unchanged, unchanged)
        return await self._change_states(
            node, touched, "capacity",
            lambda states: self.plugins.with_capacity(states, resources, requests, delta, incr),
        )

    async def set_usage(
        self, names: list[str], node: str, resources: Keyed, requests: Keyed, workloads: list[Raw], delta: bool,
        incr: bool,
    ) -> StateChange:
        return await self._change_states(
            node, names, "usage",
            lambda states: self.plugins.with_usage(states, resources, requests, workloads, delta, incr),
        )

    async def set_info(self, names: list[str], node: str, capacity: Keyed, usage: Keyed) -> None:
        """Store exactly the given capacity and usage (absolute). Like eru's SetNodeResourceInfo it
        works for a node, or a plugin of a node, that does not exist yet: those records are created
        (and announced as `added`), so a get -> remove -> set round trip restores a node exactly."""
        given = {name: PluginState(capacity[name] or {}, usage[name] or {}) for name in names}
        self.plugins.validate(given)

        async def compute():
            record = await self.store.load(node)
            before = {} if record is None else {n: record.plugins[n] for n in names if n in record.plugins}
            return record, Change(plugins=encode_states(given)), before

        await self.store.add_to_index(node)  # before the record: a crash leaves an entry readers skip
        await self.committer.mutate(
            node, compute, once=States, events=lambda before: self._state_events(node, "usage", given, before)
        )

    async def heartbeat(self, node: str, ttl_seconds: float, draining: bool, agent: bytes) -> Heartbeat:
        return await self.leases.heartbeat(node, ttl_seconds, draining, agent)

    async def set_labels(self, node: str, labels: dict[str, str]) -> None:
        async def compute():
            record = await self._existing(node)
            return record, Change(labels=labels), record.labels

        await self.committer.mutate(
            node, compute, once=dict[str, str],
            events=lambda before: [node_event(node, "labels", before={"labels": before}, after={"labels": labels})],
        )

    # -- committed allocations ---------------------------------------------------------------------

    async def allocate(
        self,
        nodes: Selection,
        strategy: str,
        count: int,
        requests: Keyed,
        given_ids: list[str] | None,
        request_id: str,
        *,
        dry_run: bool = False,
        replans: int = 20,
        reply_bytes: int | None = None,
    ) -> list[Allocation]:
        """Place `count` instances on `nodes` (`count` on each for `each`); all or nothing.
        `dry_run`: answer the plan, committing nothing (dry_run.py).

        A refusal for want of room says why (refusal.py): worked out only once refused."""
        try:
            return await self._allocate(nodes, strategy, count, requests, given_ids, request_id, dry_run=dry_run,
                                        replans=replans, reply_bytes=reply_bytes)
        except BerthError as error:
            if not explains(error):
                raise
            raise await self.explainer.allocate(error, nodes, strategy, count, requests) from None

    async def _allocate(
        self, nodes: Selection, strategy: str, count: int, requests: Keyed, given_ids: list[str] | None,
        request_id: str, *, dry_run: bool, replans: int, reply_bytes: int | None,
    ) -> list[Allocation]:
        """The plan is made from a snapshot of the nodes; if a node filled up before its commit, the
        instances already placed are returned and we plan again from a fresh snapshot. A plan
        whose answer would take more than `reply_bytes` is refused before it commits.
        """
        run = current_claim.get()
        attempt = run.attempt if run is not None and run.request_id == request_id else 0
        # ids derived from this request and its runs (a dry run places none)
        own_ids = given_ids is None and bool(request_id) and not dry_run
        if own_ids:
            failpoint("run-start")
            instances = await self._instances(nodes, strategy, count)
            if attempt:
                await self.committer.forget_runs(request_id, attempt, instances)
            earlier = await self._placed_before(request_id, attempt, instances)
            if earlier:
                return earlier
        elif given_ids is not None:
            await self._refuse_held(given_ids)
        cleared = False

        async def lost_run_found(error: BerthError) -> list[Allocation] | None:
            """The placement of this run's number that an earlier run made, or None to refuse."""
            nonlocal cleared
            if not own_ids or cleared:
                return None
            cleared = True
            return await self._lost_run(error, request_id, attempt, nodes, strategy, count)

        views = self.fleet.views
        failure: BerthError | None = None
        for replan in range(replans):
            reservation = Reservation.none()
            try:
                plan, reservation = await self._plan(nodes, strategy, count, requests, fresh=replan > 0)
                if dry_run:  # a plan nobody commits holds no room in the view, not even for a moment
                    reservation.settle_all()
                instances = sum(plan.values())
                # A dry run mints no id for what it does not place: the given ones, else "".
                unnamed = dry_run and given_ids is None
                ids = [""] * instances if unnamed else workload_ids(instances, given_ids, request_id, attempt)
                if reply_bytes is not None:
                    await self._check_reply_fits(plan, ids, requests, reply_bytes)
                if dry_run:
                    return await preview(self.store, self.plugins, plan, ids, requests)
                # spread decides on usage: a node another worker changed since is planned again
                # (but the last replan commits where it planned: spread is never refused for this)
                unmoved = strategy == "spread" and not nodes.single and replan < replans - 1
                return await self.committer.place(plan, ids, requests, reservation, unmoved=unmoved)
            except BerthError as error:
                found = await lost_run_found(error)
                if found is None:
                    raise
                if found:
                    return found
                failure = error
            except NodeFilledUp as filled:
                views.invalidate(filled.node, urgent=True)  # its record changed under the view: read it now
                views.contend(filled.node)
                failure = filled.error
                if nodes.single or replan == replans - 1:
                    found = await lost_run_found(filled.error)
                    if found is None:
                        raise filled.error from None
                    if found:
                        return found
                else:
                    log.debug("node %s filled up during allocate; planning again", filled.node)
            finally:
                reservation.settle_all()
        raise failure  # every replan met a node that filled up first

    async def _instances(self, nodes: Selection, strategy: str, count: int) -> int:
        """How many instances an allocate places in all (`each`: `count` on every selected node)."""
        return count * len(await self.fleet.members(nodes)) if strategy == "each" else count

    async def _lost_run(
        self, error: BerthError, request_id: str, attempt: int, nodes: Selection, strategy: str, count: int
    ) -> list[Allocation] | None:
        """`error` may come from this very request's own earlier run: its claim was lost (a Redis
        failover lost the claim's last writes), so this run has that run's number and finds its ids
        taken (`workload_exists`) or the room it took gone (a capacity refusal: the index may have
        lost its entries in the same failover, so the selected nodes' ledgers are searched). That
        run's placement is the answer (it may have been answered); [] means none was found: plan
        again, once. None: `error` is not of that kind."""
        capacity = no_room(error)
        if error.code != "workload_exists" and not capacity:
            return None
        instances = await self._instances(nodes, strategy, count)
        where = await self.fleet.members(nodes) if capacity else None
        await self.committer.find_runs(request_id, range(attempt, attempt + 1), instances, where)
        found = await self._placed_before(request_id, attempt, instances, runs=1)
        if found:
            log.warning("request %s: an earlier run of the same number had placed it; answering that", request_id)
        return found

    async def _placed_before(
        self, request_id: str, attempt: int, instances: int, runs: int = LOOKED_BACK_RUNS
    ) -> list[Allocation]:
        """What an earlier run of this request placed under this run's number or a later one (a
        retry after the idempotency window starts again at run 0; a failover can make a run repeat
        a number): the placements of the first such run that a node still holds, or []. The ledger
        is the truth: an allocate never places twice."""
        by_run = [workload_ids(instances, None, request_id, run) for run in range(attempt, max(attempt + 1, runs))]
        located = await self.store.locate([wid for ids in by_run for wid in ids])
        for ids in by_run:
            if any(wid in located for wid in ids):
                found = await self.placements(ids)
                if found:
                    return found
        return []

    async def placements(self, ids: list[str]) -> list[Allocation]:
        """The placements of those of `ids` a node holds for the caller (placed for it, not only
        visible to it), in the order of `ids`, as the ledger holds them (an instance released since
        is left out)."""
        caller = current_caller.get()
        located = await self.store.located(ids)
        read = await asyncio.gather(*(self.store.load_with_ledger(n, held) for n, held in located.nodes.items()))
        order = {wid: i for i, wid in enumerate(ids)}
        found = [
            Allocation(wid, record.name, resource, self.plugins.engine_params(resource))
            for record, ledger in read if record is not None
            for wid, resource in ledger.resources.items() if ledger.owner(wid) == caller.name
        ]
        return sorted(found, key=lambda allocation: order[allocation.workload_id])

    async def _plan(
        self, nodes: Selection, strategy: str, count: int, requests: Keyed, *, fresh: bool = False
    ) -> tuple[dict[str, int], Reservation]:
        """Where the instances go, reserved in the view until each node's deploy is settled
        (`fresh`: a plan before was refused at its commit: wait for the view's nodes to be read)."""
        if nodes.single:
            return {nodes.single: count}, Reservation.none()
        # pack plans on this worker's own nodes first: only those need reading again (see view.plan);
        # sampled spread reads only the nodes it draws (see Fleet.plan_sampled)
        sample = self.spread_sample if strategy == "spread" else None
        view = await self.fleet.view(list(self.plugins), nodes, requests, planning=strategy == "pack",
                                     sample=sample, fresh=fresh)
        if strategy == "each":
            return view.plan_each(count)

        async def plan() -> tuple[dict[str, int], Reservation]:
            if sample is not None and sample.applies(view):
                return await self.fleet.plan_sampled(view, nodes, count, sample)
            # pack steps aside from a node another worker is filling; spread must not (it would
            # take a busier node), it plans again when the node it chose moved (`unmoved`)
            return view.plan(strategy, count, self.fleet.views.contended if strategy == "pack" else _never)

        try:
            return await plan()
        except BerthError as error:
            if error.code != "insufficient_capacity" or not view.stale:
                raise
        # Other workers' nodes that changed were not read again for planning; before refusing, do.
        await self.fleet.refresh(view, nodes)
        return await plan()

    async def _check_reply_fits(self, plan: dict[str, int], ids: list[str], requests: Keyed, limit: int) -> None:
        """Refuse a plan whose answer NATS could not carry: placed and unanswered, it would hold
        capacity nobody knows of. The size is one instance's entry times the instances; the entry is
        computed (one instance on the plan's first node) only when even empty entries come near."""
        longest_id, longest_node = max(ids, key=len), max(plan, key=len)
        floor = _entry_size(Allocation(longest_id, longest_node, {}, {}))
        if len(ids) * floor * 32 > limit:  # a computed entry is rarely 32 times an empty one
            entry = await self._sample_entry(next(iter(sorted(plan))), requests)
            floor = _entry_size(Allocation(longest_id, longest_node, *entry)) if entry else floor
        if len(ids) * floor > limit:
            raise reply_too_large("deploy_count", len(ids) * floor, limit, "allocate fewer instances at once")

    async def _sample_entry(self, node: str, requests: Keyed) -> tuple[Raw, Raw] | None:
        """One instance's (workload resource, engine params) on `node`, or None when none fits
        there now (the commit will say so)."""
        try:
            deployment = self.plugins.deploy(await self._load(node, list(self.plugins)), 1, requests)
        except BerthError:
            return None
        return deployment.workloads_resource[0], deployment.engines_params[0]

    async def release(self, ids: list[str]) -> list[str]:
        """Return the workloads' resources to their nodes, once per request; ids nobody holds are
        skipped. The answer names every id this request removed, also those an earlier run of it
        removed before it died unanswered: each node keeps what the request removed there.

        The caller must own every id a node holds (bus.callers): one it does not own refuses the
        whole request before anything is released. An id that changes hands after that check
        (released, and placed again by another) stays its new owner's: each commit re-checks owners."""
        caller = current_caller.get()
        located = await self.store.located(ids)
        if not caller.holds_everything:
            refuse_unowned(caller, ids, await self._held_owners(located.nodes))
        return await self.committer.release(ids, located, caller.holds, once=True)

    async def give_back(self, ids: list[str], owner: str | None) -> list[str]:
        """Release workloads that no answer named, placed for `owner` (see `Committer.give_back`)."""
        return await self.committer.give_back(ids, owner)

    async def _refuse_held(self, ids: list[str]) -> None:
        """Workload ids are unique across the platform: an id that any node holds, whoever placed
        it, is `workload_exists` (a node's own commit refuses one it holds; this finds the others)."""
        held = await self._held_owners((await self.store.located(ids)).nodes)
        if held:
            raise workload_exists(min(held))

    async def _held_owners(self, by_node: dict[str, list[str]]) -> dict[str, str | None]:
        """Each of the ids (by the node the index places them on) that its node holds -> its owner."""
        read = await asyncio.gather(*(self.store.load_with_ledger(n, ids) for n, ids in by_node.items()))
        return {wid: ledger.owner(wid) for _, ledger in read for wid in ledger.resources}

    async def realloc(self, workload_id: str, requests: Keyed) -> tuple[str, Reallocation]:
        """A held workload's new resources, committed; returns its node and the reallocation."""
        node = (await self.store.locate([workload_id])).get(workload_id)
        if node is None:
            raise workload_not_found(workload_id)
        names = list(self.plugins)
        caller = current_caller.get()

        async def compute():
            record, ledger = await self.store.load_with_ledger(node, [workload_id])
            if record is None or workload_id not in ledger.resources:
                raise workload_not_found(workload_id)
            if not caller.holds(ledger.owner(workload_id)):
                raise not_yours("workload_id", workload_id)
            states = self.plugins.states(record, names)
            current = ledger.resources[workload_id]
            result = self.plugins.realloc(states, current, requests)
            after = self.plugins.reallocated(states, current, result.workload_resource)
            change = Change(plugins=encode_states(after), owners=ledger.owners,
                            ledger_replace={workload_id: result.workload_resource})
            return record, change, (current, result)

        (_, result), _ = await self.committer.mutate(
            node, compute, retry_ledger=True, once=tuple[Raw, Reallocation],
            events=lambda realloc: [node_event(
                node, "usage", workload_ids=[workload_id], before={"workload_resource": realloc[0]},
                after={"workload_resource": realloc[1].workload_resource},
            )],
        )
        return node, result

    async def allocations(self, node: str) -> dict[str, Raw]:
        """The node's ledger as the caller may see it: workload id -> its resource keyed by plugin."""
        record, ledger = await self.store.load_with_ledger(node)
        if record is None:
            raise node_not_found(node)
        return visible(current_caller.get(), ledger)

    async def list_nodes(
        self, nodenames: list[str] | None, labels: dict[str, str], offset: int, limit: int
    ) -> tuple[list[NodeRecord], dict[str, Lease], int]:
        """One page of nodes, the leases of those an agent keeps, and how many nodes there are."""
        records, total = await self.fleet.page(nodenames, labels, offset, limit)
        return records, await self.store.leases([r.name for r in records]), total


def _never(node: str) -> bool:
    return False


def refuse_unowned(caller: Caller, ids: list[str], owners: dict[str, str | None]) -> None:
    """Refuse the first of `ids` that a node holds (`owners`: each held id's owner, None for none)
    for an owner `caller` may not act on."""
    for i, wid in enumerate(ids):
        if wid in owners and not caller.holds(owners[wid]):
            raise not_yours(f"workload_ids[{i}]", wid)


def visible(caller: Caller, ledger: Ledger) -> dict[str, Raw]:
    """The ledger's entries `caller` may see: a tenant only its own."""
    return {wid: resource for wid, resource in ledger.resources.items() if caller.sees(ledger.owner(wid))}


def _entry_size(entry: Allocation) -> int:
    return len(encode(entry)) + 1  # and a byte or so of the list around them


def as_map(state: PluginState) -> Raw:
    """A plugin state as events carry it."""
    return {"capacity": state.capacity, "usage": state.usage}
