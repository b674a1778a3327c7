"""The `allocation` operator: instances are placed by the allocation service, then run as processes.

- A resource's capacity block is "<platform>/<city>": the nodes whose labels (`--city-label`,
  `--platform-label`) hold that city and platform.
- An instance is one `resource.allocate` of the instance type for (platform, group = city) from
  the configuration; its bound CPUs (if `--bind-cpus`) pin the process the `process` operator starts.
- Free capacity for `launch` is what the allocation service says those nodes can still take.
- Release stops the processes, then frees the allocations.

Placements are kept in Redis (`alloc:<user>:<id>`: index -> node and CPUs). Each allocate carries a
`request_id` derived from the instances it places, so a launch retried after a crash gets the same
placement back instead of a second one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec

from bus.client import BusClient
from bus.errors import BusError
from services.allocation.messages import AllocateReply, ListNodesReply, NodeSummary
from services.broker.config import InstanceTypes
from services.broker.messages import BlockDetail, ResourceParam, ServiceInfo
from services.broker.operators.base import LaunchSpec, OperatorError
from services.broker.operators.process import ProcessOperator
from services.broker.views import unreserved

PAGE = 1000


class Placement(msgspec.Struct):
    nodename: str
    cpus: list[int] = []


def workload_id(user: str, resource_id: str, index: int) -> str:
    """The allocation service's id for one instance (ids of at most 256 characters)."""
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


def bound_cpus(engine_params: dict[str, Any]) -> list[int]:
    return sorted(int(core) for core in ((engine_params.get("cpumem") or {}).get("cpu_map") or {}))


class AllocationOperator:
    name = "allocation"

    def __init__(
        self,
        processes: ProcessOperator,
        client: BusClient,
        types: InstanceTypes,
        *,
        city_label: str = "city",
        platform_label: str = "platform",
        bind_cpus: bool = True,
        placement: str = "spread",
    ) -> None:
        self.processes = processes
        self.client = client
        self.types = types
        self.labels = BlockLabels(city_label, platform_label)
        self.bind_cpus = bind_cpus
        self.placement = placement
        self.redis = processes.table.redis
        self.base = processes.table.base

    def validate(self, param: ResourceParam) -> None:
        self.processes.validate(param)

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

    async def _call(self, command: str, payload: dict[str, Any], reply: type):
        try:
            return await self.client.request(f"resource.{command}", payload, reply)
        except BusError as error:
            raise OperatorError(f"allocation service, {command}: {error.code}: {error.message}") from None

    async def _nodes(self, labels: dict[str, str]) -> list[NodeSummary]:
        nodes: list[NodeSummary] = []
        while True:
            page = await self._call(
                "list-nodes", {"labels": labels, "offset": len(nodes), "limit": PAGE}, ListNodesReply
            )
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
        return await self._free([n.nodename for n in nodes], param.platform, param.city)

    async def blocks(self) -> list[BlockDetail]:
        by_block: dict[tuple[str, str], list[NodeSummary]] = {}
        for node in await self._nodes({}):
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
            free = await self._free([n.nodename for n in nodes], platform, city)
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

    def _key(self, user: str, resource_id: str) -> str:
        return f"{self.base}:alloc:{user}:{resource_id}"

    async def _placements(self, user: str, resource_id: str) -> dict[int, Placement]:
        raw = await self.redis.hgetall(self._key(user, resource_id))
        return {int(k): msgspec.msgpack.decode(v, type=Placement) for k, v in raw.items()}

    async def _allocate(self, spec: LaunchSpec, indexes: list[int]) -> dict[int, Placement]:
        param = spec.param
        selector = self.labels.selector(param)
        nodes = await self._nodes(selector)
        if not nodes:
            raise OperatorError(
                "no node has labels " + ", ".join(f"{label}={value!r}" for label, value in selector.items())
            )
        ids = [workload_id(spec.user, spec.resource_id, i) for i in indexes]
        digest = hashlib.blake2b("\0".join(ids).encode(), digest_size=16).hexdigest()
        reply = await self._call(
            "allocate",
            {
                "nodenames": [n.nodename for n in nodes],
                "strategy": self.placement,
                "deploy_count": len(ids),
                "workload_resource_request": self._request(param.platform, param.city),
                "workload_ids": ids,
                "request_id": f"broker-launch-{digest}",
            },
            AllocateReply,
        )
        by_id = {a.workload_id: a for a in reply.allocations}
        placed = {
            i: Placement(by_id[wid].nodename, bound_cpus(by_id[wid].engine_params))
            for i, wid in zip(indexes, ids)
        }
        await self.redis.hset(
            self._key(spec.user, spec.resource_id),
            mapping={str(i): msgspec.msgpack.encode(p) for i, p in placed.items()},
        )
        return placed

    # -- the operator interface ------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> None:
        placed = await self._placements(spec.user, spec.resource_id)
        missing = [i for i in range(spec.instances) if i not in placed]
        if missing:
            placed.update(await self._allocate(spec, missing))
        await self.processes.launch(spec, cpus={i: p.cpus for i, p in placed.items()})

    async def status(self, user: str, resource_id: str) -> ServiceInfo:
        return await self.processes.status(user, resource_id)

    async def running_instances(self, user: str, resource_ids: list[str]) -> list[int]:
        return await self.processes.running_instances(user, resource_ids)

    async def release(self, user: str, resource_id: str, instances: int) -> None:
        placed = await self._placements(user, resource_id)
        await self.processes.release(user, resource_id, instances)
        # Also ids of a launch that allocated but died before recording it: release skips unknown ids.
        ids = sorted({workload_id(user, resource_id, i) for i in set(placed) | set(range(instances))})
        if ids:
            await self._call("release", {"workload_ids": ids}, dict)
        await self.redis.delete(self._key(user, resource_id))
