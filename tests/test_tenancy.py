"""Identities and roles over the wire (issue 17): a nats-server with berth's accounts, the three
workers on their own users, and a connection per identity. Each attack that worked with one shared
`client` user is tried again as a tenant and refused, while the tenant's own work goes on."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import pytest_asyncio
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from berth.accounts import CONSUMER_SLOTS
from bus.callers import REQUEST_INFO, Role
from bus.client import BusClient
from bus.connection import connect
from tests.accounts_helpers import NODE, Errors, deployed, refused

NODE_4 = {"cpumem": {"cpu": 4, "memory": "8G"}}
ONE_CPU = {"cpumem": {"cpu-request": 1}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("tenancy")) as d:
        yield d


@pytest_asyncio.fixture
async def d(deployment):
    yield deployment
    await deployment.close_connections()


@pytest_asyncio.fixture
async def node(d):
    """A node added by the admin, for this test alone."""
    name = f"n{time.monotonic_ns()}"
    await (await d.client("admin")).request("resource.add-node", {"nodename": name, "resource": NODE_4})
    return name


# -- roles ------------------------------------------------------------------------------------------


ADMIN_COMMANDS = [
    ("resource.add-node", {"nodename": "x", "resource": NODE_4}),
    ("resource.remove-node", {"nodename": "x"}),
    ("resource.set-node-resource-info", {"nodename": "x", "capacity": NODE_4, "usage": {}}),
    ("resource.set-node-resource-capacity", {"nodename": "x", "resource": NODE_4, "incr": True}),
    ("resource.set-node-resource-usage", {"nodename": "x", "resource": NODE_4, "incr": True}),
    ("resource.fix-node-resource", {"nodename": "x"}),
    ("resource.set-node-labels", {"nodename": "x", "labels": {"a": "b"}}),
    ("resource.cpumem.add-node", {"nodename": "x", "resource": {"cpu": 4, "memory": "8G"}}),
    ("broker.add-broker", {"user": "alice", "name": "b", "strategy": {"type": "const", "num": 1},
                           "param": {"city": "c", "platform": "p", "image": "http-server"}}),
    ("broker.remove-broker", {"user": "alice", "name": "b"}),
    (f"metrics.{NODE}.put", {"scope": "node", "metric": "x.y", "value": 1.0}),
]


@pytest.mark.parametrize(("subject", "payload"), ADMIN_COMMANDS, ids=[s for s, _ in ADMIN_COMMANDS])
async def test_a_tenant_and_a_reader_may_not_call_an_admin_command(d, subject, payload):
    for name in ("alice", "watcher"):
        error = await refused((await d.client(name)).request(subject, payload))
        assert error.http_status == 403 and error.details["role"] == "admin"
        assert name in error.message


async def test_a_reader_reads_but_may_not_place_or_release(d, node):
    watcher = await d.client("watcher")
    listed = await watcher.request("resource.list-nodes", {"nodenames": [node]})
    assert [n["nodename"] for n in listed["nodes"]] == [node]
    assert (await watcher.request(f"metrics.{NODE}.has-synced", {}))["synced"] in (True, False)
    for subject, payload in (
        ("resource.allocate", {"nodename": node, "deploy_count": 1, "workload_resource_request": ONE_CPU}),
        ("resource.release", {"workload_ids": ["w"]}),
        ("resource.realloc", {"workload_id": "w", "workload_resource_request": ONE_CPU}),
        ("broker.init", {"user": "watcher", "resource_id": "r", "param": {}}),
        ("broker.apply", {"user": "watcher", "resource_id": "r", "param": {}}),
    ):
        error = await refused(watcher.request(subject, payload))
        assert error.details["role"] == "tenant"


async def test_a_tenant_places_and_the_admin_manages_nodes(d, node):
    alice = await d.client("alice")
    placed = await alice.request("resource.allocate", {
        "nodename": node, "deploy_count": 2, "request_id": "place", "workload_resource_request": ONE_CPU})
    assert [a["nodename"] for a in placed["allocations"]] == [node, node]
    admin = await d.client("admin")
    await admin.request("resource.set-node-labels", {"nodename": node, "labels": {"pool": "a"}})
    assert (await admin.request("resource.list-nodes", {"nodenames": [node]}))["nodes"][0]["labels"] == {"pool": "a"}


async def test_a_caller_cannot_choose_who_it_is(d):
    """The header that names the caller is the server's: one the caller sends under that name is
    replaced, so a tenant claiming to be an admin's account is still the tenant."""
    alice = await d.client("alice")
    forged = {REQUEST_INFO: '{"acc": "admin_admin", "user": "admin"}'}
    reply = await alice.nc.request(f"{d.prefix}.resource.add-node",
                                   msgpack.packb({"nodename": "forged", "resource": NODE_4}), timeout=10,
                                   headers=forged)
    assert reply.headers["Nats-Service-Error-Code"] == "403"
    assert msgpack.unpackb(reply.data)["error"]["code"] == "permission_denied"


