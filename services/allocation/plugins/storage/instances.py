"""From a volume plan to one instance's wire output: engine params and workload resource (eru §3.5).

A plan is made for the *request* side of the bindings; the limit side follows it: each limit binding
goes to its request's device, and the engine gets the limit bindings with that device as their source.
"""

from __future__ import annotations

from services.allocation.plugins.kit import field_error
from services.allocation.plugins.storage.plans import Placement, Plan, disk_for_path
from services.allocation.plugins.storage.requests import StorageRequest
from services.allocation.plugins.storage.types import (
    IO,
    Disk,
    StorageEngineParams,
    StorageNode,
    StorageWorkload,
    sorted_disks,
)
from services.allocation.plugins.storage.volumes import VolumeBinding, parse_binding, parse_bindings


def instance(
    wanted: StorageRequest, plan: Plan, capacity: StorageNode
) -> tuple[StorageEngineParams, StorageWorkload]:
    """One instance's engine params and workload resource, for a validated request and its plan."""
    limit_plan = _limit_plan(wanted, plan)
    disks_limit = _disks_limit(wanted.volumes_limit, limit_plan, capacity)
    engine = StorageEngineParams(
        volumes=[binding.engine_form() for binding in applied(wanted.volumes_limit, plan.volumes)],
        storage=wanted.storage_limit,
        iops_options={disk.device: disk.io.render() for disk in disks_limit},
    )
    workload = StorageWorkload(
        volumes_request=[binding.full() for binding in wanted.volumes_request],
        volumes_limit=[binding.full() for binding in wanted.volumes_limit],
        volume_plan_request=_plan_to_wire(plan.volumes),
        volume_plan_limit=_plan_to_wire(limit_plan),
        storage_request=wanted.storage_request,
        storage_limit=wanted.storage_limit,
        disks_request=_disks(plan.disks, capacity),
        disks_limit=disks_limit,
    )
    return engine, workload


def applied(bindings: list[VolumeBinding], placements: dict[VolumeBinding, Placement]) -> list[VolumeBinding]:
    """The bindings with their planned device as source; eru matches plan entries by destination only."""
    by_destination = {binding.destination: placement for binding, placement in placements.items()}
    result = []
    for binding in bindings:
        placement = by_destination.get(binding.destination)
        result.append(binding.placed(placement.device, placement.size) if placement else binding)
    return result


def volumes_changed(current: StorageWorkload, now_applied: list[VolumeBinding]) -> bool:
    """Whether a realloc makes the engine remount: eru compares the (source, destination, flags) mounted."""
    old_plan = plan_from_wire(current.volume_plan_limit, "workload_resource.volume_plan_limit")
    old_limits = parse_bindings(current.volumes_limit, "workload_resource.volumes_limit")
    before = {binding.key for binding in applied(old_limits, old_plan)}
    return len(now_applied) != len(before) or any(binding.key not in before for binding in now_applied)


def plan_from_wire(plan: dict[str, dict[str, int]], field: str) -> dict[VolumeBinding, Placement]:
    """A stored volume plan: each binding's full string mapped to its single {device: bytes}."""
    placements = {}
    for key, devices in plan.items():
        if len(devices) != 1:
            raise field_error(
                "invalid_volume", f"{field}.{key}", "a planned volume must name exactly one device"
            )
        [(device, size)] = devices.items()
        placements[parse_binding(key, f"{field}.{key}")] = Placement(device, size)
    return placements


def _plan_to_wire(placements: dict[VolumeBinding, Placement]) -> dict[str, dict[str, int]]:
    ordered = sorted(placements.items(), key=lambda item: item[0].key)
    return {binding.full(): {placement.device: placement.size} for binding, placement in ordered}


def _limit_plan(wanted: StorageRequest, plan: Plan) -> dict[VolumeBinding, Placement]:
    """Each scheduled limit binding on its request's device, with what the limit adds to the request."""
    limit_plan = {}
    # validate_request pairs request and limit bindings by position
    for request, limit in zip(wanted.volumes_request, wanted.volumes_limit, strict=True):
        if limit.requires_schedule and request in plan.volumes:
            placement = plan.volumes[request]
            limit_plan[limit] = Placement(placement.device, placement.size + limit.size - request.size)
    return limit_plan


def _disks_limit(
    limits: list[VolumeBinding], limit_plan: dict[VolumeBinding, Placement], capacity: StorageNode
) -> list[Disk]:
    """IO limits per disk: a mount on the disk of its path, a scheduled binding on its device's disk.

    A path on no known disk has nothing to throttle and is left out (eru emits a disk with no name).
    """
    charges: dict[str, IO] = {}
    paths = [(b, b.source) for b in limits if b.requires_io and not b.requires_schedule]
    paths += [(b, placement.device) for b, placement in limit_plan.items() if b.requires_io]
    for binding, path in paths:
        disk = disk_for_path(capacity.disks, path)
        if disk is not None:
            charges[disk.device] = charges.get(disk.device, IO()) + binding.io
    return _disks(charges, capacity)


def _disks(charges: dict[str, IO], capacity: StorageNode) -> list[Disk]:
    """IO charges as eru's disk entries, carrying the capacity disk's mounts."""
    mounts = {disk.device: disk.mounts for disk in capacity.disks}
    return sorted_disks(
        Disk(device, list(mounts.get(device, []))).with_io(io) for device, io in charges.items()
    )
