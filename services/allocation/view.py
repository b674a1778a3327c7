"""A worker's standing view of deploy capacity over a set of nodes, kept up to date by events.

Asking every node for its capacity on every `allocate` over thousands of nodes costs a Redis read
and a planner run per node per request. Instead a worker keeps, per (plugins, request, node set),
each node's merged capacity and a heap of the nodes in strategy order. A node is recomputed only
when it changed: every commit publishes an event naming its node, which marks the node stale in
every view that holds it, and a periodic version sweep catches any event that was lost.

The view is only ever a hint for choosing nodes: every placement is still computed on a fresh
record and committed with a version check, so a stale view costs a retry, never an over-commit.
"""

from __future__ import annotations

import asyncio
import heapq
import os
import random
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from bus.caches import CACHES
from services.allocation.placement import each, insufficient
from services.allocation.plugins.interface import DeployCapacity
from services.allocation.records import NodeRecord
from services.allocation.selection import Selection


@dataclass
class Entry:
    base: DeployCapacity  # as computed from the node's record
    capacity: DeployCapacity  # the base, less what this worker's plans are placing there right now
    stamp: int  # bumped on every change, so heap items pushed before it are recognised as outdated


class Reservation:
    """The instances a plan counts on each node, from the plan until their deploy is committed
    (then the node's record holds them) or refused. Settling twice is harmless."""

    def __init__(self, view: "CapacityView | None", plan: dict[str, int]) -> None:
        self.view = view
        self.left = dict(plan)
        # The version of each planned node the plan was made on (see DeployBatches.deploy's `unmoved`).
        self.versions = {node: view.version_of(node) for node in plan} if view is not None else {}

    @classmethod
    def none(cls) -> "Reservation":
        """For a plan made without a view (one node named): nothing to settle."""
        return cls(None, {})

    def settle(self, node: str) -> None:
        taken = self.left.pop(node, 0)
        if taken:
            self.view._reserve(node, -taken)

    def settle_all(self) -> None:
        for node in list(self.left):
            self.settle(node)


@dataclass
class SpreadSample:
    """How `spread` draws over a large selection (DESIGN.md §8): a selection of at most `size`
    nodes is placed on exactly (the least used after placement); a larger one, per instance, on the
    least used of `size` nodes drawn uniformly from those with room. `rng` is seeded in tests."""

    size: int = 64
    rng: random.Random = field(default_factory=random.Random)

    def applies(self, view: "CapacityView") -> bool:
        return len(view.members) > self.size