async def test_the_same_request_id_from_two_tenants_is_two_requests(d, node):
    """Answers are kept per caller: bob's retry of an id alice used is bob's own request, and he is
    never handed her answer (nor do the workload ids derived from it collide)."""
    alice, bob = await d.client("alice"), await d.client("bob")
    payload = {"nodename": node, "deploy_count": 1, "request_id": "same-id", "workload_resource_request": ONE_CPU}
    first = await alice.request("resource.allocate", payload)
    second = await bob.request("resource.allocate", payload)
    assert first["allocations"][0]["workload_id"] != second["allocations"][0]["workload_id"]
    again = await bob.request("resource.allocate", payload)
    assert again == second


# -- what a tenant cannot reach on the bus --------------------------------------------------------------


async def test_a_tenant_sees_no_other_callers_replies(d, node):
    bob_nc = await d.connect("bob")
    seen = []

    async def record(msg) -> None:
        seen.append(msg.subject)

    await bob_nc.subscribe("_INBOX.>", cb=record)
    await bob_nc.subscribe(">", cb=record)  # anything at all his account carries
    await bob_nc.flush()
    alice, admin = await d.client("alice"), await d.client("admin")
    await alice.request("resource.allocate", {"nodename": node, "deploy_count": 1, "workload_resource_request": ONE_CPU})
    await admin.request("resource.list-nodes", {})
    await alice.request("resource.plugins", {})
    # Sentinel: bob's own request comes back to his own inbox, after everything above.
    await BusClient(bob_nc, prefix=d.prefix).request("resource.plugins", {})
    await bob_nc.flush()
    assert all(subject.startswith(f"{d.prefix}.events.") or subject.startswith("_INBOX.") for subject in seen)
    inbox_replies = [s for s in seen if s.startswith("_INBOX.")]
    assert len(inbox_replies) == 1  # his own reply, and no one else's


async def test_a_request_cannot_point_a_service_at_an_event_subject(d):
    """A reply subject names a subject of the caller's own account: the service's answer goes
    there and nowhere else, so nobody else receives a fake event and the stream keeps none."""
    fake = f"{d.prefix}.events.resource.victim.removed"
    listeners = {name: await d.connect(name) for name in ("bob", "admin", "watcher")}
    subscriptions = {name: await nc.subscribe(f"{d.prefix}.events.resource.>") for name, nc in listeners.items()}
    for nc in listeners.values():
        await nc.flush()
    alice = await d.connect("alice")
    own = await alice.subscribe(fake)  # the only place the answer may land: alice's own account
    await alice.flush()
    for subject in (f"{d.prefix}.resource.get-most-idle-node", f"$SRV.PING.{d.prefix}-allocation"):
        await alice.publish(subject, msgpack.packb({"nodenames": []}), reply=fake)
    assert (await own.next_msg(timeout=10)).subject == fake  # the service did answer: onto alice's subject
    # Sentinel: a real change after it; every listener gets it, and nothing before it.
    await (await d.client("admin")).request("resource.add-node", {"nodename": "sentinel", "resource": NODE_4})
    for name, sub in subscriptions.items():
        first = await sub.next_msg(timeout=10)
        assert first.subject == f"{d.prefix}.events.resource.sentinel.added", name
    js = d.jetstream(await d.connect("admin"))
    with pytest.raises(NotFoundError):
        await js.get_last_msg(f"{d.prefix}-events", fake)


async def test_a_tenant_cannot_serve_a_command_nor_publish_an_event(d):
    errors = Errors()
    alice = await d.connect("alice", errors)
    subject = f"{d.prefix}.resource.add-node"
    await alice.subscribe(subject)
    await errors.expect("permissions violation for subscription", subject)
    event = f"{d.prefix}.events.resource.x.added"
    await alice.publish(event, msgpack.packb({"type": "added", "time": time.time(), "nodename": "x"}))
    await errors.expect("permissions violation for publish", event)
    # the real service still answers the admin
    admin = await d.client("admin")
    added = await admin.request("resource.add-node", {"nodename": "served", "resource": NODE_4})
    assert added["capacity"]["cpumem"]["cpu"] == 4
    with pytest.raises(NotFoundError):
        await d.jetstream(admin.nc).get_last_msg(f"{d.prefix}-events", event)


