"""An outbox over a real nats-server and Redis: its events reach the stream and leave the outbox
once acknowledged; without a stream to acknowledge them they stay for a sweep, which sends them
once the stream is there."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.errors import NoStreamResponseError

from bus.events import StreamSpec
from bus.outbox import SWEEP_SLICE, Journal, VersionedOutboxes, journal
from bus.redis import Pipelined
from schemas.common import Event
from tests.bus_helpers import eventually

SPEC = StreamSpec("events", ("outbox.>",), max_age=60, max_bytes=1 << 20)


async def held(redis, key: str) -> dict:
    return await redis.hgetall(key)


async def test_acknowledged_events_leave_the_outbox_and_unacknowledged_ones_stay_for_a_sweep(
    events, redis, nc, prefix
):
    outbox = Journal(events, Pipelined.of(redis), f"{prefix}:outbox:test")
    entries = journal([("outbox.a.made", Event(type="")), ("outbox.b.made", Event(type=""))])
    first = outbox.field()
    await redis.hset(outbox.key, first, entries)
    # No stream yet: nothing acknowledges them (no responders), so they stay.
    assert await outbox.deliver(outbox.key, first, wait=True) is False
    assert list(await held(redis, outbox.key)) == [first.encode()]

    await events.ensure_stream(SPEC, memory=True)
    sub = await nc.jetstream().subscribe(events.subject("outbox.>"), ordered_consumer=True)
    second = outbox.field()
    await redis.hset(outbox.key, second, entries)
    assert await outbox.deliver(outbox.key, second, entries) is True  # acknowledgements in the background
    async def only_the_first_held() -> bool:
        return list(await held(redis, outbox.key)) == [first.encode()]

    await eventually(only_the_first_held)
    assert await outbox.sweep(grace=0) == 1  # the first change, sent again now that the stream is there
    assert await held(redis, outbox.key) == {}
    subjects = [(await sub.next_msg(timeout=5)).subject for _ in range(4)]
    assert sorted(subjects) == sorted([events.subject("outbox.a.made"), events.subject("outbox.b.made")] * 2)


async def test_an_acknowledgement_says_stored_duplicate_refused_or_no_stream(events, nc, prefix):
    subject = events.subject("acks.one")
    nowhere = await events.publish_acked("acks.one", b"\x80", "id-1")
    with pytest.raises(NoStreamResponseError):
        await asyncio.wait_for(nowhere, 5)
    stream = f"{prefix}-events"  # the name the namespace clean-up deletes
    await nc.jetstream().add_stream(name=stream, subjects=[subject], max_msg_size=64, storage="memory")
    await asyncio.wait_for(await events.publish_acked("acks.one", b"\x80", "id-2"), 5)
    # A copy: dropped, and acknowledged.
    await asyncio.wait_for(await events.publish_acked("acks.one", b"\x80", "id-2"), 5)
    assert (await nc.jetstream().stream_info(stream)).state.messages == 1
    with pytest.raises(RuntimeError, match="refused"):  # over the stream's message size
        await asyncio.wait_for(await events.publish_acked("acks.one", b"x" * 100, "id-3"), 5)


async def test_a_sweep_over_many_outboxes_publishes_what_they_hold_and_forgets_every_emptied_one(
    events, redis, nc, prefix
):
    """Outboxes named in `pending` for longer than the grace, over more than two slices of the
    sweep: the three that hold a version are published (each body stamped with it) and emptied,
    and every one of them is forgotten; one committed within the grace stays, untouched."""
    await events.ensure_stream(SPEC, memory=True)
    sub = await nc.jetstream().subscribe(events.subject("outbox.>"), ordered_consumer=True)
    pending = f"{prefix}:outboxes"
    outboxes = VersionedOutboxes(events, Pipelined.of(redis), pending, lambda owner: f"{prefix}:outbox:{owner}")
    owners = [f"n{i:04d}" for i in range(2 * SWEEP_SLICE + 201)]
    holding = {owners[0], owners[SWEEP_SLICE], owners[-1]}
    await redis.zadd(pending, {owner: time.time() - 60 for owner in owners})
    for owner in holding:
        await redis.hset(outboxes.outbox_key(owner), "7", journal([(f"outbox.{owner}.made", Event(type=""))]))
    await redis.zadd(pending, {"recent": time.time()})
    await redis.hset(outboxes.outbox_key("recent"), "3", journal([("outbox.recent.made", Event(type=""))]))

    assert await outboxes.sweep(grace=5) == len(holding)

    assert await redis.zrange(pending, 0, -1) == [b"recent"]
    assert all([await held(redis, outboxes.outbox_key(owner)) == {} for owner in holding])
    assert list(await held(redis, outboxes.outbox_key("recent"))) == [b"3"]
    published = [await sub.next_msg(timeout=5) for _ in holding]
    assert sorted(m.subject for m in published) == sorted(events.subject(f"outbox.{o}.made") for o in holding)
    assert all(b"version" in m.data for m in published)
    with pytest.raises(asyncio.TimeoutError):
        await sub.next_msg(timeout=0.5)  # nothing else: not the recent one
