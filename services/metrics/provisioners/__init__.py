"""Provisioners: read the kernel once per round and turn what they read into samples.

Each provisioner is a plain class with a `name`, an `interval` (seconds) and a synchronous
`sample(now_monotonic, now_unix)` returning a list of `Sample`s. It reads each of its files once
per round, so a round is internally consistent, and every sample of the round carries the round's
unix time. Rates need the previous round: the first round gives the cumulative and gauge values
only. The roots of /proc, /sys and the cgroup mount are configurable so tests can point a
provisioner at a sample tree.

Nothing here blocks on anything but file reads, and a round of all provisioners costs a few
milliseconds, so the service layer can run `sample` inline or in a worker thread.

The package: `base` (mount points, file reading, the `Provisioner` base class), `node` (CPU,
memory, pressure), `devices` (disks, network interfaces), `cgroup` (containers and cgroups). The
types a sample is made of live in `services.metrics.samples`, which reads nothing.
"""

from __future__ import annotations

from schemas.metric_scopes import Ids
from services.metrics.provisioners.base import HOST, Provisioner, Roots, numa_cpus, read_int, read_text
from services.metrics.provisioners.cgroup import CgroupProvisioner, CgroupReader, CgroupStats
from services.metrics.provisioners.devices import (
    DISK_HDD,
    DISK_NVME,
    DISK_SSD,
    DISK_UNKNOWN,
    DISK_VIRTIO,
    DiskProvisioner,
    NetworkProvisioner,
    disk_type,
)
from services.metrics.provisioners.node import (
    CpuProvisioner,
    MemoryProvisioner,
    PressureProvisioner,
    add_pressure,
)
from services.metrics.samples import Sample

PROVISIONERS: tuple[type[Provisioner], ...] = (
    CpuProvisioner,
    MemoryProvisioner,
    PressureProvisioner,
    DiskProvisioner,
    NetworkProvisioner,
    CgroupProvisioner,
)
PROVISIONER_NAMES = tuple(provisioner.name for provisioner in PROVISIONERS)

__all__ = [
    "DISK_HDD", "DISK_NVME", "DISK_SSD", "DISK_UNKNOWN", "DISK_VIRTIO", "HOST", "PROVISIONERS", "PROVISIONER_NAMES",
    "CgroupProvisioner", "CgroupReader", "CgroupStats", "CpuProvisioner", "DiskProvisioner", "Ids",
    "MemoryProvisioner", "NetworkProvisioner", "PressureProvisioner", "Provisioner", "Roots", "Sample",
    "add_pressure", "disk_type", "numa_cpus", "read_int", "read_text",
]  # fmt: skip
