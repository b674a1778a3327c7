"""A fleet, securely (issue 28): every agent runs as an identity bound to its own node, every service
identity reaches only what it serves and calls, and no service identity changes a stream. Each
probe that worked with the one shared agent credential (and with the services' credentials) is
tried again over the wire, connected as that identity, and refused; the agents' own work goes on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgpack
import pytest
import pytest_asyncio
import redis as sync_redis

from bus.callers import Role
from bus.client import BusClient
from bus.connection import inbox_prefix
from tests.accounts_helpers import Errors, deployed, refused
from tests.worker_helpers import ROOT

A, B = "web-a", "web-b"
NODE_4 = {"cpumem": {"cpu": 4, "memory": "8G"}}
ONE_CPU = {"cpumem": {"cpu-request": 1}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("fleet")) as d:
        d.start_agent(A, cpus=2)
        d.start_agent(B, cpus=2)
        yield d


@pytest_asyncio.fixture
async def d(deployment):
    yield deployment
    await deployment.close_connections()


async def lease_of(d, node: str) -> dict:
    admin = await d.client("admin")
    listed = await admin.request("resource.list-nodes", {"nodenames": [node]})
    return listed["nodes"][0]


async def as_agent(d, identity: str, errors: Errors | None = None) -> BusClient:
    """A client speaking as `identity`, with its node's own inbox (the only one it may read)."""
    nc = await d.connect(identity, errors, inbox_prefix=inbox_prefix(d.prefix, "agent", d.creds.identities[identity].node))
    return BusClient(nc, prefix=d.prefix)


# -- an agent acts for its own node only ---------------------------------------------------------


async def test_each_agent_registers_and_keeps_its_own_node_up_as_its_own_identity(d):
    for node in (A, B):
        listed = await lease_of(d, node)
        assert listed["status"] == "up" and listed["lease"]["ttl_seconds"] > 1
    agent = await as_agent(d, A)
    beat = await agent.request(f"resource.node.{A}.node-heartbeat", {"nodename": A, "ttl_seconds": 30})
    assert beat["nodename"] == A


@pytest.mark.parametrize("subject", [
    f"resource.node.{B}.node-heartbeat",   # the other node's own subject
    "resource.node-heartbeat",             # the admins' subjects, which name the node in the payload
    "resource.add-node",
    "resource.remove-node",
    "resource.release",
    "resource.allocate",
    f"events.agent.{B}.exited",            # the other node's events
    f"events.metrics.{B}.node.cpu",
    f"agent.{B}.start",                    # another agent's commands
    "broker.apply",
])
async def test_an_agent_identity_may_not_publish_for_another_node_nor_as_an_admin(d, subject):
    errors = Errors()
    agent = await as_agent(d, A, errors)
    full = f"{d.prefix}.{subject}"
    await agent.nc.publish(full, msgpack.packb({"nodename": B, "ttl_seconds": 1, "workload_ids": ["x"]}))
    await errors.expect("permissions violation for publish", full)
    listed = await lease_of(d, B)
    assert listed["status"] == "up" and listed["lease"]["ttl_seconds"] != 1  # nothing reached allocation


@pytest.mark.parametrize("pattern", [f"agent.{B}.>", f"metrics.{B}.>", "resource.>", "events.>"])
async def test_an_agent_identity_may_not_serve_nor_read_another_nodes_subjects(d, pattern):
    errors = Errors()
    agent = await as_agent(d, A, errors)
    await agent.nc.subscribe(f"{d.prefix}.{pattern}")
    await errors.expect("permissions violation for subscription", f"{d.prefix}.{pattern}")
    admin = await d.client("admin")
    info = await admin.request(f"agent.{B}.info", {})
    assert info["node"] == B and info["status"] == "up"  # answered by B's own agent


async def test_a_request_on_its_own_subject_for_another_node_is_refused_naming_both(d):
    agent = await as_agent(d, A)
    error = await refused(agent.request(f"resource.node.{A}.node-heartbeat", {"nodename": B, "ttl_seconds": 1}))
    assert error.details["field"] == "nodename" and A in error.message and B in error.message
    assert (await lease_of(d, B))["lease"]["ttl_seconds"] != 1


