"""Unit tests of the cpumem plugin's pure calculation core (eru reference §2; DESIGN.md §3, §8).

Worked examples come from the reference; "upstream" cases reuse inputs and outputs recorded from
eru's own tests, adapted where berth deliberately differs.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import pytest

from schemas.errors import BerthError, InvalidArgument
from schemas.sizes import MAX_INT
from services.allocation.plugins.cpumem import CpuMemPlugin
from services.allocation.plugins.cpumem.plans import PlanRequest, count_core_plans, plan_cores
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, ResourcePlugin

GiB = 1 << 30


@pytest.fixture
def plugin() -> CpuMemPlugin:
    return CpuMemPlugin()


def make_node(
    plugin: CpuMemPlugin,
    cpu_map: dict[int, int],
    memory: int = 16 * GiB,
    numa: list[list[int]] | None = None,
    numa_memory: list[int] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(capacity, usage) of an idle node with the given pieces per core (and NUMA topology)."""
    request: dict[str, Any] = {
        "cpu": ",".join(f"{core}:{pieces}" for core, pieces in cpu_map.items()),
        "memory": memory,
    }
    if numa is not None:
        request["numa-cpu"] = [",".join(map(str, cores)) for cores in numa]
    if numa_memory is not None:
        request["numa-memory"] = numa_memory
    return plugin.add_node(request, None)


def use_cores(usage: dict[str, Any], used: dict[int, int]) -> dict[str, Any]:
    """The usage with the given pieces taken on each core (as bound workloads would)."""
    cpu_map = dict(usage["cpu_map"])
    cpu_map.update({str(core): pieces for core, pieces in used.items()})
    return {**usage, "cpu_map": cpu_map}


def bound(cpu: float, memory: int = 0) -> dict[str, Any]:
    return {"cpu-bind": True, "cpu-request": cpu, "memory-request": memory}


def all_plans(plugin: CpuMemPlugin, capacity: dict, usage: dict, request: dict) -> list[dict[str, int]]:
    """Every plan one calculation offers, as cpu maps with int keys, in order."""
    count = plugin.deploy_capacity(capacity, usage, request).capacity
    _, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    return [{int(core): pieces for core, pieces in w["cpu_map"].items()} for w in workloads]


def core_plans(
    cpu_map: dict[int, int], cpu: float, max_share: int = -1, origin: dict[int, int] | None = None
):
    """Plans straight from the planner, as cpu maps, for free pieces per core."""
    request = PlanRequest.of(cpu, 0, 100, max_share)
    cores = [(pieces, core) for core, pieces in cpu_map.items()]
    plans = plan_cores(cores, request, origin)
    if origin is None:
        assert count_core_plans(cores, request) == len(plans)
    return [dict(plan) for plan in plans]


def error_of(call, *args) -> BerthError:
    with pytest.raises(BerthError) as caught:
        call(*args)
    return caught.value


# -- construction and protocol ---------------------------------------------------------------


def test_plugin_implements_the_protocol(plugin):
    assert (plugin.name, plugin.priority) == ("cpumem", 100)
    for name, declared in vars(ResourcePlugin).items():
        if callable(declared) and not name.startswith("_"):
            expected = list(inspect.signature(declared).parameters)[1:]  # without self
            assert list(inspect.signature(getattr(plugin, name)).parameters) == expected, name


@pytest.mark.parametrize("kwargs", [{"share_base": 0}, {"max_share": -2}, {"max_deploy_count": 0}])
def test_constructor_rejects_nonsense_configuration(kwargs):
    with pytest.raises(ValueError):
        CpuMemPlugin(**kwargs)


# -- workload request: parsing and eru's eight validation steps ----------------------------------


def deployed(plugin: CpuMemPlugin, request: dict | None, bind_cores: int = 8) -> dict[str, Any]:
    capacity, usage = make_node(plugin, dict.fromkeys(range(bind_cores), 100), memory=64 * GiB)
    return plugin.calculate_deploy(capacity, usage, 1, request)[1][0]


def test_step1_cpu_request_defaults_to_limit(plugin):
    workload = deployed(plugin, {"cpu-limit": 2})
    assert (workload["cpu_request"], workload["cpu_limit"]) == (2.0, 2.0)


def test_step2_negative_memory_in_a_deploy_is_invalid_argument_checked_before_cpu(plugin):
    # DESIGN.md §2: a negative quantity outside a delta is invalid_argument naming the field (a
    # realloc below zero keeps eru's invalid_memory: test_upstream_realloc_errors).
    error = error_of(deployed, plugin, {"memory-request": -1, "cpu-request": -1})
    assert error.code == "invalid_argument" and error.field == "workload_resource_request.memory-request"
    assert error_of(deployed, plugin, {"memory-limit": "-1G"}).field == "workload_resource_request.memory-limit"


def test_step3_negative_cpu_in_a_deploy_is_invalid_argument(plugin):
    error = error_of(deployed, plugin, {"cpu-bind": True, "cpu-request": -1})
    assert error.code == "invalid_argument" and error.field == "workload_resource_request.cpu-request"
    assert error_of(deployed, plugin, {"cpu-request": 1, "cpu-limit": -1}).field == "workload_resource_request.cpu-limit"


def test_step4_binding_needs_a_cpu_request(plugin):
    error = error_of(deployed, plugin, {"cpu-bind": True})
    assert error.code == "invalid_cpu" and "unlimited request with bind" in error.message


def test_step5_memory_request_defaults_to_limit(plugin):
    workload = deployed(plugin, {"memory-limit": "1G"})
    assert (workload["memory_request"], workload["memory_limit"]) == (GiB, GiB)


def test_step6_memory_limit_is_raised_to_the_request(plugin):
    workload = deployed(plugin, {"memory-request": "2G", "memory-limit": "1G"})
    assert workload["memory_limit"] == 2 * GiB


def test_step7_cpu_limit_is_raised_to_the_request(plugin):
    workload = deployed(plugin, {"cpu-request": 2, "cpu-limit": 1})
    assert workload["cpu_limit"] == 2.0


def test_step8_bound_workload_reserves_its_whole_limit(plugin):
    workload = deployed(plugin, {"cpu-bind": True, "cpu-request": 1, "cpu-limit": 2})
    assert workload["cpu_request"] == 2.0 and sum(workload["cpu_map"].values()) == 200


def test_unbound_limit_above_request_is_kept(plugin):
    workload = deployed(plugin, {"cpu-request": 1, "cpu-limit": 2})
    assert (workload["cpu_request"], workload["cpu_limit"]) == (1.0, 2.0)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"cpu-request": "1"}, "cpu-request"),
        ({"cpu-request": True}, "cpu-request"),
        ({"cpu-request": None}, "cpu-request"),
        ({"cpu-limit": float("nan")}, "cpu-limit"),
        ({"cpu-limit": float("inf")}, "cpu-limit"),
        ({"cpu-bind": None}, "cpu-bind"),
        ({"cpu-bind": "true"}, "cpu-bind"),
        ({"keep-cpu-bind": 1}, "keep-cpu-bind"),
        ({"memory-request": "1X"}, "memory-request"),
        ({"memory-request": 1.5}, "memory-request"),
        ({"memory-limit": True}, "memory-limit"),
        ({"memory-limit": [1]}, "memory-limit"),
    ],
)
def test_wrongly_typed_request_values_are_rejected_naming_the_key(plugin, request_, field):
    error = error_of(deployed, plugin, request_)
    assert isinstance(error, InvalidArgument) and error.code == "invalid_argument"
    assert error.field == f"workload_resource_request.{field}"  # the path from the argument's root


def test_a_request_that_is_not_a_map_is_rejected(plugin):
    assert error_of(deployed, plugin, ["cpu-bind"]).field == "workload_resource_request"


