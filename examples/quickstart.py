"""berth from Python: list nodes, place two workloads, release them, follow events and a metric.

    python examples/quickstart.py        # next to a running `berth up` (or with NATS_URL set)

`Client.connect()` finds the deployment as the `berth` commands do: NATS_URL and the BERTH_*
variables, else the .berth/up.env that `berth up` wrote here (BERTH_STATE names another folder).
"""

from __future__ import annotations

import asyncio

import berth
from berth import Client


async def main() -> None:
    async with await Client.connect() as client:
        nodes = await client.allocation.list_nodes(labels={"pool": "a"})
        print("nodes:", [node.nodename for node in nodes.nodes])

        async with client.events("resource.*.allocated") as events:
            try:
                placed = await client.allocation.allocate(
                    nodenames=[node.nodename for node in nodes.nodes] or None, strategy="spread", deploy_count=2,
                    workload_resource_request={"cpumem": {"cpu-request": 1, "memory-request": "1G"}},
                )
            except berth.Conflict as error:  # insufficient_capacity, node_down...
                print("not placed:", error.code, error.details)
                return
            event = await asyncio.wait_for(anext(events), timeout=5)
            print("event:", event.subject)

        print("placed:", [(a.workload_id, a.nodename) for a in placed.allocations])
        released = await client.allocation.release(workload_ids=[a.workload_id for a in placed.allocations])
        print("released:", released.released)

        node = placed.allocations[0].nodename
        try:
            async with client.metrics.watch(node, "node", "cpu.usage.system") as samples:
                async for sample in samples:
                    print("cpu.usage.system:", sample.value)
                    break
        except berth.Unavailable as error:  # no metrics agent runs on that node
            print("no metrics:", error)


if __name__ == "__main__":
    asyncio.run(main())
