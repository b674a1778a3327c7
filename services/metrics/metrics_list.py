"""Every metric the provisioners write, with its scope and unit: the data behind docs/reference/metrics.md.

Names follow katalyst-core's `pkg/consts/metric.go` where it has one (node names end in `.system`,
per-CPU names in `.cpu`, NUMA names in `.numa`, container names in `.container`, cgroup names in
`.cgroup`). Names katalyst lacks follow the same pattern. Units: `usage` is an absolute amount
(cores, bytes), `ratio` a fraction in [0, 1]; counters are cumulative since boot (or since the
cgroup was created) and their `.rate` twins are per second.
"""

from __future__ import annotations

import msgspec

from services.metrics.parsers import NET_DEV_FIELDS


class MetricInfo(msgspec.Struct, frozen=True):
    name: str
    scope: str
    unit: str
    description: str


def _rows(scope: str, rows: list[tuple[str, str, str]]) -> list[MetricInfo]:
    return [MetricInfo(name, scope, unit, description) for name, unit, description in rows]


_NODE = [
    ("cpu.total.system", "count", "online CPUs"),
    ("cpu.usage.system", "cores", "CPU time used by the whole node"),
    ("cpu.usage.ratio.system", "ratio", "busy fraction of all CPUs"),
    (
        "cpu.usage.ratio.cpu",
        "ratio",
        "busy fraction of all CPUs (katalyst also writes this name at node scope)",
    ),
    ("cpu.sys.usage.ratio.cpu", "ratio", "fraction of all CPUs' time spent in the kernel"),
    ("cpu.load.1min.system", "count", "1-minute load average"),
    ("cpu.load.5min.system", "count", "5-minute load average"),
    ("cpu.load.15min.system", "count", "15-minute load average"),
    ("procs.running.system", "count", "runnable tasks (/proc/stat procs_running)"),
    ("mem.total.system", "bytes", "MemTotal"),
    ("mem.free.system", "bytes", "MemFree"),
    (
        "mem.used.system",
        "bytes",
        "MemTotal - MemFree (page cache counts as used, as in the kernel's node MemUsed)",
    ),
    ("mem.available.system", "bytes", "MemAvailable"),
    ("mem.shmem.system", "bytes", "Shmem"),
    ("mem.buffer.system", "bytes", "Buffers"),
    ("mem.pagecache.system", "bytes", "Cached (page cache)"),
    ("mem.active.anon.system", "bytes", "Active(anon)"),
    ("mem.inactive.anon.system", "bytes", "Inactive(anon)"),
    ("mem.active.file.system", "bytes", "Active(file)"),
    ("mem.inactive.file.system", "bytes", "Inactive(file)"),
    ("mem.dirty.system", "bytes", "Dirty"),
    ("mem.writeback.system", "bytes", "Writeback"),
    ("mem.swap.total.system", "bytes", "SwapTotal"),
    ("mem.swap.free.system", "bytes", "SwapFree"),
    ("mem.slab.reclaimable.system", "bytes", "SReclaimable"),
    ("mem.scale.factor.system", "count", "vm.watermark_scale_factor (unitless, in 1/10000 of memory)"),
    ("mem.kswapdsteal.system", "pages", "pages reclaimed by kswapd (vmstat pgsteal_kswapd), cumulative"),
    ("mem.direct.pgsteal.system", "pages", "pages reclaimed by direct reclaim (pgsteal_direct), cumulative"),
    ("mem.kswapd.pgscan.system", "pages", "pages scanned by kswapd (pgscan_kswapd), cumulative"),
    ("mem.direct.pgscan.system", "pages", "pages scanned by direct reclaim (pgscan_direct), cumulative"),
    ("mem.compact.stall.system", "count", "direct compaction stalls (compact_stall), cumulative"),
    ("mem.kswapdsteal.delta.system", "pages", "pgsteal_kswapd increase since the previous round"),
    ("mem.direct.pgsteal.delta.system", "pages", "pgsteal_direct increase since the previous round"),
    ("mem.kswapd.pgscan.delta.system", "pages", "pgscan_kswapd increase since the previous round"),
    ("mem.direct.pgscan.delta.system", "pages", "pgscan_direct increase since the previous round"),
]

_CPU = [
    ("cpu.usage.ratio.cpu", "ratio", "busy fraction of the CPU"),
    ("cpu.iowait.ratio.cpu", "ratio", "fraction of the CPU's time idle waiting for IO"),
    ("cpu.sys.usage.ratio.cpu", "ratio", "fraction of the CPU's time spent in the kernel"),
]

