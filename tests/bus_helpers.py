"""Helpers for tests that must show that something did *not* happen, without waiting for it.

- `EventLog` keeps every event published under a subject pattern, in arrival order (it reads the wire
  with nats-py and msgpack only, so the contract tests use it too). To show that a request published
  nothing, follow it with a change whose event must come (a sentinel) and take the events before
  that one: a worker publishes on one connection, so its events arrive in the order it sent them.
  No "nothing within N seconds" waits.
- `idempotency_keys` lists the answers stored for request ids in a namespace: a refusal of bad input
  (400) keeps none (bus/idempotency.py), any other refusal is kept under its own id and replayed.
- `eventually` polls a condition with a deadline (for state that has no event to wait on).
- `with_request_id` adds a request id to a payload where the command takes one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack

Event = tuple[str, dict[str, Any]]  # (subject, decoded body)
Match = Callable[[Event], bool] | str  # a predicate on an event, or the whole subject it must have


class EventLog:
    """The events on `<prefix>.events.<pattern>` since `open`, as (subject, body) in arrival order."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.events: list[Event] = []
        self._changed = asyncio.Event()
        self._sub = None

    @classmethod
    async def open(cls, nc, prefix: str, pattern: str = ">") -> EventLog:
        log = cls(prefix)
        log._sub = await nc.subscribe(f"{prefix}.events.{pattern}", cb=log._add)
        await nc.flush()
        return log

    async def _add(self, msg) -> None:
        self.events.append((msg.subject, msgpack.unpackb(msg.data, strict_map_key=False)))
        self._changed.set()

    def subject(self, suffix: str) -> str:
        return f"{self.prefix}.events.{suffix}"

    async def _changes(self, deadline: float) -> bool:
        """Wait for another event until `deadline` (monotonic); False once it has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), left)
        except asyncio.TimeoutError:
            pass
        return True

    async def first(self, match: Match, *, after: int = 0, timeout: float = 10.0) -> int:
        """The index of the first event from index `after` on that `match`es (a predicate on the
        (subject, body) pair, or the whole subject it must have); it must come in time."""
        wanted = (lambda event: event[0] == match) if isinstance(match, str) else match
        deadline = time.monotonic() + timeout
        while True:
            for index in range(after, len(self.events)):
                if wanted(self.events[index]):
                    return index
            if not await self._changes(deadline):
                raise AssertionError(f"no matching event within {timeout} s; got {self.events[after:]!r}")

    async def before(self, sentinel: Match, *, after: int = 0, timeout: float = 10.0) -> list[Event]:
        """The events (from index `after` on) that came before the first one that matches `sentinel`
        (as in `first`: `log.before(log.subject("resource.n1.added"))`), which must come."""
        return self.events[after:await self.first(sentinel, after=after, timeout=timeout)]

    async def wait_for(self, count: int, timeout: float = 5.0) -> list[Event]:
        """Every event so far, once there are at least `count`; they must come within `timeout`."""
        deadline = time.monotonic() + timeout
        while len(self.events) < count:
            if not await self._changes(deadline):
                raise AssertionError(f"expected {count} events, got {len(self.events)}: {self.events!r}")
        return self.events

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()


async def idempotency_keys(redis, prefix: str) -> list[str]:
    """Every request id whose answer the namespace keeps (`<prefix>:idem:*`)."""
    return sorted([key.decode() async for key in redis.scan_iter(match=f"{prefix}:idem:*")])


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 15.0, interval: float = 0.05
) -> Any:
    """Await `check()` until it returns a truthy value (that value); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last: {result!r})")
        await asyncio.sleep(interval)


async def stream_events(nc, subject: str) -> list[dict[str, Any]]:
    """The events a JetStream stream holds on `subject` (a pattern), in stream order."""
    sub = await nc.jetstream().subscribe(subject, ordered_consumer=True)
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except asyncio.TimeoutError:  # nats' TimeoutError is one: nothing more for now
                return found
            found.append(msgpack.unpackb(msg.data, strict_map_key=False))
    finally:
        await sub.unsubscribe()


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): its state in /proc is T."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def with_request_id(commands: list, command: str, payload: dict[str, Any], request_id: str) -> dict[str, Any]:
    """`payload` with `request_id` if `command` (the last token of its subject in `commands`, a service's
    command table) takes one; a command that changes nothing refuses it as an unknown key (DESIGN.md §8)."""
    takes = any(
        entry.subject.rsplit(".", 1)[-1] == command and "request_id" in entry.request.__struct_fields__
        for entry in commands
    )
    return {**payload, "request_id": request_id} if takes else payload
