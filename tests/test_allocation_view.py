"""The capacity view alone (no server): strategies, reservations of plans in flight, `each`, and
the preference for nodes no other worker is racing for."""

from __future__ import annotations

import random

import pytest

from schemas.errors import BerthError
from services.allocation.plugins.interface import DeployCapacity
from services.allocation.records import NodeRecord
from services.allocation.view import CapacityView, Views

# A node "n<free>-<used>": room for `free` more instances, `used` already there (usage = used / 10).


def record(name: str, version: int = 1) -> NodeRecord:
    return NodeRecord(name, version, {}, {})


def capacity_of(record: NodeRecord) -> DeployCapacity:
    free, used = (int(part) for part in record.name[1:].split("-"))
    return DeployCapacity(free, used / 10, 0.1, 1.0)


def view_of(*names: str) -> CapacityView:
    view = CapacityView(list(names), capacity_of)
    view.update(record(name) for name in names)
    return view


def test_pack_fills_the_most_used_node_first_and_spread_the_least_used_after_each():
    view = view_of("n4-3", "n4-0", "n5-0")
    assert view.plan("pack", 2)[0] == {"n4-3": 2}
    assert view.plan("spread", 2)[0] == {"n4-0": 1, "n5-0": 1}  # the second goes where usage is now lowest


def test_a_plan_reserves_its_instances_until_they_are_settled():
    view = view_of("n2-0", "n2-5")
    first, reservation = view.plan("pack", 2)
    assert first == {"n2-5": 2}
    second, _ = view.plan("pack", 1)  # the room the first plan took is not offered again
    assert second == {"n2-0": 1}
    # A refresh from the record (the commit has not landed yet) keeps the reservation.
    view.update([record("n2-5", version=2)])
    assert view.entries["n2-5"].capacity.capacity == 0
    reservation.settle("n2-5")  # refused: the room comes back
    assert view.entries["n2-5"].capacity.capacity == 2
    reservation.settle("n2-5")  # settling twice changes nothing
    assert view.entries["n2-5"].capacity.capacity == 2


def test_a_plan_that_cannot_be_completed_reserves_nothing():
    view = view_of("n1-0", "n1-1")
    with pytest.raises(BerthError) as caught:
        view.plan("spread", 3)
    assert (caught.value.code, caught.value.details) == (
        "insufficient_capacity", {"wanted": 3, "available": 2, "unit": "instances"}
    )
    assert view.pending == {}
    assert view.plan("spread", 2)[0] == {"n1-0": 1, "n1-1": 1}


def test_each_places_on_every_member_or_names_the_one_without_room():
    view = view_of("n2-0", "n3-0")
    plan, reservation = view.plan_each(2)
    assert plan == {"n2-0": 2, "n3-0": 2}
    with pytest.raises(BerthError) as caught:
        view.plan_each(1)
    assert caught.value.details["nodename"] == "n2-0"
    reservation.settle_all()
    assert view.plan_each(1)[0] == {"n2-0": 1, "n3-0": 1}


def test_pack_prefers_a_node_no_other_worker_is_racing_for_while_one_has_room():
    view = view_of("n4-3", "n4-1")
    contended = {"n4-3"}.__contains__
    assert view.plan("pack", 1, contended)[0] == {"n4-1": 1}
    assert view.plan("pack", 4, contended)[0] == {"n4-1": 3, "n4-3": 1}  # n4-1 is full: back to n4-3


def test_pack_fills_its_own_nodes_first_and_the_others_when_none_of_its_own_fits():
    view = CapacityView(["n2-0", "n2-1", "n4-3"], capacity_of, owned={"n2-0", "n2-1"}.__contains__)
    view.update(record(name) for name in view.nodes)
    assert view.plan("pack", 1)[0] == {"n2-1": 1}  # the fullest of its own, not n4-3 (fuller, not its)
    assert view.plan("pack", 4)[0] == {"n2-1": 1, "n2-0": 2, "n4-3": 1}  # its own are full: the others'


