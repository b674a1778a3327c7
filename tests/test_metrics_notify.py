"""Change notifications over a real nats-server and Redis, with the agent sampling this machine.

Agents run in this process at a 1 s interval. Deadlines are generous and functional (an event must
come within a few intervals), never performance thresholds: the machine is shared and noisy.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgpack
import msgspec
import pytest
from nats.errors import TimeoutError as NatsTimeout

from bus.errors import BusError
from services.metrics.client import MetricsClient
from services.metrics.messages import MetricEvent
from services.metrics.worker import MetricsWorker, Options

NODE = "n1"
INTERVAL = 1.0


@pytest.fixture
async def start_agent(nc, redis, prefix, serve):
    workers: list[MetricsWorker] = []

    async def start(**options) -> MetricsWorker:
        worker = MetricsWorker(nc, redis, prefix, Options(node=NODE, interval=INTERVAL, **options))
        worker.start()
        workers.append(worker)
        await serve(worker.service)
        return worker

    yield start
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def agent(start_agent) -> MetricsWorker:
    return await start_agent()


@pytest.fixture
def metrics(nc, prefix) -> MetricsClient:
    return MetricsClient(nc, NODE, prefix=prefix)


@pytest.fixture
async def subscribe(nc, prefix):
    """Subscribe to `<prefix>.events.metrics.<NODE>.<suffix>`; unsubscribed at the end of the test
    (a subscription left with unread messages would hold up the session connection's drain)."""
    subs = []

    async def start(suffix: str, **options):
        sub = await nc.subscribe(f"{prefix}.events.metrics.{NODE}.{suffix}", **options)
        await nc.flush()
        subs.append(sub)
        return sub

    yield start
    for sub in subs:
        await sub.unsubscribe()


async def collect(sub, seconds: float) -> list:
    """Every message a raw subscription receives within `seconds`."""
    received = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            received.append(await sub.next_msg(timeout=left))
        except NatsTimeout:
            break
    return received


_EVENT = msgspec.msgpack.Decoder(MetricEvent)


def decode(msg) -> MetricEvent:
    return _EVENT.decode(msg.data)


# -- one event per new sample ----------------------------------------------------------------------


async def test_one_event_per_new_sample_timestamp_whatever_the_value(agent, metrics):
    async with metrics.watch("node", "ext.temperature") as events:
        await metrics.put("node", "ext.temperature", 1.0, time=1000.0)
        first = await events.next(timeout=5)
        await metrics.put("node", "ext.temperature", 2.0, time=1000.0)  # same time, new value: nothing
        await metrics.put("node", "ext.temperature", 2.0, time=1001.0)  # new time, same value: an event
        second = await events.next(timeout=5)
        # Rounds of the provisioners keep waking the publisher; none of them repeats a sample.
        with pytest.raises(NatsTimeout):
            await events.next(timeout=2.5 * INTERVAL)
    assert [(e.value, e.sample_time) for e in (first, second)] == [(1.0, 1000.0), (2.0, 1001.0)]


async def test_sampled_metric_gives_one_event_per_round(agent, metrics):
    async with metrics.watch("node", "cpu.usage.system") as events:
        received = [await events.next(timeout=5 * INTERVAL) for _ in range(3)]
    times = [e.sample_time for e in received]
    assert times == sorted(set(times)), "each round's sample comes once, in order"
    for earlier, later in zip(times, times[1:]):
        assert later - earlier == pytest.approx(INTERVAL, abs=0.5)
    assert all(0 <= e.value <= 1024 for e in received)


async def test_event_body_and_subject(agent, metrics, subscribe, prefix):
    path = "/kubepods/pod.a b*"
    sub = await subscribe("cgroup.*.ext.mem")  # each id is one token
    lease = await metrics.register("cgroup", "ext.mem", cgroup_path=path)
    before = time.time()
    await metrics.put("cgroup", "ext.mem", 512, cgroup_path=path, time=1234.5)
    msg = await sub.next_msg(timeout=5)
    assert msg.subject == f"{prefix}.events.metrics.{NODE}.cgroup./kubepods/pod%2Ea%20b%2A.ext.mem"
    body = msgpack.unpackb(msg.data)
    assert before <= body.pop("time") <= time.time()
    assert body == {
        "type": "metric", "scope": "cgroup", "metric": "ext.mem", "value": 512.0, "sample_time": 1234.5,
        "cgroup_path": path,
    }
    await metrics.deregister(lease.key)


async def test_registrations_of_one_metric_share_its_events(agent, metrics, subscribe):
    sub = await subscribe("cpu.0.ext.ratio")
    for _ in range(2):
        await metrics.register("cpu", "ext.ratio", core_id=0)
    await metrics.put("cpu", "ext.ratio", 0.5, core_id=0, time=10.0)
    received = await collect(sub, 1.5)
    assert [decode(m).sample_time for m in received] == [10.0]


# -- when events stop -------------------------------------------------------------------------------


async def test_no_event_after_deregistration(agent, metrics, subscribe):
    sub = await subscribe("node.cpu.usage.system")
    lease = await metrics.register("node", "cpu.usage.system")
    await sub.next_msg(timeout=5 * INTERVAL)
    assert await metrics.deregister(lease.key) is True
    deregistered = time.time()
    # An event published before the deregistration returned may still be on its way; none after.
    later = [e for e in map(decode, await collect(sub, 2.5 * INTERVAL)) if e.time >= deregistered]
    assert later == []


async def test_no_event_after_the_lease_expires(agent, metrics, subscribe):
    sub = await subscribe("node.cpu.usage.system")
    lease = await metrics.register("node", "cpu.usage.system", lease_seconds=1.5)
    ends = time.time() + lease.lease_seconds
    received = [decode(m) for m in await collect(sub, 1.5 + 2.5 * INTERVAL)]
    assert received, "events flow while the lease lives"
    # An event's `time` is taken just after the pass found the registration alive: allow that moment.
    assert all(e.time < ends + 0.05 for e in received)
    with pytest.raises(BusError) as caught:
        await metrics.renew(lease.key)
    assert caught.value.code == "notifier_not_found"


async def test_a_watch_renews_its_lease(agent, metrics):
    async with metrics.watch("node", "cpu.usage.system", lease_seconds=1) as events:
        await asyncio.sleep(2.5)  # well past the 1 s lease
        started = time.time()
        event = await events.next(timeout=3 * INTERVAL)
        while event.time < started:  # skip what queued up while we slept
            event = await events.next(timeout=3 * INTERVAL)
    assert event.sample_time > started - INTERVAL


# -- sampling never waits for a subscriber ---------------------------------------------------------


async def test_slow_subscriber_does_not_delay_sampling(agent, metrics, subscribe):
    # A subscriber to every event of the node that never finishes handling its first one.
    stuck = asyncio.Event()
    handled = []

    async def never_done(msg):
        handled.append(msg)
        await stuck.wait()

    slow = await subscribe(">", cb=never_done)
    leases = [await metrics.register("cpu", "cpu.usage.ratio.cpu", core_id=cpu) for cpu in range(2)]
    for metric in ("mem.free.system", "cpu.load.1min.system"):
        leases.append(await metrics.register("node", metric))
    async with metrics.watch("node", "cpu.usage.system") as events:
        received = [await events.next(timeout=5 * INTERVAL) for _ in range(4)]
    # The slow subscriber is still on its first event, with the others queued behind it.
    assert len(handled) == 1 and slow.pending_msgs > 0
    stuck.set()
    times = [e.sample_time for e in received]
    assert all(0.5 * INTERVAL < later - earlier < 1.5 * INTERVAL for earlier, later in zip(times, times[1:]))
    for lease in leases:
        await metrics.deregister(lease.key)


async def test_node_cpu_usage_rises_within_two_intervals_when_a_child_burns_cpu(agent, metrics):
    async with metrics.watch("node", "cpu.usage.system") as events:
        baseline = min([(await events.next(timeout=5 * INTERVAL)).value for _ in range(2)])
        burn = "print('burning', flush=True)\nwhile True: pass"
        burner = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
        try:
            assert burner.stdout.readline().strip() == "burning"
            started = time.time()
            # The round that ends a full interval of burning comes at most two intervals after the start.
            deadline = started + 2 * INTERVAL
            seen = []
            while not seen or not (seen[-1].sample_time > started and seen[-1].value >= baseline + 0.5):
                try:
                    seen.append(await events.next(timeout=max(0.01, deadline + 2 - time.time())))
                except NatsTimeout:
                    break
        finally:
            burner.kill()
            burner.wait()
    risen = [e for e in seen if e.sample_time > started and e.value >= baseline + 0.5]
    assert risen and risen[0].sample_time <= deadline + 0.25, (
        baseline, started, [(e.sample_time, e.value) for e in seen]
    )


# -- several agents on one node --------------------------------------------------------------------


async def test_one_agent_of_a_node_publishes_and_another_takes_over(start_agent, metrics, subscribe):
    first = await start_agent()
    second = await start_agent()
    sub = await subscribe("node.ext.count")
    await metrics.register("node", "ext.count")
    for worker in (first, second):  # whichever answered, the publisher learns of it on its next sync
        await worker.notifier.sync()
    for n in range(3):  # put reaches both agents; only the publisher publishes
        await metrics.put("node", "ext.count", n, time=100.0 + n)
    received = [decode(m).value for m in await collect(sub, 1.0)]
    assert received == [0.0, 1.0, 2.0]
    publisher, standby = (first, second) if first.notifier.publisher else (second, first)
    assert not standby.notifier.publisher
    await publisher.stop()
    deadline = time.monotonic() + 10
    while not standby.notifier.publisher:
        assert time.monotonic() < deadline, "the standby agent did not take over"
        await asyncio.sleep(0.1)
    await metrics.put("node", "ext.count", 3, time=103.0)
    # The new publisher continues from the record of the old one: sample 102 is not sent again.
    assert decode(await sub.next_msg(timeout=5)).value == 3.0
