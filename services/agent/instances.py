"""The instances one agent runs on its node: started, watched, probed, stopped, and adopted again by
a restarted agent.

An instance is one process of a catalog entry, started the way the broker's `process` operator
starts its own (`services.processes.spawn`: no shell, an environment built from nothing, its own
session and process group), marked `BERTH_INSTANCE=<prefix>/<node>/<instance>`, and confined to the
CPUs, NUMA nodes and memory its allocation bound (`cgroups.py`).

What survives the agent is in its state folder (`state.py`), one record per instance:
- the intent is recorded before the process is spawned, the pid and its start time right after;
- on `open`, a recorded process that still runs (same pid, same start time) is watched again; an
  intent without a pid (the agent died in between) is looked for by its marker, so it never runs
  twice; one that is gone is `exited`, with no exit code (it was not this agent's child).

Watching: a pidfd per process (`os.pidfd_open`, readable once the process has exited), which works
for the agent's children and for adopted processes alike; a child is reaped for its exit code.
Readiness: one task probes every port of every running instance (a TCP connect) each
`probe_interval`: all answer -> `ready`; a ready one whose port stops answering -> `unready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from bus.tasks import cancel_and_wait
from schemas.agent import InstanceInfo, InstanceStateName, StartInstance
from services.agent.cgroups import CgroupRoot, Confinement, affinity_confinement
from services.agent.errors import instance_exists, instance_start_failed
from services.agent.state import Record, StateDir, StateLocked
from services.processes import procfs
from services.processes.catalog import Catalog, check_command
from services.processes.ports import free_port
from services.processes.spawn import SpawnError, spawn

__all__ = ["Instances", "StateLocked"]

log = logging.getLogger(__name__)

EventHandler = Callable[[str, InstanceInfo], None]
RUNNING: tuple[InstanceStateName, ...] = ("starting", "ready", "unready")
_ANY_ADDRESS = ("", "0.0.0.0", "::")
_SPAWNING_AT_ONCE = 2  # starts run in threads: a few at a time, so a burst does not starve the loop


class Instances:
    """The instances of one node, persisted in `state_dir` (see the module's docstring)."""

    def __init__(
        self,
        *,
        state_dir: Path,
        catalog: Catalog,
        node: str,
        prefix: str,
        address: str = "127.0.0.1",
        cgroups: CgroupRoot | None = None,
        stop_grace: float = 5.0,
        probe_timeout: float = 0.5,
        probe_interval: float = 0.5,
        on_event: EventHandler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = StateDir(state_dir)
        self.catalog = catalog
        self.node = node
        self.prefix = prefix
        self.address = address
        self.probe_host = "127.0.0.1" if address in _ANY_ADDRESS else address
        self.cgroups = cgroups
        self.stop_grace = stop_grace
        self.probe_timeout = probe_timeout
        self.probe_interval = probe_interval
        self.on_event = on_event or (lambda kind, info: None)
        self.clock = clock
        self._records: dict[str, Record] = {}
        self._children: dict[str, subprocess.Popen] = {}  # instances this agent process started
        self._pidfds: dict[str, int] = {}  # instances whose exit is watched
        self._ports: set[int] = set()  # ports of every known instance, exited ones included
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # per instance: (lock, users)
        self._spawning = asyncio.Semaphore(_SPAWNING_AT_ONCE)
        self._prober: asyncio.Task | None = None

    def marker(self, instance: str) -> str:
        return f"{self.prefix}/{self.node}/{instance}"

    # -- the agent's life -------------------------------------------------------------------------

    async def open(self) -> None:
        """Take the state folder (`StateLocked` if another agent has it) and adopt its instances."""
        self.state.lock()
        try:
            records = self.state.load_all()
            for record in records:
                self._records[record.instance] = record
                self._ports.update(record.ports.values())
            marked: dict[str, int] | None = None
            for record in records:
                if record.state == "exited":
                    continue
                if not record.pid and marked is None:  # read every process's environment once at most
                    marked = procfs.marked_processes(self.marker(""))
                self._adopt(record, marked or {})
        except BaseException:
            self.state.unlock()
            raise
        self._prober = asyncio.create_task(self._probe_forever(), name=f"agent {self.node} probes")

    def _adopt(self, record: Record, marked: dict[str, int]) -> None:
        """Watch the recorded process again; find an intent's process by its marker; record what
        is gone as exited."""
        if not record.pid:
            pid = marked.get(self.marker(record.instance))
            if pid is None:  # the agent died before it spawned the process: nothing runs
                self._exited(record, None)
                return
            record.pid, record.start_time = pid, procfs.start_time(pid) or 0
            self.state.save(record)
            self._emit("started", record)
        if not procfs.is_running(record.pid, record.start_time) or not self._watch(record):
            self._exited(record, None)

    async def close(self) -> None:
        """Stop watching and probing, and give the state folder up. The processes run on: the next
        agent on this folder adopts them."""
        await cancel_and_wait(self._prober)
        self._prober = None
        for instance in list(self._pidfds):
            self._unwatch(instance)
        self.state.unlock()

    async def stop_all(self) -> None:
        """Stop every instance (the agent's `--stop-on-exit`)."""
        await asyncio.gather(*(self.stop(instance) for instance in list(self._records)))

    # -- start ------------------------------------------------------------------------------------

    async def start(self, spec: StartInstance) -> InstanceInfo:
        """Start `spec.instance` unless it exists: then its info, whatever its state (the same id
        with another spec is `instance_exists`). Raises `invalid_argument` for a param the catalog
        refuses, `instance_start_failed` if the process cannot be started."""
        async with self._exclusive(spec.instance):
            record = self._records.get(spec.instance)
            if record is not None:
                if record.spec != spec:
                    raise instance_exists(spec.instance)
                return self._info(record)
            check_command(spec.param, self.catalog)
            return await self._start(spec)

    async def _start(self, spec: StartInstance) -> InstanceInfo:
        record = Record(spec=spec, ports=self._claim_ports(spec.param.ports), started_at=self.clock())
        if self.cgroups is not None and self.cgroups.mode() == "cgroup":
            record.cgroup = self.cgroups.path(self.node, spec.instance)  # known before it is made
        self._records[spec.instance] = record
        self.state.save(record)  # the intent, before anything exists that a crash could orphan
        confinement = self._confine(spec)
        record.cgroup, record.pinning = confinement.path, confinement.pinning
        try:
            async with self._spawning:
                process = await asyncio.to_thread(self._spawn, record, confinement)
        except SpawnError as error:
            await self._forget(record)
            raise instance_start_failed(str(error)) from None
        self._children[spec.instance] = process
        record.pid, record.start_time = process.pid, procfs.start_time(process.pid) or 0
        if not spec.param.ports:
            record.state = "ready"
        self.state.save(record)
        watched = self._watch(record)
        self._emit("started", record)
        if record.state == "ready":
            self._emit("ready", record)
        if not watched:  # gone (and reaped by someone else) before it could be watched
            self._exited(record, None)
        return self._info(record)

    def _confine(self, spec: StartInstance) -> Confinement:
        if self.cgroups is None:
            return affinity_confinement(spec.cpus, spec.memory_limit)
        return self.cgroups.confine(self.node, spec.instance, spec.cpus, spec.mems, spec.memory_limit)

    def _spawn(self, record: Record, confinement: Confinement) -> subprocess.Popen:
        owner = record.spec.owner
        return spawn(
            self.catalog,
            record.spec.param,
            marker=self.marker(record.instance),
            ports=record.ports,
            extra={"BERTH_INSTANCE_INDEX": str(owner.index), "BERTH_RESOURCE_ID": owner.resource_id,
                   "BERTH_ADDRESS": self.address},
            pre_exec=confinement.pre_exec(),
        )

    def _claim_ports(self, names: Iterable[str]) -> dict[str, int]:
        """A free port per name, none of them held by another instance of this agent."""
        ports: dict[str, int] = {}
        for name in names:
            port = free_port()
            while port in self._ports:
                port = free_port()
            self._ports.add(port)
            ports[name] = port
        return ports

    # -- exit -------------------------------------------------------------------------------------

    def _watch(self, record: Record) -> bool:
        """Be called back when the recorded process exits; False if it is already gone (or its pid
        is somebody else's now). The start time is compared after the pidfd is open: from then on the
        pidfd names that process, even if the pid is reused."""
        try:
            fd = os.pidfd_open(record.pid)
        except ProcessLookupError:
            return False
        if procfs.start_time(record.pid) != record.start_time:
            os.close(fd)
            return False
        self._pidfds[record.instance] = fd
        asyncio.get_running_loop().add_reader(fd, self._on_exit, record.instance)
        return True

    def _unwatch(self, instance: str) -> None:
        fd = self._pidfds.pop(instance, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _on_exit(self, instance: str) -> None:
        self._unwatch(instance)
        record = self._records.get(instance)
        if record is not None and record.state != "exited":
            self._exited(record, self._reap(instance))

    def _reap(self, instance: str) -> int | None:
        """The exit code of our child `instance` (negative: killed by that signal); None for an
        adopted process, whose exit status went to its new parent."""
        child = self._children.pop(instance, None)
        return child.poll() if child is not None else None

    def _exited(self, record: Record, exit_code: int | None) -> None:
        record.state, record.exit_code, record.exited_at = "exited", exit_code, self.clock()
        self.state.save(record)
        self._emit("exited", record)

    # -- readiness --------------------------------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception:  # a bug here must not end readiness for good
                log.exception("agent %s: probing instances failed", self.node)
            await asyncio.sleep(self.probe_interval)

    async def probe(self, instances: Iterable[str] | None = None) -> None:
        """One round: every port of every running instance (or of those named), at once."""
        chosen = self._records.values() if instances is None else filter(None, map(self._records.get, instances))
        records = [r for r in chosen if r.pid and r.state in RUNNING and r.ports]
        answers = await asyncio.gather(*(self._answers_all(record) for record in records))
        for record, ready in zip(records, answers):
            if self._records.get(record.instance) is not record or record.state not in RUNNING:
                continue  # stopped or exited during the round
            if ready and record.state != "ready":
                self._change(record, "ready")
            elif not ready and record.state == "ready":
                self._change(record, "unready")

    async def _answers_all(self, record: Record) -> bool:
        return all(await asyncio.gather(*(self._answers(port) for port in record.ports.values())))

    async def _answers(self, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(self.probe_host, port), self.probe_timeout
            )
        except (TimeoutError, OSError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    def _change(self, record: Record, state: InstanceStateName) -> None:
        record.state = state
        self.state.save(record)  # a restarted agent reports what this one last saw
        self._emit(state, record)

    # -- stop -------------------------------------------------------------------------------------

    async def stop(self, instance: str) -> bool:
        """Stop the process group (SIGTERM, SIGKILL after `stop_grace`), remove the cgroup, free the
        ports, forget the instance; False if there was none (a second stop)."""
        async with self._exclusive(instance):
            record = self._records.get(instance)
            if record is None:
                return False
            self._unwatch(instance)  # its exit is this stop's doing: `stopped`, not `exited`
            if record.pid:
                await procfs.stop_group(record.pid, record.start_time, self.stop_grace)
                await self._gone(record)
            if record.state != "exited":
                record.state, record.exit_code, record.exited_at = "exited", self._reap(instance), self.clock()
            await self._forget(record)
            self._emit("stopped", record)
            return True

    async def _gone(self, record: Record, timeout: float = 5.0, poll: float = 0.01) -> None:
        """Wait (a little) for the leader to be gone: `stop_group` returns as soon as it has sent
        SIGKILL, and the exit code and an empty cgroup come only once the kernel is done with it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while procfs.is_running(record.pid, record.start_time) and loop.time() < deadline:
            await asyncio.sleep(poll)

    async def _forget(self, record: Record) -> None:
        self._children.pop(record.instance, None)
        if record.cgroup:
            if self.cgroups is not None:
                await self.cgroups.remove(record.cgroup)
            else:
                log.warning("instance %s: cgroup %s left (the agent runs without cgroups)",
                            record.instance, record.cgroup)
        self._ports.difference_update(record.ports.values())
        self.state.delete(record.instance)
        del self._records[record.instance]

    @contextlib.asynccontextmanager
    async def _exclusive(self, instance: str) -> AsyncIterator[None]:
        """One start or stop of `instance` at a time; the lock lives only while someone uses it."""
        lock, users = self._locks.get(instance, (asyncio.Lock(), 0))
        self._locks[instance] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[instance]
            if users == 1:
                del self._locks[instance]
            else:
                self._locks[instance] = (lock, users - 1)

    # -- queries ----------------------------------------------------------------------------------

    def get(self, instances: Iterable[str]) -> tuple[list[InstanceInfo], list[str]]:
        """The info of each known id, and the ids not known."""
        found, missing = [], []
        for instance in instances:
            record = self._records.get(instance)
            if record is None:
                missing.append(instance)
            else:
                found.append(self._info(record))
        return found, missing

    def list(self) -> list[InstanceInfo]:
        return [self._info(self._records[i]) for i in sorted(self._records)]

    def __len__(self) -> int:
        return len(self._records)

    def running(self) -> int:
        """Instances not exited (those still starting included)."""
        return sum(1 for record in self._records.values() if record.state in RUNNING)

    def held_workloads(self) -> dict[str, tuple[str, float]]:
        """{instance: (workload id, started at)} of the instances that hold a workload: the agent
        compares them with the node's allocation ledger."""
        return {
            instance: (record.spec.workload_id, record.started_at)
            for instance, record in self._records.items()
            if record.spec.workload_id
        }

    def _info(self, record: Record) -> InstanceInfo:
        spec = record.spec
        return InstanceInfo(
            instance=spec.instance,
            state=record.state,
            address=self.address,
            ports=dict(record.ports),
            pid=record.pid,
            image=spec.param.image,
            cpus=list(spec.cpus),
            mems=list(spec.mems),
            memory_limit=spec.memory_limit,
            workload_id=spec.workload_id,
            owner=spec.owner,
            pinning=record.pinning,
            cgroup=record.cgroup,
            started_at=record.started_at,
            exit_code=record.exit_code,
            exited_at=record.exited_at,
        )

    def _emit(self, kind: str, record: Record) -> None:
        try:
            self.on_event(kind, self._info(record))
        except Exception:  # the handler's failure is not the instance's
            log.exception("agent %s: handling event %s of %s failed", self.node, kind, record.instance)
