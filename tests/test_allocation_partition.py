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
import random
from urllib.parse import urlsplit

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas.errors import BusError
from services.allocation.committer import workload_ids
from tests.allocation_helpers import ONE_CORE, allocate_until_answered, check_invariants
from tests.bus_helpers import eventually
from tests.tcp_proxy import MODES, TcpProxy
from tests.worker_helpers import start_worker, stop_workers

NODES = [f"p{i}" for i in range(8)]
CORES = 16  # 128 placements fit: commits go on through the cut, and the nodes fill up after it
CLIENTS = 32
RETRIED = {"timeout", "no_responders", "busy", "unavailable", "outcome_unknown"}  # "not yet": same request again
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
    # Reset: its claims fail at once, and a claim it cannot make says nothing of what an earlier
    # delivery did; silent: the client's 3 s timeout comes before the worker's command timeout.
    expected = "outcome_unknown" if mode == "reset" else "timeout"
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


# -- an error never hides a change (issue 32) ------------------------------------------------


class Honest:
    """Clients as the issue's harness has them: each allocates with a fresh request id and
    releases what it was given with another; a timeout, `busy` or `outcome_unknown` is sent again
    with the same id, `unavailable` is taken as "not applied" and not sent again."""

    def __init__(self, client) -> None:
        self.client = client
        self.placed: dict[str, list[str]] = {}  # request id -> the ids it was answered with
        self.released: dict[str, list[str]] = {}  # request id -> the ids it released
        self.not_applied: dict[str, tuple[str, list[str]]] = {}  # request id -> (command, ids) answered unavailable
        self.codes: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self, clients: int) -> None:
        self._tasks = [asyncio.create_task(self._loop(n)) for n in range(clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _ask(self, subject: str, payload: dict) -> dict | None:
        """The answer, or None for `unavailable` (and for a capacity refusal)."""
        while True:
            try:
                return await self.client.request(subject, payload, dict, timeout=2)
            except BusError as error:
                self.codes.append(error.code)
                if error.code in ("unavailable", "insufficient_capacity"):
                    return None
                if error.code not in ("timeout", "no_responders", "busy", "outcome_unknown"):
                    raise
            await asyncio.sleep(0.05)

    async def _loop(self, n: int) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            request_id = f"a{n}-{i}"
            placed = await self._ask("resource.allocate", {
                "nodenames": NODES, "strategy": "spread", "deploy_count": 1, "workload_resource_request": ONE_CORE,
                "request_id": request_id})
            if placed is None:
                self.not_applied[request_id] = ("allocate", [])
                continue
            ids = [a["workload_id"] for a in placed["allocations"]]
            self.placed[request_id] = ids
            release_id = f"r{n}-{i}"
            if await self._ask("resource.release", {"workload_ids": ids, "request_id": release_id}) is None:
                self.not_applied[release_id] = ("release", ids)
            else:
                self.released[release_id] = ids


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reset", "swallow"])
async def test_after_every_unavailable_answer_the_change_did_not_happen(
    mode, client, prefix, nats_url, redis_url, proxies, workers
):
    proxy = await proxies(redis_url)
    # the only worker: every request meets the cuts
    await workers(nats_url, proxy.url("redis", urlsplit(redis_url).path))
    await add_nodes(client)
    load = Honest(client)
    load.start(16)
    for _ in range(8):  # short cuts, now and then: some land while a commit's reply is in flight
        await asyncio.sleep(random.uniform(0.3, 0.8))
        proxy.cut(mode)
        await asyncio.sleep(random.uniform(0.2, 0.6))
        proxy.restore()
    await asyncio.sleep(1)
    await load.stop()
    assert proxy.cut_live > 0 and (proxy.refused + proxy.held + proxy.swallowed) > 0  # the cuts hit live links
    assert {"outcome_unknown", "timeout", "unavailable"} & set(load.codes)  # and requests met them

    try:
        [held] = await eventually(lambda: settled(client, load), timeout=30)
    except AssertionError:
        raise AssertionError(f"orphans that never went: {await orphans(client, load)}") from None
    for request_id, (command, ids) in load.not_applied.items():
        if command == "allocate":  # none of the ids any run of it could have placed
            derived = {w for run in range(4) for w in workload_ids(1, None, request_id, run)}
            assert derived.isdisjoint(held), f"allocate {request_id} answered unavailable, yet placed"
        else:
            assert set(ids) <= held, f"release {request_id} answered unavailable, yet released {ids}"
    answered = {w for ids in load.placed.values() for w in ids}
    gone = {w for ids in load.released.values() for w in ids}
    kept = {w for command, ids in load.not_applied.values() if command == "release" for w in ids}
    assert held == (answered - gone) | kept  # the ledgers hold what the answers say, no orphan
    await check_invariants(client, NODES)


async def settled(client, load: Honest) -> list[set[str]] | None:
    """[what the ledgers hold] (a list: it may be empty), once the runs that never answered have
    given back what they placed (their claims expire in 2 s, and a takeover or the worker's own
    resolution cleans up)."""
    held = {w for ids in (await ledgers(client)).values() for w in ids}
    answered = {w for ids in load.placed.values() for w in ids}
    return [held] if held <= answered else None


async def orphans(client, load: Honest) -> dict[str, tuple[str, int, object]]:
    """Each ledger entry no answer named: (the request and run that derive it, what it was answered)."""
    answered = {w for ids in load.placed.values() for w in ids}
    stray = {w for ids in (await ledgers(client)).values() for w in ids} - answered
    asked = {f"a{n}-{i}" for n in range(16) for i in range(400)}
    found = {}
    for request_id in asked:
        for run in range(4):
            [wid] = workload_ids(1, None, request_id, run)
            if wid in stray:
                found[wid] = (request_id, run, load.placed.get(request_id, load.not_applied.get(request_id)))
    return found


# -- a silent NATS link ----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_worker_whose_nats_link_goes_silent_is_sent_no_requests_once_the_server_notices(
    nc, client, prefix, nats_url, redis_url, proxies, workers
):
    """The server pings every client every two seconds and drops one that misses two
    (berth/servers.py): within about five seconds it stops routing requests into the silence,
    so a client that does not retry at all is answered by the other worker."""
    proxy = await proxies(nats_url)
    silent = await workers(proxy.url("nats"), redis_url)
    await workers(nats_url, redis_url)
    await add_nodes(client)
    before = (await srv(nc, "STATS", f"{prefix}-allocation", silent.instance_id))
    assert before is not None  # both serve
    assert proxy.cut("swallow") == 1  # its one connection stays open; every byte either way is thrown away
    await eventually(lambda: asyncio.sleep(0, proxy.server_closed >= 1), timeout=8)  # the server dropped it
    assert proxy.swallowed > 0  # the fault hit: the server's pings (at least) went into the silence
    codes = []
    for i in range(40):
        try:
            await client.request("resource.allocate", {"nodenames": NODES, "deploy_count": 1,
                                                       "workload_resource_request": ONE_CORE}, dict, timeout=1)
        except BusError as error:
            codes.append(error.code)
    assert codes.count("timeout") == 0, codes  # none went to the silent worker
    proxy.restore()
    await eventually(lambda: srv(nc, "PING", f"{prefix}-allocation", silent.instance_id), timeout=20)  # back


@pytest.mark.slow
async def test_a_worker_whose_redis_link_goes_silent_answers_within_its_command_timeout(
    client, prefix, nats_url, redis_url, proxies, workers
):
    """Commands into a silent Redis link time out (bus.redis.COMMAND_TIMEOUT) instead of waiting
    forever: the request is answered, and says that its outcome is unknown (its claim could not be
    made, and an earlier delivery of it might have made the change)."""
    proxy = await proxies(redis_url)
    await workers(nats_url, proxy.url("redis", urlsplit(redis_url).path))  # the only worker
    await add_nodes(client)
    payload = {"nodenames": NODES, "deploy_count": 1, "workload_resource_request": ONE_CORE, "request_id": "quiet"}
    await client.request("resource.allocate", {**payload, "request_id": "warm"}, dict, timeout=10)
    proxy.cut("swallow")
    with pytest.raises(BusError) as answered:
        await client.request("resource.allocate", payload, dict, timeout=15)
    assert answered.value.code == "outcome_unknown"  # an answer, not a wait for ever
    assert proxy.swallowed > 0  # the fault hit: its commands went into the silence
    proxy.restore()
    [placed] = (await eventually(lambda: _allocated(client, payload), timeout=20))["allocations"]
    assert placed["workload_id"] in {w for ids in (await ledgers(client)).values() for w in ids}


async def _allocated(client, payload: dict) -> dict | None:
    try:
        return await client.request("resource.allocate", payload, dict, timeout=5)
    except BusError as error:
        if error.code in ("timeout", "busy", "outcome_unknown", "unavailable"):
            return None
        raise
