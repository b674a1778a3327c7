"""The allocation service's commands and events: which subject takes which message (DESIGN.md §3).

Only the contract's tables: the exporters (`berth schema`) and clients read them without starting a
worker. endpoints.py binds each command's `handler` to the code that answers it.
"""

from __future__ import annotations

from dataclasses import replace

from bus.callers import Role
from bus.events import StreamSpec
from bus.service import Command
from schemas.allocation import (
    AddNode,
    Allocate,
    AllocateReply,
    AllocateWire,
    AllocationsReply,
    BeforeAfter,
    CalculateDeploy,
    CalculateDeployReply,
    CalculateRealloc,
    CalculateReallocReply,
    CalculateRemap,
    CalculateRemapReply,
    CapacityUsage,
    GetAllocations,
    GetMetrics,
    GetMostIdleNode,
    GetNodeResourceInfo,
    GetNodesDeployCapacity,
    GetNodesDeployCapacityReply,
    GetNodesDeployCapacityWire,
    HeartbeatReply,
    ListNodes,
    ListNodesReply,
    MetricsDescriptionReply,
    MetricsReply,
    MostIdleNode,
    NodeEvent,
    NodeHeartbeat,
    NodeRequest,
    NodeResourceInfo,
    PluginsReply,
    Realloc,
    ReallocReply,
    ReleaseReply,
    ReleaseWorkloads,
    SetNodeLabels,
    SetNodeResourceCapacity,
    SetNodeResourceInfo,
    SetNodeResourceUsage,
)
from schemas.common import Empty

PLUGIN_NAMES = ("cpumem", "storage", "gpu")

# The eru plugin commands, served at both levels: (command, request, reply, handler, changes state).
PLUGIN_COMMANDS = [
    ("calculate-deploy", CalculateDeploy, CalculateDeployReply, "calculate_deploy", False),
    ("calculate-realloc", CalculateRealloc, CalculateReallocReply, "calculate_realloc", False),
    ("calculate-remap", CalculateRemap, CalculateRemapReply, "calculate_remap", False),
    ("add-node", AddNode, CapacityUsage, "add_node", True),
    ("remove-node", NodeRequest, Empty, "remove_node", True),
    ("get-nodes-deploy-capacity", GetNodesDeployCapacity, GetNodesDeployCapacityReply, "get_nodes_deploy_capacity", False),
    ("set-node-resource-capacity", SetNodeResourceCapacity, BeforeAfter, "set_node_resource_capacity", True),
    ("get-node-resource-info", GetNodeResourceInfo, NodeResourceInfo, "get_node_resource_info", False),
    ("set-node-resource-info", SetNodeResourceInfo, Empty, "set_node_resource_info", True),
    ("set-node-resource-usage", SetNodeResourceUsage, BeforeAfter, "set_node_resource_usage", True),
    ("get-most-idle-node", GetMostIdleNode, MostIdleNode, "get_most_idle_node", False),
    ("fix-node-resource", GetNodeResourceInfo, NodeResourceInfo, "fix_node_resource", True),
    ("get-metrics-description", Empty, MetricsDescriptionReply, "get_metrics_description", False),
    ("get-metrics", GetMetrics, MetricsReply, "get_metrics", False),
]

# Requests whose node list the service keeps raw (see schemas/allocation.py).
WIRE_TYPES = {GetNodesDeployCapacity: GetNodesDeployCapacityWire}

MANAGER_ONLY_COMMANDS = [
    Command("resource.allocate", Allocate, AllocateReply, "allocate", idempotent=True, wire=AllocateWire,
            undo="undo_allocate", role=Role.TENANT, keep="kept_allocate", recall="recall_allocate"),
    Command("resource.release", ReleaseWorkloads, ReleaseReply, "release", idempotent=True, role=Role.TENANT,
            keep="kept_release", recall="recall_release"),
    Command("resource.realloc", Realloc, ReallocReply, "realloc", idempotent=True, role=Role.TENANT),
    Command("resource.list-nodes", ListNodes, ListNodesReply, "list_nodes"),
    Command("resource.get-allocations", GetAllocations, AllocationsReply, "get_allocations"),
    Command("resource.set-node-labels", SetNodeLabels, Empty, "set_node_labels", idempotent=True),
    # An agent's heartbeat: no request_id (renewing a lease twice is renewing it), admins only.
    Command("resource.node-heartbeat", NodeHeartbeat, HeartbeatReply, "node_heartbeat", role=Role.ADMIN),
    Command("resource.plugins", Empty, PluginsReply, "list_plugins"),
]


def plugin_commands(plugin: str | None) -> list[Command]:
    """The eru commands on `resource.<plugin>.<command>`, or on `resource.<command>` for the manager."""
    group = f"resource.{plugin}" if plugin else "resource"
    return [
        Command(f"{group}.{name}", request, reply, handler, idempotent=changes, wire=WIRE_TYPES.get(request))
        for name, request, reply, handler, changes in PLUGIN_COMMANDS
    ]


# What a node's agent sends, also on its node's own subjects, `resource.node.<node>.<command>`:
# its NATS permissions allow it those of its node only, and a request there acts on that node only
# (`Command.scope`). Admins may send them too; other callers, as on the plain subjects.
AGENT_COMMANDS = ("add-node", "set-node-resource-capacity", "set-node-labels", "node-heartbeat", "get-allocations")


def node_scoped(commands: list[Command]) -> list[Command]:
    """The agent's commands among `commands`, on their node's subjects."""
    return [replace(command, subject=f"resource.node.*.{name}", scope="nodename")
            for command in commands if (name := command.subject.removeprefix("resource.")) in AGENT_COMMANDS]


# What the manager level serves (the plugin levels serve `plugin_commands(plugin)`).
MANAGER_COMMANDS = plugin_commands(None) + MANAGER_ONLY_COMMANDS
MANAGER_COMMANDS += node_scoped(MANAGER_COMMANDS)
COMMANDS = MANAGER_COMMANDS + [command for plugin in PLUGIN_NAMES for command in plugin_commands(plugin)]
EVENTS = {
    "resource.<node>.<added|removed|capacity|usage|allocated|released|labels|down|up|draining>": NodeEvent,
    # the same change to one owner's workloads, naming only those (what a tenant may follow)
    "resource.workload.<owner>.<node>.<allocated|released|usage>": NodeEvent,
}
# Change events are kept a day for replay, in the stream all services' change events share.
STREAM = StreamSpec("events", ("resource.>",), max_age=24 * 3600, max_bytes=1 << 30)
