"""A node agent's commands and events: which subject takes which message (docs/agents.md).

Only the contract's tables: the exporters (`berth schema`) and clients read them without starting a
worker. endpoints.py binds each command's `handler` to the code that answers it.
"""

from __future__ import annotations

from bus.callers import Role
from bus.events import StreamSpec
from bus.service import Command
from schemas.agent import (
    AgentEvent,
    AgentInfo,
    Drain,
    InstanceEvent,
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

def commands(node: str) -> list[Command]:
    """The commands of one host's agent (`node` is "<node>" in the exported schema)."""
    group = f"agent.{node}"
    return [
        Command(f"{group}.start", StartInstance, InstanceInfo, "start", role=Role.ADMIN),
        Command(f"{group}.stop", InstanceRequest, Stopped, "stop", role=Role.ADMIN),
        Command(f"{group}.status", InstancesRequest, InstancesReply, "status", role=Role.READER),
        Command(f"{group}.list", ListInstances, InstancePage, "list", role=Role.READER),
        Command(f"{group}.info", Empty, AgentInfo, "info", role=Role.READER),
        Command(f"{group}.drain", Drain, AgentInfo, "drain", role=Role.ADMIN),
    ]


COMMANDS = commands("<node>")
EVENTS = {
    "agent.<node>.<started|ready|unready|exited|stopped>": InstanceEvent,
    "agent.<node>.host.<registered|capacity|draining|resumed>": AgentEvent,
}
# An agent's news is change news: kept a day for replay, in the stream allocation and broker share.
STREAM = StreamSpec("events", ("agent.>",), max_age=24 * 3600, max_bytes=1 << 30)
