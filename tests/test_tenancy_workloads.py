"""Workloads belong to the tenant that placed them (issue 17, item 2), over the wire with berth's
accounts: two tenants, a reader and the admin, each its own NATS identity. A tenant releases and
reallocs only its own workloads and lists only its own; a reader lists everyone's; the admin acts on
anyone's. Ownership lasts as long as the placement: through the node's repairs, a worker killed
between its commit and its answer, and tenants placing and releasing on the same nodes at once."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest
import pytest_asyncio

from bus.callers import Role
from schemas.errors import BusError
from tests.accounts_helpers import IDENTITIES, Deployment, refused
from tests.allocation_helpers import check_invariants

NODE_8 = {"cpumem": {"cpu": 8, "memory": "16G"}}
ONE_CPU = {"cpumem": {"cpu-request": 1}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("owners"), IDENTITIES)
    try:
        d.start_worker("allocation")
        yield d
    finally:
        d.stop()


@pytest_asyncio.fixture
async def who(deployment):
    """A client per identity, the admin's included."""
    yield {name: await deployment.client(name) for name in (*IDENTITIES, "admin")}
    await deployment.close_connections()


@pytest_asyncio.fixture
async def node(who):
    """A node added by the admin, for this test alone."""
    name = f"n{time.monotonic_ns()}"
    await who["admin"].request("resource.add-node", {"nodename": name, "resource": NODE_8})
    return name


async def place(client, node: str, count: int = 1, **extra) -> list[str]:
    placed = await client.request("resource.allocate", {
        "nodename": node, "deploy_count": count, "workload_resource_request": ONE_CPU, **extra})
    return [a["workload_id"] for a in placed["allocations"]]


async def release(client, ids: list[str], **extra) -> list[str]:
    return (await client.request("resource.release", {"workload_ids": ids, **extra}))["released"]


async def listed(client, node: str) -> set[str]:
    """The workloads get-allocations shows this caller."""
    reply = await client.request("resource.get-allocations", {"nodename": node})
    return {a["workload_id"] for a in reply["allocations"]}


async def state(admin, node: str) -> tuple[dict, list]:
    """The node's usage and its whole ledger, as the admin reads them (usage is what the ledger explains)."""
    info = await admin.request("resource.get-node-resource-info", {"nodename": node})
    assert info["diffs"] == []
    return info["usage"], (await admin.request("resource.get-allocations", {"nodename": node}))["allocations"]


async def test_a_tenant_releases_only_its_own_workloads_and_the_admin_anyone_s(who, node):
    alice, bob, admin = who["alice"], who["bob"], who["admin"]
    theirs, own = await place(alice, node, 2), await place(bob, node)
    before = await state(admin, node)
    for n, ids in enumerate((theirs[:1], [*own, theirs[0]], ["never-placed", *own, theirs[1]])):
        error = await refused(release(bob, ids, request_id=f"take-{n}"))
        at = len(ids) - 1
        assert error.http_status == 403
        assert error.details["field"] == f"workload_ids[{at}]" and error.details["workload_id"] == ids[at]
        assert "alice" not in error.message  # whose it is stays unsaid
    assert await state(admin, node) == before  # the whole request refused: bob's own one stayed too
    assert await release(alice, theirs[:1]) == theirs[:1]
    assert await release(admin, [theirs[1], *own]) == sorted([theirs[1], *own])
    usage, ledger = await state(admin, node)
    assert ledger == [] and usage["cpumem"]["cpu"] == 0
    assert await release(bob, ["never-placed"]) == []  # an unknown id is skipped, as ever


async def test_a_tenant_cannot_realloc_another_s_workload(who, node):
    alice, bob = who["alice"], who["bob"]
    [wid] = await place(alice, node)
    before = await state(who["admin"], node)
    grow = {"workload_id": wid, "workload_resource_request": ONE_CPU}
    error = await refused(bob.request("resource.realloc", grow))
    assert error.details["field"] == "workload_id" and "alice" not in error.message
    assert await state(who["admin"], node) == before
    grown = await alice.request("resource.realloc", grow)
    assert grown["delta_resource"]["cpumem"]["cpu_request"] == 1


async def test_a_tenant_lists_its_own_workloads_and_a_reader_everyone_s(who, node):
    alice_ids, bob_ids = set(await place(who["alice"], node, 2)), set(await place(who["bob"], node))
    assert await listed(who["alice"], node) == alice_ids
    assert await listed(who["bob"], node) == bob_ids
    assert await listed(who["watcher"], node) == await listed(who["admin"], node) == alice_ids | bob_ids
    error = await refused(release(who["watcher"], sorted(alice_ids)))  # reading is all a reader may do
    assert error.details["role"] == "tenant"


async def test_an_id_placed_again_by_another_tenant_is_the_new_owner_s(who, node):
    alice, bob = who["alice"], who["bob"]
    wid = f"shared-{node}"
    await place(alice, node, workload_ids=[wid])
    assert await release(alice, [wid]) == [wid]
    await place(bob, node, workload_ids=[wid])
    await refused(release(alice, [wid]))
    assert (await listed(alice, node), await listed(bob, node)) == (set(), {wid})


async def test_a_workload_without_an_owner_is_the_services_own(deployment, who, node):
    """Data written before owners were kept has none: only an admin (or a service) acts on it."""
    [wid] = await place(who["alice"], node)
    deployment.redis_admin().delete(f"{deployment.prefix}:allocation:{{node:{node}}}:owners")
    await refused(release(who["alice"], [wid]))
    assert await listed(who["alice"], node) == set() and await listed(who["watcher"], node) == {wid}
    assert await release(who["admin"], [wid]) == [wid]


