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
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable

import msgspec

from bus.codec import decode_as, encode
from services.allocation.messages import NodeName
from services.allocation.placement import insufficient
from services.allocation.plugin import DeployCapacity
from services.allocation.store import NodeRecord


class NodeSet:
    """A list of node names as it came on the wire: known by its bytes, decoded only when needed.

    A scheduler sends the same long candidate list again and again; comparing its bytes costs a
    fraction of decoding, checking (every name is a subject token), hashing and freeing thousands
    of strings on every request: a view keyed by the bytes decodes its list once.
    """

    def __init__(self, raw: bytes | msgspec.Raw, field: str = "nodenames") -> None:
        self.key = bytes(raw)
        self.field = field

    @classmethod
    def of(cls, names: list[str]) -> "NodeSet":
        node_set = cls(encode(names))
        node_set.__dict__["names"] = names
        return node_set

    @cached_property
    def names(self) -> list[str]:
        return decode_as(self.key, list[NodeName], self.field)

    def __len__(self) -> int:
        """The list's length from its MessagePack header, without decoding the names."""
        head = self.key[:1]
        if head and 0x90 <= head[0] <= 0x9F:
            return head[0] & 0x0F
        if head in (b"\xdc", b"\xdd"):
            return int.from_bytes(self.key[1:3 if head == b"\xdc" else 5], "big")
        return len(self.names)  # not an array: decoding says what is wrong with it


@dataclass
class Entry:
    capacity: DeployCapacity
    stamp: int  # bumped on every change, so heap items pushed before it are recognised as outdated


@dataclass
class CapacityView:
    """Merged deploy capacity per node for one request; `compute` gives a record's capacity or None."""

    nodes: list[str]
    compute: Callable[[NodeRecord], DeployCapacity | None]
    entries: dict[str, Entry] = field(default_factory=dict)  # nodes with room, by name
    seen: dict[str, int] = field(default_factory=dict)  # every member's version when last computed
    stale: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one refresh at a time
    _heaps: dict[str, list[tuple[float, int, str, int]]] = field(default_factory=dict)
    _stamps: int = 0

    def __post_init__(self) -> None:
        self.members = set(self.nodes)
        self.stale = set(self.nodes)  # nothing is computed yet

    def update(self, records: Iterable[NodeRecord]) -> None:
        """Recompute the given (freshly loaded) nodes."""
        for record in records:
            self._stamps += 1
            self.seen[record.name] = record.version
            capacity = self.compute(record)
            if capacity is None or capacity.capacity <= 0:
                self.entries.pop(record.name, None)
                continue
            entry = self.entries[record.name] = Entry(capacity, self._stamps)
            for strategy, heap in self._heaps.items():
                heapq.heappush(heap, self._item(strategy, record.name, entry))

    def capacities(self) -> dict[str, DeployCapacity]:
        return {node: entry.capacity for node, entry in self.entries.items()}

    def plan(self, strategy: str, count: int) -> dict[str, int]:
        """Choose nodes for `count` instances and reserve them in the view until their events arrive.

        spread: each instance to the node with the lowest usage after taking it (eru's GLOBAL);
        pack: the most-used node that still fits first, filled before the next.
        """
        heap = self._heap(strategy)
        plan: dict[str, int] = {}
        left = count
        while left:
            node = self._pop_valid(heap)
            if node is None:
                self._restore(plan)
                raise insufficient(count, count - left)
            cap = self.entries[node].capacity
            take = 1 if strategy == "spread" else min(left, cap.capacity)
            plan[node] = plan.get(node, 0) + take
            left -= take
            self._reserve(node, take)
        return plan

    def _heap(self, strategy: str) -> list[tuple[float, int, str, int]]:
        heap = self._heaps.get(strategy)
        if heap is None:
            heap = [self._item(strategy, node, e) for node, e in self.entries.items()]
            heapq.heapify(heap)
            self._heaps[strategy] = heap
        return heap

    def _item(self, strategy: str, node: str, entry: Entry) -> tuple[float, int, str, int]:
        # Among equally good nodes each worker prefers a different order (a per-process salt), so
        # replicas planning at the same moment pick different nodes instead of colliding on one.
        return _score(strategy, entry.capacity), zlib.crc32(node.encode(), _SALT), node, entry.stamp

    def _pop_valid(self, heap: list[tuple[float, int, str, int]]) -> str | None:
        while heap:
            _, _, node, stamp = heapq.heappop(heap)
            entry = self.entries.get(node)
            if entry is not None and entry.stamp == stamp and entry.capacity.capacity > 0:
                return node
        return None

    def _reserve(self, node: str, taken: int) -> None:
        """Count `taken` instances as placed on `node` in this view (its event will recompute it)."""
        entry = self.entries[node]
        cap = entry.capacity
        self._stamps += 1
        entry.capacity = DeployCapacity(cap.capacity - taken, cap.usage + cap.rate * taken, cap.rate, cap.weight)
        entry.stamp = self._stamps
        for strategy, heap in self._heaps.items():
            if entry.capacity.capacity > 0:
                heapq.heappush(heap, self._item(strategy, node, entry))

    def _restore(self, plan: dict[str, int]) -> None:
        """Undo the reservations of a plan that could not be completed."""
        for node, taken in plan.items():
            self._reserve(node, -taken)


_SALT = int.from_bytes(os.urandom(4), "big")


def _score(strategy: str, cap: DeployCapacity) -> float:
    # spread: smallest usage after one more instance first; pack: the most used first.
    return cap.usage + cap.rate if strategy == "spread" else -cap.usage


class Views:
    """The views a worker holds, least recently used dropped first."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._views: OrderedDict[tuple, CapacityView] = OrderedDict()
        # The records views were last computed from; a commit may start from one (its version
        # check catches a stale one) instead of reading the node again.
        self._records: dict[str, NodeRecord] = {}
        self._known: dict[str, int] = {}  # the newest version of each node the views reflect

    def remember(self, records: Iterable[NodeRecord]) -> None:
        for record in records:
            self._records[record.name] = record
            self._known[record.name] = max(record.version, self._known.get(record.name, 0))

    def committed(self, record: NodeRecord) -> None:
        """A record this worker just wrote: recompute it everywhere, without reading it back."""
        self.remember([record])
        for view in self._views.values():
            if record.name in view.members:
                view.update([record])

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

    def invalidate(self, node: str) -> None:
        self._records.pop(node, None)
        self._known.pop(node, None)
        for view in self._views.values():
            if node in view.members:
                view.stale.add(node)

    def invalidate_all(self) -> None:
        self._records.clear()
        self._known.clear()
        for view in self._views.values():
            view.stale.update(view.members)

    def versions(self) -> dict[str, int]:
        """node -> the version each view last computed it at (for the sweep that catches lost events)."""
        seen: dict[str, int] = {}
        for view in self._views.values():
            seen.update(view.seen)
        return seen
