"""The `allocation` operator: instances are placed by the allocation service, then run by the agent
of the node each was placed on (`berth agent`, docs/agents.md).

- A resource's capacity block is "<platform>/<city>": the nodes whose labels (`--city-label`,
  `--platform-label`) hold that city and platform.
- An instance is one `resource.allocate` of the instance type for (platform, group = city) from
  the configuration. The node's agent starts it (`agent.<node>.start`), pinned to the CPUs and NUMA
  nodes the allocation bound, within the instance type's memory; the instance's id is its
  workload id, so the agent stops it by itself once the workload is released.
- Free capacity for `launch` is what the allocation service says those nodes can still take.
- Status comes from the agents; an instance on a node whose agent's lease lapsed (`down`) is lost,
  as an exited one: the resource is `failed`, and a warm pool replaces it elsewhere.
- Release stops the instances through their agents, then frees the allocations. An agent that
  does not answer while its node is up fails the release (retried); on a node that is down, the
  instance is left to its agent, which stops it when it comes back (the workload is gone).

Placements are kept in Redis (index -> node, CPUs, NUMA nodes, memory), and each node's resources
(for the node's `down` event): `PlacementTable` in allocation_store.py keeps them and their keys.
Each allocate carries a `request_id` derived from the instances it places, so a launch retried after
a crash gets the same placement back instead of a second one; an agent's start is idempotent by
instance id.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

from bus.client import BusClient
from schemas.agent import (
    InstanceInfo,
    InstanceParam,
    InstancesReply,
    Owner,
    StartInstance,
    Stopped,
    Volume,
)
from schemas.allocation import AllocateReply, ListNodesReply, NodeSummary
from schemas.broker import BlockDetail, Endpoint, ResourceParam, ServiceInfo
from schemas.errors import BusError, NoResponders
from services.broker.config import InstanceTypes
from services.broker.operators.allocation_store import Placement, PlacementTable
from services.broker.operators.base import LaunchSpec, OperatorError, service_info
from services.broker.views import unreserved
from services.processes.catalog import Catalog, check_command

PAGE = 1000
# An agent's error codes that say "nobody answers there", not "it refused".
UNREACHABLE = ("no_responders", "timeout")
RUNNING_STATES = ("starting", "ready", "unready")
SERVED_POLL = 0.1  # seconds between looks for an allocation service to serve, while waiting for one


def workload_id(user: str, resource_id: str, index: int) -> str:
    """The allocation service's id for one instance (ids of at most 256 characters), also the
    instance's id on its agent."""
    name = f"broker/{user}/{resource_id}/{index}"
    if len(name) <= 256:
        return name
    digest = hashlib.blake2b(resource_id.encode(), digest_size=16).hexdigest()
    return f"broker/{user}/{digest}/{index}"


@dataclass(frozen=True)
class BlockLabels:
    """The node labels that hold a capacity block's city and platform."""

    city: str = "city"
    platform: str = "platform"

    def selector(self, param: ResourceParam) -> dict[str, str]:
        """The labels of the nodes of `param`'s block."""
        return {self.city: param.city, self.platform: param.platform}

    def block_of(self, node: NodeSummary) -> tuple[str, str]:
        """(platform, city) of the block `node` belongs to."""
        return node.labels.get(self.platform, ""), node.labels.get(self.city, "")