def test_spread_stays_exact_and_prefers_its_own_nodes_only_among_equally_used_ones():
    view = CapacityView(["n3-0", "n3-2", "n3-4"], capacity_of, owned={"n3-4"}.__contains__)
    view.update(record(name) for name in view.nodes)
    assert view.plan("spread", 2)[0] == {"n3-0": 2}  # the least used after each, not its own n3-4
    for owned in ("n3-0", "n4-0"):  # two empty nodes: its own first, whatever the salt says
        view = CapacityView(["n3-0", "n4-0"], capacity_of, owned={owned}.__contains__)
        view.update(record(name) for name in view.nodes)
        assert view.plan("spread", 1)[0] == {owned: 1}
        assert set(view.plan("spread", 1)[0]) == {"n3-0", "n4-0"} - {owned}  # then the emptier one


def test_only_its_own_stale_nodes_are_needed_before_planning_and_a_refused_node_always_is():
    view = CapacityView(["n2-0", "n2-1"], capacity_of, owned={"n2-0"}.__contains__)
    assert view.take_stale(owned_only=True) == ["n2-0"]
    assert view.stale == {"n2-1"}  # still stale: read when a query needs every node
    view.mark_stale("n2-1", urgent=True)  # a commit to it was refused
    assert view.take_stale(owned_only=True) == ["n2-1"] and not view.stale


def test_views_keep_only_the_newest_records():
    views = Views(records_kept=2)
    views.remember([record("n1-0"), record("n2-0"), record("n3-0")])
    views.remember([record("n2-0", version=2)])  # remembered again: the newest now
    views.remember([record("n4-0")])
    assert views.take_record("n1-0") is None and views.take_record("n3-0") is None
    assert views.take_record("n2-0").version == 2 and views.take_record("n4-0") is not None
    assert views.known_version("n1-0") == 1  # versions are kept for every node


def test_a_view_under_a_steady_allocate_release_loop_keeps_its_heaps_bounded():
    # Each commit re-pushes its node; under spread an item of a node that got busier sinks for good
    # and was never popped: the heap (and the worker) grew by an item per change (issue 31).
    names = [f"n{i}-0" for i in range(50)]
    busy: dict[str, int] = {name: 0 for name in names}

    def capacity(record: NodeRecord) -> DeployCapacity:
        return DeployCapacity(100 - busy[record.name], busy[record.name] / 100, 0.01, 1.0)

    view = CapacityView(list(names), capacity)
    view.update(record(name) for name in names)
    for step in range(5_000):
        plan, reservation = view.plan("spread", 1)
        [node] = plan
        busy[node] += 1
        view.update([record(node, version=step + 2)])
        reservation.settle_all()
        busy[node] -= 1  # released again
        view.update([record(node, version=step + 3)])
    for heap in view._heaps.values():
        assert len(heap) <= 2 * len(view.entries) + 64


# -- sampled spread (DESIGN.md §8) ---------------------------------------------------------------


def equal_nodes(count: int, room: int) -> tuple[CapacityView, dict[str, int]]:
    """`count` equal empty nodes of room for `room` instances; `placed` counts what each holds."""
    placed = {f"e{i}": 0 for i in range(count)}

    def capacity(record: NodeRecord) -> DeployCapacity:
        return DeployCapacity(room - placed[record.name], placed[record.name] / room, 1 / room, 1.0)

    view = CapacityView(list(placed), capacity)
    view.update(record(name) for name in placed)
    return view, placed


def sampled_placement(view: CapacityView, rng: random.Random, size: int) -> str | None:
    """One instance by sampled spread as `Fleet.plan_sampled` makes it (no node is stale here)."""
    return view.place_one_of(view.draw(rng, size, set()))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_spread_keeps_equal_nodes_within_two_instances_after_every_placement(seed):
    view, placed = equal_nodes(500, room=8)
    rng = random.Random(seed)
    for step in range(3_000):
        node = sampled_placement(view, rng, 16)
        placed[node] += 1
        view.update([record(node, version=step + 2)])  # the commit, as the worker learns of it
        view.pending.clear()
        loads = placed.values()
        assert max(loads) - min(loads) <= 2, (step, max(loads), min(loads))


