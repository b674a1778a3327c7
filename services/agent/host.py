"""What a host has, read from its kernel files, and the allocation node request that offers it.

`read_host(root)` reads everything under `root` ("/": this machine; a tests' fake tree otherwise);
`node_resource(host, ...)` turns it into the manager-level `resource` map of add-node. Pure and
synchronous: no network, no Redis. The only process it may start is `nvidia-smi`, and only for "/".

Every plugin's part of the map is in the stored (snapshot) shape, the capacity exactly as the plugin
will store it, so the same map serves add-node and an absolute set-node-resource-capacity request:
* cpumem: `{"cpu", "cpu_map", "memory", "numa", "numa_memory"}`, which cpumem takes verbatim. Its
  request form ("id:pieces" + positional `numa-cpu`/`numa-memory` lists) cannot keep real NUMA ids:
  element i is NUMA node i, so sparse ids (nodes 0 and 2) and memory-only nodes have no spelling.
* storage: `{"volumes": {mount point: bytes}, "storage": bytes}` (a map of volumes marks the
  snapshot, taken verbatim; `disks` is left out: its IO quotas are the operator's to set).
* gpu: `{"prod_count_map": {product: cards}}`, empty when the host has none.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter

import msgspec

from services.metrics.parsers import parse_cpulist, parse_meminfo
from services.metrics.provisioners.base import Roots, numa_cpus, read_int, read_text

NVIDIA_SMI_TIMEOUT = 5.0
SECTOR = 512  # sys/block/<dev>/size counts 512-byte sectors whatever the device's own sector size
GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd"}  # PCI vendor id -> product prefix
# Block devices that are no disk of their own: loop files, RAM disks, device-mapper views of other
# disks, optical and floppy drives.
VIRTUAL_DISKS = ("loop", "ram", "zram", "dm-", "sr", "fd")
VIRTUAL_VOLUME_DEVICES = ("/dev/loop", "/dev/ram", "/dev/zram")
SYSTEM_MOUNTS = ("/boot", "/proc", "/sys", "/dev", "/run")

_CARD = re.compile(r"card[0-9]+")  # not "card0-HDMI-A-1" (a connector) nor "renderD128"
_STAT_CPU = re.compile(r"^cpu([0-9]+) ", re.MULTILINE)
_NOT_PRODUCT = re.compile(r"[^a-z0-9.-]+")
_MOUNT_ESCAPE = re.compile(r"\\([0-7]{3})")  # /proc/mounts writes a space in a path as \040


class HostUnreadable(ValueError):
    """The root holds no host: neither its memory nor its CPUs can be read (a wrong --root)."""


class Host(msgspec.Struct, frozen=True):
    """A host's capacity. Sizes are bytes; NUMA node ids are the kernel's (they may be sparse)."""

    cpus: list[int] = []  # online CPU ids, ascending
    numa: dict[int, list[int]] = {}  # NUMA node -> its online CPUs; [] for a memory-only node
    memory: int = 0
    numa_memory: dict[int, int] = {}
    volumes: dict[str, int] = {}  # mount point -> size of the file system mounted there
    disks: dict[str, int] = {}  # whole block device (sda, nvme0n1) -> size
    storage: int = 0  # size of the root file system
    gpus: dict[str, int] = {}  # product -> cards


def read_host(root: str = "/", *, nvidia_smi: str | None = "nvidia-smi") -> Host:
    """The host whose tree is at `root`. A missing file gives an empty or zero value (a host without
    NUMA, disks or GPUs is normal); a root with neither memory nor CPUs is `HostUnreadable`."""
    roots = Roots.under(root)
    meminfo = read_text(f"{roots.proc}/meminfo")
    cpus = _online_cpus(roots)
    if meminfo is None and cpus is None:
        raise HostUnreadable(
            f"{root} is not a host's root: neither {roots.proc}/meminfo nor "
            f"{roots.sys}/devices/system/cpu/online nor {roots.proc}/stat can be read"
        )
    online = set(cpus or [])
    numa = {
        node: [cpu for cpu in node_cpus if cpu in online] for node, node_cpus in numa_cpus(roots.sys).items()
    }
    return Host(
        cpus=cpus or [],
        numa=numa,
        memory=parse_meminfo(meminfo or "").get("MemTotal", 0),
        numa_memory={node: _node_memory(roots.sys, node) for node in numa},
        volumes=_volumes(root, roots.proc),
        disks=_disks(roots.sys),
        storage=_fs_size(root) or 0,
        gpus=_gpus(root, roots.sys, nvidia_smi),
    )


def _online_cpus(roots: Roots) -> list[int] | None:
    """The online CPU list; kernels without it still number their CPUs in /proc/stat. None: neither."""
    online = read_text(f"{roots.sys}/devices/system/cpu/online")
    if online is not None:
        return parse_cpulist(online)
    stat = read_text(f"{roots.proc}/stat")
    return None if stat is None else sorted(int(cpu) for cpu in _STAT_CPU.findall(stat))


def _node_memory(sys_root: str, node: int) -> int:
    meminfo = read_text(f"{sys_root}/devices/system/node/node{node}/meminfo")
    return parse_meminfo(meminfo or "").get("MemTotal", 0)


def _volumes(root: str, proc: str) -> dict[str, int]:
    """Mount point -> size of the file systems on real block devices, but the root's and the system's.

    No byte is offered twice: a device is counted at its first mount only (bind mounts and btrfs
    subvolumes show it again) and never when it holds the root file system. A mount point must be a
    directory: containers bind files such as /etc/hosts from the host's disk.
    """
    mounts = [
        (fields[0], _MOUNT_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1]))
        for fields in (line.split() for line in (read_text(f"{proc}/mounts") or "").splitlines())
        if len(fields) >= 2
    ]
    seen = {device for device, point in mounts if point == "/"}
    volumes = {}
    for device, point in mounts:
        path = root.rstrip("/") + point
        if device in seen or not _is_volume(device, point) or not os.path.isdir(path):
            continue
        seen.add(device)
        if (size := _fs_size(path)) is not None:
            volumes[point] = size
    return volumes


def _is_volume(device: str, point: str) -> bool:
    system = any(point == prefix or point.startswith(prefix + "/") for prefix in SYSTEM_MOUNTS)
    return (
        device.startswith("/dev/")
        and not device.startswith(VIRTUAL_VOLUME_DEVICES)
        and point != "/"
        and not system
    )


def _fs_size(path: str) -> int | None:
    """The size of the file system holding `path`, or None when it cannot be asked (a stale mount)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize


