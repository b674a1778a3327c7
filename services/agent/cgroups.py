"""Confining an instance: its own cgroup (CPUs, NUMA nodes, memory limit), else its CPU affinity.

Each instance gets the cgroup `/<parent>/<node>/<safe_name(instance)>`:
- cgroup v1: in each hierarchy berth's metrics reader samples (`cpuset`, `memory`, `cpu`,
  `cpuacct`, `blkio`; those that cannot be written are skipped), so the instance's usage is
  read like a container's. A v1 cpuset takes no task before its `cpuset.cpus` and `cpuset.mems` are
  set, in every ancestor too: empty ones get their parent's values.
- cgroup v2: once, in the unified hierarchy, with `+cpuset +memory` enabled in the
  `cgroup.subtree_control` of its ancestors.

The process joins it between fork and exec (`Confinement.pre_exec`), so it never runs a single
instruction outside, and its children are born inside. Where no cpuset can be made (no rights, no
cpuset controller: `CgroupRoot.mode()` says "affinity"), the process gets `sched_setaffinity` only.

A CPU the host does not have cannot be pinned (an agent reading a fake host tree in tests reports
8 CPUs on a 2-CPU machine): the instance is confined to the CPUs of the request that exist, and
with none, not pinned at all (pinning "none"). That is logged once, and never fails a start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.agent.state import safe_name
from services.metrics.cgroups import detect_layout
from services.metrics.parsers import parse_cpulist

log = logging.getLogger(__name__)

# v1 hierarchies an instance's cgroup is made in: cpuset first (it decides the mode), then those the
# metrics reader samples (`services.metrics.cgroups.V1_CONTROLLERS`).
V1_HIERARCHIES = ("cpuset", "memory", "cpu", "cpuacct", "blkio")
_CONTROLLERS_V2 = ("cpuset", "memory")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log a warning the first time `key` comes up in this process (not once per instance)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def format_list(numbers: Iterable[int]) -> str:
    return ",".join(str(n) for n in sorted(numbers))


@dataclass(frozen=True)
class Confinement:
    """How one instance is confined. `pinning` ("cgroup", "affinity" or "none") says how its CPUs
    are enforced; `cpus` are those it is pinned to (empty with "none"); `path` is its cgroup
    relative to each hierarchy's root and `directories` that cgroup in each hierarchy ("", (): none)."""

    pinning: str
    cpus: tuple[int, ...] = ()
    path: str = ""
    directories: tuple[str, ...] = ()

    def pre_exec(self) -> Callable[[], None] | None:
        """The step the child runs before exec: join the cgroups (writing its own pid into each
        `cgroup.procs`), or set its affinity. Only syscalls: it runs in a forked child."""
        procs = [os.path.join(d, "cgroup.procs") for d in self.directories]
        affinity = set(self.cpus) if self.pinning == "affinity" else set()
        if not procs and not affinity:
            return None

        def step() -> None:
            pid = str(os.getpid()).encode()
            for path in procs:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
            if affinity:
                os.sched_setaffinity(0, affinity)

        return step


def affinity_confinement(cpus: Iterable[int], memory_limit: int = 0) -> Confinement:
    """Pinning by CPU affinity alone, to the requested CPUs this process may run on."""
    wanted = set(cpus)
    pinned = _existing(wanted, os.sched_getaffinity(0))
    if memory_limit:
        warn_once("memory", "no memory cgroup: memory limits of instances are not enforced")
    return Confinement("affinity", tuple(sorted(pinned))) if pinned else Confinement("none")


def _existing(wanted: set[int], available: set[int]) -> set[int]:
    """The CPUs of `wanted` in `available`, warning (once) about the others."""
    pinned = wanted & available
    if wanted - available:
        warn_once(
            "cpus", "CPUs %s are not on this machine (it has %s): instances are pinned to the bound CPUs "
            "it has, or not at all", format_list(wanted - available), format_list(available),
        )
    return pinned


