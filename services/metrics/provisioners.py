"""Provisioners: read the kernel once per round and turn what they read into samples.

Each provisioner is a plain class with a `name`, an `interval` (seconds) and a synchronous
`sample(now_monotonic, now_unix)` returning a list of `Sample`s. It reads each of its files once
per round, so a round is internally consistent, and every sample of the round carries the round's
unix time. Rates need the previous round: the first round gives the cumulative and gauge values
only. The roots of /proc, /sys and the cgroup mount are configurable so tests can point a
provisioner at a sample tree.

Nothing here blocks on anything but file reads, and a round of all provisioners costs a few
milliseconds, so the service layer can run `sample` inline or in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from services.metrics.cgroups import CgroupLayout, Discovery, detect_layout, discover
from services.metrics.metrics_list import (
    MEMORY_COUNTERS,
    METRICS,
    PSI_FIELDS,
    PSI_RESOURCES,
    cgroup_name,
    psi_name,
)
from services.metrics.parsers import (
    NET_DEV_FIELDS,
    DiskStats,
    ProcStat,
    parse_blkio,
    parse_cpu_max,
    parse_cpuacct_usage_all,
    parse_cpulist,
    parse_diskstats,
    parse_flat_keyed,
    parse_int,
    parse_io_stat,
    parse_loadavg,
    parse_meminfo,
    parse_memory_limit,
    parse_net_dev,
    parse_numa_stat,
    parse_pressure,
    parse_proc_stat,
)
from services.metrics.rates import Counters, CpuRatios, cpu_ratios

Ids = tuple[str | int, ...]


class Roots(msgspec.Struct, frozen=True):
    """Where the kernel's file systems are mounted."""

    proc: str = "/proc"
    sys: str = "/sys"
    cgroup: str = "/sys/fs/cgroup"


HOST = Roots()  # this machine's mount points


class Sample(msgspec.Struct, frozen=True, gc=False):
    """One metric value. `ids` holds the scope's id values in the order `SCOPES[scope]` names them."""

    scope: str
    ids: Ids
    metric: str
    value: float
    time: float


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


class _Batch:
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
        batch = _Batch(now_unix)
        self._collect(batch, now_monotonic)
        return batch.samples

    def _collect(self, batch: _Batch, now: float) -> None:
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


# ---------------------------------------------------------------------------------------- CPU


class CpuProvisioner(Provisioner):
    """Node, per-CPU and per-NUMA CPU usage from /proc/stat; load from /proc/loadavg."""

    name = "cpu"

    def __init__(self, roots: Roots = HOST, interval: float = 5.0) -> None:
        super().__init__(roots, interval)
        # Ratios compare two readings of all columns of a line, so keep the whole previous file.
        self._previous: ProcStat | None = None

    def _collect(self, batch: _Batch, now: float) -> None:
        text = read_text(f"{self.roots.proc}/stat")
        if text is None:
            return
        stat = parse_proc_stat(text)
        batch.add("node", (), "cpu.total.system", len(stat.cpus))
        batch.add("node", (), "procs.running.system", stat.procs_running)
        self._load(batch)
        previous, self._previous = self._previous, stat
        if previous is not None:
            self._node_usage(batch, previous, stat)
            ratios = self._per_cpu(batch, previous, stat)
            self._per_numa(batch, ratios)

    def _load(self, batch: _Batch) -> None:
        text = read_text(f"{self.roots.proc}/loadavg")
        if text is not None:
            load = parse_loadavg(text)
            batch.add("node", (), "cpu.load.1min.system", load.load1)
            batch.add("node", (), "cpu.load.5min.system", load.load5)
            batch.add("node", (), "cpu.load.15min.system", load.load15)

    def _node_usage(self, batch: _Batch, previous: ProcStat, stat: ProcStat) -> None:
        ratios = cpu_ratios(previous.total, stat.total)
        if ratios is None:
            return
        batch.add("node", (), "cpu.usage.system", ratios.usage * len(stat.cpus))
        batch.add("node", (), "cpu.usage.ratio.system", ratios.usage)
        batch.add("node", (), "cpu.usage.ratio.cpu", ratios.usage)
        batch.add("node", (), "cpu.sys.usage.ratio.cpu", ratios.system)

    def _per_cpu(self, batch: _Batch, previous: ProcStat, stat: ProcStat) -> dict[int, CpuRatios]:
        found = {}
        for cpu, times in stat.cpus.items():
            before = previous.cpus.get(cpu)
            ratios = None if before is None else cpu_ratios(before, times)
            if ratios is None:
                continue
            found[cpu] = ratios
            batch.add("cpu", (cpu,), "cpu.usage.ratio.cpu", ratios.usage)
            batch.add("cpu", (cpu,), "cpu.iowait.ratio.cpu", ratios.iowait)
            batch.add("cpu", (cpu,), "cpu.sys.usage.ratio.cpu", ratios.system)
        return found

    def _per_numa(self, batch: _Batch, ratios: dict[int, CpuRatios]) -> None:
        """A node's usage in cores is the sum of its CPUs' ratios; its averages divide by the CPUs
        that had a ratio this round (katalyst's rule for core aggregates)."""
        for node, cpus in numa_cpus(self.roots.sys).items():
            have = [ratios[cpu] for cpu in cpus if cpu in ratios]
            if not have:
                continue
            usage = sum(r.usage for r in have)
            batch.add("numa", (node,), "cpu.usage.numa", usage)
            batch.add("numa", (node,), "cpu.usage.numa.avg", usage / len(have))
            batch.add("numa", (node,), "cpu.iowait.ratio.numa.avg", sum(r.iowait for r in have) / len(have))


