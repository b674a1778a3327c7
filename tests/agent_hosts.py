"""Fake host trees for the agent: the kernel files `services.agent.host.read_host` reads, under a root.

Not a test module. `fake_host` writes a small tree of any shape (CPUs in blocks over NUMA nodes, sparse
or memory-only nodes, offline CPUs, disks, mounted volumes, GPUs); `set_online` hot-unplugs CPUs.
Each CPU's NUMA node is kept as the kernel shows it, a `cpu/cpuN/nodeM` entry, so `set_online` can
rebuild the node lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
# What every host mounts besides its disks; none of it is a volume.
SYSTEM_MOUNTS = (
    "proc /proc proc rw 0 0\nsysfs /sys sysfs rw 0 0\ntmpfs /run tmpfs rw 0 0\n/dev/vda / ext4 rw 0 0\n"
)


def fake_host(
    path: Path,
    *,
    cpus: int = 4,
    numa_nodes: int | Sequence[int] = 1,
    memory_only: Sequence[int] = (),
    memory: int = 8 << 30,
    disks: dict[str, int] | None = None,
    gpus: dict[str, int] | None = None,
    offline: Sequence[int] = (),
    volumes: Sequence[str] = (),
) -> Path:
    """Write a host tree at `path` and return it.

    `numa_nodes`: a count (ids 0..n-1; 0: a host without NUMA) or the node ids (sparse ones allowed),
    which get the CPUs evenly in blocks; `memory_only` adds nodes without CPUs. `memory` (whole KiB)
    is split evenly over all nodes. `disks`: block device -> bytes. `gpus`: "vendor:device" hex ids ->
    cards, e.g. {"10de:2204": 2}. `volumes`: mount points, each a directory of the tree mounted from
    its own /dev/vdX, so its size is the size of the file system holding `path`.
    """
    nodes = list(range(numa_nodes)) if isinstance(numa_nodes, int) else list(numa_nodes)
    online = [cpu for cpu in range(cpus) if cpu not in offline]
    _write(path / "proc/meminfo", f"MemTotal: {memory // 1024:>16} kB\nMemFree: {memory // 2048:>17} kB\n")
    _write(
        path / "proc/stat",
        "cpu  1 0 1 10 0 0 0 0 0 0\n" + "".join(f"cpu{c} 1 0 1 10 0 0 0 0 0 0\n" for c in online),
    )
    # The kernel writes a space in a mount point as \040.
    mounts = "".join(
        f"/dev/vd{chr(ord('b') + i)} {point.replace(' ', chr(92) + '040')} ext4 rw 0 0\n"
        for i, point in enumerate(volumes)
    )
    _write(path / "proc/mounts", SYSTEM_MOUNTS + mounts)
    for point in volumes:
        (path / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    _write(path / CPU_DIR / "possible", f"0-{cpus - 1}\n")
    for cpu in range(cpus):
        (path / CPU_DIR / f"cpu{cpu}").mkdir(parents=True, exist_ok=True)
        if nodes:
            (path / CPU_DIR / f"cpu{cpu}" / f"node{nodes[cpu * len(nodes) // cpus]}").mkdir(exist_ok=True)
    _write_numa(path, nodes + list(memory_only), memory // 1024)
    set_online(path, online)
    for device, size in (disks or {}).items():
        _write(path / "sys/block" / device / "size", f"{size // 512}\n")
    _write_gpus(path, gpus or {})
    return path


def set_online(root: Path, cpus: Sequence[int]) -> None:
    """Bring exactly `cpus` online (CPU hot-plug): rewrites cpu/online and every node's cpulist."""
    _write(root / CPU_DIR / "online", ",".join(map(str, sorted(cpus))) + "\n")
    members: dict[str, list[int]] = {}
    for cpu in cpus:
        for entry in (root / CPU_DIR / f"cpu{cpu}").glob("node*"):
            members.setdefault(entry.name, []).append(cpu)
    for node in (root / NODE_DIR).glob("node*"):
        _write(node / "cpulist", ",".join(map(str, sorted(members.get(node.name, [])))) + "\n")


def _write_numa(root: Path, nodes: list[int], kib: int) -> None:
    """The node list and each node's meminfo, `kib` split evenly (the remainder on the first node)."""
    if not nodes:
        return
    _write(root / NODE_DIR / "online", ",".join(map(str, sorted(nodes))) + "\n")
    share, remainder = divmod(kib, len(nodes))
    for index, node in enumerate(nodes):
        node_kib = share + (remainder if index == 0 else 0)
        _write(root / NODE_DIR / f"node{node}/meminfo", f"Node {node} MemTotal:       {node_kib} kB\n")


def _write_gpus(root: Path, gpus: dict[str, int]) -> None:
    """One DRM card per GPU, each with a connector entry beside it as real cards have."""
    card = 0
    for ids, count in gpus.items():
        vendor, device = ids.split(":")
        for _ in range(count):
            _write(root / f"sys/class/drm/card{card}/device/vendor", f"0x{vendor}\n")
            _write(root / f"sys/class/drm/card{card}/device/device", f"0x{device}\n")
            (root / f"sys/class/drm/card{card}-DP-1").mkdir(parents=True)
            card += 1


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
