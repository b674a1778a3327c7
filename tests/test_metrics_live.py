"""The provisioners on this machine's real /proc, /sys and cgroup file systems.

Two rounds with half a second of CPU burned in between must give values within sane bounds,
rates on the second round, and only metrics listed in metrics_list. Nothing here measures speed:
what a round costs is a figure `bench/metrics.py` prints (the budget is 2 % of one core at a 1 s
interval).
"""

from __future__ import annotations

import os
import time

import pytest

from services.metrics.metrics_list import BY_SCOPE_AND_NAME
from services.metrics.parsers import parse_cpulist
from services.metrics.provisioners import PROVISIONERS, CgroupProvisioner, Provisioner, Sample

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux procfs")


def own_memory_cgroup() -> str | None:
    """This process's cgroup in the v1 memory hierarchy (or the v2 one), from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        lines = [line.strip().split(":", 2) for line in f if line.strip()]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return path
    return next((path for hierarchy, _, path in lines if hierarchy == "0"), None)


def build() -> list[Provisioner]:
    paths = ["/", *filter(None, [own_memory_cgroup()])]
    return [cls(cgroup_paths=paths) if cls is CgroupProvisioner else cls() for cls in PROVISIONERS]


def sample_all(provisioners: list[Provisioner]) -> list[Sample]:
    now_monotonic, now_unix = time.monotonic(), time.time()
    return [s for p in provisioners for s in p.sample(now_monotonic, now_unix)]


SPIN = 0.5  # CPU seconds this process burns between the two rounds
USER_HZ = os.sysconf("SC_CLK_TCK")  # the unit of /proc/stat's counters


def spin(cpu_seconds: float) -> None:
    """Burn this much CPU time (not wall time: however often we are preempted, the work is done)."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


class Live:
    def __init__(self) -> None:
        self.provisioners = build()
        started = time.monotonic()
        self.first = sample_all(self.provisioners)
        spin(SPIN)
        self.second = sample_all(self.provisioners)
        # At least the time between the two reads of /proc/stat (each round reads after it starts).
        self.outer_window = time.monotonic() - started


@pytest.fixture(scope="module")
def run() -> Live:
    return Live()


@pytest.fixture(scope="module")
def live(run):
    return run.provisioners, run.first, run.second


def values(samples: list[Sample], scope: str, metric: str) -> dict[tuple, float]:
    return {s.ids: s.value for s in samples if s.scope == scope and s.metric == metric}


def node(samples: list[Sample], metric: str) -> float:
    return values(samples, "node", metric)[()]


def online_cpus() -> list[int]:
    with open("/sys/devices/system/cpu/online") as f:
        return parse_cpulist(f.read())


def test_every_metric_is_listed(live):
    _, first, second = live
    assert {(s.scope, s.metric) for s in first + second} - set(BY_SCOPE_AND_NAME) == set()


def test_one_round_is_consistent_in_time(live):
    _, first, second = live
    assert len({s.time for s in first}) == 1 and len({s.time for s in second}) == 1
    assert second[0].time > first[0].time


def test_cpu(live, run):
    _, _, second = live
    cpus = online_cpus()
    assert node(second, "cpu.total.system") == len(cpus)
    per_cpu = values(second, "cpu", "cpu.usage.ratio.cpu")
    assert sorted(ids[0] for ids in per_cpu) == cpus
    for metric in ("cpu.usage.ratio.cpu", "cpu.iowait.ratio.cpu", "cpu.sys.usage.ratio.cpu"):
        assert all(0.0 <= v <= 1.0 for v in values(second, "cpu", metric).values())
    assert 0.0 <= node(second, "cpu.usage.ratio.system") <= 1.0
    usage = node(second, "cpu.usage.system")  # CPUs busy on average between the two rounds
    assert 0 <= usage <= len(cpus)
    # This process alone burned SPIN CPU seconds between the rounds: the busy CPU seconds the round
    # reports cover at least those (to one tick of /proc/stat per CPU and read).
    assert usage * run.outer_window >= SPIN - 2 * len(cpus) / USER_HZ, (usage, run.outer_window)
    assert node(second, "cpu.load.1min.system") >= 0
    assert node(second, "procs.running.system") >= 1