async def test_a_tenant_sees_node_changes_and_its_own_broker_events_only(d, node):
    bob = await d.connect("bob")
    sub = await bob.subscribe(f"{d.prefix}.events.>")
    await bob.flush()
    alice = await d.client("alice")
    await alice.request("resource.allocate", {"nodename": node, "deploy_count": 1, "workload_resource_request": ONE_CPU})
    admin = await d.client("admin")
    await admin.request("resource.set-node-labels", {"nodename": node, "labels": {"seen": "yes"}})
    # bob sees the node's relabelling, which came after alice's placement, and not the placement
    msg = await sub.next_msg(timeout=10)
    assert msg.subject == f"{d.prefix}.events.resource.{node}.labels"
    assert sub.pending_msgs == 0
    watcher = await d.connect("watcher")  # a reader sees everything
    assert (await d.jetstream(watcher).get_last_msg(f"{d.prefix}-events",
                                                    f"{d.prefix}.events.resource.{node}.allocated")).data


async def _workload_events(sub, count: int) -> list:
    return [await sub.next_msg(timeout=10) for _ in range(count)]


async def test_a_tenant_follows_its_own_workloads_and_sees_no_one_elses_ids(d, node):
    """alice's placements, reallocation and release reach her on `resource.workload.alice.>`, each
    naming her ids only, also when one release (the admin's) removes bob's beside hers; bob's own
    subject carries his; alice receives nothing of his, live or replayed."""
    alice_nc = await d.connect("alice")
    sub = await alice_nc.subscribe(f"{d.prefix}.events.>")
    await alice_nc.flush()
    alice, bob, admin = await d.client("alice"), await d.client("bob"), await d.client("admin")
    request = {"nodename": node, "deploy_count": 2, "workload_resource_request": ONE_CPU}
    hers = [a["workload_id"] for a in (await alice.request("resource.allocate", request))["allocations"]]
    his = [a["workload_id"] for a in (await bob.request("resource.allocate", request))["allocations"]]
    await alice.request("resource.realloc", {"workload_id": hers[0], "workload_resource_request": ONE_CPU})
    released = await admin.request("resource.release", {"workload_ids": [hers[1], *his]})
    assert sorted(released["released"]) == sorted([hers[1], *his])

    own = f"{d.prefix}.events.resource.workload.alice.{node}"
    got = await _workload_events(sub, 3)
    assert [(m.subject, msgpack.unpackb(m.data)["workload_ids"]) for m in got] == [
        (f"{own}.allocated", hers), (f"{own}.usage", [hers[0]]), (f"{own}.released", [hers[1]])]
    assert all(msgpack.unpackb(m.data)["nodename"] == node for m in got)
    await asyncio.sleep(0.5)  # anything else alice would receive has come by now
    assert sub.pending_msgs == 0

    watcher = d.jetstream(await d.connect("watcher"))  # bob's own events were published, and kept
    last = await watcher.get_last_msg(f"{d.prefix}-events", f"{d.prefix}.events.resource.workload.bob.{node}.released")
    assert sorted(msgpack.unpackb(last.data)["workload_ids"]) == sorted(his)  # a release names ids in order

    js = d.jetstream(alice_nc)  # replayed through a consumer of her own (of all her nodes): hers only
    stream, mine = f"{d.prefix}-events", f"{d.prefix}.events.resource.workload.alice."
    info = await js.add_consumer(stream, ConsumerConfig(name="alice-3", filter_subject=f"{mine}>",
                                                        ack_policy=AckPolicy.NONE))
    pull = await js.pull_subscribe_bind(info.name, stream=stream)
    replayed = await pull.fetch(100, timeout=10)
    assert all(m.subject.startswith(mine) for m in replayed)
    assert [m.subject for m in replayed if m.subject.startswith(own)] == [m.subject for m in got]
    await js.delete_consumer(stream, "alice-3")
    with pytest.raises((NoRespondersError, NatsError)):  # nor may she filter bob's
        await js.add_consumer(stream, ConsumerConfig(
            name="alice-3", filter_subject=f"{d.prefix}.events.resource.workload.bob.>"))


# -- JetStream: consumers of one's own -----------------------------------------------------------------


async def test_a_tenant_reads_the_stream_through_consumers_of_its_own(d, node):
    js = d.jetstream(await d.connect("alice"))
    stream, subject = f"{d.prefix}-events", f"{d.prefix}.events.resource.*.added"
    info = await js.add_consumer(stream, ConsumerConfig(name="alice-0", filter_subject=subject,
                                                        ack_policy=AckPolicy.EXPLICIT))
    pull = await js.pull_subscribe_bind(info.name, stream=stream)
    fetched = await pull.fetch(100, timeout=10)
    assert f"{d.prefix}.events.resource.{node}.added" in {msg.subject for msg in fetched}
    for msg in fetched:
        await msg.ack_sync()
    assert (await js.consumer_info(stream, "alice-0")).num_ack_pending == 0
    await js.delete_consumer(stream, "alice-0")


