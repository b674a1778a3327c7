"""Metrics state changes whose agent dies right after the commit, before the answer: the retry with
the same request_id answers what the first run did and does not apply it again (issue 16, item 3).

The doomed agent runs with the `after-commit` failpoint: it SIGKILLs itself the moment its change
is committed (a notifier registration in Redis, a `put` in its own store). Each test shows the
fault hit (the agent died by SIGKILL, the change it committed is there) and then retries on a
healthy agent.
"""

from __future__ import annotations

import signal

import msgpack
import pytest

from bus.codec import encode
from schemas.errors import BusError
from services.metrics.client import MetricsClient

NODE = "n1"
WATCHED = {"scope": "node", "metric": "ext.load"}


@pytest.fixture
def agent(spawn_worker):
    """Start a metrics agent of node n1 (a slow interval: these tests only use `put` values)."""

    def start(env: dict[str, str] | None = None):
        return spawn_worker("services.metrics.worker", "--node", NODE, "--interval", "60", env=env)

    return start


@pytest.fixture
def metrics(nc, prefix) -> MetricsClient:
    return MetricsClient(nc, NODE, prefix=prefix, timeout=10)  # a retry waits for a dead run's claim


@pytest.fixture
def unanswered(nc, prefix) -> MetricsClient:
    """For requests to an agent that dies before answering: the client gives up soon."""
    return MetricsClient(nc, NODE, prefix=prefix, timeout=2)


async def registrations(redis, prefix: str) -> set[str]:
    """The node's registration keys, as Redis holds them (`services.metrics.notifier_store.node_base`)."""
    return {key.decode() for key in await redis.smembers(f"{prefix}:metrics:{{{NODE}}}:notifiers")}


async def dies_after_commit(doomed, call) -> None:
    """Run `call` against the doomed agent alone; it gets no answer, and the agent died by SIGKILL."""
    with pytest.raises(BusError) as unanswered:
        await call()
    assert unanswered.value.code in ("timeout", "no_responders")
    assert doomed.wait() == -signal.SIGKILL  # it died at the failpoint, after its commit


async def registered_then_idle(agent, metrics) -> str:
    """A registration made by an agent that then stops, so that the next agent is the only one."""
    healthy = agent()
    key = (await metrics.register(**WATCHED, lease_seconds=60)).key
    healthy.signal(signal.SIGTERM)
    healthy.wait()
    return key


async def test_register_retried_after_a_crash_makes_one_registration(agent, metrics, unanswered, redis,
                                                                     prefix):
    doomed = agent({"BERTH_FAILPOINTS": "after-commit"})
    request = {**WATCHED, "lease_seconds": 60, "request_id": "reg-1"}
    await dies_after_commit(doomed, lambda: unanswered.register(**request))
    committed = await registrations(redis, prefix)
    assert len(committed) == 1  # the first run's registration landed before its agent died

    agent()
    lease = await metrics.register(**request)  # the retry takes the dead run's claim over
    assert await registrations(redis, prefix) == committed == {lease.key}  # the same one, not a second
    assert await metrics.register(**request) == lease
    assert await metrics.deregister(lease.key) is True
    assert await registrations(redis, prefix) == set()  # nothing left that nobody can deregister


async def test_renew_retried_after_a_crash_answers_the_same_lease(agent, metrics, unanswered, redis, prefix):
    # Already safe, and this shows it: a renewal sets the lease's end (now + its lease), it adds
    # nothing, so running it again at the retry restarts the lease from then, as any renewal would.
    key = await registered_then_idle(agent, metrics)
    doomed = agent({"BERTH_FAILPOINTS": "after-commit"})
    await dies_after_commit(doomed, lambda: unanswered.renew(key, request_id="renew-1"))

    agent()
    lease = await metrics.renew(key, request_id="renew-1")
    assert (lease.key, lease.lease_seconds) == (key, 60)
    assert await registrations(redis, prefix) == {key}


async def test_deregister_retried_after_a_crash_still_says_removed(agent, metrics, unanswered, redis, prefix):
    key = await registered_then_idle(agent, metrics)
    doomed = agent({"BERTH_FAILPOINTS": "after-commit"})
    await dies_after_commit(doomed, lambda: unanswered.deregister(key, request_id="dereg-1"))
    assert await registrations(redis, prefix) == set()  # the first run removed it, then died

    agent()
    # What the first run did, not "it was not registered": the retry takes the dead run's claim over.
    assert await metrics.deregister(key, request_id="dereg-1") is True
    assert await metrics.deregister(key, request_id="dereg-1") is True


async def replies(nc, subject: str, payload: dict, count: int) -> list[dict]:
    """Every agent's reply to one broadcast request (a client keeps only the first)."""
    inbox = await nc.subscribe(nc.new_inbox())
    await nc.publish(subject, encode(payload), reply=inbox.subject)
    answers = [msgpack.unpackb((await inbox.next_msg(timeout=10)).data) for _ in range(count)]
    await inbox.unsubscribe()
    return answers


@pytest.mark.parametrize("given_time", [False, True])
async def test_put_retried_after_a_crash_stores_the_first_sample(agent, nc, prefix, given_time):
    """`put` reaches every agent of the node and each keeps its own answers. One agent dies right
    after storing it; its restarted successor gets the retry, never having seen the first run:
    it must store the sample the surviving agent answered (the same time), so that the node holds
    one sample of the put and a publisher that changes hands publishes it once. With `time` given
    it was already safe: every run stores the same value and time, and a sample time seen before
    publishes nothing; without it, each agent used to take its own "now"."""
    agent()  # survives: it answers the first run and replays that answer to the retry
    doomed = agent({"BERTH_FAILPOINTS": "after-commit"})
    put = {**WATCHED, "value": 2.5, "request_id": "put-1", **({"time": 1000.0} if given_time else {})}
    subject = f"{prefix}.metrics.{NODE}.put"
    [first] = await replies(nc, subject, put, 1)
    assert doomed.wait() == -signal.SIGKILL  # it stored the put and died before answering

    agent()  # the doomed agent's replacement, as a supervisor restarts it
    retried = await replies(nc, subject, put, 2)
    assert retried == [first, first]  # the survivor's replay and the new agent's run agree
