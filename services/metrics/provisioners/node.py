"""Node-wide provisioners: CPU usage and load, memory and reclaim, pressure stall information."""

from __future__ import annotations

from schemas.metric_scopes import Ids
from services.metrics.metrics_list import PSI_FIELDS, PSI_RESOURCES, psi_name
from services.metrics.parsers import (
    ProcStat,
    parse_flat_keyed,
    parse_loadavg,
    parse_meminfo,
    parse_pressure,
    parse_proc_stat,
)
from services.metrics.provisioners.base import HOST, Batch, Provisioner, Roots, numa_cpus, read_int, read_text
from services.metrics.rates import Counters, CpuRatios, cpu_ratios

# ---------------------------------------------------------------------------------------- CPU


class CpuProvisioner(Provisioner):
    """Node, per-CPU and per-NUMA CPU usage from /proc/stat; load from /proc/loadavg."""

    name = "cpu"

    def __init__(self, roots: Roots = HOST, interval: float = 5.0) -> None:
        super().__init__(roots, interval)
        # Ratios compare two readings of all columns of a line, so keep the whole previous file.
        self._previous: ProcStat | None = None

    def _collect(self, batch: Batch, now: float) -> None:
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

    def _load(self, batch: Batch) -> None:
        text = read_text(f"{self.roots.proc}/loadavg")
        if text is not None:
            load = parse_loadavg(text)
            batch.add("node", (), "cpu.load.1min.system", load.load1)
            batch.add("node", (), "cpu.load.5min.system", load.load5)
            batch.add("node", (), "cpu.load.15min.system", load.load15)

    def _node_usage(self, batch: Batch, previous: ProcStat, stat: ProcStat) -> None:
        ratios = cpu_ratios(previous.total, stat.total)
        if ratios is None:
            return
        batch.add("node", (), "cpu.usage.system", ratios.usage * len(stat.cpus))
        batch.add("node", (), "cpu.usage.ratio.system", ratios.usage)
        batch.add("node", (), "cpu.usage.ratio.cpu", ratios.usage)
        batch.add("node", (), "cpu.sys.usage.ratio.cpu", ratios.system)

    def _per_cpu(self, batch: Batch, previous: ProcStat, stat: ProcStat) -> dict[int, CpuRatios]:
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

    def _per_numa(self, batch: Batch, ratios: dict[int, CpuRatios]) -> None:
        """A node's usage in cores is the sum of its CPUs' ratios; its averages divide by the CPUs
        that had a ratio this round (katalyst's rule for core aggregates)."""
        for node, cpus in numa_cpus(self.roots.sys).items():
            have = [ratios[cpu] for cpu in cpus if cpu in ratios]
            if not have:
                continue
            usage = sum(ratio.usage for ratio in have)
            batch.add("numa", (node,), "cpu.usage.numa", usage)
            batch.add("numa", (node,), "cpu.usage.numa.avg", usage / len(have))
            batch.add(
                "numa", (node,), "cpu.iowait.ratio.numa.avg", sum(ratio.iowait for ratio in have) / len(have)
            )


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

    def _collect(self, batch: Batch, now: float) -> None:
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

    def _meminfo(self, batch: Batch) -> None:
        text = read_text(f"{self.roots.proc}/meminfo")
        if text is None:
            return
        info = parse_meminfo(text)
        for metric, key in _MEMINFO.items():
            batch.add("node", (), metric, info.get(key))
        if "MemTotal" in info and "MemFree" in info:
            batch.add("node", (), "mem.used.system", info["MemTotal"] - info["MemFree"])

    def _vmstat(self, batch: Batch, now: float) -> None:
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

    def _node_meminfo(self, batch: Batch, node: int) -> None:
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
    batch: Batch, counters: Counters, now: float, scope: str, ids: Ids, resource: str, text: str
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

    def _collect(self, batch: Batch, now: float) -> None:
        for resource in PSI_RESOURCES:
            text = read_text(f"{self.roots.proc}/pressure/{resource}")
            if text is not None:
                add_pressure(batch, self._counters, now, "node", (), resource, text)
