"""Contract: DESIGN.md §2, §4 and §8 ("All services", "Broker") against a broker worker process.

Every request is a plain `msgpack` map sent with nats-py; every reply and event is read raw. One
broker worker (the `process` operator, short intervals, `--max-instances 6`) serves the module;
tests keep apart by user. No process launched by the module may outlive it.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import pytest_asyncio

from tests.broker_helpers import FAST_ARGS, SERVER, const_broker, marked, param, server
from tests.bus_helpers import EventLog
from tests.contract.conftest import ERROR_HEADER, Wire, WireReply, send_from_processes, unique

MAX_INSTANCES = 6
ONE = {"least_instance": 1, "request_instance": 1}


def instances(least: int, request: int) -> dict[str, int]:
    """An instance filter (§4: `filter: {least_instance, request_instance}`)."""
    return {"least_instance": least, "request_instance": request}

FAILING = server("failing", FAIL_INSTANCES="0")  # every instance exits at once: the launch fails


# -- the worker, and no process left behind -----------------------------------------------------


def own_processes(namespace: str, user: str | None = None) -> list[str]:
    """Markers of live processes launched in this namespace (of one user, if given)."""
    return sorted(m for m in marked(namespace) if user is None or m.startswith(f"{namespace}/{user}/"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def b(module_workers, wire: Wire, namespace):
    """The module's broker worker, answering; afterwards, no launched process may be alive."""
    module_workers("services.broker.worker", *FAST_ARGS, "--max-instances", str(MAX_INSTANCES))
    deadline = time.monotonic() + 15
    while True:  # the first request right after "ready" can meet "no responders" once in a while
        try:
            await wire.ok("broker.get-namespace", {"user": "probe"}, timeout=2)
            break
        except Exception:
            assert time.monotonic() < deadline, "the broker worker does not answer"
            await asyncio.sleep(0.05)
    yield wire
    deadline = time.monotonic() + 15
    while own_processes(namespace) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    left = own_processes(namespace)
    for pid in marked(namespace).values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes launched by the module outlived it: {left}"


