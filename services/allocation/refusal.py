"""Why an allocate or a calculate-deploy could not place: what keeps the instances off each node,
and, over the selection, what a refusal reports (docs/allocation.md, "When an allocate is refused").

Pure and synchronous, like the rest of the calculation core: explain.py reads the nodes again and
hands their records here, and only once a request has been refused, so the placing path never pays
for an explanation. The shape follows kube-scheduler's "0/5000 nodes are available: 3000
Insufficient cpu, ..." and Nomad's allocation metrics (nodes evaluated, exhausted per dimension):

    {"nodes": 6, "unschedulable": 2, "down": 1, "draining": 1, "with_room": 2,
     "lacking": {"cpu": {"nodes": 2, "largest_shortfall": 3.0, "unit": "cores"},
                 "memory": {"nodes": 1, "largest_shortfall": 2147483648, "unit": "bytes"}},
     "fit": 4}

A node *lacks* a resource when its plugin's deploy capacity for the request is below what the
node was wanted for (`need`: one instance when the strategy spreads or packs over a selection,
every instance on a node named alone, `deploy_count` on each node for `each`); the plugin then says
which of its resources fall short and by how much (`ResourcePlugin.shortfalls`). Nodes down or
draining are counted as such and not evaluated further, as kube-scheduler counts an unschedulable
node under that reason only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from schemas.errors import BerthError
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import Shortfall
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import DOWN, DRAINING, NodeRecord

# What one plugin makes of one node state (within one refusal): its capacity and its shortfalls.
Memo = dict[tuple[str, bytes], tuple[int, dict[str, Shortfall]]]

EXPLAINED_CODES = frozenset({"insufficient_capacity", "insufficient_resource", "node_down", "node_draining"})


@dataclass
class Verdict:
    """One node of a refused request: its status when it takes no new workloads (None: it was
    evaluated), how many instances fit on it now, and what it lacks for `need` of them."""

    unschedulable: str | None = None
    fit: int = 0
    lacks: dict[str, Shortfall] = field(default_factory=dict)


def explains(error: BerthError) -> bool:
    """Whether `error` is a refusal for want of room (or of a node that takes workloads): one that
    says why. A label selection that no node takes (`node_not_found` on `labels`) is one too."""
    return error.code in EXPLAINED_CODES or (error.code == "node_not_found" and error.field == "labels")


def judge(
    record: NodeRecord, plugins: PluginSet, requests: Keyed, need: int, *, statuses: bool = True,
    memo: Memo | None = None,
) -> Verdict:
    """What keeps `need` instances of `requests` (keyed by the plugins asked) off the node.
    `statuses`: a node down or draining is only that (a calculate-deploy ignores the status).
    A node without a record of a plugin takes none of its instances: it lacks that plugin wholly
    (`unit: instances`). `memo` shares the work between nodes in the same state."""
    if statuses and not record.schedulable:
        return Verdict(record.status)
    memo = {} if memo is None else memo
    verdict = Verdict(fit=MAX_INT)
    for name, request in requests.items():
        raw = record.raw.get(name)
        if raw is None:
            capacity, short = 0, {name: Shortfall(need, "instances")}
        else:
            key = (name, raw)
            if key not in memo:
                memo[key] = _plugin_verdict(plugins, name, record, request, need)
            capacity, short = memo[key]
        verdict.fit = min(verdict.fit, capacity)
        verdict.lacks.update(short)
    return verdict


def _plugin_verdict(
    plugins: PluginSet, name: str, record: NodeRecord, request: Any, need: int
) -> tuple[int, dict[str, Shortfall]]:
    plugin, state = plugins[name], record.plugins[name]
    capacity = max(plugin.deploy_capacity(state.capacity, state.usage, request).capacity, 0)
    if capacity >= need:
        return capacity, {}
    shortfalls = getattr(plugin, "shortfalls", None)
    short = shortfalls(state.capacity, state.usage, request, need) if shortfalls is not None else {}
    # A plugin that cannot say which of its resources falls short: the instances that do not fit.
    return capacity, short or {name: Shortfall(need - capacity, "instances")}


def summary(verdicts: Iterable[Verdict], need: int, most: int | None = None) -> dict[str, Any]:
    """The selection's counts: `nodes` (those that exist), `unschedulable` (of them `down` and
    `draining`), `with_room` (nodes that take `need` instances), `lacking` (per resource: the nodes
    that lack it, its largest shortfall and unit, by resource name) and `fit` (the instances the
    nodes take now, at most `most` per node)."""
    counts = {"nodes": 0, "unschedulable": 0, DOWN: 0, DRAINING: 0, "with_room": 0}
    lacking: dict[str, dict[str, Any]] = {}
    fit = 0
    for verdict in verdicts:
        counts["nodes"] += 1
        if verdict.unschedulable is not None:
            counts["unschedulable"] += 1
            counts[verdict.unschedulable] = counts.get(verdict.unschedulable, 0) + 1
            continue
        fit = min(fit + (verdict.fit if most is None else min(verdict.fit, most)), MAX_INT)
        counts["with_room"] += verdict.fit >= need
        for resource, short in verdict.lacks.items():
            entry = lacking.setdefault(resource, {"nodes": 0, "largest_shortfall": 0, "unit": short.unit})
            entry["nodes"] += 1
            entry["largest_shortfall"] = max(entry["largest_shortfall"], short.amount)
    return {**counts, "lacking": dict(sorted(lacking.items())), "fit": fit}


def explain(error: BerthError, verdicts: Iterable[Verdict], need: int, most: int | None = None) -> BerthError:
    """`error` with the selection's counts added to its details (its own keys kept as they are)
    and said in words after its message."""
    told = summary(verdicts, need, most)
    refusal = BerthError(
        f"{error.message}; {in_words(told, need)}", code=error.code,
        details={**error.details, **{key: value for key, value in told.items() if key not in error.details}},
    )
    refusal.http_status = error.http_status
    return refusal


def in_words(told: dict[str, Any], need: int) -> str:
    """`2/6 selected nodes have room for 1 instance: 1 down, 1 draining, 2 short of cpu (by up to
    3 cores), 1 short of memory (by up to 2 GiB); 4 instances fit`."""
    nodes, with_room = told["nodes"], told["with_room"]
    head = f"{with_room}/{nodes} selected nodes have room for {amount(need, 'instances')}"  # as kube's "0/5 nodes"
    reasons = [f"{told[status]} {status}" for status in (DOWN, DRAINING) if told.get(status)]
    by_count = sorted(told["lacking"].items(), key=lambda item: (-item[1]["nodes"], item[0]))
    reasons += [
        f"{entry['nodes']} short of {resource} (by up to {amount(entry['largest_shortfall'], entry['unit'])})"
        for resource, entry in by_count
    ]
    why = ", ".join(reasons) if reasons else "none is down, draining or short of a resource"
    return f"{head}: {why}; {amount(told['fit'], 'instances')} {'fits' if told['fit'] == 1 else 'fit'}"


_BINARY = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def amount(value: float, unit: str) -> str:
    """A quantity in words: `1 instance`, `2.5 cores`, `1.5 GiB` (bytes in binary units, exact or to
    three significant digits), `3 selected nodes`."""
    if unit == "bytes":
        for name, size in _BINARY:
            if value >= size:
                return f"{value / size:.3g} {name}" if value % size else f"{int(value // size)} {name}"
    if value == 1 and unit.endswith("s"):
        unit = unit[:-1]
    return f"{value:g} {unit}" if isinstance(value, float) else f"{value} {unit}"
