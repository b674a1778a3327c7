"""The storage plugin (eru resource-storage): volumes, disks with IO quotas, and a storage budget.

Every method takes and returns wire maps (DESIGN.md §3); see `types.py` for their keys. The deploy,
capacity and realloc rules are eru's; where berth deliberately differs it says so next to the code.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, Raw, Shortfall
from services.allocation.plugins.kit import (
    MatrixUpdates,
    check_count,
    chosen_source,
    decode,
    encode,
    insufficient_resource,
    metric,
    metric_description,
    ratio,
    refuse_unknown_fields,
    safe_name,
)
from services.allocation.plugins.storage.instances import applied, instance, plan_from_wire, volumes_changed
from services.allocation.plugins.storage.plans import Host, Plan, affinity_plan, volume_plans
from services.allocation.plugins.storage.records import (
    check_node,
    check_record,
    normalized_usage,
    returned_usage,
    without_disks,
    without_empty_volumes,
)
from services.allocation.plugins.storage.requests import (
    StorageRequest,
    parse_node_request,
    parse_workload_request,
    total,
    validate_request,
)
from services.allocation.plugins.storage.types import (
    IO,
    Disk,
    StorageEngineParams,
    StorageNode,
    StorageWorkload,
    combine,
    sorted_disks,
)
from services.allocation.plugins.storage.volumes import merge_bindings, parse_bindings

# eru's realloc delta carries the per-device volume change under this made-up binding; only its
# devices and sizes are ever read (by set-node-resource-usage / apply_workloads).
DELTA_PLAN_KEY = "fake-source:fake-destination:fake-flags:0:0:0:0:0"
# Share of the engine's reported storage offered for scheduling (eru's `rate`: 8/10).
ENGINE_STORAGE_SHARE = (8, 10)


class StoragePlugin(MatrixUpdates[StorageNode]):
    name = "storage"
    priority = 1  # eru's storage never decides the most idle node against cpumem/gpu (100)
    _record_shape, _workload_shape = StorageNode, StorageWorkload

    def __init__(self, max_deploy_count: int = 10000) -> None:
        # The most plans one calculation offers: eru's cap for requests that need no volume, applied here
        # to every volume request so that tiny bindings on huge volumes cannot produce millions of plans.
        self.max_deploy_count = check_count(max_deploy_count, "max_deploy_count", minimum=1)

    # --- records -------------------------------------------------------------------------------------

    def add_node(self, resource: Raw | None, info: EngineInfo | None) -> tuple[Raw, Raw]:
        request = parse_node_request(resource, "resource", delta=False)
        capacity = request.resolve() if request is not None else StorageNode()
        if info is not None:
            capacity = _with_engine_defaults(capacity, info)
        usage = normalized_usage(capacity, StorageNode())
        check_record(capacity, usage)
        return encode(capacity), encode(usage)

    # --- calculations --------------------------------------------------------------------------------

    def calculate_deploy(
        self, capacity: Raw, usage: Raw, deploy_count: int, request: Raw | None
    ) -> tuple[list[Raw], list[Raw]]:
        count = check_count(deploy_count, "deploy_count")
        wanted = _deploy_request(request)
        cap, used = _record(capacity, usage)
        fits = _storage_fits(cap, used, wanted)
        if fits is not None and fits < count:
            raise insufficient_resource(
                f"not enough storage: {count} instances wanted, room for {fits} "
                f"({wanted.storage_request} bytes each, {cap.storage - used.storage} bytes free)",
                requested=count, available=fits, unit="instances",
            )
        plans = [Plan()] * count
        if wanted.needs_planning():
            plans = volume_plans(Host.of(cap, used), wanted.volumes_request, self.max_deploy_count)
            if len(plans) < count:
                raise insufficient_resource(
                    f"not enough volume plans: {count} instances wanted, room for {len(plans)}",
                    requested=count, available=len(plans), unit="instances",
                )
        instances = [instance(wanted, plan, cap) for plan in plans[:count]]
        return [encode(engine) for engine, _ in instances], [encode(workload) for _, workload in instances]

    def engine_params(self, workload_resource: Raw) -> Raw:
        held = decode(workload_resource, StorageWorkload, "workload_resource")
        plan = plan_from_wire(held.volume_plan_request, "workload_resource.volume_plan_request")
        limits = parse_bindings(held.volumes_limit, "workload_resource.volumes_limit")
        return encode(StorageEngineParams(
            volumes=[binding.engine_form() for binding in applied(limits, plan)],
            storage=held.storage_limit,
            iops_options={disk.device: disk.io.render() for disk in held.disks_limit},
        ))

    def deploy_capacity(self, capacity: Raw, usage: Raw, request: Raw | None) -> DeployCapacity:
        wanted = _deploy_request(request)
        cap, used = _record(capacity, usage)
        count = self.max_deploy_count
        if wanted.needs_planning():
            count = len(volume_plans(Host.of(cap, used), wanted.volumes_request, self.max_deploy_count))
        fits = _storage_fits(cap, used, wanted)
        if fits is not None:  # a pure storage request is limited by storage alone (eru)
            count = min(count, fits) if wanted.volumes_limit else fits
        usage_ratio, rate = _usage_and_rate(cap, used, wanted)
        return DeployCapacity(capacity=count, usage=usage_ratio, rate=rate, weight=1.0)

    def shortfalls(self, capacity: Raw, usage: Raw, request: Raw | None, count: int) -> dict[str, Shortfall]:
        """`storage` (the budget) and `volumes` (the scheduled volumes' space), in bytes, that keep
        `count` instances off the node."""
        wanted = _deploy_request(request)
        cap, used = _record(capacity, usage)
        short: dict[str, Shortfall] = {}
        fits = _storage_fits(cap, used, wanted)
        if fits is not None and fits < count:
            missing = count * wanted.storage_request - max(cap.storage - used.storage, 0)
            short["storage"] = Shortfall(min(missing, MAX_INT), "bytes")
        if wanted.needs_planning():
            plans = len(volume_plans(Host.of(cap, used), wanted.volumes_request, count))
            if plans < count:
                each = sum(binding.size for binding in wanted.volumes_request if binding.requires_schedule)
                free = sum(max(size - used.volumes.get(device, 0), 0) for device, size in cap.volumes.items())
                missing = count * each - free
                missing = missing if missing > 0 else (count - plans) * each
                short["volumes"] = Shortfall(min(missing, MAX_INT), "bytes")
        return short

    def calculate_realloc(
        self, capacity: Raw, usage: Raw, workload_resource: Raw, request: Raw | None
    ) -> tuple[Raw, Raw, Raw]:
        """eru's delta realloc: sizes, IO and storage in the request add to the workload's current ones."""
        cap, used = _record(capacity, usage)
        current = decode(workload_resource, StorageWorkload, "workload_resource")
        delta = parse_workload_request(request, "workload_resource_request", delta=True)
        wanted = _merged_request(current, delta)
        free = cap.storage - used.storage
        if wanted.storage_request - current.storage_request > free:
            room = current.storage_request + free  # what the workload may hold in all
            raise insufficient_resource(
                f"not enough storage: {wanted.storage_request} bytes wanted in all, {room} bytes available "
                f"({current.storage_request} held, {free} free)",
                requested=wanted.storage_request, available=room, unit="bytes",
            )
        current_plan = plan_from_wire(current.volume_plan_request, "workload_resource.volume_plan_request")
        if any(binding.needs_planning for binding in delta.volumes_request or delta.volumes_limit):
            returned = returned_usage(cap, used, current.usage(), "workload_resource")
            plan = affinity_plan(Host.of(cap, returned), wanted.volumes_request, current_plan)
        else:
            # eru drops the IO charges here (an empty disks_request); berth keeps what the workload holds.
            plan = Plan(current_plan, {disk.device: disk.io for disk in current.disks_request})
        engine, workload = instance(wanted, plan, cap)
        engine.volume_changed = volumes_changed(current, applied(wanted.volumes_limit, plan.volumes))
        change = combine(workload.usage(), current.usage(), -1)
        delta_resource = StorageWorkload(
            volume_plan_request={DELTA_PLAN_KEY: {d: size for d, size in change.volumes.items() if size}},
            storage_request=change.storage,
            disks_request=[disk for disk in change.disks if disk.io.nonzero()],
        )
        return encode(engine), encode(delta_resource), encode(workload)

    def calculate_remap(self, capacity: Raw, usage: Raw, workloads: dict[str, Raw]) -> dict[str, Raw]:
        return {}  # volumes are never remapped (eru)

    # --- node operations -----------------------------------------------------------------------------

    # apply_workloads and usage_from_workloads (MatrixUpdates') need these storage steps.

    def _holding(self, raw: object, field: str) -> StorageNode:
        """What a workload holds of the node: its request side."""
        return decode(raw, StorageWorkload, field).usage()

    def _usage(self, usage: Raw) -> StorageNode:
        return _usage(usage)

    def _applied_usage(self, usage: StorageNode) -> Raw:
        check_node(usage, "usage")
        return encode(usage)

    def _usage_shape(self, capacity: Raw) -> Callable[[StorageNode], Raw]:
        """The usage lists exactly the capacity's volumes and disks."""
        cap = decode(capacity, StorageNode, "capacity")
        return lambda usage: encode(normalized_usage(cap, usage))

    # set-node-resource-capacity and -usage (eru §2.12) are MatrixUpdates'; these are their storage steps.
    _empty = StorageNode
    _combine = staticmethod(combine)

    def _record(self, capacity: Raw, usage: Raw) -> tuple[StorageNode, StorageNode]:
        return _record(capacity, usage)

    def _capacity_sources(
        self, capacity: StorageNode, resource: Raw | None, request: Raw | None, delta: bool
    ) -> tuple[StorageNode, list[StorageNode]]:
        node_request = parse_node_request(request, "resource_request", delta=delta)
        node_resource = _node_resource(resource)
        if node_request is not None and node_request.rm_disks:
            if delta:
                raise InvalidArgument(
                    "resource_request.rm-disks", "disks can only be removed by an absolute update"
                )
            capacity = without_disks(capacity, node_request.rm_disks)
        # An absolute request keeps the keys it leaves out (eru's SkipEmpty).
        requested = node_request.resolve(None if delta else capacity) if node_request is not None else None
        return capacity, chosen_source(requested, node_resource, [])

    def _settled_capacity(self, capacity: StorageNode, usage: StorageNode, delta: bool) -> tuple[Raw, Raw]:
        if delta:
            capacity = without_empty_volumes(capacity)
        after_usage = normalized_usage(capacity, usage)
        check_record(capacity, after_usage)
        return encode(capacity), encode(after_usage)

    def _usage_sources(
        self, resource: Raw | None, request: Raw | None, workloads: list[Raw], delta: bool
    ) -> list[StorageNode]:
        node_request = parse_node_request(request, "resource_request", delta=delta)
        node_resource = _node_resource(resource)
        requested = node_request.resolve() if node_request is not None else None
        return chosen_source(requested, node_resource, self._holdings(workloads))

    def _settled_usage(self, capacity: StorageNode, usage: StorageNode) -> Raw:
        after = normalized_usage(capacity, usage)
        check_record(capacity, after)
        return encode(after)

    def diffs(self, capacity: Raw, usage: Raw, workloads: list[Raw]) -> list[str]:
        """eru's diffs in its order (storage, volumes, disks), devices ascending; a missing entry is 0."""
        _, used = _record(capacity, usage)
        explained = self._explained(workloads)
        diffs = []
        if used.storage != explained.storage:
            diffs.append(f"node.Storage != sum(workload.Storage): {used.storage} != {explained.storage}")
        for device in sorted(used.volumes.keys() | explained.volumes.keys()):
            stored, summed = used.volumes.get(device, 0), explained.volumes.get(device, 0)
            if stored != summed:
                diffs.append(
                    f"node.Volumes[{device}] != sum(workload.Volumes[{device}]): {stored} != {summed}"
                )
        stored_disks, summed_disks = used.disk_map(), explained.disk_map()
        for device in sorted(stored_disks.keys() | summed_disks.keys()):
            stored_disk = stored_disks.get(device) or Disk(device)
            summed_disk = stored_disk.with_io(summed_disks[device].io if device in summed_disks else IO())
            if stored_disk.io != summed_disk.io:
                which = f"node.Disks[{device}] != sum(workload.Disks[{device}])"
                diffs.append(f"{which}: {stored_disk.render()} != {summed_disk.render()}")
        return diffs

    def load(self, capacity: Raw, usage: Raw) -> float:
        """The share of the storage budget in use (eru's storage has no load: it names the first node)."""
        cap, used = _record(capacity, usage)
        return ratio(used.storage, cap.storage)

    def metrics_description(self) -> list[Raw]:
        return [
            metric_description("storage_used", "node used storage.", ["podname", "nodename"]),
            metric_description("storage_capacity", "node available storage.", ["podname", "nodename"]),
        ]

    def metrics(self, podname: str, nodename: str, capacity: Raw, usage: Raw) -> list[Raw]:
        cap, used = _record(capacity, usage)
        prefix, labels = f"core.node.{safe_name(nodename)}.storage", [podname, nodename]
        # eru keys both under `.storage.used`; berth's keys are distinct (DESIGN.md §3).
        return [
            metric("storage_used", labels, f"{prefix}.used", used.storage),
            metric("storage_capacity", labels, f"{prefix}.capacity", cap.storage),
        ]


# --- decoding ------------------------------------------------------------------------------------------


def _record(capacity: Raw, usage: Raw) -> tuple[StorageNode, StorageNode]:
    cap, used = decode(capacity, StorageNode, "capacity"), _usage(usage)
    check_record(cap, used)
    return cap, used


def _usage(usage: Raw) -> StorageNode:
    return decode(usage, StorageNode, "usage")


def _node_resource(resource: Raw | None) -> StorageNode | None:
    """A set-* `resource` a client sends, in the stored shape; None when absent."""
    if resource is None:
        return None
    refuse_unknown_fields(resource, StorageNode, "resource")
    return decode(resource, StorageNode, "resource")


def _deploy_request(raw: Raw | None) -> StorageRequest:
    field = "workload_resource_request"
    return validate_request(parse_workload_request(raw, field), field, add_volume_sizes=True)


def _merged_request(current: StorageWorkload, delta: StorageRequest) -> StorageRequest:
    """The workload's bindings and storage with a realloc delta added (eru skips the volume-size add here)."""
    delta_request = delta.volumes_request or delta.volumes_limit
    merged = StorageRequest(
        merge_bindings(
            delta_request, parse_bindings(current.volumes_request, "workload_resource.volumes_request")
        ),
        merge_bindings(
            delta.volumes_limit, parse_bindings(current.volumes_limit, "workload_resource.volumes_limit")
        ),
        total([delta.storage_request, current.storage_request, *(b.size for b in delta_request)]),
        total([delta.storage_limit, current.storage_limit, *(b.size for b in delta.volumes_limit)]),
    )
    return validate_request(merged, "workload_resource_request", add_volume_sizes=False)


def _with_engine_defaults(capacity: StorageNode, info: EngineInfo) -> StorageNode:
    """What the engine reports fills in what the request left out (eru's AddNode).

    The engine's own storage entry, when present, stands for everything it reports; berth otherwise uses
    `info.storage_total` (eru would read 0 there). 80% of that total becomes the budget if none was given.
    """
    if "storage" in info.resources:
        refuse_unknown_fields(info.resources["storage"], StorageNode, "info.resources.storage")
        engine = decode(info.resources["storage"], StorageNode, "info.resources.storage")
    else:
        engine = StorageNode(storage=check_count(info.storage_total, "info.storage_total"))
    numerator, denominator = ENGINE_STORAGE_SHARE
    return StorageNode(
        capacity.volumes or dict(sorted(engine.volumes.items())),
        capacity.disks or sorted_disks(engine.disks),
        capacity.storage or engine.storage * numerator // denominator,
    )


def _storage_fits(capacity: StorageNode, usage: StorageNode, wanted: StorageRequest) -> int | None:
    """How many instances the storage budget takes, or None when the request asks for no storage."""
    if wanted.storage_request <= 0:
        return None
    return max(0, (capacity.storage - usage.storage) // wanted.storage_request)


def _usage_and_rate(capacity: StorageNode, usage: StorageNode, wanted: StorageRequest) -> tuple[float, float]:
    """eru: measured on volumes when the request has volumes (or no storage), else on the storage budget."""
    volume_total = sum(capacity.volumes.values())
    if volume_total == 0 and capacity.storage == 0:
        return 0.0, 0.0
    if wanted.volumes_request or wanted.storage_request == 0:
        requested = sum(binding.size for binding in wanted.volumes_request)
        return ratio(sum(usage.volumes.values()), volume_total), ratio(requested, volume_total)
    return ratio(usage.storage, capacity.storage), ratio(wanted.storage_request, capacity.storage)
