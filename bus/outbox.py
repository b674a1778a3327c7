"""Outboxes: the events of a change are written in the same commit as the change, then published
with JetStream acknowledgements, by the worker that committed or, if it died first, by any worker.

An outbox is a Redis hash in the slot of the records it reports on: field -> the change's events
(`journal` encodes them; a `bus.cas` step writes them in the commit). After the commit the worker
publishes them, each with a message id (`<outbox key>:<field>:<n>`) that JetStream uses to drop a
second copy, and deletes the field once every one is acknowledged. Whatever is still in an outbox
a while after its commit (its worker died, or NATS was away) is published by a sweep that every
worker runs now and then. So every committed change's event reaches the stream, at least once.

Two shapes, one per way of naming a change:
- `VersionedOutboxes`: one outbox per versioned record (`cas.journal` writes the field: the version
  the change made, which is known only once the commit landed, so each event body gets it as
  `version` when it is published). Before each commit the record's owner goes into a sorted set
  (`pending`, scored by time, in the same batch just ahead of the commit); the sweep reads only the
  outboxes named there. A consumer that follows record versions sees no gap.
- `Journal`: one outbox for a whole keyspace whose changes have no version of their own; each
  change's field is named by its time and a random part (`field()`), and the sweep reads the hash.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable


from bus import scripts
from bus.codec import decoder, encode
from bus.events import EventBus
from bus.redis import Pipelined
from schemas.common import Event

log = logging.getLogger("berth.outbox")

# How long the acknowledgements of one change's events are waited for; past it they stay in the
# outbox for a sweep.
ACK_TIMEOUT = 5.0
SWEEP_SLICE = 500  # outboxes a sweep reads at once (one batch; requests' commands go between slices)
_entries = decoder(list[tuple[str, dict[str, Any]]])


def journal(events: list[tuple[str, Event]]) -> bytes:
    """The value a commit writes into an outbox for `events` (each event's `type` is its subject's
    last token, as `EventBus.publish` sets it)."""
    for suffix, event in events:
        event.type = suffix.rsplit(".", 1)[-1]
    return encode([(suffix, event) for suffix, event in events])


class Outbox:
    """Publishing what outboxes hold. `stamp`: each body gets the field as its `version`."""

    def __init__(self, events: EventBus | None, batch: Pipelined, *, stamp: bool) -> None:
        self.events = events
        self.batch = batch
        self.stamp = stamp

    async def deliver(self, key: str, field: str | int, entries: bytes | None = None, *, wait: bool = False) -> bool:
        """Publish the events journaled under `field` of outbox `key` (`entries`, else as stored)
        now, and drop them from the outbox once every one is acknowledged. The events leave before
        this returns, so an answer sent after it follows them; the acknowledgements are waited for
        in the background, unless `wait`: then False says some were not, and stay for a sweep."""
        if entries is None:
            entries = await self.batch.execute_command("HGET", key, field)
            if entries is None:
                return True  # delivered already
        if self.events is None:
            return True
        stamp = {"version": int(field)} if self.stamp else {}
        try:
            acks = [
                await self.events.publish_acked(suffix, encode({**body, **stamp}), f"{key}:{field}:{n}")
                for n, (suffix, body) in enumerate(_entries(entries))
            ]
        except Exception as error:  # NATS away: a sweep tries again
            log.warning("events of %s %s not sent: %r", key, field, error)
            return False
        settled = self._settle(key, field, acks)
        return await settled if wait else True

    def _settle(self, key: str, field: str | int, acks: list[asyncio.Future]) -> asyncio.Future[bool]:
        """Once every acknowledgement came, drop the field from the outbox; the future says whether
        they all came within ACK_TIMEOUT (else they stay for a sweep). Callbacks, not a task: this
        runs for every commit."""
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[bool] = loop.create_future()
        waiting = len(acks)

        def give_up() -> None:
            for ack in acks:
                ack.cancel()  # each cancelled one reports in acknowledged()

        def acknowledged(ack: asyncio.Future) -> None:
            nonlocal waiting
            if settled.done():
                return
            if ack.cancelled() or ack.exception() is not None:  # no stream, a timeout, NATS away
                timer.cancel()
                give_up()
                log.warning("events of %s %s not acknowledged: %r", key, field,
                            "timeout" if ack.cancelled() else ack.exception())
                settled.set_result(False)
                return
            waiting -= 1
            if waiting == 0:
                drop()

        def drop() -> None:
            timer.cancel()
            self.batch.execute_command("HDEL", key, field).add_done_callback(dropped)

        def dropped(deleted: asyncio.Future) -> None:
            if deleted.cancelled() or deleted.exception() is not None:  # a sweep sends them again
                log.warning("events of %s %s sent; dropping them from the outbox failed", key, field)
                settled.set_result(False)
            else:
                settled.set_result(True)

        timer = loop.call_later(ACK_TIMEOUT, give_up)
        for ack in acks:
            ack.add_done_callback(acknowledged)
        if not acks:
            drop()
        return settled

    async def _deliver_held(self, key: str, due: Callable[[str], bool], order: Callable[[str], Any]) -> tuple[int, bool]:
        """Deliver the fields of outbox `key` that are `due`, in `order`: (how many, all of them)."""
        held = await self.batch.execute_command("HGETALL", key)
        fields = sorted((f.decode() for f in held if due(f.decode())), key=order)
        results = [await self.deliver(key, field, held[field.encode()], wait=True) for field in fields]
        return sum(results), all(results)


class VersionedOutboxes(Outbox):
    """One outbox per versioned record, found through the `pending` sorted set (see the module)."""

    def __init__(self, events: EventBus | None, batch: Pipelined, pending_key: str,
                 outbox_key: Callable[[str], str]) -> None:
        super().__init__(events, batch, stamp=True)
        self.pending_key = pending_key
        self.outbox_key = outbox_key  # owner name -> its outbox hash
        self._forget = scripts.register(batch.redis, "bus", "outbox_forget")

    async def sweep(self, grace: float = 5.0) -> int:
        """Publish what outboxes still hold `grace` seconds after their last commit; how many
        versions. Every worker may run it at once: JetStream drops the second copies.

        Nearly every outbox named is empty (its worker published and dropped the events): each
        slice of them is read, and the empty ones forgotten, in one batch, not one round trip per
        outbox (a spread over 50,000 nodes names thousands of them every few seconds)."""
        delivered = 0
        stale = await self.batch.redis.zrangebyscore(self.pending_key, 0, time.time() - grace, withscores=True)
        for start in range(0, len(stale), SWEEP_SLICE):
            part = stale[start:start + SWEEP_SLICE]
            swept = await asyncio.gather(
                *(self._deliver_held(self.outbox_key(owner.decode()), lambda f: True, int) for owner, _ in part)
            )
            delivered += sum(count for count, _ in swept)
            await asyncio.gather(*(
                self.batch.script(self._forget, [self.pending_key], [owner, repr(score)])
                for (owner, score), (_, emptied) in zip(part, swept) if emptied
            ))
        return delivered


class Journal(Outbox):
    """One outbox for a keyspace whose changes have no version (see the module)."""

    def __init__(self, events: EventBus | None, batch: Pipelined, key: str) -> None:
        super().__init__(events, batch, stamp=False)
        self.key = key

    @staticmethod
    def field() -> str:
        """A new change's field: its time (ms) first, so that a sweep can tell its age and order."""
        return f"{int(time.time() * 1000):015d}-{secrets.token_hex(6)}"

    async def sweep(self, grace: float = 5.0) -> int:
        """Publish the changes still held `grace` seconds after they were journaled; how many."""
        before = f"{int((time.time() - grace) * 1000):015d}"
        count, _ = await self._deliver_held(self.key, lambda field: field < before, str)
        return count
