"""Properties of the cpumem plugin's calculations, over random nodes and requests (Hypothesis)."""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bus.errors import BerthError
from services.allocation.cpumem import CpuMemPlugin
from services.allocation.cpumem.plans import PlanRequest, count_core_plans, count_full_plans, plan_cores

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_DEPLOY = 500


@st.composite
def plugins(draw) -> CpuMemPlugin:
    return CpuMemPlugin(
        share_base=draw(st.sampled_from([100, 10])),
        max_share=draw(st.sampled_from([-1, -1, 0, 1, 2, 5])),
        max_deploy_count=MAX_DEPLOY,
    )


@st.composite
def nodes(draw, share_base: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A valid (capacity, usage): oversold and odd-sized cores, partly used, maybe NUMA."""
    core_ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=10, unique=True))
    cpu_map, used = {}, {}
    for core in core_ids:
        pieces = draw(
            st.one_of(st.integers(1, 3).map(lambda n: n * share_base), st.integers(0, 4 * share_base))
        )
        cpu_map[str(core)] = pieces
        used[str(core)] = draw(st.sampled_from([0, 0, pieces, draw(st.integers(0, pieces))]))
    memory = draw(st.integers(0, 64))
    capacity = {
        "cpu": float(len(cpu_map)),
        "cpu_map": cpu_map,
        "memory": memory,
        "numa_memory": {},
        "numa": {},
    }
    usage = {
        "cpu": draw(st.integers(0, 800)) / 100,
        "cpu_map": used,
        "memory": draw(st.integers(0, memory)),
        "numa_memory": {},
        "numa": {},
    }
    numa_nodes = draw(st.integers(0, 3))
    if numa_nodes:
        capacity["numa"] = {core: str(draw(st.integers(0, numa_nodes - 1))) for core in cpu_map}
        for node in sorted(set(capacity["numa"].values())):
            capacity["numa_memory"][node] = draw(st.integers(0, 32))
            usage["numa_memory"][node] = draw(st.integers(0, capacity["numa_memory"][node]))
        usage["numa"] = dict(capacity["numa"])
    return capacity, usage


@st.composite
def requests(draw) -> dict[str, Any]:
    request: dict[str, Any] = {"cpu-bind": draw(st.booleans())}
    request["cpu-request"] = draw(st.integers(1 if request["cpu-bind"] else 0, 400)) / 100
    if draw(st.booleans()):
        request["cpu-limit"] = draw(st.integers(0, 400)) / 100
    request["memory-request"] = draw(st.sampled_from([0, 1, 2, 5, draw(st.integers(0, 20))]))
    return request


@st.composite
def scenarios(draw):
    plugin = draw(plugins())
    capacity, usage = draw(nodes(plugin.share_base))
    plugin.validate_record(capacity, usage)
    return plugin, capacity, usage, draw(requests())


def placeable(plugin: CpuMemPlugin, capacity: dict, usage: dict, request: dict) -> int | None:
    """deploy_capacity's answer when deploying that many instances is practical to try."""
    capacity_count = plugin.deploy_capacity(capacity, usage, request).capacity
    return None if capacity_count >= MAX_DEPLOY else capacity_count


@SETTINGS
@given(scenarios())
def test_one_calculation_never_over_allocates(scenario):
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    if count is None:
        count = MAX_DEPLOY  # an unbound request without memory: any number fits
    _, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    after = plugin.apply_workloads(usage, workloads, True)
    plugin.validate_record(capacity, after)  # no core or NUMA node beyond its capacity
    if request["memory-request"]:
        assert after["memory"] <= max(capacity["memory"], usage["memory"])
    for workload in workloads:
        assert all(pieces > 0 for pieces in workload["cpu_map"].values())
        if workload["cpu_map"]:
            pieces = int(workload["cpu_request"] * plugin.share_base)
            assert sum(workload["cpu_map"].values()) == pieces


@SETTINGS
@given(scenarios())
def test_deploy_then_release_restores_usage_exactly(scenario):
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    count = MAX_DEPLOY if count is None else min(count, 50)
    _, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    after = plugin.apply_workloads(usage, workloads, True)
    assert plugin.apply_workloads(after, list(reversed(workloads)), False) == usage


@SETTINGS
@given(scenarios())
def test_deploy_capacity_is_exactly_what_deploy_can_place(scenario):
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    if count is None:
        return
    engines, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    assert len(engines) == len(workloads) == count
    with pytest.raises(BerthError) as caught:
        plugin.calculate_deploy(capacity, usage, count + 1, request)
    assert caught.value.code == "insufficient_capacity"


@SETTINGS
@given(scenarios(), st.data())
def test_realloc_delta_commits_like_release_then_take(scenario, data):
    plugin, capacity, usage, request = scenario
    if not placeable(plugin, capacity, usage, request):
        return
    _, (current,) = plugin.calculate_deploy(capacity, usage, 1, request)
    usage = plugin.apply_workloads(usage, [current], True)
    delta_request = {
        "keep-cpu-bind": data.draw(st.booleans()),
        "cpu-bind": data.draw(st.booleans()),
        "cpu-request": data.draw(st.integers(-200, 200)) / 100,
        "memory-request": data.draw(st.integers(-5, 5)),
    }
    try:
        _, delta, new = plugin.calculate_realloc(capacity, usage, current, delta_request)
    except BerthError as error:
        assert error.code in {
            "insufficient_capacity",
            "insufficient_resource",
            "invalid_cpu",
            "invalid_memory",
        }
        return
    committed = plugin.apply_workloads(usage, [delta], True)
    assert committed == plugin.apply_workloads(plugin.apply_workloads(usage, [current], False), [new], True)
    plugin.validate_record(capacity, committed)


@SETTINGS
@given(scenarios(), st.data())
def test_capacity_change_rolls_back_exactly(scenario, data):
    plugin, capacity, usage, _ = scenario
    try:  # normalise the record: a 0-piece core disappears, which may leave memory without cores
        capacity, usage = plugin.set_capacity(capacity, usage, capacity, None, False, True)
    except BerthError:
        assume(False)
    delta = data.draw(st.booleans())
    cores = data.draw(st.lists(st.integers(0, 45), min_size=1, max_size=4, unique=True))
    request = {"cpu": ",".join(f"{core}:{data.draw(st.integers(1, 300))}" for core in cores)}
    try:
        after = plugin.set_capacity(capacity, usage, None, request, delta, data.draw(st.booleans()))
    except BerthError:
        return  # e.g. a core removed while in use, or a new core outside the NUMA topology
    assert plugin.set_capacity(*after, capacity, None, False, False) == (capacity, usage)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=12), st.integers(1, 5))
def test_full_plan_count_formula_matches_the_heap(units, full):
    """count_full_plans is the number of rounds of taking the `full` cores with the most units."""
    heap = [-unit for unit in units]
    heapq.heapify(heap)
    rounds = 0
    while len(heap) >= full:
        picked = [heapq.heappop(heap) + 1 for _ in range(full)]
        rounds += 1
        for left in picked:
            if left < 0:
                heapq.heappush(heap, left)
    assert count_full_plans(sorted(units), full) == rounds


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.integers(0, 30), st.integers(0, 500), min_size=1, max_size=10),
    st.integers(1, 500),
    st.sampled_from([-1, 0, 1, 3]),
)
def test_counting_plans_matches_building_them(free, pieces, max_share):
    request = PlanRequest(pieces // 100, pieces % 100, 0, 100, max_share)
    cores = [(left, core) for core, left in free.items()]
    plans = plan_cores(cores, request)
    assert count_core_plans(cores, request) == len(plans)
    for plan in plans:
        assert sum(piece for _, piece in plan) == pieces and len({core for core, _ in plan}) == len(plan)
    for core, left in free.items():
        assert sum(piece for plan in plans for taken, piece in plan if taken == core) <= max(left, 0)