_NUMA = [
    ("cpu.usage.numa", "cores", "sum of the busy fractions of the node's CPUs"),
    ("cpu.usage.numa.avg", "ratio", "mean busy fraction of the node's CPUs"),
    ("cpu.iowait.ratio.numa.avg", "ratio", "mean iowait fraction of the node's CPUs"),
    ("mem.total.numa", "bytes", "node MemTotal (may differ from the node totals during memory hot-plug)"),
    ("mem.free.numa", "bytes", "node MemFree"),
    ("mem.used.numa", "bytes", "node MemUsed (MemTotal - MemFree)"),
    ("mem.shmem.numa", "bytes", "node Shmem"),
    ("mem.filepage.numa", "bytes", "node FilePages"),
    ("mem.inactivefile.numa", "bytes", "node Inactive(file)"),
    (
        "mem.available.numa",
        "bytes",
        (
            "MemFree + file LRU + SReclaimable, at most MemTotal: the kernel has no per-node "
            "MemAvailable; this estimate ignores watermarks, so it can exceed what the kernel would report"
        ),
    ),
]

_DEVICE = [
    ("io.read.system", "count", "reads completed, cumulative"),
    ("io.write.system", "count", "writes completed, cumulative"),
    ("io.busy.system", "ms", "time the device had IO in flight (io_ticks), cumulative"),
    ("io.read.ops.system", "ops/s", "reads completed per second"),
    ("io.write.ops.system", "ops/s", "writes completed per second"),
    ("io.read.bps.system", "bytes/s", "bytes read per second"),
    ("io.write.bps.system", "bytes/s", "bytes written per second"),
    ("io.busy.rate.system", "ratio", "fraction of the round the device was busy"),
    ("io.disk.type", "enum", "0 unknown, 1 HDD, 2 SSD, 3 NVMe, 4 VIRTIO"),
    ("io.disk.wbt", "us", "writeback-throttling latency target (queue/wbt_lat_usec), where present"),
]

_NETWORK = [
    *[(f"net.tcp.{field}", "count", f"/proc/net/dev {field.replace('_', ' ')}, cumulative (whole interface)")
      for field in NET_DEV_FIELDS],
    ("net.receive.bps", "bytes/s", "bytes received per second (bytes, despite the name)"),
    ("net.transmit.bps", "bytes/s", "bytes sent per second (bytes, despite the name)"),
    ("net.speed", "Mb/s", "link speed, only when the driver knows it"),
]  # fmt: skip

_CONTAINER = [
    ("cpu.usage.container", "cores", "CPU time used per second"),
    ("cpu.usage.user.container", "cores", "user CPU time used per second"),
    ("cpu.usage.sys.container", "cores", "kernel CPU time used per second"),
    ("cpu.usage.ratio.container", "ratio", "CPU usage / CPU limit; only when a quota is set"),
    ("cpu.limit.container", "cores", "quota / period; only when a quota is set"),
    ("cpu.quota.container", "us", "CFS quota per period, -1 when unlimited"),
    ("cpu.period.container", "us", "CFS period"),
    ("cpu.share.container", "count", "cpu.shares on cgroup v1, cpu.weight on v2"),
    ("cpu.nr.throttled.container", "count", "periods in which the cgroup was throttled, cumulative"),
    ("cpu.nr.period.container", "count", "enforcement periods that elapsed, cumulative"),
    ("cpu.throttled.time.container", "us", "time throttled, cumulative"),
    ("cpu.nr.throttled.container.rate", "1/s", "throttled periods per second"),
    ("cpu.nr.period.container.rate", "1/s", "enforcement periods per second"),
    ("cpu.throttled.time.container.rate", "us/s", "microseconds throttled per second"),
    ("mem.usage.container", "bytes", "memory charged to the cgroup (v1 usage_in_bytes, v2 memory.current)"),
    ("mem.limit.container", "bytes", "memory limit; only when limited"),
    ("mem.swap.container", "bytes", "swap used"),
    ("mem.rss.container", "bytes", "anonymous memory (v1 total_rss, v2 anon)"),
    ("mem.cache.container", "bytes", "page cache (v1 total_cache, v2 file)"),
    ("mem.shmem.container", "bytes", "shared memory"),
    ("mem.dirty.container", "bytes", "dirty page cache"),
    ("mem.writeback.container", "bytes", "page cache under writeback"),
    ("mem.mapped.container", "bytes", "mapped page cache"),
    ("mem.activeanon.container", "bytes", "active anonymous LRU"),
    ("mem.inactiveanon.container", "bytes", "inactive anonymous LRU"),
    ("mem.activefile.container", "bytes", "active file LRU"),
    ("mem.inactivefile.container", "bytes", "inactive file LRU"),
    ("mem.pgfault.container", "count", "page faults, cumulative"),
    ("mem.pgmajfault.container", "count", "major page faults, cumulative"),
    ("mem.pgsteal.container", "pages", "pages reclaimed, cumulative (v2)"),
    ("mem.pgscan.container", "pages", "pages scanned by reclaim, cumulative (v2)"),
    ("mem.kswapdstall.container", "pages", "pages reclaimed by kswapd (katalyst's name for pgsteal_kswapd), cumulative (v2)"),
    ("mem.kswapdscan.container", "pages", "pages scanned by kswapd, cumulative (v2)"),
    ("mem.directsteal.container", "pages", "pages reclaimed by direct reclaim, cumulative (v2)"),
    ("mem.directscan.container", "pages", "pages scanned by direct reclaim, cumulative (v2)"),
    ("mem.workingsetrefault.container", "pages", "refaults of evicted pages, anon + file, cumulative"),
    ("mem.workingsetrefault.anon.container", "pages", "refaults of evicted anonymous pages, cumulative"),
    ("mem.workingsetrefault.file.container", "pages", "refaults of evicted file pages, cumulative"),
    ("mem.workingsetactivate.container", "pages", "refaulted pages activated at once, cumulative (v2)"),
    ("blkio.read.iops.container", "ops/s", "reads per second, all devices"),
    ("blkio.write.iops.container", "ops/s", "writes per second, all devices"),
    ("blkio.read.bps.container", "bytes/s", "bytes read per second, all devices"),
    ("blkio.write.bps.container", "bytes/s", "bytes written per second, all devices"),
]  # fmt: skip

