"""Stopping background tasks for certain.

Python 3.11's `asyncio.wait_for` loses a cancellation that arrives just as the awaited future
completes (fixed in 3.12). Library calls use it (nats-py's `request`, for one), so a cancelled task
can run on as if nothing happened; measured here: a notifier-renewing loop outlived its `cancel()`.
`cancel_and_wait` cancels again until every task has really ended.
"""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Task, retry_after: float = 0.5) -> None:
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_after)
