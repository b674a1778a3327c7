"""Partitions: an allocation worker cut off from Redis, or from NATS, under load, then healed.

The worker under test reaches its server through `tests.tcp_proxy.TcpProxy`; a second worker and
the clients talk to the real servers. Clients send allocates with unique request ids, forever
until the scenario ends, and send each again with the same id while the answer is "not yet"
(timeout, busy, unavailable). The worker must never answer wrongly while cut (no `internal`, no
success that the ledger does not hold), must serve again once healed, and at the end:

- every placement a client was answered with is in its node's ledger, and no id is in two;
- usage equals the ledger on every node, nothing is over-committed;
- the ledgers hold nothing no client was answered with (once the claims of runs that never
  answered have expired and their retries gave back what they placed).

Each test also shows that its cut hit: the proxy closed live connections, and clients saw the
worker answer `unavailable` or time out, or the worker vanish from NATS and come back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from urllib.parse import urlsplit

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tests.allocation_helpers import allocate_until_answered, check_invariants
from tests.bus_helpers import eventually
from tests.tcp_proxy import MODES, TcpProxy
from tests.worker_helpers import start_worker, stop_workers

NODES = [f"p{i}" for i in range(8)]
CORES = 16  # 128 placements fit: commits go on through the cut, and the nodes fill up after it
CLIENTS = 32
RETRIED = {"timeout", "no_responders", "busy", "unavailable"}  # "not yet": same request again
WORKER = "services.allocation.worker"


@pytest.fixture
async def proxies():
    """`await make(url)` -> a TcpProxy to that server; all closed at the end."""
    made: list[TcpProxy] = []

    async def make(url: str) -> TcpProxy:
        parts = urlsplit(url.split(",")[0])
        made.append(await TcpProxy.start(parts.hostname, parts.port))
        return made[-1]

    yield make
    for proxy in made:
        await proxy.close()


@pytest.fixture
async def workers(prefix):
    """`await start(nats_url, redis_url)` -> an allocation worker process; stopped at the end.
    Started in a thread: waiting for its ready line must not block the loop that runs the proxy."""
    started = []

    async def start(nats: str, redis: str):
        started.append(await asyncio.to_thread(start_worker, WORKER, nats, redis, prefix))
        return started[-1]

    yield start
    await asyncio.to_thread(stop_workers, started)  # the loop relays their drain through a proxy


class Load:
    """CLIENTS clients allocating with fresh request ids until `stop()`; every answer kept."""

    def __init__(self, client) -> None:
        self.client = client
        self.answers: dict[str, dict | str] = {}
        self.retries: list[str] = []  # the "not yet" codes met, in order
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(CLIENTS)]

    async def _client(self, n: int) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            request_id = f"c{n}-{i}"
            self.answers[request_id] = await allocate_until_answered(
                self.client, NODES, request_id, self.retries, retried=RETRIED
            )

    def wrong(self) -> list[str]:
        """Answers no request may get: an error other than a refusal for capacity (`internal`...)."""
        return [a for a in self.answers.values() if not isinstance(a, dict) and a != "insufficient_capacity"]

    async def answered(self, count: int) -> None:
        """Wait until `count` more requests are answered than now."""
        target = len(self.answers) + count
        await self.until(lambda: len(self.answers) >= target)

    async def until(self, condition) -> None:
        """Wait for `condition()`; a wrong answer meanwhile fails at once, not by a timeout."""

        async def check() -> bool:
            assert self.wrong() == [], self.wrong()
            return condition()

        await eventually(check, timeout=30)

    async def stop(self) -> None:
        """Let every client finish the request it is on (retrying until answered), then stop."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def add_nodes(client) -> None:
    for node in NODES:
        resource = {"cpumem": {"cpu": CORES, "memory": "64G"}}
        await client.request("resource.add-node", {"nodename": node, "resource": resource})


async def ledgers(client) -> dict[str, list[str]]:
    held = {}
    for node in NODES:
        reply = await client.request("resource.get-allocations", {"nodename": node})
        held[node] = [a["workload_id"] for a in reply["allocations"]]
    return held


async def check_answers_hold(client, answers: dict[str, dict | str]) -> None:
    """Every answer was true, and the ledgers hold exactly what was answered."""
    refused = {reply for reply in answers.values() if not isinstance(reply, dict)}
    assert refused <= {"insufficient_capacity"}, refused  # never internal, never a stray code
    replies = [reply for reply in answers.values() if isinstance(reply, dict)]
    placed = {(a["workload_id"], a["nodename"]) for reply in replies for a in reply["allocations"]}
    answered_ids = {wid for wid, _ in placed}

    async def no_orphans() -> dict[str, list[str]] | None:
        # A run cut off mid-request may still hold placements until its retry's takeover (after
        # the 2 s lease) or its own undo gives them back: wait for that, then check.
        held = await ledgers(client)
        return held if {w for ids in held.values() for w in ids} <= answered_ids else None

    try:
        held = await eventually(no_orphans, timeout=20)
    except AssertionError:
        held = await ledgers(client)
    all_held = [w for ids in held.values() for w in ids]
    assert len(all_held) == len(set(all_held)), "an id is in two ledgers"
    missing = {(w, node) for w, node in placed if w not in held[node]}
    assert missing == set(), "answered placements that their node's ledger does not hold"
    assert set(all_held) - answered_ids == set(), "orphans: ledger entries no client was answered with"
    assert await check_invariants(client, NODES) == len(placed)  # usage == ledger, no over-commit


