"""The metrics contract's vocabulary (DESIGN.md §5): scopes and the ids that name an entity in each,
aggregation kinds, and the value a read answers. The wire Structs (schemas/metrics.py), the store and the
provisioners share it; it reads no kernel file, so a client or the schema export can import it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from schemas.common import Request
from schemas.errors import InvalidArgument

# Scope -> the id keys that name one entity in it, in order. A sample's `ids` is a tuple of these.
SCOPES: dict[str, tuple[str, ...]] = {
    "node": (),
    "numa": ("numa_id",),
    "cpu": ("core_id",),
    "device": ("device",),
    "network": ("nic",),
    "container": ("pod_uid", "container"),
    "container-numa": ("pod_uid", "container", "numa_id"),
    "pod-volume": ("pod_uid", "volume"),
    "cgroup": ("cgroup_path",),
    "cgroup-numa": ("cgroup_path", "numa_id"),
}

# Id keys whose values are integers; every other id is a non-empty string.
INT_IDS = frozenset({"numa_id", "core_id"})

AGGREGATORS = ("sum", "avg")
# aggregate kind -> the scope its inputs come from
KINDS = {"pods": "container", "pods-numa": "container-numa", "cores": "cpu"}
# A cpuset's bounds: ids as high as a `core_id` may be (messages.Index), and at most as many CPUs as
# the largest Linux configuration (NR_CPUS 8192 on x86-64), so that no request expands further.
MAX_CPU_ID = 1_000_000
MAX_CPUSET_CPUS = 8192

# An entity's ids in the order `SCOPES[scope]` names them.
Ids = tuple[str | int, ...]


class MetricValue(msgspec.Struct, frozen=True):
    """A value and the unix time (seconds) of its sample."""

    value: float
    time: float


class PodRef(Request, frozen=True):
    """A pod in an aggregation request: its UID and the containers to add up."""

    uid: Annotated[str, msgspec.Meta(min_length=1)]
    containers: list[Annotated[str, msgspec.Meta(min_length=1)]] = []


def entity_key(scope: str, ids: Mapping[str, Any] | None) -> Ids:
    """The ordered id tuple of an entity, validated: `invalid_argument` names the bad field."""
    if scope not in SCOPES:
        raise InvalidArgument("scope", f"unknown scope {scope!r}; one of {', '.join(SCOPES)}")
    ids = ids or {}
    key = []
    for name in SCOPES[scope]:
        if name not in ids:
            raise InvalidArgument(name, f"required for scope {scope}")
        value = ids[name]
        if name in INT_IDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(name, f"must be a non-negative integer, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise InvalidArgument(name, f"must be a non-empty string, got {value!r}")
        key.append(value)
    return tuple(key)


def ids_dict(scope: str, key: Ids) -> dict[str, str | int]:
    """The wire form of an entity's ids: `{"pod_uid": ..., "container": ...}`."""
    return dict(zip(SCOPES[scope], key))
