"""Events: publish a Struct on `<prefix>.events.<...>`, subscribe with a callback or an iterator.

JetStream streams keep events for replay. Each service says which stream keeps its events and for
how long (a `StreamSpec`): change events that clients replay after a restart are kept a day, one
metric sample a second only a short while, so they live in different streams. `ensure_stream`
creates a stream or adds the service's subjects to it, so every worker can call it on start.
On a NATS cluster of three or more servers, streams are replicated three times.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, TypeVar

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from bus.codec import decoder, encode
from schemas.common import Event

log = logging.getLogger("berth.events")
# JetStream's "no suitable peers for placement": too few servers of a cluster answer to hold a
# replicated stream.
NO_SUITABLE_PEERS = 10005


E = TypeVar("E")
T = TypeVar("T")


@dataclass(frozen=True)
class StreamSpec:
    """A stream that keeps events: `<prefix>-<name>` over `<prefix>.events.<subject>` for each
    subject given, within the limits given (the oldest events go first)."""

    name: str
    subjects: tuple[str, ...]
    max_age: float  # seconds
    max_bytes: int
    max_msgs_per_subject: int = -1  # -1: no limit


class StreamMissing(RuntimeError):
    """A stream, or some of its subjects, that this worker may not set up itself."""

    def __init__(self, stream: str, subjects: list[str]) -> None:
        super().__init__(f"the events stream {stream} does not keep {', '.join(subjects)}, and this worker's user "
                         "may not change streams: an administrator sets them up (`berth up` does, before its workers)")


class EventSubscription(Generic[E]):
    """An async iterator of (subject, event); use as `async with` to unsubscribe at the end."""

    def __init__(self, sub: Subscription, type_: type[E]) -> None:
        self.sub = sub
        self.decode = decoder(type_)

    def __aiter__(self) -> AsyncIterator[tuple[str, E]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, E]]:
        async for msg in self.sub.messages:
            yield msg.subject, self.decode(msg.data)

    async def next(self, timeout: float) -> tuple[str, E]:
        msg = await self.sub.next_msg(timeout=timeout)
        return msg.subject, self.decode(msg.data)

    async def close(self) -> None:
        await self.sub.unsubscribe()

    async def __aenter__(self) -> "EventSubscription[E]":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class Acknowledgements:
    """JetStream publishes whose acknowledgements come back on one wildcard inbox of the
    connection, each to its own future. nats-py's `publish_async` does the same with a semaphore,
    a random token and a parsed PubAck per message: twice the CPU of this, for every event."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.inbox = f"{nc.new_inbox()}."
        self._waiting: dict[str, asyncio.Future] = {}
        self._tokens = itertools.count()

    @classmethod
    async def start(cls, nc: Client) -> "Acknowledgements":
        acks = cls(nc)
        await nc.subscribe(f"{acks.inbox}*", cb=acks._answered)
        return acks

    async def publish(self, subject: str, data: bytes, msg_id: str) -> asyncio.Future:
        token = str(next(self._tokens))
        ack = asyncio.get_running_loop().create_future()
        self._waiting[token] = ack
        ack.add_done_callback(lambda _: self._waiting.pop(token, None))  # also when cancelled
        await self.nc.publish(subject, data, reply=self.inbox + token, headers={"Nats-Msg-Id": msg_id})
        return ack

    async def _answered(self, msg) -> None:
        ack = self._waiting.pop(msg.subject[len(self.inbox):], None)
        if ack is None or ack.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            ack.set_exception(NoStreamResponseError())  # no stream takes the subject
        elif not msg.data or (b'"error"' in msg.data and "error" in json.loads(msg.data)):
            ack.set_exception(RuntimeError(f"the stream refused the event: {msg.data!r}"))
        else:
            ack.set_result(None)


