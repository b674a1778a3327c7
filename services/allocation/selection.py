"""Which nodes a request considers: a list of names as it came on the wire, a label selector, both,
or every node (`Selection`). view.py keeps a capacity view per selection; `key` finds it."""

from __future__ import annotations

from functools import cached_property

import msgspec

from bus.codec import decode_as, encode
from schemas.allocation import NodeName


class NodeSet:
    """A list of node names as it came on the wire: known by its bytes, decoded only when needed.

    A scheduler sends the same long candidate list again and again; comparing its bytes costs a
    fraction of decoding, checking (every name is a subject token), hashing and freeing thousands
    of strings on every request: a view keyed by the bytes decodes its list once.
    """

    def __init__(self, raw: bytes | msgspec.Raw, field: str = "nodenames") -> None:
        self.key = bytes(raw)
        self.field = field
        self.identity = SampledBytes(self.key)

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


class Selection:
    """The nodes a request considers: listed by name (kept as their wire bytes), those whose labels
    match a selector (every key present with that value), both (the listed nodes that match), or,
    with neither, every node. A listed node that does not exist is an error; a node that merely
    stops matching, or goes away, simply leaves a label selection."""

    def __init__(self, names: NodeSet | None = None, labels: dict[str, str] | None = None) -> None:
        self.names = names
        self.labels = labels
        self.key = (names.identity if names is not None else None, tuple(sorted(labels.items())) if labels is not None else None)

    @property
    def dynamic(self) -> bool:
        """Membership follows the directory (labels or every node), rather than a fixed list."""
        return self.labels is not None or self.names is None

    def admits(self, node: str, labels: dict[str, str] | None) -> bool:
        """Whether a node with these labels (None: it does not exist) belongs to the selection."""
        if labels is None or (self.names is not None and node not in self._listed):
            return False
        return all(labels.get(key) == value for key, value in (self.labels or {}).items())

    @cached_property
    def _listed(self) -> set[str]:
        return set(self.names.names) if self.names is not None else set()

    @property
    def single(self) -> str | None:
        """The one node of a list of one (no view needed), else None."""
        if self.dynamic or len(self.names) != 1:
            return None
        return self.names.names[0]


class SampledBytes:
    """Bytes hashed from a sample and compared in full: a view keyed by a 93 KiB node list is found
    without hashing all of it on every request (equal lists still compare equal byte for byte)."""

    __slots__ = ("data", "_hash")

    def __init__(self, data: bytes) -> None:
        self.data = data
        middle = len(data) // 2
        self._hash = hash((len(data), data[:256], data[middle:middle + 256], data[-256:]))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampledBytes) and self._hash == other._hash and self.data == other.data