def test_sizes_accept_human_strings_and_integral_floats(plugin):
    assert deployed(plugin, {"memory-request": "1G"})["memory_request"] == GiB
    assert deployed(plugin, {"memory-request": "512MiB"})["memory_request"] == 512 << 20
    assert deployed(plugin, {"memory-request": 1024.0})["memory_request"] == 1024


@pytest.mark.parametrize("key", ["cpu", "memory", "cpu_request", "x"])
def test_unknown_keys_are_refused(plugin, key):
    """DESIGN.md §8: a typo (or eru's removed `cpu`/`memory` shortcuts) must not place an empty workload."""
    error = error_of(deployed, plugin, {"cpu-request": 1, key: 4})
    assert (error.code, error.field) == ("invalid_argument", f"workload_resource_request.{key}")
    assert f"unknown key '{key}'; accepted: cpu-bind, cpu-limit, cpu-request, keep-cpu-bind" in error.message


@pytest.mark.parametrize("request_", [None, {}])
def test_empty_request_is_unbound_with_nothing_asked(plugin, request_):
    capacity, usage = make_node(plugin, {0: 100})
    engines, workloads = plugin.calculate_deploy(capacity, usage, 3, request_)
    assert engines == [{"cpu": 0.0, "cpu_map": {}, "numa_node": "", "memory": 0, "remap": False}] * 3
    assert workloads[0] == {
        "cpu_request": 0.0,
        "cpu_limit": 0.0,
        "memory_request": 0,
        "memory_limit": 0,
        "cpu_map": {},
        "numa_memory": {},
        "numa_node": "",
    }
    assert plugin.deploy_capacity(capacity, usage, request_) == DeployCapacity(MAX_INT, 0.0, 0.0, 1.0)


def test_empty_request_fits_even_a_node_without_cpumem_capacity(plugin):
    capacity, usage = plugin.add_node(None, None)
    assert plugin.deploy_capacity(capacity, usage, None).capacity == MAX_INT
    assert plugin.deploy_capacity(capacity, usage, {"cpu-request": 1}).capacity == 0


# -- node requests and add-node ---------------------------------------------------------------


def test_add_node_with_a_core_count_and_share(plugin):
    capacity, usage = plugin.add_node({"cpu": 3, "share": 200, "memory": "4G"}, None)
    assert capacity == {
        "cpu": 3.0,
        "cpu_map": {"0": 200, "1": 200, "2": 200},
        "memory": 4 * GiB,
        "numa_memory": {},
        "numa": {},
    }
    assert usage == {
        "cpu": 0.0,
        "cpu_map": {"0": 0, "1": 0, "2": 0},
        "memory": 0,
        "numa_memory": {},
        "numa": {},
    }


def test_add_node_with_the_list_form_orders_cores_numerically(plugin):
    capacity, usage = plugin.add_node({"cpu": "10:100, 9:200,0:50", "memory": 1}, None)
    assert list(capacity["cpu_map"].items()) == [("0", 50), ("9", 200), ("10", 100)]
    assert capacity["cpu"] == 3.0 and list(usage["cpu_map"]) == ["0", "9", "10"]


@pytest.mark.parametrize(
    "cpu",
    [
        *("0", "a:100", "0:x", "0:1_0", "0:+5", "0:4294967296", "0:100,0:100", "01:100", "-1:100", "0:-100"),
        *(1.5, -2, 65537, True, None),
    ],
)
def test_malformed_cpu_is_rejected(plugin, cpu):
    error = error_of(plugin.add_node, {"cpu": cpu, "memory": 1}, None)
    assert isinstance(error, InvalidArgument) and error.field == "resource.cpu"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"cpu": 2, "share": -1}, "share"),
        ({"cpu": 2, "share": "100"}, "share"),
        ({"cpu": 2, "memory": "lots"}, "memory"),
        ({"cpu": 2, "memory": -1}, "memory"),
        ({"cpu": 2, "numa-cpu": "0,1"}, "numa-cpu"),
        ({"cpu": 2, "numa-cpu": [0, 1]}, "numa-cpu"),
        ({"cpu": 2, "numa-cpu": ["0,1", "1"]}, "numa-cpu"),
        ({"cpu": 2, "numa-cpu": ["0,x"]}, "numa-cpu[0]"),
        ({"cpu": 2, "numa-cpu": ["0", "1"], "numa-memory": "1G"}, "numa-memory"),
        ({"cpu": 2, "numa-cpu": ["0", "1"], "numa-memory": ["1G", "2X"]}, "numa-memory[1]"),
    ],
)
def test_malformed_node_request_values_are_rejected(plugin, request_, field):
    assert error_of(plugin.add_node, request_, None).field == f"resource.{field}"


def test_add_node_with_numa_splits_memory_over_numa_nodes_not_cores(plugin):
    # eru divides by the number of cores in the map; berth by the 3 NUMA nodes, remainder to node 0.
    capacity, usage = plugin.add_node({"cpu": 6, "memory": 100, "numa-cpu": ["0,1,2,3", "4", "5"]}, None)
    assert capacity["numa_memory"] == {"0": 34, "1": 33, "2": 33}
    assert capacity["numa"] == {"0": "0", "1": "0", "2": "0", "3": "0", "4": "1", "5": "2"}
    assert usage["numa_memory"] == {"0": 0, "1": 0, "2": 0} and usage["numa"] == capacity["numa"]


def test_add_node_with_explicit_numa_memory(plugin):
    capacity, _ = plugin.add_node(
        {"cpu": 2, "memory": "4G", "numa-cpu": ["0", "1"], "numa-memory": ["1G", 3 * GiB]}, None
    )
    assert capacity["numa_memory"] == {"0": GiB, "1": 3 * GiB}


def test_add_node_from_engine_info_takes_80_percent_of_memory(plugin):
    capacity, _ = plugin.add_node(None, EngineInfo(ncpu=2, memory_total=1000))
    assert capacity == {
        "cpu": 2.0,
        "cpu_map": {"0": 100, "1": 100},
        "memory": 800,
        "numa_memory": {},
        "numa": {},
    }


def test_add_node_accepts_engine_info_as_a_map(plugin):
    capacity, _ = plugin.add_node({}, {"ncpu": 1, "memory_total": 10})
    assert capacity["cpu_map"] == {"0": 100} and capacity["memory"] == 8


def test_add_node_from_engine_resources_uses_its_topology_and_overrides_ncpu(plugin):
    engine = {
        "cpu": 4,
        "memory": 1000,
        "numa": {"0": "0", "1": "0", "2": "1", "3": "1"},
        "numa_memory": {"0": 500, "1": 500},
    }
    capacity, _ = plugin.add_node(None, EngineInfo(ncpu=64, memory_total=1, resources={"cpumem": engine}))
    assert capacity["cpu_map"] == {"0": 100, "1": 100, "2": 100, "3": 100}
    assert capacity["memory"] == 800 and capacity["numa_memory"] == {"0": 400, "1": 400}
    assert capacity["numa"] == engine["numa"]


def test_add_node_from_engine_info_keeps_a_requested_numa_cpu(plugin):
    engine = {"numa": {"0": "0", "1": "1"}, "numa_memory": {"0": 500, "1": 500}}
    capacity, _ = plugin.add_node(
        {"numa-cpu": ["0", "1"], "numa-memory": [100, 300]},
        EngineInfo(ncpu=2, memory_total=1000, resources={"cpumem": engine}),
    )
    assert capacity["numa"] == {"0": "0", "1": "1"} and capacity["numa_memory"] == {"0": 100, "1": 300}
    capacity, _ = plugin.add_node(
        {"numa-cpu": ["0,1"]}, EngineInfo(ncpu=2, memory_total=1000, resources={"cpumem": engine})
    )
    assert capacity["numa"] == {"0": "0", "1": "0"}


