"""Volume plans: where each scheduled binding of one instance goes (eru resource-storage §3.4).

A plan maps each binding that needs a volume to (device, bytes) and records the IO it charges per disk.
`volume_plans` returns plans that fit *together*: applying all of them never over-allocates a volume or
a disk. Bindings come in four kinds:

- normal: an AUTO binding with a size; it shares an already *used* volume, best fit first;
- monopoly (`m` flag): all of them take one *unused* volume whole, split in proportion to their sizes;
- unlimited: an AUTO binding asking for nothing; it gets size 0 on the emptiest volume;
- mount: a real host path; it only charges IO to the disk that holds the path.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from services.allocation.plugins.kit import insufficient_resource
from services.allocation.plugins.storage.types import IO, Disk, StorageNode
from services.allocation.plugins.storage.volumes import VolumeBinding


class Placement(msgspec.Struct, frozen=True):
    device: str
    size: int


class Plan(msgspec.Struct):
    volumes: dict[VolumeBinding, Placement] = {}
    disks: dict[str, IO] = {}  # disk device -> IO charged

    def merged(self, other: Plan) -> Plan:
        disks = dict(self.disks)
        for device, io in other.disks.items():
            disks[device] = disks.get(device, IO()) + io
        return Plan({**self.volumes, **other.volumes}, disks)


def disk_for_path(disks: Iterable[Disk], path: str) -> Disk | None:
    """The disk holding `path`: the deepest mount point that is a prefix of it (eru's GetDiskByPath)."""
    mounts = [(_with_slash(mount), disk) for disk in disks for mount in disk.mounts]
    mounts.sort(key=lambda entry: -entry[0].count("/"))  # stable, so equal depths keep device order
    return next((disk for mount, disk in mounts if _with_slash(path).startswith(mount)), None)


def _with_slash(path: str) -> str:
    return path if path.endswith("/") else path + "/"


class Host(msgspec.Struct):
    """A node's volumes and disk quotas while plans are made; `take` charges them."""

    size: dict[str, int]  # volume device -> capacity
    used: dict[str, int]
    quota: dict[str, IO]  # disk device -> IO left
    disks: list[Disk]
    volume_disk: dict[str, str | None]  # the disk holding each volume, looked up once

    @classmethod
    def of(cls, capacity: StorageNode, usage: StorageNode) -> Host:
        used_io = {disk.device: disk.io for disk in usage.disks}
        return cls(
            size=dict(capacity.volumes),
            used={device: usage.volumes.get(device, 0) for device in capacity.volumes},
            quota={disk.device: disk.io - used_io.get(disk.device, IO()) for disk in capacity.disks},
            disks=capacity.disks,
            volume_disk={
                device: _device(disk_for_path(capacity.disks, device)) for device in capacity.volumes
            },
        )

    def copy(self) -> Host:
        return Host(self.size, dict(self.used), dict(self.quota), self.disks, self.volume_disk)

    def free(self, device: str) -> int:
        return self.size[device] - self.used[device]

    def order(self, device: str) -> tuple[int, str]:
        """eru's volume order: the least free space first, then the device name."""
        return (self.free(device), device)

    def disk_of(self, path: str) -> str | None:
        if path in self.volume_disk:
            return self.volume_disk[path]
        return _device(disk_for_path(self.disks, path))

    def io_fits(self, disk: str | None, io: IO) -> bool:
        """A binding without IO needs no disk; one with IO needs a disk with that much quota left."""
        return not io.any() or (disk is not None and io.fits(self.quota[disk]))

    def take(self, plan: Plan, device: str | None, size: int, disk: str | None, io: IO) -> None:
        """Charge `size` bytes of `device` and `io` of `disk` (if IO is asked for), noting them in `plan`."""
        if device is not None:
            self.used[device] += size
        if disk is not None and io.any():
            self.quota[disk] = self.quota[disk] - io
            plan.disks[disk] = plan.disks.get(disk, IO()) + io


def _device(disk: Disk | None) -> str | None:
    return disk.device if disk else None


class _Kinds(msgspec.Struct):
    normal: list[VolumeBinding]
    monopoly: list[VolumeBinding]
    unlimited: list[VolumeBinding]
    mount: list[VolumeBinding]

    def scheduled(self) -> bool:
        return bool(self.normal or self.monopoly or self.unlimited)


def _kinds(bindings: list[VolumeBinding]) -> _Kinds:
    kinds = _Kinds([], [], [], [])
    for binding in bindings:
        if binding.monopoly:
            kinds.monopoly.append(binding)
        elif binding.unlimited:
            kinds.unlimited.append(binding)
        elif binding.requires_schedule:
            kinds.normal.append(binding)
        else:
            kinds.mount.append(binding)
    # Smallest first, as eru places them; the stable sort keeps the callers' (key) order among equals.
    kinds.normal.sort(key=lambda binding: binding.size)
    kinds.monopoly.sort(key=lambda binding: binding.size)
    return kinds


def volume_plans(host: Host, bindings: list[VolumeBinding], limit: int) -> list[Plan]:
    """Up to `limit` plans for one instance each, all fitting on the node together.

    Normal bindings only share *used* volumes and monopoly groups only take *unused* ones. While the
    monopoly side could place more instances than the normal side, the smallest unused volume that fits
    the smallest normal binding is handed over to the normal side; the last round decides (as in eru).
    """
    if not any(binding.needs_planning for binding in bindings):
        return [Plan() for _ in range(limit)]
    kinds = _kinds(bindings)
    if kinds.scheduled() and not host.size:
        return []
    used = sorted((d for d in host.size if host.used[d] > 0), key=host.order)
    unused = sorted((d for d in host.size if host.used[d] == 0), key=host.order)
    smallest = min((binding.size for binding in kinds.normal), default=None)
    while True:
        scratch = host.copy()  # normal plans charge disks first; monopoly plans see what is left
        normal = _normal_plans(scratch, kinds, used, limit)
        monopoly = _monopoly_plans(scratch, kinds.monopoly, unused, limit)
        handover = next((d for d in unused if smallest is not None and host.free(d) >= smallest), None)
        if len(monopoly) <= len(normal) or handover is None:
            break
        unused.remove(handover)
        used.append(handover)
    count = min(len(normal), len(monopoly))
    plans = [normal[i].merged(monopoly[i]) for i in range(count)]
    if kinds.unlimited and count:
        device = _emptiest(host, used + unused, normal + monopoly)
        shared = Plan({binding: Placement(device, 0) for binding in kinds.unlimited})
        plans = [plan.merged(shared) for plan in plans]
    return plans


def _normal_plans(host: Host, kinds: _Kinds, used: list[str], limit: int) -> list[Plan]:
    if not kinds.normal and not any(binding.requires_io for binding in kinds.mount):
        return [Plan() for _ in range(limit)]
    plans: list[Plan] = []
    while len(plans) < limit:
        plan = _normal_plan(host, kinds, used)
        if plan is None:
            break
        plans.append(plan)
    return plans


def _normal_plan(host: Host, kinds: _Kinds, used: list[str]) -> Plan | None:
    """One instance's normal and mount bindings, or None; the host is only charged when all fit."""
    trial, plan = host.copy(), Plan()
    for binding in kinds.normal:
        fitting = [
            d for d in used if trial.free(d) >= binding.size and trial.io_fits(trial.disk_of(d), binding.io)
        ]
        if not fitting:
            return None
        device = min(fitting, key=trial.order)
        trial.take(plan, device, binding.size, trial.disk_of(device), binding.io)
        plan.volumes[binding] = Placement(device, binding.size)
    if not _charge_mounts(trial, plan, kinds.mount):
        return None
    host.used, host.quota = trial.used, trial.quota
    return plan


def _charge_mounts(host: Host, plan: Plan, mounts: list[VolumeBinding]) -> bool:
    """Charge the IO of mount bindings to the disks holding their source paths."""
    for binding in mounts:
        disk = host.disk_of(binding.source)
        if not host.io_fits(disk, binding.io):
            return False
        host.take(plan, None, 0, disk, binding.io)
    return True


def _monopoly_plans(host: Host, monopoly: list[VolumeBinding], unused: list[str], limit: int) -> list[Plan]:
    if not monopoly:
        return [Plan() for _ in range(limit)]
    plans: list[Plan] = []
    for device in unused:
        plan = _monopoly_plan(host, monopoly, device) if len(plans) < limit else None
        if plan is not None:
            plans.append(plan)
    return plans


def _monopoly_plan(host: Host, monopoly: list[VolumeBinding], device: str) -> Plan | None:
    """All monopoly bindings on `device`, which they then fill completely, or None if they do not fit."""
    free = host.free(device)
    sizes = [binding.size for binding in monopoly]
    io = sum((binding.io for binding in monopoly), IO())
    disk = host.disk_of(device)
    if free < sum(sizes) or not host.io_fits(disk, io):
        return None
    plan = Plan()
    for binding, share in zip(monopoly, _split(free, sizes), strict=True):
        plan.volumes[binding] = Placement(device, share)
    host.take(plan, device, free, disk, io)
    return plan


def _split(space: int, sizes: list[int]) -> list[int]:
    """`space` in proportion to `sizes` (equal parts if all are 0); the remainder goes to the first share."""
    weights = sizes if sum(sizes) > 0 else [1] * len(sizes)
    shares = [space * weight // sum(weights) for weight in weights]
    shares[0] += space - sum(shares)
    return shares


def _emptiest(host: Host, devices: list[str], plans: list[Plan]) -> str:
    """The volume with the most space left once all plans are applied (the first such, in eru's order)."""
    free = {device: host.free(device) for device in devices}
    for plan in plans:
        for placement in plan.volumes.values():
            free[placement.device] -= placement.size
    return max(devices, key=lambda device: free[device])


def affinity_plan(host: Host, bindings: list[VolumeBinding], current: dict[VolumeBinding, Placement]) -> Plan:
    """One plan for a reallocated workload that keeps each binding on the device it already has.

    `host` must already have the workload's current allocation returned. Bindings whose key is in the
    current plan stay on their device at their new size; the monopoly group stays together on its device
    if any of it was placed before; everything else is scheduled afresh. Raises `insufficient_resource`.
    """
    kinds, plan = _kinds(bindings), Plan()
    placed = {binding.key: placement.device for binding, placement in current.items()}
    if not _charge_mounts(host, plan, kinds.mount):
        raise insufficient_resource("not enough IO quota for the mounted volumes")
    fresh = [binding for binding in kinds.normal if binding.key not in placed]
    for binding in kinds.normal:
        if binding.key in placed:
            _keep(host, plan, binding, placed[binding.key])
    group, regrouped = _keep_monopoly(host, kinds.monopoly, current)
    plan = plan.merged(group)
    fresh += [binding for binding in kinds.monopoly if not regrouped]
    for binding in kinds.unlimited:
        if binding.key in placed:
            _keep(host, plan, binding, placed[binding.key])
        else:
            fresh.append(binding)
    if not fresh:
        return plan
    rescheduled = volume_plans(host, fresh, 1)
    if not rescheduled:
        raise insufficient_resource("no volume plan for the new volumes", volumes=[b.full() for b in fresh])
    return plan.merged(rescheduled[0])


def _keep(host: Host, plan: Plan, binding: VolumeBinding, device: str) -> None:
    disk = host.disk_of(device)
    if host.free(device) < binding.size:
        raise insufficient_resource(f"no space to grow {binding.destination} on {device}", device=device)
    if not host.io_fits(disk, binding.io):
        raise insufficient_resource(f"no IO quota to grow {binding.destination} on {device}", device=device)
    host.take(plan, device, binding.size, disk, binding.io)
    plan.volumes[binding] = Placement(device, binding.size)


def _keep_monopoly(
    host: Host, monopoly: list[VolumeBinding], current: dict[VolumeBinding, Placement]
) -> tuple[Plan, bool]:
    """The monopoly group re-split on the device it holds, and whether it had one (else it is rescheduled).

    As in eru, the group may grow only within what its device gave it before.
    """
    placed = {binding.key: placement.device for binding, placement in current.items()}
    device = next((placed[binding.key] for binding in monopoly if binding.key in placed), None)
    if device is None:
        return Plan(), False
    held = sum(placement.size for binding, placement in current.items() if binding.monopoly)
    group = _monopoly_plan(host, monopoly, device) if held >= sum(b.size for b in monopoly) else None
    if group is None:
        raise insufficient_resource(f"no space to grow the monopoly volumes on {device}", device=device)
    return group, True