async def test_ownership_survives_the_node_s_repairs_and_a_realloc(who, node):
    alice, bob, admin = who["alice"], who["bob"], who["admin"]
    ids = await place(alice, node, 2)
    await alice.request("resource.realloc", {"workload_id": ids[0], "workload_resource_request": ONE_CPU})
    drift = {"nodename": node, "resource_request": {"memory": "1G"}, "delta": True}
    await admin.request("resource.cpumem.set-node-resource-usage", drift)
    assert (await admin.request("resource.fix-node-resource", {"nodename": node}))["diffs"]
    info = await admin.request("resource.get-node-resource-info", {"nodename": node})
    await admin.request("resource.set-node-resource-info",
                        {"nodename": node, "capacity": info["capacity"], "usage": info["usage"]})
    await admin.request("resource.set-node-labels", {"nodename": node, "labels": {"repaired": "yes"}})
    for wid in ids:
        await refused(release(bob, [wid]))
    assert await listed(alice, node) == set(ids) and await listed(bob, node) == set()
    assert await release(alice, ids) == sorted(ids)


# -- faults and concurrency: deployments of their own ----------------------------------------------------


@pytest.fixture
def own_deployment(tmp_path):
    d = Deployment(tmp_path, {"alice": Role.TENANT, "bob": Role.TENANT})
    try:
        yield d
    finally:
        d.stop()


async def test_ownership_survives_a_worker_killed_between_commit_and_answer(own_deployment):
    d = own_deployment
    healthy = d.start_worker("allocation")
    admin, alice, bob = [await d.client(name) for name in ("admin", "alice", "bob")]
    await admin.request("resource.add-node", {"nodename": "k1", "resource": NODE_8})
    healthy.signal(signal.SIGTERM)
    healthy.wait()
    doomed = d.start_worker("allocation", env={"BERTH_FAILPOINTS": "after-commit"})
    payload = {"nodename": "k1", "deploy_count": 2, "workload_resource_request": ONE_CPU, "request_id": "job"}
    with pytest.raises(BusError) as unanswered:
        await alice.request("resource.allocate", payload, timeout=3)
    assert unanswered.value.code in ("timeout", "no_responders")
    assert doomed.wait() == -signal.SIGKILL  # it died at the failpoint, its placement committed

    d.start_worker("allocation")
    ids = [a["workload_id"] for a in (await alice.request("resource.allocate", payload))["allocations"]]
    usage, ledger = await state(admin, "k1")
    assert {a["workload_id"] for a in ledger} == set(ids)  # what the dead run placed went back
    assert usage["cpumem"]["cpu"] == 2
    await refused(release(bob, ids))
    grow = {"workload_id": ids[0], "workload_resource_request": ONE_CPU}
    await refused(bob.request("resource.realloc", grow))
    assert await listed(bob, "k1") == set() and await listed(alice, "k1") == set(ids)
    assert await release(alice, ids) == sorted(ids)


class Tenant:
    """What one tenant was told: the ids it holds, and what its attempts on others' came to."""

    def __init__(self, name: str, client) -> None:
        self.name = name
        self.client = client
        self.held: set[str] = set()
        self.busy: set[str] = set()  # ids one of its own requests places or names in a release now
        self.denied = 0


async def test_two_tenants_on_the_same_nodes_never_release_each_other_s(own_deployment):
    """Three workers; two tenants place and release on the same two nodes at once, from one pool of
    workload ids per node, so that an id is released by one tenant and placed again by the other
    while the first (or anyone) tries to release it. Each release names what the tenant holds, what
    the other one may hold, or both. A release is answered with exactly the tenant's own ids or
    refused whole; at the end each tenant lists exactly what it was told it holds, and usage equals
    the ledger."""
    d = own_deployment
    for _ in range(3):
        d.start_worker("allocation")
    admin = await d.client("admin")
    nodes = ["p0", "p1"]
    for name in nodes:
        await admin.request("resource.add-node", {"nodename": name, "resource": NODE_8})
    pool = {name: [f"{name}-w{i}" for i in range(6)] for name in nodes}  # an id lives on one node only
    tenants = [Tenant(name, await d.client(name, timeout=20)) for name in ("alice", "bob")]

    async def act(me: Tenant, rng: random.Random) -> None:
        node = rng.choice(nodes)
        free = [w for w in pool[node] if w not in me.held and w not in me.busy]
        mine = sorted(me.held - me.busy)
        if rng.random() < 0.4 and free:
            wid = rng.choice(free)
            me.busy.add(wid)
            try:
                await place(me.client, node, workload_ids=[wid])
                me.held.add(wid)
            except BusError as error:
                assert error.code in ("workload_exists", "insufficient_capacity"), error
            finally:
                me.busy.discard(wid)
            return
        own = rng.sample(mine, k=min(len(mine), rng.randint(0, 2)))
        others = rng.sample(free, k=min(len(free), rng.randint(0 if own else 1, 2)))
        if not own and not others:
            return
        ids = [*own, *others]
        rng.shuffle(ids)
        me.busy.update(ids)  # its other requests place none of these meanwhile (that one would be its own)
        try:
            released = await release(me.client, ids)
            assert sorted(released) == sorted(own), (me.name, ids, released)  # its own, all, and nothing else
            me.held -= set(own)
        except BusError as error:
            assert error.code == "permission_denied" and error.details["workload_id"] in others, error
            me.denied += 1
        finally:
            me.busy -= set(ids)

    async def run(me: Tenant, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            await act(me, rng)

    await asyncio.gather(*(run(me, 10 * i + j) for i, me in enumerate(tenants) for j in range(4)))
    for me in tenants:
        assert set().union(*[await listed(me.client, name) for name in nodes]) == me.held, me.name
    assert all(me.denied for me in tenants)  # each tried the other's workloads, and was refused
    assert await check_invariants(admin, nodes) == sum(len(me.held) for me in tenants)