def test_add_node_request_wins_over_engine_info(plugin):
    capacity, _ = plugin.add_node({"cpu": 1, "memory": 5}, EngineInfo(ncpu=8, memory_total=1000))
    assert capacity["cpu_map"] == {"0": 100} and capacity["memory"] == 5


def test_add_node_without_request_or_info_is_an_empty_record(plugin):
    capacity, usage = plugin.add_node(None, None)
    assert capacity == usage == {"cpu": 0.0, "cpu_map": {}, "memory": 0, "numa_memory": {}, "numa": {}}
    plugin.validate_record(capacity, usage)


def test_add_node_with_memory_but_no_cores_is_invalid_cpu_map(plugin):
    assert error_of(plugin.add_node, {"memory": "4G"}, None).code == "invalid_cpu_map"


def test_add_node_with_a_snapshot_takes_it_verbatim(plugin):
    snapshot = {
        "cpu": 2.0,
        "cpu_map": {"0": 300, "5": 50},
        "memory": 7,
        "numa_memory": {"0": 7},
        "numa": {"0": "0", "5": "0"},
    }
    capacity, _ = plugin.add_node(snapshot, None)
    assert capacity == snapshot


# -- record validation -------------------------------------------------------------------------


@pytest.fixture
def numa_node(plugin):
    return make_node(
        plugin, {0: 100, 1: 100, 2: 100, 3: 100}, memory=8, numa=[[0, 1], [2, 3]], numa_memory=[4, 4]
    )


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        (lambda c, u: u["cpu_map"].update({"9": 1}), "invalid_cpu_map", "usage.cpu_map.9"),
        (lambda c, u: u["cpu_map"].update({"0": 101}), "invalid_cpu_map", "usage.cpu_map.0"),
        (lambda c, u: u["cpu_map"].update({"0": -1}), "invalid_cpu_map", "usage.cpu_map.0"),
        (lambda c, u: c["cpu_map"].update({"0": -1}), "invalid_cpu_map", "capacity.cpu_map.0"),
        (lambda c, u: c.update(cpu_map={}), "invalid_cpu_map", "capacity.cpu_map"),
        (lambda c, u: c["numa"].pop("3"), "invalid_numa_cpu", "capacity.numa"),
        (
            lambda c, u: (c["numa_memory"].pop("1"), u["numa_memory"].pop("1")),
            "invalid_numa_memory",
            "capacity.numa_memory",
        ),
        (lambda c, u: u["numa_memory"].update({"1": 5}), "invalid_numa_memory", "usage.numa_memory.1"),
        (lambda c, u: u["numa_memory"].update({"1": -1}), "invalid_numa_memory", "usage.numa_memory.1"),
        (lambda c, u: c["numa_memory"].update({"1": -1}), "invalid_numa_memory", "capacity.numa_memory.1"),
        (lambda c, u: u.update(memory=-1), "invalid_memory", "usage.memory"),
        (lambda c, u: u.update(cpu=-0.5), "invalid_cpu", "usage.cpu"),
        (lambda c, u: u.update(cpu=float("nan")), "invalid_cpu", "usage.cpu"),
        (lambda c, u: c["cpu_map"].update({"01": 1}), "invalid_cpu_map", "capacity.cpu_map"),
        (lambda c, u: c["numa"].update({"0": "x"}), "invalid_numa_cpu", "capacity.numa"),
        (lambda c, u: c["cpu_map"].update({"0": "100"}), "invalid_argument", "capacity.cpu_map.0"),
        (lambda c, u: c["cpu_map"].update({"0": 99.5}), "invalid_argument", "capacity.cpu_map.0"),
        (lambda c, u: u.update(numa_memory=None), "invalid_argument", "usage.numa_memory"),
    ],
)
def test_validate_record_rejects(plugin, numa_node, change, code, field):
    capacity, usage = numa_node
    change(capacity, usage)
    error = error_of(plugin.validate_record, capacity, usage)
    assert (error.code, error.field) == (code, field)


def test_validate_record_accepts_a_missing_usage_and_oversubscribed_total_memory(plugin, numa_node):
    capacity, usage = numa_node
    plugin.validate_record(capacity, None)
    plugin.validate_record(capacity, {**usage, "memory": 100})  # eru never checks total memory usage


def test_records_accept_integral_floats_from_json_clients(plugin, numa_node):
    capacity, usage = numa_node
    capacity = {**capacity, "memory": 8.0, "cpu_map": {core: 100.0 for core in capacity["cpu_map"]}}
    plugin.validate_record(capacity, usage)
    assert plugin.deploy_capacity(capacity, usage, bound(1, 1)).capacity == 4


# -- the CPU planner: worked examples of the reference and upstream test cases -----------------------


@pytest.mark.parametrize("cores", [2, 3, 4, 7, 10])
def test_1_7_cpus_on_idle_cores_gives_half_as_many_plans_of_a_whole_core_and_70(plugin, cores):
    capacity, usage = make_node(plugin, dict.fromkeys(range(cores), 100))
    plans = all_plans(plugin, capacity, usage, bound(1.7))
    assert len(plans) == cores // 2
    assert all(sorted(plan.values()) == [70, 100] for plan in plans)


def test_1_7_cpus_on_four_idle_cores_cut_fragments_from_the_first_cores(plugin):
    capacity, usage = make_node(plugin, dict.fromkeys(range(4), 100))
    assert all_plans(plugin, capacity, usage, bound(1.7)) == [{0: 70, 2: 100}, {1: 70, 3: 100}]


