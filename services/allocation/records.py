"""A node's record, ledger and changes as allocation computes with them: plain values, no I/O.

store.py reads and writes them in Redis; the calculation core (plugin_set.py, view.py, the
plugins) takes them from here, so that it never imports the module that talks to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from bus.codec import decoder, encode

Raw = dict[str, Any]

UP, DOWN, DRAINING = "up", "down", "draining"  # a node's status; only an `up` node takes new workloads


class PluginState(msgspec.Struct, array_like=True):
    capacity: Raw
    usage: Raw


@dataclass
class NodeRecord:
    """A node as stored. `raw` keeps each plugin's encoded state: equal bytes mean equal state,
    which lets callers memoise calculations across nodes without decoding them."""

    name: str
    version: int
    labels: dict[str, str]
    raw: dict[str, bytes]
    tag: str = ""  # names the write that made this version (bus/cas.lua: versions repeat after a failover)
    status: str = UP

    @property
    def schedulable(self) -> bool:
        """Whether new workloads may be placed here: not while its agent is gone or it drains."""
        return self.status == UP

    @cached_property
    def plugins(self) -> dict[str, PluginState]:
        return {name: decode_state(value) for name, value in self.raw.items()}


@dataclass
class Ledger:
    """Ledger entries as read: workload id -> its resource keyed by plugin, and the owners of those
    that have one."""

    resources: dict[str, Raw]
    owners: dict[str, str]

    def owner(self, workload_id: str) -> str | None:
        return self.owners.get(workload_id)


class Intent(msgspec.Struct, array_like=True):
    """A multi-node allocation in progress: when it must be done by, its ids, and the identity it
    places them for (an intent kept before owners were recorded has none)."""

    deadline: float
    workload_ids: list[str]
    owner: str | None = None


@dataclass
class Located:
    """Where the workload index places some ids: node -> its ids, and each id's index entry."""

    nodes: dict[str, list[str]]
    entries: dict[str, bytes]


@dataclass
class Change:
    """What one commit writes. Plugin states are encoded (`encode_state`); ledger values are
    `{plugin: workload resource}` maps; the `index` ids are written to the global workload index
    (`NodeStore.index_entry`) just before the commit, in the same round trip."""

    plugins: dict[str, bytes] = field(default_factory=dict)
    remove_plugins: list[str] = field(default_factory=list)
    labels: dict[str, str] | None = None
    status: str | None = None  # the node's new status (None: unchanged)
    lease: str | None = None  # with `status`: "lapsed" or "live", what the node's lease must be
    ledger_add: dict[str, Raw] = field(default_factory=dict)  # must not exist yet
    ledger_remove: list[str] = field(default_factory=list)  # must exist
    ledger_replace: dict[str, Raw] = field(default_factory=dict)  # must exist
    # The owner of each entry the change adds (written with it), removes or replaces (it must still be
    # the owner the change was computed for); an id not listed has none.
    owners: dict[str, str] = field(default_factory=dict)
    delete: str = ""  # "", "delete" or "delete_if_empty" (refused while the ledger holds workloads)
    index: list[str] = field(default_factory=list)
    # A request applied at most once: (its marker, the answer to keep beside the record for a retry,
    # for how many seconds: the request's idempotency window).
    once: tuple[str, bytes, int] | None = None
    journal: bytes | None = None  # the change's events, for the node's outbox (`bus.outbox.journal`)
    tag: str = ""  # set by the commit: the tag of the version it wrote
    fence: int = 0  # the writing run's lease end (ms of server time); 0: not fenced

    def is_empty(self) -> bool:
        return not (
            self.plugins or self.remove_plugins or self.labels is not None or self.status is not None or self.ledger_add
            or self.ledger_remove or self.ledger_replace or self.delete
        )


class Lease(msgspec.Struct, frozen=True):
    """A node's lease as its last heartbeat left it (ms of the Redis server's clock)."""

    ends: int
    beat: int
    ttl: int
    agent: bytes = b""


class StaleVersion(Exception):
    """The record changed since it was read; reload and compute again."""


class AlreadyApplied(Exception):
    """The request was applied to this node before (by an earlier run of it): its kept answer."""

    def __init__(self, answer: bytes, version: int) -> None:
        super().__init__("already applied")
        self.answer = answer
        self.version = version


class LeaseExpired(Exception):
    """The writing run's lease ended before its commit: a newer run may have taken it over."""


class LedgerConflict(Exception):
    def __init__(self, reason: str, subject: str) -> None:
        super().__init__(f"{reason}: {subject}")
        self.reason = reason
        self.subject = subject


decode_state = decoder(PluginState)


def encode_state(state: PluginState) -> bytes:
    return encode(state)


def encode_states(states: dict[str, PluginState]) -> dict[str, bytes]:
    return {name: encode(state) for name, state in states.items()}
