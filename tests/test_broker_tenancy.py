"""Broker resources and pools belong to their user (issue 17), over the wire: a nats-server with
berth's accounts, the workers on their own users, and a connection per identity. A tenant acts for
its own user only, whatever user or resource id it names; a reader reads everyone's; the admin acts
for anyone. The broker runs the `allocation` operator: its own requests to the allocation service
come from the services' account, and place what any tenant launches."""

from __future__ import annotations

import time
from typing import Any

import pytest
import pytest_asyncio
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.accounts_helpers import deployed, refused
from tests.broker_helpers import FAST_ARGS, const_broker, kill_marked, param
from tests.bus_helpers import eventually

ONE = {"least_instance": 1, "request_instance": 1}
NODE = "placed"  # the one node the allocation operator places on (city and platform of `param()`), and its agent


@pytest_asyncio.fixture(scope="module")
async def deployment(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("broker-tenancy"), *FAST_ARGS,
                  "--operator", "allocation", "--no-bind-cpus") as d:
        d.start_agent(NODE, "city=sz", "platform=linux", cpus=8, memory=16 << 30)  # it registers the node
        yield d
    kill_marked(d.prefix)  # what a failed test launched and left


@pytest_asyncio.fixture
async def as_(deployment):
    """`await as_("alice")`: a function calling broker commands as that identity (its connection
    closed after the test)."""

    async def speaking(name: str):
        client = await deployment.client(name, timeout=20)

        async def call(command: str, payload: dict[str, Any], service: str = "broker") -> dict[str, Any]:
            return await client.request(f"{service}.{command}", payload, dict)

        return call

    yield speaking
    await deployment.close_connections()


async def not_hers(call_, user: str = "alice") -> None:
    """Refused as someone else's user: 403, naming the field `user`."""
    error = await refused(call_)
    assert (error.http_status, error.details["field"], error.details["user"]) == (403, "user", user)