@dataclass
class CapacityView:
    """Merged deploy capacity per node for one request; `compute` gives a record's capacity or None."""

    nodes: list[str]
    compute: Callable[[NodeRecord], DeployCapacity | None]
    entries: dict[str, Entry] = field(default_factory=dict)  # nodes with room, by name
    seen: dict[str, int] = field(default_factory=dict)  # every member's version when last computed
    stale: set[str] = field(default_factory=set)
    # The nodes this worker owns (shards.py), and those of them that are stale: pack's planning
    # reads only these again; the others wait until spread, a capacity query or a refusal needs them.
    owned: Callable[[str], bool] = lambda node: True
    stale_owned: set[str] = field(default_factory=set)
    stale_roomless: set[str] = field(default_factory=set)  # stale nodes without room: see take_stale_without_room
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one refresh at a time
    pending: dict[str, int] = field(default_factory=dict)  # instances reserved by plans, per node
    # Sampled spread's estimate of a stale node (`learn`): the instances other workers placed there
    # (released: negative) since it was read, and the version their events bring it to.
    foreign: dict[str, int] = field(default_factory=dict)
    estimated: dict[str, int] = field(default_factory=dict)
    ready: bool = False  # computed once: from then on requests need not wait for a refresh
    _heaps: dict[str, list[tuple]] = field(default_factory=dict)  # per strategy: nodes with room, best first
    _stamps: int = 0
    # The nodes with room (net of reservations) in a list, for sampled spread's uniform draws.
    _roomy: list[str] = field(default_factory=list)
    _roomy_at: dict[str, int] = field(default_factory=dict)
    _spread: dict[str, float] = field(default_factory=dict)  # each node's spread score, for sampled draws

    selection: Selection | None = None  # set for a membership that follows the directory

    def __post_init__(self) -> None:
        self.members = set(self.nodes)
        self.stale = set(self.nodes)  # nothing is computed yet
        self.stale_roomless = set(self.nodes)
        self.reshard()

    def mark_stale(self, node: str, *, urgent: bool = False) -> None:
        """`node` changed: read it again before planning on it (`urgent`: before the next plan,
        owned or not: a commit to it was just refused)."""
        self._forget_estimate(node)
        self._stale(node, urgent)

    def _stale(self, node: str, urgent: bool = False) -> None:
        self.stale.add(node)
        if node not in self._roomy_at:
            self.stale_roomless.add(node)
        if urgent or self.owned(node):
            self.stale_owned.add(node)

    def learn(self, node: str, version: int, placed: int | None) -> None:
        """Another worker's change to `node` (an event making `version`): stale, as any change. When
        it placed (`placed` > 0) or released (< 0) instances, and the view knows the node at the
        version before, sampled spread also estimates it instead of reading it: as if those were
        instances of this view's request (exact for equal workloads; the commit re-checks the node
        either way, and refuses it if it moved past `version`: `version_of`)."""
        if placed is not None and node in self.entries and version == self.version_of(node) + 1:
            self.foreign[node] = self.foreign.get(node, 0) + placed
            self.estimated[node] = version
            self._refresh(node)
        else:
            self._forget_estimate(node)
        self._stale(node)

    def version_of(self, node: str) -> int:
        """The node's version as the view holds it: read, or estimated from events since."""
        return self.estimated.get(node) or self.seen.get(node, 0)

    def take_unestimated_of(self, nodes: Iterable[str]) -> list[str]:
        """Those of `nodes` that are stale and not estimated (`learn`), to read again."""
        return self.take_stale_of([node for node in nodes if node not in self.estimated])

    def _forget_estimate(self, node: str) -> None:
        self.estimated.pop(node, None)
        if self.foreign.pop(node, 0) and node in self.entries:
            self._refresh(node)

    def take_stale_of(self, nodes: Iterable[str]) -> list[str]:
        """Those of `nodes` that are stale, to read again; no longer stale."""
        todo = [node for node in nodes if node in self.stale]
        self.stale.difference_update(todo)
        self.stale_owned.difference_update(todo)
        self.stale_roomless.difference_update(todo)
        return todo

    def take_stale_without_room(self) -> list[str]:
        """The stale nodes the view holds no room on (a release may have freed some): sampled
        spread draws only from nodes with room, so these are read before it plans."""
        return self.take_stale_of(list(self.stale_roomless))

    def take_stale(self, owned_only: bool) -> list[str]:
        """The stale nodes to read again (those planning needs, or all); no longer stale."""
        todo = list(self.stale_owned if owned_only else self.stale)
        self.stale.difference_update(todo)
        self.stale_roomless.difference_update(todo)
        self.stale_owned.clear()  # taken either way
        return todo

    def reshard(self) -> None:
        """The workers changed, and with them which nodes this one owns."""
        self.stale_owned = {node for node in self.stale if self.owned(node)}
        self._heaps.clear()  # rebuilt with the new split when next planned on

    def join(self, node: str) -> None:
        self.members.add(node)
        self.mark_stale(node)

    def leave(self, node: str) -> None:
        self.members.discard(node)
        self.stale.discard(node)
        self.stale_owned.discard(node)
        self.stale_roomless.discard(node)
        self.entries.pop(node, None)  # heap items for it are skipped when popped
        self._room(node, False)
        self._spread.pop(node, None)
        self.seen.pop(node, None)
        self.pending.pop(node, None)
        self.foreign.pop(node, None)
        self.estimated.pop(node, None)

    def update(self, records: Iterable[NodeRecord]) -> None:
        """Recompute the given (freshly loaded) nodes; reservations still in flight stay counted."""
        for record in records:
            self.seen[record.name] = record.version
            self.foreign.pop(record.name, None)
            self.estimated.pop(record.name, None)
            base = self.compute(record) if record.schedulable else None
            if base is None or base.capacity <= 0:
                self.entries.pop(record.name, None)
                self._room(record.name, False)
                continue
            self.entries[record.name] = Entry(base, base, 0)
            self._refresh(record.name)

    def capacities(self) -> dict[str, DeployCapacity]:
        """Each node's capacity as its record says (the instances being placed now not deducted)."""
        return {node: entry.base for node, entry in self.entries.items()}

    def plan_each(self, count: int) -> tuple[dict[str, int], Reservation]:
        """`count` instances on every member, reserved, or `insufficient_capacity` naming a node without room."""
        plan = {node: count for node in sorted(self.members)}
        room = {node: self.entries[node].capacity.capacity if node in self.entries else 0 for node in plan}
        each(room, count)
        for node, taken in plan.items():
            self._reserve(node, taken)
        return plan, Reservation(self, plan)

    def plan(
        self, strategy: str, count: int, contended: Callable[[str], bool] = lambda node: False
    ) -> tuple[dict[str, int], Reservation]:
        """Choose nodes for `count` instances and reserve them in the view until they are settled.

        spread: each instance to the node with the lowest usage after taking it (eru's GLOBAL),
        this worker's own nodes first among equally used ones (shards.py);
        pack: the most-used node that still fits first, filled before the next, among this worker's
        own nodes first: the others' only when none of its own fits. With several workers each
        fills its own nodes instead of all racing for the same one. A node another worker is
        committing to right now (`contended`) comes after the others that fit.
        """
        heap = self._heap(strategy)
        plan: dict[str, int] = {}
        left = count
        while left:
            node = self._pop_preferred(heap, contended)
            if node is None:
                Reservation(self, plan).settle_all()
                raise insufficient(count, count - left)
            cap = self.entries[node].capacity
            take = 1 if strategy == "spread" else min(left, cap.capacity)
            plan[node] = plan.get(node, 0) + take
            left -= take
            self._reserve(node, take)
        return plan, Reservation(self, plan)

    def draw(self, rng: random.Random, size: int, drawn: set[str]) -> list[str]:
        """Up to `size` more nodes with room, drawn uniformly from those not `drawn` yet (added to
        it): sampled spread's candidates for one instance. Fewer only when fewer have room."""
        roomy = self._roomy
        left = len(roomy) - sum(1 for node in drawn if node in self._roomy_at)
        if left <= size:
            fresh = [node for node in roomy if node not in drawn]
        else:  # a draw with replacement (fast), its repeats and nodes drawn before replaced
            fresh = [node for node in dict.fromkeys(rng.choices(roomy, k=size)) if node not in drawn]
            taken = set(fresh)
            while len(fresh) < size:
                node = roomy[rng.randrange(len(roomy))]
                if node not in drawn and node not in taken:
                    taken.add(node)
                    fresh.append(node)
        drawn.update(fresh)
        return fresh

    def place_one_of(self, candidates: list[str]) -> str | None:
        """Sampled spread: the candidate whose usage after one more instance is lowest (the first
        drawn among equals: the draw is random), reserved; None when none has room."""
        best = min(filter(self._roomy_at.__contains__, candidates), key=self._spread.__getitem__, default=None)
        if best is not None:
            self._reserve(best, 1)
        return best

    def has_room(self, node: str) -> bool:
        return node in self._roomy_at

    def _room(self, node: str, has_room: bool) -> None:
        """Keep `_roomy` (a list, for O(1) uniform draws) to the nodes with room."""
        at = self._roomy_at.get(node)
        if has_room and at is None:
            self._roomy_at[node] = len(self._roomy)
            self._roomy.append(node)
        elif not has_room and at is not None:
            if node in self.stale:
                self.stale_roomless.add(node)
            last = self._roomy.pop()
            del self._roomy_at[node]
            if last != node:
                self._roomy[at] = last
                self._roomy_at[last] = at

    def _heap(self, strategy: str) -> list[tuple]:
        heap = self._heaps.get(strategy)
        if heap is None:
            heap = [self._item(strategy, node, e) for node, e in self.entries.items()]
            heapq.heapify(heap)
            self._heaps[strategy] = heap
        return heap

    def _item(self, strategy: str, node: str, entry: Entry) -> tuple:
        # pack: this worker's own nodes before the others' (it fills the fullest of its own);
        # spread: the least used node, this worker's own first among equals (it stays exact).
        # Then, among equally good nodes each worker prefers a different order (a per-process
        # salt), so replicas planning at the same moment pick different nodes.
        theirs = not self.owned(node)
        tier, rank = (theirs, False) if strategy == "pack" else (False, theirs)
        salted = zlib.crc32(node.encode(), _SALT)
        return tier, _score(strategy, entry.capacity), rank, salted, node, entry.stamp

    def _pop_preferred(self, heap: list[tuple], contended: Callable[[str], bool]) -> str | None:
        """The best node with room that is not contended, else the best node with room."""
        aside = []
        while heap:
            item = heapq.heappop(heap)
            node, stamp = item[-2:]
            entry = self.entries.get(node)
            if entry is None or entry.stamp != stamp or entry.capacity.capacity <= 0:
                continue  # outdated
            if not contended(node):
                break
            aside.append(item)
        else:
            if not aside:
                return None
            item = aside.pop(0)
        for other in aside:
            heapq.heappush(heap, other)
        return item[-2]

    def _reserve(self, node: str, taken: int) -> None:
        """Count `taken` more instances (fewer, if negative) as being placed on `node`."""
        pending = self.pending.get(node, 0) + taken
        if pending:
            self.pending[node] = pending
        else:
            self.pending.pop(node, None)
        if node in self.entries:
            self._refresh(node)

    def _refresh(self, node: str) -> None:
        """The node's capacity net of its reservations (and of others' instances sampled spread
        estimates: `learn`), and its new place in every strategy's heap."""
        entry = self.entries[node]
        base, taken = entry.base, self.pending.get(node, 0) + self.foreign.get(node, 0)
        entry.capacity = DeployCapacity(base.capacity - taken, base.usage + base.rate * taken, base.rate, base.weight)
        self._stamps += 1
        entry.stamp = self._stamps
        self._room(node, entry.capacity.capacity > 0)
        self._spread[node] = _score("spread", entry.capacity)
        if entry.capacity.capacity > 0:
            for strategy, heap in self._heaps.items():
                heapq.heappush(heap, self._item(strategy, node, entry))
                if len(heap) > 2 * len(self.entries) + HEAP_SLACK:
                    self._rebuild(strategy, heap)

    def _rebuild(self, strategy: str, heap: list[tuple]) -> None:
        """Drop a heap's outdated items. A node's old item is skipped only when it reaches the top,
        and under spread a node that got busier sinks for good: without this, a steady
        allocate/release loop grew the heap (and the worker) by an item per change."""
        heap[:] = [self._item(strategy, node, e) for node, e in self.entries.items() if e.capacity.capacity > 0]
        heapq.heapify(heap)


