"""An outbox over a real nats-server and Redis: its events reach the stream and leave the outbox
once acknowledged; without a stream to acknowledge them they stay for a sweep, which sends them
once the stream is there."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NoStreamResponseError

from bus.events import StreamSpec
from bus.outbox import Journal, journal
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
