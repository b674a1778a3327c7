"""Change notifications over a real nats-server and Redis, with the agent sampling this machine.

Agents run in this process at a 1 s interval. Nothing here measures time: a test waits for the
event that must come (with a generous deadline), and shows that something did *not* happen with a
sentinel, a later event that must come and that the unwanted one would have preceded. The agent
publishes every event on one connection, and each publishing pass goes through the watched
subjects in the order they were registered, so what arrives before a sentinel was published before
it. Rounds are counted with the agent's own round listener, never with the clock.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from schemas.errors import BusError
from services.metrics.client import MetricsClient
from services.metrics.config import MetricsServiceConfig
from services.metrics.worker import MetricsWorker
from tests.bus_helpers import EventLog, eventually

NODE = "n1"
INTERVAL = 1.0


@pytest.fixture
async def start_agent(nc, redis, prefix, serve):
    workers: list[MetricsWorker] = []

    async def start(**options) -> MetricsWorker:
        worker = MetricsWorker(nc, redis, prefix, MetricsServiceConfig(node=NODE, interval=INTERVAL, **options))
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
async def event_log(nc, prefix):
    """`await event_log("node.>")`: the node's events under that pattern, from now on (closed at the end)."""
    logs = []

    async def open_log(pattern: str) -> EventLog:
        logs.append(await EventLog.open(nc, prefix, f"metrics.{NODE}.{pattern}"))
        return logs[-1]

    yield open_log
    for log in logs:
        await log.close()


def metric(name: str):
    """Matches the logged events of one metric (by their body)."""
    return lambda event: event[1]["metric"] == name


def sample(sample_time: float):
    """Matches the logged events of one sample time."""
    return lambda event: event[1]["sample_time"] == sample_time


def of(events, name: str) -> list[dict]:
    return [body for _, body in events if body["metric"] == name]


async def publishing(worker: MetricsWorker) -> None:
    """Wait until the agent holds the node's publisher lease and its first round is done."""

    async def ready():
        return worker.notifier.publisher and worker.agent.synced

    await eventually(ready)


def rounds_of(worker: MetricsWorker, scope: str, metric_name: str, ids: tuple = ()) -> list[float]:
    """From now on, the sample time of `metric_name` after each round that wrote a new one, in order
    (the agent calls its round listeners right after a round, before the publisher runs)."""
    times: list[float] = []

    def listener() -> None:
        data = worker.store.latest(scope, ids, metric_name)
        if data is not None and (not times or times[-1] != data.time):
            times.append(data.time)

    worker.agent.on_round(listener)
    return times


def consecutive(part: list[float], whole: list[float]) -> bool:
    """`part` is a run of consecutive entries of `whole`."""
    if not part or part[0] not in whole:
        return False
    start = whole.index(part[0])
    return whole[start : start + len(part)] == part


# -- one event per new sample ----------------------------------------------------------------------


async def test_one_event_per_new_sample_timestamp_whatever_the_value(agent, metrics, event_log):
    log = await event_log("node.>")
    await publishing(agent)
    await metrics.register("node", "ext.temperature")
    await metrics.register("node", "ext.mark")  # a sentinel we put when we like
    await metrics.register("node", "cpu.load.1min.system")  # a sentinel that each round brings
    await metrics.put("node", "ext.temperature", 1.0, time=1000.0)
    first = await log.first(metric("ext.temperature"))
    # Same time, new value: nothing. The pass that publishes the mark ran after this put was stored.
    await metrics.put("node", "ext.temperature", 2.0, time=1000.0)
    await metrics.put("node", "ext.mark", 1, time=1.0)
    mark = await log.first(metric("ext.mark"), after=first + 1)
    assert of(log.events[first + 1 : mark], "ext.temperature") == []
    # New time, same value: an event.
    await metrics.put("node", "ext.temperature", 2.0, time=1001.0)
    second = await log.first(metric("ext.temperature"), after=mark + 1)
    # Rounds of the provisioners keep waking the publisher: two of them later, no sample came again.
    later = await log.first(metric("cpu.load.1min.system"), after=second + 1)
    later = await log.first(metric("cpu.load.1min.system"), after=later + 1)
    assert of(log.events[second + 1 : later], "ext.temperature") == []
    events = of(log.events, "ext.temperature")
    assert [(e["value"], e["sample_time"]) for e in events[:2]] == [(1.0, 1000.0), (2.0, 1001.0)]


