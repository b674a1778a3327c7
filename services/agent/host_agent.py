"""One host's agent: it registers the host as a node, keeps the node's lease, runs the instances
the broker places there, and tells its node's metrics which cgroups are whose.

- Registration: the host is read (`host.py`) and offered less the reservations: `add-node` the
  first time, then `set-node-resource-capacity` (absolute: usage and the ledger stay as they are)
  whenever the host changes (a CPU unplugged, a disk added). Labels given to the agent are set.
- Lease: a heartbeat every `--heartbeat` seconds renews it for `--ttl`; the allocation service
  marks the node down when it lapses (services/allocation/leases.py).
- Reconcile: an instance started for a workload lives while the node's ledger holds that workload.
  On start, after the node was down, and every `--reconcile-interval`, instances whose workload
  was released (by the broker, while this agent was away) are stopped: nothing runs that nothing
  will release.
- Draining: `drain` takes the node out of new placements (kept across restarts in the state
  folder) and refuses new starts; what runs goes on until its owners release it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from bus.client import BusClient
from bus.events import EventBus
from bus.tasks import cancel_and_wait, every
from schemas.agent import AgentEvent, AgentInfo, InstanceEvent, InstanceInfo, StartInstance
from schemas.errors import BusError, answered_nothing
from services.agent.config import AgentServiceConfig
from services.agent.errors import already_registered, node_draining, not_registered
from services.agent.host import describe, node_resource, read_host
from services.agent.instances import Instances
from services.metrics.cgroups import PodCgroups

log = logging.getLogger("berth.agent")


class HostAgent:
    def __init__(
        self, config: AgentServiceConfig, instances: Instances, allocation: BusClient, events: EventBus,
        *, pods: dict[str, PodCgroups] | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.instances = instances
        self.allocation = allocation
        self.events = events
        # The metrics agent's view of which cgroup is whose (`CgroupProvisioner.pods`): this agent
        # fills it as instances start and stop.
        self.pods = pods if pods is not None else {}
        self.capacity: dict = {}
        self.status = "up"
        self.started_at = time.time()
        self._draining_file = Path(config.state) / "draining"
        self._loops: list[asyncio.Task] = []
        self._publishing: set[asyncio.Task] = set()
        self._reconciled = False
        self._answered = False  # the allocation service has answered a beat of this agent

    @property
    def draining(self) -> bool:
        return self._draining_file.exists()

    # -- life ----------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Adopt what runs (before the agent serves: a start or stop must find it)."""
        await self.instances.open()
        for info in self.instances.list():
            self._note_pod(info)

    async def come_up(self) -> None:
        """Once the agent serves: register the host, take the lease and stop what was released
        meanwhile, at once if the allocation service answers, else as soon as it does. Not before
        it serves: a node is up only when its agent answers."""
        await self._beat()
        self._loops = [
            asyncio.create_task(every(self.config.heartbeat, self._beat, "heartbeat"), name="heartbeat"),
            asyncio.create_task(self._reconcile_every(), name="reconcile"),
        ]

    async def close(self) -> None:
        await cancel_and_wait(*self._loops)
        if self.config.stop_on_exit:
            await self.instances.stop_all()
        await self.instances.close()
        await cancel_and_wait(*self._publishing, timeout=2)

    async def _reconcile_every(self) -> None:
        await asyncio.sleep(self.config.reconcile_interval)
        await every(self.config.reconcile_interval, self.reconcile, "reconcile")

    # -- registration and lease ----------------------------------------------------------------------

    def _own(self, command: str) -> str:
        """The allocation subject of `command` for this node: the only ones an agent's identity may
        publish on (berth/accounts.py)."""
        return f"resource.node.{self.node}.{command}"

    async def register(self) -> None:
        """Offer the host as it is now: a new node, or the existing one's capacity if it changed."""
        host = await asyncio.to_thread(read_host, self.config.metrics.root)
        capacity = node_resource(host, reserve_cpu=self.config.reserve_cpu, reserve_memory=self.config.reserve_memory)
        if capacity == self.capacity:
            return
        try:
            await self.allocation.request(self._own("add-node"), {
                "nodename": self.node, "resource": capacity, "labels": self.config.labels}, dict)
            kind = "registered"
        except BusError as error:
            if not already_registered(error):
                raise
            await self.allocation.request(self._own("set-node-resource-capacity"), {
                "nodename": self.node, "resource_request": capacity, "delta": False}, dict)
            if self.config.labels:
                await self.allocation.request(self._own("set-node-labels"), {
                    "nodename": self.node, "labels": self.config.labels}, dict)
            kind = "registered" if not self.capacity else "capacity"
        log.info("node %s %s: %s", self.node, kind, describe(host))
        self.capacity = capacity
        self._publish(f"host.{kind}", AgentEvent(type=kind, node=self.node, status=self.status, capacity=capacity))

    async def heartbeat(self) -> None:
        """Renew the node's lease; after a time down, stop what was released meanwhile."""
        report = {"address": self.config.address, "instances": len(self.instances),
                  "running": self.instances.running(), "pinning": self.pinning, "started_at": self.started_at}
        try:
            beat = await self.allocation.request(self._own("node-heartbeat"), {
                "nodename": self.node, "ttl_seconds": self.config.ttl, "draining": self.draining,
                "agent": report}, dict, timeout=self.config.heartbeat)
        except BusError as error:
            if not not_registered(error):
                raise
            log.warning("node %s was removed: registering it again", self.node)
            self.capacity = {}
            await self.register()
            return
        self.status = "draining" if self.draining else "up"
        if beat["was"] == "down":
            log.warning("node %s was down (its lease had lapsed): comparing instances with its ledger", self.node)
            await self.reconcile()

    async def _beat(self) -> None:
        """Offer the host if it changed (or was never offered), renew the lease; the first time the
        node is known, and after any beat that went unanswered, stop what was released while no
        agent watched. The allocation service away (starting, restarting, a cut link) is said in
        one line: the next beat tries again. Before it has ever answered (the agent starting beside
        it, as in `berth up`), that is waiting, not a fault: said at INFO."""
        try:
            await self.register()
            await self.heartbeat()
            self._answered = True
            if not self._reconciled:
                await self.reconcile()
                self._reconciled = True
        except BusError as error:
            if not answered_nothing(error):
                raise
            # The beat that finds the node down may be the one whose answer is lost (sent when the
            # link comes back, answered to a request that timed out): after any silence, the next
            # beat that is answered compares instances with the ledger.
            self._reconciled = False
            if not self._answered:
                log.info("node %s: waiting for the allocation service to register the node (%s); asking again "
                         "in %.1f s", self.node, error.code, self.config.heartbeat)
                return
            log.warning("node %s: the allocation service does not answer (%s); trying again in %.1f s",
                        self.node, error.code, self.config.heartbeat)

    # -- instances -----------------------------------------------------------------------------------

    async def start(self, spec: StartInstance) -> InstanceInfo:
        found, _ = self.instances.get([spec.instance])
        if self.draining and not found:
            raise node_draining(self.node)
        return await self.instances.start(spec)

    async def reconcile(self) -> list[str]:
        """Stop the instances whose workload the node's ledger no longer holds; the ones stopped.
        Only instances recorded before the ledger was read: a start that comes after the read was
        placed after it, and its workload may be newer than what was read."""
        held = self.instances.held_workloads()
        if not held:
            return []
        read_at = time.time()
        reply = await self.allocation.request(self._own("get-allocations"), {"nodename": self.node}, dict)
        ledger = {a["workload_id"] for a in reply["allocations"]}
        stale = [instance for instance, (workload, started) in held.items()
                 if workload not in ledger and started < read_at]
        for instance in stale:
            log.warning("instance %s: its workload was released; stopping it", instance)
            await self.instances.stop(instance)
        return stale

    async def set_draining(self, draining: bool) -> None:
        if draining == self.draining:
            return
        if draining:
            self._draining_file.write_text("draining\n")
        else:
            self._draining_file.unlink(missing_ok=True)
        await self.heartbeat()  # the allocation service learns it now, not at the next beat
        kind = "draining" if draining else "resumed"
        self._publish(f"host.{kind}", AgentEvent(type=kind, node=self.node, status=self.status,
                                                 capacity=self.capacity))

    @property
    def pinning(self) -> str:
        cgroups = self.instances.cgroups
        return cgroups.mode() if cgroups is not None else "affinity"

    def info(self) -> AgentInfo:
        return AgentInfo(
            node=self.node, status="draining" if self.draining else "up", address=self.config.address,
            instances=len(self.instances), running=self.instances.running(), pinning=self.pinning,
            started_at=self.started_at, heartbeat_seconds=self.config.heartbeat, ttl_seconds=self.config.ttl,
            capacity=self.capacity,
        )

    # -- events --------------------------------------------------------------------------------------

    def on_instance(self, kind: str, info: InstanceInfo) -> None:
        """`Instances` tells of every change: the metrics learn the cgroup, subscribers the change."""
        self._note_pod(info)
        self._publish(kind, InstanceEvent(
            type=kind, node=self.node, instance=info.instance, state=info.state, workload_id=info.workload_id,
            owner=info.owner, pid=info.pid, exit_code=info.exit_code,
        ))

    def _note_pod(self, info: InstanceInfo) -> None:
        """The instance's cgroup as a pod of one container for the metrics agent: `metrics.<node>.get`
        with `pod_uid` the instance id and `container` its image answers for it."""
        if info.cgroup and info.state != "exited":
            self.pods[info.instance] = PodCgroups(info.instance, info.cgroup, {info.image: info.cgroup})
        else:
            self.pods.pop(info.instance, None)

    def _publish(self, suffix: str, event) -> None:
        """Publish on `agent.<node>.<suffix>` (an instance's `<kind>`, the host's `host.<kind>`)."""
        task = asyncio.get_running_loop().create_task(self._send(f"agent.{self.node}.{suffix}", event))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _send(self, subject: str, event) -> None:
        try:
            await self.events.publish(subject, event)
        except Exception as error:  # the broker also asks (status): an event lost is a moment lost
            log.warning("could not publish %s: %r", subject, error)
