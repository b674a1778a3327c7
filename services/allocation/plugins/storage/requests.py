"""Parsing and validating the storage plugin's requests (eru resource-storage §3.3).

Workload requests use eru's hyphenated keys; node requests carry `"device:size"` volume strings, disk
strings and human sizes. Everything is strict: a value that does not parse is an error naming its field.
"""

from __future__ import annotations

import re
from functools import reduce

import msgspec

from schemas.sizes import MAX_INT, parse_size
from services.allocation.plugins.interface import Raw
from services.allocation.plugins.kit import (
    decode,
    field_error,
    recoded,
    refuse_unknown_fields,
    refuse_unknown_keys,
)
from services.allocation.plugins.storage.types import IO, Disk, StorageNode, sorted_disks
from services.allocation.plugins.storage.volumes import VolumeBinding, parse_bindings
from services.allocation.quantity import saturating_add

# eru reads the first of these keys that holds a non-empty list.
REQUEST_VOLUME_KEYS = ("volumes-request", "volume-request")
LIMIT_VOLUME_KEYS = ("volumes", "volume", "volume-limit", "volumes-limit")
# Every key each map is read with (eru reference §3.3); any other is a typo, refused.
WORKLOAD_REQUEST_KEYS = frozenset({
    *REQUEST_VOLUME_KEYS, *LIMIT_VOLUME_KEYS, "storage-request", "storage-limit", "storage",
})
NODE_REQUEST_KEYS = frozenset({"volumes", "storage", "disks", "rm-disks"})
_PLAIN_INT = re.compile(r"-?\d+")
DISK_FORM = (
    "'<device>:<mount points, comma-separated>:<read IOPS>:<write IOPS>:<read bytes/s>:<write bytes/s>', "
    "such as '/dev/sda:/,/data:1000:1000:100M:100M'"
)


def total(values: list[int]) -> int:
    """A sum that saturates at MAX_INT instead of leaving the range a stored integer can hold."""
    return reduce(saturating_add, values, 0)


class StorageRequest(msgspec.Struct):
    """A workload request: volume bindings (request and limit side) and a storage budget in bytes."""

    volumes_request: list[VolumeBinding] = []
    volumes_limit: list[VolumeBinding] = []
    storage_request: int = 0
    storage_limit: int = 0

    def is_empty(self) -> bool:
        return not (self.volumes_request or self.volumes_limit or self.storage_request or self.storage_limit)

    def needs_planning(self) -> bool:
        return any(binding.needs_planning for binding in self.volumes_request)


def parse_workload_request(raw: object, field: str, *, delta: bool = False) -> StorageRequest:
    """The request as sent, not yet validated. In a delta (realloc) request values may be negative."""
    if raw is None:
        return StorageRequest()
    if not isinstance(raw, dict):
        raise field_error("invalid_argument", field, f"must be a map, got {type(raw).__name__}")
    refuse_unknown_keys(raw, WORKLOAD_REQUEST_KEYS, field)
    request = StorageRequest(
        _first_bindings(raw, field, REQUEST_VOLUME_KEYS, delta),
        _first_bindings(raw, field, LIMIT_VOLUME_KEYS, delta),
        _storage(raw, "storage-request", field, delta),
        _storage(raw, "storage-limit", field, delta),
    )
    if "storage" in raw:  # eru: `storage` sets both sides
        request.storage_request = request.storage_limit = _storage(raw, "storage", field, delta)
    return request


def _first_bindings(raw: Raw, field: str, keys: tuple[str, ...], delta: bool) -> list[VolumeBinding]:
    lists = [parse_bindings(raw[key], f"{field}.{key}", delta=delta) for key in keys if key in raw]
    return next((bindings for bindings in lists if bindings), [])


def _storage(raw: Raw, key: str, field: str, delta: bool) -> int:
    if key not in raw:
        return 0
    # A quantity that does not parse, or is negative outside a delta, is invalid_argument (§2).
    return parse_size(raw[key], f"{field}.{key}", allow_negative=delta)


