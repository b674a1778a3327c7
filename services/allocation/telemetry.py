"""The allocation service's Prometheus metrics (the request metrics are `bus.telemetry`'s).

Counted as they happen, in this process:
    berth_allocation_commit_retries_total{reason}   commits that met a changed record and computed again
    berth_allocation_placements_total               instances placed (committed deploys)
    berth_allocation_released_total                 workloads released
    berth_allocation_commit_deploys                 deploys committed together in one commit (histogram)
    berth_allocation_node_status_total{status}      node status changes this worker wrote (down, up, draining)

Read on scrape, for the whole deployment (every allocation worker reports the same figures):
    berth_allocation_nodes                          nodes
    berth_allocation_workloads                      workloads held (the workload index)
    berth_allocation_capacity{plugin,resource}      capacity of all nodes, in base units
    berth_allocation_usage{plugin,resource}         usage of all nodes, in base units

Resources: cpumem `cpu` (cores) and `memory` (bytes); storage `storage` (bytes, volumes
included) and `volumes` (bytes, all volumes together); gpu one resource per product (cards).

The totals are refreshed by a scrape at most every `--metrics-refresh` seconds (`NodeTotals`):
the node names and versions are the worker's directory (kept by change events, no Redis read);
only the nodes whose version moved since the last refresh are read, 500 at a time in the worker's
shared pipeline (one HMGET each: version and plugin states); each plugin state is decoded into the
few numbers the totals need (memoised on its bytes: identical nodes are decoded once), so a scrape
costs little when few nodes changed (docs/benchmarks.md, "Measurements behind the code").
"""

from __future__ import annotations

import msgspec
from prometheus_client import Counter, Histogram

from bus.caches import Memo
from bus.codec import decoder
from bus.telemetry import GaugeTable

