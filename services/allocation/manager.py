"""The allocation service's orchestration: each command loads what it needs, asks the plugins, commits.

Every command works on a selection of plugins (`names`): a plugin-level endpoint selects one, a
manager-level endpoint all of them. Values come and go per plugin (`Keyed`, `States` and the typed
results of plugin_set.py); the transport (endpoints.py) translates them from and to the wire.
The parts: `PluginSet` (plugin_set.py) calculates, `Fleet` (fleet.py) knows the nodes and keeps the
capacity views, `Committer` (committer.py) commits changes and multi-node placements, `Placer`
(placing.py) plans and places an allocate's instances and reads back what a request placed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable


from bus.callers import Caller, current_caller
from bus.events import EventBus
from bus.outbox import VersionedOutboxes
from bus.tasks import cancel_and_wait, every
from schemas.allocation import Allocation, node_event, workload_events
from schemas.errors import BerthError
from services.allocation.committer import Committer
from services.allocation.errors import no_node_matches, no_room, node_not_found, not_yours, workload_not_found
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
from services.allocation.placing import Placer
from services.allocation.selection import Selection
from services.allocation.shards import Shards
from services.allocation.store import NodeStore
from services.allocation.view import SpreadSample

log = logging.getLogger("berth.allocation")

Raw = dict[str, Any]


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
        self.placer = Placer(store, self.plugins, self.fleet, self.committer, self.explainer,
                             spread_sample or SpreadSample())
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
        self, nodes: Selection, strategy: str, count: int, requests: Keyed, given_ids: list[str] | None,
        request_id: str, **options: Any,
    ) -> list[Allocation]:
        """Place `count` instances on `nodes`, all or nothing (placing.py: `Placer.allocate`)."""
        return await self.placer.allocate(nodes, strategy, count, requests, given_ids, request_id, **options)

    async def placements(self, ids: list[str]) -> list[Allocation]:
        """What a node holds of `ids` for the caller (placing.py: `Placer.placements`)."""
        return await self.placer.placements(ids)

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
            refuse_unowned(caller, ids, await self.store.held_owners(located.nodes))
        return await self.committer.release(ids, located, caller.holds, once=True)

    async def give_back(self, ids: list[str], owner: str | None) -> list[str]:
        """Release workloads that no answer named, placed for `owner` (see `Committer.give_back`)."""
        return await self.committer.give_back(ids, owner)

    async def realloc(self, workload_id: str, requests: Keyed) -> tuple[str, Reallocation]:
        """A held workload's new resources, committed; returns its node and the reallocation."""
        node = (await self.store.locate([workload_id])).get(workload_id)
        if node is None:
            raise workload_not_found(workload_id)
        names = list(self.plugins)
        caller = current_caller.get()
        owners: dict[str, str] = {}  # for the owner's own event

        async def compute():
            record, ledger = await self.store.load_with_ledger(node, [workload_id])
            if record is None or workload_id not in ledger.resources:
                raise workload_not_found(workload_id)
            owners.update(ledger.owners)
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
            events=lambda realloc: workload_events(
                node, "usage", [workload_id], owners, before={"workload_resource": realloc[0]},
                after={"workload_resource": realloc[1].workload_resource},
            ),
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


def refuse_unowned(caller: Caller, ids: list[str], owners: dict[str, str | None]) -> None:
    """Refuse the first of `ids` that a node holds (`owners`: each held id's owner, None for none)
    for an owner `caller` may not act on."""
    for i, wid in enumerate(ids):
        if wid in owners and not caller.holds(owners[wid]):
            raise not_yours(f"workload_ids[{i}]", wid)


def visible(caller: Caller, ledger: Ledger) -> dict[str, Raw]:
    """The ledger's entries `caller` may see: a tenant only its own."""
    return {wid: resource for wid, resource in ledger.resources.items() if caller.sees(ledger.owner(wid))}


def as_map(state: PluginState) -> Raw:
    """A plugin state as events carry it."""
    return {"capacity": state.capacity, "usage": state.usage}
