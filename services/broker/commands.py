"""The broker's commands and events: which subject takes which message (DESIGN.md §4).

Only the contract's tables: the exporters (`berth schema`) and clients read them without starting a
worker. endpoints.py binds each command's `handler` to the code that answers it.
"""

from __future__ import annotations

from bus.callers import Role
from bus.events import StreamSpec
from bus.service import Command
from schemas.broker import (
    AddBroker,
    Apply,
    ApplyReply,
    BrokerEvent,
    BrokerList,
    BrokerView,
    GetInstanceType,
    GetNamespace,
    GetResourceDetail,
    Init,
    InstanceType,
    Launch,
    LaunchReply,
    ListBrokers,
    ListResources,
    Namespace,
    Preparing,
    Release,
    RemoveBroker,
    RemovedBroker,
    ResourceDetailReply,
    ResourceEvent,
    ResourceList,
    ResourceRef,
    ResourceView,
    Scale,
    ServiceInfo,
)
from schemas.common import Empty

COMMANDS = [
    Command("broker.init", Init, Empty, "init", idempotent=True, role=Role.TENANT),
    Command("broker.launch", Launch, LaunchReply, "launch", idempotent=True, role=Role.TENANT),
    Command("broker.scale", Scale, LaunchReply, "scale", idempotent=True, role=Role.TENANT),
    Command("broker.get-service-info", ResourceRef, ServiceInfo, "get_service_info"),
    Command("broker.is-service-preparing", ResourceRef, Preparing, "is_service_preparing"),
    Command("broker.release", Release, Empty, "release", idempotent=True, role=Role.TENANT),
    Command("broker.apply", Apply, ApplyReply, "apply", idempotent=True, role=Role.TENANT),
    Command("broker.add-broker", AddBroker, BrokerView, "add_broker", idempotent=True),
    Command("broker.remove-broker", RemoveBroker, RemovedBroker, "remove_broker", idempotent=True),
    Command("broker.list-brokers", ListBrokers, BrokerList, "list_brokers"),
    Command("broker.get-instance-type", GetInstanceType, InstanceType, "get_instance_type"),
    Command("broker.get-namespace", GetNamespace, Namespace, "get_namespace"),
    Command("broker.get-resource-detail", GetResourceDetail, ResourceDetailReply, "get_resource_detail"),
    Command("broker.list-resources", ListResources, ResourceList, "list_resources"),
    Command("broker.get-resource", ResourceRef, ResourceView, "get_resource"),
]

EVENTS = {
    "broker.<user>.<broker>.<launched|ready|sold|released|cooling|hit|miss>": BrokerEvent,
    "broker.resource.<user>.<resource_id>.<init|deploying|running|deleting|released>": ResourceEvent,
}
# Change events are kept a day for replay, in the stream all services' change events share.
STREAM = StreamSpec("events", ("broker.>",), max_age=24 * 3600, max_bytes=1 << 30)