class CgroupRoot:
    """The cgroups the agent makes its instances' under: `<hierarchy>/<parent>/<node>/<instance>`."""

    def __init__(self, mount: str = "/sys/fs/cgroup", parent: str = "berth") -> None:
        self.mount = mount
        self.parent = parent.strip("/")
        self.layout = detect_layout(mount)
        self.version = 2 if self.layout.mode == "v2" else 1
        self.hierarchies: dict[str, str] = {}  # name ("cpuset"... or "unified") -> its root directory
        self._mode: str | None = None

    # -- the host ---------------------------------------------------------------------------------

    def mode(self) -> str:
        """"cgroup" when a cpuset cgroup can be made under the parent (tried once, with a test child),
        else "affinity". Never raises: a host that refuses is a host without cgroups for us."""
        if self._mode is None:
            try:
                self._mode = "cgroup" if self._probe() else "affinity"
            except OSError as error:
                log.warning("cgroups under %s/%s cannot be made (%s): pinning by CPU affinity",
                            self.mount, self.parent, error)
                self._mode = "affinity"
            if self._mode == "affinity":
                self.hierarchies = {}
        return self._mode

    def _probe(self) -> bool:
        if self.version == 2:
            if "cpuset" not in self.layout.unified_controllers:
                return False
            self.hierarchies = {"unified": self.layout.unified or self.mount}
        else:
            cpuset = os.path.join(self.mount, "cpuset")
            if not os.path.exists(os.path.join(cpuset, "cgroup.procs")):
                return False
            self.hierarchies = {"cpuset": cpuset}
        test = self._make(next(iter(self.hierarchies.values())), f"/{self.parent}/probe-{os.getpid()}")
        try:
            if not os.path.exists(os.path.join(test, "cpuset.cpus")):
                return False
        finally:
            os.rmdir(test)
        if self.version == 1:
            self._add_v1_hierarchies()
        return True

    def _add_v1_hierarchies(self) -> None:
        """The other v1 hierarchies the parent can be made in (one directory per mount: `cpu` and
        `cpuacct` are often one hierarchy, linked under both names)."""
        seen = {os.path.realpath(self.hierarchies["cpuset"])}
        for name in V1_HIERARCHIES[1:]:
            directory = os.path.join(self.mount, name)
            real = os.path.realpath(directory)
            if real in seen or not os.path.exists(os.path.join(directory, "cgroup.procs")):
                continue
            try:
                self._make(directory, f"/{self.parent}")
            except OSError as error:
                warn_once(f"hierarchy {name}", "cgroup hierarchy %s skipped: %s", directory, error)
                continue
            seen.add(real)
            self.hierarchies[name] = directory

    # -- an instance ------------------------------------------------------------------------------

    def path(self, node: str, instance: str) -> str:
        """The cgroup of `instance`, relative to each hierarchy's root."""
        node = node if _PLAIN_NAME.fullmatch(node) else safe_name(node)
        return f"/{self.parent}/{node}/{safe_name(instance)}"

    def confine(self, node: str, instance: str, cpus: Iterable[int] = (), mems: Iterable[int] = (),
                memory_limit: int = 0) -> Confinement:
        """Make the instance's cgroup and set its limits; its affinity only where cgroups are not
        available (or this one cannot be made: logged, and the start goes on)."""
        if self.mode() != "cgroup":
            return affinity_confinement(cpus, memory_limit)
        path = self.path(node, instance)
        try:
            directories = {name: self._make(root, path) for name, root in self.hierarchies.items()}
            pinned = self._set_cpuset(directories[next(iter(directories))], set(cpus), set(mems))
            if memory_limit:
                self._set_memory(directories, memory_limit)
        except OSError as error:
            log.warning("cgroup %s cannot be made (%s): instance %s pinned by CPU affinity", path, error, instance)
            self._remove_now(path)
            return affinity_confinement(cpus, memory_limit)
        return Confinement("cgroup" if pinned else "none", tuple(sorted(pinned)), path,
                           tuple(directories.values()))

    def _make(self, root: str, path: str) -> str:
        """Make `path` in the hierarchy at `root`, each missing ancestor made usable on the way."""
        v1_cpuset = self.version == 1 and root == self.hierarchies.get("cpuset")
        directory = root
        for name in path.strip("/").split("/"):
            parent, directory = directory, os.path.join(directory, name)
            if self.version == 2:
                self._enable_controllers(parent)
            os.makedirs(directory, exist_ok=True)
            for file in ("cpuset.cpus", "cpuset.mems") if v1_cpuset else ():
                if not _read(os.path.join(directory, file)):
                    _write(os.path.join(directory, file), _read(os.path.join(parent, file)))
        return directory

    def _enable_controllers(self, directory: str) -> None:
        """v2: let the children of `directory` have a cpuset and a memory controller. Without
        cpuset there is no cgroup mode (the error propagates); without memory, only no limits."""
        enabled = set(_read(os.path.join(directory, "cgroup.subtree_control")).split())
        for controller in _CONTROLLERS_V2:
            if controller in enabled:
                continue
            try:
                _write(os.path.join(directory, "cgroup.subtree_control"), f"+{controller}")
            except OSError as error:
                if controller == "cpuset":
                    raise
                warn_once(f"v2 {controller}", "cgroup %s: no %s controller for its children (%s)",
                          directory, controller, error)

    def _set_cpuset(self, directory: str, cpus: set[int], mems: set[int]) -> set[int]:
        """Confine to the bound CPUs and NUMA nodes the parent has (the parent's all where none
        is bound, or none of the bound exist); the CPUs pinned."""
        parent = os.path.dirname(directory)
        effective = ("cpuset.effective_cpus", "cpuset.effective_mems") if self.version == 1 else (
            "cpuset.cpus.effective", "cpuset.mems.effective")
        available_cpus = set(parse_cpulist(_read_first(parent, (effective[0], "cpuset.cpus"))))
        available_mems = set(parse_cpulist(_read_first(parent, (effective[1], "cpuset.mems"))))
        pinned = _existing(cpus, available_cpus)
        nodes = mems & available_mems
        if mems - available_mems:
            warn_once("mems", "NUMA nodes %s are not on this machine (it has %s): not confined to them",
                      format_list(mems - available_mems), format_list(available_mems))
        _write(os.path.join(directory, "cpuset.cpus"), format_list(pinned or available_cpus))
        _write(os.path.join(directory, "cpuset.mems"), format_list(nodes or available_mems))
        return pinned

    def _set_memory(self, directories: dict[str, str], limit: int) -> None:
        """The memory limit, where a memory controller serves the cgroup (else only a warning: a
        missing limit is no reason to give up the CPU confinement)."""
        if self.version == 2:
            target = os.path.join(directories["unified"], "memory.max")
        else:
            target = os.path.join(directories.get("memory", "/nonexistent"), "memory.limit_in_bytes")
        if not os.path.exists(target):
            warn_once("memory", "no memory cgroup: memory limits of instances are not enforced")
            return
        _write(target, str(limit))

    # -- removal ----------------------------------------------------------------------------------

    async def remove(self, path: str, timeout: float = 5.0, poll: float = 0.05) -> bool:
        """Remove the cgroup `path` of an instance whose process group was stopped; whether it is
        gone. An rmdir fails while tasks remain (a process that left the group, or one still
        exiting): those are killed (what is in an instance's cgroup is the instance's), and the
        rmdir is retried until `timeout`."""
        if not self._ours(path):
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._remove_now(path, kill=True):
            if loop.time() > deadline:
                log.warning("cgroup %s still has tasks after %s s: left in place", path, timeout)
                return False
            await asyncio.sleep(poll)
        return True

    def _ours(self, path: str) -> bool:
        """`path` is an instance cgroup under our parent (a damaged record removes nothing else)."""
        parts = path.strip("/").split("/")
        return len(parts) == 3 and parts[0] == self.parent and ".." not in parts and "." not in parts

    def _remove_now(self, path: str, kill: bool = False) -> bool:
        self.mode()
        gone = True
        for root in reversed(list(self.hierarchies.values())):
            directory = os.path.join(root, path.strip("/"))
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                continue
            except OSError:
                gone = False
                if kill:
                    _kill_tasks(directory)
        return gone


def _kill_tasks(directory: str) -> None:
    for pid in map(int, _read(os.path.join(directory, "cgroup.procs")).split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _read_first(directory: str, names: Iterable[str]) -> str:
    """The first of the files `names` in `directory` that has a value."""
    for name in names:
        if value := _read(os.path.join(directory, name)):
            return value
    return ""


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