COMMIT_RETRIES = Counter(
    "berth_allocation_commit_retries",
    "Commits that found the node changed since it was read (reason version) or a workload they relied on "
    "moved (reason ledger), and computed again.",
    ("reason",),
)
RETRY_VERSION = COMMIT_RETRIES.labels("version")
RETRY_LEDGER = COMMIT_RETRIES.labels("ledger")
PLACEMENTS = Counter("berth_allocation_placements", "Instances placed: workloads committed to nodes by allocate.")
RELEASED = Counter("berth_allocation_released", "Workloads released (their resources returned to their node).")
COMMIT_DEPLOYS = Histogram(
    "berth_allocation_commit_deploys",
    "Deploys (allocate requests' parts for one node) committed together in one commit to a node.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)

NODE_STATUS = Counter(
    "berth_allocation_node_status",
    "Node status changes this worker wrote: down (the agent's lease lapsed), up (its agent is back), draining.",
    ("status",),
)

NODES = GaugeTable("berth_allocation_nodes", "Nodes (every allocation worker reports the same figure).")
WORKLOADS = GaugeTable("berth_allocation_workloads", "Workloads held on nodes (the workload index).")
CAPACITY = GaugeTable(
    "berth_allocation_capacity",
    "Capacity of all nodes per plugin and resource, in base units: cpu in cores, memory, storage and "
    "volumes in bytes, a gpu product in cards.",
    ("plugin", "resource"),
)
USAGE = GaugeTable(
    "berth_allocation_usage",
    "Usage of all nodes per plugin and resource, in the units of berth_allocation_capacity.",
    ("plugin", "resource"),
)


# -- what a plugin state adds to the totals --------------------------------------------------------
# Each decodes a stored plugin state ([capacity, usage], see records.PluginState) into only the
# fields it sums; msgspec skips the rest (core maps, NUMA maps, disks) without building them.


class _CpuMem(msgspec.Struct):
    cpu: float = 0.0
    memory: int = 0


class _Storage(msgspec.Struct):
    storage: int = 0
    volumes: dict[str, int] = {}


class _Gpu(msgspec.Struct):
    prod_count_map: dict[str, int] = {}


def _cpumem(raw: bytes) -> list[tuple[str, float, float]]:
    cap, use = _CPUMEM(raw)
    return [("cpu", cap.cpu, use.cpu), ("memory", cap.memory, use.memory)]


def _storage(raw: bytes) -> list[tuple[str, float, float]]:
    cap, use = _STORAGE(raw)
    return [("storage", cap.storage, use.storage), ("volumes", sum(cap.volumes.values()), sum(use.volumes.values()))]


def _gpu(raw: bytes) -> list[tuple[str, float, float]]:
    cap, use = _GPU(raw)
    return [(p, cards, use.prod_count_map.get(p, 0)) for p, cards in cap.prod_count_map.items()]


_CPUMEM = decoder(tuple[_CpuMem, _CpuMem])
_STORAGE = decoder(tuple[_Storage, _Storage])
_GPU = decoder(tuple[_Gpu, _Gpu])
SUMMARIES = {"cpumem": _cpumem, "storage": _storage, "gpu": _gpu}

SLICE = 500  # records read per round trip
SUMMARY_MEMO_BYTES = 8 << 20


class NodeTotals:
    """The scrape-time figures of one allocation worker (`manager` is its AllocationManager).

    Each node's share of the totals is kept with the version it was read at. A refresh reads again
    only the nodes whose version the worker's directory (kept by change events and the version
    sweep) says is newer: an idle fleet costs no read at all, a busy one a read per changed node.
    """

    def __init__(self, manager) -> None:
        self.manager = manager
        self._nodes: dict[str, tuple[int, list[tuple[str, str, float, float]]]] = {}  # node -> (version, parts)
        # A state's summary, by its bytes: equal nodes are summed without decoding each.
        self._memo: Memo[tuple[str, bytes], list[tuple[str, str, float, float]]] = Memo(
            "allocation totals memo", SUMMARY_MEMO_BYTES, lambda key, parts: 200 + len(key[1]) + 100 * len(parts)
        )

    async def refresh(self) -> None:
        manager, store, fleet = self.manager, self.manager.store, self.manager.fleet
        if fleet.watching:
            await fleet.follow_directory()  # nodes other workers added or removed since
        names = await fleet.all_nodes()
        known = fleet.directory.versions if fleet.watching else {}
        todo = [n for n in names if n not in self._nodes or self._nodes[n][0] < known.get(n, 1 << 62)]
        plugins = [name for name in manager.plugins if name in SUMMARIES]
        for start in range(0, len(todo), SLICE):
            part = todo[start:start + SLICE]
            for node, found in zip(part, await store.plugin_states(part, plugins)):
                if found is None:  # no record, or a removed node's tombstone
                    self._nodes.pop(node, None)
                    continue
                version, states = found
                parts = []
                for plugin, raw in zip(plugins, states):
                    if raw is not None:
                        summary = self._memo.get((plugin, raw))
                        if summary is None:
                            summary = self._memo.put((plugin, raw), [(plugin, *p) for p in SUMMARIES[plugin](raw)])
                        parts += summary
                self._nodes[node] = (int(version), parts)
        for node in self._nodes.keys() - set(names):  # removed
            del self._nodes[node]
        capacity: dict[tuple[str, str], float] = {}
        usage: dict[tuple[str, str], float] = {}
        for name in manager.plugins:  # a plugin without nodes still shows its zeros
            for resource in {"cpumem": ("cpu", "memory"), "storage": ("storage", "volumes")}.get(name, ()):
                capacity[name, resource] = usage[name, resource] = 0.0
        for _, parts in self._nodes.values():
            for plugin, resource, cap, use in parts:
                key = (plugin, resource)
                capacity[key] = capacity.get(key, 0.0) + cap
                usage[key] = usage.get(key, 0.0) + use
        workloads = await store.workload_count()
        NODES.set(len(self._nodes))
        WORKLOADS.set(workloads)
        CAPACITY.replace(capacity)
        USAGE.replace(usage)
