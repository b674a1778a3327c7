"""Events: publish a Struct on `<prefix>.events.<...>`, subscribe with a callback or an iterator.

A JetStream stream over `<prefix>.events.>` keeps every event for replay; `ensure_stream` creates
it (or leaves it alone when it exists), so every worker can call it on start.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, TypeVar

import msgspec
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from bus.codec import encode
from schemas.common import Event

log = logging.getLogger("berth.events")

E = TypeVar("E")


class EventSubscription(Generic[E]):
    """An async iterator of (subject, event); use as `async with` to unsubscribe at the end."""

    def __init__(self, sub: Subscription, type_: type[E]) -> None:
        self.sub = sub
        self.decoder = msgspec.msgpack.Decoder(type_)

    def __aiter__(self) -> AsyncIterator[tuple[str, E]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, E]]:
        async for msg in self.sub.messages:
            yield msg.subject, self.decoder.decode(msg.data)

    async def next(self, timeout: float) -> tuple[str, E]:
        msg = await self.sub.next_msg(timeout=timeout)
        return msg.subject, self.decoder.decode(msg.data)

    async def close(self) -> None:
        await self.sub.unsubscribe()

    async def __aenter__(self) -> "EventSubscription[E]":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class EventBus:
    def __init__(self, nc: Client, *, prefix: str = "berth") -> None:
        self.nc = nc
        self.prefix = prefix

    @property
    def stream_name(self) -> str:
        return f"{self.prefix}-events"

    def subject(self, suffix: str) -> str:
        return f"{self.prefix}.events.{suffix}"

    async def ensure_stream(self, *, max_age: float = 24 * 3600, memory: bool = False) -> None:
        """Create the replay stream if it does not exist yet (idempotent, safe from many workers)."""
        js = self.nc.jetstream()
        config = StreamConfig(
            name=self.stream_name,
            subjects=[self.subject(">")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.MEMORY if memory else StorageType.FILE,
            max_age=max_age,
        )
        try:
            await js.add_stream(config)
        except BadRequestError as error:
            # Another worker created it first with a different config (e.g. storage): keep theirs.
            log.info("events stream %s exists: %s", self.stream_name, error.description)

    async def publish(self, suffix: str, event: Event) -> None:
        """Publish `event` on `<prefix>.events.<suffix>`; its `type` is the subject's last token."""
        event.type = suffix.rsplit(".", 1)[-1]
        await self.nc.publish(self.subject(suffix), encode(event))

    async def subscribe(
        self,
        pattern: str,
        type_: type[E] = dict,
        cb: Callable[[str, E], Awaitable[None]] | None = None,
    ) -> Subscription | EventSubscription[E]:
        """Subscribe to `<prefix>.events.<pattern>` (NATS wildcards allowed).

        With `cb`, every event is handed to it and the subscription is returned; without, an
        `EventSubscription` to iterate.
        """
        subject = self.subject(pattern)
        if cb is None:
            return EventSubscription(await self.nc.subscribe(subject), type_)
        decoder = msgspec.msgpack.Decoder(type_)

        async def deliver(msg) -> None:
            await cb(msg.subject, decoder.decode(msg.data))

        return await self.nc.subscribe(subject, cb=deliver)
