"""Claims on request ids (bus/idempotency.py) against a real Redis: a dead holder's claim is taken
over within a lease, a live holder keeps its claim however long it works, an answer that cannot
be kept is undone, and what is not kept frees or expires the claim."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from bus.idempotency import IdempotencyStore, Reply, current_claim
from schemas.errors import BerthError
from tests.worker_helpers import ROOT

OK = Reply(b"\x81\xa2ok\xc3")
MALFORMED = Reply(b"{}", {"Nats-Service-Error-Code": "400", "Nats-Service-Error": "bad"})
INTERNAL = Reply(b"{}", {"Nats-Service-Error-Code": "500", "Nats-Service-Error": "oops"})

HOLDER = """
import asyncio, sys
from bus.idempotency import IdempotencyStore
from bus.redis import connect_redis

async def main(url, prefix):
    store = IdempotencyStore(connect_redis(url), prefix=prefix, lease=0.5)
    async def hold():
        print("claimed", flush=True)
        await asyncio.Event().wait()  # works until it is killed
    await store.run("scope", "job-1", b"payload", hold)

asyncio.run(main(*sys.argv[1:]))
"""


def store(redis, prefix, **options) -> IdempotencyStore:
    return IdempotencyStore(redis, prefix=prefix, **options)


async def test_a_claim_whose_holder_died_is_taken_over_as_the_next_attempt(redis, redis_url, prefix):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, redis_url, prefix], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == "claimed"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
    attempts = []

    async def call() -> Reply:
        attempts.append(current_claim.get())
        return OK

    # The retry waits while the dead holder's lease runs out (it cannot renew it), then runs.
    assert await store(redis, prefix, lease=0.5).run("scope", "job-1", b"payload", call) == OK
    assert [(c.request_id, c.attempt) for c in attempts] == [("job-1", 1)]
    assert await store(redis, prefix).run("scope", "job-1", b"payload", call) == OK  # kept: not run again
    assert len(attempts) == 1


async def test_a_live_holder_keeps_its_claim_for_as_long_as_it_works(redis, prefix):
    holder, retry = store(redis, prefix, lease=0.3), store(redis, prefix, lease=0.3, wait=10)
    runs = 0
    working = asyncio.Event()
    finish = asyncio.Event()

    async def slow() -> Reply:
        nonlocal runs
        runs += 1
        working.set()
        await finish.wait()
        return OK

    first = asyncio.create_task(holder.run("scope", "job-2", b"p", slow))
    await working.wait()
    second = asyncio.create_task(retry.run("scope", "job-2", b"p", slow))
    # Four leases pass while the holder works: it renews its claim, so the retry keeps waiting.
    key = holder.key("scope", "job-2")
    for _ in range(4):
        until = int(await redis.hget(key, "u"))
        while int(await redis.hget(key, "u")) == until:
            await asyncio.sleep(0.02)
    assert not second.done()
    finish.set()
    assert await first == OK and await second == OK
    assert runs == 1


async def test_an_answer_that_cannot_be_kept_is_undone_and_its_caller_told_to_retry(redis, prefix):
    ids = store(redis, prefix)
    undone = []

    async def overtaken() -> Reply:
        # Meanwhile a retry took the claim over (as if this run had stalled past its lease).
        await redis.hset(ids.key("scope", "job-3"), "t", "someone-else")
        return OK

    async def undo(reply: Reply) -> None:
        undone.append(reply)

    with pytest.raises(BerthError) as caught:
        await ids.run("scope", "job-3", b"p", overtaken, undo)
    assert (caught.value.code, caught.value.field) == ("busy", "request_id")
    assert undone == [OK]
    assert await redis.hget(ids.key("scope", "job-3"), "r") is None  # the other run's answer will count


async def test_a_malformed_answer_frees_the_id_and_an_internal_one_expires_the_claim(redis, prefix):
    ids = store(redis, prefix)
    claims = []

    def answering(reply: Reply):
        async def call() -> Reply:
            claims.append(current_claim.get().attempt)
            return reply

        return call

    assert await ids.run("scope", "job-4", b"bad", answering(MALFORMED)) == MALFORMED
    assert not await redis.exists(ids.key("scope", "job-4"))  # the id is free for the corrected payload
    assert await ids.run("scope", "job-4", b"good", answering(INTERNAL)) == INTERNAL
    assert await ids.run("scope", "job-4", b"good", answering(OK)) == OK
    assert claims == [0, 0, 1]  # after an internal error, the retry is the next attempt


async def test_a_retry_that_waits_too_long_for_a_live_holder_is_told_busy(redis, prefix):
    holder, impatient = store(redis, prefix, lease=0.3), store(redis, prefix, wait=0.5)
    working = asyncio.Event()
    finish = asyncio.Event()

    async def slow() -> Reply:
        working.set()
        await finish.wait()
        return OK

    first = asyncio.create_task(holder.run("scope", "job-5", b"p", slow))
    await working.wait()
    with pytest.raises(BerthError) as caught:
        await impatient.run("scope", "job-5", b"p", slow)
    assert caught.value.code == "busy"
    finish.set()
    assert await first == OK


async def test_a_reused_id_with_another_payload_is_refused(redis, prefix):
    ids = store(redis, prefix)

    async def call() -> Reply:
        return OK

    await ids.run("scope", "job-6", b"one", call)
    with pytest.raises(BerthError) as caught:
        await ids.run("scope", "job-6", b"two", call)
    assert (caught.value.code, caught.value.field) == ("invalid_argument", "request_id")