async def test_a_tenant_cannot_touch_consumers_not_its_own_nor_filter_what_it_may_not_see(d):
    stream = f"{d.prefix}-events"
    admin_js = d.jetstream(await d.connect("admin"))
    await admin_js.add_consumer(stream, ConsumerConfig(name="admin-0", durable_name="admin-0"))
    js = d.jetstream(await d.connect("alice"))
    attempts = [
        js.delete_consumer(stream, "admin-0"),  # someone else's
        js.consumer_info(stream, "admin-0"),
        js.add_consumer(stream, ConsumerConfig(name="bob-0", filter_subject=f"{d.prefix}.events.resource.*.added")),
        # its own slot, but events it may not see
        js.add_consumer(stream, ConsumerConfig(name="alice-1", filter_subject=f"{d.prefix}.events.broker.bob.>")),
        js.add_consumer(stream, ConsumerConfig(name="alice-1", filter_subject=f"{d.prefix}.events.resource.>")),
        js.add_consumer(stream, ConsumerConfig(name="alice-1", filter_subjects=[f"{d.prefix}.events.broker.bob.>"])),
        js.add_consumer(stream, ConsumerConfig(name="alice-1")),  # the whole stream
        js.add_consumer(stream, ConsumerConfig(durable_name="alice-1")),  # the old API, the filter in the body
        js.add_consumer(stream, ConsumerConfig()),  # a name of the server's choosing
        js.add_consumer(stream, ConsumerConfig(name=f"alice-{CONSUMER_SLOTS}",  # beyond the bound
                                               filter_subject=f"{d.prefix}.events.resource.*.added")),
        js.delete_stream(stream),
        js.purge_stream(stream),
    ]
    for attempt in attempts:
        with pytest.raises((NoRespondersError, NatsError)):
            await attempt
    assert (await admin_js.consumer_info(stream, "admin-0")).name == "admin-0"  # still there


async def test_a_consumer_cannot_deliver_onto_a_service_subject(d, node):
    """A push consumer's deliveries stay in the streams' own account: one pointed at a command
    subject is made (in the tenant's slot) and delivers nothing anywhere."""
    stream = f"{d.prefix}-events"
    js = d.jetstream(await d.connect("alice"))
    target = f"{d.prefix}.resource.remove-node"
    admin = await d.client("admin")
    before = await _endpoint_requests(admin, "resource-remove-node")
    await js.add_consumer(stream, ConsumerConfig(name="alice-2", deliver_subject=target, ack_policy=AckPolicy.NONE,
                                                 filter_subject=f"{d.prefix}.events.resource.*.added"))
    await asyncio.sleep(1)
    info = await js.consumer_info(stream, "alice-2")
    assert info.num_pending > 0 and info.delivered.stream_seq == 0  # there was something to deliver
    assert await _endpoint_requests(admin, "resource-remove-node") == before
    assert (await admin.request("resource.list-nodes", {"nodenames": [node]}))["total"] == 1
    await js.delete_consumer(stream, "alice-2")


async def _endpoint_requests(client: BusClient, endpoint: str) -> int:
    stats = await client.nc.request(f"$SRV.STATS.{client.prefix}-allocation", b"", timeout=5)
    import json

    return sum(e["num_requests"] for e in json.loads(stats.data)["endpoints"] if e["name"] == endpoint)


# -- identities come and go ---------------------------------------------------------------------------


async def test_an_identity_added_to_a_running_server_works_at_once_and_a_removed_one_is_cut_off(d, node):
    d.add_identity("carol", Role.TENANT)
    carol = await d.client("carol")
    placed = await carol.request("resource.allocate", {
        "nodename": node, "deploy_count": 1, "workload_resource_request": ONE_CPU})
    assert placed["allocations"][0]["nodename"] == node
    cut = asyncio.Event()

    async def on_disconnect() -> None:
        cut.set()

    await d.connect("carol", disconnected_cb=on_disconnect, allow_reconnect=False)
    url = d.creds.nats_url("carol", d.nats.url)
    d.remove_identity("carol")
    await asyncio.wait_for(cut.wait(), 10)
    with pytest.raises(NatsError, match="Authorization Violation"):
        await connect(url, worker=False, allow_reconnect=False, max_reconnect_attempts=0)
