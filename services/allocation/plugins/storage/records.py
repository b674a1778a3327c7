"""Rules for a storage node's stored record: what may be stored, and the usage shape the plugin writes.

A record the plugin writes lists every capacity volume and disk in its usage (zeros included), with the
disk's mounts. Stored records are checked but never rewritten (set-node-resource-info stores verbatim).
"""

from __future__ import annotations

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT
from services.allocation.plugins.kit import field_error
from services.allocation.plugins.storage.types import IO, StorageNode, combine, sorted_disks


def check_node(node: StorageNode, name: str) -> None:
    """Each value of a capacity or usage is a storable, non-negative integer and each device is named once."""
    for device, size in node.volumes.items():
        if not device or not 0 <= size <= MAX_INT:
            raise field_error(
                "invalid_volume", f"{name}.volumes.{device}", f"size must be in [0, {MAX_INT}], got {size}"
            )
    if not 0 <= node.storage <= MAX_INT:
        raise field_error(
            "invalid_storage", f"{name}.storage", f"must be in [0, {MAX_INT}], got {node.storage}"
        )
    devices: set[str] = set()
    for disk in node.disks:
        where = f"{name}.disks.{disk.device}"
        if not disk.device or disk.device in devices:
            raise InvalidArgument(where, "each disk needs a device name, used once")
        if not all(0 <= value <= MAX_INT for value in disk.io.values()):
            raise InvalidArgument(where, f"IO quotas must be in [0, {MAX_INT}], got {disk.io.render()}")
        devices.add(disk.device)


def check_record(capacity: StorageNode, usage: StorageNode) -> None:
    """A record may be stored if both halves are well-formed and nothing is used beyond its capacity.

    eru does not compare storage usage with capacity; berth does, so usage never exceeds capacity.
    Usage of a device the node does not have is allowed only when it is zero.
    """
    check_node(capacity, "capacity")
    check_node(usage, "usage")
    for device, used in usage.volumes.items():
        if used > capacity.volumes.get(device, 0):
            raise field_error(
                "invalid_volume",
                f"usage.volumes.{device}",
                f"{used} used exceeds the capacity {capacity.volumes.get(device, 0)}",
            )
    if usage.storage > capacity.storage:
        raise field_error(
            "invalid_storage",
            "usage.storage",
            f"{usage.storage} used exceeds the capacity {capacity.storage}",
        )
    quotas = {disk.device: disk.io for disk in capacity.disks}
    for disk in usage.disks:
        if not disk.io.fits(quotas.get(disk.device, IO())):
            raise InvalidArgument(
                f"usage.disks.{disk.device}", f"{disk.io.render()} used exceeds the disk's quota"
            )


def normalized_usage(capacity: StorageNode, usage: StorageNode) -> StorageNode:
    """`usage` listing exactly the capacity's volumes and disks (zeros included, mounts from capacity).

    Entries for devices the node does not have are dropped when zero and kept otherwise, so that
    `check_record` reports them instead of them silently disappearing.
    """
    volumes = {device: usage.volumes.get(device, 0) for device in capacity.volumes}
    volumes.update({d: size for d, size in usage.volumes.items() if d not in capacity.volumes and size != 0})
    used = usage.disk_map()
    disks = [disk.with_io(used[disk.device].io if disk.device in used else IO()) for disk in capacity.disks]
    known = {disk.device for disk in capacity.disks}
    disks += [disk for disk in usage.disks if disk.device not in known and disk.io.nonzero()]
    return StorageNode(volumes, sorted_disks(disks), usage.storage)


def returned_usage(capacity: StorageNode, usage: StorageNode, held: StorageNode, field: str) -> StorageNode:
    """`usage` with a workload's holding `held` given back (realloc plans against this).

    A workload that claims a device the node lacks, or more than the node records as used, does not
    match this node's record: that is reported instead of planning on a corrupt view.
    """
    returned = combine(usage, held, -1)
    for device in held.volumes:
        if device not in capacity.volumes or returned.volumes[device] < 0:
            raise field_error(
                "invalid_volume",
                f"{field}.volume_plan_request",
                f"{device!r} does not match the node's usage",
            )
    for disk in returned.disks:
        if any(value < 0 for value in disk.io.values()):
            raise InvalidArgument(
                f"{field}.disks_request", f"disk {disk.device!r} holds more than the node's usage"
            )
    return returned


def without_disks(node: StorageNode, devices: list[str]) -> StorageNode:
    return StorageNode(dict(node.volumes), [d for d in node.disks if d.device not in devices], node.storage)


def without_empty_volumes(node: StorageNode) -> StorageNode:
    """eru drops volumes whose capacity a delta update brought to 0."""
    return StorageNode(
        {d: size for d, size in node.volumes.items() if size != 0}, list(node.disks), node.storage
    )