def test_numa(live):
    _, first, second = live
    totals = values(first, "numa", "mem.total.numa")
    assert totals and all(v > 0 for v in totals.values())
    for ids, total in totals.items():
        assert 0 <= values(first, "numa", "mem.free.numa")[ids] <= total
        assert 0 <= values(first, "numa", "mem.available.numa")[ids] <= total
    usage = values(second, "numa", "cpu.usage.numa")
    averages = values(second, "numa", "cpu.usage.numa.avg")
    assert usage and all(0 <= v <= len(online_cpus()) for v in usage.values())
    assert all(0 <= v <= 1 for v in averages.values())
    # the per-node CPU usage adds up to the node's (both are sums of per-CPU ratios)
    assert sum(usage.values()) == pytest.approx(sum(values(second, "cpu", "cpu.usage.ratio.cpu").values()))


def test_memory(live):
    _, first, _ = live
    total = node(first, "mem.total.system")
    assert total > 0
    assert 0 < node(first, "mem.available.system") <= total
    assert 0 <= node(first, "mem.free.system") <= total
    assert node(first, "mem.used.system") == total - node(first, "mem.free.system")
    assert node(first, "mem.kswapdsteal.system") >= 0


def test_second_round_gives_rates(live):
    _, first, second = live
    assert not values(first, "cpu", "cpu.usage.ratio.cpu")
    nics = values(second, "network", "net.tcp.receive_bytes")
    assert nics and set(values(second, "network", "net.receive.bps")) == set(nics)
    assert all(v >= 0 for v in values(second, "network", "net.transmit.bps").values())
    disks = values(second, "device", "io.read.system")
    assert set(values(second, "device", "io.read.ops.system")) == set(disks)
    assert all(0 <= v <= 1 for v in values(second, "device", "io.busy.rate.system").values())
    assert all(v in (0, 1, 2, 3, 4) for v in values(second, "device", "io.disk.type").values())
    assert "mem.kswapdsteal.delta.system" in {s.metric for s in second}


def test_pressure(live):
    _, _, second = live
    if not os.path.exists("/proc/pressure/cpu"):
        pytest.skip("no PSI on this kernel")
    assert 0 <= node(second, "cpu.psi.some.ratio.system") <= 1
    assert 0 <= node(second, "mem.psi.some.avg10.system") <= 100


def expected_layout() -> str:
    """v1, v2 or hybrid, from the mount table (an independent check of detect_layout)."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    v1 = any(kind == "cgroup" and point.startswith("/sys/fs/cgroup/") for point, kind in mounts)
    v2 = [point for point, kind in mounts if kind == "cgroup2" and point.startswith("/sys/fs/cgroup")]
    if v1 and v2:
        return "hybrid"
    return "v1" if v1 else "v2" if v2 else "none"


def test_cgroups(live):
    provisioners, _, second = live
    cgroup = next(p for p in provisioners if isinstance(p, CgroupProvisioner))
    assert cgroup.layout.mode == expected_layout()
    assert cgroup.discovery is not None and "/" in cgroup.discovery.cgroups
    usage = values(second, "cgroup", "mem.usage.cgroup")
    assert all(v > 0 for v in usage.values())
    own = own_memory_cgroup()
    if own is not None:
        assert usage.get((own,), 0) > 0
    root_cpu = values(second, "cgroup", "cpu.usage.cgroup").get(("/",))
    assert root_cpu is not None and 0 <= root_cpu <= len(online_cpus()) * 1.05
    for ids, value in values(second, "cgroup-numa", "mem.total.numa.cgroup").items():
        assert value >= 0 and isinstance(ids[1], int)
