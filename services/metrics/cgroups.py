"""Where the cgroup controllers are mounted, and which cgroups berth samples.

Hosts come in three layouts, and a collector must decide per controller (katalyst-metrics.md §9.3):
- v2: one unified hierarchy at the mount point, which has `cgroup.controllers`;
- v1: one directory per controller (`cpu`, `cpuacct`, `memory`, `blkio`, ...) on a tmpfs;
- hybrid: v1 controller directories plus a cgroup2 mount at `unified/` that holds the
  controllers v1 does not (often none), and PSI files for every cgroup.

Discovery walks one hierarchy and finds Kubernetes pods (cgroupfs driver: `kubepods/burstable/
pod<uid>/<container id>`; systemd driver: `kubepods.slice/kubepods-burstable.slice/
kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope`), containers run by docker or
containerd outside Kubernetes, the QoS-level cgroups, and the paths the operator configured.
Cgroup paths are relative to the hierarchy root and start with "/"; kubelet and the container
runtimes create the same relative path in every hierarchy they use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec

# v1 controllers berth reads (the hierarchies are found by these directory names).
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "blkio")

# Kubernetes' top-level cgroup and its QoS children, per cgroup driver.
_KUBEPODS = {
    "kubepods": ("burstable", "besteffort"),
    "kubepods.slice": ("kubepods-burstable.slice", "kubepods-besteffort.slice"),
}

# systemd scope names of containers: "<prefix><container id>.scope".
_SCOPE_PREFIXES = ("cri-containerd-", "containerd-", "docker-", "crio-", "nerdctl-")


class CgroupLayout(msgspec.Struct, frozen=True):
    """Where each controller lives. `mode` is "v1", "v2", "hybrid" or "none"."""

    mode: str
    v1: dict[str, str]
    unified: str | None = None
    unified_controllers: frozenset[str] = frozenset()

    def locate(self, v1_name: str, v2_name: str | None) -> tuple[int, str] | None:
        """(version, hierarchy directory) serving a controller, or None where no hierarchy has it.

        `v2_name` None means the v2 files exist without any controller (cpu.stat's usage_usec).
        """
        if v1_name in self.v1:
            return 1, self.v1[v1_name]
        if self.unified is not None and (v2_name is None or v2_name in self.unified_controllers):
            return 2, self.unified
        return None

    def discovery_root(self) -> str | None:
        """The hierarchy to walk for discovery: memory's, else cpuacct's, else the unified one."""
        for controller in ("memory", "cpuacct"):
            if controller in self.v1:
                return self.v1[controller]
        return self.unified


def detect_layout(root: str = "/sys/fs/cgroup") -> CgroupLayout:
    """Inspect the cgroup mount point (files only, so tests can point it at a sample tree)."""
    controllers_file = os.path.join(root, "cgroup.controllers")
    if os.path.exists(controllers_file):
        return CgroupLayout("v2", {}, root, _read_words(controllers_file))
    v1 = {
        name: os.path.join(root, name)
        for name in V1_CONTROLLERS
        if os.path.exists(os.path.join(root, name, "cgroup.procs"))
    }
    unified = os.path.join(root, "unified")
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        return CgroupLayout("hybrid", v1, unified, _read_words(os.path.join(unified, "cgroup.controllers")))
    return CgroupLayout("v1" if v1 else "none", v1)


def _read_words(path: str) -> frozenset[str]:
    with open(path) as f:
        return frozenset(f.read().split())


class PodCgroups(msgspec.Struct):
    """One Kubernetes pod: its cgroup and its containers' cgroups (container id -> path)."""

    uid: str
    path: str
    containers: dict[str, str]


class Discovery(msgspec.Struct):
    """The result of one discovery walk.

    `pods` feed the container scopes; `cgroups` (QoS cgroups, standalone containers, configured
    paths) feed the cgroup scopes.
    """

    pods: dict[str, PodCgroups]
    cgroups: list[str]

    def living_pods(self) -> dict[str, list[str]]:
        """pod uid -> container ids, the shape `Store.retain_pods` takes."""
        return {uid: list(pod.containers) for uid, pod in self.pods.items()}


def discover(layout: CgroupLayout, configured: Sequence[str] = ()) -> Discovery:
    """Walk the discovery hierarchy once.

    A directory that vanishes during the walk is skipped, but other errors (permission denied)
    propagate: a partial listing must not make the caller forget pods that still run.
    """
    root = layout.discovery_root()
    if root is None:
        return Discovery({}, [])
    pods: dict[str, PodCgroups] = {}
    cgroups: list[str] = []
    for top, qos_names in _KUBEPODS.items():
        if not os.path.isdir(f"{root}/{top}"):
            continue
        qos_paths = [f"/{top}/{qos}" for qos in qos_names if os.path.isdir(f"{root}/{top}/{qos}")]
        # Guaranteed pods sit directly under the top cgroup, the others under their QoS cgroup.
        for parent in [f"/{top}", *qos_paths]:
            cgroups.append(parent)
            _find_pods(root, parent, pods)
    cgroups.extend(_standalone_containers(root))
    cgroups.extend(path for path in configured if path not in cgroups)
    return Discovery(pods, cgroups)


def _subdirs(root: str, path: str) -> list[str]:
    """Names of the child cgroups of `path` (sorted, so rounds list them in a stable order)."""
    try:
        return sorted(entry.name for entry in os.scandir(root + path) if entry.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _find_pods(root: str, parent: str, pods: dict[str, PodCgroups]) -> None:
    for name in _subdirs(root, parent):
        uid = pod_uid(name)
        if uid is None:
            continue
        path = f"{parent}/{name}"
        containers = {}
        for child in _subdirs(root, path):
            container = container_id(child)
            if container is not None:
                containers[container] = f"{path}/{child}"
        pods[uid] = PodCgroups(uid, path, containers)


def pod_uid(name: str) -> str | None:
    """The pod UID in a pod cgroup's directory name, or None if it is not a pod's.

    cgroupfs driver: "pod1b2c...-..."; systemd driver: "kubepods-burstable-pod1b2c_..._.slice",
    where systemd has replaced the UID's dashes with underscores.
    """
    if name.endswith(".slice"):
        stem = name[: -len(".slice")]
        at = stem.rfind("-pod")
        if at < 0 or at + 4 == len(stem):
            return None
        return stem[at + 4 :].replace("_", "-")
    if name.startswith("pod") and len(name) > 3:
        return name[3:]
    return None


def container_id(name: str) -> str | None:
    """The container id in a container cgroup's directory name.

    cgroupfs driver: the bare id; systemd driver: "<runtime>-<id>.scope". CRI-O's monitor process
    ("crio-conmon-<id>.scope") is not a container.
    """
    if not name.endswith(".scope"):
        return name
    stem = name[: -len(".scope")]
    if stem.startswith("crio-conmon-"):
        return None
    for prefix in _SCOPE_PREFIXES:
        if stem.startswith(prefix):
            return stem[len(prefix) :]
    return None


def _standalone_containers(root: str) -> list[str]:
    """Containers outside Kubernetes: docker's cgroupfs `/docker/<id>` and systemd runtime scopes."""
    found = [f"/docker/{name}" for name in _subdirs(root, "/docker")]
    for name in _subdirs(root, "/system.slice"):
        if name.endswith(".scope") and name.startswith(_SCOPE_PREFIXES):
            found.append(f"/system.slice/{name}")
    return found
