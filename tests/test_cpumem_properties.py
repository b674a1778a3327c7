"""Properties of the cpumem plugin's calculations, over random nodes and requests (Hypothesis).

The strategies are shaped so that most examples reach the arithmetic: nodes are mostly partly used
(a full core, no free memory now and then), requests mostly ask for memory (an unbound request
without it fits any number of times) and for less than a node has, realloc deltas mostly stay
within what the workload holds, and capacity changes mostly name existing cores. Each test labels
its examples with `event()` ("arithmetic", "edge: ...", "refused: ...") and rejects those with
nothing to check with `assume()`: `pytest --hypothesis-show-statistics` shows the shares.
"""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from schemas.errors import BerthError
from services.allocation.plugins.cpumem import CpuMemPlugin
from services.allocation.plugins.cpumem.plans import PlanRequest, count_core_plans, count_full_plans, plan_cores

# Fewer examples than before the strategies were shaped, yet more of them reach the arithmetic.
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_DEPLOY = 500


@st.composite
def plugins(draw) -> CpuMemPlugin:
    return CpuMemPlugin(
        share_base=draw(st.sampled_from([100, 10])),
        max_share=draw(st.sampled_from([-1, -1, 0, 1, 2, 5])),
        max_deploy_count=MAX_DEPLOY,
    )


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`common` three times in four, `rare` otherwise (`one_of` would pick each half the time)."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda usual: common if usual else rare)