@dataclass
class Ctx:
    """One test's view: the wire, Redis, its own user, and the events of the broker from the start."""

    b: Wire
    redis: Any
    ns: str
    user: str
    cap: EventLog

    def ref(self, resource_id: str) -> dict[str, str]:
        return {"user": self.user, "resource_id": resource_id}

    def status_subject(self, resource_id: str, status: str) -> str:
        return self.b.subject(f"events.broker.resource.{self.user}.{resource_id}.{status}")

    def pool_subject(self, broker: str, kind: str) -> str:
        return self.b.subject(f"events.broker.{self.user}.{broker}.{kind}")

    # Redis keys of the broker's records (services/broker/store.py), for the corruption tests.
    def record_key(self, resource_id: str) -> str:
        return f"{self.ns}:broker:{{{self.ns}}}:res:{self.user}:{resource_id}"

    def broker_key(self, name: str) -> str:
        return f"{self.ns}:broker:{{{self.ns}}}:broker:{self.user}:{name}"

    def pool_key(self, name: str, part: str) -> str:
        return f"{self.ns}:broker:{{{self.ns}}}:pool:{self.user}:{name}:{part}"

    async def call(self, command: str, payload: Any) -> WireReply:
        return await self.b.request(f"broker.{command}", payload, timeout=20)

    async def ok(self, command: str, payload: Any) -> Any:
        return (await self.call(command, payload)).expect_ok()

    async def init(self, resource_id: str, **param_fields: Any) -> None:
        await self.ok("init", {**self.ref(resource_id), "param": param(**param_fields)})

    async def event(self, subject: str, start: int = 0, timeout: float = 30.0) -> tuple[int, dict]:
        """The first event on `subject` at index `start` or later (waits for it)."""
        index = await self.cap.first(subject, after=start, timeout=timeout)
        return index, self.cap.events[index][1]

    async def running(self, resource_id: str, instances: int = 1, image: str = SERVER, **fields: Any) -> None:
        """Init and launch cold; back once its `running` event was published."""
        await self.ok("init", {**self.ref(resource_id), "param": param(image, **fields)})
        await self.launched(resource_id, instances)

    async def launched(self, resource_id: str, instances: int = 1) -> None:
        """Launch an inited resource; back once its `running` event was published."""
        start = len(self.cap.events)
        wanted = {"least_instance": 1, "request_instance": instances}
        await self.ok("launch", {**self.ref(resource_id), "filter": wanted})
        await self.event(self.status_subject(resource_id, "running"), start)

    async def add_broker(
        self, name: str, num: int, image: str = SERVER, env: dict[str, str] | None = None, **fields: Any
    ) -> dict:
        return await self.ok("add-broker", const_broker(self.user, name, num, image, env, **fields))

    async def ready_pool(self, name: str, num: int = 1, image: str = SERVER, **fields: Any) -> list[str]:
        """A const broker whose `num` resources all announced `ready`; their ids."""
        start = len(self.cap.events)
        await self.add_broker(name, num, image, **fields)
        ready = []
        for _ in range(num):
            start, body = await self.event(self.pool_subject(name, "ready"), start)
            start += 1
            ready.append(body["resource_id"])
        return ready

    def mine(self, events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        """Events about this test's user (pool events `<user>.<broker>.<kind>`, status events
        `resource.<user>.<id>.<status>`)."""
        base = len(self.b.subject("events.broker.").split(".")) - 1
        found = []
        for subject, body in events:
            tokens = subject.split(".")[base:]
            user = tokens[1] if len(tokens) == 4 and tokens[0] == "resource" else tokens[0]
            if user == self.user:
                found.append((subject, body))
        return found

    async def sentinel(self) -> str:
        """Publish a known event (init of a fresh id); its subject, for `EventLog.before`."""
        resource_id = unique("sentinel")
        await self.init(resource_id)
        return self.status_subject(resource_id, "init")

    async def quiet_since(self, mark: int) -> list[tuple[str, dict]]:
        """This user's events after index `mark` and before a sentinel."""
        return self.mine((await self.cap.before(await self.sentinel()))[mark:])

    async def snapshot(self, *resource_ids: str) -> dict[str, Any]:
        """Everything a refused or replayed request must leave as it was."""
        records = {rid: (await self.call("get-resource", self.ref(rid))).body for rid in resource_ids}
        return {
            "resources": await self.ok("list-resources", {"user": self.user, "limit": 1000}),
            "brokers": await self.ok("list-brokers", {"user": self.user}),
            "records": records,
            "idempotency": sorted([k async for k in self.redis.scan_iter(match=f"{self.ns}:idem:*")]),
            "processes": own_processes(self.ns, self.user),
        }

    async def clean(self) -> None:
        """Remove the user's brokers, release its live resources, wait for their processes to go."""
        for broker in (await self.ok("list-brokers", {"user": self.user}))["brokers"]:
            await self.call("remove-broker", {"user": self.user, "name": broker["name"]})
        listing = await self.ok("list-resources", {"user": self.user, "limit": 1000})
        for record in listing["resources"]:
            if record["status"] in ("init", "deploying", "running") and not record["broker_name"]:
                await self.call("release", self.ref(record["resource_id"]))
        deadline = time.monotonic() + 15
        while own_processes(self.ns, self.user) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert own_processes(self.ns, self.user) == [], "released resources left processes behind"


@pytest_asyncio.fixture
async def ctx(b, redis, namespace):
    cap = await b.capture("broker.>")
    context = Ctx(b, redis, namespace, unique("u"), cap)
    yield context
    await context.clean()
    await cap.close()


def assert_error(reply: WireReply, status: int, code: str, field: str | None = None) -> dict:
    """§2: headers `Nats-Service-Error-Code` (status) and `Nats-Service-Error` (message), body
    `{"error": {"code", "message", "details"}}`; `details.field` names the field when given."""
    assert not reply.ok, f"expected {code}, got success {reply.body!r}"
    assert (reply.status, reply.code) == (status, code), reply.body
    assert set(reply.body) == {"error"} and set(reply.error) == {"code", "message", "details"}
    assert isinstance(reply.error["message"], str) and reply.error["message"]
    assert reply.headers[ERROR_HEADER] == reply.error["message"]
    assert isinstance(reply.details, dict)
    if field is not None:
        assert reply.details.get("field") == field, reply.details
    return reply.details


# -- §2: payloads, errors, types -------------------------------------------------------------------


def bad(user: str, command: str, payload: dict) -> tuple[str, dict]:
    return command, {"user": user, **payload}


def broker_payload(**fields: Any) -> dict:
    return {"name": "b", "strategy": {"type": "const", "num": 0}, "param": param(), **fields}


# (test id, command, payload for a user, the field invalid_argument must name)
INVALID: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("not-a-map", "init", lambda u: b"\x93\x01\x02\x03", "$"),
    ("int-key", "init", lambda u: {"user": u, "resource_id": "r", "param": param(), 1: "x"}, "$"),
    ("missing-user", "init", lambda u: {"resource_id": "r", "param": param()}, "user"),
    ("null-user", "get-resource", lambda u: {"user": None, "resource_id": "r"}, "user"),
    ("int-resource-id", "init", lambda u: {"user": u, "resource_id": 7, "param": param()}, "resource_id"),
    ("missing-resource-id", "get-resource", lambda u: {"user": u}, "resource_id"),
    ("resource-id-trailing-newline", "get-resource", lambda u: {"user": u, "resource_id": "r\n"}, "resource_id"),
    ("missing-param", "init", lambda u: {"user": u, "resource_id": "r"}, "param"),
    ("empty-image", "init", lambda u: {"user": u, "resource_id": "r", "param": param("")}, "param.image"),
    ("missing-filter", "launch", lambda u: {"user": u, "resource_id": "r"}, "filter"),
    ("least-above-request", "launch",
     lambda u: {"user": u, "resource_id": "r", "filter": {"least_instance": 2, "request_instance": 1}},
     "filter.least_instance"),
    ("zero-request", "launch",
     lambda u: {"user": u, "resource_id": "r", "filter": {"least_instance": 0, "request_instance": 0}},
     "filter.request_instance"),
    ("negative-least", "scale",
     lambda u: {"user": u, "resource_id": "r", "filter": {"least_instance": -1, "request_instance": 1}},
     "filter.least_instance"),
    ("float-least", "launch",
     lambda u: {"user": u, "resource_id": "r", "filter": {"least_instance": 1.5, "request_instance": 2}},
     "filter.least_instance"),
    ("string-request", "scale",
     lambda u: {"user": u, "resource_id": "r", "filter": {"least_instance": 1, "request_instance": "1"}},
     "filter.request_instance"),
    ("apply-missing-filter", "apply", lambda u: {"user": u, "resource_id": "r", "param": param()}, "filter"),
    ("unknown-strategy", "add-broker", lambda u: {"user": u, **broker_payload(strategy={"type": "fancy"})},
     "strategy.type"),
    ("const-without-num", "add-broker", lambda u: {"user": u, **broker_payload(strategy={"type": "const"})},
     "strategy.num"),
    ("negative-num", "add-broker",
     lambda u: {"user": u, **broker_payload(strategy={"type": "const", "num": -1})}, "strategy.num"),
    ("zero-instance", "add-broker", lambda u: {"user": u, **broker_payload(instance=0)}, "instance"),
    ("unknown-fit-field", "add-broker", lambda u: {"user": u, **broker_payload(fit_fields=["colour"])},
     "fit_fields[0]"),
    ("negative-idle-keep", "add-broker", lambda u: {"user": u, **broker_payload(idle_keep_seconds=-1)},
     "idle_keep_seconds"),
    ("nan-idle-keep", "add-broker", lambda u: {"user": u, **broker_payload(idle_keep_seconds=math.nan)},
     "idle_keep_seconds"),
    ("null-release-loop", "add-broker", lambda u: {"user": u, **broker_payload(release_loop=None)},
     "release_loop"),
    ("string-release-loop", "add-broker", lambda u: {"user": u, **broker_payload(release_loop="yes")},
     "release_loop"),
    ("remove-without-name", "remove-broker", lambda u: {"user": u}, "name"),
    ("unknown-status", "list-resources", lambda u: {"user": u, "status": "gone"}, "status"),
    ("zero-limit", "list-resources", lambda u: {"user": u, "limit": 0}, "limit"),
    ("string-broker-sold", "list-resources", lambda u: {"user": u, "broker_sold": "yes"}, "broker_sold"),
    ("null-broker-sold", "list-resources", lambda u: {"user": u, "broker_sold": None}, "broker_sold"),
]  # fmt: skip


