"""The allocation service's domain layer: plugin fan-out over node records, and committed changes.

Every command works on a selection of plugins: a plugin-level endpoint selects one, a manager-level
endpoint selects all of them (resource maps keyed by plugin name). Reads load a node record and ask
the pure plugin cores; changes compute on a record and commit it with `NodeStore.commit`, which
refuses if the record changed meanwhile, in which case we compute again on the fresh record.
Calculation and commit are therefore one atomic step per node, with any number of workers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

from bus.codec import encode
from bus.errors import BerthError
from bus.events import EventBus
from bus.idempotency import current_claim
from services.allocation import placement, telemetry
from services.allocation.commits import DeployBatches, node_not_found
from services.allocation.directory import NodeDirectory, matches
from services.allocation.messages import ResourceEvent
from services.allocation.plugin import DeployCapacity, EngineInfo, NamingPlugin, ResourcePlugin
from services.allocation.store import (
    Change,
    LedgerConflict,
    NodeRecord,
    NodeStore,
    PluginState,
    StaleVersion,
    encode_state,
)
from services.allocation.view import CapacityView, Reservation, Selection, Views

log = logging.getLogger("berth.allocation")

Raw = dict[str, Any]
T = TypeVar("T")

# Workload ids derived from a request_id are stable, so a retried allocate names the same workloads.
_WORKLOAD_NAMESPACE = uuid.UUID("6f1d3c2e-8a4b-4e55-9a37-3b0f1c7d2e91")


class ResourceManager:
    def __init__(
        self,
        store: NodeStore,
        plugins: dict[str, ResourcePlugin],
        events: EventBus | None = None,
        *,
        attempts: int = 200,
        intent_timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.plugins = {name: NamingPlugin(plugin) for name, plugin in plugins.items()}
        self.events = events
        self.attempts = attempts
        self.intent_timeout = intent_timeout
        self.views = Views()
        self.directory = NodeDirectory(store)
        self.watching = False
        self._capacity_memo: dict[tuple[str, bytes, bytes], DeployCapacity] = {}
        self.deploys = DeployBatches(
            store, self.plugins, latest=self.views.take_record, committed=self._committed, publish=self._publish,
            release=self.release, contend=self.views.contend, attempts=attempts,
        )

    # -- selecting plugins and requests --------------------------------------------------------

    def keyed(self, value: Raw | None, names: list[str], field: str) -> dict[str, Raw | None]:
        """Split a manager-level map keyed by plugin into one value per selected plugin."""
        value = value or {}
        for key, sub in value.items():
            if key not in self.plugins:
                raise BerthError(
                    f"{field}: no plugin named {key!r} (have {', '.join(self.plugins)})",
                    code="plugin_not_found", field=f"{field}.{key}",
                )
            if sub is not None and not isinstance(sub, dict):
                raise BerthError(f"{field}.{key}: must be a map", code="invalid_argument", field=f"{field}.{key}")
        return {name: value.get(name) for name in names}

    def _states(self, record: NodeRecord, names: list[str]) -> dict[str, PluginState]:
        missing = [name for name in names if name not in record.plugins]
        if missing:
            raise node_not_found(record.name, missing[0])
        return {name: record.plugins[name] for name in names}

    async def _load(self, node: str, names: list[str]) -> tuple[NodeRecord, dict[str, PluginState]]:
        record = await self.store.load(node)
        if record is None:
            raise node_not_found(node)
        return record, self._states(record, names)

    async def _publish(self, node: str, kind: str, version: int, **fields: Any) -> None:
        if self.events is not None:
            event = ResourceEvent(nodename=node, version=version, **fields)
            await self.events.publish(f"resource.{node}.{kind}", event)

    async def _mutate(
        self,
        node: str,
        compute: Callable[[], Awaitable[tuple[NodeRecord | None, Change, T]]],
        *,
        retry_ledger: bool = False,
    ) -> tuple[T, int]:
        """Compute a change on fresh data and commit it; if the node changed meanwhile, do it again.

        `compute` reads what it needs and returns (the record it read, None for a new node; the
        change; the result); it raises to refuse. `retry_ledger` also retries when a ledger entry
        it relied on moved. Returns the result and the node's new version.
        """
        retry_on: tuple[type[Exception], ...] = (StaleVersion, LedgerConflict) if retry_ledger else (StaleVersion,)
        for attempt in range(self.attempts):
            record, change, result = await compute()
            version = record.version if record else 0
            if change.is_empty():
                return result, version
            try:
                version = await self.store.commit(node, version, change)
            except retry_on as error:
                (telemetry.RETRY_VERSION if isinstance(error, StaleVersion) else telemetry.RETRY_LEDGER).inc()
                # Someone else changed the node; a short random pause spreads the contenders out.
                await asyncio.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
                continue
            self._committed(node, record, change, version)
            return result, version
        raise BerthError(f"node {node} is changing too fast; retry", code="busy", details={"nodename": node})

    def _committed(self, node: str, record: NodeRecord | None, change: Change, version: int) -> None:
        """Show our own commit to the views and the directory at once, instead of waiting for its
        event and a reload."""
        if not self.watching:
            return
        if change.delete:
            after = None
            self.views.invalidate(node)
        else:
            raw = {} if record is None else {n: v for n, v in record.raw.items() if n not in change.remove_plugins}
            raw.update(change.plugins)
            labels = change.labels if change.labels is not None else record.labels if record else {}
            after = NodeRecord(node, version, labels, raw)
            self.views.committed(after)
        if self.directory.note(after, node):
            self.views.relabelled(node, None if after is None else after.labels)

    async def _existing(self, node: str) -> NodeRecord:
        record = await self.store.load(node)
        if record is None:
            raise node_not_found(node)
        return record

    # -- pure calculations over stored nodes -----------------------------------------------------

    async def calculate_deploy(
        self, names: list[str], node: str, count: int, requests: dict[str, Raw | None]
    ) -> tuple[list[Raw], list[Raw]]:
        _, states = await self._load(node, names)
        return self._deploy(states, count, requests)

    def _deploy(
        self, states: dict[str, PluginState], count: int, requests: dict[str, Raw | None]
    ) -> tuple[list[Raw], list[Raw]]:
        engines: list[Raw] = [{} for _ in range(count)]
        workloads: list[Raw] = [{} for _ in range(count)]
        for name, state in states.items():
            params, resources = self.plugins[name].calculate_deploy(state.capacity, state.usage, count, requests[name])
            for i in range(count):
                engines[i][name] = params[i]
                workloads[i][name] = resources[i]
        return engines, workloads

    async def calculate_realloc(
        self, names: list[str], node: str, workload: dict[str, Raw | None], requests: dict[str, Raw | None]
    ) -> tuple[Raw, Raw, Raw]:
        _, states = await self._load(node, names)
        return self._realloc(states, workload, requests)

    def _realloc(
        self, states: dict[str, PluginState], workload: dict[str, Raw | None], requests: dict[str, Raw | None]
    ) -> tuple[Raw, Raw, Raw]:
        engine, delta, resource = {}, {}, {}
        for name, state in states.items():
            engine[name], delta[name], resource[name] = self.plugins[name].calculate_realloc(
                state.capacity, state.usage, workload.get(name) or {}, requests[name]
            )
        return engine, delta, resource

    async def calculate_remap(self, names: list[str], node: str, workloads: dict[str, Raw]) -> dict[str, Raw]:
        if not workloads:
            return {}
        _, states = await self._load(node, names)
        remapped: dict[str, Raw] = {}
        for name, state in states.items():
            split = {wid: (w or {}).get(name) or {} for wid, w in workloads.items()}
            for wid, params in self.plugins[name].calculate_remap(state.capacity, state.usage, split).items():
                remapped.setdefault(wid, {})[name] = params
        return dict(sorted(remapped.items()))

    async def deploy_capacity(
        self, names: list[str], nodes: Selection, requests: dict[str, Raw | None]
    ) -> dict[str, DeployCapacity]:
        view = await self._view(names, nodes, requests)
        return dict(sorted(view.capacities().items()))

    async def _view(self, names: list[str], nodes: Selection, requests: dict[str, Raw | None]) -> CapacityView:
        """The standing capacity view for this request over these nodes, refreshed where it is stale."""
        request_keys = tuple(encode(requests[name]) for name in names)
        key = (tuple(names), request_keys, nodes.key)
        view = self.views.get(key) if self.watching else None
        if view is None:
            compute = self._capacity_function(names, dict(zip(names, request_keys)), requests, strict=not nodes.dynamic)
            view = CapacityView(await self._members(nodes), compute, selection=nodes if nodes.dynamic else None)
            if self.watching:
                self.views.put(key, view)
        elif nodes.dynamic:
            await self._follow_directory()
        if not view.members:
            raise no_node_matches(nodes)
        if not view.ready:  # its first computation: every request needs it
            async with view.lock:
                await self._refresh(view, nodes)
        elif view.stale and not view.lock.locked():
            # Nodes other workers changed: read them again, but let no request wait for it (the
            # view is a hint; every commit re-checks the node), or each would queue on the lock.
            async with view.lock:
                await self._refresh(view, nodes)
        return view

    async def _refresh(self, view: CapacityView, nodes: Selection) -> None:
        """Read the view's stale nodes again and recompute them."""
        if not view.stale:
            return
        todo = list(view.stale)
        view.stale.clear()
        records = await self.store.load_many(todo)
        missing = [node for node, record in records.items() if record is None]
        if missing and not nodes.dynamic:
            view.stale.update(missing)  # look again next time; it may have been added by then
            raise node_not_found(missing[0])
        for node in missing:
            view.leave(node)
        found = [record for record in records.values() if record is not None]
        view.update(found)
        view.ready = True
        if self.watching:
            self.views.remember(found)

    async def _members(self, nodes: Selection) -> list[str]:
        """The nodes of a selection as this worker knows them (a list is taken as given)."""
        if not nodes.dynamic:
            return nodes.names.names
        await self._follow_directory()
        return [n for n in self.directory.select(nodes.labels or {}) if nodes.admits(n, self.directory.labels[n])]

    async def _follow_directory(self) -> None:
        """Read the nodes that events said were added, removed or relabelled, and move them in or
        out of the label selections; without events to follow, read the whole directory now."""
        if not self.watching:
            await self.directory.load()
            return
        for node in await self.directory.refresh():
            self.views.relabelled(node, self.directory.labels.get(node))

    def _capacity_function(
        self, names: list[str], request_keys: dict[str, bytes], requests: dict[str, Raw | None], *, strict: bool
    ) -> Callable[[NodeRecord], DeployCapacity | None]:
        """A record's merged capacity for the request, memoised on each plugin's stored bytes:
        nodes in the same state (a fleet of identical machines) are planned once. A node without a
        record for one of the plugins is an error for a listed node (`strict`), else it has no room."""
        memo = self._capacity_memo
        if len(memo) > 200_000:
            memo.clear()

        def compute(record: NodeRecord) -> DeployCapacity | None:
            entries = []
            for name in names:
                raw = record.raw.get(name)
                if raw is None:
                    if strict:
                        raise node_not_found(record.name, name)
                    return None
                key = (name, raw, request_keys[name])
                cap = memo.get(key)
                if cap is None:
                    state = record.plugins[name]
                    cap = memo[key] = self.plugins[name].deploy_capacity(state.capacity, state.usage, requests[name])
                if cap.capacity <= 0:
                    return None
                entries.append(cap)
            return placement.merge(entries)

        return compute

    # -- keeping views fresh -----------------------------------------------------------------------

    async def watch(self, sweep_interval: float = 5.0) -> None:
        """Follow the change events of every worker so views recompute only the nodes that changed."""
        if self.events is None or self.watching:
            return
        await self.directory.load()

        async def changed(subject: str, event: dict) -> None:
            _, node, kind = subject.rsplit(".", 2)
            version = event.get("version") or 0
            if not version or version > self.views.known_version(node):  # not our own, already shown
                self.views.invalidate(node)
            self.directory.changed(node, kind, version)

        self._subscription = await self.events.subscribe("resource.*.*", cb=changed)
        self._sweeper = asyncio.create_task(self._sweep(sweep_interval))
        self.watching = True

    async def unwatch(self) -> None:
        if self.watching:
            self.watching = False
            self._sweeper.cancel()
            await self._subscription.unsubscribe()

    async def _sweep(self, interval: float, index_every: int = 12) -> None:
        """Catch changes whose event was lost (a reconnect, a slow consumer) by comparing versions,
        reap the allocations a dead worker left half done, and now and then index what the ledgers
        hold that the workload index lost."""
        for rounds in itertools.count(1):
            await asyncio.sleep(interval)
            try:
                await self._reap_intents()
                if rounds % index_every == 0 and (repaired := await self.store.repair_index(await self._all_nodes())):
                    log.warning("indexed %d workloads the ledgers hold and the index had lost", repaired)
            except Exception:
                log.exception("reaping unfinished allocations failed; trying again later")
            try:
                for node in await self.directory.sweep():
                    self.views.invalidate(node)
            except Exception:
                log.exception("view sweep failed; making every view recompute")
                self.views.invalidate_all()

    async def _all_nodes(self) -> list[str]:
        return sorted(self.directory.labels) if self.watching else await self.store.node_names()

    async def most_idle(self, names: list[str], nodes: Selection) -> tuple[str, int]:
        """The most idle node by the highest-priority plugin; ties go to the smallest name."""
        records = await self.store.load_many(sorted(set(await self._members(nodes))))
        if not nodes.dynamic:
            for node, record in records.items():
                if record is None:
                    raise node_not_found(node)
                self._states(record, names)
        usable = {n: r for n, r in records.items() if r is not None and all(name in r.plugins for name in names)}
        if not usable:
            raise no_node_matches(nodes)
        best: tuple[str, int] | None = None
        for name in names:
            plugin = self.plugins[name]
            loads = {node: plugin.load(r.plugins[name].capacity, r.plugins[name].usage) for node, r in usable.items()}
            if best is None or plugin.priority > best[1]:
                best = (placement.most_idle(loads), plugin.priority)
        assert best is not None
        return best

    def metrics_description(self, names: list[str]) -> list[Raw]:
        return [d for name in names for d in self.plugins[name].metrics_description()]

    async def metrics(self, names: list[str], podname: str, node: str) -> list[Raw]:
        _, states = await self._load(node, names)
        return [
            m
            for name, state in states.items()
            for m in self.plugins[name].metrics(podname, node, state.capacity, state.usage)
        ]

    # -- node administration ---------------------------------------------------------------------

    async def add_node(
        self,
        names: list[str],
        node: str,
        resources: dict[str, Raw | None],
        info: EngineInfo | None,
        labels: dict[str, str] | None,
    ) -> tuple[Raw, Raw]:
        created = {}
        for name in names:
            capacity, usage = self.plugins[name].add_node(resources[name], info)
            created[name] = PluginState(capacity, usage)
        whole = len(names) == len(self.plugins)

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
        _, version = await self._mutate(node, compute)
        for name in names:
            await self._publish(node, "added", version, plugin=name, after=as_map(created[name]))
        return {n: s.capacity for n, s in created.items()}, {n: s.usage for n, s in created.items()}

    async def remove_node(self, names: list[str], node: str) -> None:
        """Manager level (all plugins) removes a node no workload holds; plugin level one plugin's record.

        Removing what does not exist succeeds and changes nothing (eru: "deleting a missing node is
        not an error"), so a retried or replayed removal is harmless."""
        whole = len(names) == len(self.plugins)

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
            (removed, gone), version = await self._mutate(node, compute)
        except LedgerConflict as conflict:
            raise BerthError(
                f"node {node} still holds {conflict.subject} workloads", code="node_not_empty",
                field="nodename", details={"nodename": node, "workloads": int(conflict.subject)},
            ) from None
        if gone:
            await self.store.remove_from_index(node)
        for name, state in removed.items():
            await self._publish(node, "removed", version, plugin=name, before=as_map(state))

    async def _change_states(
        self, node: str, names: list[str], kind: str, update: Callable[[str, PluginState], PluginState]
    ) -> tuple[dict[str, PluginState], dict[str, PluginState]]:
        """Replace each selected plugin's state with `update(name, state)`; returns (before, after)."""

        async def compute():
            record = await self._existing(node)
            states = self._states(record, names)
            after = {name: update(name, state) for name, state in states.items()}
            return record, Change(plugins=encode_states(after)), (states, after)

        (before, after), version = await self._mutate(node, compute)
        for name in names:
            await self._publish(
                node, kind, version, plugin=name, before=as_map(before[name]), after=as_map(after[name])
            )
        return before, after

    async def set_capacity(
        self, names, node, resources: dict[str, Raw | None], requests: dict[str, Raw | None], delta: bool, incr: bool
    ) -> tuple[Raw, Raw]:
        # As in eru, only the plugins that were given a resource or a request change.
        touched = [name for name in names if resources[name] is not None or requests[name] is not None]
        if not touched:
            _, states = await self._load(node, names)
            unchanged = {n: s.capacity for n, s in states.items()}
            return unchanged, unchanged

        def update(name: str, state: PluginState) -> PluginState:
            return PluginState(*self.plugins[name].set_capacity(
                state.capacity, state.usage, resources[name], requests[name], delta, incr))

        before, after = await self._change_states(node, touched, "capacity", update)
        return {n: s.capacity for n, s in before.items()}, {n: s.capacity for n, s in after.items()}

    async def set_usage(
        self, names, node, resources, requests, workloads: list[Raw], delta: bool, incr: bool
    ) -> tuple[Raw, Raw]:
        def update(name: str, state: PluginState) -> PluginState:
            usage = self.plugins[name].set_usage(
                state.capacity, state.usage, resources[name], requests[name], split(workloads, name), delta, incr
            )
            return PluginState(state.capacity, usage)

        before, after = await self._change_states(node, names, "usage", update)
        return {n: s.usage for n, s in before.items()}, {n: s.usage for n, s in after.items()}

    async def set_info(self, names, node, capacity: dict[str, Raw | None], usage: dict[str, Raw | None]) -> None:
        """Store exactly the given capacity and usage (absolute). Like eru's SetNodeResourceInfo it
        works for a node, or a plugin of a node, that does not exist yet: those records are created
        (and announced as `added`), so a get -> remove -> set round trip restores a node exactly."""
        given = {name: PluginState(capacity[name] or {}, usage[name] or {}) for name in names}
        for name, state in given.items():
            self.plugins[name].validate_record(state.capacity, state.usage)

        async def compute():
            record = await self.store.load(node)
            before = {} if record is None else {n: record.plugins[n] for n in names if n in record.plugins}
            return record, Change(plugins=encode_states(given)), before

        await self.store.add_to_index(node)  # before the record: a crash leaves an entry readers skip
        before, version = await self._mutate(node, compute)
        for name, state in given.items():
            if name in before:
                await self._publish(node, "usage", version, plugin=name, before=as_map(before[name]), after=as_map(state))
            else:
                await self._publish(node, "added", version, plugin=name, after=as_map(state))

    async def node_info(
        self, names: list[str], node: str, workloads: list[Raw] | None
    ) -> tuple[Raw, Raw, list[str]]:
        """Capacity, usage and the diffs against `workloads` (or the ledger, when none are given)."""
        record, ledger = await self.store.load_with_ledger(node)
        if record is None:
            raise node_not_found(node)
        states = self._states(record, names)
        source = list(ledger.values()) if workloads is None else workloads
        diffs = [d for name, st in states.items() for d in self.plugins[name].diffs(st.capacity, st.usage, split(source, name))]
        return {n: st.capacity for n, st in states.items()}, {n: st.usage for n, st in states.items()}, diffs

    async def fix(self, names, node, workloads: list[Raw] | None) -> tuple[Raw, Raw, list[str]]:
        """Rewrite usage from the given workloads, or from the node's ledger when none are given."""

        async def compute():
            record, ledger = await self.store.load_with_ledger(node)
            if record is None:
                raise node_not_found(node)
            states = self._states(record, names)
            source = list(ledger.values()) if workloads is None else workloads
            diffs = [
                d for name, st in states.items() for d in self.plugins[name].diffs(st.capacity, st.usage, split(source, name))
            ]
            fixed = {
                name: PluginState(st.capacity, self.plugins[name].usage_from_workloads(st.capacity, split(source, name)))
                for name, st in states.items()
            }
            return record, Change(plugins=encode_states(fixed) if diffs else {}), (states, fixed, diffs)

        (before, fixed, diffs), version = await self._mutate(node, compute)
        if diffs:
            for name in names:
                await self._publish(
                    node, "usage", version, plugin=name, before=as_map(before[name]), after=as_map(fixed[name])
                )
        return {n: st.capacity for n, st in fixed.items()}, {n: st.usage for n, st in fixed.items()}, diffs

    async def set_labels(self, node: str, labels: dict[str, str]) -> None:
        async def compute():
            record = await self._existing(node)
            return record, Change(labels=labels), record.labels

        before, version = await self._mutate(node, compute)
        await self._publish(node, "labels", version, before={"labels": before}, after={"labels": labels})

    # -- committed allocations ---------------------------------------------------------------------

    async def allocate(
        self,
        nodes: Selection,
        strategy: str,
        count: int,
        requests: dict[str, Raw | None],
        given_ids: list[str] | None,
        request_id: str,
        *,
        replans: int = 20,
    ) -> list[Raw]:
        """Place `count` instances on `nodes` (`count` on each for `each`); all or nothing.

        The plan is made from a snapshot of the nodes; if a node filled up before its commit, the
        instances already placed are returned and we plan again from a fresh snapshot.
        """
        run = current_claim.get()
        attempt = run.attempt if run is not None and run.request_id == request_id else 0
        if attempt and given_ids is None:
            each = len(await self._members(nodes)) if strategy == "each" else 1
            await self._forget_runs(request_id, attempt, count * each)
        cleared = False
        for replan in range(replans):
            plan, reservation = await self._plan(nodes, strategy, count, requests)
            ids = workload_ids(sum(plan.values()), given_ids, request_id, attempt)
            try:
                return await self._place(plan, ids, requests, reservation)
            except BerthError as error:
                if error.code != "workload_exists" or given_ids is not None or not request_id or cleared:
                    raise
                # An id derived from this very request is held already: an earlier run of it placed
                # it and its claim was lost (a Redis failover lost the claim's last writes). Give
                # back what every run of it placed, once, and place again.
                log.warning("request %s: an earlier run's placement had lost its claim; releasing it", request_id)
                await self._forget_runs(request_id, attempt + 1, len(ids))
                cleared = True
            except NodeFilledUp as filled:
                self.views.invalidate(filled.node)  # its record changed under the view: read it afresh
                self.views.contend(filled.node)
                if nodes.single or replan == replans - 1:
                    raise filled.error from None
                log.debug("node %s filled up during allocate; planning again", filled.node)
            finally:
                reservation.settle_all()
        raise AssertionError("unreachable")

    async def _plan(
        self, nodes: Selection, strategy: str, count: int, requests: dict[str, Raw | None]
    ) -> tuple[dict[str, int], Reservation]:
        """Where the instances go, reserved in the view until each node's deploy is settled."""
        if nodes.single:
            return {nodes.single: count}, Reservation.none()
        view = await self._view(list(self.plugins), nodes, requests)
        if strategy == "each":
            return view.plan_each(count)
        return view.plan(strategy, count, self.views.contended)

    async def _forget_runs(self, request_id: str, attempt: int, count: int) -> None:
        """Release what earlier runs of this very request placed without answering (their worker
        died, and this run took their claim over). Their ids derive from the request id and the
        run, so they are ours; no caller ever saw them."""
        earlier = [wid for run in range(attempt) for wid in workload_ids(count, None, request_id, run)]
        if len(await self.store.locate(earlier)) < len(earlier):
            # Not all were placed, or some lost their index entry with a Redis failover: look in the
            # ledgers (a takeover is rare; this reads every node's ledger for these ids once).
            await self.store.repair_index(await self._all_nodes(), earlier)
        released = await self.release(earlier)
        if released:
            log.info("request %s: released %d instances an unanswered run had placed", request_id, len(released))

    async def _place(
        self, plan: dict[str, int], ids: list[str], requests: dict[str, Raw | None], reservation: Reservation
    ) -> list[Raw]:
        """Commit a plan node by node. Over several nodes an intent records the ids first: if this
        worker dies half way, a reaper on any worker releases them (see `_reap_intents`)."""
        intent = uuid.uuid4().hex if len(plan) > 1 else None
        if intent:
            await self.store.begin_intent(intent, ids, time.time() + self.intent_timeout)
        placed: list[Raw] = []
        start = 0
        try:
            for node in sorted(plan):
                try:
                    deployed = await self.deploys.deploy(
                        node, ids[start:start + plan[node]], requests, settled=partial(reservation.settle, node)
                    )
                    placed += deployed.allocations
                except BerthError as error:
                    if error.code in ("insufficient_capacity", "insufficient_resource"):
                        raise NodeFilledUp(node, error) from None
                    raise
                start += plan[node]
            if intent and not await self.store.take_intent(intent):
                # A reaper judged us dead and is releasing these ids: report failure, not a placement.
                raise BerthError("allocate took too long and was rolled back; retry", code="busy")
        except BaseException as error:
            # Release every id of the plan, not only those known placed: a commit interrupted by a
            # cancellation may have landed. An id that turned out to be someone else's stays.
            taken = error.details.get("workload_id") if isinstance(error, BerthError) and error.code == "workload_exists" else None
            await asyncio.shield(self._roll_back([i for i in ids if i != taken], intent))
            raise
        return placed

    async def _roll_back(self, ids: list[str], intent: str | None) -> None:
        released = await self.release(ids)
        if released:
            log.info("allocate failed after placing %d instances: rolled them back", len(released))
        if intent:
            await self.store.take_intent(intent)

    async def _reap_intents(self) -> None:
        """Release the instances of multi-node allocations whose worker died before finishing."""
        for intent, ids in (await self.store.expired_intents(time.time())).items():
            if await self.store.take_intent(intent):
                log.warning("allocate %s never finished: releasing its %d instances", intent, len(ids))
                await self.release(ids)

    async def release(self, ids: list[str]) -> list[str]:
        """Return the workloads' resources to their nodes; ids nobody holds are skipped."""
        by_node: dict[str, list[str]] = {}
        for wid, node in (await self.store.locate(ids)).items():
            by_node.setdefault(node, []).append(wid)
        released: list[str] = []
        for node, held_ids in sorted(by_node.items()):
            released += await self._release_on(node, held_ids)
        await self.store.unindex_workloads(list(dict.fromkeys(ids)))
        return sorted(released)

    async def _release_on(self, node: str, ids: list[str]) -> list[str]:
        async def compute():
            record, ledger = await self.store.load_with_ledger(node, ids)
            if record is None or not ledger:
                return record, Change(), []
            after = {
                name: PluginState(st.capacity, self.plugins[name].apply_workloads(st.usage, split(ledger.values(), name), False))
                for name, st in record.plugins.items()
                if name in self.plugins
            }
            return record, Change(plugins=encode_states(after), ledger_remove=list(ledger)), sorted(ledger)

        released, version = await self._mutate(node, compute, retry_ledger=True)
        if released:
            telemetry.RELEASED.inc(len(released))
            await self._publish(node, "released", version, workload_ids=released)
        return released

    async def realloc(self, workload_id: str, requests: dict[str, Raw | None]) -> Raw:
        node = (await self.store.locate([workload_id])).get(workload_id)
        if node is None:
            raise workload_not_found(workload_id)
        names = list(self.plugins)

        async def compute():
            record, ledger = await self.store.load_with_ledger(node, [workload_id])
            if record is None or workload_id not in ledger:
                raise workload_not_found(workload_id)
            states = self._states(record, names)
            current = ledger[workload_id]
            engine, delta, resource = self._realloc(states, current, requests)
            after = {}
            for name, st in states.items():
                plugin = self.plugins[name]
                returned = plugin.apply_workloads(st.usage, split([current], name), False)
                after[name] = PluginState(st.capacity, plugin.apply_workloads(returned, [resource[name]], True))
            reply = {"workload_id": workload_id, "nodename": node, "engine_params": engine,
                     "workload_resource": resource, "delta_resource": delta}
            change = Change(plugins=encode_states(after), ledger_replace={workload_id: resource})
            return record, change, (current, reply)

        (before, reply), version = await self._mutate(node, compute, retry_ledger=True)
        await self._publish(node, "usage", version, workload_ids=[workload_id],
                            before={"workload_resource": before}, after={"workload_resource": reply["workload_resource"]})
        return reply

    async def allocations(self, node: str) -> dict[str, Raw]:
        record, ledger = await self.store.load_with_ledger(node)
        if record is None:
            raise node_not_found(node)
        return ledger

    async def list_nodes(
        self, nodenames: list[str] | None, labels: dict[str, str], offset: int, limit: int
    ) -> tuple[list[NodeRecord], int]:
        """One page of the selected nodes in name order, and how many there are. Only the page's
        records are read: the names come from the list, the directory (labels) or the index."""
        if nodenames is not None:
            listed = await self.store.load_many(sorted(set(nodenames)))
            found = [r for r in listed.values() if r is not None and matches(r.labels, labels)]
            return found[offset:offset + limit], len(found)
        if labels:
            await self._follow_directory()
            names = self.directory.select(labels)
        else:
            names = await self.store.node_names()
        page = await self.store.load_many(names[offset:offset + limit])
        return [r for r in page.values() if r is not None and matches(r.labels, labels)], len(names)


class NodeFilledUp(Exception):
    """A node planned for an allocate had no room left at its commit."""

    def __init__(self, node: str, error: BerthError) -> None:
        super().__init__(node)
        self.node = node
        self.error = error


def encode_states(states: dict[str, PluginState]) -> dict[str, bytes]:
    return {name: encode_state(state) for name, state in states.items()}


def split(workloads, name: str) -> list[Raw]:
    """One plugin's part of each manager-level workload resource."""
    return [(w or {}).get(name) or {} for w in workloads]


def as_map(state: PluginState) -> Raw:
    return {"capacity": state.capacity, "usage": state.usage}


def no_node_matches(nodes: Selection) -> BerthError:
    return BerthError(
        "no node matches the selection", code="node_not_found", field="labels", details={"labels": nodes.labels or {}}
    )


def workload_not_found(workload_id: str) -> BerthError:
    return BerthError(
        f"workload {workload_id} not found", code="workload_not_found", field="workload_id",
        details={"workload_id": workload_id},
    )


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
