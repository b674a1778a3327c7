"""The latest value of every metric, keyed by scope, entity ids and metric name.

Like katalyst's MetricStore it keeps no history: each write replaces the value and its sample
time. Reads tell a missing entity (pod, container, CPU, ...) from a missing metric, and can flag
stale data; aggregations over pods and cpusets follow katalyst's divisor rules. Values written with
`put` (external metrics) belong to their writer: pod and cgroup clean-up never removes them, only
their optional TTL does.

All methods are thread-safe, so provisioners may write from a worker thread while the service
layer reads on its event loop.
"""

from __future__ import annotations

import math
import threading
import time as _time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from schemas.errors import InvalidArgument
from schemas.metric_scopes import (
    AGGREGATORS,
    KINDS,
    MAX_CPU_ID,
    MAX_CPUSET_CPUS,
    SCOPES,
    Ids,
    MetricValue,
    PodRef,
    entity_key,
    ids_dict,
)
from services.metrics.errors import MetricExpired, MetricNotFound
from services.metrics.parsers import parse_cpulist
from services.metrics.samples import Sample

# Katalyst clamps a non-zero insurance period up to a minute.
MIN_INSURANCE_SECONDS = 60.0


# id key -> the entity it names, for "which entity is missing" errors
_ENTITY_NAMES = {
    "numa_id": "numa",
    "core_id": "cpu",
    "device": "device",
    "nic": "nic",
    "pod_uid": "pod",
    "container": "container",
    "volume": "volume",
    "cgroup_path": "cgroup",
}
_POD_SCOPES = ("container", "container-numa", "pod-volume")


class StoredMetric(msgspec.Struct):
    """One stored value, as `list` returns it (the `list` reply flattens `ids` into each entry)."""

    scope: str
    metric: str
    ids: dict[str, str | int]
    value: float
    time: float


class _Slot(msgspec.Struct, gc=False):
    value: float
    time: float
    expires: float | None = None  # unix seconds, only for put with a TTL
    external: bool = False  # written with put: clean-up leaves it alone


def _check_metric(metric: object) -> str:
    if not isinstance(metric, str) or not metric:
        raise InvalidArgument("metric", f"must be a non-empty string, got {metric!r}")
    return metric


