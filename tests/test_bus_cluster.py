"""Several worker processes, discovery, events and the replay stream."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import msgspec
import pytest
from nats.micro.service import ServiceStats

from bus import discovery
from bus.events import StreamSpec
from schemas.common import Event
from schemas.errors import BusError
from tests import echo_service
from tests.bus_helpers import eventually
from tests.echo_service import Served


async def instance_stats(nc, name: str, instance: str) -> ServiceStats:
    """One instance's $SRV.STATS, asked of that instance alone (no wait for whoever else answers)."""
    msg = await nc.request(f"$SRV.STATS.{name}.{instance}", b"", timeout=5)
    return ServiceStats.from_dict(json.loads(msg.data))


async def test_two_worker_processes_share_load_and_both_are_discovered(spawn_worker, client, nc, prefix):
    first, second = spawn_worker("tests.echo_service"), spawn_worker("tests.echo_service")
    ids = {first.instance_id, second.instance_id}
    name = f"{prefix}-echo"

    # A scatter-gather stops listening once answers pause; a slow instance may miss one round,
    # never all of them.
    async def both_found():
        return {p.id for p in await discovery.ping(nc, name)} == ids

    await eventually(both_found)

    replies = await asyncio.gather(*(client.request("echo.sleep", {"seconds": 0.05}, Served) for _ in range(60)))
    served_by = Counter(r.instance for r in replies)
    assert set(served_by) == ids
    assert sum(served_by.values()) == 60

    sleep_counts = {
        instance: next(
            e.num_requests
            for e in (await instance_stats(nc, name, instance)).endpoints
            if e.subject == f"{prefix}.echo.sleep"
        )
        for instance in ids
    }
    assert sleep_counts == dict(served_by)

    info = json.loads((await nc.request(f"$SRV.INFO.{name}.{first.instance_id}", b"", timeout=5)).data)
    subjects = sorted(e["subject"] for e in info["endpoints"])
    assert subjects == sorted(f"{prefix}.{c.subject}" for c in echo_service.COMMANDS)


async def test_stats_count_errors_and_processing_time(serve, prefix, redis, client, nc):
    service = await serve(echo_service.make_service(prefix, redis))
    await client.request("echo.sleep", {"seconds": 0.1}, Served)
    for _ in range(2):
        with pytest.raises(BusError) as caught:
            await client.request("echo.fail", {"code": "node_not_found"})
        assert caught.value.code == "node_not_found"
    stats = await instance_stats(nc, service.name, service.id)
    by_subject = {e.subject: e for e in stats.endpoints}
    sleep, fail = by_subject[f"{prefix}.echo.sleep"], by_subject[f"{prefix}.echo.fail"]
    assert sleep.num_requests == 1 and sleep.num_errors == 0
    # The stats count the handler's own task, not just the hand-off to it: the request slept 0.1 s in
    # there, so it cannot have taken less (a consequence of the sleep, not a speed figure).
    assert sleep.average_processing_time >= 100_000_000  # ns
    assert fail.num_requests == 2 and fail.num_errors == 2
    assert fail.last_error == "404:node_not_found"  # the code, never the message (which may name ids)


class Thing(Event):
    nodename: str
    amount: int


CHANGES = StreamSpec("events", ("resource.>",), max_age=3600, max_bytes=1 << 20)


async def test_events_reach_callback_and_iterator_subscribers_and_are_replayable(events, nc):
    await events.ensure_stream(CHANGES, memory=True)
    await events.ensure_stream(CHANGES, memory=True)  # idempotent

    got_by_callback: asyncio.Queue = asyncio.Queue()

    async def on_event(subject, event):
        await got_by_callback.put((subject, event))

    by_callback_sub = await events.subscribe("resource.*.added", cb=on_event)
    async with await events.subscribe("resource.>", Thing) as stream:
        await events.publish("resource.n1.added", Thing(type="", nodename="n1", amount=3))
        subject, event = await stream.next(timeout=2)
    assert subject == f"{events.prefix}.events.resource.n1.added"
    assert (event.type, event.nodename, event.amount) == ("added", "n1", 3)
    assert event.time > 0
    by_callback = await asyncio.wait_for(got_by_callback.get(), 5)
    assert by_callback[0] == subject and by_callback[1]["type"] == "added"
    assert by_callback[1]["nodename"] == "n1" and by_callback[1]["amount"] == 3
    await by_callback_sub.unsubscribe()

    # The stream kept it: a late subscriber can replay from the start.
    js = nc.jetstream()
    replay = await js.subscribe(events.subject("resource.>"), ordered_consumer=True)
    msg = await replay.next_msg(timeout=2)
    assert msgspec.msgpack.decode(msg.data, type=Thing).nodename == "n1"
    await replay.unsubscribe()


async def test_services_add_their_subjects_to_a_shared_stream_and_limits_hold(events, nc):
    """Two services sharing the change-events stream each add their subjects; a sample stream
    keeps at most its per-subject limit."""
    other = StreamSpec("events", ("broker.>",), max_age=3600, max_bytes=1 << 20)
    samples = StreamSpec("metrics", ("metrics.>",), max_age=3600, max_bytes=1 << 20, max_msgs_per_subject=3)
    await asyncio.gather(events.ensure_stream(CHANGES, memory=True), events.ensure_stream(other, memory=True))
    await events.ensure_stream(samples, memory=True)
    js = nc.jetstream()
    shared = (await js.stream_info(events.stream_name(CHANGES))).config
    assert sorted(shared.subjects) == [events.subject("broker.>"), events.subject("resource.>")]
    for amount in range(5):
        await events.publish("metrics.n1.node.cpu", Thing(type="", nodename="n1", amount=amount))
    await nc.flush()

    async def three_kept() -> bool:
        return (await js.stream_info(events.stream_name(samples))).state.messages == 3

    await eventually(three_kept)