def _disks(sys_root: str) -> dict[str, int]:
    base = f"{sys_root}/block"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    disks = {}
    for name in names:
        if not name.startswith(VIRTUAL_DISKS) and (sectors := read_int(f"{base}/{name}/size")) is not None:
            disks[name] = sectors * SECTOR
    return disks


def _gpus(root: str, sys_root: str, nvidia_smi: str | None) -> dict[str, int]:
    """Cards per product. nvidia-smi names NVIDIA cards (it runs on this machine only, so never for a
    fake tree); without it, or for other vendors, the PCI device id of each DRM card names it."""
    names = _nvidia_smi_names(nvidia_smi) if nvidia_smi and root.rstrip("/") == "" else []
    products = [_nvidia_product(name) for name in names]
    products += [
        product for product in _drm_products(sys_root) if not (names and product.startswith("nvidia-"))
    ]
    return dict(sorted(Counter(products).items()))


def _nvidia_smi_names(executable: str) -> list[str]:
    """One name per card; [] when nvidia-smi is absent or fails (no driver loaded, a hung GPU)."""
    path = shutil.which(executable)
    if path is None:
        return []
    command = [path, "--query-gpu=name", "--format=csv,noheader"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def _nvidia_product(name: str) -> str:
    """ "NVIDIA GeForce RTX 3090" -> "nvidia-geforce-rtx-3090": a gpu product is one lower-case word."""
    model = name.strip().lower().removeprefix("nvidia ")
    return "nvidia-" + _NOT_PRODUCT.sub("-", model).strip("-")


def _drm_products(sys_root: str) -> list[str]:
    """ "<vendor>-<PCI device id>" of every NVIDIA or AMD card under sys/class/drm, e.g. "nvidia-2204"."""
    base = f"{sys_root}/class/drm"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    products = []
    for name in filter(_CARD.fullmatch, names):
        vendor = GPU_VENDORS.get((read_text(f"{base}/{name}/device/vendor") or "").strip().lower())
        device = (read_text(f"{base}/{name}/device/device") or "").strip().lower().removeprefix("0x")
        if vendor and device:
            products.append(f"{vendor}-{device}")
    return products


def node_resource(
    host: Host, *, reserve_cpu: float = 0.0, reserve_memory: int = 0, share_base: int = 100
) -> dict[str, dict]:
    """The add-node `resource` map offering the host less what its own processes keep.

    Given to the real plugins' add-node (without engine info), the stored capacity is:
    * cpumem: every online CPU a core of `share_base` pieces, less `reserve_cpu` cores taken from the
      highest-numbered CPUs (whole cores left out, a fraction off the next core's pieces, rounded
      to a whole piece); `cpu` is the number of cores left (cpumem counts cores, not pieces);
      `memory` is MemTotal less `reserve_memory` (never below 0); with NUMA, the real node ids,
      memory-only nodes included, whose memory sums to `memory`.
    * storage: `volumes` as read, and `storage` = root file system + the volumes' total, as eru's
      add-node makes it: a deploy charges a workload's volume sizes to the storage budget too, so a
      budget without the volumes' bytes would refuse workloads that fit the volumes.
    * gpu: the host's cards per product.

    Raises ValueError for a negative reservation or one that leaves no CPU.
    """
    if reserve_cpu < 0 or reserve_memory < 0:
        raise ValueError(
            f"a negative reservation: --reserve-cpu {reserve_cpu:g} --reserve-memory {reserve_memory}"
        )
    pieces = len(host.cpus) * share_base - round(reserve_cpu * share_base)
    if pieces <= 0:
        raise ValueError(f"--reserve-cpu {reserve_cpu:g} leaves no CPU of {len(host.cpus)}")
    return {
        "cpumem": _cpumem(host, pieces, max(host.memory - reserve_memory, 0), share_base),
        "storage": _storage(host),
        "gpu": {"prod_count_map": dict(host.gpus)},
    }


def _cpumem(host: Host, pieces: int, memory: int, share_base: int) -> dict:
    """The cpumem snapshot: `pieces` filled into the lowest CPUs, `share_base` each (so the
    reservation comes off the highest ones); NUMA keys only for a host that has NUMA nodes."""
    cpu_map = {}
    for cpu in host.cpus:
        if pieces <= 0:
            break
        cpu_map[str(cpu)] = min(pieces, share_base)
        pieces -= share_base
    resource: dict = {"cpu": float(len(cpu_map)), "cpu_map": cpu_map, "memory": memory}
    if host.numa:
        node_of = {str(cpu): str(node) for node, cpus in host.numa.items() for cpu in cpus}
        resource["numa"] = {cpu: node_of[cpu] for cpu in cpu_map if cpu in node_of}
        resource["numa_memory"] = _split_memory(memory, host)
    return resource


def _split_memory(memory: int, host: Host) -> dict[str, int]:
    """`memory` over the NUMA nodes in proportion to their MemTotal (equally when none is known), the
    rounding remainder to the lowest id: the reservation comes from every node alike, and the
    figures sum to `memory` exactly."""
    nodes = sorted(host.numa)
    weights = {node: host.numa_memory.get(node, 0) for node in nodes}
    if not any(weights.values()):
        weights = dict.fromkeys(nodes, 1)
    total = sum(weights.values())
    split = {str(node): memory * weight // total for node, weight in weights.items()}
    split[str(nodes[0])] += memory - sum(split.values())
    return split


def _storage(host: Host) -> dict:
    """The storage snapshot. A mount point with ':' is left out, as it would split a volume binding
    string ("src:dst:flags:size") in the wrong place; one with whitespace too, so that nothing that
    splits on it sees another path."""
    volumes = {
        point: size
        for point, size in host.volumes.items()
        if ":" not in point and not re.search(r"\s", point)
    }
    return {"volumes": volumes, "storage": host.storage + sum(volumes.values())}


def describe(host: Host) -> str:
    """One log line: "8 CPUs on 2 NUMA nodes, 31.2 GiB, 2 volumes, 0 GPUs"."""
    numa = f" on {_count(len(host.numa), 'NUMA node')}" if host.numa else ""
    return (
        f"{_count(len(host.cpus), 'CPU')}{numa}, {host.memory / (1 << 30):.1f} GiB, "
        f"{_count(len(host.volumes), 'volume')}, {_count(sum(host.gpus.values()), 'GPU')}"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
