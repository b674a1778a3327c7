"""Which nodes exist, what their labels are and which take new workloads (their status), as this
worker knows them: selecting nodes by label (or every node) without a client listing them, and
without reading every record per request.

The directory is loaded once from the node index and kept fresh the same way capacity views are:
change events name the node that changed (own commits are noted directly), and a periodic sweep
compares versions with Redis to catch any event that was lost. A node whose event arrives is
marked pending and its labels are read again before the next selection.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from services.allocation.records import UP, NodeRecord
from services.allocation.store import NodeStore

Labels = dict[str, str]

# The changes that can add or remove a node, change its labels or its status; any other only bumps
# its version.
_LABEL_KINDS = frozenset({"added", "removed", "labels", "up", "down", "draining"})


def matches(labels: Labels, selector: Labels) -> bool:
    """Every key of the selector is present with the same value (an empty selector matches all)."""
    return all(labels.get(key) == value for key, value in selector.items())


class NodeDirectory:
    def __init__(self, store: NodeStore) -> None:
        self.store = store
        self.labels: dict[str, Labels] = {}
        self.versions: dict[str, int] = {}
        self.unschedulable: set[str] = set()  # nodes down or draining: in no selection
        self.pending: set[str] = set()
        self.loaded = False
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        """Read every node in the index: its version and labels."""
        async with self._lock:
            names = await self.store.node_names()
            self._apply(zip(names, await self.store.directory_entries(names)))
            self.loaded = True

    async def refresh(self) -> list[str]:
        """Read the pending nodes again; returns the nodes whose presence or labels changed."""
        if not self.pending:
            return []
        async with self._lock:
            todo = sorted(self.pending)
            self.pending.difference_update(todo)
            return self._apply(zip(todo, await self.store.directory_entries(todo)))

    def _apply(self, found: Iterable[tuple[str, tuple[int, Labels, str] | None]]) -> list[str]:
        changed = []
        for node, state in found:
            before = self.selectable(node)
            if state is None:
                self._forget(node)
            else:
                version, labels, status = state
                self._set(node, version, labels, status)
            if before != self.selectable(node):
                changed.append(node)
        return changed

    def _set(self, node: str, version: int, labels: Labels, status: str) -> None:
        self.versions[node], self.labels[node] = version, labels
        if status == UP:
            self.unschedulable.discard(node)
        else:
            self.unschedulable.add(node)

    def _forget(self, node: str) -> None:
        self.labels.pop(node, None)
        self.versions.pop(node, None)
        self.unschedulable.discard(node)

    def selectable(self, node: str) -> Labels | None:
        """The labels of a node that selections take (None: it does not exist, or takes no new
        workloads now)."""
        return None if node in self.unschedulable else self.labels.get(node)

    def note(self, record: NodeRecord | None, node: str) -> bool:
        """A record this worker just wrote (None: deleted). True if what selections see changed."""
        before = self.selectable(node)
        if record is None:
            self._forget(node)
        else:
            self._set(node, record.version, record.labels, record.status)
        return before != self.selectable(node)

    def changed(self, node: str, kind: str, version: int) -> None:
        """An event says `node` changed (`kind`) at `version` (0: unknown)."""
        if version and version <= self.versions.get(node, 0):
            return  # our own change, or one we have read already
        if kind in _LABEL_KINDS or node not in self.labels or not version:
            self.pending.add(node)
        else:
            self.versions[node] = version  # usage or capacity moved: labels and presence did not

    def select(self, selector: Labels, *, schedulable: bool = False) -> list[str]:
        """The names of the nodes whose labels match, sorted; `schedulable`: only those up."""
        return sorted(
            node for node, labels in self.labels.items()
            if matches(labels, selector) and not (schedulable and node in self.unschedulable)
        )

    async def sweep(self) -> set[str]:
        """Catch what lost events hid: nodes added or removed (the index) and changed (versions).
        Returns the nodes found out of date; they are read again before the next selection."""
        names = set(await self.store.node_names())
        stale = names.symmetric_difference(self.labels)
        known = sorted(self.labels)
        for start in range(0, len(known), 500):  # in slices, so requests are served meanwhile
            part = known[start:start + 500]
            for node, version in zip(part, await self.store.versions(part)):
                if version != self.versions.get(node):
                    stale.add(node)
        self.pending.update(stale)
        return stale
