"""Workload owners inside the allocation service: the pure rules of who may release and who sees
what, the commit's re-check of the owners it relied on, and a release whose workload changes hands
between its read and its commit. Over the wire with real identities: tests/test_tenancy_workloads.py."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.callers import INTERNAL, Caller, Role, current_caller
from schemas.errors import BerthError
from services.allocation.manager import refuse_unowned, visible
from services.allocation.records import Change, Ledger, LedgerConflict

GiB = 1 << 30
ONE_CORE = {"cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": GiB}}
ALICE, BOB = Caller("alice", Role.TENANT), Caller("bob", Role.TENANT)

callers = st.sampled_from([ALICE, BOB, Caller("watcher", Role.READER), Caller("admin", Role.ADMIN), INTERNAL])
owners = st.sampled_from([None, "alice", "bob", "carol"])
ids = st.sampled_from([f"w{i}" for i in range(8)])


def may_release(caller: Caller, owner: str | None) -> bool:
    """The rule, spelled out: an admin identity releases anything; a tenant its own; the services'
    own account (the broker) only what the services placed (no owner); a reader nothing."""
    if caller.role == Role.ADMIN:
        return caller.name is not None or owner is None
    return caller.role == Role.TENANT and owner == caller.name


@given(callers, st.dictionaries(ids, owners), st.lists(ids, max_size=10))
def test_a_release_is_refused_at_the_first_held_id_the_caller_does_not_own(caller, held, named):
    """`held`: the ids some node holds, with their owners; the others are unknown and skipped."""
    foreign = [i for i, wid in enumerate(named) if wid in held and not may_release(caller, held[wid])]
    try:
        refuse_unowned(caller, named, held)
    except BerthError as error:
        assert foreign, error
        assert (error.code, error.field) == ("permission_denied", f"workload_ids[{foreign[0]}]")
        assert error.details["workload_id"] == named[foreign[0]]
        assert not any(name in error.message for name in ("alice", "bob", "carol") if name != caller.name)
        return
    assert not foreign
    if caller.role == Role.TENANT:  # what goes is the tenant's own, whatever the list named
        assert all(held[wid] == caller.name for wid in named if wid in held)
    if caller.holds_everything:  # the release then reads no owner at all
        assert all(may_release(caller, owner) for owner in held.values())


@given(callers, st.dictionaries(ids, owners))
def test_a_tenant_sees_its_own_workloads_and_others_see_all(caller, held):
    ledger = Ledger({wid: {"cpumem": {}} for wid in held}, {w: owner for w, owner in held.items() if owner})
    seen = visible(caller, ledger)
    if caller.role == Role.TENANT:
        assert set(seen) == {wid for wid, owner in held.items() if owner == caller.name}
    else:
        assert seen == ledger.resources


# -- against Redis ------------------------------------------------------------------------------------


@pytest.fixture
async def manager(serve_allocation, client):
    manager = await serve_allocation()
    node = {"nodename": "o1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}}
    await client.request("resource.add-node", node)
    return manager


async def as_caller(caller: Caller, call, *args):
    """`call(*args)` in a task of its own that serves `caller`, as the runtime serves a request."""
    context = contextvars.copy_context()
    context.run(current_caller.set, caller)
    return await asyncio.create_task(call(*args), context=context)


async def place(manager, caller: Caller, ids: list[str]) -> None:
    """Deploy `ids` on o1 for `caller`, as its allocate would."""
    requests = {name: ONE_CORE.get(name) for name in manager.plugins}
    await as_caller(caller, manager.deploys.deploy, "o1", ids, requests)


async def owners_of(manager, node: str = "o1") -> dict[str, str]:
    _, ledger = await manager.store.load_with_ledger(node)
    return {wid: ledger.owner(wid) for wid in ledger.resources}


async def test_a_commit_refuses_an_entry_whose_owner_is_not_the_one_it_was_computed_for(manager):
    await place(manager, ALICE, ["w1"])
    store = manager.store
    for wrong in ({}, {"w1": "bob"}):
        for change in (Change(ledger_remove=["w1"], owners=wrong),
                       Change(ledger_replace={"w1": {}}, owners=wrong)):
            record = await store.load("o1")
            with pytest.raises(LedgerConflict) as refused:
                await store.commit("o1", record.version, change, record.tag)
            assert (refused.value.reason, refused.value.subject) == ("owner_changed", "w1")
    assert await owners_of(manager) == {"w1": "alice"}
    assert await manager.give_back(["w1"], "alice") == ["w1"]
    assert await store.redis.exists(store.owners_key("o1")) == 0  # the owner went with the entry


async def test_a_workload_that_changes_hands_before_the_release_commits_is_left_to_its_new_owner(
    manager, monkeypatch
):
    """Alice's release reads w1 as hers; before its commit w1 is released and bob places it again.
    The commit is refused (the node moved on), the release computes again and leaves bob's w1."""
    await place(manager, ALICE, ["w1"])
    store, commit = manager.store, manager.store.commit
    swapped = []

    async def swap_first(node, version, change, tag=""):
        if change.ledger_remove and not swapped:
            swapped.append(node)
            await manager.give_back(["w1"], "alice")
            await place(manager, BOB, ["w1"])
        return await commit(node, version, change, tag)

    monkeypatch.setattr(store, "commit", swap_first)
    assert await as_caller(ALICE, manager.release, ["w1"]) == [] and swapped
    assert await owners_of(manager) == {"w1": "bob"}
    assert await store.locate(["w1"]) == {"w1": "o1"}  # still indexed: bob can release it
    assert await as_caller(BOB, manager.release, ["w1"]) == ["w1"]


async def test_a_release_leaves_the_index_entry_of_a_placement_made_while_it_ran(manager, monkeypatch):
    """Alice releases w2, which nobody holds when she looks it up; bob places w2 before her
    release ends. His entry in the workload index stays, or his own release would not find w2."""
    store, located = manager.store, manager.store.located

    async def then_bob_places(ids):
        found = await located(ids)
        await place(manager, BOB, ["w2"])
        return found

    monkeypatch.setattr(store, "located", then_bob_places)
    assert await as_caller(ALICE, manager.release, ["w2"]) == []
    monkeypatch.undo()
    assert await store.locate(["w2"]) == {"w2": "o1"}
    # The same with an entry a release read and an id placed again since: only the entry read goes.
    read = (await store.located(["w2"])).entries
    assert await as_caller(BOB, manager.release, ["w2"]) == ["w2"]
    await place(manager, ALICE, ["w2"])
    await store.unindex(read)
    assert await store.locate(["w2"]) == {"w2": "o1"}
