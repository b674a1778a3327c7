"""Device provisioners: whole block devices (/proc/diskstats) and network interfaces (/proc/net/dev)."""

from __future__ import annotations

import os

from services.metrics.parsers import NET_DEV_FIELDS, DiskStats, parse_diskstats, parse_net_dev
from services.metrics.provisioners.base import Batch, Provisioner, read_int, read_text

# ------------------------------------------------------------------------------------- disks

DISK_UNKNOWN, DISK_HDD, DISK_SSD, DISK_NVME, DISK_VIRTIO = range(5)
_SECTOR_BYTES = 512  # diskstats counts 512-byte sectors whatever the device's block size

# metric -> DiskStats field, written as it is
_DISK_COUNTERS = {"io.read.system": "reads", "io.write.system": "writes", "io.busy.system": "io_ticks_ms"}
# metric -> (DiskStats counter, scale of its per-second rate to the metric's unit)
_DISK_RATES = {
    "io.read.ops.system": ("reads", 1),
    "io.write.ops.system": ("writes", 1),
    "io.read.bps.system": ("sectors_read", _SECTOR_BYTES),
    "io.write.bps.system": ("sectors_written", _SECTOR_BYTES),
}


class DiskProvisioner(Provisioner):
    """Whole block devices from /proc/diskstats (partitions and loop/ram devices are skipped)."""

    name = "disk"

    def _collect(self, batch: Batch, now: float) -> None:
        text = read_text(f"{self.roots.proc}/diskstats")
        if text is None:
            return
        try:
            # /sys/block lists whole disks only; diskstats also lists their partitions.
            disks = set(os.listdir(f"{self.roots.sys}/block"))
        except OSError:
            return
        for name, stats in parse_diskstats(text).items():
            if name in disks and not name.startswith(("loop", "ram")):
                self._disk(batch, now, name, stats)

    def _disk(self, batch: Batch, now: float, name: str, stats: DiskStats) -> None:
        ids = (name,)
        for metric, field in _DISK_COUNTERS.items():
            batch.add("device", ids, metric, getattr(stats, field))
        for metric, (field, scale) in _DISK_RATES.items():
            batch.add("device", ids, metric, self._rate((name, field), getattr(stats, field), now, scale))
        busy = self._rate((name, "busy"), stats.io_ticks_ms, now, 1 / 1000)
        # io_ticks and the clock are read a moment apart, so the fraction can overshoot a hair.
        batch.add("device", ids, "io.busy.rate.system", None if busy is None else min(1.0, busy))
        block = f"{self.roots.sys}/block/{name}"
        batch.add("device", ids, "io.disk.type", disk_type(block, name))
        batch.add("device", ids, "io.disk.wbt", read_int(f"{block}/queue/wbt_lat_usec"))


def disk_type(block_dir: str, name: str) -> int:
    """katalyst's disk type enum. virtio disks report rotational=1, so the bus is checked first."""
    if name.startswith("nvme"):
        return DISK_NVME
    try:
        if "/virtio" in os.readlink(block_dir):
            return DISK_VIRTIO
    except OSError:
        pass  # not a symlink (sample trees) or gone
    rotational = read_text(f"{block_dir}/queue/rotational")
    if rotational is None:
        return DISK_UNKNOWN
    return DISK_HDD if rotational.strip() == "1" else DISK_SSD


# ----------------------------------------------------------------------------------- network

_NET_METRICS = {field: f"net.tcp.{field}" for field in NET_DEV_FIELDS}


class NetworkProvisioner(Provisioner):
    """Per-interface counters and byte rates from /proc/net/dev (loopback skipped), link speed."""

    name = "network"

    def _collect(self, batch: Batch, now: float) -> None:
        text = read_text(f"{self.roots.proc}/net/dev")
        if text is None:
            return
        for nic, counters in parse_net_dev(text).items():
            if nic != "lo":
                self._nic(batch, now, nic, counters)

    def _nic(self, batch: Batch, now: float, nic: str, counters: dict[str, int]) -> None:
        ids = (nic,)
        for field, value in counters.items():
            batch.add("network", ids, _NET_METRICS[field], value)
        batch.add("network", ids, "net.receive.bps", self._rate((nic, "rx"), counters["receive_bytes"], now))
        batch.add(
            "network", ids, "net.transmit.bps", self._rate((nic, "tx"), counters["transmit_bytes"], now)
        )
        # Virtual interfaces refuse to read their speed (EINVAL); unknown speeds read as -1.
        speed = read_int(f"{self.roots.sys}/class/net/{nic}/speed")
        if speed is not None and speed > 0:
            batch.add("network", ids, "net.speed", speed)