def bound(engine_params: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The CPUs an allocation bound, and the NUMA node it bound them on (none: not bound)."""
    cpumem = engine_params.get("cpumem") or {}
    cpus = sorted(int(core) for core in (cpumem.get("cpu_map") or {}))
    numa = cpumem.get("numa_node")
    return cpus, [int(numa)] if cpus and numa not in (None, "") else []


class AllocationOperator:
    name = "allocation"

    def __init__(
        self,
        table: PlacementTable,
        client: BusClient,
        types: InstanceTypes,
        *,
        catalog: Catalog | None = None,
        city_label: str = "city",
        platform_label: str = "platform",
        bind_cpus: bool = True,
        placement: str = "spread",
        agent_timeout: float = 5.0,
    ) -> None:
        self.table = table
        self.client = client
        self.types = types
        self.catalog = catalog or Catalog.load(None)
        self.labels = BlockLabels(city_label, platform_label)
        self.bind_cpus = bind_cpus
        self.placement = placement
        self.agent_timeout = agent_timeout

    def validate(self, param: ResourceParam) -> None:
        """The agents run the same catalog as the broker: a param it refuses, they would refuse."""
        check_command(param, self.catalog)

    def block_key(self, param: ResourceParam) -> str:
        return f"{param.platform}/{param.city}"

    def _request(self, platform: str, city: str) -> dict[str, Any]:
        size = self.types.get(platform, city)
        return {
            "cpumem": {
                "cpu-bind": self.bind_cpus,
                "cpu-request": size.cpu_per_instance,
                "memory-request": size.mem_per_instance,
            }
        }

    async def _call(self, command: str, payload: dict[str, Any], reply: type, *, wait: float = 0.0):
        """`wait`: seconds to wait, while no allocation service serves, for one to (it may be starting)."""
        give_up = time.monotonic() + wait
        while True:
            try:
                return await self.client.request(f"resource.{command}", payload, reply)
            except BusError as error:
                if isinstance(error, NoResponders) and time.monotonic() < give_up:
                    await asyncio.sleep(SERVED_POLL)
                    continue
                raise OperatorError(f"allocation service, {command}: {error.code}: {error.message}") from None

    async def _nodes(self, labels: dict[str, str] | None = None, names: list[str] | None = None) -> list[NodeSummary]:
        nodes: list[NodeSummary] = []
        selection: dict[str, Any] = {"labels": labels or {}} if names is None else {"nodenames": names}
        while True:
            page = await self._call("list-nodes", {**selection, "offset": len(nodes), "limit": PAGE}, ListNodesReply)
            nodes += page.nodes
            if not page.nodes or len(nodes) >= page.total:
                return nodes

    async def _free(self, nodenames: list[str], platform: str, city: str) -> int:
        if not nodenames:
            return 0
        reply = await self._call(
            "get-nodes-deploy-capacity",
            {"nodenames": nodenames, "workload_resource_request": self._request(platform, city)},
            dict,
        )
        return int(reply["total"])

    async def free_instances(self, param: ResourceParam) -> int:
        nodes = await self._nodes(self.labels.selector(param))
        return await self._free([n.nodename for n in nodes if n.status == "up"], param.platform, param.city)

    async def blocks(self) -> list[BlockDetail]:
        by_block: dict[tuple[str, str], list[NodeSummary]] = {}
        for node in await self._nodes():
            by_block.setdefault(self.labels.block_of(node), []).append(node)
        blocks = []
        for (platform, city), nodes in sorted(by_block.items()):
            cpumem = [((n.capacity.get("cpumem") or {}), (n.usage.get("cpumem") or {})) for n in nodes]
            cpu_total, cpu_used = (
                sum(c.get("cpu", 0) for c, _ in cpumem),
                sum(u.get("cpu", 0) for _, u in cpumem),
            )
            mem_total, mem_used = (
                sum(c.get("memory", 0) for c, _ in cpumem),
                sum(u.get("memory", 0) for _, u in cpumem),
            )
            free = await self._free([n.nodename for n in nodes if n.status == "up"], platform, city)
            size = self.types.get(platform, city)
            used = int(
                min(
                    cpu_used / size.cpu_per_instance if size.cpu_per_instance else 0,
                    mem_used / size.mem_per_instance if size.mem_per_instance else 0,
                )
            )
            blocks.append(
                unreserved(
                    f"{platform}/{city}",
                    free + used,
                    used,
                    free,
                    cpu_total=cpu_total,
                    cpu_used=cpu_used,
                    mem_total=mem_total,
                    mem_used=mem_used,
                )
            )
        return blocks

    # -- placements ------------------------------------------------------------------------------

    async def resources_on(self, node: str) -> list[tuple[str, str]]:
        """(user, resource id) of the resources with an instance placed on `node`."""
        return await self.table.resources_on(node)

    async def _allocate(self, spec: LaunchSpec, indexes: list[int]) -> dict[int, Placement]:
        param = spec.param
        selector = self.labels.selector(param)
        ids = [workload_id(spec.user, spec.resource_id, i) for i in indexes]
        digest = hashlib.blake2b("\0".join(ids).encode(), digest_size=16).hexdigest()
        memory = self.types.get(param.platform, param.city).mem_per_instance
        reply = await self._call(
            "allocate",
            {
                "labels": selector,
                "strategy": self.placement,
                "deploy_count": len(ids),
                "workload_resource_request": self._request(param.platform, param.city),
                "workload_ids": ids,
                "request_id": f"broker-launch-{digest}",
            },
            AllocateReply,
        )
        by_id = {a.workload_id: a for a in reply.allocations}
        placed = {i: Placement(by_id[wid].nodename, *bound(by_id[wid].engine_params), memory)
                  for i, wid in zip(indexes, ids)}
        await self.table.record(spec.user, spec.resource_id, placed)
        return placed

    # -- the agents ------------------------------------------------------------------------------

    async def _agent(self, node: str, command: str, payload: Any, reply: type):
        return await self.client.request(f"agent.{node}.{command}", payload, reply, timeout=self.agent_timeout)

    async def _start(self, spec: LaunchSpec, index: int, placement: Placement) -> InstanceInfo:
        param = spec.param
        start = StartInstance(
            instance=workload_id(spec.user, spec.resource_id, index),
            param=InstanceParam(image=param.image, env=param.env, ports=param.ports, volumes={
                name: Volume(volume.host_dir, volume.container_dir) for name, volume in param.volumes.items()}),
            cpus=placement.cpus, mems=placement.mems, memory_limit=placement.memory,
            workload_id=workload_id(spec.user, spec.resource_id, index),
            owner=Owner(spec.user, spec.resource_id, index),
        )
        try:
            return await self._agent(placement.nodename, "start", start, InstanceInfo)
        except BusError as error:
            raise OperatorError(f"agent of {placement.nodename}, start: {error.code}: {error.message}") from None

    async def _states(self, user: str, resource_id: str, placed: dict[int, Placement]) -> dict[int, InstanceInfo | str]:
        """Each instance as its agent reports it, or "lost" (its node is down or gone, or its agent
        knows it not) or "unknown" (its agent does not answer, its node is up)."""
        by_node: dict[str, list[int]] = {}
        for index, placement in placed.items():
            by_node.setdefault(placement.nodename, []).append(index)
        replies = await asyncio.gather(*(
            self._agent(node, "status", {"instances": [workload_id(user, resource_id, i) for i in indexes]},
                        InstancesReply)
            for node, indexes in by_node.items()
        ), return_exceptions=True)
        silent = [node for node, reply in zip(by_node, replies) if isinstance(reply, BaseException)]
        down = await self._down(silent)
        states: dict[int, InstanceInfo | str] = {}
        for (node, indexes), reply in zip(by_node.items(), replies):
            if isinstance(reply, BaseException):
                if not isinstance(reply, BusError):
                    raise reply
                for index in indexes:
                    states[index] = "lost" if node in down else "unknown"
                continue
            known = {info.instance: info for info in reply.instances}
            for index in indexes:
                states[index] = known.get(workload_id(user, resource_id, index), "lost")
        return states

    async def _down(self, nodes: list[str]) -> set[str]:
        """Those of `nodes` that are down (their agent's lease lapsed) or gone."""
        if not nodes:
            return set()
        up = {n.nodename for n in await self._nodes(names=nodes) if n.status != "down"}
        return set(nodes) - up

    # -- the operator interface ------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> None:
        placed = await self.table.load(spec.user, spec.resource_id)
        missing = [i for i in range(spec.instances) if i not in placed]
        if missing:
            placed.update(await self._allocate(spec, missing))
        await asyncio.gather(*(self._start(spec, i, placed[i]) for i in range(spec.instances)))

    async def status(self, user: str, resource_id: str) -> ServiceInfo:
        placed = await self.table.load(user, resource_id)
        states = await self._states(user, resource_id, placed)
        endpoints = [
            Endpoint(ip=info.address, ports=dict(info.ports), name=f"{resource_id}-{index}")
            for index, info in states.items()
            if isinstance(info, InstanceInfo) and info.state == "ready"
        ]
        exited = sum(1 for info in states.values() if isinstance(info, InstanceInfo) and info.state == "exited")
        lost = sum(1 for info in states.values() if info == "lost")
        starting = len(placed) - len(endpoints) - exited - lost
        return service_info(endpoints, len(placed), starting, exited, lost)

    async def running_instances(self, user: str, resource_ids: list[str]) -> list[int]:
        async def running(resource_id: str) -> int:
            states = await self._states(user, resource_id, await self.table.load(user, resource_id))
            return sum(1 for info in states.values()
                       if info == "unknown" or (isinstance(info, InstanceInfo) and info.state in RUNNING_STATES))

        return list(await asyncio.gather(*(running(rid) for rid in resource_ids)))

    async def lost_instances(self, user: str, resource_id: str) -> int:
        states = await self._states(user, resource_id, await self.table.load(user, resource_id))
        return sum(1 for info in states.values() if info == "lost")

    async def release(self, user: str, resource_id: str, instances: int) -> None:
        placed = await self.table.load(user, resource_id)
        stopped = await asyncio.gather(*(
            self._agent(p.nodename, "stop", {"instance": workload_id(user, resource_id, i)}, Stopped)
            for i, p in placed.items()
        ), return_exceptions=True)
        silent = {placed[i].nodename for i, result in zip(placed, stopped) if isinstance(result, BaseException)}
        alive = silent - await self._down(sorted(silent))
        if alive:
            raise OperatorError(f"the agents of {', '.join(sorted(alive))} do not answer; release retried")
        # Also ids of a launch that allocated but died before recording it: release skips unknown ids.
        ids = sorted({workload_id(user, resource_id, i) for i in set(placed) | set(range(instances))})
        if ids:
            # An allocation service starting beside the broker (`berth up` starts them together, and
            # a pool's first round releases the servers lost while it was stopped) is waited for: a
            # pool server whose release fails is not retried, and would hold its CPUs for good.
            await self._call("release", {"workload_ids": ids}, dict, wait=self.client.timeout)
        await self.table.forget(user, resource_id, {p.nodename for p in placed.values()})
