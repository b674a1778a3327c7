"""Whether a request may have changed anything yet: what its answer may say when the store stops
answering (DESIGN.md §8, "An error never hides a change").

A store sends the write that decides a request (a commit, a claim of a sale, a registration)
through `deciding(...)`. From then on the request may have changed something, unless the write's
own reply says it did not (a refusal: a stale version, Redis out of memory) or it never left
(`bus.redis.StoreNotReached`: no connection). A write whose reply was lost (`ReplyLost`: a reset,
or the command timeout on a silent link) may have run.

The service runtime gives every request its `Outcome` (`tracking`); background tasks a request
starts share it (they run for the request). When the store fails, the runtime answers
`unavailable` (503) if the request sent nothing decisive, and otherwise first tries to learn what
happened (bus.idempotency), then `outcome_unknown` (504).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Iterable, Iterator
from typing import TypeVar

from redis import exceptions as redis_errors

T = TypeVar("T")


class Outcome:
    """One request's decisive writes that may have reached the store (`sent`)."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    @property
    def may_have_changed(self) -> bool:
        return self.sent > 0


_current: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar("berth_outcome", default=None)


@contextlib.contextmanager
def tracking() -> Iterator[Outcome]:
    """The outcome of the request this task serves, from here to the end of the block."""
    outcome = Outcome()
    token = _current.set(outcome)
    try:
        yield outcome
    finally:
        _current.reset(token)


def current() -> Outcome | None:
    return _current.get()


def _not_applied(error: BaseException) -> bool:
    """Whether a failed write certainly changed nothing: it never left, or its reply came and said
    no (a refusal by Redis, a version conflict the store raised). A reply that did not come (the
    connection failed after sending, a timeout, the wait cancelled) proves nothing."""
    from bus.redis import StoreNotReached  # bus.redis imports nothing of this module

    if isinstance(error, StoreNotReached):
        return True
    lost = (redis_errors.ConnectionError, redis_errors.TimeoutError, asyncio.CancelledError, OSError, TimeoutError)
    return not isinstance(error, lost)


def changed() -> None:
    """The current request has made its change outside the store (in the worker's own memory: a
    metric `put`): whatever fails from here, it is made."""
    outcome = _current.get()
    if outcome is not None:
        outcome.sent += 1


async def deciding(write: Awaitable[T], outcomes: Iterable[Outcome | None] | None = None) -> T:
    """Await `write`, the decisive write of the current request (or of `outcomes`: the requests a
    batched commit decides for): they may have changed something, unless it failed in a way that
    proves it did not."""
    marked = [o for o in (outcomes if outcomes is not None else [_current.get()]) if o is not None]
    for outcome in marked:
        outcome.sent += 1
    try:
        return await write
    except BaseException as error:
        if _not_applied(error):
            for outcome in marked:
                outcome.sent -= 1
        raise