class EventBus:
    """`js_domain`: the streams' JetStream API is at `$JS.<js_domain>.API` (where the streams live
    in another NATS account, see berth/accounts.py); None: the connection's own `$JS.API`."""

    def __init__(self, nc: Client, *, prefix: str = "berth", js_domain: str | None = None) -> None:
        self.nc = nc
        self.prefix = prefix
        self.js_domain = js_domain
        self._acks: Acknowledgements | None = None  # made on first use

    def stream_name(self, spec: StreamSpec) -> str:
        return f"{self.prefix}-{spec.name}"

    def subject(self, suffix: str) -> str:
        return f"{self.prefix}.events.{suffix}"

    async def ensure_stream(
        self, spec: StreamSpec, *, memory: bool = False, attempts: int = 5, wait: float = 60.0, create: bool = True
    ) -> None:
        """Create the stream, or add this service's subjects to it (other services share it).

        Idempotent and safe from many workers at once: a worker that lost a race reads the stream
        again and adds what is still missing. On a NATS cluster that is still starting, or whose
        JetStream leader just went away, every step is asked again until JetStream answers, for
        `wait` seconds at most. `create` False: only check that the stream is there with this
        service's subjects (a worker whose user may not change streams, berth/accounts.py)."""
        js = self.nc.jetstream(domain=self.js_domain)
        deadline = asyncio.get_running_loop().time() + wait
        wanted = [self.subject(subject) for subject in spec.subjects]
        config = StreamConfig(
            name=self.stream_name(spec),
            subjects=wanted,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.MEMORY if memory else StorageType.FILE,
            max_age=spec.max_age,
            max_bytes=spec.max_bytes,
            max_msgs_per_subject=spec.max_msgs_per_subject,
            num_replicas=3 if len(self.nc.servers) >= 3 else 1,
        )
        for _ in range(attempts):
            try:
                current = (await _when_ready("info", lambda: js.stream_info(config.name), deadline)).config
            except NotFoundError:
                if not create:
                    raise StreamMissing(config.name, wanted) from None
                try:
                    await _when_ready("create", lambda: js.add_stream(config), deadline)
                    return
                except BadRequestError as error:  # another worker created it meanwhile
                    log.info("events stream %s: %s", config.name, error.description)
                    continue
            missing = [subject for subject in wanted if subject not in (current.subjects or [])]
            if not missing:
                return
            if not create:
                raise StreamMissing(config.name, missing)
            current.subjects = [*current.subjects, *missing]
            try:
                await _when_ready("update", lambda: js.update_stream(current), deadline)
            except BadRequestError as error:
                log.info("events stream %s: %s", config.name, error.description)
        raise RuntimeError(f"could not add {wanted} to the events stream {config.name}")

    async def publish(self, suffix: str, event: Event) -> None:
        """Publish `event` on `<prefix>.events.<suffix>`; its `type` is the subject's last token."""
        event.type = suffix.rsplit(".", 1)[-1]
        await self.nc.publish(self.subject(suffix), encode(event))

    async def publish_acked(self, suffix: str, data: bytes, msg_id: str) -> asyncio.Future:
        """Publish encoded `data` on `<prefix>.events.<suffix>` now; the future returned resolves
        when its stream has it, or fails with what the stream answered (it may never resolve:
        wait for it with a timeout). `msg_id` names the event: a second copy within the stream's
        duplicate window is dropped."""
        if self._acks is None:
            self._acks = await Acknowledgements.start(self.nc)
        return await self._acks.publish(self.subject(suffix), data, msg_id)

    async def subscribe(
        self,
        pattern: str,
        type_: type[E] = dict,
        cb: Callable[[str, E], Awaitable[None]] | None = None,
        *,
        queue: str = "",
    ) -> Subscription | EventSubscription[E]:
        """Subscribe to `<prefix>.events.<pattern>` (NATS wildcards allowed).

        With `cb`, every event is handed to it and the subscription is returned; without, an
        `EventSubscription` to iterate. With `queue`, each event goes to one of the subscribers
        that name the same queue (one replica of a service reacts, not all).
        """
        subject = self.subject(pattern)
        if cb is None:
            return EventSubscription(await self.nc.subscribe(subject, queue=queue), type_)
        decode = decoder(type_)

        async def deliver(msg) -> None:
            await cb(msg.subject, decode(msg.data))

        return await self.nc.subscribe(subject, queue=queue, cb=deliver)


async def _when_ready(step: str, call: Callable[[], Awaitable[T]], deadline: float) -> T:
    """`call()`, asked again while JetStream does not answer: a NATS cluster elects its JetStream
    leader, and places a replicated stream's peers, in seconds after it starts (or after the
    leader's server went away); until then its API times out or answers 503. A replicated stream
    also waits for its peers: a server that stopped answering is offline until it comes back."""
    while True:
        try:
            return await call()
        except (NatsTimeout, ServiceUnavailableError, BadRequestError) as error:
            waiting = not isinstance(error, BadRequestError) or error.err_code == NO_SUITABLE_PEERS
            if not waiting or asyncio.get_running_loop().time() > deadline:
                raise
            log.info("JetStream did not answer the stream %s yet; asking again", step)
            await asyncio.sleep(0.5)
