"""The `process` operator: each instance is a local process started from an entry of the catalog.

- `image` names an entry of the operator-side catalog (`services/processes/catalog.py`): its argv
  is run directly (no shell), with placeholders filled from the process's variables; a request
  cannot add a command, an argument or a variable the entry did not ask for. Processes are started
  by `services/processes/spawn.py`, which the agent shares.
- Every process gets free loopback ports as `PORT_<NAME>` (name upper-cased, `-` -> `_`), its host
  directories as `VOLUME_<NAME>`, and `BERTH_INSTANCE=<prefix>/<user>/<id>/<index>` as a marker;
  nothing of the broker's own environment but what `catalog.py` lists (no `REDIS_URL`).
- It runs in its own session (so it outlives a broker restart), as the entry's `user` if it names
  one, and, when an allocation bound CPUs for it, pinned to those CPUs.
- Status: `staging` while some instance is starting, `running` once a TCP connect succeeds on every
  port of every instance, `failed` if an instance exited (once none is still starting).
- Release: SIGTERM to the process group, SIGKILL after a grace period.

Each process is recorded in Redis (pid, start time, process group, ports, CPUs) before the launch
returns; the intent is recorded before the process starts, so that a broker that dies in between
is followed by one that finds the process by its marker instead of starting a second one. Two
launches of one resource may overlap (one paused past its launch lease, and the one that took it
over): each records its intent and its process only over the slot it started from, so one keeps
the instance and the other stops the process it started (`set_slot.lua`). The records and their
keys are in process_store.py (`ProcessTable`); this module only uses them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import msgspec

from schemas.broker import BlockDetail, Endpoint, ResourceParam, ServiceInfo
from services.broker.operators.base import LaunchSpec, OperatorError, service_info
from services.broker.operators.process_store import ProcessTable, Slot
from services.broker.views import unreserved
from services.processes import procfs
from services.processes.catalog import Catalog, check_command
from services.processes.ports import free_port
from services.processes.spawn import SpawnError, spawn

BLOCK = "local"


def alive(slot: Slot) -> bool:
    """The recorded process still runs (a zombie, or a pid reused by another process, does not)."""
    return bool(slot.pid) and procfs.is_running(slot.pid, slot.start_time)


async def stop_deployment(deployment: str, grace: float = 5.0) -> int:
    """Stop every process group launched for `deployment` (the `DEPLOYMENT` value `berth up` gave
    its workers, once they have stopped); how many. Their records stay: on the next start the
    broker finds them exited, drops dead idle ones from warm pools, and reports the rest `failed`."""
    groups = set()
    for pid in procfs.processes_with(procfs.DEPLOYMENT, deployment):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    await asyncio.gather(*(procfs.stop_group(pgid, procfs.start_time(pgid) or 0, grace) for pgid in groups))
    return len(groups)


class ProcessOperator:
    name = "process"

    def __init__(
        self,
        table: ProcessTable,
        *,
        prefix: str,
        max_instances: int = 64,
        stop_grace: float = 5.0,
        probe_timeout: float = 0.5,
        host: str = "127.0.0.1",
        workdir: str | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self.table = table
        self.catalog = catalog or Catalog.load(None)
        self.prefix = prefix
        self.max_instances = max_instances
        self.stop_grace = stop_grace
        self.probe_timeout = probe_timeout
        self.host = host
        self.workdir = workdir
        # Processes this broker process started: polled so that they are reaped when they exit.
        self._children: dict[int, subprocess.Popen] = {}
        # Starts run in threads; a few at a time, so that a pool refill does not starve the event loop.
        self._starting = asyncio.Semaphore(2)

    def validate(self, param: ResourceParam) -> None:
        check_command(param, self.catalog)

    def block_key(self, param: ResourceParam) -> str:
        return BLOCK  # any city and platform: one machine, one pool of `max_instances`

    async def free_instances(self, param: ResourceParam) -> int:
        return max(0, self.max_instances - await self.table.count())

    async def blocks(self) -> list[BlockDetail]:
        used = await self.table.count()
        return [unreserved(BLOCK, self.max_instances, used, max(0, self.max_instances - used))]

    def marker(self, user: str, resource_id: str, index: int | str = "") -> str:
        return f"{self.prefix}/{user}/{resource_id}/{index}"

    def _marked(self, user: str, resource_id: str) -> dict[int, int]:
        """This resource's live processes by their marker: instance index -> pid."""
        mine = self.marker(user, resource_id)
        found = {}
        for marker, pid in procfs.marked_processes(mine).items():
            resource, _, index = marker.rpartition("/")
            if resource + "/" == mine and index.isdigit():  # not those of an id that only starts alike
                found[int(index)] = pid
        return found

    # -- launch ----------------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec, cpus: dict[int, list[int]] | None = None) -> None:
        self._reap()
        slots = await self.table.load(spec.user, spec.resource_id)
        found: dict[int, int] | None = None
        for index in range(spec.instances):
            slot = slots.get(index)
            if slot is not None and slot.pid:
                continue
            if slot is not None:
                # Only an intent: a launch died (or paused) after recording it. Its process may exist.
                if found is None:
                    found = self._marked(spec.user, spec.resource_id)
                pid = found.get(index)
                if pid is not None:
                    await self._record(spec, index, slot, pid)
                    continue
            intent = await self._intent(spec, index, slot, (cpus or {}).get(index, []))
            if intent is None:
                continue  # another launch of this resource took the instance meanwhile
            # Starting a process blocks until it has exec'ed, which takes long on a busy machine:
            # in a thread, so that the event loop keeps serving (apply latency).
            async with self._starting:
                proc = await asyncio.to_thread(self._spawn, spec, index, intent)
            self._children[proc.pid] = proc
            await self._record(spec, index, intent, proc.pid)

    async def _intent(self, spec: LaunchSpec, index: int, seen: Slot | None, cpus: list[int]) -> Slot | None:
        """Record the intent to start instance `index` in place of `seen` (no slot, or an intent
        whose process never started); None if another launch changed the slot first. Its ports are
        new, not `seen`'s: the launch that recorded `seen` may only be paused, and start its process
        on those ports when it resumes (before it finds it lost the instance; `seen`'s ports stay
        handed out for that reason)."""
        intent = Slot(ports=await self._free_ports(spec.param.ports), cpus=cpus)
        if await self.table.set_slot(spec.user, spec.resource_id, index, seen, intent) == intent:
            return intent
        await self.table.free_ports(list(intent.ports.values()))
        return None

    async def _record(self, spec: LaunchSpec, index: int, intent: Slot, pid: int) -> None:
        """Record `pid` as instance `index`, started from `intent`. If another launch of the
        resource took the instance meanwhile, or the resource was released, the process is stopped
        instead: no instance may run twice, nor run untracked."""
        started = procfs.start_time(pid) or 0
        slot = msgspec.structs.replace(intent, pid=pid, pgid=pid, start_time=started)
        now = await self.table.set_slot(spec.user, spec.resource_id, index, intent, slot)
        if now is None or now.pid != pid:
            await procfs.stop_group(pid, started, self.stop_grace)
            self._reap()

    async def _free_ports(self, names: dict[str, str]) -> dict[str, int]:
        ports: dict[str, int] = {}
        for name in names:
            port = free_port()
            while not await self.table.claim_port(port):  # another instance holds it already
                port = free_port()
            ports[name] = port
        return ports

    def _spawn(self, spec: LaunchSpec, index: int, slot: Slot) -> subprocess.Popen:
        cpus = set(slot.cpus)
        try:
            return spawn(
                self.catalog,
                spec.param,
                marker=self.marker(spec.user, spec.resource_id, index),
                ports=slot.ports,
                extra={"BERTH_INSTANCE_INDEX": str(index), "BERTH_RESOURCE_ID": spec.resource_id,
                       "BERTH_ADDRESS": self.host},
                cwd=self.workdir,
                # Pinned before it runs a single instruction of its own (children inherit it).
                pre_exec=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        except SpawnError as error:
            raise OperatorError(str(error)) from None

    # -- status ----------------------------------------------------------------------------------

    async def status(self, user: str, resource_id: str) -> ServiceInfo:
        self._reap()
        slots = await self.table.load(user, resource_id)
        states = await asyncio.gather(*(self._state(slot) for slot in slots.values()))
        endpoints = [
            Endpoint(ip=self.host, ports=dict(slot.ports), name=f"{resource_id}-{index}")
            for (index, slot), state in zip(slots.items(), states)
            if state == "ready"
        ]
        return service_info(endpoints, len(slots), states.count("starting"), states.count("dead"))

    async def running_instances(self, user: str, resource_ids: list[str]) -> list[int]:
        every = await self.table.load_many(user, resource_ids)
        return [sum(1 for slot in slots.values() if alive(slot)) for slots in every]

    async def lost_instances(self, user: str, resource_id: str) -> int:
        return 0  # this host's own processes: one that is gone exited (its node is the broker's)

    async def _state(self, slot: Slot) -> str:
        if not slot.pid:
            return "starting"
        if not alive(slot):
            return "dead"
        answers = await asyncio.gather(*(self._answers(port) for port in slot.ports.values()))
        return "ready" if all(answers) else "starting"

    async def _answers(self, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(self.host, port), self.probe_timeout)
        except (TimeoutError, OSError):
            return False
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True

    # -- release ---------------------------------------------------------------------------------

    async def release(self, user: str, resource_id: str, instances: int = 0) -> None:
        slots = await self.table.load(user, resource_id)
        groups = [(slot.pgid, slot.start_time) for slot in slots.values() if slot.pid]
        if any(not slot.pid for slot in slots.values()):
            # Intents without a pid: their processes, if any, are only known by their marker.
            for pid in self._marked(user, resource_id).values():
                groups.append((pid, procfs.start_time(pid) or 0))
        await asyncio.gather(
            *(procfs.stop_group(pgid, started, self.stop_grace) for pgid, started in set(groups))
        )
        self._reap()
        await self.table.delete(user, resource_id, slots)

    def _reap(self) -> None:
        """Collect the exit status of children that ended (possibly released by another replica)."""
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]
