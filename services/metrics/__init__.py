"""The metrics service's kernel-reading core (DESIGN.md §5): provisioners that read /proc, /sys and
the cgroup file systems, and the store that keeps the latest value of every metric.

A service loop looks like:

    store = Store(insurance_seconds=0)
    provisioners = [cls(Roots(), interval=5.0) for cls in PROVISIONERS]
    for p in provisioners:                      # each on its own interval after the first round
        store.write(p.sample(time.monotonic(), time.time()))
        if isinstance(p, CgroupProvisioner) and p.discovery is not None:
            store.retain_pods(p.discovery.living_pods())
            store.retain_cgroups(p.discovery.cgroups)
"""

from services.metrics.errors import MetricExpired, MetricNotFound
from services.metrics.metrics_list import METRICS, SCOPES, MetricInfo
from services.metrics.provisioners import (
    PROVISIONERS,
    CgroupProvisioner,
    CpuProvisioner,
    DiskProvisioner,
    MemoryProvisioner,
    NetworkProvisioner,
    PressureProvisioner,
    Provisioner,
    Roots,
    Sample,
)
from services.metrics.store import MetricValue, PodRef, Store, StoredMetric

__all__ = [
    "METRICS",
    "PROVISIONERS",
    "SCOPES",
    "CgroupProvisioner",
    "CpuProvisioner",
    "DiskProvisioner",
    "MemoryProvisioner",
    "MetricExpired",
    "MetricInfo",
    "MetricNotFound",
    "MetricValue",
    "NetworkProvisioner",
    "PodRef",
    "PressureProvisioner",
    "Provisioner",
    "Roots",
    "Sample",
    "Store",
    "StoredMetric",
]
