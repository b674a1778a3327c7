"""Requests, replies and events of the metrics service (DESIGN.md §5 and §8, "Metrics").

Every command answers on `<prefix>.metrics.<node>.<command>`. An entity is named by the id keys its
scope needs (`SCOPES` in metric_scopes.py: `pod_uid` and `container` for the container scope, ...);
ids a scope does not need are ignored. Types are strict: msgspec rejects a string where a number
belongs, a null, a negative id, an unknown scope, kind or aggregator, and names the field. Finite
numbers (no NaN, no infinity) are checked by the store, which names the field too. `MetricValue`
(the reply of `get`, `aggregate` and `put`) and `PodRef` (a pod in `aggregate`) are defined in
metric_scopes.py, beside the scopes, as the store returns and takes them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType, field

from schemas.common import Request
from schemas.errors import InvalidArgument
from schemas.metric_scopes import AGGREGATORS, KINDS, MAX_CPU_ID, SCOPES, Ids, PodRef, entity_key
from schemas.patterns import END, matching
from schemas.subjects import DOTTED_NAME_REGEX, MAX_SUBJECT_BYTES, escape_token

Scope = Literal[
    "node", "numa", "cpu", "device", "network", "container", "container-numa", "pod-volume", "cgroup",
    "cgroup-numa",
]  # fmt: skip
Kind = Literal["pods", "pods-numa", "cores"]
Aggregator = Literal["sum", "avg"]
assert set(Scope.__args__) == set(SCOPES) and set(Kind.__args__) == set(KINDS)
assert set(Aggregator.__args__) == set(AGGREGATORS)

# Metric names become subject tokens (one per dot-separated part), so each part is a plain name.
Metric = matching(DOTTED_NAME_REGEX, "names of letters, digits, '_' and '-', joined by '.'", max_length=255)
Index = Annotated[int, Meta(ge=0, le=MAX_CPU_ID)]
MAX_ID_LENGTH = 1024  # characters of a string id (device, nic, pod_uid, container, volume, cgroup_path)
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH)]
NotifierKey = matching(rf"^[0-9a-f]{{32}}{END}", "32 lower-case hexadecimal digits")
LeaseSeconds = Annotated[float, Meta(ge=1, le=3600)]
RequestId = Annotated[str, Meta(min_length=1, max_length=200)]

# Lists are paged so that no reply comes near NATS's maximum payload (1 MB by default).
MAX_LIST_LIMIT = 2000


class EntityIds(Struct, kw_only=True):
    """The id keys of every scope; each message carries those its scope needs."""

    numa_id: Index | UnsetType = UNSET
    core_id: Index | UnsetType = UNSET
    device: Id | UnsetType = UNSET
    nic: Id | UnsetType = UNSET
    pod_uid: Id | UnsetType = UNSET
    container: Id | UnsetType = UNSET
    volume: Id | UnsetType = UNSET
    cgroup_path: Id | UnsetType = UNSET

    def ids(self) -> dict[str, Any]:
        """The ids that were given, as the store takes them."""
        return {name: getattr(self, name) for name in ID_KEYS if getattr(self, name) is not UNSET}


ID_KEYS = tuple(EntityIds.__struct_fields__)
assert set(ID_KEYS) == {name for names in SCOPES.values() for name in names}


class MetricRef(EntityIds, kw_only=True):
    """One metric of one entity."""

    scope: Scope
    metric: Metric

    def entity(self) -> Ids:
        """The entity's id tuple; `invalid_argument` names an id the scope needs but lacks."""
        return entity_key(self.scope, self.ids())


# -- commands ---------------------------------------------------------------------------------


class Get(MetricRef, Request, kw_only=True):
    """`get`: the latest value of a metric."""


class Aggregate(Request, kw_only=True):
    """`aggregate`: sum or average over pods' containers, their containers on one NUMA node, or a cpuset."""

    kind: Kind
    agg: Aggregator
    metric: Metric
    pods: list[PodRef] = []
    numa_id: Index | UnsetType = UNSET  # kind pods-numa
    cpuset: Annotated[str, Meta(max_length=65536)] | UnsetType = UNSET  # kind cores, e.g. "0-3,8"


class Put(MetricRef, Request, kw_only=True):
    """`put`: store an external metric; without `time` the sample time is now.

    With `request_id`, a retry replays the first answer (the same sample time) instead of storing
    the value again; every agent of the node keeps its own answers (`put` reaches all of them), and
    without `time` they all take the sample time the first of them took (`PutTimes`)."""

    value: float
    time: float | UnsetType = UNSET
    ttl_seconds: float | UnsetType = UNSET
    request_id: RequestId | UnsetType = UNSET


class RegisterNotifier(MetricRef, Request, kw_only=True):
    """`register-notifier`: publish this metric's new samples as events while the lease lives."""

    lease_seconds: LeaseSeconds | UnsetType = UNSET
    request_id: RequestId | UnsetType = UNSET


class Lease(Struct):
    """A notifier registration: renew it within `lease_seconds` or it ends."""

    key: str
    lease_seconds: float


class NotifierRequest(Request):
    """`renew-notifier` and `deregister-notifier`; a retry with the same `request_id` replays the
    first answer (a renewal is not restarted again, a deregistration still says `removed`)."""

    key: NotifierKey
    request_id: RequestId | UnsetType = UNSET


class Deregistered(Struct):
    removed: bool  # False: the key was unknown or its lease had already ended


class Synced(Struct):
    """`has-synced`: true once the first round of every provisioner ran, even if some failed."""

    synced: bool
    failed: list[str]
    interval_seconds: float


class ListMetrics(Request, kw_only=True):
    """`list`: what is stored, ordered by scope, ids and metric, a page at a time."""

    scope: Scope | UnsetType = UNSET
    offset: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_LIST_LIMIT)] = 1000


class Entry(MetricRef, kw_only=True):
    value: float
    time: float


class Entries(Struct):
    entries: list[Entry]
    total: int  # entries in the whole listing, for paging


# -- events -----------------------------------------------------------------------------------


class MetricEvent(MetricRef, kw_only=True):
    """A new sample of a registered metric. `time` is when it was published, `sample_time` when
    it was sampled (the same for every metric of one provisioner round)."""

    type: str = "metric"
    time: float = field(default_factory=time.time)
    value: float
    sample_time: float


EVENT_PATTERN = "metrics.<node>.<scope>[.<id>...].<metric tokens>"


def event_subject(prefix: str, node: str, ref: MetricRef) -> str:
    """`<prefix>.events.metrics.<node>.<scope>[.<id>...].<metric>`, ids escaped to one token each."""
    ids = [escape_token(str(value)) for value in ref.entity()]
    return ".".join([prefix, "events", "metrics", node, ref.scope, *ids, ref.metric])


def checked_subject(prefix: str, node: str, ref: MetricRef) -> str:
    """`event_subject`, refused (naming the longest id) when over `MAX_SUBJECT_BYTES`: ids are escaped,
    so an id within `MAX_ID_LENGTH` may still make too long a subject."""
    subject = event_subject(prefix, node, ref)
    size = len(subject.encode())
    if size > MAX_SUBJECT_BYTES:
        ids = ref.ids()
        field = max(ids, key=lambda name: len(str(ids[name]))) if ids else "metric"
        raise InvalidArgument(
            field, f"the event subject would take {size} bytes (ids escaped), over {MAX_SUBJECT_BYTES}: "
            "use shorter ids", limit=MAX_SUBJECT_BYTES,
        )
    return subject