# The memory counters that also get a per-second `.rate` twin, in both cgroup scopes.
MEMORY_COUNTERS = [
    name for name, unit, _ in _CONTAINER if name.startswith("mem.") and unit in ("count", "pages")
]

_CONTAINER_RATES = [
    (f"{name}.rate", "1/s", f"{text.replace(', cumulative', '')}, per second")
    for name, _, text in _CONTAINER
    if name in MEMORY_COUNTERS
]

_CONTAINER_NUMA = [
    ("mem.total.numa.container", "bytes", "memory on the NUMA node (v1 hierarchical_total; v2 anon + file)"),
    ("mem.file.numa.container", "bytes", "page cache on the NUMA node"),
    ("mem.anon.numa.container", "bytes", "anonymous memory on the NUMA node"),
    ("cpu.usage.count.numa.container", "ns", "CPU time on the node's CPUs, cumulative (cgroup v1 only)"),
    ("cpu.usage.numa.container", "cores", "CPU time on the node's CPUs per second (cgroup v1 only)"),
]

# Katalyst's cgroup-scope names differ from the container ones in one place.
_CGROUP_EXCEPTIONS = {
    "cpu.nr.period.container": "cpu.throttled.period.cgroup",
    "cpu.nr.period.container.rate": "cpu.throttled.period.cgroup.rate",
}


def cgroup_name(container_metric: str) -> str:
    """The cgroup-scope name of a container-scope metric (`mem.usage.container` -> `mem.usage.cgroup`)."""
    return _CGROUP_EXCEPTIONS.get(container_metric) or container_metric.replace(".container", ".cgroup")


# Pressure files -> metric prefix (katalyst writes memory as "mem").
PSI_RESOURCES = {"cpu": "cpu", "memory": "mem", "io": "io"}
PSI_FIELDS = ("avg10", "avg60", "avg300", "ratio")
_PSI_KATALYST = {
    "mem.psi.some.avg60.container": "mem.psiavg60.container",
    "mem.psi.some.avg60.cgroup": "mem.psiavg60.cgroup",
}


def psi_name(prefix: str, kind: str, field: str, suffix: str) -> str:
    """`cpu.psi.some.avg10.system`; katalyst's `mem.psiavg60.<container|cgroup>` where it has one."""
    name = f"{prefix}.psi.{kind}.{field}.{suffix}"
    return _PSI_KATALYST.get(name, name)


def _psi_rows(suffix: str) -> list[tuple[str, str, str]]:
    rows = []
    for resource, prefix in PSI_RESOURCES.items():
        for kind in ("some", "full"):
            stalled = f"{resource} pressure, {kind} tasks stalled"
            for field in ("avg10", "avg60", "avg300"):
                rows.append(
                    (psi_name(prefix, kind, field, suffix), "percent", f"{stalled}: kernel {field} average")
                )
            rows.append(
                (psi_name(prefix, kind, "ratio", suffix), "ratio", f"{stalled}: fraction of the round")
            )
    return rows


def _container_and_cgroup(scope: str, rows: list[tuple[str, str, str]]) -> list[MetricInfo]:
    twin = "cgroup-numa" if scope == "container-numa" else "cgroup"
    return _rows(scope, rows) + _rows(twin, [(cgroup_name(name), unit, text) for name, unit, text in rows])


METRICS: tuple[MetricInfo, ...] = (
    *_rows("node", _NODE + _psi_rows("system")),
    *_rows("cpu", _CPU),
    *_rows("numa", _NUMA),
    *_rows("device", _DEVICE),
    *_rows("network", _NETWORK),
    *_container_and_cgroup("container", _CONTAINER + _CONTAINER_RATES),
    *_rows("container", _psi_rows("container")),
    *_rows("cgroup", _psi_rows("cgroup")),
    *_container_and_cgroup("container-numa", _CONTAINER_NUMA),
)

# (scope, name) -> MetricInfo, for look-ups and for the test that every emitted metric is listed.
BY_SCOPE_AND_NAME: dict[tuple[str, str], MetricInfo] = {(m.scope, m.name): m for m in METRICS}