def validate_request(request: StorageRequest, field: str, *, add_volume_sizes: bool) -> StorageRequest:
    """eru's WorkloadResourceRequest.Validate, returning the normalised request.

    Limit-only volumes become the request too; request and limit pair up by (source, destination, flags);
    a limit below its request is raised to it. With `add_volume_sizes` (deploy, not realloc) the volume
    sizes are added to the storage budget once, as eru does since PRs #572/#575.
    """
    if request.is_empty():
        return request
    request_key = "volumes-request" if request.volumes_request else "volumes"  # limits stand in for requests
    requested = _sorted_checked(request.volumes_request or request.volumes_limit, f"{field}.{request_key}")
    limits = _sorted_checked(request.volumes_limit, f"{field}.volumes")
    if len(requested) != len(limits):
        raise field_error("invalid_volume", f"{field}.volumes", "request and limit volumes differ in number")
    paired = [_paired(req, lim, f"{field}.volumes") for req, lim in zip(requested, limits, strict=True)]
    storage_request, storage_limit = _storage_pair(request.storage_request, request.storage_limit, field)
    if add_volume_sizes:
        storage_request = total([storage_request] + [binding.size for binding in requested])
        storage_limit = total([storage_limit] + [binding.size for binding in paired])
    return StorageRequest(requested, paired, storage_request, storage_limit)


def _sorted_checked(bindings: list[VolumeBinding], field: str) -> list[VolumeBinding]:
    destinations: set[str] = set()
    for binding in bindings:
        if binding.monopoly and binding.unlimited:
            raise field_error("invalid_volume", field, f"monopoly volume {binding.full()!r} needs a size")
        if any(value < 0 for value in binding.io.values()):
            raise field_error(
                "invalid_argument", field, f"IO values of {binding.full()!r} must not be negative"
            )
        if binding.destination in destinations:
            raise field_error("invalid_volume", field, f"two volumes mount at {binding.destination!r}")
        destinations.add(binding.destination)
    return sorted(bindings, key=lambda binding: binding.key)


def _paired(request: VolumeBinding, limit: VolumeBinding, field: str) -> VolumeBinding:
    """The limit binding, raised to its request where it asks for less."""
    if request.key != limit.key:
        raise field_error(
            "invalid_volume", field, f"request {request.full()!r} and limit {limit.full()!r} do not match"
        )
    size = request.size if request.size > 0 and limit.size > 0 and request.size > limit.size else limit.size
    io = IO(*map(max, request.io.values(), limit.io.values()))
    return msgspec.structs.replace(limit, size=size, io=io)


def _storage_pair(request: int, limit: int, field: str) -> tuple[int, int]:
    if request < 0 or limit < 0:
        key = "storage-request" if request < 0 else "storage-limit"
        raise field_error("invalid_storage", f"{field}.{key}", "storage request and limit must not be negative")
    if limit > 0 and request == 0:
        request = limit
    if limit > 0 and request > limit:
        limit = request  # a soft limit never sits below the request
    return request, limit


class NodeRequest(msgspec.Struct):
    """An operator's node request; None marks a key that was not sent.

    `storage` is the value sent: in the string form the volume total is added to it (eru), while a
    `snapshot` (a request in the stored NodeResource shape, such as a `before` being replayed) is taken
    verbatim, so a rollback restores exactly what was there.
    """

    volumes: dict[str, int] | None = None
    storage: int | None = None
    disks: list[Disk] | None = None
    rm_disks: list[str] = []
    snapshot: bool = False

    def resolve(self, current: StorageNode | None = None) -> StorageNode:
        """The NodeResource this request stands for; with `current`, omitted keys keep their stored values."""
        keep = current if current is not None else StorageNode()
        volumes = dict(sorted((keep.volumes if self.volumes is None else self.volumes).items()))
        disks = list(keep.disks if self.disks is None else self.disks)
        return StorageNode(volumes, sorted_disks(disks), self._storage(keep))

    def _storage(self, keep: StorageNode) -> int:
        if self.snapshot:
            return keep.storage if self.storage is None else self.storage
        if self.storage is not None:
            return total([self.storage, *(self.volumes or {}).values()])
        if self.volumes is not None:  # the budget keeps its non-volume part and follows the volumes
            return total([keep.storage, *(-size for size in keep.volumes.values()), *self.volumes.values()])
        return keep.storage


