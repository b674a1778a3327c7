"""What a request may have changed when its store fails (bus/outcome.py), and the client that sends
a state change again until its answer is definite (bus/client.py `change`)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import OutOfMemoryError

from bus import outcome
from bus.client import BusClient
from bus.codec import decode_stored, encode
from bus.connection import subscriptions_in_place
from bus.redis import ReplyLost, StoreNotReached
from bus.service import error_reply
from schemas.errors import BusError, OutcomeUnknown


async def _fails(error: BaseException) -> None:
    raise error


async def _answers() -> str:
    return "ok"


@pytest.mark.parametrize("write, may_have_changed", [
    (_answers, True),  # made
    (lambda: _fails(ReplyLost("reset after sending")), True),  # sent, reply lost: it may have run
    (lambda: _fails(TimeoutError()), True),
    (lambda: _fails(asyncio.CancelledError()), True),  # the wait gave up, not the write
    (lambda: _fails(StoreNotReached("refused")), False),  # never left
    (lambda: _fails(OutOfMemoryError("OOM")), False),  # a reply came: Redis refused it
    (lambda: _fails(KeyError("a conflict the store raised after its reply")), False),
])
async def test_a_decisive_write_counts_unless_its_failure_proves_it_changed_nothing(write, may_have_changed):
    with outcome.tracking() as tracked:
        try:
            await outcome.deciding(write())
        except BaseException:
            pass
        assert tracked.may_have_changed is may_have_changed


async def test_a_batched_commit_decides_for_the_requests_it_carries():
    with outcome.tracking() as mine:
        others = [outcome.Outcome(), outcome.Outcome()]
        with pytest.raises(ReplyLost):
            await outcome.deciding(_fails(ReplyLost("lost")), others)
        assert [o.may_have_changed for o in others] == [True, True]
        assert not mine.may_have_changed  # the task that ran the batch decided nothing of its own


async def test_change_sends_again_with_the_same_request_id_until_a_definite_answer(nc, prefix):
    seen: list[str] = []
    answers = [error_reply(OutcomeUnknown("lost")), error_reply(BusError("busy", "later")), None]

    async def respond(msg) -> None:
        seen.append(decode_stored(msg.data)["request_id"])
        reply = answers[len(seen) - 1]
        if reply is None:
            await msg.respond(encode({"done": True}))
        else:
            await nc.publish(msg.reply, reply.body, headers=reply.headers)

    sub = await nc.subscribe(f"{prefix}.thing.change", cb=respond)
    await subscriptions_in_place(nc)
    client = BusClient(nc, prefix=prefix, timeout=2)
    assert await client.change("thing.change", {"x": 1}) == {"done": True}
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0]  # one request id, made for it, sent three times
    seen.clear()
    answers[:] = [error_reply(OutcomeUnknown("lost"))] * 50
    with pytest.raises(BusError) as unknown:
        await client.change("thing.change", {"x": 1, "request_id": "mine"}, retry_for=0.5)
    assert unknown.value.code == "outcome_unknown" and set(seen) == {"mine"} and len(seen) > 1
    await sub.unsubscribe()
