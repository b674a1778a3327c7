"""Stopping background tasks for certain: the one way berth stops a task it started.

Python 3.11's `asyncio.wait_for` loses a cancellation that arrives just as the awaited future
completes (fixed in 3.12). Library calls use it (nats-py's `request`, for one), so a cancelled task
can run on as if nothing happened; measured here: a notifier-renewing loop outlived its `cancel()`.
A bare `task.cancel()` followed by `await task` (or `asyncio.gather(...)`) can then wait for ever,
and one without the await leaves the task running. `cancel_and_wait` cancels again until every
task has really ended.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("berth.tasks")


async def cancel_and_wait(
    *tasks: asyncio.Task | None, retry_after: float = 0.5, timeout: float | None = None
) -> set[asyncio.Task]:
    """Cancel `tasks` (None entries are skipped: a task not started yet) and wait until all have
    ended, cancelling again every `retry_after` seconds those that are still running.

    With `timeout`, give up after that many seconds; returns the tasks still running then (empty
    without a timeout). A task's outcome (its result, exception or cancellation) stays on the task.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {task for task in tasks if task is not None and not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        wait = retry_after if deadline is None else min(retry_after, deadline - time.monotonic())
        if wait <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=wait)
    return pending


async def every(period: float, work, what: str) -> None:
    """Run `await work()` every `period` seconds until cancelled. A failure is logged and the next
    round comes as usual: a background chore must outlive a moment without Redis or NATS."""
    while True:
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; trying again in %.1f s", what, period)
        await asyncio.sleep(period)
