"""Events as async iterators: `client.events(pattern, since=...)`.

    async with berth.events("resource.*.allocated", since="10m") as events:
        async for event in events:           # Event: subject, message, stream, seq
            print(event.subject, event.message.workload_ids)

The events the streams kept since `since` come first, then the live ones, with no gap and no
duplicate: the same `Feed` as `berth events --since` (berth/commands/events.py). Each event's
message is decoded as its service's event Struct (the `EVENTS` tables: `NodeEvent`,
`BrokerEvent`, `MetricEvent`...), or as a plain map when no table names its subject.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import TYPE_CHECKING, Any

import msgspec

from berth.commands.events import Feed, check_pattern, parse_since
from berth.commands.exits import EXIT_USAGE, CommandError
from berth.errors import Error, InvalidInput, PermissionDenied, Unavailable
from berth.registry import contracts
from bus.codec import decoder
from bus.tasks import cancel_and_wait

if TYPE_CHECKING:
    from berth.client import Client

log = logging.getLogger("berth.client")

Since = datetime | timedelta | float | str  # a time, how long ago, unix seconds, or as `berth events --since`


@dataclass(frozen=True)
class Event:
    """One event: its subject below `<prefix>.events.`, its message (the service's event Struct, or
    a map), and for a replayed one the stream and its sequence there."""

    subject: str
    message: Any
    stream: str | None = None
    seq: int | None = None


def start_of(since: Since) -> datetime:
    """The time a replay starts from."""
    if isinstance(since, datetime):
        return since if since.tzinfo else since.replace(tzinfo=timezone.utc)
    if isinstance(since, timedelta):
        return datetime.now(timezone.utc) - since
    if isinstance(since, (int, float)):
        return datetime.fromtimestamp(since, timezone.utc)
    return parse_since(since)


def _matcher(pattern: str) -> list[set[str] | None]:
    """An EVENTS table's subject pattern as tokens: a set of names (`<a|b>`, or a literal), None
    for any one token (`<node>`); a pattern of many tokens from there on (`[.<id>...]`, `<metric
    tokens>`) ends with `...`, as the string "..."."""
    tokens: list[set[str] | None] = []
    for token in pattern.split("."):
        if "[" in token or " " in token:
            tokens.append({"..."})
            break
        if token.startswith("<") and token.endswith(">"):
            names = token[1:-1]
            tokens.append(set(names.split("|")) if "|" in names else None)
        else:
            tokens.append({token})
    return tokens


def _matches(tokens: list[set[str] | None], subject: list[str]) -> bool:
    for index, wanted in enumerate(tokens):
        if wanted == {"..."}:
            return len(subject) > index
        if index >= len(subject) or (wanted is not None and subject[index] not in wanted):
            return False
    return len(tokens) == len(subject)


@cache
def _event_types() -> list[tuple[list[set[str] | None], Any]]:
    return [(_matcher(pattern), type_) for tables in contracts().values()
            for pattern, type_ in getattr(tables, "EVENTS", {}).items()]


def message_of(subject: str, data: bytes) -> Any:
    """An event's body as the Struct its subject's table names, else as a map (or its bytes, when
    it is not MessagePack at all)."""
    tokens = subject.split(".")
    for matcher, type_ in _event_types():
        if _matches(matcher, tokens):
            try:
                return decoder(type_)(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                break  # another version of the event: as a map
    try:
        return decoder()(data)
    except msgspec.DecodeError:
        return data


class Events:
    """The events of a pattern: `async with` it (or iterate it at once, and `aclose` it) and `async
    for` its `Event`s. A failure of the replay ends the iteration with its `berth.Error`."""

    def __init__(self, client: Client, pattern: str, since: Since | None, timeout: float) -> None:
        self.client = client
        self.pattern = pattern
        self.since = since
        self.timeout = timeout  # seconds for each JetStream API call
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._feed: Feed | None = None
        self._closed = False

    async def __aenter__(self) -> Events:
        await self.open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __aiter__(self) -> Events:
        return self

    async def open(self) -> None:
        """Replay and subscribe (iterating does it first)."""
        if self._feed is not None:
            return
        client = self.client
        below = f"{client.prefix}.events."
        try:
            subject = below + check_pattern(self.pattern)
        except CommandError as error:
            raise InvalidInput("invalid_argument", str(error), {"field": "pattern"}) from None
        try:
            start = None if self.since is None else start_of(self.since)
        except CommandError as error:
            raise InvalidInput("invalid_argument", str(error).replace("--since", "since"), {"field": "since"}) from None

        def deliver(full: str, data: bytes, stream: str | None = None, seq: int | None = None) -> None:
            name = full.removeprefix(below)
            self._queue.put_nowait(Event(name, message_of(name, data), stream, seq))

        args = argparse.Namespace(prefix=client.prefix, js_domain=client.js_domain, timeout=self.timeout)
        connection = client._connection
        connection.refused.clear()  # a refusal of another call before this one is not this feed's
        feed = Feed(connection, client.nc, args, subject, start, deliver, lambda text: log.info("events: %s", text))
        self._feed = feed
        client._open_events.add(self)
        try:
            await feed.open()
        except CommandError as error:
            await self.aclose()
            raise self._error(error) from None
        except BaseException:
            await self.aclose()
            raise

    async def __anext__(self) -> Event:
        await self.open()
        assert self._feed is not None
        if self._closed:
            raise StopAsyncIteration
        if not self._queue.empty():
            return self._queue.get_nowait()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait([getter, *self._feed.fetching], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                await cancel_and_wait(getter)
        if getter.done() and not getter.cancelled():
            return getter.result()
        failure = self._feed.failed()
        if isinstance(failure, CommandError):
            raise self._error(failure)
        raise Unavailable("unavailable", f"replaying {self.pattern} failed: {failure!r}") from failure

    async def aclose(self) -> None:
        """Stop: the replays' consumers are removed, the subscription ends."""
        self.client._open_events.discard(self)
        if self._feed is not None and not self._closed:
            self._closed = True
            await self._feed.close()

    def _error(self, error: CommandError) -> Error:
        if error.status == EXIT_USAGE:
            return InvalidInput("invalid_argument", str(error))
        if self.client._connection.refused.is_set() or "not allowed" in str(error):
            return PermissionDenied("permission_denied", str(error))
        return Unavailable("unavailable", str(error))
