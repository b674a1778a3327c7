"""An outbox: the events of a change are written in the same commit as the change, then published
with JetStream acknowledgements, by the worker that committed or, if it died first, by any worker.

A versioned record (`bus.cas`) keeps its outbox in a hash of its own slot: field = the version the
change made, value = the change's events (`cas.journal` writes it in the commit). After the commit
the worker publishes them, each with a message id (`<outbox key>:<version>:<n>`) that JetStream
uses to drop a second copy, and deletes the field once every one is acknowledged. Before each
commit the record's owner name goes into one sorted set (`pending`, scored by time): `sweep`, run
by every worker now and then, finds outboxes that still hold events a while after their commit
(their worker died, or NATS was away) and publishes them. So every committed change's event
reaches the stream, at least once; a consumer that follows record versions sees no gap.

Events are stored as complete bodies except `version`, which is the outbox field's: the version
is known only once the commit has landed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec

from bus import scripts
from bus.codec import encode
from bus.events import EventBus
from bus.redis import Pipelined
from schemas.common import Event

log = logging.getLogger("berth.outbox")

Entry = tuple[str, Any]  # (subject suffix below `<prefix>.events.`, body map)
_entries = msgspec.msgpack.Decoder(list[tuple[str, dict[str, Any]]])

def journal(events: list[tuple[str, Event]]) -> bytes:
    """The value a commit writes into the outbox for `events` (each event's `type` is its subject's
    last token, as `EventBus.publish` sets it)."""
    for suffix, event in events:
        event.type = suffix.rsplit(".", 1)[-1]
    return encode([(suffix, event) for suffix, event in events])


class Outbox:
    def __init__(self, events: EventBus | None, batch: Pipelined, pending_key: str,
                 outbox_key: Callable[[str], str]) -> None:
        self.events = events
        self.batch = batch
        self.pending_key = pending_key
        self.outbox_key = outbox_key  # owner name -> its outbox hash
        self._forget = scripts.register(batch.redis, "bus", "outbox_forget")

    async def deliver(self, owner: str, version: int, entries: bytes | None = None) -> bool:
        """Publish the events `owner`'s change to `version` journaled (`entries`, else as stored),
        then drop them from its outbox. False if some were not acknowledged: they stay for a sweep."""
        key = self.outbox_key(owner)
        if entries is None:
            entries = await self.batch.execute_command("HGET", key, version)
            if entries is None:
                return True  # delivered already
        if self.events is not None:
            try:
                await asyncio.gather(*(
                    self.events.publish_acked(suffix, encode({**body, "version": version}), f"{key}:{version}:{n}")
                    for n, (suffix, body) in enumerate(_entries.decode(entries))
                ))
            except Exception as error:  # NATS away, no stream, a timeout: a sweep tries again
                log.warning("events of %s version %d not acknowledged yet: %r", owner, version, error)
                return False
        await self.batch.execute_command("HDEL", key, version)
        return True

    async def sweep(self, grace: float = 5.0) -> int:
        """Publish what outboxes still hold `grace` seconds after their last commit; how many
        versions. Every worker may run it at once: JetStream drops the second copies."""
        delivered = 0
        stale = await self.batch.redis.zrangebyscore(self.pending_key, 0, time.time() - grace, withscores=True)
        for owner, score in stale:
            owner = owner.decode()
            held = await self.batch.execute_command("HGETALL", self.outbox_key(owner))
            results = [await self.deliver(owner, int(version), entries)
                       for version, entries in sorted(held.items(), key=lambda item: int(item[0]))]
            delivered += sum(results)
            if all(results):
                await self.batch.script(self._forget, [self.pending_key], [owner, repr(score)])
        return delivered