def test_a_draw_is_uniform_over_the_nodes_with_room_and_never_repeats_a_node():
    view, placed = equal_nodes(40, room=1)
    for name in ("e0", "e1", "e2"):  # full: never drawn
        placed[name] = 1
        view.update([record(name, version=2)])
    rng, counts = random.Random(7), {name: 0 for name in placed}
    for _ in range(2_000):
        drawn = view.draw(rng, 8, set())
        assert len(drawn) == len(set(drawn)) == 8
        for name in drawn:
            counts[name] += 1
    assert counts["e0"] == counts["e1"] == counts["e2"] == 0
    expected = 2_000 * 8 / 37
    assert all(0.8 * expected < counts[name] < 1.2 * expected for name in placed if name not in ("e0", "e1", "e2"))


def test_draws_replace_nodes_already_drawn_until_every_node_with_room_was_offered():
    view, placed = equal_nodes(30, room=1)
    for index in range(28):  # two nodes keep room
        placed[f"e{index}"] = 1
        view.update([record(f"e{index}", version=2)])
    drawn: set[str] = set()
    assert sorted(view.draw(random.Random(1), 16, drawn)) == ["e28", "e29"]
    assert view.draw(random.Random(1), 16, drawn) == []  # nothing left to offer
    assert sampled_placement(view, random.Random(1), 16) in ("e28", "e29")


# -- sampled spread's estimate of nodes other workers changed ---------------------------------------


def test_instances_another_worker_placed_or_released_are_estimated_not_read():
    """Another worker placed 2 instances on a node at its next version, then released them: the view
    counts them as instances of its own request (usage and room move), keeps the node stale for
    the strategies that read, and a draw need not read it; the plan's version is the estimate's."""
    view = view_of("n5-0", "n5-1")
    view.take_stale(owned_only=False)  # both read
    view.learn("n5-0", 2, 2)
    assert view.entries["n5-0"].capacity == DeployCapacity(3, 0.2, 0.1, 1.0)
    view.learn("n5-0", 3, -2)
    assert view.entries["n5-0"].capacity == DeployCapacity(5, 0.0, 0.1, 1.0)
    assert "n5-0" in view.stale and view.take_unestimated_of(["n5-0", "n5-1"]) == []
    assert view.version_of("n5-0") == 3
    plan, reservation = view.plan("spread", 1)
    assert plan == {"n5-0": 1} and reservation.versions == {"n5-0": 3}


def test_a_change_the_view_cannot_count_or_a_missed_version_is_read_again():
    nodes = ("n5-0", "n6-0", "n7-0")
    view = view_of(*nodes)
    view.take_stale(owned_only=False)
    view.learn("n5-0", 2, None)  # a change of capacity, labels, a realloc: no count of instances
    view.learn("n6-0", 3, 1)  # version 2 was not seen: the count would miss its change
    view.learn("n7-0", 2, 1)
    view.learn("n7-0", 3, None)  # an estimate that a later change spoils is dropped
    for node in nodes:
        assert view.entries[node].capacity == view.entries[node].base
        assert view.version_of(node) == 1
    assert view.take_unestimated_of(nodes) == list(nodes)


def test_reading_an_estimated_node_replaces_the_estimate():
    view = view_of("n5-0")
    view.learn("n5-0", 2, 3)
    view.update([NodeRecord("n5-0", 2, {}, {})])
    assert view.entries["n5-0"].capacity == DeployCapacity(5, 0.0, 0.1, 1.0)  # the record's, nothing added
    assert view.version_of("n5-0") == 2 and not view.estimated and not view.foreign
