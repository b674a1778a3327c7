"""Several worker processes, discovery, events and the replay stream."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec

from bus import discovery
from schemas.common import Event
from tests.echo_service import Served


async def test_two_worker_processes_share_load_and_both_are_discovered(spawn_worker, client, nc, prefix):
    first, second = spawn_worker("tests.echo_service"), spawn_worker("tests.echo_service")
    found = await discovery.ping(nc, f"{prefix}-echo")
    assert {p.id for p in found} == {first.instance_id, second.instance_id}

    replies = await asyncio.gather(*(client.request("echo.sleep", {"seconds": 0.05}, Served) for _ in range(60)))
    served_by = Counter(r.instance for r in replies)
    assert set(served_by) == {first.instance_id, second.instance_id}
    assert sum(served_by.values()) == 60

    stats = await discovery.stats(nc, f"{prefix}-echo")
    sleep_counts = {
        s.id: next(e.num_requests for e in s.endpoints if e.subject == f"{prefix}.echo.sleep") for s in stats
    }
    assert sleep_counts == dict(served_by)

    infos = await discovery.info(nc, f"{prefix}-echo")
    subjects = {e.subject for e in infos[0].endpoints}
    assert f"{prefix}.echo.increment" in subjects and f"{prefix}.echo.typed" in subjects


async def test_stats_count_errors_and_processing_time(serve, prefix, redis, client, nc):
    from bus.errors import BusError
    from tests import echo_service

    service = await serve(echo_service.make_service(prefix, redis))
    await client.request("echo.sleep", {"seconds": 0.1}, Served)
    for _ in range(2):
        try:
            await client.request("echo.fail", {"code": "node_not_found"})
        except BusError:
            pass
    [stats] = await discovery.stats(nc, service.name)
    by_subject = {e.subject: e for e in stats.endpoints}
    sleep, fail = by_subject[f"{prefix}.echo.sleep"], by_subject[f"{prefix}.echo.fail"]
    assert sleep.num_requests == 1 and sleep.num_errors == 0
    assert sleep.average_processing_time >= 100_000_000  # the time of the real work, in ns
    assert fail.num_requests == 2 and fail.num_errors == 2
    assert fail.last_error.startswith("404:")


class Thing(Event):
    nodename: str
    amount: int


async def test_events_reach_callback_and_iterator_subscribers_and_are_replayable(events, nc):
    await events.ensure_stream(memory=True)
    await events.ensure_stream(memory=True)  # idempotent

    got_by_callback: list[tuple[str, dict]] = []

    async def on_event(subject, event):
        got_by_callback.append((subject, event))

    await events.subscribe("resource.*.added", cb=on_event)
    async with await events.subscribe("resource.>", Thing) as stream:
        await events.publish("resource.n1.added", Thing(type="", nodename="n1", amount=3))
        subject, event = await stream.next(timeout=2)
    assert subject == f"{events.prefix}.events.resource.n1.added"
    assert (event.type, event.nodename, event.amount) == ("added", "n1", 3)
    assert event.time > 0
    await nc.flush()
    await asyncio.sleep(0.05)
    assert got_by_callback[0][1]["type"] == "added"

    # The stream kept it: a late subscriber can replay from the start.
    js = nc.jetstream()
    replay = await js.subscribe(events.subject(">"), ordered_consumer=True)
    msg = await replay.next_msg(timeout=2)
    assert msgspec.msgpack.decode(msg.data, type=Thing).nodename == "n1"
    await replay.unsubscribe()