def _check_number(field: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise InvalidArgument(field, f"must be positive, got {value}")
    return float(value)


class Store:
    """In-memory metric store. `insurance_seconds` > 0 turns on the staleness check of `get`."""

    def __init__(self, insurance_seconds: float = 0.0, clock: Callable[[], float] = _time.time) -> None:
        if not math.isfinite(insurance_seconds) or insurance_seconds < 0:
            raise ValueError(f"insurance_seconds must be >= 0, got {insurance_seconds}")
        self.insurance_seconds = max(insurance_seconds, MIN_INSURANCE_SECONDS) if insurance_seconds else 0.0
        self._clock = clock
        self._lock = threading.Lock()
        # scope -> entity ids -> metric -> slot
        self._scopes: dict[str, dict[Ids, dict[str, _Slot]]] = {scope: {} for scope in SCOPES}

    def now(self) -> float:
        """The store's unix time, the sample time of a put without one."""
        return self._clock()

    # ------------------------------------------------------------------------------ writes

    def write(self, samples: Iterable[Sample]) -> None:
        """Store a provisioner round (samples are trusted: they come from this process)."""
        with self._lock:
            for s in samples:
                self._scopes[s.scope].setdefault(s.ids, {})[s.metric] = _Slot(s.value, s.time)

    def put(
        self,
        scope: str,
        metric: str,
        value: float,
        ids: Mapping[str, Any] | None = None,
        time: float | None = None,
        ttl_seconds: float | None = None,
    ) -> MetricValue:
        """Store an external metric. Without `time` the sample time is now; with `ttl_seconds`
        the value disappears that long after the put."""
        key = entity_key(scope, ids)
        _check_metric(metric)
        value = _check_number("value", value)
        now = self._clock()
        sample_time = now if time is None else _check_number("time", time)
        if sample_time < 0:
            raise InvalidArgument("time", f"must not be negative, got {sample_time}")
        expires = (
            None if ttl_seconds is None else now + _check_number("ttl_seconds", ttl_seconds, positive=True)
        )
        with self._lock:
            self._scopes[scope].setdefault(key, {})[metric] = _Slot(
                value, sample_time, expires, external=True
            )
        return MetricValue(value, sample_time)

    # ------------------------------------------------------------------------------- reads

    def get(self, scope: str, metric: str, ids: Mapping[str, Any] | None = None) -> MetricValue:
        """The latest value, or `metric_not_found` saying whether the entity or the metric is
        missing, or `metric_expired` (carrying the value) when it is older than the insurance."""
        key = entity_key(scope, ids)
        _check_metric(metric)
        now = self._clock()
        with self._lock:
            entities = self._scopes[scope]
            slot = self._live_slot(entities, key, metric, now)
            if slot is None:
                raise self._not_found(entities, scope, key, metric)
        data = MetricValue(slot.value, slot.time)
        # A zero (epoch) time means "no time": never stale, as in katalyst.
        if self.insurance_seconds and 0 < data.time < now - self.insurance_seconds:
            details = {"scope": scope, "metric": metric, **ids_dict(scope, key)}
            raise MetricExpired(
                f"{metric} in scope {scope} is older than {self.insurance_seconds:g} s", data, details
            )
        return data

    def latest(self, scope: str, key: Ids, metric: str) -> MetricValue | None:
        """The stored value or None, for an already validated entity key and without the staleness
        check: the notifier's look-up, made for every registration after every round."""
        with self._lock:
            slot = self._live_slot(self._scopes[scope], key, metric, self._clock())
        return None if slot is None else MetricValue(slot.value, slot.time)

    def list(self, scope: str | None = None) -> list[StoredMetric]:
        """Every stored value (of one scope, if given), ordered by scope, ids and metric."""
        if scope is not None and scope not in SCOPES:
            raise InvalidArgument("scope", f"unknown scope {scope!r}; one of {', '.join(SCOPES)}")
        now = self._clock()
        entries = []
        with self._lock:
            for name in [scope] if scope else SCOPES:
                entities = self._scopes[name]
                for key in sorted(entities):
                    for metric in sorted(entities[key]):
                        slot = self._live_slot(entities, key, metric, now)
                        if slot is not None:
                            ids = ids_dict(name, key)
                            entries.append(StoredMetric(name, metric, ids, slot.value, slot.time))
        return entries

    def aggregate(
        self,
        kind: str,
        agg: str,
        metric: str,
        pods: Sequence[PodRef] = (),
        numa_id: int | None = None,
        cpuset: str | Sequence[int] | None = None,
    ) -> MetricValue:
        """Sum or average a metric over pods' containers (`pods`), their containers on one NUMA
        node (`pods-numa`), or the CPUs of a cpuset (`cores`).

        Katalyst's rules: a pod listed twice counts once; missing values are skipped; `avg`
        divides by the pods (or CPUs) that had a value; nothing found gives 0. The time is the
        newest sample time, and at least now; no staleness check is made.
        """
        if kind not in KINDS:
            raise InvalidArgument("kind", f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        if agg not in AGGREGATORS:
            raise InvalidArgument("agg", f"unknown aggregator {agg!r}; one of sum, avg")
        _check_metric(metric)
        if kind == "cores":
            groups = [(cpu, [(cpu,)]) for cpu in _parse_cpuset(cpuset)]
        else:
            groups = _pod_groups(pods, () if kind == "pods" else (_check_numa_id(numa_id),))
        now = self._clock()
        total, newest = 0.0, now
        counted: set[str | int] = set()  # pods (or CPUs) that contributed a value
        with self._lock:
            entities = self._scopes[KINDS[kind]]
            for member, keys in groups:
                if member in counted:
                    continue
                found = [
                    s for s in (self._live_slot(entities, k, metric, now) for k in keys) if s is not None
                ]
                if found:
                    total += sum(s.value for s in found)
                    counted.add(member)
                    newest = max(newest, *(s.time for s in found))
        if agg == "avg":
            total = total / len(counted) if counted else 0.0
        return MetricValue(total, newest)

    # ---------------------------------------------------------------------------- clean-up

    def retain_pods(self, living: Mapping[str, Collection[str]]) -> int:
        """Forget pods (and containers) that are gone: `living` maps each living pod's UID to
        its living containers. Removes their container, container-NUMA and pod-volume values,
        except those written with `put`. Call it only with a listing that succeeded: an empty
        map removes every pod. Returns the number of values removed."""

        def dead(scope: str, key: Ids) -> bool:
            containers = living.get(key[0])
            return containers is None or (scope != "pod-volume" and key[1] not in containers)

        return self._remove(_POD_SCOPES, dead)

    def retain_cgroups(self, living: Collection[str]) -> int:
        """Forget cgroup and cgroup-NUMA values of paths not in `living` (except `put` ones)."""
        return self._remove(("cgroup", "cgroup-numa"), lambda scope, key: key[0] not in living)

    # ----------------------------------------------------------------------------- helpers

    def _remove(self, scopes: Iterable[str], dead: Callable[[str, Ids], bool]) -> int:
        removed = 0
        with self._lock:
            for scope in scopes:
                entities = self._scopes[scope]
                for key in [k for k in entities if dead(scope, k)]:
                    metrics = entities[key]
                    kept = {m: slot for m, slot in metrics.items() if slot.external}
                    removed += len(metrics) - len(kept)
                    if kept:
                        entities[key] = kept
                    else:
                        del entities[key]
        return removed

    @staticmethod
    def _live_slot(entities: dict[Ids, dict[str, _Slot]], key: Ids, metric: str, now: float) -> _Slot | None:
        """The slot, or None; a put whose TTL has passed is deleted on the way (caller holds the lock)."""
        metrics = entities.get(key)
        slot = None if metrics is None else metrics.get(metric)
        if slot is None or slot.expires is None or slot.expires > now:
            return slot
        del metrics[metric]
        if not metrics:
            del entities[key]
        return None

    @staticmethod
    def _not_found(
        entities: dict[Ids, dict[str, _Slot]], scope: str, key: Ids, metric: str
    ) -> MetricNotFound:
        """Name the first id level nothing is stored under (the pod before its container), else
        the metric. The node always exists, so node lookups only miss metrics."""
        details: dict[str, Any] = {"scope": scope, "metric": metric, **ids_dict(scope, key)}
        names = SCOPES[scope]
        for level in range(len(key)):
            prefix = key[: level + 1]
            if not any(k[: level + 1] == prefix for k in entities):
                entity = _ENTITY_NAMES[names[level]]
                message = f"{entity} {key[level]!r} has no metrics in scope {scope}"
                return MetricNotFound(message, details={"missing": "entity", "entity": entity, **details})
        where = ", ".join(f"{name}={value!r}" for name, value in zip(names, key))
        message = f"metric {metric!r} not found in scope {scope}" + (f" for {where}" if where else "")
        return MetricNotFound(message, details={"missing": "metric", **details})


def _parse_cpuset(cpuset: str | Sequence[int] | None) -> list[int]:
    if cpuset is None:
        raise InvalidArgument("cpuset", "required for kind cores")
    if isinstance(cpuset, str):
        try:
            return parse_cpulist(cpuset, max_id=MAX_CPU_ID, max_cpus=MAX_CPUSET_CPUS)
        except ValueError as error:
            raise InvalidArgument("cpuset", f"{cpuset[:100]!r} is not a CPU list like '0-3,8': {error}") from None
    cpus = list(cpuset)
    for cpu in cpus:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise InvalidArgument("cpuset", f"CPU ids must be non-negative integers, got {cpu!r}")
    return sorted(set(cpus))


def _check_numa_id(numa_id: object) -> int:
    if isinstance(numa_id, bool) or not isinstance(numa_id, int) or numa_id < 0:
        raise InvalidArgument("numa_id", f"kind pods-numa needs a non-negative integer, got {numa_id!r}")
    return numa_id


def _pod_groups(pods: Sequence[PodRef], numa: tuple[int, ...]) -> list[tuple[str, list[Ids]]]:
    """(pod uid, the entity keys of its containers) per listed pod, in order.

    A pod listed twice appears twice: as in katalyst, a later listing is skipped only once an
    earlier one contributed a value. A container named twice in one listing counts once.
    """
    groups = []
    for pod in pods:
        if not isinstance(pod.uid, str) or not pod.uid:
            raise InvalidArgument("pods", f"every pod needs a non-empty uid, got {pod.uid!r}")
        groups.append((pod.uid, [(pod.uid, name, *numa) for name in dict.fromkeys(pod.containers)]))
    return groups
