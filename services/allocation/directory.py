"""Which nodes exist and what their labels are, as this worker knows them: selecting nodes by label
(or every node) without a client listing them, and without reading every record per request.

The directory is loaded once from the node index and kept fresh the same way capacity views are:
change events name the node that changed (own commits are noted directly), and a periodic sweep
compares versions with Redis to catch any event that was lost. A node whose event arrives is
marked pending and its labels are read again before the next selection.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from services.allocation.store import NodeRecord, NodeStore

Labels = dict[str, str]

# The changes that can add or remove a node or change its labels; any other only bumps its version.
_LABEL_KINDS = frozenset({"added", "removed", "labels"})


def matches(labels: Labels, selector: Labels) -> bool:
    """Every key of the selector is present with the same value (an empty selector matches all)."""
    return all(labels.get(key) == value for key, value in selector.items())


class NodeDirectory:
    def __init__(self, store: NodeStore) -> None:
        self.store = store
        self.labels: dict[str, Labels] = {}
        self.versions: dict[str, int] = {}
        self.pending: set[str] = set()
        self.loaded = False
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        """Read every node in the index: its version and labels."""
        async with self._lock:
            names = await self.store.node_names()
            self._apply(zip(names, await self.store.versions_and_labels(names)))
            self.loaded = True

    async def refresh(self) -> list[str]:
        """Read the pending nodes again; returns the nodes whose presence or labels changed."""
        if not self.pending:
            return []
        async with self._lock:
            todo = sorted(self.pending)
            self.pending.difference_update(todo)
            return self._apply(zip(todo, await self.store.versions_and_labels(todo)))

    def _apply(self, found: Iterable[tuple[str, tuple[int, Labels] | None]]) -> list[str]:
        changed = []
        for node, state in found:
            before = self.labels.get(node)
            if state is None:
                self.labels.pop(node, None)
                self.versions.pop(node, None)
            else:
                self.versions[node], self.labels[node] = state
            if before != (None if state is None else state[1]):
                changed.append(node)
        return changed

    def note(self, record: NodeRecord | None, node: str) -> bool:
        """A record this worker just wrote (None: deleted). True if presence or labels changed."""
        before = self.labels.get(node)
        if record is None:
            self.labels.pop(node, None)
            self.versions.pop(node, None)
            return before is not None
        self.labels[node], self.versions[node] = record.labels, record.version
        return before != record.labels

    def changed(self, node: str, kind: str, version: int) -> None:
        """An event says `node` changed (`kind`) at `version` (0: unknown)."""
        if version and version <= self.versions.get(node, 0):
            return  # our own change, or one we have read already
        if kind in _LABEL_KINDS or node not in self.labels or not version:
            self.pending.add(node)
        else:
            self.versions[node] = version  # usage or capacity moved: labels and presence did not

    def select(self, selector: Labels) -> list[str]:
        """The names of the nodes whose labels match, sorted."""
        return sorted(node for node, labels in self.labels.items() if matches(labels, selector))

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