async def test_sampled_metric_gives_one_event_per_round(agent, metrics):
    rounds = rounds_of(agent, "node", "cpu.usage.system")
    async with metrics.watch("node", "cpu.usage.system") as events:
        received = [await events.next(timeout=5 * INTERVAL) for _ in range(3)]
    times = [e.sample_time for e in received]
    assert times == sorted(set(times)), "each round's sample comes once, in order"
    # After the first (the value current at registration, maybe sampled before we counted rounds),
    # one event per round of the provisioner, none skipped and none repeated.
    assert consecutive(times[1:], rounds), (times, rounds)
    assert all(0 <= e.value <= 1024 for e in received)


async def test_event_body_and_subject(agent, metrics, event_log, prefix):
    path = "/kubepods/pod.a b*"
    log = await event_log("cgroup.*.ext.mem")  # each id is one token
    lease = await metrics.register("cgroup", "ext.mem", cgroup_path=path)
    before = time.time()
    await metrics.put("cgroup", "ext.mem", 512, cgroup_path=path, time=1234.5)
    subject, body = log.events[await log.first(metric("ext.mem"))]
    assert subject == f"{prefix}.events.metrics.{NODE}.cgroup./kubepods/pod%2Ea%20b%2A.ext.mem"
    body = dict(body)
    assert before <= body.pop("time") <= time.time()
    assert body == {
        "type": "metric", "scope": "cgroup", "metric": "ext.mem", "value": 512.0, "sample_time": 1234.5,
        "cgroup_path": path,
    }
    await metrics.deregister(lease.key)


async def test_registrations_of_one_metric_share_its_events(agent, metrics, event_log):
    log = await event_log("cpu.0.ext.ratio")
    await publishing(agent)
    for _ in range(2):
        await metrics.register("cpu", "ext.ratio", core_id=0)
    await metrics.put("cpu", "ext.ratio", 0.5, core_id=0, time=10.0)
    first = await log.first(sample(10.0))
    await metrics.put("cpu", "ext.ratio", 0.7, core_id=0, time=11.0)  # the sentinel
    sentinel = await log.first(sample(11.0), after=first + 1)
    # A second event for the second registration would have come right after the first.
    assert [body["sample_time"] for _, body in log.events[: sentinel + 1]] == [10.0, 11.0]


# -- when events stop -------------------------------------------------------------------------------


async def test_no_event_after_deregistration(agent, metrics, event_log):
    log = await event_log("node.>")
    await publishing(agent)
    lease = await metrics.register("node", "cpu.load.1min.system")
    await metrics.register("node", "cpu.load.5min.system")  # same provisioner: the sentinel
    await log.first(metric("cpu.load.1min.system"))
    assert await metrics.deregister(lease.key) is True
    deregistered = time.time()
    # A round that started after the deregistration returned published the sentinel; it would
    # have published the deregistered metric first, in the same pass.
    sentinel = await log.first(
        lambda e: metric("cpu.load.5min.system")(e) and e[1]["sample_time"] > deregistered
    )
    # An event published before the deregistration returned may arrive after it; none was published after.
    after = [e for e in of(log.events[: sentinel + 1], "cpu.load.1min.system") if e["time"] >= deregistered]
    assert after == []


async def test_no_event_after_the_lease_expires(agent, metrics, event_log, redis, prefix):
    log = await event_log("node.>")
    await publishing(agent)
    lease = await metrics.register("node", "cpu.load.1min.system", lease_seconds=1.5)
    registration = f"{prefix}:metrics:{{{NODE}}}:notifier:{lease.key}"
    # When the lease ends, at Redis's resolution (ms): an upper bound, read right after registering.
    pttl = await redis.pttl(registration)
    lease_end_ms = time.time() * 1000 + pttl
    await metrics.register("node", "cpu.load.5min.system")  # same provisioner, long lease: the sentinel
    await log.first(metric("cpu.load.1min.system"))  # events flow while the lease lives

    async def gone():
        return not await redis.exists(registration)

    await eventually(gone, timeout=10)
    ended = time.time()
    # A round that started after Redis dropped the registration: its pass would have published the
    # leased metric before the sentinel.
    sentinel = await log.first(lambda e: metric("cpu.load.5min.system")(e) and e[1]["sample_time"] > ended)
    leased = of(log.events[: sentinel + 1], "cpu.load.1min.system")
    assert leased, "events flow while the lease lives"
    # Every event was published before the lease ran out (Redis keeps expiries in whole ms).
    assert all(int(e["time"] * 1000) <= lease_end_ms for e in leased), (lease_end_ms, leased)
    with pytest.raises(BusError) as caught:
        await metrics.renew(lease.key)
    assert caught.value.code == "notifier_not_found"


