"""What one worker knows of the nodes: the directory (names, labels, versions), the standing capacity
views, and the change events and version sweep that keep both fresh.

Everything here is a hint: every change is still computed on a fresh record and committed with a
version check (see committer.py), so a stale view costs a retry, never an over-commit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

import msgspec

from bus.codec import encode
from bus.events import EventBus
from bus.tasks import cancel_and_wait
from services.allocation.directory import NodeDirectory, matches
from services.allocation.errors import no_node_matches, node_not_found
from services.allocation.placement import insufficient
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import UP, Change, NodeRecord
from services.allocation.selection import Selection
from services.allocation.shards import Shards
from services.allocation.store import NodeStore
from services.allocation.view import CapacityView, Reservation, SpreadSample, Views

if TYPE_CHECKING:
    from services.allocation.commits import NodeCommits

log = logging.getLogger("berth.allocation")


class Changed(msgspec.Struct):
    """What following a node event needs of it: the version it made, and the workloads it placed
    or released (every worker gets every worker's events; decoding only this is a fraction of the
    whole event's cost)."""

    version: int | None = None
    workload_ids: list[str] | None = None

    def placed(self, kind: str) -> int | None:
        """Instances the change placed (released: negative), None for any other change."""
        if self.workload_ids is None or kind not in ("allocated", "released"):
            return None
        return len(self.workload_ids) if kind == "allocated" else -len(self.workload_ids)


REFRESH_CHUNK = 1000  # nodes read and recomputed at a time


class Fleet:
    def __init__(self, store: NodeStore, plugins: PluginSet, shards: Shards | None = None) -> None:
        self.store = store
        self.plugins = plugins
        self.views = Views(owned=shards.mine if shards is not None else lambda node: True)
        self.directory = NodeDirectory(store)
        self.watching = False

    async def view(
        self, names: list[str], nodes: Selection, requests: Keyed, *, planning: bool = False,
        sample: SpreadSample | None = None, fresh: bool = False,
    ) -> CapacityView:
        """The standing capacity view for this request over these nodes, refreshed where it is stale
        (`planning`: only the nodes this worker owns, see shards.py; `sample`: for sampled spread,
        only the nodes without room, see `plan_sampled`)."""
        request_keys = tuple(encode(requests[name]) for name in names)
        key = (tuple(names), request_keys, nodes.key)
        view = self.views.get(key) if self.watching else None
        if view is None:
            compute = self.plugins.capacity_function(
                names, requests, dict(zip(names, request_keys)), strict=not nodes.dynamic
            )
            selection = nodes if nodes.dynamic else None
            view = CapacityView(await self.members(nodes), compute, selection=selection, owned=self.views.owned)
            if self.watching:
                self.views.put(key, view)
        elif nodes.dynamic:
            await self.follow_directory()
        if not view.members:
            raise no_node_matches(nodes)
        if not view.ready:  # its first computation: every request needs it
            async with view.lock:
                await self._refresh(view, nodes, owned_only=False)
        elif sample is not None and sample.applies(view):
            if view.stale_roomless:
                await self._refresh_some(view, nodes, view.take_stale_without_room())
        elif (view.stale_owned if planning else view.stale) and (fresh or not view.lock.locked()):
            # Nodes other workers changed: read them again, but let no request wait for it (the
            # view is a hint; every commit re-checks the node), or each would queue on the lock;
            # unless `fresh`: a plan made on what the view held was refused, it must not repeat.
            async with view.lock:
                await self._refresh(view, nodes, owned_only=planning)
        return view

    async def refresh(self, view: CapacityView, nodes: Selection) -> None:
        """Read every stale node of the view again, this worker's or not."""
        async with view.lock:
            await self._refresh(view, nodes, owned_only=False)

    async def _refresh(self, view: CapacityView, nodes: Selection, *, owned_only: bool) -> None:
        """Read the view's stale nodes (those this worker owns, or all) again and recompute them, a
        chunk at a time: 50,000 records read at once would stay in the process's memory as free
        space nothing else reuses."""
        todo = view.take_stale(owned_only)
        done = 0
        try:
            for done in range(0, len(todo), REFRESH_CHUNK):
                await self._refresh_some(view, nodes, todo[done:done + REFRESH_CHUNK])
            done = len(todo)
        finally:
            for node in todo[done:]:  # not read (an error): look again next time
                view.mark_stale(node)
        view.ready = True

    async def _refresh_some(self, view: CapacityView, nodes: Selection, todo: list[str]) -> None:
        records = await self.store.load_many(todo)
        missing = [node for node, record in records.items() if record is None]
        if missing and not nodes.dynamic:
            for node in missing:  # look again next time; it may have been added by then
                view.mark_stale(node)
            raise node_not_found(missing[0])
        for node in missing:
            view.leave(node)
        found = [record for record in records.values() if record is not None]
        view.update(found)
        if self.watching:
            self.views.remember(found)

    async def plan_sampled(
        self, view: CapacityView, nodes: Selection, count: int, sample: SpreadSample
    ) -> tuple[dict[str, int], Reservation]:
        """Sampled spread: each instance on the least used after placement of `sample.size` nodes
        drawn uniformly from those with room, the stale ones among them read first, unless the
        view estimates them from the instances other workers' events say they placed or released
        there (`CapacityView.learn`: with many workers, reading each drawn node another worker
        changed cost a record read and a planner run per instance). A node that turns out full is
        replaced by a further draw. Refused only when no node has room."""
        plan: dict[str, int] = {}
        try:
            for placed in range(count):
                node = await self._sampled_one(view, nodes, sample)
                if node is None:
                    raise insufficient(count, placed)
                plan[node] = plan.get(node, 0) + 1
        except BaseException:
            Reservation(view, plan).settle_all()
            raise
        return plan, Reservation(view, plan)

    async def _sampled_one(self, view: CapacityView, nodes: Selection, sample: SpreadSample) -> str | None:
        drawn: set[str] = set()
        candidates: list[str] = []
        while fresh := view.draw(sample.rng, sample.size - len(candidates), drawn):
            if view.stale and (stale := view.take_unestimated_of(fresh)):
                await self._refresh_some(view, nodes, stale)
                fresh = [node for node in fresh if view.has_room(node)]  # read again: some may be full
            candidates += fresh
            if len(candidates) >= sample.size:
                break
        return view.place_one_of(candidates)

    async def members(self, nodes: Selection) -> list[str]:
        """The nodes of a selection as this worker knows them (a list is taken as given)."""
        if not nodes.dynamic:
            return nodes.names.names
        await self.follow_directory()
        directory = self.directory
        return [n for n in directory.select(nodes.labels or {}, schedulable=True) if nodes.admits(n, directory.labels[n])]

    async def follow_directory(self) -> None:
        """Read the nodes that events said were added, removed or relabelled, and move them in or
        out of the label selections; without events to follow, read the whole directory now."""
        if not self.watching:
            await self.directory.load()
            return
        for node in await self.directory.refresh():
            self.views.relabelled(node, self.directory.selectable(node))

    async def all_nodes(self) -> list[str]:
        return sorted(self.directory.labels) if self.watching else await self.store.node_names()

    async def page(
        self, nodenames: list[str] | None, labels: dict[str, str], offset: int, limit: int
    ) -> tuple[list[NodeRecord], int]:
        """One page of the selected nodes in name order, and how many there are. Only the page's
        records are read: the names come from the list, the directory (labels) or the index."""
        if nodenames is not None:
            listed = await self.store.load_many(sorted(set(nodenames)))
            found = [r for r in listed.values() if r is not None and matches(r.labels, labels)]
            return found[offset:offset + limit], len(found)
        if labels:
            await self.follow_directory()
            names = self.directory.select(labels)
        else:
            names = await self.store.node_names()
        page = await self.store.load_many(names[offset:offset + limit])
        return [r for r in page.values() if r is not None and matches(r.labels, labels)], len(names)

    # -- keeping views fresh -----------------------------------------------------------------------

    def follow_commits(self, commits: NodeCommits) -> None:
        """Learn of this worker's commits from the one commit loop: each landed commit is shown to
        the views and the directory, a node another worker committed to first is contended for a
        moment, and a record the views remember saves the loop a read."""
        commits.on_commit.append(self.show_commit)
        commits.on_contended.append(self.views.contend)
        commits.recall = self.views.take_record

    def show_commit(self, node: str, record: NodeRecord | None, change: Change, version: int) -> None:
        """Show this worker's own commit (`change` on `record`, which made `version`) to the views
        and the directory at once, instead of waiting for its event and a reload."""
        if not self.watching:
            return
        if change.delete:
            after = None
            self.views.invalidate(node)
        else:
            raw = {} if record is None else {n: v for n, v in record.raw.items() if n not in change.remove_plugins}
            raw.update(change.plugins)
            labels = change.labels if change.labels is not None else record.labels if record else {}
            status = change.status if change.status is not None else record.status if record else UP
            after = NodeRecord(node, version, labels, raw, change.tag, status)
            self.views.committed(after)
        if self.directory.note(after, node):
            self.views.relabelled(node, self.directory.selectable(node))

    async def watch(
        self, events: EventBus | None, sweep_interval: float, chores: Callable[[int], Awaitable[None]]
    ) -> None:
        """Follow the change events of every worker so views recompute only the nodes that changed;
        every `sweep_interval` run `chores(round)`, then compare versions with the store."""
        if events is None or self.watching:
            return
        await self.directory.load()

        async def changed(subject: str, event: Changed) -> None:
            _, node, kind = subject.rsplit(".", 2)
            version = event.version or 0
            if not version:
                self.views.invalidate(node)
            elif version > self.views.known_version(node):  # not our own, already shown
                self.views.learn(node, version, event.placed(kind))
            self.directory.changed(node, kind, version)

        self._subscription = await events.subscribe("resource.*.*", Changed, cb=changed)
        self._sweeper = asyncio.create_task(self._sweep(sweep_interval, chores))
        self.watching = True

    async def unwatch(self) -> None:
        if self.watching:
            self.watching = False
            await cancel_and_wait(self._sweeper)
            await self._subscription.unsubscribe()

    async def _sweep(self, interval: float, chores: Callable[[int], Awaitable[None]]) -> None:
        """Catch changes whose event was lost (a reconnect, a slow consumer) by comparing versions."""
        for rounds in itertools.count(1):
            await asyncio.sleep(interval)
            try:
                await chores(rounds)
            except Exception:
                log.exception("reaping unfinished allocations failed; trying again later")
            try:
                for node in await self.directory.sweep():
                    self.views.invalidate(node)
            except Exception:
                log.exception("view sweep failed; making every view recompute")
                self.views.invalidate_all()