def test_pieces_are_truncated(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert all_plans(plugin, capacity, usage, bound(0.29)) == [{0: 28}] * 3
    assert deployed(plugin, bound(0.57))["cpu_map"] == {"0": 56}


def test_a_request_below_one_piece_has_no_plan(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert plugin.deploy_capacity(capacity, usage, bound(0.001)).capacity == 0
    assert error_of(plugin.calculate_deploy, capacity, usage, 1, bound(0.001)).code == "insufficient_capacity"


def test_upstream_full_plans_with_oversold_cores():
    plans = core_plans({0: 400, 1: 200, 2: 400}, 2)
    assert Counter(tuple(sorted(plan)) for plan in plans) == Counter({(0, 2): 3, (0, 1): 1, (1, 2): 1})
    assert Counter(tuple(sorted(plan)) for plan in core_plans({0: 200, 1: 200, 2: 200}, 2)) == Counter(
        {(0, 1): 1, (0, 2): 1, (1, 2): 1}
    )


@pytest.mark.parametrize(
    ("cpu_map", "cpu", "expected"),
    [
        ({0: 300, 1: 300}, 2, [{0: 100, 1: 100}] * 3),
        ({0: 300}, 0.5, [{0: 50}] * 6),
        ({0: 70, 1: 100, 2: 400}, 1.3, [{0: 30, 2: 100}] * 2 + [{1: 30, 2: 100}] * 2),
        ({0: 70, 1: 50, 2: 90}, 0.5, [{1: 50}, {0: 50}, {2: 50}]),
    ],
)
def test_upstream_oversell_cases(cpu_map, cpu, expected):
    assert core_plans(cpu_map, cpu) == expected


def test_upstream_oversell_whole_cpus_prefer_loaded_cores():
    plans = core_plans({0: 100, 1: 200, 2: 300}, 1)
    assert len(plans) == 6 and plans[:2] == [{0: 100}, {1: 100}]


def test_upstream_seven_fragmented_cores():
    assert len(core_plans({0: 50, 1: 100, 2: 300, 3: 70, 4: 200, 5: 30, 6: 230}, 1.7)) >= 2


def test_upstream_stable_fragment_core(plugin):
    capacity, usage = make_node(plugin, {0: 230, 1: 200})
    first = plugin.calculate_deploy(capacity, usage, 1, bound(1.7))[1]
    assert first[0]["cpu_map"] == {"0": 70, "1": 100}
    usage = plugin.apply_workloads(usage, first, True)
    assert plugin.calculate_deploy(capacity, usage, 1, bound(1.7))[1][0]["cpu_map"] == {"0": 70, "1": 100}


@pytest.mark.parametrize(
    ("cpu_map", "cpu", "usage_after_two"),
    [
        ({0: 230, 1: 80, 2: 300, 3: 200}, 1.7, {0: 70, 1: 70, 2: 0, 3: 200}),
        ({0: 70, 1: 50, 2: 100, 3: 100, 4: 100}, 1.7, {0: 70, 1: 0, 2: 70, 3: 100, 4: 100}),
        ({0: 70, 1: 50, 2: 90}, 0.5, {0: 50, 1: 50, 2: 0}),
    ],
)
def test_upstream_usage_after_two_plans(plugin, cpu_map, cpu, usage_after_two):
    capacity, usage = make_node(plugin, cpu_map)
    _, workloads = plugin.calculate_deploy(capacity, usage, 2, bound(cpu, 1))
    after = plugin.apply_workloads(usage, workloads, True)
    assert after["cpu_map"] == {str(core): pieces for core, pieces in usage_after_two.items()}


def test_upstream_numa_plans_are_local_first(plugin):
    capacity, usage = make_node(
        plugin, dict.fromkeys(range(4), 100), 4 * GiB, [[0, 1], [2, 3]], [2 * GiB] * 2
    )
    _, workloads = plugin.calculate_deploy(capacity, usage, 2, bound(1.3, 1))
    assert [(w["cpu_map"], w["numa_node"], w["numa_memory"]) for w in workloads] == [
        ({"0": 30, "1": 100}, "0", {"0": 1}),
        ({"2": 30, "3": 100}, "1", {"1": 1}),
    ]
    assert plugin.deploy_capacity(capacity, usage, bound(1.3, 1)).capacity == 2


def test_upstream_numa_then_cross_numa(plugin):
    capacity, usage = make_node(
        plugin, dict.fromkeys(range(6), 100), 6 * GiB, [[0, 1, 2], [3, 4, 5]], [3 * GiB] * 2
    )
    _, workloads = plugin.calculate_deploy(capacity, usage, 3, bound(2, 2 * GiB))
    assert [(w["cpu_map"], w["numa_node"], w["numa_memory"]) for w in workloads] == [
        ({"1": 100, "2": 100}, "0", {"0": 2 * GiB}),
        ({"4": 100, "5": 100}, "1", {"1": 2 * GiB}),
        ({"0": 100, "3": 100}, "", {}),
    ]


def test_upstream_memory_caps_the_plans(plugin):
    capacity, usage = make_node(plugin, dict.fromkeys(range(4), 100), 4 * GiB)
    assert all_plans(plugin, capacity, usage, bound(1.3, 3 * GiB)) == [{0: 30, 1: 100}]


def test_upstream_fragment_cores_above_max_share_means_no_conversion():
    # eru (before its fix) sliced with a negative bound and panicked here.
    assert core_plans({0: 100, 1: 100, 2: 30, 3: 40, 4: 50}, 0.5, max_share=2) == [{4: 50}]


def test_max_share_limits_conversion():
    assert len(core_plans(dict.fromkeys(range(4), 100), 0.5)) == 8
    assert core_plans(dict.fromkeys(range(4), 100), 0.5, max_share=1) == [{0: 50}, {0: 50}]
    assert core_plans(dict.fromkeys(range(4), 100), 0.5, max_share=0) == []


def test_issue_501_a_zero_piece_core_is_not_a_fragment_core():
    plugin = CpuMemPlugin(max_share=1)
    capacity, usage = make_node(plugin, dict.fromkeys(range(4), 100))
    first = plugin.calculate_deploy(capacity, usage, 1, bound(1.1))[1]
    usage = plugin.apply_workloads(usage, first, True)
    second = plugin.calculate_deploy(capacity, usage, 1, bound(1.1))[1]
    assert (first[0]["cpu_map"], second[0]["cpu_map"]) == ({"0": 10, "1": 100}, {"0": 10, "2": 100})


def test_ties_break_by_numeric_core_id(plugin):
    # eru compares ids as strings, so "10" < "9"; berth orders numerically.
    capacity, usage = make_node(plugin, {10: 100, 9: 100})
    assert all_plans(plugin, capacity, usage, bound(1)) == [{9: 100}, {10: 100}]
    assert all_plans(plugin, capacity, usage, bound(0.5)) == [{9: 50}] * 2 + [{10: 50}] * 2


def test_numa_nodes_are_planned_in_numeric_order(plugin):
    capacity, usage = plugin.add_node(
        {"cpu": "0:100,1:100,2:100", "memory": 6, "numa-cpu": ["2", "1", "0"], "numa-memory": [2, 2, 2]}, None
    )
    _, workloads = plugin.calculate_deploy(capacity, usage, 3, bound(1, 1))
    assert [w["numa_node"] for w in workloads] == ["0", "1", "2"]
    assert [w["cpu_map"] for w in workloads] == [{"2": 100}, {"1": 100}, {"0": 100}]


def test_numa_local_plans_are_also_capped_by_free_total_memory(plugin):
    # Unbound workloads take total memory but no NUMA memory; eru would over-commit the total here.
    capacity, usage = make_node(
        plugin, dict.fromkeys(range(4), 100), 4 * GiB, [[0, 1], [2, 3]], [2 * GiB] * 2
    )
    usage = {**usage, "memory": 3 * GiB}
    assert plugin.deploy_capacity(capacity, usage, bound(1, GiB)).capacity == 1
    assert len(plugin.calculate_deploy(capacity, usage, 1, bound(1, GiB))[1]) == 1
    assert (
        error_of(plugin.calculate_deploy, capacity, usage, 2, bound(1, GiB)).code == "insufficient_capacity"
    )


def benchmark_node(plugin: CpuMemPlugin, cores: int) -> tuple[dict, dict]:
    half = cores // 2
    return make_node(
        plugin,
        dict.fromkeys(range(cores), 100),
        256 * GiB,
        [list(range(half)), list(range(half, cores))],
        [128 * GiB] * 2,
    )


def test_benchmark_a_64_idle_cores_in_two_numa_nodes_give_42_plans(plugin):
    # Per NUMA node: converting 11 of 32 cores gives min(21 full, 22 fragment) = 21 plans.
    capacity, usage = benchmark_node(plugin, 64)
    plans = plugin.calculate_deploy(capacity, usage, 42, bound(1.5, 2 * GiB))[1]
    assert [w["numa_node"] for w in plans] == ["0"] * 21 + ["1"] * 21
    assert plugin.deploy_capacity(capacity, usage, bound(1.5, 2 * GiB)).capacity == 42
    assert (
        error_of(plugin.calculate_deploy, capacity, usage, 43, bound(1.5, 2 * GiB)).code
        == "insufficient_capacity"
    )


@pytest.mark.parametrize(
    "used",
    [
        {**dict.fromkeys(range(32), 100), **dict.fromkeys(range(32, 40), 70)},  # NUMA node 0 busy
        {
            **dict.fromkeys([*range(16), *range(32, 48)], 100),
            **dict.fromkeys([*range(16, 20), *range(48, 52)], 70),
        },
    ],
)
def test_benchmark_b_half_busy_with_eight_30_piece_cores_gives_16_plans(plugin, used):
    capacity, usage = benchmark_node(plugin, 64)
    usage = use_cores(usage, used)
    assert len(all_plans(plugin, capacity, usage, bound(1.5, 2 * GiB))) == 16


def test_benchmark_c_128_idle_cores_give_85_plans(plugin):
    # 42 per NUMA node (min(43, 42) after 21 conversions) leaves one idle core in each: one more
    # cross-NUMA plan.
    capacity, usage = benchmark_node(plugin, 128)
    workloads = plugin.calculate_deploy(capacity, usage, 85, bound(1.5, 2 * GiB))[1]
    assert [w["numa_node"] for w in workloads].count("") == 1 and workloads[-1]["numa_node"] == ""
    assert plugin.deploy_capacity(capacity, usage, bound(1.5, 2 * GiB)).capacity == 85


# -- calculate-deploy ------------------------------------------------------------------------------


def test_bound_deploy_returns_engine_params_and_workloads(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 4 * GiB, [[0], [1]], [2 * GiB] * 2)
    engines, workloads = plugin.calculate_deploy(
        capacity,
        usage,
        1,
        {"cpu-bind": True, "cpu-request": 1, "cpu-limit": 1, "memory-request": "1G", "memory-limit": "1G"},
    )
    assert engines == [{"cpu": 1.0, "cpu_map": {"0": 100}, "numa_node": "0", "memory": GiB, "remap": False}]
    assert workloads == [
        {
            "cpu_request": 1.0,
            "cpu_limit": 1.0,
            "memory_request": GiB,
            "memory_limit": GiB,
            "cpu_map": {"0": 100},
            "numa_memory": {"0": GiB},
            "numa_node": "0",
        }
    ]


def test_bound_deploy_beyond_the_plans_is_insufficient_capacity(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100})
    error = error_of(plugin.calculate_deploy, capacity, usage, 3, bound(1))
    assert error.code == "insufficient_capacity" and error.status == 409
    assert error.details == {
        "plugin": "cpumem", "resource": "cpu", "requested": 3, "available": 2, "unit": "instances"
    }
    assert error_of(plugin.calculate_deploy, capacity, usage, 1, bound(2.2)).code == "insufficient_capacity"


def test_unbound_deploy_checks_memory_and_the_size_of_one_instance_only(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 4 * GiB)
    usage = {**usage, "cpu": 50.0}  # unbound CPU is never capacity-checked
    assert (
        len(plugin.calculate_deploy(capacity, usage, 4, {"cpu-request": 2, "memory-request": "1G"})[0]) == 4
    )
    error = error_of(plugin.calculate_deploy, capacity, usage, 5, {"cpu-request": 1, "memory-request": "1G"})
    assert error.code == "insufficient_capacity" and error.details["resource"] == "memory"
    error = error_of(plugin.calculate_deploy, capacity, usage, 1, {"cpu-request": 2.5})
    assert error.code == "insufficient_capacity" and error.details["resource"] == "cpu"


def test_unbound_deploy_params(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    engines, workloads = plugin.calculate_deploy(
        capacity, usage, 2, {"cpu-request": 0.5, "memory-limit": 100}
    )
    # A limit of 0 is no quota: the request alone does not set one.
    assert engines == [{"cpu": 0.0, "cpu_map": {}, "numa_node": "", "memory": 100, "remap": False}] * 2
    assert workloads[1] == {
        "cpu_request": 0.5,
        "cpu_limit": 0.0,
        "memory_request": 100,
        "memory_limit": 100,
        "cpu_map": {},
        "numa_memory": {},
        "numa_node": "",
    }
    assert engines[0] is not engines[1]


@pytest.mark.parametrize("count", [-1, True, "1", 1.0, None, 10001])
def test_deploy_count_must_be_a_sane_integer(plugin, count):
    capacity, usage = make_node(plugin, {0: 100})
    assert error_of(plugin.calculate_deploy, capacity, usage, count, None).field == "deploy_count"


def test_deploy_of_zero_instances_is_empty(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert plugin.calculate_deploy(capacity, usage, 0, bound(1)) == ([], [])


# -- deploy capacity ------------------------------------------------------------------------------


def test_unbound_deploy_capacity_counts_memory(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 10 * GiB)
    usage = {**usage, "memory": 2 * GiB}
    result = plugin.deploy_capacity(capacity, usage, {"cpu-request": 1, "memory-request": "3G"})
    assert result == DeployCapacity(2, 0.2, 0.3, 1.0)
    assert plugin.deploy_capacity(capacity, usage, {"cpu-request": 3, "memory-request": 1}).capacity == 0
    usage = {**usage, "memory": 11 * GiB}  # oversubscribed by a capacity change: no negative capacity
    assert plugin.deploy_capacity(capacity, usage, {"memory-request": 1}).capacity == 0


def test_bound_deploy_capacity_counts_plans_with_weight_100(plugin):
    capacity, usage = make_node(plugin, dict.fromkeys(range(4), 100))
    usage = {**usage, "cpu": 1.0}
    assert plugin.deploy_capacity(capacity, usage, bound(1.7)) == DeployCapacity(2, 0.25, 0.425, 100.0)


def test_deploy_capacity_divides_safely(plugin):
    capacity, usage = make_node(plugin, {0: 100}, memory=0)
    assert plugin.deploy_capacity(capacity, usage, {"memory-request": 0}) == DeployCapacity(
        MAX_INT, 0.0, 0.0, 1.0
    )
    assert plugin.deploy_capacity(capacity, usage, {"memory-request": 1}) == DeployCapacity(0, 0.0, 0.0, 1.0)


# -- calculate-realloc -----------------------------------------------------------------------------


def test_realloc_full_cores_beat_affinity(plugin):
    # The reference's example: holding {0:50}, with {0:40, 1:100} free, grow to 1 CPU.
    capacity, usage = make_node(plugin, {0: 100, 1: 100})
    usage = use_cores(usage, {0: 60})
    workload = {"cpu_request": 0.5, "cpu_limit": 0.5, "cpu_map": {"0": 50}}
    engine, delta, new = plugin.calculate_realloc(
        capacity, usage, workload, {"keep-cpu-bind": True, "cpu-request": 0.5, "cpu-limit": 0.5}
    )
    assert engine == {"cpu": 1.0, "cpu_map": {"1": 100}, "numa_node": "", "memory": 0, "remap": False}
    assert new["cpu_map"] == {"1": 100} and delta["cpu_map"] == {"0": -50, "1": 100}
    assert (delta["cpu_request"], delta["cpu_limit"]) == (0.5, 0.5)


@pytest.mark.parametrize(
    ("free", "origin", "cpu", "expected"),
    [
        ({0: 0, 1: 30, 2: 0}, {0: 100, 1: 30, 2: 40}, 1, {0: 100}),
        ({0: 0, 1: 30, 2: 0}, {0: 100, 1: 30, 2: 40}, 1.2, {0: 100, 1: 20}),
        ({0: 0, 1: 80, 2: 0, 3: 0}, {0: 100, 1: 20, 2: 40, 3: 10}, 2, {0: 100, 1: 100}),
        ({0: 0, 1: 69, 2: 10}, {0: 100, 1: 30, 2: 40}, 2, None),
        ({0: 0, 1: 70, 2: 10}, {0: 100, 1: 30, 2: 40}, 2, {0: 100, 1: 100}),
        ({0: 100, 1: 60, 2: 0, 3: 100, 4: 100}, {0: 100, 1: 30, 2: 40}, 2, {0: 100, 3: 100}),
        ({0: 0, 1: 60, 2: 0}, {0: 100, 1: 30, 2: 40}, 2, None),
    ],
)
def test_upstream_realloc_affinity_cases(plugin, free, origin, cpu, expected):
    # Capacity = what is free plus what the workload holds; the rest of the node is idle.
    capacity, usage = make_node(plugin, {core: free[core] + origin.get(core, 0) for core in free})
    usage = use_cores(usage, origin)
    workload = {"cpu_request": sum(origin.values()) / 100, "cpu_map": {str(c): p for c, p in origin.items()}}
    delta_cpu = cpu - workload["cpu_request"]
    request = {"keep-cpu-bind": True, "cpu-request": delta_cpu}
    if expected is None:
        assert (
            error_of(plugin.calculate_realloc, capacity, usage, workload, request).code
            == "insufficient_resource"
        )
        return
    _, _, new = plugin.calculate_realloc(capacity, usage, workload, request)
    assert new["cpu_map"] == {str(core): pieces for core, pieces in expected.items()}


def test_upstream_multiple_candidate_second_cores():
    origin = {0: 100, 1: 30, 2: 40}
    plans = core_plans({0: 200, 1: 90, 2: 40, 3: 100, 4: 100}, 2, origin=origin)
    assert plans == [{0: 100, 3: 100}, {0: 100, 4: 100}]


def test_realloc_delta_of_every_field_is_a_difference(plugin):
    # A later core revision's expectation: {2,4,200,400} - {1,1,50,100} = {1,3,150,300}.
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 1000)
    current = {"cpu_request": 1, "cpu_limit": 1, "memory_request": 50, "memory_limit": 100}
    usage = {**usage, "cpu": 1.0, "memory": 50}
    request = {"cpu-request": 1, "cpu-limit": 3, "memory-request": 150, "memory-limit": 300}
    engine, delta, new = plugin.calculate_realloc(capacity, usage, current, request)
    assert [new[k] for k in ("cpu_request", "cpu_limit", "memory_request", "memory_limit")] == [
        2,
        4,
        200,
        400,
    ]
    assert [delta[k] for k in ("cpu_request", "cpu_limit", "memory_request", "memory_limit")] == [
        1,
        3,
        150,
        300,
    ]
    assert engine == {"cpu": 4.0, "cpu_map": {}, "numa_node": "", "memory": 400, "remap": False}


def test_realloc_delta_carries_the_new_numa_memory(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 4 * GiB, [[0], [1]], [2 * GiB] * 2)
    current = {
        "cpu_request": 1,
        "cpu_limit": 1,
        "memory_request": GiB,
        "memory_limit": GiB,
        "cpu_map": {"0": 100},
        "numa_memory": {"0": GiB},
        "numa_node": "0",
    }
    usage = plugin.apply_workloads(usage, [current], True)
    _, delta, new = plugin.calculate_realloc(
        capacity, usage, current, {"keep-cpu-bind": True, "memory-request": "512M"}
    )
    assert new["numa_memory"] == {"0": GiB + (512 << 20)} and new["numa_node"] == "0"
    assert delta["numa_memory"] == {"0": 512 << 20} and delta["memory_limit"] == 512 << 20
    # Committing the delta is the same as releasing the old resource and taking the new one.
    committed = plugin.apply_workloads(usage, [delta], True)
    assert committed == plugin.apply_workloads(plugin.apply_workloads(usage, [current], False), [new], True)


def test_realloc_without_keep_cpu_bind_unbinds(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 4 * GiB, [[0], [1]], [2 * GiB] * 2)
    current = {
        "cpu_request": 1,
        "cpu_limit": 1,
        "memory_request": GiB,
        "memory_limit": GiB,
        "cpu_map": {"0": 100},
        "numa_memory": {"0": GiB},
        "numa_node": "0",
    }
    usage = plugin.apply_workloads(usage, [current], True)
    engine, delta, new = plugin.calculate_realloc(capacity, usage, current, {})
    assert (new["cpu_map"], new["numa_node"], new["numa_memory"]) == ({}, "", {})
    assert delta["cpu_map"] == {"0": -100} and delta["numa_memory"] == {"0": -GiB}
    assert delta["cpu_request"] == 0.0 and engine["cpu_map"] == {}


def test_realloc_can_bind_an_unbound_workload(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100})
    current = {"cpu_request": 1, "cpu_limit": 1}
    usage = plugin.apply_workloads(usage, [current], True)
    _, delta, new = plugin.calculate_realloc(capacity, usage, current, {"cpu-bind": True})
    assert new["cpu_map"] == {"0": 100} and delta["cpu_map"] == {"0": 100}


def test_upstream_realloc_errors(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100}, 4 * GiB, [[0], [1]], [GiB] * 2)
    current = {
        "cpu_request": 1,
        "cpu_limit": 1,
        "memory_request": GiB,
        "memory_limit": GiB,
        "cpu_map": {"0": 100},
        "numa_memory": {"0": GiB},
        "numa_node": "0",
    }
    usage = plugin.apply_workloads(usage, [current], True)
    error = error_of(
        plugin.calculate_realloc, capacity, usage, current, {"keep-cpu-bind": True, "cpu-request": -3}
    )
    assert error.code == "invalid_cpu"
    error = error_of(
        plugin.calculate_realloc, capacity, usage, current, {"keep-cpu-bind": True, "cpu-request": 2}
    )
    assert error.code == "insufficient_resource" and error.status == 409
    _, _, new = plugin.calculate_realloc(
        capacity, usage, current, {"keep-cpu-bind": True, "cpu-request": -0.5, "cpu-limit": -0.5}
    )
    assert new["cpu_map"] == {"0": 50} and new["numa_node"] == "0"
    error = error_of(
        plugin.calculate_realloc, capacity, usage, current, {"memory-request": "1P", "memory-limit": "1P"}
    )
    assert error.code == "insufficient_capacity" and error.details["resource"] == "memory"
    error = error_of(plugin.calculate_realloc, capacity, usage, current, {"memory-request": -2 * GiB})
    assert error.code == "invalid_memory"