async def test_a_watch_renews_its_lease(agent, metrics, redis, prefix):
    await publishing(agent)
    async with metrics.watch("node", "cpu.load.1min.system", lease_seconds=1) as events:
        key = events.lease.key
        # The current value at once, then one event per round: the fourth comes two rounds (two
        # leases) after registering, which only a renewed registration lives to see.
        for _ in range(4):
            await events.next(timeout=3 * INTERVAL)
        assert events.lease.key == key  # renewed all along, never lost and registered again
        assert await redis.exists(f"{prefix}:metrics:{{{NODE}}}:notifier:{key}")


# -- sampling never waits for a subscriber ---------------------------------------------------------


async def test_slow_subscriber_does_not_delay_sampling(agent, metrics, nc, prefix):
    # A subscriber to every event of the node that never finishes handling its first one.
    stuck = asyncio.Event()
    handled = []

    async def never_done(msg):
        handled.append(msg)
        await stuck.wait()

    slow = await nc.subscribe(f"{prefix}.events.metrics.{NODE}.>", cb=never_done)
    await nc.flush()
    rounds = rounds_of(agent, "node", "cpu.usage.system")
    leases = [await metrics.register("cpu", "cpu.usage.ratio.cpu", core_id=cpu) for cpu in range(2)]
    for name in ("mem.free.system", "cpu.load.1min.system"):
        leases.append(await metrics.register("node", name))
    async with metrics.watch("node", "cpu.usage.system") as events:
        received = [await events.next(timeout=5 * INTERVAL) for _ in range(4)]
    # The slow subscriber is still on its first event, with the others queued behind it.
    assert len(handled) == 1 and slow.pending_msgs > 0
    stuck.set()
    # Meanwhile every round went on and was published: one event per round, none skipped.
    times = [e.sample_time for e in received]
    assert consecutive(times[1:], rounds), (times, rounds)
    for lease in leases:
        await metrics.deregister(lease.key)
    await slow.unsubscribe()


async def test_node_cpu_usage_rises_within_two_intervals_when_a_child_burns_cpu(agent, metrics):
    async with metrics.watch("node", "cpu.usage.system") as events:
        baseline = min([(await events.next(timeout=5 * INTERVAL)).value for _ in range(2)])
        burn = "print('burning', flush=True)\nwhile True: pass"
        burner = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
        try:
            assert burner.stdout.readline().strip() == "burning"
            started = time.time()
            # The first round that starts after the burner did covers part of an interval of
            # burning; the second covers a whole one: by then the usage has risen.
            after = []
            while len(after) < 2:
                event = await events.next(timeout=5 * INTERVAL)
                if event.sample_time > started:
                    after.append(event)
        finally:
            burner.kill()
            burner.wait()
    seen = [(e.sample_time, e.value) for e in after]
    assert any(e.value >= baseline + 0.5 for e in after), (baseline, started, seen)


# -- several agents on one node --------------------------------------------------------------------


async def test_one_agent_of_a_node_publishes_and_another_takes_over(start_agent, metrics, event_log):
    first = await start_agent()
    second = await start_agent()
    log = await event_log("node.ext.count")
    await metrics.register("node", "ext.count")
    for worker in (first, second):  # whichever answered, the publisher learns of it on its next sync
        await worker.notifier.sync()
    for n in range(3):  # put reaches both agents; only the publisher publishes
        await metrics.put("node", "ext.count", n, time=100.0 + n)
        await log.first(lambda e, n=n: e[1]["value"] == n)
    for worker in (first, second):  # a publishing pass of each, done: whatever they publish is out
        await worker.notifier.publish_new_samples()
    await metrics.put("node", "ext.count", 99, time=199.0)  # the sentinel
    sentinel = await log.first(lambda e: e[1]["value"] == 99.0)
    assert [body["value"] for _, body in log.events[:sentinel]] == [0.0, 1.0, 2.0]
    publisher, standby = (first, second) if first.notifier.publisher else (second, first)
    assert not standby.notifier.publisher
    await publisher.stop()

    async def taken_over():
        return standby.notifier.publisher

    await eventually(taken_over, timeout=10)
    await metrics.put("node", "ext.count", 3, time=200.0)
    # The new publisher continues from the record of the old one: sample 199 is not sent again.
    new = await log.first(lambda e: e[1]["value"] == 3.0, after=sentinel + 1)
    assert log.events[sentinel + 1 : new] == []