def parse_node_request(raw: object, field: str, *, delta: bool) -> NodeRequest | None:
    """A node request (add-node, set-*); None when none was sent. Negative values only in a delta."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise field_error("invalid_argument", field, f"must be a map, got {type(raw).__name__}")
    if _is_snapshot(raw):
        refuse_unknown_fields(raw, StorageNode, field)
        node = decode(raw, StorageNode, field)
        given = {key: getattr(node, key) for key in ("volumes", "storage", "disks") if key in raw}
        return NodeRequest(**given, snapshot=True)
    refuse_unknown_keys(raw, NODE_REQUEST_KEYS, field)
    request = NodeRequest(rm_disks=_rm_disks(raw, field))
    if "volumes" in raw:
        request.volumes = _node_volumes(raw["volumes"], f"{field}.volumes", delta)
    if "storage" in raw:
        request.storage = parse_size(raw["storage"], f"{field}.storage", allow_negative=delta)
    if "disks" in raw:
        request.disks = _disks(raw["disks"], f"{field}.disks", delta)
    return request


def _is_snapshot(raw: Raw) -> bool:
    """Stored NodeResources keep volumes as a map and disks as maps; operator requests use strings."""
    disks = raw.get("disks")
    return isinstance(raw.get("volumes"), dict) or (
        isinstance(disks, list) and any(isinstance(d, dict) for d in disks)
    )


def _node_volumes(values: object, field: str, delta: bool) -> dict[str, int]:
    if not isinstance(values, list):
        raise field_error(
            "invalid_volume", field, f"must be a list of 'device:size' strings, got {type(values).__name__}"
        )
    volumes: dict[str, int] = {}
    for index, text in enumerate(values):
        where = f"{field}[{index}]"
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 2 or not parts[0]:
            raise field_error(
                "invalid_volume", where, f"{text!r} should be '<device>:<size>', such as '/data:100G'"
            )
        if parts[0] in volumes:
            raise field_error("invalid_volume", where, f"volume {parts[0]!r} is listed twice")
        volumes[parts[0]] = recoded("invalid_volume", parse_size, parts[1], where, allow_negative=delta)
    return volumes


def _disks(values: object, field: str, delta: bool) -> list[Disk]:
    if not isinstance(values, list):
        raise field_error(
            "invalid_argument", field, f"must be a list of disk strings, got {type(values).__name__}"
        )
    disks = [parse_disk(text, f"{field}[{index}]", delta=delta) for index, text in enumerate(values)]
    if len({disk.device for disk in disks}) != len(disks):
        raise field_error("invalid_argument", field, "a disk is listed twice")
    return sorted_disks(disks)


def parse_disk(text: object, field: str, *, delta: bool = False) -> Disk:
    """`device:mount1,mount2:readIOPS:writeIOPS:readBPS:writeBPS`; IOPS are plain integers, BPS sizes.

    An empty mount list leaves a disk's mounts as they are when the disk is added to an existing one.
    """
    parts = text.split(":") if isinstance(text, str) else []
    if len(parts) != 6 or not parts[0]:
        raise field_error("invalid_argument", field, f"{text!r} should be {DISK_FORM}")
    device, mounts, read_iops, write_iops, read_bps, write_bps = parts
    mount_list = mounts.split(",") if mounts else []
    if "" in mount_list:
        raise field_error("invalid_argument", field, f"{text!r} has an empty mount point")
    io = IO(
        _plain_int(read_iops, field, delta),
        _plain_int(write_iops, field, delta),
        parse_size(read_bps, field, allow_negative=delta),
        parse_size(write_bps, field, allow_negative=delta),
    )
    return Disk(device, mount_list).with_io(io)


def _plain_int(text: str, field: str, delta: bool) -> int:
    if not _PLAIN_INT.fullmatch(text.strip()):
        raise field_error("invalid_argument", field, f"IOPS must be an integer, got {text!r}")
    value = int(text)
    if value < 0 and not delta:
        raise field_error("invalid_argument", field, f"IOPS must not be negative, got {value}")
    if abs(value) > MAX_INT:
        raise field_error("invalid_argument", field, f"{value} is larger than {MAX_INT}")
    return value


def _rm_disks(raw: Raw, field: str) -> list[str]:
    value = raw.get("rm-disks", "")
    if not isinstance(value, str):
        raise field_error("invalid_argument", f"{field}.rm-disks", "must be a string like 'dev1,dev2'")
    return [device for device in value.split(",") if device]