async def test_a_tenant_may_not_use_an_agents_subjects(d):
    alice = await d.client("alice")
    await refused(alice.request(f"resource.node.{A}.node-heartbeat", {"nodename": A, "ttl_seconds": 1}))


def test_an_agent_started_with_another_nodes_identity_refuses_to_start_naming_both(d):
    argv, env = d.creds.worker_launch(A, d.nats.url, d.redis.url)
    run = subprocess.run(
        [sys.executable, "-m", "bus.runner", "services.agent.worker", *argv, "--node", "web-c",
         "--state", str(d.directory / "web-c-state"), "--root", str(d.directory / f"{A}-host")],
        cwd=ROOT, env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f"node {A}'s agent" in run.stderr and "node web-c's agent" in run.stderr, run.stderr


def test_an_agents_redis_user_reaches_only_its_own_nodes_metrics_keys(d):
    with d.redis_as(A) as mine:
        mine.set(f"{d.prefix}:metrics:{{{A}}}:probe", "1")
        for key in (f"{d.prefix}:metrics:{{{B}}}:probe", f"{d.prefix}:allocation:nodes", f"{d.prefix}:broker:x"):
            with pytest.raises(sync_redis.exceptions.NoPermissionError):
                mine.get(key)


async def test_a_removed_agent_identity_is_cut_off_from_nats_and_redis(d):
    d.add_identity("web-z", Role.AGENT, "web-z")
    errors, cut = Errors(), asyncio.Event()

    async def disconnected() -> None:
        cut.set()

    agent = await d.connect("web-z", errors, disconnected_cb=disconnected,
                            inbox_prefix=inbox_prefix(d.prefix, "agent", "web-z"))
    await agent.flush()
    with d.redis_as("web-z") as redis:
        assert redis.ping()
    password = d.creds.identities["web-z"].password
    d.remove_identity("web-z")
    await asyncio.wait_for(cut.wait(), 10)  # the server closed its connection at once
    await errors.expect("authorization violation")  # and refuses it again
    with pytest.raises(sync_redis.exceptions.AuthenticationError):
        sync_redis.Redis(port=d.redis_port, username="web-z", password=password).ping()


# -- least privilege of the services' identities --------------------------------------------------

# What each service's identity may publish, and a sample of what it may not (the docs' table).
MAY_PUBLISH = {
    "allocation": (["events.resource.n1.added"],
                   ["resource.allocate", "broker.apply", f"agent.{A}.start", "events.broker.x.y", "metrics.n1.put"]),
    "broker": (["resource.allocate", "resource.release", "resource.list-nodes", f"agent.{A}.start",
                f"agent.{A}.stop", "events.broker.alice.x"],
               ["resource.add-node", "resource.remove-node", "resource.node-heartbeat", "resource.set-node-labels",
                f"resource.node.{A}.node-heartbeat", f"agent.{A}.drain", "events.resource.n1.added"]),
    "metrics": (["events.metrics.n1.node.cpu"], ["resource.allocate", f"agent.{A}.start", "events.agent.n1.x"]),
    A: ([f"resource.node.{A}.node-heartbeat", f"events.agent.{A}.exited", f"events.metrics.{A}.node.cpu"],
        [f"resource.node.{B}.node-heartbeat", "resource.allocate", f"events.agent.{B}.exited", "broker.apply"]),
}
STREAM_VERBS = ["CREATE", "UPDATE", "DELETE", "PURGE"]


@pytest.mark.parametrize("identity", list(MAY_PUBLISH))
async def test_each_service_identity_publishes_what_the_table_allows_and_nothing_else(d, identity):
    """Each allowed subject is followed by a refused one: the first violation reported must be the
    refused one's (errors come in order), so the allowed one was let through."""
    errors = Errors()
    nc = await d.connect(identity, errors)
    allowed, denied = MAY_PUBLISH[identity]
    for subject in allowed:
        sentinel = f"{d.prefix}.{denied[0]}"
        await nc.publish(f"{d.prefix}.{subject}", b"\x80")
        await nc.publish(sentinel, b"\x80")
        first = await errors.expect("permissions violation for publish")
        assert sentinel.lower() in first, (subject, first)
    for subject in denied:
        await nc.publish(f"{d.prefix}.{subject}", b"\x80")
        await errors.expect("permissions violation for publish", f"{d.prefix}.{subject}")


@pytest.mark.parametrize("identity", ["allocation", "broker", "metrics", A])
async def test_no_service_identity_may_create_change_purge_or_delete_a_stream(d, identity):
    errors = Errors()
    nc = await d.connect(identity, errors)
    for stream in (f"{d.prefix}-events", f"{d.prefix}-metrics"):
        for verb in STREAM_VERBS:
            subject = f"$JS.{d.prefix}.API.STREAM.{verb}.{stream}"
            await nc.publish(subject, b'{"max_msgs": 1}')
            await errors.expect("permissions violation for publish", subject)
    admin = await d.connect("admin")
    info = await d.jetstream(admin).stream_info(f"{d.prefix}-events")
    assert info.config.max_msgs in (None, -1)  # the limits the admin step set


# -- what tenants see of each other ----------------------------------------------------------------


async def test_srv_stats_and_info_carry_no_other_callers_ids(d):
    bob, alice = await d.client("bob"), await d.client("alice")
    secret = f"bobsecret{time.monotonic_ns()}"
    await refused(bob.request("resource.get-node-resource-info", {"nodename": secret}), "node_not_found")
    await refused(bob.request("broker.get-resource", {"user": "bob", "resource_id": secret}), "resource_not_found")
    for verb in ("STATS", "INFO"):
        for service in ("allocation", "broker"):
            replies = await alice.nc.request(f"$SRV.{verb}.{d.prefix}-{service}", b"", timeout=5)
            assert b"node_not_found" in replies.data or b"resource_not_found" in replies.data or verb == "INFO"
            assert secret.encode() not in replies.data


async def test_a_workload_id_is_unique_across_the_platform(d):
    admin, alice, bob = await d.client("admin"), await d.client("alice"), await d.client("bob")
    n1, n2 = f"u1-{time.monotonic_ns()}", f"u2-{time.monotonic_ns()}"
    for node in (n1, n2):
        await admin.request("resource.add-node", {"nodename": node, "resource": NODE_4})
    wid = f"wid-{time.monotonic_ns()}"
    await alice.request("resource.allocate", {"nodename": n1, "deploy_count": 1, "workload_ids": [wid],
                                              "workload_resource_request": ONE_CPU})
    error = await refused(bob.request("resource.allocate", {"nodename": n2, "deploy_count": 1, "workload_ids": [wid],
                                                            "workload_resource_request": ONE_CPU}),
                          "workload_exists")
    assert error.details["workload_id"] == wid
    held = await admin.request("resource.get-allocations", {"nodename": n2})
    assert held["allocations"] == []
    released = await alice.request("resource.release", {"workload_ids": [wid]})
    assert released["released"] == [wid]


async def test_the_brokers_identity_releases_only_what_the_services_placed(d):
    """The broker allocates and releases its own placements; a tenant's workload is not its to
    release, though its credential may send `release` (before, it acted as an admin)."""
    admin, alice = await d.client("admin"), await d.client("alice")
    node = f"b-{time.monotonic_ns()}"
    await admin.request("resource.add-node", {"nodename": node, "resource": NODE_4})
    hers = (await alice.request("resource.allocate", {"nodename": node, "deploy_count": 1,
                                                      "workload_resource_request": ONE_CPU}))["allocations"]
    broker = BusClient(await d.connect("broker", inbox_prefix=inbox_prefix(d.prefix, "broker")), prefix=d.prefix)
    own = (await broker.request("resource.allocate", {"nodename": node, "deploy_count": 1,
                                                      "workload_resource_request": ONE_CPU}))["allocations"]
    error = await refused(broker.request("resource.release", {"workload_ids": [hers[0]["workload_id"]]}))
    assert error.details["field"] == "workload_ids[0]"
    released = await broker.request("resource.release", {"workload_ids": [own[0]["workload_id"]]})
    assert released["released"] == [own[0]["workload_id"]]
    held = await admin.request("resource.get-allocations", {"nodename": node})
    assert [a["workload_id"] for a in held["allocations"]] == [hers[0]["workload_id"]]