async def serves_again(load: Load) -> None:
    """The only worker left answers an allocate at once (its Redis is reachable again): the answer
    joins the others, so `check_answers_hold` judges it too."""
    answer = await allocate_until_answered(load.client, NODES, "after-heal", [], retried=set())
    load.answers["after-heal"] = answer


# -- Redis link ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
async def test_worker_cut_from_redis_answers_unavailable_or_nothing_then_recovers(
    mode, client, nats_url, redis_url, proxies, workers
):
    proxy = await proxies(redis_url)
    cut_off = await workers(nats_url, proxy.url("redis", urlsplit(redis_url).path))
    healthy = await workers(nats_url, redis_url)
    await add_nodes(client)
    load = Load(client)
    load.start()
    await load.answered(40)

    assert proxy.cut(mode) > 0  # the worker's live Redis connections were closed (or frozen)
    # Only the cut worker can answer `unavailable` or let a request time out (the other one reaches
    # Redis directly). Keep the link cut until requests that came after the cut met it, not only
    # those in flight:
    # the worker tried to connect again (a stall closes nothing: it has no reason to), and since
    # then clients were answered `unavailable` (its Redis calls failed) or, with new connections
    # black-holed or every byte held, nothing (they timed out, after the 2 s lease of the runs
    # they had started: the retries took their claims over on the other worker).
    if mode != "stall":
        await load.until(lambda: proxy.refused + proxy.held > 0)
    mark = len(load.retries)
    expected = "unavailable" if mode == "reset" else "timeout"
    await load.until(lambda: load.retries[mark:].count(expected) >= 10)
    accepted = proxy.accepted
    proxy.restore()
    await load.answered(60)
    await load.stop()

    if mode != "stall":  # a stall's connections live on: late, the held commands run now
        assert proxy.accepted > accepted  # the worker reached Redis again through the healed link
    assert cut_off.proc.poll() is None
    await asyncio.to_thread(stop_workers, [healthy])  # from here only the healed worker answers
    await serves_again(load)
    await check_answers_hold(client, load.answers)


# -- NATS link -------------------------------------------------------------------------------


async def srv(nc, verb: str, name: str, instance: str) -> dict | None:
    """The instance's `$SRV.<verb>` answer, or None when it is not on the bus."""
    try:
        return json.loads((await nc.request(f"$SRV.{verb}.{name}.{instance}", b"", timeout=1)).data)
    except (NoRespondersError, NatsTimeout):
        return None


def allocate_requests(stats: dict) -> int:
    return next(e["num_requests"] for e in stats["endpoints"] if e["subject"].endswith(".resource.allocate"))


@pytest.mark.slow
# Not "stall": a frozen NATS connection is noticed only after the client's missed pings (15 s or
# more), and the point here is the drop and the reconnect.
@pytest.mark.parametrize("mode", ["reset", "drop"])
async def test_worker_cut_from_nats_reconnects_and_others_serve_meanwhile(
    mode, nc, client, prefix, nats_url, redis_url, proxies, workers
):
    proxy = await proxies(nats_url)
    cut_off = await workers(proxy.url("nats"), redis_url)
    await workers(nats_url, redis_url)
    name, instance = f"{prefix}-allocation", cut_off.instance_id
    await add_nodes(client)
    load = Load(client)
    load.start()
    await load.answered(40)

    assert proxy.cut(mode) == 1  # the worker's one NATS connection was closed
    # The cut hit: the worker is gone from the bus; the load goes on through the other worker.
    await eventually(lambda: _none(srv(nc, "PING", name, instance)), timeout=30)
    await load.answered(40)
    await load.until(lambda: proxy.refused + proxy.held > 0)  # it tried to reconnect
    accepted = proxy.accepted
    proxy.restore()

    # It reconnected through the healed link, answers its own ping, and takes requests again.
    before = allocate_requests(await eventually(lambda: srv(nc, "STATS", name, instance), timeout=30))
    assert proxy.accepted > accepted
    await eventually(lambda: _more(srv(nc, "STATS", name, instance), before), timeout=30)
    await load.stop()
    await check_answers_hold(client, load.answers)


async def _none(answer) -> bool:
    return await answer is None


async def _more(stats, before: int) -> bool:
    stats = await stats
    return stats is not None and allocate_requests(stats) > before