_SALT = int.from_bytes(os.urandom(4), "big")
CONTENDED_KEPT = 4096  # nodes remembered as contended before the expired ones are dropped
HEAP_SLACK = 64  # outdated heap items a view tolerates beyond twice its nodes before it rebuilds


def _score(strategy: str, cap: DeployCapacity) -> float:
    # spread: smallest usage after one more instance first; pack: the most used first.
    return cap.usage + cap.rate if strategy == "spread" else -cap.usage


class Views:
    """The views a worker holds, least recently used dropped first."""

    def __init__(
        self,
        limit: int = 16,
        contention_seconds: float = 0.05,
        owned: Callable[[str], bool] = lambda node: True,
        records_kept: int = 2048,
    ) -> None:
        self.limit = limit
        # The newest records only: a node's whole state (about 2 KiB) for each of 50,000 nodes
        # would more than double a worker's memory, to save one read per commit on nodes it has
        # not touched for a while (pack commits to the same few nodes; spread's rotation reads).
        self.records_kept = records_kept
        self.contention_seconds = contention_seconds
        self.owned = owned  # the nodes this worker plans on first (shards.py)
        self._contended: dict[str, float] = {}  # node -> until when another worker races us for it
        self._views: OrderedDict[tuple, CapacityView] = OrderedDict()
        # The records views were last computed from; a commit may start from one (its version
        # check catches a stale one) instead of reading the node again.
        self._records: dict[str, NodeRecord] = {}
        self._known: dict[str, int] = {}  # the newest version of each node the views reflect (a node each)
        ref = weakref.ref(self)
        CACHES.watch("allocation views", lambda: len(v._views) if (v := ref()) else 0, limit=limit)
        CACHES.watch("allocation view heap items", lambda: v.heap_items() if (v := ref()) else 0,
                     limit=lambda: v.heap_bound() if (v := ref()) else 0)
        CACHES.watch("allocation records", lambda: len(v._records) if (v := ref()) else 0, limit=records_kept)

    def heap_items(self) -> int:
        return sum(len(heap) for view in self._views.values() for heap in view._heaps.values())

    def heap_bound(self) -> int:
        """What `heap_items` stays within: per strategy of each view, twice its nodes with room and
        the slack (`CapacityView._rebuild`)."""
        return sum((2 * len(view.entries) + HEAP_SLACK) * len(view._heaps) for view in self._views.values())

    def remember(self, records: Iterable[NodeRecord]) -> None:
        for record in records:
            self._records.pop(record.name, None)  # to the end: the newest are kept
            self._records[record.name] = record
            if len(self._records) > self.records_kept:
                del self._records[next(iter(self._records))]
            self._known[record.name] = max(record.version, self._known.get(record.name, 0))

    def committed(self, record: NodeRecord) -> None:
        """A record this worker just wrote: recompute it everywhere, without reading it back."""
        self.remember([record])
        for view in self._views.values():
            if record.name in view.members:
                view.update([record])

    def contend(self, node: str) -> None:
        """Another worker committed to `node` while we meant to: prefer other nodes for a moment."""
        now = time.monotonic()
        if len(self._contended) >= CONTENDED_KEPT:  # forget those whose moment passed
            self._contended = {n: until for n, until in self._contended.items() if until >= now}
        self._contended[node] = now + self.contention_seconds

    def resharded(self) -> None:
        for view in self._views.values():
            view.reshard()

    def contended(self, node: str) -> bool:
        until = self._contended.get(node)
        if until is None:
            return False
        if until < time.monotonic():
            del self._contended[node]
            return False
        return True

    def known_version(self, node: str) -> int:
        return self._known.get(node, 0)

    def take_record(self, node: str) -> NodeRecord | None:
        """The remembered record of `node`, once: a retry after a failed commit reads it afresh."""
        return self._records.pop(node, None)

    def get(self, key: tuple) -> CapacityView | None:
        view = self._views.get(key)
        if view is not None:
            self._views.move_to_end(key)
        return view

    def put(self, key: tuple, view: CapacityView) -> None:
        self._views[key] = view
        while len(self._views) > self.limit:
            self._views.popitem(last=False)

    def invalidate(self, node: str, *, urgent: bool = False) -> None:
        """`node` changed (`urgent`: a commit to it was refused: read it before the next plan)."""
        self._records.pop(node, None)
        self._known.pop(node, None)
        for view in self._views.values():
            if node in view.members:
                view.mark_stale(node, urgent=urgent)

    def learn(self, node: str, version: int, placed: int | None) -> None:
        """Another worker changed `node` (its event): `CapacityView.learn` in every view holding it."""
        self._records.pop(node, None)
        self._known.pop(node, None)
        for view in self._views.values():
            if node in view.members:
                view.learn(node, version, placed)

    def relabelled(self, node: str, labels: dict[str, str] | None) -> None:
        """A node appeared, went away or changed labels: it joins or leaves the label selections."""
        for view in self._views.values():
            if view.selection is None:
                continue
            belongs = view.selection.admits(node, labels)
            if belongs and node not in view.members:
                view.join(node)
            elif not belongs and node in view.members:
                view.leave(node)

    def invalidate_all(self) -> None:
        self._records.clear()
        self._known.clear()
        for view in self._views.values():
            view.stale.update(view.members)
            view.stale_roomless = {node for node in view.members if not view.has_room(node)}
            view.reshard()
