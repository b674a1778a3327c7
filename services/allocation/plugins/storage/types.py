"""The storage plugin's wire shapes (eru resource-storage §3.2) as typed Structs, and their arithmetic.

Volume bindings and volume plans stay strings on the wire, exactly as in eru; `volumes.py` parses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class IO(msgspec.Struct, frozen=True):
    """Four IO numbers: a binding's request, a disk's quota, or what a workload holds of one."""

    read_iops: int = 0
    write_iops: int = 0
    read_bps: int = 0
    write_bps: int = 0

    def __add__(self, other: IO) -> IO:
        return IO(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: IO) -> IO:
        return IO(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def scaled(self, sign: int) -> IO:
        return IO(*(sign * value for value in self.values()))

    def values(self) -> tuple[int, int, int, int]:
        return (self.read_iops, self.write_iops, self.read_bps, self.write_bps)

    def any(self) -> bool:
        """eru's RequireIOPS: asks for some quota."""
        return any(value > 0 for value in self.values())

    def nonzero(self) -> bool:
        return any(self.values())

    def fits(self, quota: IO) -> bool:
        return all(need <= have for need, have in zip(self.values(), quota.values(), strict=True))

    def render(self) -> str:
        """The `rIOPS:wIOPS:rBPS:wBPS` form of eru's iops_options and disk strings."""
        return ":".join(str(value) for value in self.values())


class Disk(msgspec.Struct, forbid_unknown_fields=False):
    """A disk with IO quotas. The mixed-case keys (`read_IOPS`, `read_bps`) are eru's, kept on the wire."""

    device: str
    mounts: list[str] = []
    read_iops: int = msgspec.field(default=0, name="read_IOPS")
    write_iops: int = msgspec.field(default=0, name="write_IOPS")
    read_bps: int = 0
    write_bps: int = 0

    @property
    def io(self) -> IO:
        return IO(self.read_iops, self.write_iops, self.read_bps, self.write_bps)

    def with_io(self, io: IO) -> Disk:
        return Disk(self.device, list(self.mounts), *io.values())

    def render(self) -> str:
        """eru's `device:mount1,mount2:rIOPS:wIOPS:rBPS:wBPS` (used in diffs)."""
        return f"{self.device}:{','.join(self.mounts)}:{self.io.render()}"


class StorageNode(msgspec.Struct, forbid_unknown_fields=False):
    """A node's capacity or usage: volumes (device -> bytes), disks, and the flat storage budget."""

    volumes: dict[str, int] = {}
    disks: list[Disk] = []
    storage: int = 0

    def disk_map(self) -> dict[str, Disk]:
        return {disk.device: disk for disk in self.disks}


class StorageWorkload(msgspec.Struct, forbid_unknown_fields=False):
    """What one workload holds. Plans map a binding's full string to {device: bytes}."""

    volumes_request: list[str] = []
    volumes_limit: list[str] = []
    volume_plan_request: dict[str, dict[str, int]] = {}
    volume_plan_limit: dict[str, dict[str, int]] = {}
    storage_request: int = 0
    storage_limit: int = 0
    disks_request: list[Disk] = []
    disks_limit: list[Disk] = []

    def usage(self) -> StorageNode:
        """What this workload adds to a node's usage: eru counts the request side only."""
        volumes: dict[str, int] = {}
        for placement in self.volume_plan_request.values():
            for device, size in placement.items():
                volumes[device] = volumes.get(device, 0) + size
        return StorageNode(volumes, list(self.disks_request), self.storage_request)


class StorageEngineParams(msgspec.Struct):
    volumes: list[str] = []
    volume_changed: bool = False
    storage: int = 0
    iops_options: dict[str, str] = {}


def combine(a: StorageNode, b: StorageNode, sign: int) -> StorageNode:
    """a + sign * b, element-wise. A disk keeps a's mounts unless b names some (eru's Disks.Add)."""
    volumes = dict(a.volumes)
    for device, size in b.volumes.items():
        volumes[device] = volumes.get(device, 0) + sign * size
    disks = a.disk_map()
    for disk in b.disks:
        base = disks.get(disk.device, Disk(disk.device))
        merged = base.with_io(base.io + disk.io.scaled(sign))
        merged.mounts = list(disk.mounts or base.mounts)
        disks[disk.device] = merged
    return StorageNode(volumes, sorted_disks(disks.values()), a.storage + sign * b.storage)


def sorted_disks(disks: Iterable[Disk]) -> list[Disk]:
    """Disks in device order, the order eru stores them in."""
    return sorted(disks, key=lambda disk: disk.device)