# ------------------------------------------------------------------------------------- memory

# metric -> /proc/meminfo key (bytes after parsing)
_MEMINFO = {
    "mem.total.system": "MemTotal",
    "mem.free.system": "MemFree",
    "mem.available.system": "MemAvailable",
    "mem.shmem.system": "Shmem",
    "mem.buffer.system": "Buffers",
    "mem.pagecache.system": "Cached",
    "mem.active.anon.system": "Active(anon)",
    "mem.inactive.anon.system": "Inactive(anon)",
    "mem.active.file.system": "Active(file)",
    "mem.inactive.file.system": "Inactive(file)",
    "mem.dirty.system": "Dirty",
    "mem.writeback.system": "Writeback",
    "mem.swap.total.system": "SwapTotal",
    "mem.swap.free.system": "SwapFree",
    "mem.slab.reclaimable.system": "SReclaimable",
}

# metric -> /proc/vmstat key (cumulative page counts)
_VMSTAT = {
    "mem.kswapdsteal.system": "pgsteal_kswapd",
    "mem.direct.pgsteal.system": "pgsteal_direct",
    "mem.kswapd.pgscan.system": "pgscan_kswapd",
    "mem.direct.pgscan.system": "pgscan_direct",
    "mem.compact.stall.system": "compact_stall",
}

# per-round delta metric -> cumulative metric it is the delta of
_VMSTAT_DELTAS = {
    "mem.kswapdsteal.delta.system": "mem.kswapdsteal.system",
    "mem.direct.pgsteal.delta.system": "mem.direct.pgsteal.system",
    "mem.kswapd.pgscan.delta.system": "mem.kswapd.pgscan.system",
    "mem.direct.pgscan.delta.system": "mem.direct.pgscan.system",
}

# metric -> /sys/devices/system/node/nodeN/meminfo key
_NODE_MEMINFO = {
    "mem.total.numa": "MemTotal",
    "mem.free.numa": "MemFree",
    "mem.used.numa": "MemUsed",
    "mem.shmem.numa": "Shmem",
    "mem.filepage.numa": "FilePages",
    "mem.inactivefile.numa": "Inactive(file)",
}


