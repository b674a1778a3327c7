"""The allocation service's domain errors, each built in one place (codes and details per DESIGN.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import BerthError, InvalidArgument, PermissionDenied

if TYPE_CHECKING:
    from services.allocation.selection import Selection


def node_not_found(node: str, plugin: str | None = None) -> BerthError:
    where = f" in plugin {plugin}" if plugin else ""
    return BerthError(
        f"node {node} not found{where}", code="node_not_found", field="nodename",
        details={"nodename": node, **({"plugin": plugin} if plugin else {})},
    )


def not_schedulable(node: str, status: str) -> BerthError:
    """A node that takes no new workloads now: its agent stopped renewing its lease (`down`), or
    it is being drained (`draining`)."""
    why = "its agent's lease lapsed" if status == "down" else "it is being drained"
    return BerthError(
        f"node {node} takes no new workloads: {why}", code=f"node_{status}", field="nodename",
        details={"nodename": node, "status": status},
    )


def no_node_matches(nodes: Selection) -> BerthError:
    return BerthError(
        "no node matches the selection", code="node_not_found", field="labels", details={"labels": nodes.labels or {}}
    )


def workload_exists(workload_id: str) -> BerthError:
    return BerthError(
        f"workload {workload_id} is already allocated", code="workload_exists",
        field="workload_ids", details={"workload_id": workload_id},
    )


def workload_not_found(workload_id: str) -> BerthError:
    return BerthError(
        f"workload {workload_id} not found", code="workload_not_found", field="workload_id",
        details={"workload_id": workload_id},
    )


def not_yours(field: str, workload_id: str) -> BerthError:
    """A workload the caller may not act on (bus.callers `owns`); whose it is stays unsaid."""
    return PermissionDenied(
        f"{field}: workload {workload_id} is not yours", field=field, details={"workload_id": workload_id}
    )


def node_busy(node: str) -> BerthError:
    """A node changed under every one of our attempts to commit to it."""
    return BerthError(f"node {node} is changing too fast; retry", code="busy", details={"nodename": node})


def reply_too_large(field: str, size: int, limit: int, advice: str) -> BerthError:
    """A reply (of about `size` bytes) that NATS could not carry, refused before anything is
    committed; `field` is what makes it so large."""
    return InvalidArgument(
        field, f"the reply would take about {size} bytes, over the {limit} the server's max payload "
        f"leaves: {advice}", reply_bytes=size, limit=limit,
    )


def no_room(error: BerthError) -> bool:
    """The nodes have no room for what was asked (eru splits this into two codes: see DESIGN.md §3)."""
    return error.code in ("insufficient_capacity", "insufficient_resource")


def node_moved(node: str) -> BerthError:
    """Spread chose `node` on a state another worker has changed since: plan again (never
    answered: the last replan commits wherever it planned)."""
    return BerthError(f"node {node} changed after it was chosen", code="node_moved", details={"nodename": node})


def not_placeable_now(error: BerthError) -> bool:
    """A node refused a deploy for now: no room, it takes no new workloads (down or draining), or
    it changed after spread chose it."""
    return no_room(error) or error.code in ("node_down", "node_draining", "node_moved")
