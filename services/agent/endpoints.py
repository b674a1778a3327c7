"""The agent service's transport: which command answers on which subject, and who may call it.

Every command is `agent.<node>.<command>` below the prefix, so each host's agent answers for its own
node. Starting, stopping and draining change the host: admins only (the broker, a service, acts
as one); reading what runs is a reader's.
"""

from __future__ import annotations

from schemas.agent import (
    AgentInfo,
    Drain,
    InstanceInfo,
    InstancePage,
    InstanceRequest,
    InstancesReply,
    InstancesRequest,
    ListInstances,
    StartInstance,
    Stopped,
)
from schemas.common import Empty
from services.agent.host_agent import HostAgent




class AgentEndpoints:
    def __init__(self, agent: HostAgent) -> None:
        self.agent = agent

    async def start(self, req: StartInstance) -> InstanceInfo:
        return await self.agent.start(req)

    async def stop(self, req: InstanceRequest) -> Stopped:
        return Stopped(req.instance, await self.agent.instances.stop(req.instance))

    async def status(self, req: InstancesRequest) -> InstancesReply:
        # Probed now, not only at the probe loop's next round: a caller waiting for a new instance
        # to be ready learns it as soon as it is (the `process` operator probes when asked, too).
        found, _ = self.agent.instances.get(req.instances)
        await self.agent.instances.probe([info.instance for info in found if info.state != "ready"])
        found, missing = self.agent.instances.get(req.instances)
        return InstancesReply(found, missing)

    async def list(self, req: ListInstances) -> InstancePage:
        every = self.agent.instances.list()
        return InstancePage(every[req.offset:req.offset + req.limit], len(every))

    async def info(self, req: Empty) -> AgentInfo:
        return self.agent.info()

    async def drain(self, req: Drain) -> AgentInfo:
        await self.agent.set_draining(req.draining)
        return self.agent.info()
