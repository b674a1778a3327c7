"""The node agent's errors, each built in one place (codes as docs/agents.md lists them)."""

from __future__ import annotations

from schemas.errors import BerthError, InvalidArgument


def instance_exists(instance: str) -> InvalidArgument:
    return InvalidArgument(
        "instance", f"{instance!r} runs already, with another spec (stop it first)", code="instance_exists",
    )


def instance_start_failed(reason: str) -> BerthError:
    """The process could not be started (the image's command is missing or not executable...)."""
    return BerthError(reason, code="instance_start_failed", field="param.image")


def node_draining(node: str) -> BerthError:
    return BerthError(f"node {node} is draining: it starts no new instance", code="node_draining",
                      field="instance", details={"nodename": node})


def already_registered(error: BerthError) -> bool:
    """An add-node refused because the node exists: the agent registered it before (a restart)."""
    return error.code == "node_exists"


def not_registered(error: BerthError) -> bool:
    """A heartbeat refused because the allocation service has no such node (it was removed)."""
    return error.code == "node_not_found"
