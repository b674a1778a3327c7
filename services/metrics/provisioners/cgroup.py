"""The cgroup provisioner: Kubernetes containers and other cgroups, on cgroup v1, v2 or hybrid hosts.

`CgroupReader` reads one cgroup's files into `CgroupStats` (container-scope metric names);
`CgroupProvisioner` discovers the cgroups each round, turns counters into rates and names the
metrics of each scope.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import msgspec

from schemas.metric_scopes import Ids
from services.metrics.cgroups import CgroupLayout, Discovery, PodCgroups, detect_layout, discover
from services.metrics.metrics_list import MEMORY_COUNTERS, METRICS, PSI_RESOURCES, cgroup_name
from services.metrics.parsers import (
    parse_blkio,
    parse_cpu_max,
    parse_cpuacct_usage_all,
    parse_flat_keyed,
    parse_io_stat,
    parse_memory_limit,
    parse_numa_stat,
)
from services.metrics.provisioners.base import HOST, Batch, Provisioner, Roots, numa_cpus, read_int, read_text
from services.metrics.provisioners.node import add_pressure

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
            user = sum(cpu_user for cpu_user, _ in per_cpu.values())
            system = sum(cpu_system for _, cpu_system in per_cpu.values())
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
            stats.counters[f"blkio.read.{kind}.container"] = sum(device.get("Read", 0) for device in devices)
            stats.counters[f"blkio.write.{kind}.container"] = sum(
                device.get("Write", 0) for device in devices
            )

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
            stats.counters[metric] = sum(device.get(key, 0) for device in devices)


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
_CONTAINER_METRICS = [metric.name for metric in METRICS if metric.scope in ("container", "container-numa")]
_SCOPE_NAMES = {
    "container": {name: name for name in _CONTAINER_METRICS},
    "cgroup": {name: cgroup_name(name) for name in _CONTAINER_METRICS},
}


class CgroupProvisioner(Provisioner):
    """Kubernetes containers (container scopes) and QoS, standalone-container and configured
    cgroups (cgroup scopes), on cgroup v1, v2 or hybrid hosts.

    `discovery` holds the last successful discovery, for the service layer's pod clean-up
    (`Store.retain_pods(discovery.living_pods())`); it stays None until one succeeds. `pods` are
    pods their launcher names (a `berth agent`'s instances, whose cgroups follow no runtime's
    naming): they join every discovery as they are at that moment.
    """

    name = "cgroup"

    def __init__(
        self, roots: Roots = HOST, interval: float = 5.0, cgroup_paths: Sequence[str] = (),
        pods: Mapping[str, PodCgroups] | None = None,
    ) -> None:
        super().__init__(roots, interval)
        self.cgroup_paths = tuple(cgroup_paths)
        self.pods = pods if pods is not None else {}
        self.layout = detect_layout(roots.cgroup)
        self.reader = CgroupReader(self.layout, os.sysconf("SC_PAGE_SIZE"))
        self.discovery: Discovery | None = None

    def _collect(self, batch: Batch, now: float) -> None:
        discovery = discover(self.layout, self.cgroup_paths)
        discovery.pods.update(dict(self.pods))  # a copy in one step: the launcher changes it meanwhile
        self.discovery = discovery
        cpu_nodes = {cpu: node for node, cpus in numa_cpus(self.roots.sys).items() for cpu in cpus}
        for pod in discovery.pods.values():
            for container, path in pod.containers.items():
                self._cgroup(batch, now, path, "container", (pod.uid, container), cpu_nodes)
        for path in discovery.cgroups:
            self._cgroup(batch, now, path, "cgroup", (path,), cpu_nodes)

    def _cgroup(
        self, batch: Batch, now: float, path: str, scope: str, ids: Ids, cpu_nodes: dict[int, int]
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
