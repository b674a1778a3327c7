"""What every provisioner shares: the kernel's mount points, reading its files, a round's batch.

Each provisioner is a plain class with a `name`, an `interval` (seconds) and a synchronous
`sample(now_monotonic, now_unix)` returning a list of `Sample`s (see the package's docstring).
"""

from __future__ import annotations

import os
from typing import ClassVar

import msgspec

from schemas.metric_scopes import Ids
from services.metrics.parsers import parse_cpulist, parse_int
from services.metrics.rates import Counters
from services.metrics.samples import Sample


class Roots(msgspec.Struct, frozen=True):
    """Where the kernel's file systems are mounted."""

    proc: str = "/proc"
    sys: str = "/sys"
    cgroup: str = "/sys/fs/cgroup"

    @classmethod
    def under(cls, root: str) -> Roots:
        """The mount points of a host whose tree is at `root` (`/`: this machine's)."""
        base = root.rstrip("/")
        return cls(proc=f"{base}/proc", sys=f"{base}/sys", cgroup=f"{base}/sys/fs/cgroup")


HOST = Roots()  # this machine's mount points


def read_text(path: str) -> str | None:
    """A whole kernel file, or None when it does not exist or cannot be read (vanished cgroup,
    a NIC without a speed). os.read avoids the text-IO layer's cost on these small files."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii", "replace")


def read_int(path: str) -> int | None:
    text = read_text(path)
    return None if text is None else parse_int(text)


class Batch:
    """The samples of one round, all stamped with the round's unix time; None values are skipped."""

    def __init__(self, time: float) -> None:
        self.time = time
        self.samples: list[Sample] = []

    def add(self, scope: str, ids: Ids, metric: str, value: float | None) -> None:
        if value is not None:
            self.samples.append(Sample(scope, ids, metric, float(value), self.time))


class Provisioner:
    """Base class: a round starts a new generation of counters, then `_collect` reads the files."""

    name: ClassVar[str]

    def __init__(self, roots: Roots = HOST, interval: float = 5.0) -> None:
        self.roots = roots
        self.interval = interval
        self._counters = Counters()

    def sample(self, now_monotonic: float, now_unix: float) -> list[Sample]:
        self._counters.new_round()
        batch = Batch(now_unix)
        self._collect(batch, now_monotonic)
        return batch.samples

    def _collect(self, batch: Batch, now: float) -> None:
        raise NotImplementedError

    def _rate(self, key: object, value: float, now: float, scale: float = 1.0) -> float | None:
        rate = self._counters.rate(key, value, now)
        return None if rate is None else rate * scale


def numa_cpus(sys_root: str) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from the online node list and each node's cpulist.

    Memory-only nodes have an empty cpulist. A kernel without NUMA support has no node directory.
    """
    base = f"{sys_root}/devices/system/node"
    online = read_text(f"{base}/online")
    if online is None:
        return {}
    return {
        node: parse_cpulist(read_text(f"{base}/node{node}/cpulist") or "") for node in parse_cpulist(online)
    }