class MemoryProvisioner(Provisioner):
    """Node memory (meminfo), reclaim counters (vmstat), watermark scale factor, per-NUMA memory."""

    name = "memory"

    def _collect(self, batch: _Batch, now: float) -> None:
        self._meminfo(batch)
        self._vmstat(batch, now)
        batch.add(
            "node",
            (),
            "mem.scale.factor.system",
            read_int(f"{self.roots.proc}/sys/vm/watermark_scale_factor"),
        )
        for node in numa_cpus(self.roots.sys):
            self._node_meminfo(batch, node)

    def _meminfo(self, batch: _Batch) -> None:
        text = read_text(f"{self.roots.proc}/meminfo")
        if text is None:
            return
        info = parse_meminfo(text)
        for metric, key in _MEMINFO.items():
            batch.add("node", (), metric, info.get(key))
        if "MemTotal" in info and "MemFree" in info:
            batch.add("node", (), "mem.used.system", info["MemTotal"] - info["MemFree"])

    def _vmstat(self, batch: _Batch, now: float) -> None:
        text = read_text(f"{self.roots.proc}/vmstat")
        if text is None:
            return
        vmstat = parse_flat_keyed(text)
        counters = {metric: vmstat.get(key) for metric, key in _VMSTAT.items()}
        for metric, value in counters.items():
            batch.add("node", (), metric, value)
        for metric, source in _VMSTAT_DELTAS.items():
            if counters[source] is not None:
                batch.add("node", (), metric, self._counters.delta(source, counters[source], now))

    def _node_meminfo(self, batch: _Batch, node: int) -> None:
        text = read_text(f"{self.roots.sys}/devices/system/node/node{node}/meminfo")
        if text is None:
            return
        info = parse_meminfo(text)
        for metric, key in _NODE_MEMINFO.items():
            batch.add("numa", (node,), metric, info.get(key))
        # The kernel keeps no per-node MemAvailable. Free memory plus the file LRU (page cache that
        # is not shmem) plus reclaimable slab is what reclaim could free; watermarks are ignored.
        parts = [
            info.get(key) for key in ("MemTotal", "MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        ]
        if None not in parts:
            total, *available = parts
            batch.add("numa", (node,), "mem.available.numa", min(total, sum(available)))


# ----------------------------------------------------------------------------------- pressure

_PSI_SUFFIXES = ("system", "container", "cgroup")
# (suffix, pressure file, kind) -> the four metric names, in PSI_FIELDS order.
_PSI_NAMES = {
    (suffix, resource, kind): tuple(psi_name(prefix, kind, field, suffix) for field in PSI_FIELDS)
    for suffix in _PSI_SUFFIXES
    for resource, prefix in PSI_RESOURCES.items()
    for kind in ("some", "full")
}


def add_pressure(
    batch: _Batch, counters: Counters, now: float, scope: str, ids: Ids, resource: str, text: str
) -> None:
    """The kernel's averages as they are, and the stalled fraction of the round from `total`.

    `scope` is "node", "container" or "cgroup"; node metric names end in ".system"."""
    suffix = "system" if scope == "node" else scope
    pressure = parse_pressure(text)
    for kind, line in (("some", pressure.some), ("full", pressure.full)):
        if line is None:
            continue
        avg10, avg60, avg300, ratio = _PSI_NAMES[suffix, resource, kind]
        batch.add(scope, ids, avg10, line.avg10)
        batch.add(scope, ids, avg60, line.avg60)
        batch.add(scope, ids, avg300, line.avg300)
        stalled = counters.rate((scope, ids, resource, kind), line.total_us, now)
        # The file and the clock are read a moment apart, so the fraction can overshoot a hair.
        batch.add(scope, ids, ratio, None if stalled is None else min(1.0, stalled / 1e6))


class PressureProvisioner(Provisioner):
    """Node PSI from /proc/pressure/{cpu,memory,io}, where the kernel has it (4.20+, CONFIG_PSI)."""

    name = "pressure"

    def _collect(self, batch: _Batch, now: float) -> None:
        for resource in PSI_RESOURCES:
            text = read_text(f"{self.roots.proc}/pressure/{resource}")
            if text is not None:
                add_pressure(batch, self._counters, now, "node", (), resource, text)


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

    def _collect(self, batch: _Batch, now: float) -> None:
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

    def _disk(self, batch: _Batch, now: float, name: str, stats: DiskStats) -> None:
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

    def _collect(self, batch: _Batch, now: float) -> None:
        text = read_text(f"{self.roots.proc}/net/dev")
        if text is None:
            return
        for nic, counters in parse_net_dev(text).items():
            if nic != "lo":
                self._nic(batch, now, nic, counters)

    def _nic(self, batch: _Batch, now: float, nic: str, counters: dict[str, int]) -> None:
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


# ------------------------------------------------------------------------------------ cgroups

# memory.stat keys -> metric; a metric with several keys is their sum (only one form exists on a
# given kernel: 5.9 split workingset_refault into _anon and _file).
_V1_MEMORY_STAT = {
    "mem.rss.container": ("total_rss",),
    "mem.cache.container": ("total_cache",),
    "mem.shmem.container": ("total_shmem",),
    "mem.dirty.container": ("total_dirty",),
    "mem.writeback.container": ("total_writeback",),
    "mem.mapped.container": ("total_mapped_file",),
    "mem.activeanon.container": ("total_active_anon",),
    "mem.inactiveanon.container": ("total_inactive_anon",),
    "mem.activefile.container": ("total_active_file",),
    "mem.inactivefile.container": ("total_inactive_file",),
    "mem.swap.container": ("total_swap",),
    "mem.pgfault.container": ("total_pgfault",),
    "mem.pgmajfault.container": ("total_pgmajfault",),
    "mem.workingsetrefault.container": (
        "total_workingset_refault", "total_workingset_refault_anon", "total_workingset_refault_file",
    ),
    "mem.workingsetrefault.anon.container": ("total_workingset_refault_anon",),
    "mem.workingsetrefault.file.container": ("total_workingset_refault_file",),
}  # fmt: skip

_V2_MEMORY_STAT = {
    "mem.rss.container": ("anon",),
    "mem.cache.container": ("file",),
    "mem.shmem.container": ("shmem",),
    "mem.dirty.container": ("file_dirty",),
    "mem.writeback.container": ("file_writeback",),
    "mem.mapped.container": ("file_mapped",),
    "mem.activeanon.container": ("active_anon",),
    "mem.inactiveanon.container": ("inactive_anon",),
    "mem.activefile.container": ("active_file",),
    "mem.inactivefile.container": ("inactive_file",),
    "mem.pgfault.container": ("pgfault",),
    "mem.pgmajfault.container": ("pgmajfault",),
    "mem.pgsteal.container": ("pgsteal",),
    "mem.pgscan.container": ("pgscan",),
    "mem.kswapdstall.container": ("pgsteal_kswapd",),
    "mem.kswapdscan.container": ("pgscan_kswapd",),
    "mem.directsteal.container": ("pgsteal_direct",),
    "mem.directscan.container": ("pgscan_direct",),
    "mem.workingsetrefault.container": ("workingset_refault", "workingset_refault_anon", "workingset_refault_file"),
    "mem.workingsetrefault.anon.container": ("workingset_refault_anon",),
    "mem.workingsetrefault.file.container": ("workingset_refault_file",),
    "mem.workingsetactivate.container": (
        "workingset_activate", "workingset_activate_anon", "workingset_activate_file",
    ),
}  # fmt: skip

_MEMORY_COUNTERS = frozenset(MEMORY_COUNTERS)

# per-NUMA metric -> cgroup v1 memory.numa_stat key (v2 has no "total": it is anon + file there)
_NUMA_STAT = {
    "mem.total.numa.container": "total",
    "mem.file.numa.container": "file",
    "mem.anon.numa.container": "anon",
}


class CgroupStats(msgspec.Struct):
    """What one cgroup's files gave this round, under container-scope metric names.

    `gauges` are written as they are; `counters` are cumulative values (already scaled to the
    metric's unit per second) whose rate is the metric. The numa maps are keyed by NUMA node.
    """

    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    numa_gauges: dict[int, dict[str, float]] = {}
    numa_counters: dict[int, dict[str, float]] = {}
    pressure: dict[str, str] = {}  # pressure file ("cpu", "memory", "io") -> its text

    def gauge(self, metric: str, value: float | None) -> None:
        """Record a gauge whose file may be missing (None)."""
        if value is not None:
            self.gauges[metric] = value


class CgroupReader:
    """Reads one cgroup's cpu, memory, io and pressure files under a detected layout."""

    def __init__(self, layout: CgroupLayout, page_size: int) -> None:
        self.layout = layout
        self.page_size = page_size

    def read(self, path: str, cpu_nodes: dict[int, int]) -> CgroupStats:
        """`cpu_nodes` maps CPU -> NUMA node, for v1's per-CPU usage."""
        stats = CgroupStats()
        if "cpuacct" in self.layout.v1:
            self._cpu_v1(stats, path, cpu_nodes)
        elif self.layout.unified is not None:
            self._cpu_v2(stats, self.layout.unified + path)
        memory = self.layout.locate("memory", "memory")
        if memory is not None:
            (self._memory_v1 if memory[0] == 1 else self._memory_v2)(stats, memory[1] + path)
        io = self.layout.locate("blkio", "io")
        if io is not None:
            (self._io_v1 if io[0] == 1 else self._io_v2)(stats, io[1] + path)
        if self.layout.unified is not None:
            for resource in PSI_RESOURCES:
                text = read_text(f"{self.layout.unified}{path}/{resource}.pressure")
                if text is not None:
                    stats.pressure[resource] = text
        return stats

    def _cpu_v1(self, stats: CgroupStats, path: str, cpu_nodes: dict[int, int]) -> None:
        text = read_text(f"{self.layout.v1['cpuacct']}{path}/cpuacct.usage_all")
        if text is not None:
            per_cpu = parse_cpuacct_usage_all(text)
            user = sum(u for u, _ in per_cpu.values())
            system = sum(s for _, s in per_cpu.values())
            stats.counters["cpu.usage.container"] = (user + system) / 1e9
            stats.counters["cpu.usage.user.container"] = user / 1e9
            stats.counters["cpu.usage.sys.container"] = system / 1e9
            self._cpu_per_numa(stats, per_cpu, cpu_nodes)
        cpu_dir = self.layout.v1.get("cpu")
        if cpu_dir is None:
            return
        quota = read_int(f"{cpu_dir}{path}/cpu.cfs_quota_us")
        period = read_int(f"{cpu_dir}{path}/cpu.cfs_period_us")
        if quota is not None and period is not None:
            _cpu_limits(stats, quota, period)
        stats.gauge("cpu.share.container", read_int(f"{cpu_dir}{path}/cpu.shares"))
        text = read_text(f"{cpu_dir}{path}/cpu.stat")
        if text is not None:
            cpu_stat = parse_flat_keyed(text)
            throttled = cpu_stat.get("throttled_time")
            _throttling(stats, cpu_stat, None if throttled is None else throttled / 1000)

    def _cpu_per_numa(
        self, stats: CgroupStats, per_cpu: dict[int, tuple[int, int]], cpu_nodes: dict[int, int]
    ) -> None:
        by_node: dict[int, int] = {}
        for cpu, (user, system) in per_cpu.items():
            node = cpu_nodes.get(cpu)
            if node is not None:
                by_node[node] = by_node.get(node, 0) + user + system
        for node, ns in by_node.items():
            stats.numa_gauges.setdefault(node, {})["cpu.usage.count.numa.container"] = ns
            stats.numa_counters.setdefault(node, {})["cpu.usage.numa.container"] = ns / 1e9

    def _cpu_v2(self, stats: CgroupStats, directory: str) -> None:
        # cpu.stat has the usage fields even where the cpu controller is not enabled.
        text = read_text(f"{directory}/cpu.stat")
        if text is not None:
            cpu_stat = parse_flat_keyed(text)
            for metric, key in (
                ("cpu.usage.container", "usage_usec"),
                ("cpu.usage.user.container", "user_usec"),
                ("cpu.usage.sys.container", "system_usec"),
            ):
                if key in cpu_stat:
                    stats.counters[metric] = cpu_stat[key] / 1e6
            _throttling(stats, cpu_stat, cpu_stat.get("throttled_usec"))
        text = read_text(f"{directory}/cpu.max")
        if text is not None:
            cpu_max = parse_cpu_max(text)
            _cpu_limits(stats, cpu_max.quota_us, cpu_max.period_us)
        stats.gauge("cpu.share.container", read_int(f"{directory}/cpu.weight"))

    def _memory_v1(self, stats: CgroupStats, directory: str) -> None:
        self._memory_sizes(stats, directory, "memory.usage_in_bytes", "memory.limit_in_bytes")
        self._memory_stat(stats, directory, _V1_MEMORY_STAT)
        text = read_text(f"{directory}/memory.numa_stat")
        if text is not None:
            numa = parse_numa_stat(text)
            # hierarchical_* include the children (as usage_in_bytes does); old kernels lack them.
            for metric, key in _NUMA_STAT.items():
                for node, pages in (numa.get(f"hierarchical_{key}") or numa.get(key, {})).items():
                    stats.numa_gauges.setdefault(node, {})[metric] = pages * self.page_size

    def _memory_v2(self, stats: CgroupStats, directory: str) -> None:
        self._memory_sizes(stats, directory, "memory.current", "memory.max")
        stats.gauge("mem.swap.container", read_int(f"{directory}/memory.swap.current"))
        self._memory_stat(stats, directory, _V2_MEMORY_STAT)
        text = read_text(f"{directory}/memory.numa_stat")
        if text is not None:
            numa = parse_numa_stat(text)  # already bytes in v2
            anon, file = numa.get("anon", {}), numa.get("file", {})
            for node in anon.keys() | file.keys():
                stats.numa_gauges.setdefault(node, {}).update(
                    {
                        "mem.anon.numa.container": anon.get(node, 0),
                        "mem.file.numa.container": file.get(node, 0),
                        "mem.total.numa.container": anon.get(node, 0) + file.get(node, 0),
                    }
                )

    def _memory_sizes(self, stats: CgroupStats, directory: str, usage_file: str, limit_file: str) -> None:
        stats.gauge("mem.usage.container", read_int(f"{directory}/{usage_file}"))
        limit = read_text(f"{directory}/{limit_file}")
        stats.gauge("mem.limit.container", None if limit is None else parse_memory_limit(limit))

    def _memory_stat(self, stats: CgroupStats, directory: str, table: dict[str, tuple[str, ...]]) -> None:
        text = read_text(f"{directory}/memory.stat")
        if text is None:
            return
        memory_stat = parse_flat_keyed(text)
        for metric, keys in table.items():
            present = [memory_stat[key] for key in keys if key in memory_stat]
            if not present:
                continue
            stats.gauges[metric] = sum(present)
            if metric in _MEMORY_COUNTERS:
                stats.counters[f"{metric}.rate"] = sum(present)

    def _io_v1(self, stats: CgroupStats, directory: str) -> None:
        # The _recursive files include the children, like the memory and cpu numbers do.
        for kind, file in (("bps", "io_service_bytes_recursive"), ("iops", "io_serviced_recursive")):
            text = read_text(f"{directory}/blkio.throttle.{file}")
            if text is None:
                continue
            devices = parse_blkio(text).values()
            stats.counters[f"blkio.read.{kind}.container"] = sum(d.get("Read", 0) for d in devices)
            stats.counters[f"blkio.write.{kind}.container"] = sum(d.get("Write", 0) for d in devices)

    def _io_v2(self, stats: CgroupStats, directory: str) -> None:
        text = read_text(f"{directory}/io.stat")
        if text is None:
            return
        devices = parse_io_stat(text).values()
        for metric, key in (
            ("blkio.read.bps.container", "rbytes"),
            ("blkio.write.bps.container", "wbytes"),
            ("blkio.read.iops.container", "rios"),
            ("blkio.write.iops.container", "wios"),
        ):
            stats.counters[metric] = sum(d.get(key, 0) for d in devices)


def _cpu_limits(stats: CgroupStats, quota_us: int, period_us: int) -> None:
    stats.gauges["cpu.quota.container"] = quota_us
    stats.gauges["cpu.period.container"] = period_us
    if quota_us > 0 and period_us > 0:
        stats.gauges["cpu.limit.container"] = quota_us / period_us


def _throttling(stats: CgroupStats, cpu_stat: dict[str, int], throttled_us: float | None) -> None:
    """Throttle counters: present only where the cpu controller is enabled."""
    for metric, value in (
        ("cpu.nr.throttled.container", cpu_stat.get("nr_throttled")),
        ("cpu.nr.period.container", cpu_stat.get("nr_periods")),
        ("cpu.throttled.time.container", throttled_us),
    ):
        stats.gauge(metric, value)
        if value is not None:
            stats.counters[f"{metric}.rate"] = value


# Scope -> (container-scope name -> the metric's name in that scope). Looking a name up here also
# guarantees the cgroup provisioner only writes metrics that metrics_list lists.
_CONTAINER_METRICS = [m.name for m in METRICS if m.scope in ("container", "container-numa")]
_SCOPE_NAMES = {
    "container": {name: name for name in _CONTAINER_METRICS},
    "cgroup": {name: cgroup_name(name) for name in _CONTAINER_METRICS},
}


class CgroupProvisioner(Provisioner):
    """Kubernetes containers (container scopes) and QoS, standalone-container and configured
    cgroups (cgroup scopes), on cgroup v1, v2 or hybrid hosts.

    `discovery` holds the last successful discovery, for the service layer's pod clean-up
    (`Store.retain_pods(discovery.living_pods())`); it stays None until one succeeds.
    """

    name = "cgroup"

    def __init__(self, roots: Roots = HOST, interval: float = 5.0, cgroup_paths: Sequence[str] = ()) -> None:
        super().__init__(roots, interval)
        self.cgroup_paths = tuple(cgroup_paths)
        self.layout = detect_layout(roots.cgroup)
        self.reader = CgroupReader(self.layout, os.sysconf("SC_PAGE_SIZE"))
        self.discovery: Discovery | None = None

    def _collect(self, batch: _Batch, now: float) -> None:
        discovery = discover(self.layout, self.cgroup_paths)
        self.discovery = discovery
        cpu_nodes = {cpu: node for node, cpus in numa_cpus(self.roots.sys).items() for cpu in cpus}
        for pod in discovery.pods.values():
            for container, path in pod.containers.items():
                self._cgroup(batch, now, path, "container", (pod.uid, container), cpu_nodes)
        for path in discovery.cgroups:
            self._cgroup(batch, now, path, "cgroup", (path,), cpu_nodes)

    def _cgroup(
        self, batch: _Batch, now: float, path: str, scope: str, ids: Ids, cpu_nodes: dict[int, int]
    ) -> None:
        stats = self.reader.read(path, cpu_nodes)
        names = _SCOPE_NAMES[scope]
        rates = self._rates((path,), stats.counters, now)
        limit = stats.gauges.get("cpu.limit.container")
        if limit and rates.get("cpu.usage.container") is not None:
            rates["cpu.usage.ratio.container"] = rates["cpu.usage.container"] / limit
        for metric, value in {**stats.gauges, **rates}.items():
            batch.add(scope, ids, names[metric], value)
        for node in stats.numa_gauges.keys() | stats.numa_counters.keys():
            numa_rates = self._rates((path, node), stats.numa_counters.get(node, {}), now)
            for metric, value in {**stats.numa_gauges.get(node, {}), **numa_rates}.items():
                batch.add(f"{scope}-numa", (*ids, node), names[metric], value)
        for resource, text in stats.pressure.items():
            add_pressure(batch, self._counters, now, scope, ids, resource, text)

    def _rates(self, key: tuple, counters: dict[str, float], now: float) -> dict[str, float | None]:
        return {metric: self._rate((*key, metric), value, now) for metric, value in counters.items()}


PROVISIONERS: tuple[type[Provisioner], ...] = (
    CpuProvisioner,
    MemoryProvisioner,
    PressureProvisioner,
    DiskProvisioner,
    NetworkProvisioner,
    CgroupProvisioner,
)
PROVISIONER_NAMES = tuple(p.name for p in PROVISIONERS)