@st.composite
def nodes(draw, share_base: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A valid (capacity, usage): oversold and odd-sized cores, mostly partly used, maybe NUMA."""
    core_ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=10, unique=True))
    cpu_map, used = {}, {}
    for core in core_ids:
        pieces = draw(
            st.one_of(st.integers(1, 3).map(lambda n: n * share_base), st.integers(0, 4 * share_base))
        )
        cpu_map[str(core)] = pieces
        # mostly a free core or a fragment used (a bound request needs whole free cores)
        used[str(core)] = draw(mostly(st.sampled_from([0, 0, pieces // 2]), st.integers(0, pieces)))
    memory = draw(mostly(st.integers(16, 64), st.integers(0, 64)))
    capacity = {
        "cpu": float(len(cpu_map)),
        "cpu_map": cpu_map,
        "memory": memory,
        "numa_memory": {},
        "numa": {},
    }
    usage = {
        "cpu": draw(mostly(st.integers(0, 25 * len(cpu_map)), st.integers(0, 800))) / 100,
        "cpu_map": used,
        "memory": draw(mostly(st.integers(0, memory // 4), st.integers(0, memory))),
        "numa_memory": {},
        "numa": {},
    }
    numa_nodes = draw(mostly(st.integers(0, 2), st.integers(0, 3)))
    if numa_nodes:
        capacity["numa"] = {core: str(draw(st.integers(0, numa_nodes - 1))) for core in cpu_map}
        for node in sorted(set(capacity["numa"].values())):
            numa_memory = draw(mostly(st.integers(16, 32), st.integers(0, 32)))
            capacity["numa_memory"][node] = numa_memory
            used_memory = mostly(st.integers(0, numa_memory // 4), st.integers(0, numa_memory))
            usage["numa_memory"][node] = draw(used_memory)
        usage["numa"] = dict(capacity["numa"])
    return capacity, usage


@st.composite
def requests(draw) -> dict[str, Any]:
    request: dict[str, Any] = {"cpu-bind": draw(st.booleans())}
    cpu = mostly(st.integers(1, 100), st.integers(1, 400))
    request["cpu-request"] = draw(cpu if request["cpu-bind"] else st.one_of(st.just(0), cpu)) / 100
    if draw(st.booleans()):
        request["cpu-limit"] = draw(st.integers(0, 400)) / 100
    request["memory-request"] = draw(mostly(st.integers(1, 4), st.integers(0, 20)))
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
    event("arithmetic" if workloads else "edge: nothing fits")
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
def test_engine_params_follow_from_the_workload_resource(scenario):
    # an allocate's answer is rebuilt from the ledger on a retry: the params must be the deploy's own
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    count = MAX_DEPLOY if count is None else min(count, 20)
    params, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    event("arithmetic" if workloads else "edge: nothing fits")
    assert [plugin.engine_params(workload) for workload in workloads] == params


@SETTINGS
@given(scenarios())
def test_deploy_then_release_restores_usage_exactly(scenario):
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    count = MAX_DEPLOY if count is None else min(count, 50)
    _, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    event("arithmetic" if workloads else "edge: nothing fits")
    after = plugin.apply_workloads(usage, workloads, True)
    assert plugin.apply_workloads(after, list(reversed(workloads)), False) == usage


@SETTINGS
@given(scenarios())
def test_deploy_capacity_is_exactly_what_deploy_can_place(scenario):
    plugin, capacity, usage, request = scenario
    count = placeable(plugin, capacity, usage, request)
    assume(count is not None)  # an unbound request without memory: no limit to check
    event("arithmetic" if count else "edge: nothing fits")
    engines, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    assert len(engines) == len(workloads) == count
    with pytest.raises(BerthError) as caught:
        plugin.calculate_deploy(capacity, usage, count + 1, request)
    assert caught.value.code == "insufficient_capacity"


@SETTINGS
@given(scenarios(), st.data())
def test_realloc_delta_commits_like_release_then_take(scenario, data):
    plugin, capacity, usage, request = scenario
    assume(placeable(plugin, capacity, usage, request) != 0)  # a workload to realloc
    _, (current,) = plugin.calculate_deploy(capacity, usage, 1, request)
    usage = plugin.apply_workloads(usage, [current], True)
    # Deltas mostly within what the workload holds (a negative total is refused, now and then).
    held_cpu, held_memory = round(current["cpu_request"] * 100), current["memory_request"]
    within = st.fixed_dictionaries({
        "cpu-request": st.integers(-held_cpu, 50).map(lambda n: n / 100),
        "memory-request": st.integers(-held_memory, 2),
    })
    anything = st.fixed_dictionaries({
        "cpu-request": st.integers(-200, 200).map(lambda n: n / 100), "memory-request": st.integers(-5, 5),
    })
    delta_request = {
        "keep-cpu-bind": data.draw(st.booleans()),
        "cpu-bind": data.draw(st.booleans()),
        **data.draw(mostly(within, anything)),
    }
    try:
        _, delta, new = plugin.calculate_realloc(capacity, usage, current, delta_request)
    except BerthError as error:
        event(f"refused: {error.code}")
        assert error.code in {
            "insufficient_capacity",
            "insufficient_resource",
            "invalid_cpu",
            "invalid_memory",
        }
        return
    event("arithmetic")
    committed = plugin.apply_workloads(usage, [delta], True)
    assert committed == plugin.apply_workloads(plugin.apply_workloads(usage, [current], False), [new], True)
    plugin.validate_record(capacity, committed)


def cpu_text(pieces: dict[str, int]) -> str:
    return ",".join(f"{core}:{amount}" for core, amount in pieces.items())


@st.composite
def fitting_change(draw, capacity: dict, usage: dict, delta: bool, incr: bool) -> str:
    """A capacity change the record can take: an absolute map keeps every used core, at least as
    large as its use; a decrement takes at most what a core has free; new cores only without NUMA
    (a new core would have no NUMA node)."""
    sizes, used = capacity["cpu_map"], usage["cpu_map"]
    existing = sorted(sizes, key=int)
    new_cores = st.integers(41, 60).map(str)  # the nodes' cores are 0 to 40
    cores = st.sampled_from(existing) if capacity["numa"] else mostly(st.sampled_from(existing), new_cores)
    if not delta:  # the listed cores are the new map: every used one must stay
        chosen = [core for core in existing if used.get(core, 0)]
        chosen += [core for core in draw(st.lists(cores, max_size=3, unique=True)) if core not in chosen]
        if not chosen:
            chosen = [draw(cores)]
        at_least = {core: max(1, used.get(core, 0)) for core in chosen}
        return cpu_text({core: draw(st.integers(least, least + 300)) for core, least in at_least.items()})
    if incr:
        chosen = draw(st.lists(cores, min_size=1, max_size=4, unique=True))
        return cpu_text({core: draw(st.integers(1, 300)) for core in chosen})
    free = [core for core in existing if sizes[core] - used.get(core, 0) > 0]
    if not free:
        return cpu_text({existing[0]: 1})  # nothing to take from: refused, an edge
    chosen = draw(st.lists(st.sampled_from(free), min_size=1, max_size=4, unique=True))
    return cpu_text({core: draw(st.integers(1, sizes[core] - used.get(core, 0))) for core in chosen})


def any_change() -> st.SearchStrategy[str]:
    """Any cores and amounts: mostly refused (a core removed while in use, taken below zero...)."""
    cores = st.lists(st.integers(0, 45).map(str), min_size=1, max_size=4, unique=True)
    amounts = st.integers(1, 300)
    return cores.flatmap(lambda cs: st.tuples(*[amounts] * len(cs)).map(lambda ps: cpu_text(dict(zip(cs, ps)))))


@SETTINGS
@given(scenarios(), st.data())
def test_capacity_change_rolls_back_exactly(scenario, data):
    plugin, capacity, usage, _ = scenario
    try:  # normalise the record: a 0-piece core disappears, which may leave memory without cores
        capacity, usage = plugin.set_capacity(capacity, usage, capacity, None, False, True)
    except BerthError:
        assume(False)
    delta, incr = data.draw(st.booleans()), data.draw(st.booleans())
    request = {"cpu": data.draw(mostly(fitting_change(capacity, usage, delta, incr), any_change()))}
    try:
        after = plugin.set_capacity(capacity, usage, None, request, delta, incr)
    except BerthError as error:
        event(f"refused: {error.code}")
        return  # e.g. a core removed while in use, or a new core outside the NUMA topology
    event("arithmetic")
    assert plugin.set_capacity(*after, capacity, None, False, False) == (capacity, usage)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=12), st.integers(1, 5))
def test_full_plan_count_formula_matches_the_heap(units, full):
    """count_full_plans is the number of rounds of taking the `full` cores with the most units."""
    event("arithmetic" if len(units) >= full else "edge: fewer cores than a plan takes")
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


@st.composite
def free_cores_and_pieces(draw) -> tuple[dict[int, int], int]:
    """Free pieces per core (mostly whole cores or a fragment, any amount now and then), and a
    request that mostly asks for no more whole cores than there are (any size now and then)."""
    left = st.one_of(st.integers(1, 3).map(lambda n: n * 100), st.integers(1, 99), st.integers(0, 500))
    free = draw(st.dictionaries(st.integers(0, 30), left, min_size=1, max_size=10))
    whole = sum(left // 100 for left in free.values() if left and left % 100 == 0)
    full, fragment = st.integers(0, min(whole, 3)), st.integers(0, 99)
    fitting = st.tuples(full, fragment).map(lambda parts: max(1, 100 * parts[0] + parts[1]))
    return free, draw(mostly(fitting, st.integers(1, 500)))


@settings(max_examples=120, deadline=None)
@given(free_cores_and_pieces(), st.sampled_from([-1, 0, 1, 3]))
def test_counting_plans_matches_building_them(free_and_pieces, max_share):
    free, pieces = free_and_pieces
    request = PlanRequest(pieces // 100, pieces % 100, 0, 100, max_share)
    cores = [(left, core) for core, left in free.items()]
    plans = plan_cores(cores, request)
    event("arithmetic" if plans else "edge: no plan")
    assert count_core_plans(cores, request) == len(plans)
    for plan in plans:
        assert sum(piece for _, piece in plan) == pieces and len({core for core, _ in plan}) == len(plan)
    for core, left in free.items():
        assert sum(piece for plan in plans for taken, piece in plan if taken == core) <= max(left, 0)