@pytest.mark.parametrize("command,payload,field", [case[1:] for case in INVALID], ids=[c[0] for c in INVALID])
async def test_invalid_argument_names_the_field(ctx, command, payload, field):
    # §2: "missing required keys, wrong types, negative or NaN quantities are rejected with
    # `invalid_argument` naming the field"; §8: "Booleans are booleans (null is invalid)".
    assert_error(await ctx.call(command, payload(ctx.user)), 400, "invalid_argument", field)


async def test_unknown_keys_are_refused_at_every_level(ctx):
    # §2: "Unknown keys ... are rejected with `invalid_argument` naming the field"; §8: "Unknown keys
    # are refused at every level", "naming the key, with the accepted keys in the message".
    for payload, field, known in [
        ({**ctx.ref("r"), "param": param(), "colour": "blue"}, "colour", "resource_id"),
        ({**ctx.ref("r"), "param": {**param(), "colour": "red"}}, "param.colour", "image"),
    ]:
        details = assert_error(await ctx.call("init", payload), 400, "invalid_argument", field)
        assert known in details["accepted"]
    shaped = await ctx.call("get-resource", {**ctx.ref("r"), "shape": "round"})
    assert_error(shaped, 400, "invalid_argument", "shape")
    assert_error(await ctx.call("get-resource", ctx.ref("r")), 404, "resource_not_found")  # nothing made


# -- every error code, its status and body; refusals change nothing -------------------------------


@dataclass
class Refusal:
    """A request the broker refuses, after `setup` made the state it needs (and let it settle)."""

    command: str
    status: int
    code: str
    field: str | None
    setup: Callable[[Ctx], Awaitable[dict]]
    # Events the refusal itself publishes, as (subject, resource_id); a refused `apply` reports a
    # `miss` on each fitting broker it tried.
    published: Callable[[Ctx, dict], list[tuple[str, str]]] = lambda c, p: []


async def _unknown_launch(c: Ctx) -> dict:
    return {**c.ref("never"), "filter": ONE}


async def _init_twice(c: Ctx) -> dict:
    await c.init("r")
    return {**c.ref("r"), "param": param()}


async def _scale_not_running(c: Ctx) -> dict:
    await c.init("r")
    return {**c.ref("r"), "filter": ONE}


async def _info_not_launched(c: Ctx) -> dict:
    await c.init("r")
    return c.ref("r")


async def _launch_twice(c: Ctx) -> dict:
    await c.running("r")
    return {**c.ref("r"), "filter": ONE}


async def _launch_too_many(c: Ctx) -> dict:
    await c.init("r")
    return {**c.ref("r"), "filter": {"least_instance": 1000, "request_instance": 1000}}


async def _apply_no_broker(c: Ctx) -> dict:
    return {**c.ref("caller"), "param": param(), "filter": ONE}


async def _apply_empty_broker(c: Ctx) -> dict:
    await c.add_broker("empty", 0)
    return {**c.ref("caller"), "param": param(), "filter": ONE}


async def _apply_cooling_broker(c: Ctx) -> dict:
    start = len(c.cap.events)
    await c.add_broker("crash", 1, **FAILING)
    await c.event(c.pool_subject("crash", "cooling"), start)
    return {**c.ref("caller"), "param": param(), "filter": ONE}


async def _remove_unknown_broker(c: Ctx) -> dict:
    return {"user": c.user, "name": "nobody"}


def _misses(*brokers: str) -> Callable[[Ctx, dict], list[tuple[str, str]]]:
    return lambda c, p: [(c.pool_subject(name, "miss"), p["resource_id"]) for name in brokers]


REFUSALS = {
    "resource_not_found": Refusal("launch", 404, "resource_not_found", "resource_id", _unknown_launch),
    "resource_already_init": Refusal("init", 409, "resource_already_init", "resource_id", _init_twice),
    "resource_not_running": Refusal("scale", 412, "resource_not_running", "resource_id", _scale_not_running),
    "application_not_found": Refusal(
        "get-service-info", 404, "application_not_found", "resource_id", _info_not_launched
    ),
    "application_already_launched": Refusal(
        "launch", 409, "application_already_launched", "resource_id", _launch_twice
    ),
    "no_enough_resources": Refusal(
        "launch", 409, "no_enough_resources", "filter.least_instance", _launch_too_many
    ),
    "broker_param_not_fit": Refusal("apply", 409, "broker_param_not_fit", "param", _apply_no_broker),
    "broker_not_enough_resources": Refusal(
        "apply", 409, "broker_not_enough_resources", "param", _apply_empty_broker, _misses("empty")
    ),
    "broker_cooling": Refusal(
        "apply", 503, "broker_cooling", "param", _apply_cooling_broker, _misses("crash")
    ),
    "broker_not_found": Refusal("remove-broker", 404, "broker_not_found", "name", _remove_unknown_broker),
}


@pytest.mark.parametrize("name", REFUSALS)
async def test_error_code_has_its_status_headers_and_body(ctx, name):
    # §2 error replies; §8: "404 `*_not_found`, `resource_not_found`; 409 `*_exists`, `*_already_*`,
    # `no_enough_resources`, `broker_not_enough_resources`, `broker_param_not_fit`; 412
    # `resource_not_running`; 503 `manager_not_running`, `broker_cooling`".
    refusal = REFUSALS[name]
    payload = await refusal.setup(ctx)
    assert_error(await ctx.call(refusal.command, payload), refusal.status, refusal.code, refusal.field)


# Commands that could change something (get-service-info writes what it learns from the operator).
CHANGING = {"init", "launch", "scale", "release", "apply", "add-broker", "remove-broker", "get-service-info"}


REFUSED_CHANGES = [n for n, r in REFUSALS.items() if r.command in CHANGING] + [
    c[0] for c in INVALID if c[1] in CHANGING
]


