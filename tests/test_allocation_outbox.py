"""Every committed change's event reaches the events stream, also when the worker dies between the
commit and the publish (issue 16, item 4): the change's events are written into the node's outbox
in the same commit, and another worker's sweep publishes what the dead one did not."""

from __future__ import annotations

import signal

import pytest

from schemas.errors import BusError
from tests.bus_helpers import eventually, stream_events

NODE = {"nodename": "o1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}}
ONE_CORE = {"cpumem": {"cpu-request": 1, "memory-request": 1 << 30}}


async def stream_versions(nc, prefix: str, node: str) -> list[int]:
    """The node versions of the node's events the stream holds, in stream order."""
    return [event["version"] for event in await stream_events(nc, f"{prefix}.events.resource.{node}.>")]


async def test_an_event_committed_by_a_worker_that_died_before_publishing_reaches_the_stream(
    spawn_worker, client, nc, prefix
):
    healthy = spawn_worker("services.allocation.worker")
    await client.request("resource.add-node", NODE)
    healthy.signal(signal.SIGTERM)
    healthy.wait()

    doomed = spawn_worker("services.allocation.worker", env={"BERTH_FAILPOINTS": "after-commit"})
    allocate = {"nodename": "o1", "deploy_count": 1, "workload_resource_request": ONE_CORE}
    with pytest.raises(BusError):  # never answered: the worker died right after its commit
        await client.request("resource.allocate", allocate, dict, timeout=3)
    assert doomed.wait() == -signal.SIGKILL
    assert set(await stream_versions(nc, prefix, "o1")) == {1}  # the fault hit: version 2's event was not sent

    spawn_worker("services.allocation.worker")  # its sweep runs every 5 s
    held = await client.request("resource.get-allocations", {"nodename": "o1"}, dict)
    assert len(held["allocations"]) == 1  # the commit landed
    await client.request("resource.allocate", allocate, dict)  # version 3, published by its own worker

    async def no_gap() -> bool:
        return sorted(set(await stream_versions(nc, prefix, "o1"))) == [1, 2, 3]

    await eventually(no_gap, timeout=30)  # the sweep published version 2 from the dead worker's outbox