def rid(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


def ref(user: str, resource_id: str, **fields: Any) -> dict[str, Any]:
    return {"user": user, "resource_id": resource_id, **fields}


def refs(listing: dict[str, Any]) -> set[tuple[str, str]]:
    """(user, resource_id) of each resource a listing shows."""
    return {(r["user"], r["resource_id"]) for r in listing["resources"]}


def owners(listing: dict[str, Any], field: str = "resources") -> set[str]:
    return {item["user"] for item in listing[field]}


async def placed(b) -> list[str]:
    """The workloads on the node."""
    reply = await b("get-allocations", {"nodename": NODE}, "resource")
    return [a["workload_id"] for a in reply["allocations"]]


async def running(b, user: str, resource_id: str) -> dict[str, Any]:
    async def up():
        info = await b("get-service-info", ref(user, resource_id))
        return info if info["status"] == "running" else None

    return await eventually(up, 20)


async def test_another_tenant_cannot_reach_a_tenants_resource(as_):
    admin, alice, bob = await as_("admin"), await as_("alice"), await as_("bob")
    mine = rid("mine")
    await alice("init", ref("alice", mine, param=param()))
    await alice("launch", ref("alice", mine, filter=ONE))
    await running(alice, "alice", mine)
    assert f"broker/alice/{mine}/0" in await placed(admin)  # the broker's own request placed it
    for command, extra in (
        ("release", {}),
        ("scale", {"filter": ONE}),
        ("launch", {"filter": ONE}),
        ("init", {"param": param()}),
        ("apply", {"param": param(), "filter": ONE}),
        ("get-resource", {}),
        ("get-service-info", {}),
        ("is-service-preparing", {}),
    ):
        await not_hers(bob(command, ref("alice", mine, **extra)))
    # His own user names his own resources: hers of the same id is not among them.
    for command, extra in (("release", {}), ("scale", {"filter": ONE}), ("launch", {"filter": ONE}),
                           ("get-resource", {}), ("get-service-info", {})):
        await refused(bob(command, ref("bob", mine, **extra)), "resource_not_found")
    assert await bob("is-service-preparing", ref("bob", mine)) == {"preparing": False}
    for command in ("get-namespace", "get-instance-type", "get-resource-detail"):
        await not_hers(bob(command, {"user": "alice"}))
    seen = await alice("get-resource", ref("alice", mine))
    assert (seen["user"], seen["status"], seen["request_instance"]) == ("alice", "running", 1)
    await alice("scale", ref("alice", mine, filter=ONE))
    await running(alice, "alice", mine)
    await alice("release", ref("alice", mine))
    assert (await alice("get-resource", ref("alice", mine)))["status"] == "released"
    assert not {f"broker/alice/{mine}/{i}" for i in (0, 1)} & set(await placed(admin))  # and freed it


async def test_a_tenant_lists_its_own_and_a_reader_everyones(as_):
    alice, bob, watcher = await as_("alice"), await as_("bob"), await as_("watcher")
    hers, his = ("alice", rid("listed")), ("bob", rid("listed"))
    await alice("init", ref(*hers, param=param()))
    await bob("init", ref(*his, param=param()))
    listing = await bob("list-resources", {"limit": 1000})
    assert his in refs(listing) and owners(listing) == {"bob"}
    assert listing["total"] == len(listing["resources"])
    assert owners(await bob("get-resource-detail", {"user": "bob", "limit": 1000})) == {"bob"}
    await not_hers(bob("list-resources", {"user": "alice"}))
    assert {hers, his} <= refs(await watcher("list-resources", {"limit": 1000}))
    assert owners(await watcher("list-resources", {"user": "alice", "limit": 1000})) == {"alice"}
    assert {hers, his} <= refs(await watcher("get-resource-detail", {"user": "watcher", "limit": 1000}))
    assert await watcher("is-service-preparing", ref(*his)) == {"preparing": True}
    for command, payload in (("init", ref("watcher", rid("r"), param=param())), ("release", ref(*hers))):
        assert (await refused(watcher(command, payload))).details["role"] == "tenant"
    for resource in (hers, his):
        assert (await watcher("get-resource", ref(*resource)))["status"] == "init"


async def test_pools_belong_to_their_user(as_):
    """A broker's pool is its user's: that user's launch and apply take from it, and nobody else's
    (an admin gives each tenant brokers of its own)."""
    admin, alice, bob, watcher = [await as_(name) for name in ("admin", "alice", "bob", "watcher")]
    name = f"pool{time.monotonic_ns()}"
    await admin("add-broker", const_broker("alice", name, 1))
    await admin("add-broker", const_broker("bob", f"{name}-b", 0))

    async def idle():
        brokers = (await alice("list-brokers", {}))["brokers"]
        return next((b for b in brokers if b["name"] == name and b["idle"]), None)

    await eventually(idle, 20)
    assert owners(await bob("list-brokers", {}), "brokers") == {"bob"}
    assert owners(await alice("list-brokers", {"user": "alice"}), "brokers") == {"alice"}
    await not_hers(bob("list-brokers", {"user": "alice"}))
    assert {"alice", "bob"} <= owners(await watcher("list-brokers", {}), "brokers")
    # bob's apply with his own user meets his own (empty) broker, never alice's warm resource
    empty = await refused(bob("apply", ref("bob", rid("taker"), param=param(), filter=ONE)),
                          "broker_not_enough_resources")
    assert empty.details["brokers"] == [f"{name}-b"]
    await not_hers(bob("apply", ref("alice", rid("taker"), param=param(), filter=ONE)))
    [warm] = [r["resource_id"] for r in (await alice("list-resources", {"broker_name": name}))["resources"]]
    await refused(bob("release", ref("bob", warm)), "resource_not_found")
    await not_hers(bob("release", ref("alice", warm)))
    caller = rid("caller")
    sold = await alice("apply", ref("alice", caller, param=param(), filter=ONE))
    assert sold == {"broker_resource_id": warm}
    await alice("release", ref("alice", caller))
    await admin("remove-broker", {"user": "alice", "name": name})
    await admin("remove-broker", {"user": "bob", "name": f"{name}-b"})


async def test_the_admin_acts_for_any_user(as_):
    admin, alice, bob = await as_("admin"), await as_("alice"), await as_("bob")
    made = rid("made")
    await admin("init", ref("alice", made, param=param()))
    await admin("launch", ref("alice", made, filter=ONE))
    await running(alice, "alice", made)  # made for alice: hers
    await not_hers(bob("release", ref("alice", made)))
    assert ("alice", made) in refs(await admin("list-resources", {"limit": 1000}))
    await admin("release", ref("alice", made))
    assert (await alice("get-resource", ref("alice", made)))["status"] == "released"


async def test_refusals_and_answers_stay_under_retries(as_):
    """A refusal is kept as any answer is (the same again for a retry); and a request id is its
    caller's own, so bob's refused id does not stand in the way of alice's."""
    alice, bob = await as_("alice"), await as_("bob")
    mine, never = rid("kept"), rid("never")
    await alice("init", ref("alice", mine, param=param()))
    for _ in range(2):
        await not_hers(bob("release", ref("alice", mine, request_id="same")))
        await not_hers(bob("init", ref("alice", never, param=param(), request_id="other")))
    assert (await alice("get-resource", ref("alice", mine)))["status"] == "init"
    await refused(alice("get-resource", ref("alice", never)), "resource_not_found")
    for _ in range(2):
        assert await alice("release", ref("alice", mine, request_id="same")) == {}
    assert (await alice("get-resource", ref("alice", mine)))["status"] == "released"


async def test_only_an_admin_runs_and_stops_processes_on_a_host(as_):
    """The agent's commands over accounts: a tenant or a reader may not start, stop or drain (nor
    renew the node's lease: it could keep a dead host in selections); a reader reads what runs."""
    admin, alice, watcher = await as_("admin"), await as_("alice"), await as_("watcher")
    start = {"instance": rid("direct"), "param": {"image": "http-server", "ports": {"http": "http"}}}
    for caller in (alice, watcher):
        await refused(caller("start", start, f"agent.{NODE}"))
        await refused(caller("stop", {"instance": start["instance"]}, f"agent.{NODE}"))
        await refused(caller("drain", {"draining": True}, f"agent.{NODE}"))
        await refused(caller("node-heartbeat", {"nodename": NODE, "ttl_seconds": 600}, "resource"))
    started = await admin("start", start, f"agent.{NODE}")
    listed = await watcher("status", {"instances": [start["instance"]]}, f"agent.{NODE}")
    assert [i["pid"] for i in listed["instances"]] == [started["pid"]]
    assert (await admin("stop", {"instance": start["instance"]}, f"agent.{NODE}"))["stopped"] is True


async def test_a_tenant_receives_its_own_broker_events_and_none_of_another_tenants(deployment, as_):
    """By subscription and through a consumer of its own: bob's `init` event arrives, and alice's
    `init`, made before it, never does (each check waits for bob's positive event, which comes
    after alice's, rather than for a quiet moment)."""
    d = deployment
    bob_nc = await d.connect("bob")
    live = await bob_nc.subscribe(f"{d.prefix}.events.>")
    await bob_nc.flush()
    alice, bob = await as_("alice"), await as_("bob")
    hers, his = rid("hers"), rid("his")
    await alice("init", ref("alice", hers, param=param()))
    await bob("init", ref("bob", his, param=param()))
    mine = f"{d.prefix}.events.broker.resource.bob.{his}.init"
    seen = []
    while not seen or seen[-1] != mine:  # up to bob's own event, which came after alice's
        seen.append((await live.next_msg(timeout=10)).subject)
    assert not [subject for subject in seen if ".alice." in subject], seen
    js = d.jetstream(bob_nc)
    stream = f"{d.prefix}-events"
    await js.add_consumer(stream, ConsumerConfig(name="bob-3", filter_subject=f"{d.prefix}.events.broker.resource.bob.>",
                                                 ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL))
    try:
        pull = await js.pull_subscribe_bind("bob-3", stream=stream)
        fetched = [msg.subject for msg in await pull.fetch(1000, timeout=5)]
        assert mine in fetched and not [s for s in fetched if ".alice." in s]
    finally:
        await js.delete_consumer(stream, "bob-3")
    for subject in (f"{d.prefix}.events.broker.resource.alice.>", f"{d.prefix}.events.broker.alice.>"):
        with pytest.raises((NoRespondersError, NatsError)):  # his slots filter only what he may see
            await js.add_consumer(stream, ConsumerConfig(name="bob-4", filter_subject=subject))