@pytest.mark.parametrize("name", REFUSED_CHANGES)
async def test_refused_request_changes_nothing(ctx, name):
    # Bad input changes nothing: listings, records, idempotency keys and processes stay as they
    # were, and nothing is published (a refused `apply` publishes only its `miss` events).
    if name in REFUSALS:
        refusal = REFUSALS[name]
        command, payload = refusal.command, await refusal.setup(ctx)
        published = refusal.published(ctx, payload)
    else:
        _, command, make, _ = next(case for case in INVALID if case[0] == name)
        payload, published = make(ctx.user), []
    named = payload.get("resource_id") if isinstance(payload, dict) else None
    ids = [named] if isinstance(named, str) else []
    before = await ctx.snapshot(*ids)
    mark = len(ctx.cap.events)
    assert not (await ctx.call(command, payload)).ok
    assert await ctx.snapshot(*ids) == before
    events = await ctx.quiet_since(mark)
    assert [(subject, body["resource_id"]) for subject, body in events] == published


async def test_internal_error_is_500(ctx):
    # §8: "500 `internal`" (a record that Redis cannot read as one).
    await ctx.init("r")
    async with corrupted(ctx.redis, ctx.record_key("r")):
        assert_error(await ctx.call("get-resource", ctx.ref("r")), 500, "internal")


@asynccontextmanager
async def corrupted(redis, key: str):
    """Replace `key` by a string (so every command on it fails), and put it back afterwards."""
    dumped, ttl = await redis.dump(key), await redis.pttl(key)
    await redis.set(key, b"not what the broker wrote")
    try:
        yield
    finally:
        await redis.delete(key)
        if dumped is not None:
            await redis.restore(key, max(ttl, 0), dumped)


# -- request_id on every state-changing command ------------------------------------------------------


def resource_ids(payload: dict) -> list[str]:
    """The resource named by a payload, if any, for `Ctx.snapshot`."""
    return [payload["resource_id"]] if "resource_id" in payload else []


@dataclass
class Idempotent:
    """How to exercise one state-changing command's `request_id`.

    prepare: make the state a successful request needs; its payload (without request_id).
    settle: after a success, wait until its background work published its last event.
    failing: a well-formed payload the broker refuses, and a change after which it would answer
             differently (None when the refusal depends on the payload alone); None when the
             command refuses only malformed payloads, whose answers are not kept.
    other: another payload, to reuse the request id with.
    corrupt: the Redis key whose corruption makes the request fail with `internal`.
    """

    command: str
    prepare: Callable[[Ctx], Awaitable[dict]]
    failing: Callable[[Ctx], Awaitable[tuple[dict, Callable[[], Awaitable[None]] | None]]] | None
    other: Callable[[dict], dict]
    corrupt: Callable[[Ctx, dict], str]
    settle: Callable[[Ctx, int], Awaitable[None]] | None = None
    ids: Callable[[dict], list[str]] = resource_ids


async def _init_prepare(c: Ctx) -> dict:
    return {**c.ref("r"), "param": param()}


async def _init_failing(c: Ctx):
    await c.init("taken")
    return {**c.ref("taken"), "param": param()}, lambda: c.ok("release", c.ref("taken"))


async def _launch_prepare(c: Ctx) -> dict:
    await c.init("r")
    return {**c.ref("r"), "filter": ONE}


async def _until_running(c: Ctx, mark: int) -> None:
    await c.event(c.status_subject("r", "running"), mark)


async def _launch_failing(c: Ctx):
    return {**c.ref("later"), "filter": ONE}, lambda: c.init("later")


async def _scale_prepare(c: Ctx) -> dict:
    await c.running("r")
    return {**c.ref("r"), "filter": ONE}


async def _scale_failing(c: Ctx):
    await c.init("idle")
    return {**c.ref("idle"), "filter": ONE}, lambda: c.launched("idle")


async def _release_prepare(c: Ctx) -> dict:
    await c.init("r")
    return c.ref("r")


async def _release_failing(c: Ctx):
    return c.ref("unknown"), lambda: c.init("unknown")


async def _apply_prepare(c: Ctx) -> dict:
    await c.ready_pool("pool")
    return {**c.ref("r"), "param": param(), "filter": ONE}


async def _pool_refilled(c: Ctx, mark: int) -> None:
    await c.event(c.pool_subject("pool", "ready"), mark)


async def _apply_failing(c: Ctx):
    payload = {**c.ref("r"), "param": param(), "filter": ONE}
    return payload, lambda: c.add_broker("empty", 0)  # then it would be broker_not_enough_resources


async def _add_broker_prepare(c: Ctx) -> dict:
    return {"user": c.user, **broker_payload(name="b0")}


async def _remove_broker_prepare(c: Ctx) -> dict:
    await c.add_broker("b0", 0)
    return {"user": c.user, "name": "b0"}


async def _remove_broker_failing(c: Ctx):
    return {"user": c.user, "name": "b1"}, lambda: c.add_broker("b1", 0)


