"""The pure calculation interface every resource plugin implements (eru's resource plugin, §1.2).

Everything here is synchronous, deterministic and free of I/O: the service layer loads a node's
record from Redis, calls one of these methods, and commits the result with a Lua script that
re-checks the record's version. Values cross this boundary in their wire shape (plain maps of
MessagePack builtins, keys as in DESIGN.md §3) so the service layer can stay plugin-agnostic;
each plugin decodes them into its own typed Structs and raises `schemas.errors.BerthError`
subclasses naming the field at fault.

`capacity` and `usage` are a node's stored NodeResource maps for this plugin.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import msgspec

from bus.codec import split_field
from schemas.errors import BerthError

Raw = dict[str, Any]


class EngineInfo(msgspec.Struct, forbid_unknown_fields=False):
    """Node-level facts an engine reports at add-node (DESIGN.md §8)."""

    ncpu: int = 0
    memory_total: int = 0
    storage_total: int = 0
    resources: dict[str, Raw] = {}


class DeployCapacity(msgspec.Struct):
    """How many more instances of a request fit on a node, and what one instance weighs there."""

    capacity: int
    usage: float
    rate: float
    weight: float


class Shortfall(msgspec.Struct, frozen=True):
    """How much of one resource a node misses for a deploy, in the resource's own `unit` (`cores`,
    `bytes`, `cards`): what the instances ask for of it, less what the node has free of it; where
    the node has enough free in all but not in the shape asked (cores split into fragments or over
    NUMA nodes, a volume per device, IO quota), what the instances that do not fit ask for."""

    amount: int | float
    unit: str


class ResourcePlugin(Protocol):
    name: str
    # Most-idle priority: the highest-priority plugin decides the most idle node (cpumem/gpu 100, storage 1).
    priority: int

    def add_node(self, resource: Raw | None, info: EngineInfo | None) -> tuple[Raw, Raw]:
        """(capacity, usage) of a new node from its node request, else from engine info, else empty."""

    def validate_record(self, capacity: Raw, usage: Raw) -> None:
        """Reject a record a client gives to be stored (set-node-resource-info), unknown keys included."""

    def check_workload_keys(self, workload: Raw | None, field: str) -> None:
        """Refuse a key of a client's workload resource that the plugin does not read (DESIGN.md §8)."""

    def calculate_deploy(
        self, capacity: Raw, usage: Raw, deploy_count: int, request: Raw | None
    ) -> tuple[list[Raw], list[Raw]]:
        """(engines_params, workloads_resource), one of each per instance; a shortfall raises the plugin's
        insufficient_* error (eru's split, DESIGN.md §8)."""

    def engine_params(self, workload_resource: Raw) -> Raw:
        """The engine params of an instance deployed with `workload_resource` (as calculate_deploy
        gave them beside it): an answer rebuilt from the ledger has the same ones."""

    def calculate_realloc(
        self, capacity: Raw, usage: Raw, workload_resource: Raw, request: Raw | None
    ) -> tuple[Raw, Raw, Raw]:
        """(engine_params, delta_resource, workload_resource) for a delta request."""

    def calculate_remap(self, capacity: Raw, usage: Raw, workloads: dict[str, Raw]) -> dict[str, Raw]:
        """workload id -> new engine params, for the workloads whose binding changes."""

    def deploy_capacity(self, capacity: Raw, usage: Raw, request: Raw | None) -> DeployCapacity: ...

    def shortfalls(self, capacity: Raw, usage: Raw, request: Raw | None, count: int) -> dict[str, Shortfall]:
        """Which of the plugin's resources (`cpu`, `memory`, `storage`, `volumes`, `gpu`...) keep
        `count` instances of `request` off the node, and by how much; {} when they fit. Asked only
        to explain a refusal (services/allocation/refusal.py), never on the placing path."""

    def set_capacity(
        self, capacity: Raw, usage: Raw, resource: Raw | None, request: Raw | None, delta: bool, incr: bool
    ) -> tuple[Raw, Raw]:
        """New (capacity, usage): capacity changes may add zero usage for new cores or drop empty ones."""

    def set_usage(
        self,
        capacity: Raw,
        usage: Raw,
        resource: Raw | None,
        request: Raw | None,
        workloads: list[Raw],
        delta: bool,
        incr: bool,
    ) -> Raw:
        """New usage after the delta/incr matrix with source priority request > resource > workloads."""

    def apply_workloads(self, usage: Raw, workloads: list[Raw], incr: bool) -> Raw:
        """Usage with the workload resources added (incr) or returned (not incr); used by commit and release."""

    def usage_from_workloads(self, capacity: Raw, workloads: list[Raw]) -> Raw:
        """The usage the given workloads explain (fix-node-resource, ledger repair)."""

    def diffs(self, capacity: Raw, usage: Raw, workloads: list[Raw]) -> list[str]:
        """Human-readable differences between stored usage and what the workloads explain, in eru's order."""

    def load(self, capacity: Raw, usage: Raw) -> float:
        """How busy a node is for get-most-idle-node (eru §2.14): the smallest load is the most idle."""

    def metrics_description(self) -> list[Raw]: ...

    def metrics(self, podname: str, nodename: str, capacity: Raw, usage: Raw) -> list[Raw]: ...


class NamingPlugin:
    """A plugin whose errors say which plugin raised them (`details.plugin`), so that a reply at
    manager level can name a field by its whole path (see `keyed_field`)."""

    def __init__(self, plugin: ResourcePlugin) -> None:
        self._plugin = plugin
        self.name = plugin.name
        self.priority = plugin.priority

    def __getattr__(self, attribute: str) -> Any:
        method = getattr(self._plugin, attribute)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except BerthError as error:
                error.details.setdefault("plugin", self.name)
                raise

        setattr(self, attribute, call)  # wrapped once, then found without __getattr__
        return call


# The request keys whose value a manager-level request keys by plugin (DESIGN.md §8).
KEYED_KEYS = frozenset({
    "workload_resource_request", "workload_resource", "workloads_resource",
    "resource", "resource_request", "capacity", "usage",
})


def keyed_field(field: str, plugin: str) -> str:
    """A plugin's field path as a manager-level request spells it: the plugin's name follows the
    key (`workload_resource_request.cpu-request` -> `workload_resource_request.cpumem.cpu-request`;
    `workloads_resource[0].cpu_map` -> `workloads_resource[0].cpumem.cpu_map`)."""
    head, steps = split_field(field)
    if head not in KEYED_KEYS:
        return field
    # A list (or map) of workload resources: the plugin follows the item.
    at = 1 if head == "workloads_resource" and steps else 0
    return "".join([head, *steps[:at], f".{plugin}", *steps[at:]])
