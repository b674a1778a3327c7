"""`bus.tasks.cancel_and_wait`: the one way berth stops the tasks it started."""

from __future__ import annotations

import asyncio

from bus.tasks import cancel_and_wait


async def test_cancels_and_waits_until_every_task_has_ended():
    tasks = [asyncio.create_task(asyncio.sleep(60)) for _ in range(3)]
    assert await cancel_and_wait(*tasks) == set()
    assert all(task.cancelled() for task in tasks)


async def test_skips_tasks_not_started_and_tasks_already_done():
    done = asyncio.create_task(asyncio.sleep(0, "result"))
    await done
    assert await cancel_and_wait(None, done) == set()
    assert done.result() == "result"


async def test_cancels_again_a_task_that_swallowed_a_cancellation():
    # What Python 3.11's wait_for does when a cancellation meets the completion of what it awaits.
    swallowed = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.append(True)
        await asyncio.sleep(60)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, retry_after=0.05) == set()
    assert task.cancelled() and swallowed == [True]


async def test_timeout_gives_back_the_tasks_still_running():
    stoppable = asyncio.Event()

    async def immortal() -> None:  # swallows every cancellation until it is allowed to stop
        while not stoppable.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, retry_after=0.05, timeout=0.2) == {task}
    assert not task.done()
    stoppable.set()
    assert await cancel_and_wait(task) == set()