def test_realloc_rejects_a_malformed_workload_resource(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    error = error_of(plugin.calculate_realloc, capacity, usage, {"cpu_request": "1"}, {})
    assert error.code == "invalid_argument" and error.field == "workload_resource.cpu_request"


# -- calculate-remap ---------------------------------------------------------------------------------


def test_remap_without_workloads_does_not_look_at_the_node(plugin):
    assert plugin.calculate_remap(None, None, {}) == {}


def test_upstream_remap_gives_unbound_workloads_the_share_pool(plugin):
    capacity, usage = make_node(plugin, dict.fromkeys(range(4), 100), 4 * GiB)
    unbound = {"cpu_request": 1, "cpu_limit": 1, "memory_request": GiB, "memory_limit": GiB}
    workloads = {
        "id2": dict(unbound, numa_node="1"),
        "id1": unbound,
        "id3": dict(unbound, cpu_map={"0": 100, "1": 100}, cpu_request=2, cpu_limit=2),
    }
    usage = plugin.apply_workloads(usage, list(workloads.values()), True)
    remapped = plugin.calculate_remap(capacity, usage, workloads)
    assert list(remapped) == ["id1", "id2"]
    assert remapped["id1"] == {
        "cpu": 1.0,
        "cpu_map": {"2": 100, "3": 100},
        "numa_node": "",
        "memory": GiB,
        "remap": True,
    }
    assert remapped["id2"]["numa_node"] == "1"
    usage = use_cores(usage, dict.fromkeys(range(4), 100))  # no core wholly free: every core
    remapped = plugin.calculate_remap(capacity, usage, workloads)
    assert remapped["id1"]["cpu_map"] == {"0": 100, "1": 100, "2": 100, "3": 100}


def test_remap_pool_excludes_partly_bound_cores(plugin):
    capacity, usage = make_node(plugin, {0: 200, 1: 100, 2: 100})
    usage = use_cores(usage, {0: 50, 1: 1})
    assert plugin.calculate_remap(capacity, usage, {"w": {}})["w"]["cpu_map"] == {"0": 100, "2": 100}


# -- set-node-resource-capacity -----------------------------------------------------------------------


def test_delta_capacity_request_adds_share_base_to_the_first_cores(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    capacity, usage = plugin.set_capacity(capacity, usage, None, {"cpu": 2, "memory": "1G"}, True, True)
    assert capacity["cpu_map"] == {"0": 200, "1": 100} and capacity["cpu"] == 2.0
    assert capacity["memory"] == 16 * GiB + GiB and usage["cpu_map"] == {"0": 0, "1": 0}


@pytest.mark.parametrize(("cpu", "incr"), [("1:100", False), ("1:-100", True)])
def test_delta_capacity_decrement_removes_empty_cores(plugin, cpu, incr):
    capacity, usage = make_node(plugin, {0: 100, 1: 100, 2: 100})
    capacity, usage = plugin.set_capacity(capacity, usage, None, {"cpu": cpu}, True, incr)
    assert capacity["cpu_map"] == {"0": 100, "2": 100} and capacity["cpu"] == 2.0
    assert usage["cpu_map"] == {"0": 0, "2": 0}


def test_removing_a_core_in_use_is_invalid_cpu_map(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 100})
    usage = use_cores(usage, {1: 10})
    error = error_of(plugin.set_capacity, capacity, usage, None, {"cpu": "1:100"}, True, False)
    assert error.code == "invalid_cpu_map"


def test_absolute_capacity_request_keeps_omitted_keys_and_always_adds(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 200}, 4 * GiB, [[0], [1]], [GiB, 3 * GiB])
    new_capacity, _ = plugin.set_capacity(capacity, usage, None, {"memory": "8G"}, False, False)
    assert new_capacity == {**capacity, "memory": 8 * GiB}
    new_capacity, new_usage = plugin.set_capacity(
        capacity, usage, None, {"cpu": 4, "numa-cpu": ["0,1", "2,3"]}, False, False
    )
    assert new_capacity["cpu_map"] == {"0": 100, "1": 100, "2": 100, "3": 100}
    assert (
        new_capacity["numa_memory"] == capacity["numa_memory"]
        and new_capacity["memory"] == capacity["memory"]
    )
    assert new_usage["numa"] == new_capacity["numa"] and new_usage["cpu_map"] == dict.fromkeys("0123", 0)
    # The omitted numa-cpu is kept too, and then the new cores have no NUMA node.
    assert (
        error_of(plugin.set_capacity, capacity, usage, None, {"cpu": 4}, False, True).code
        == "invalid_numa_cpu"
    )


