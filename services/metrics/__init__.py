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

import importlib

# Names are imported when first used (PEP 562), so that importing any module of the package (the
# wire module, schemas/metrics.py, above all) does not load the kernel reader with it.
_MODULES = {
    "services.metrics.metrics_list": ("METRICS", "MetricInfo"),
    "services.metrics.provisioners": (
        "PROVISIONERS", "CgroupProvisioner", "CpuProvisioner", "DiskProvisioner", "MemoryProvisioner",
        "NetworkProvisioner", "PressureProvisioner", "Provisioner", "Roots",
    ),
    "services.metrics.samples": ("Sample",),
    "services.metrics.errors": ("MetricExpired", "MetricNotFound"),
    "services.metrics.store": ("Store", "StoredMetric"),
    "schemas.metric_scopes": ("SCOPES", "MetricValue", "PodRef"),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


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