IDEMPOTENT = {
    "init": Idempotent(
        "init", _init_prepare, _init_failing, lambda p: {**p, "resource_id": "r2"},
        lambda c, p: c.record_key(p["resource_id"]),
    ),
    "launch": Idempotent(
        "launch", _launch_prepare, _launch_failing,
        lambda p: {**p, "filter": {"least_instance": 1, "request_instance": 2}},
        lambda c, p: c.record_key("r"), _until_running,
    ),
    "scale": Idempotent(
        "scale", _scale_prepare, _scale_failing,
        lambda p: {**p, "filter": {"least_instance": 1, "request_instance": 2}},
        lambda c, p: c.record_key("r"), _until_running,
    ),
    "release": Idempotent(
        "release", _release_prepare, _release_failing, lambda p: {**p, "resource_id": "r2"},
        lambda c, p: c.record_key("r"),
    ),
    "apply": Idempotent(
        "apply", _apply_prepare, _apply_failing, lambda p: {**p, "resource_id": "r2"},
        lambda c, p: c.record_key("r"), _pool_refilled,
    ),
    "add-broker": Idempotent(
        "add-broker", _add_broker_prepare, None, lambda p: {**p, "instance": 2},
        lambda c, p: c.broker_key("b0"),
    ),
    "remove-broker": Idempotent(
        "remove-broker", _remove_broker_prepare, _remove_broker_failing, lambda p: {**p, "name": "b2"},
        # remove-broker reads the pool before it removes the broker: corrupt the pool.
        lambda c, p: c.pool_key("b0", "warming"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_retry_replays_the_first_answer_and_changes_nothing(ctx, command):
    # §2: "Commands that change state accept an optional `request_id`; a retry with the same id
    # within 24 h returns the first answer and changes nothing."
    case = IDEMPOTENT[command]
    payload = {**await case.prepare(ctx), "request_id": unique("rid")}
    mark = len(ctx.cap.events)
    first = await ctx.call(command, payload)
    assert first.ok, first.body
    if case.settle:
        await case.settle(ctx, mark)
    before = await ctx.snapshot(*case.ids(payload))
    mark = len(ctx.cap.events)
    again = await ctx.call(command, payload)
    assert (again.data, again.headers) == (first.data, first.headers)
    assert await ctx.snapshot(*case.ids(payload)) == before
    assert await ctx.quiet_since(mark) == []


@pytest.mark.parametrize("command", [command for command, case in IDEMPOTENT.items() if case.failing])
async def test_request_id_error_reply_is_replayed(ctx, command):
    # §2 "returns the first answer": an error is an answer too. Where the refusal depends on the
    # state, the state is changed before the retry: the retry still gets the first error.
    case = IDEMPOTENT[command]
    payload, change = await case.failing(ctx)
    payload = {**payload, "request_id": unique("rid")}
    first = await ctx.call(command, payload)
    assert not first.ok
    if change is not None:
        await change()
    again = await ctx.call(command, payload)
    assert (again.data, again.headers) == (first.data, first.headers)
    stored = [k async for k in ctx.redis.scan_iter(match=f"{ctx.ns}:idem:*:{payload['request_id']}")]
    assert len(stored) == 1


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_malformed_request_is_not_kept(ctx, command):
    # §2 request_id, refined: a request refused as malformed (400) did nothing, so nothing is kept
    # for its id, and the corrected request with the same id runs.
    case = IDEMPOTENT[command]
    payload = {**await case.prepare(ctx), "request_id": unique("rid")}
    malformed = await ctx.call(command, {"request_id": payload["request_id"]})  # required keys missing
    assert_error(malformed, 400, "invalid_argument")
    assert [k async for k in ctx.redis.scan_iter(match=f"{ctx.ns}:idem:*:{payload['request_id']}")] == []
    mark = len(ctx.cap.events)
    corrected = await ctx.call(command, payload)
    assert corrected.ok, corrected.body
    if case.settle:
        await case.settle(ctx, mark)


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_reused_with_another_payload_is_refused(ctx, command):
    # A request id names one request: reused for another payload it is refused, changing nothing.
    case = IDEMPOTENT[command]
    payload = {**await case.prepare(ctx), "request_id": unique("rid")}
    mark = len(ctx.cap.events)
    assert (await ctx.call(command, payload)).ok
    if case.settle:
        await case.settle(ctx, mark)
    other = case.other(payload)
    before = await ctx.snapshot(*case.ids(payload), *case.ids(other))
    mark = len(ctx.cap.events)
    assert_error(await ctx.call(command, other), 400, "invalid_argument", "request_id")
    assert await ctx.snapshot(*case.ids(payload), *case.ids(other)) == before
    assert await ctx.quiet_since(mark) == []


@pytest.mark.parametrize("command", IDEMPOTENT)
async def test_request_id_internal_error_is_not_stored(ctx, command):
    # An `internal` error is not the answer to keep: once the cause is repaired, the retry runs.
    case = IDEMPOTENT[command]
    payload = {**await case.prepare(ctx), "request_id": unique("rid")}
    async with corrupted(ctx.redis, case.corrupt(ctx, payload)):
        assert_error(await ctx.call(command, payload), 500, "internal")
    mark = len(ctx.cap.events)
    retried = await ctx.call(command, payload)
    assert retried.ok, retried.body
    if case.settle:
        await case.settle(ctx, mark)


async def test_request_id_retries_from_two_processes_at_once_have_one_effect(ctx, nats_url):
    # §2 request_id, across clients: the same launch sent by two processes at once launches once
    # and both get the same answer.
    await ctx.init("r")
    mark = len(ctx.cap.events)
    payload = {**ctx.ref("r"), "filter": ONE, "request_id": unique("rid")}
    replies = await send_from_processes(nats_url, ctx.b.subject("broker.launch"), msgpack.packb(payload))
    assert replies[0].data == replies[1].data
    reply = replies[0].expect_ok()
    assert reply == {"request_instance": 1, "broker_resource_id": ""}
    await ctx.event(ctx.status_subject("r", "running"), mark)
    assert own_processes(ctx.ns, ctx.user) == [f"{ctx.ns}/{ctx.user}/r/0"]
    events = ctx.mine(await ctx.cap.before(await ctx.sentinel()))
    deploying = [subject for subject, _ in events if subject.endswith(".deploying")]
    assert deploying == [ctx.status_subject("r", "deploying")]


# -- §8 Broker pins --------------------------------------------------------------------------------


async def test_process_operator_serves_any_city_and_platform(ctx):
    # §8: "The `process` operator serves any city and platform".
    await ctx.running("r", city="atlantis", platform="plan9")
    info = await ctx.ok("get-service-info", ctx.ref("r"))
    assert (info["status"], info["current_instances"]) == ("running", 1)


async def test_filter_takes_min_of_available_and_request_when_at_least_least(ctx):
    # §4: "`filter: {least_instance, request_instance}` -> take min(available, request) when
    # available >= least, else `no_enough_resources`"; §8: the process operator's capacity is
    # `--max-instances` minus those it runs (this worker: 6).
    assert own_processes(ctx.ns) == []
    await ctx.running("one")  # 1 of 6 runs: 5 available
    await ctx.init("many")
    reply = await ctx.ok("launch", {**ctx.ref("many"), "filter": instances(5, 9)})
    assert reply["request_instance"] == 5  # min(5 available, 9 requested)
    await ctx.init("more")
    refused = await ctx.call("launch", {**ctx.ref("more"), "filter": instances(1, 1)})
    assert_error(refused, 409, "no_enough_resources", "filter.least_instance")
    await ctx.ok("release", ctx.ref("many"))
    reply = await ctx.ok("launch", {**ctx.ref("more"), "filter": instances(1, 2)})
    assert reply["request_instance"] == 2  # min(5 available, 2 requested)


async def test_get_service_info_fields_at_top_level_and_port_names_unchanged(ctx):
    # §8: "`get-service-info` returns ServiceInfo's fields at the top level; endpoint `ports` keys are
    # the names given in `param.ports`, unchanged"; §4 ServiceInfo {status, message,
    # request_instances, current_instances, available_endpoints: [{ip, ports: {name: port}, name}]}.
    ports = {"Web-Admin": "http", "stats_2": "tcp"}
    await ctx.running("r", instances=2, image="http-server-two-ports", ports=ports)
    info = await ctx.ok("get-service-info", ctx.ref("r"))
    assert set(info) == {"status", "message", "request_instances", "current_instances", "available_endpoints"}
    assert (info["status"], info["request_instances"], info["current_instances"]) == ("running", 2, 2)
    assert isinstance(info["message"], str)
    for endpoint in info["available_endpoints"]:
        assert set(endpoint) == {"ip", "ports", "name"}
        assert set(endpoint["ports"]) == set(ports)
        assert all(isinstance(port, int) for port in endpoint["ports"].values())


async def test_get_resource_returns_the_record_at_top_level(ctx):
    # §8: "`get-resource` returns the record at the top level: `resource_id`, `user`, `param`, `status`
    # (string), `resource_block_key`, `request_instance`, `no_ready_instance`, `broker_resource_id`,
    # `broker_name`, `broker_sold`, `updated_at`".
    await ctx.running("r")
    record = await ctx.ok("get-resource", ctx.ref("r"))
    pinned = {
        "resource_id", "user", "param", "status", "resource_block_key", "request_instance",
        "no_ready_instance", "broker_resource_id", "broker_name", "broker_sold", "updated_at",
    }  # fmt: skip
    assert pinned <= set(record)
    assert (record["resource_id"], record["user"], record["status"]) == ("r", ctx.user, "running")
    assert record["param"]["image"] == SERVER and record["param"]["ports"] == {"http": "http"}
    assert type(record["request_instance"]) is int and type(record["no_ready_instance"]) is int
    assert type(record["broker_sold"]) is bool and isinstance(record["updated_at"], float)
    assert isinstance(record["resource_block_key"], str) and record["broker_resource_id"] == ""


async def test_get_namespace(ctx):
    # §8: "`get-namespace` -> `{namespace}`" (README: by default the user).
    assert await ctx.ok("get-namespace", {"user": ctx.user}) == {"namespace": ctx.user}


async def test_get_instance_type(ctx):
    # §8: "`get-instance-type` {user, platform, group} -> `{cpu_per_instance, mem_per_instance}`"
    # (README defaults: 1 CPU, 1G).
    reply = await ctx.ok("get-instance-type", {"user": ctx.user, "platform": "linux", "group": "sz"})
    assert reply == {"cpu_per_instance": 1.0, "mem_per_instance": 1 << 30}
    assert type(reply["mem_per_instance"]) is int


async def test_list_brokers_shape_with_integer_counts(ctx):
    # §8: "`list-brokers` -> `{brokers: [{user, name, strategy, target, warming, idle, sold,
    # cooling_until}]}` (counts are integers, names as given)".
    await ctx.add_broker("Mixed_Case-1", 0)
    reply = await ctx.ok("list-brokers", {"user": ctx.user})
    [broker] = reply["brokers"]
    assert {"user", "name", "strategy", "target", "warming", "idle", "sold", "cooling_until"} <= set(broker)
    assert (broker["user"], broker["name"]) == (ctx.user, "Mixed_Case-1")
    assert broker["strategy"] == {"type": "const", "num": 0}
    for count in ("target", "warming", "idle", "sold"):
        assert type(broker[count]) is int, count
    assert isinstance(broker["cooling_until"], (int, float)) and not isinstance(broker["cooling_until"], bool)
    listed = await ctx.ok("list-brokers", {})  # user is optional
    assert any(b["user"] == ctx.user and b["name"] == "Mixed_Case-1" for b in listed["brokers"])


async def test_const_strategy_keeps_num_unsold(ctx):
    # §8: "Strategies: `{"type": "const", "num": N}`" (README: keeps N unsold resources, as crm).
    ready = await ctx.ready_pool("warm", 2)
    broker = (await ctx.ok("list-brokers", {"user": ctx.user}))["brokers"][0]
    assert (broker["target"], broker["idle"], broker["warming"]) == (2, 2, 0)
    mark = len(ctx.cap.events)
    sold = (await ctx.ok("apply", {**ctx.ref("c"), "param": param(), "filter": ONE}))["broker_resource_id"]
    assert sold in ready
    _, refill = await ctx.event(ctx.pool_subject("warm", "ready"), mark)  # back to 2 unsold
    broker = (await ctx.ok("list-brokers", {"user": ctx.user}))["brokers"][0]
    assert (broker["idle"], broker["sold"]) == (2, 1) and refill["resource_id"] not in ready


@pytest.mark.parametrize(
    "idle_keep", [0, None, 0.01], ids=["zero-is-off", "absent-is-off", "positive-recycles"]
)
async def test_idle_keep_seconds_zero_or_absent_is_off(ctx, idle_keep):
    # §8: "`idle_keep_seconds` 0 or absent means off". A pool of one becomes ready; then it is asked
    # for two. With recycling on, the idle resource would be released in the tick that made it ready
    # (before the second launch); off, no `released` event comes before the second `launched`.
    fields = {} if idle_keep is None else {"idle_keep_seconds": idle_keep}
    await ctx.ready_pool("keep", 1, **fields)
    await ctx.add_broker("keep", 2, **fields)  # an update keeps the pool
    first, _ = await ctx.event(ctx.pool_subject("keep", "launched"))
    second, _ = await ctx.event(ctx.pool_subject("keep", "launched"), first + 1)
    released = [s for s, _ in ctx.cap.events[:second] if s == ctx.pool_subject("keep", "released")]
    assert bool(released) == (idle_keep == 0.01)


async def test_fit_fields_default_is_city_and_worker_version(ctx):
    # §4: "A broker's fit function becomes data: `fit_fields` (default `["city", "worker_version"]`)".
    # A broker that fits but is empty answers broker_not_enough_resources; one that does not fit,
    # broker_param_not_fit.
    await ctx.add_broker("sz-v1", 0)  # param(): city sz, platform linux, worker_version v1

    async def apply_code(**fields: Any) -> str:
        reply = await ctx.call("apply", {**ctx.ref(unique("c")), "param": param(**fields), "filter": ONE})
        return reply.code

    assert await apply_code() == "broker_not_enough_resources"
    other_fields = {"platform": "windows", **server("failing", FAIL_INSTANCES="1")}
    assert await apply_code(**other_fields) == "broker_not_enough_resources"
    assert await apply_code(city="gz") == "broker_param_not_fit"
    assert await apply_code(worker_version="v2") == "broker_param_not_fit"


async def test_remove_broker_releases_unsold_resources(ctx):
    # §8: "`remove-broker` releases that broker's unsold resources."
    ready = await ctx.ready_pool("gone", 2)
    reply = await ctx.ok("remove-broker", {"user": ctx.user, "name": "gone"})
    assert sorted(reply["released"]) == sorted(ready)
    for resource_id in ready:
        assert (await ctx.ok("get-resource", ctx.ref(resource_id)))["status"] == "released"
    assert own_processes(ctx.ns, ctx.user) == []
    assert (await ctx.ok("list-brokers", {"user": ctx.user}))["brokers"] == []


async def test_apply_on_a_not_inited_id_initializes_it_running_at_once_and_linked(ctx):
    # §8: "`apply` on a `resource_id` that was not `init`ed initializes it; on success the caller's
    # resource is `running` at once, linked to the broker resource"; §4 apply -> {broker_resource_id}.
    [ready] = await ctx.ready_pool("pool")
    reply = await ctx.ok("apply", {**ctx.ref("caller"), "param": param(), "filter": ONE})
    assert reply == {"broker_resource_id": ready}
    record = await ctx.ok("get-resource", ctx.ref("caller"))
    assert (record["status"], record["broker_resource_id"]) == ("running", ready)
    info = await ctx.ok("get-service-info", ctx.ref("caller"))
    assert (info["status"], info["current_instances"]) == ("running", 1)


async def test_launch_tries_the_users_brokers_first(ctx):
    # §8: "`launch` tries the user's brokers first (as crm)".
    [ready] = await ctx.ready_pool("pool")
    await ctx.init("job")
    reply = await ctx.ok("launch", {**ctx.ref("job"), "filter": ONE})
    assert reply["broker_resource_id"] == ready
    record = await ctx.ok("get-resource", ctx.ref("job"))
    assert (record["status"], record["broker_resource_id"]) == ("running", ready)


async def test_released_record_stays_readable_with_status_released(ctx):
    # §8: "After `release`, the record stays readable for 24 h with status `released`
    # (`get-resource`, `list-resources`)".
    await ctx.running("r")
    assert await ctx.ok("release", ctx.ref("r")) == {}
    assert (await ctx.ok("get-resource", ctx.ref("r")))["status"] == "released"
    listed = await ctx.ok("list-resources", {"user": ctx.user, "status": "released"})
    assert [r["resource_id"] for r in listed["resources"]] == ["r"] and listed["total"] == 1
    assert own_processes(ctx.ns, ctx.user) == []


AFTER_RELEASE = {
    "release": lambda c: c.ref("r"),
    "launch": lambda c: {**c.ref("r"), "filter": ONE},
    "scale": lambda c: {**c.ref("r"), "filter": ONE},
    "get-service-info": lambda c: c.ref("r"),
}


@pytest.mark.parametrize("command", AFTER_RELEASE)
async def test_after_release_every_other_command_answers_resource_not_found(ctx, command):
    # §8: "every other command on it answers `resource_not_found`, including a second `release`"
    # (except `init` and `apply`, which start a new life under the id: the next test).
    await ctx.init("r")
    await ctx.ok("release", ctx.ref("r"))
    reply = await ctx.call(command, AFTER_RELEASE[command](ctx))
    assert_error(reply, 404, "resource_not_found", "resource_id")
    assert (await ctx.ok("get-resource", ctx.ref("r")))["status"] == "released"


async def test_after_release_init_starts_a_new_life_under_the_id(ctx):
    # §8 (as crm, which forgets a released record): `init` on a released id makes a new record.
    await ctx.init("r")
    await ctx.ok("release", ctx.ref("r"))
    assert await ctx.ok("init", {**ctx.ref("r"), "param": param()}) == {}
    assert (await ctx.ok("get-resource", ctx.ref("r")))["status"] == "init"
    assert await ctx.ok("is-service-preparing", ctx.ref("r")) == {"preparing": True}


@pytest.mark.parametrize("which", ["unknown", "released"])
async def test_is_service_preparing_on_an_unknown_or_released_id_is_false(ctx, which):
    # §8: "`is-service-preparing` on an unknown id answers `{preparing: false}`" (and, as crm forgets
    # released records, on a released one too); an inited one is preparing.
    await ctx.init("r")
    assert await ctx.ok("is-service-preparing", ctx.ref("r")) == {"preparing": True}
    if which == "released":
        await ctx.ok("release", ctx.ref("r"))
    resource_id = "r" if which == "released" else "never"
    assert await ctx.ok("is-service-preparing", ctx.ref(resource_id)) == {"preparing": False}


async def test_param_is_crms_resource_param(ctx):
    # §4: "`param` is crm's ResourceParam: `city`, `platform`, `env`, `ports` (name -> protocol),
    # `volumes` (name -> {host_dir, container_dir}), `image`, `worker_version`, `broker_name`".
    given = param(**server("slow", DELAY="1"), volumes={"data": {"host_dir": "/tmp", "container_dir": "/data"}})
    await ctx.ok("init", {**ctx.ref("r"), "param": given})
    stored = (await ctx.ok("get-resource", ctx.ref("r")))["param"]
    fields = {"city", "platform", "env", "ports", "volumes", "image", "worker_version", "broker_name"}
    assert set(stored) == fields
    assert {k: stored[k] for k in given} == given and stored["broker_name"] == ""


async def test_launch_city_overrides_the_param_city(ctx):
    # §4: "`launch` {user, resource_id, city?, filter}".
    await ctx.init("r")
    start = len(ctx.cap.events)
    await ctx.ok("launch", {**ctx.ref("r"), "city": "gz", "filter": ONE})
    assert (await ctx.ok("get-resource", ctx.ref("r")))["param"]["city"] == "gz"
    await ctx.event(ctx.status_subject("r", "running"), start)


async def test_service_status_staging_running_failed(ctx):
    # §4: "service status `staging`, `running`, `failed`": a launch whose processes exit is failed.
    await ctx.running("ok")
    assert (await ctx.ok("get-service-info", ctx.ref("ok")))["status"] == "running"
    await ctx.init("broken", **FAILING)
    await ctx.ok("launch", {**ctx.ref("broken"), "filter": ONE})
    seen = set()
    deadline = time.monotonic() + 20
    while (status := (await ctx.ok("get-service-info", ctx.ref("broken")))["status"]) != "failed":
        seen.add(status)
        assert status == "staging" and time.monotonic() < deadline, seen
        await asyncio.sleep(0.05)


async def test_list_resources_filters_and_pages(ctx):
    # §4: "`list-resources` {user?, status?, broker_name?, broker_sold?, offset, limit} ->
    # {resources, total}".
    for index in range(4):
        await ctx.init(f"r{index}")
    await ctx.ok("release", ctx.ref("r3"))
    page = await ctx.ok("list-resources", {"user": ctx.user, "status": "init", "offset": 1, "limit": 2})
    assert set(page) == {"resources", "total"} and page["total"] == 3
    assert [r["resource_id"] for r in page["resources"]] == ["r1", "r2"]
    released = await ctx.ok("list-resources", {"user": ctx.user, "status": "released"})
    assert [r["resource_id"] for r in released["resources"]] == ["r3"]
    sold = await ctx.ok("list-resources", {"user": ctx.user, "broker_sold": True, "broker_name": "none"})
    assert sold == {"resources": [], "total": 0}


# -- events ----------------------------------------------------------------------------------------


@dataclass
class Story:
    """The events of one user's pools and resources through every kind of event."""

    user: str
    started: float
    ended: float
    events: list[tuple[str, dict]]
    ids: dict[str, str]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def story(b, redis, namespace):
    cap = await b.capture("broker.>")
    c = Ctx(b, redis, namespace, unique("story"), cap)
    started = time.time()
    await c.add_broker("empty", 0)  # fits but never has a resource: `miss`
    [warm] = await c.ready_pool("warm")  # `launched`, `ready`
    mark = len(cap.events)
    await c.ok("apply", {**c.ref("caller"), "param": param(), "filter": ONE})  # miss, hit, sold
    await c.event(c.pool_subject("warm", "ready"), mark)  # the pool refilled
    await c.ok("release", c.ref("caller"))  # the sold resource goes along: `released`
    await c.add_broker("crash", 1, **FAILING, fit_fields=["image"])  # `launched`, then `cooling`
    await c.event(c.pool_subject("crash", "cooling"))
    await c.running("cold", city="gz")  # fits no broker: init, deploying, running
    await c.ok("release", c.ref("cold"))  # deleting, released
    ended = time.time()
    events = c.mine(await cap.before(await c.sentinel()))
    await c.clean()
    await cap.close()
    return Story(c.user, started, ended, events, {"warm": warm, "caller": "caller", "cold": "cold"})


POOL_KINDS = {  # kind: (broker, resource_id key in Story.ids or None for any, caller_id key or None)
    "launched": ("warm", "warm", None),
    "ready": ("warm", "warm", None),
    "sold": ("warm", "warm", "caller"),
    "hit": ("warm", "warm", "caller"),
    "released": ("warm", "warm", None),
    "cooling": ("crash", None, None),
    "miss": ("empty", "caller", None),
}


@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_broker_event_subject_type_time_and_fields(b, story, kind):
    # §8: "Event subjects `berth.events.broker.<user>.<broker>.<kind>` with kinds `launched`, `ready`,
    # `sold`, `released`, `cooling`, `hit`, `miss`; body fields `resource_id` and, where they apply,
    # `caller_id`"; "Event bodies: `{type, time, ...}` where `type` is the last subject token".
    broker, resource_key, caller_key = POOL_KINDS[kind]
    subject = b.subject(f"events.broker.{story.user}.{broker}.{kind}")
    bodies = [body for s, body in story.events if s == subject]
    assert bodies, f"no {kind} event on {subject}"
    body = bodies[0]
    assert body["type"] == kind
    assert isinstance(body["time"], float) and story.started <= body["time"] <= story.ended
    assert set(body) == {"type", "time", "resource_id"} | ({"caller_id"} if caller_key else set())
    assert isinstance(body["resource_id"], str)
    if resource_key:
        assert body["resource_id"] == story.ids[resource_key]
    if caller_key:
        assert body["caller_id"] == story.ids[caller_key]


@pytest.mark.parametrize("status", ["init", "deploying", "running", "deleting", "released"])
async def test_resource_event_subject_type_time_and_id(b, story, status):
    # §4: "`berth.events.broker.resource.<user>.<resource_id>.<status>`", statuses `init`,
    # `deploying`, `running`, `released`, `deleting`.
    resource_id = story.ids["cold"]
    subject = b.subject(f"events.broker.resource.{story.user}.{resource_id}.{status}")
    [body] = [body for s, body in story.events if s == subject]
    assert body["type"] == status and body["resource_id"] == resource_id
    assert isinstance(body["time"], float) and story.started <= body["time"] <= story.ended


async def test_events_are_replayed_from_the_stream(b, story, nc, namespace):
    # §2: "A JetStream stream over `berth.events.>` keeps them for replay" (stream `<prefix>-events`).
    js = nc.jetstream()
    firsts: dict[str, dict] = {}
    for subject, body in story.events:
        firsts.setdefault(subject, body)
    assert len(firsts) >= 10
    for subject, body in firsts.items():
        replay = await js.subscribe(subject, stream=f"{namespace}-events", ordered_consumer=True)
        try:
            stored = await replay.next_msg(timeout=5)
        finally:
            await replay.unsubscribe()
        assert (stored.subject, msgpack.unpackb(stored.data)) == (subject, body)