def test_absolute_capacity_without_inputs_empties_the_record(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert plugin.set_capacity(capacity, usage, None, None, False, True) == (
        {"cpu": 0.0, "cpu_map": {}, "memory": 0, "numa_memory": {}, "numa": {}},
        {"cpu": 0.0, "cpu_map": {}, "memory": 0, "numa_memory": {}, "numa": {}},
    )


def test_delta_capacity_without_inputs_changes_nothing(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert plugin.set_capacity(capacity, usage, None, None, True, True) == (capacity, usage)


def test_capacity_request_wins_over_resource(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    new_capacity, _ = plugin.set_capacity(
        capacity, usage, {"memory": 5, "cpu_map": {"0": 1}}, {"memory": 7}, True, True
    )
    assert new_capacity["memory"] == 16 * GiB + 7 and new_capacity["cpu_map"] == {"0": 100}


@pytest.mark.parametrize(
    ("request_", "delta", "incr"),
    [
        (
            {"cpu": "0:300,1:50,7:100", "memory": "1G", "numa-cpu": ["0,1", "7"], "numa-memory": [1, 2]},
            False,
            True,
        ),
        ({"cpu": 2, "memory": "2G"}, True, True),
        ({"cpu": "0:100,2:100"}, True, False),  # core 2 disappears
    ],
)
def test_capacity_rollback_with_before_is_exact(plugin, request_, delta, incr):
    before_capacity, before_usage = plugin.add_node(
        {"cpu": "0:300,1:50,2:100", "memory": "4G", "numa-cpu": ["0,1", "2"], "numa-memory": ["1G", "3G"]},
        None,
    )
    before_usage = use_cores(before_usage, {0: 20})
    after_capacity, after_usage = plugin.set_capacity(
        before_capacity, before_usage, None, request_, delta, incr
    )
    assert after_capacity != before_capacity
    # Core's rollback replays `before` absolutely, as a resource or (eru's way) as a request.
    as_resource = plugin.set_capacity(after_capacity, after_usage, before_capacity, None, False, False)
    as_request = plugin.set_capacity(after_capacity, after_usage, None, before_capacity, False, False)
    assert as_resource == as_request == (before_capacity, before_usage)


@pytest.mark.parametrize(("delta", "incr"), [(None, True), (True, None), ("yes", True), (1, False)])
def test_set_flags_must_be_booleans(plugin, delta, incr):
    capacity, usage = make_node(plugin, {0: 100})
    assert error_of(plugin.set_capacity, capacity, usage, None, None, delta, incr).code == "invalid_argument"
    assert error_of(plugin.set_usage, capacity, usage, None, None, [], delta, incr).code == "invalid_argument"


def test_negative_capacity_only_in_delta_requests(plugin):
    capacity, usage = make_node(plugin, {0: 100})
    assert error_of(plugin.set_capacity, capacity, usage, None, {"memory": -1}, False, True).field == "resource_request.memory"
    new_capacity, _ = plugin.set_capacity(capacity, usage, None, {"memory": -1}, True, True)
    assert new_capacity["memory"] == 16 * GiB - 1
    error = error_of(plugin.set_capacity, capacity, usage, None, {"memory": "-17G"}, True, True)
    assert error.code == "invalid_memory"


# -- set-node-resource-usage, apply and usage from workloads ---------------------------------------------


WORKLOAD_A = {
    "cpu_request": 1.5,
    "cpu_limit": 2,
    "memory_request": 100,
    "memory_limit": 200,
    "cpu_map": {"0": 100, "1": 50},
    "numa_memory": {"0": 100},
    "numa_node": "0",
}
WORKLOAD_B = {"cpu_request": 0.3, "cpu_limit": 0, "memory_request": 10, "memory_limit": 10}


@pytest.fixture
def small_numa_node(plugin):
    return make_node(plugin, {0: 100, 1: 100, 2: 100}, 1000, [[0, 1], [2]], [500, 500])


def test_usage_from_workloads_lists_every_core_and_numa_node(plugin, small_numa_node):
    capacity, _ = small_numa_node
    usage = plugin.usage_from_workloads(capacity, [WORKLOAD_A, WORKLOAD_B])
    assert usage == {
        "cpu": 1.8,
        "cpu_map": {"0": 100, "1": 50, "2": 0},
        "memory": 110,
        "numa_memory": {"0": 100, "1": 0},
        "numa": capacity["numa"],
    }
    plugin.validate_record(capacity, usage)


def test_set_usage_with_workloads_delta_and_absolute(plugin, small_numa_node):
    capacity, usage = small_numa_node
    added = plugin.set_usage(capacity, usage, None, None, [WORKLOAD_A, WORKLOAD_B], True, True)
    assert added == plugin.usage_from_workloads(capacity, [WORKLOAD_A, WORKLOAD_B])
    assert plugin.set_usage(
        capacity, added, None, None, [WORKLOAD_B], True, False
    ) == plugin.usage_from_workloads(capacity, [WORKLOAD_A])
    # Absolute: rewritten from the workloads alone, and incr is forced.
    assert plugin.set_usage(
        capacity, added, None, None, [WORKLOAD_B], False, False
    ) == plugin.usage_from_workloads(capacity, [WORKLOAD_B])


def test_set_usage_source_priority_request_then_resource_then_workloads(plugin, small_numa_node):
    capacity, usage = small_numa_node
    by_request = plugin.set_usage(
        capacity, usage, {"memory": 5}, {"cpu": "0:100,1:100"}, [WORKLOAD_A], False, True
    )
    assert by_request["cpu_map"] == {"0": 100, "1": 100, "2": 0} and by_request["cpu"] == 2.0
    assert by_request["memory"] == 0
    by_resource = plugin.set_usage(capacity, usage, {"memory": 5}, None, [WORKLOAD_A], False, True)
    assert by_resource["memory"] == 5 and by_resource["cpu_map"] == {"0": 0, "1": 0, "2": 0}


def test_set_usage_rollback_with_before_is_exact(plugin, small_numa_node):
    capacity, _ = small_numa_node
    before = plugin.usage_from_workloads(capacity, [WORKLOAD_B])
    after = plugin.set_usage(capacity, before, None, None, [WORKLOAD_A], True, True)
    assert plugin.set_usage(capacity, after, before, None, None, False, False) == before


def test_usage_never_goes_below_zero(plugin, small_numa_node):
    capacity, usage = small_numa_node
    error = error_of(plugin.set_usage, capacity, usage, None, None, [WORKLOAD_A], True, False)
    assert error.code == "invalid_cpu"
    error = error_of(plugin.apply_workloads, usage, [{"cpu_map": {"2": 1}}], False)
    assert error.code == "invalid_cpu_map" and error.field == "usage.cpu_map.2"
    assert error_of(plugin.apply_workloads, usage, [{"memory_request": 1}], False).code == "invalid_memory"
    assert (
        error_of(plugin.apply_workloads, usage, [{"numa_memory": {"1": 1}}], False).code
        == "invalid_numa_memory"
    )


def test_set_usage_beyond_capacity_is_rejected(plugin, small_numa_node):
    capacity, usage = small_numa_node
    error = error_of(plugin.set_usage, capacity, usage, None, {"cpu": "2:101"}, [], True, True)
    assert error.code == "invalid_cpu_map"


def test_apply_then_release_restores_usage(plugin, small_numa_node):
    _, usage = small_numa_node
    added = plugin.apply_workloads(usage, [WORKLOAD_A, WORKLOAD_B, WORKLOAD_B], True)
    assert added["cpu"] == 2.1 and added["cpu_map"]["1"] == 50
    assert plugin.apply_workloads(added, [WORKLOAD_B, WORKLOAD_A, WORKLOAD_B], False) == usage


def test_memory_totals_saturate_instead_of_overflowing(plugin):
    usage = {"cpu": 0.0, "cpu_map": {}, "memory": MAX_INT - 5, "numa_memory": {"0": MAX_INT}, "numa": {}}
    after = plugin.apply_workloads(usage, [{"memory_request": 10, "numa_memory": {"0": 1}}], True)
    assert (after["memory"], after["numa_memory"]) == (MAX_INT, {"0": MAX_INT})


def test_apply_workloads_rejects_malformed_workloads(plugin, small_numa_node):
    _, usage = small_numa_node
    error = error_of(plugin.apply_workloads, usage, [WORKLOAD_A, {"cpu_map": {"0": "1"}}], True)
    assert error.field == "workloads_resource[1].cpu_map.0"
    assert error_of(plugin.apply_workloads, usage, {"a": WORKLOAD_A}, True).field == "workloads_resource"


def test_apply_workloads_pins_errors_and_the_total_applied_at_once(plugin):
    """The shared kit's apply_workloads, pinned: the message when usage would go negative, workloads decoded
    before the usage, and the workloads' total combined once (so even no workloads rounds and saturates)."""
    error = error_of(plugin.apply_workloads, {"memory": 5}, [{"memory_request": 6}], False)
    assert (error.code, error.field, error.message) == (
        "invalid_memory", "usage.memory", "usage.memory: must not be negative, got -1"
    )
    assert error_of(plugin.apply_workloads, "bad", [{"cpu_map": {"x": 1}}], True).field == (
        "workloads_resource[0].cpu_map"
    )
    assert error_of(plugin.apply_workloads, {}, [], 1).field == "incr"
    after = plugin.apply_workloads({"cpu": 0.1234567891, "memory": MAX_INT + 5}, [], True)
    assert (after["cpu"], after["memory"]) == (0.123456789, MAX_INT)
    # saturation happens on the total, not workload by workload
    there_and_back = [{"memory_request": 10}, {"memory_request": -10}]
    assert plugin.apply_workloads({"memory": MAX_INT - 1}, there_and_back, True)["memory"] == MAX_INT - 1


def test_usage_from_workloads_reads_the_capacity_first(plugin):
    assert error_of(plugin.usage_from_workloads, "bad", [{"cpu_map": {"x": 1}}]).field == "capacity"


# -- diffs, load, metrics ----------------------------------------------------------------------------------


def test_diffs_follow_erus_text_and_order(plugin):
    capacity, usage = make_node(plugin, {9: 100, 10: 100, 2: 100}, 1000, [[2, 9], [10]], [500, 500])
    usage = {**use_cores(usage, {10: 20, 9: 30}), "cpu": 0.5, "memory": 7, "numa_memory": {"0": 3, "1": 4}}
    workloads = [{"cpu_request": 0.25, "cpu_map": {"2": 5}, "memory_request": 1, "numa_memory": {"1": 4}}]
    assert plugin.diffs(capacity, usage, workloads) == [
        "node.CPUUsed != sum(workload.CPURequest): 0.50 != 0.25",
        "node.CPUMap[2] != sum(workload.CPUMap[2]): 0 != 5",
        "node.CPUMap[9] != sum(workload.CPUMap[9]): 30 != 0",
        "node.CPUMap[10] != sum(workload.CPUMap[10]): 20 != 0",
        "node.NUMAMemory[0] != sum(workload.NUMAMemory[0]: 3 != 0)",
        "node.MemoryUsed != sum(workload.MemoryRequest): 7 != 1",
    ]


def test_no_diffs_when_usage_is_what_the_workloads_explain(plugin, small_numa_node):
    capacity, _ = small_numa_node
    workloads = [WORKLOAD_A, WORKLOAD_B, {"cpu_request": 0.1}, {"cpu_request": 0.2}]
    assert plugin.diffs(capacity, plugin.usage_from_workloads(capacity, workloads), workloads) == []


def test_load_is_used_pieces_share_plus_used_memory_share(plugin):
    capacity, usage = make_node(plugin, {0: 100, 1: 300}, 1000)
    assert plugin.load(capacity, usage) == 0.0
    usage = {**use_cores(usage, {1: 100}), "memory": 500}
    assert plugin.load(capacity, usage) == 0.25 + 0.5
    assert plugin.load(*plugin.add_node(None, None)) == 0.0


def test_metrics_description(plugin):
    descriptions = plugin.metrics_description()
    assert [d["name"] for d in descriptions] == ["cpu_map", "cpu_used", "memory_capacity", "memory_used"]
    assert all(d["type"] == "gauge" for d in descriptions)
    assert descriptions[0]["labels"] == ["podname", "nodename", "cpuid"]
    assert all(d["labels"] == ["podname", "nodename"] for d in descriptions[1:])


def test_metrics_report_numbers_under_distinct_keys(plugin):
    capacity, usage = make_node(plugin, {0: 100, 10: 100, 2: 100}, 2000)
    usage = {**use_cores(usage, {10: 50}), "cpu": 1.5, "memory": 300}
    metrics = plugin.metrics("pod", "node.a", capacity, usage)
    assert [(m["name"], m["key"], m["value"]) for m in metrics] == [
        ("memory_capacity", "core.node.node_a.memory", 2000),
        ("memory_used", "core.node.node_a.memory.used", 300),
        ("cpu_used", "core.node.node_a.cpu.used", 1.5),
        ("cpu_map", "core.node.node_a.cpu.0", 0),
        ("cpu_map", "core.node.node_a.cpu.2", 0),
        ("cpu_map", "core.node.node_a.cpu.10", 50),
    ]
    assert metrics[-1]["labels"] == ["pod", "node.a", "10"] and metrics[0]["labels"] == ["pod", "node.a"]
    assert len({m["key"] for m in metrics}) == len(metrics)
