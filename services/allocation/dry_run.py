"""An allocate's plan without its commit (`dry_run: true`): what each planned node would give the
instances, computed on fresh records as a commit computes it, and written nowhere (no ledger, no
usage, no event, no kept answer)."""

from __future__ import annotations

from schemas.allocation import Allocation
from schemas.errors import BerthError
from services.allocation.committer import NodeFilledUp
from services.allocation.errors import node_not_found, not_placeable_now, not_schedulable
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.store import NodeStore


async def preview(
    store: NodeStore, plugins: PluginSet, plan: dict[str, int], ids: list[str], requests: Keyed
) -> list[Allocation]:
    """The allocations committing `plan` would make now, nodes in name order as `Committer.place`
    takes them; a node that would refuse raises as it would there (`NodeFilledUp`: plan again)."""
    records = await store.load_many(sorted(plan))
    placed: list[Allocation] = []
    for node, record in records.items():
        try:
            if record is None:
                raise node_not_found(node)
            if not record.schedulable:
                raise not_schedulable(node, record.status)
            deployment = plugins.deploy(plugins.states(record, list(plugins)), plan[node], requests)
        except BerthError as error:
            if not_placeable_now(error):
                raise NodeFilledUp(node, error) from None
            raise
        named = ids[len(placed):len(placed) + plan[node]]
        placed += [
            Allocation(wid, node, resource, params)
            for wid, resource, params in zip(named, deployment.workloads_resource, deployment.engines_params)
        ]
    return placed
