"""Unit tests of the gpu plugin's pure core (eru resource-gpu, DESIGN.md §3 and §8)."""

from __future__ import annotations

import math

import pytest

from schemas.errors import BerthError
from services.allocation.plugins.gpu import GpuPlugin
from services.allocation.plugins.interface import EngineInfo


def cards(**counts: int) -> dict:
    return {"prod_count_map": {product.replace("_", "-"): count for product, count in counts.items()}}


def error_of(call, *args) -> tuple[str, str | None]:
    with pytest.raises(BerthError) as caught:
        call(*args)
    return caught.value.code, caught.value.field


@pytest.fixture
def gpu() -> GpuPlugin:
    return GpuPlugin()


@pytest.fixture
def node(gpu):
    """4 nvidia-3090 and 2 a100, none in use."""
    return gpu.add_node(cards(nvidia_3090=4, a100=2), None)


@pytest.fixture
def busy(gpu, node):
    """The node with one workload holding 2 nvidia-3090: (capacity, usage, workload)."""
    _, workloads = gpu.calculate_deploy(*node, 1, cards(nvidia_3090=2))
    return node[0], gpu.apply_workloads(node[1], workloads, True), workloads[0]


def test_identity(gpu):
    assert (gpu.name, gpu.priority) == ("gpu", 100)


# --- node records --------------------------------------------------------------------------------------


def test_add_node(gpu, node):
    assert node == ({"prod_count_map": {"a100": 2, "nvidia-3090": 4}}, {"prod_count_map": {}})


def test_add_node_falls_back_to_the_engine(gpu):
    info = EngineInfo(resources={"gpu": cards(h100=8.0)})
    assert gpu.add_node(None, info)[0] == cards(h100=8)
    assert gpu.add_node({"prod_count_map": {}}, info)[0] == cards(h100=8)
    assert gpu.add_node(cards(a100=1), info)[0] == cards(a100=1)  # requested cards win
    assert gpu.add_node(None, None) == ({"prod_count_map": {}}, {"prod_count_map": {}})
    assert gpu.add_node(cards(a100=0), None)[0] == {"prod_count_map": {}}  # 0 cards: none


@pytest.mark.parametrize(
    ("resource", "field"),
    [
        (cards(a100=-1), "resource.prod_count_map.a100"),
        ({"prod_count_map": {" ": 1}}, "resource.prod_count_map"),
        ({"prod_count_map": {"a100": "1"}}, "resource.prod_count_map.a100"),
        ({"prod_count_map": {"a100": 1.5}}, "resource.prod_count_map.a100"),
        ({"prod_count_map": {"a100": math.inf}}, "resource.prod_count_map.a100"),
        ({"prod_count_map": {"a100": True}}, "resource.prod_count_map.a100"),
        ({"prod_count_map": [1]}, "resource.prod_count_map"),
        ("a100", "resource"),
    ],
)
def test_malformed_maps_are_invalid_argument(gpu, resource, field):
    assert error_of(gpu.add_node, resource, None) == ("invalid_argument", field)


def test_validate_record(gpu, busy):
    gpu.validate_record(busy[0], busy[1])
    for capacity, usage, field in [
        (cards(a100=0), cards(), "capacity.prod_count_map.a100"),  # stored counts are positive (eru)
        (cards(a100=1), cards(a100=2), "usage.prod_count_map.a100"),
        (cards(a100=1), cards(h100=1), "usage.prod_count_map.h100"),
        (cards(a100=1), cards(a100=-1), "usage.prod_count_map.a100"),
        (cards(a100=2**63), cards(), "capacity.prod_count_map.a100"),
    ]:
        assert error_of(gpu.validate_record, capacity, usage) == ("invalid_argument", field)


# --- deploy and capacity -------------------------------------------------------------------------------


def test_deploy_gives_each_instance_the_request(gpu, node):
    engines, workloads = gpu.calculate_deploy(*node, 2, cards(nvidia_3090=2, a100=1))
    assert engines == workloads == [cards(a100=1, nvidia_3090=2)] * 2


def test_deploy_that_does_not_fit(gpu, node):
    with pytest.raises(BerthError) as caught:
        gpu.calculate_deploy(*node, 3, cards(nvidia_3090=2))
    assert caught.value.code == "insufficient_resource"
    assert caught.value.details == {
        "product": "nvidia-3090", "requested": 6, "available": 4, "unit": "cards"
    }
    assert error_of(gpu.calculate_deploy, *node, 1, cards(h100=1))[0] == "insufficient_resource"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (cards(a100=0), "workload_resource_request.prod_count_map.a100"),  # eru: a count must be > 0
        (cards(a100=-1), "workload_resource_request.prod_count_map.a100"),
        ({"prod_count_map": {"": 1}}, "workload_resource_request.prod_count_map"),
    ],
)
def test_deploy_request_errors(gpu, node, request_, field):
    assert error_of(gpu.calculate_deploy, *node, 1, request_) == ("invalid_argument", field)
    assert error_of(gpu.deploy_capacity, *node, request_) == ("invalid_argument", field)


def test_empty_request(gpu, node):
    assert gpu.calculate_deploy(*node, 2, None) == ([cards()] * 2, [cards()] * 2)
    capacity = gpu.deploy_capacity(*node, {})
    assert (capacity.capacity, capacity.usage, capacity.rate, capacity.weight) == (1_000_000, 0.0, 0.0, 1.0)


def test_deploy_capacity(gpu, busy):
    capacity = gpu.deploy_capacity(busy[0], busy[1], cards(nvidia_3090=1, a100=1))
    assert (capacity.capacity, capacity.usage, capacity.rate, capacity.weight) == (2, 2 / 6, 2 / 6, 1.0)
    assert gpu.deploy_capacity(busy[0], busy[1], cards(nvidia_3090=3)).capacity == 0
    assert gpu.deploy_capacity(busy[0], busy[1], cards(h100=1)).capacity == 0
    empty_node = gpu.add_node(None, None)
    assert gpu.deploy_capacity(*empty_node, cards(a100=1)).usage == 0.0


# --- realloc -------------------------------------------------------------------------------------------


def test_realloc_adds_the_delta(gpu, busy):
    engine, delta, new = gpu.calculate_realloc(*busy, cards(nvidia_3090=-1, a100=2))
    assert engine == new == cards(a100=2, nvidia_3090=1)
    assert delta == cards(a100=2, nvidia_3090=-1)  # deltas keep negative counts
    assert gpu.apply_workloads(busy[1], [delta], True) == gpu.usage_from_workloads(busy[0], [new])


def test_realloc_below_zero_drops_the_product(gpu, busy):
    _, delta, new = gpu.calculate_realloc(*busy, cards(nvidia_3090=-5))
    assert new == cards() and delta == cards(nvidia_3090=-2)


def test_realloc_uses_what_the_workload_gives_back(gpu, busy):
    assert gpu.calculate_realloc(*busy, cards(nvidia_3090=2))[2] == cards(nvidia_3090=4)
    with pytest.raises(BerthError) as caught:
        gpu.calculate_realloc(*busy, cards(nvidia_3090=3))
    assert caught.value.code == "insufficient_resource"


def test_realloc_errors(gpu, busy):
    capacity, usage, workload = busy
    assert error_of(gpu.calculate_realloc, capacity, usage, workload, {"prod_count_map": {" ": 1}})[0] == (
        "invalid_argument"
    )
    assert error_of(gpu.calculate_realloc, capacity, usage, cards(a100=0), None) == (
        "invalid_argument",
        "workload_resource.prod_count_map.a100",
    )
    assert error_of(gpu.calculate_realloc, capacity, usage, cards(a100=1), None) == (
        "invalid_argument",
        "workload_resource.prod_count_map",
    )


def test_remap_never_changes_cards(gpu, busy):
    assert gpu.calculate_remap(busy[0], busy[1], {"w": busy[2]}) == {}


# --- node operations -----------------------------------------------------------------------------------


def test_capacity_matrix(gpu, busy):
    capacity, usage, _ = busy
    assert gpu.set_capacity(capacity, usage, None, cards(h100=1), True, True)[0] == cards(
        a100=2, h100=1, nvidia_3090=4
    )
    assert gpu.set_capacity(capacity, usage, None, cards(a100=2), True, False)[0] == cards(nvidia_3090=4)
    assert gpu.set_capacity(capacity, usage, None, cards(nvidia_3090=3), False, False)[0] == cards(
        nvidia_3090=3
    )
    assert gpu.set_capacity(capacity, usage, None, {}, False, True)[0] == capacity  # keeps what it leaves out
    assert gpu.set_capacity(capacity, usage, cards(nvidia_3090=2), None, False, True)[0] == cards(
        nvidia_3090=2
    )
    assert gpu.set_capacity(capacity, usage, None, None, True, True) == (capacity, usage)


def test_capacity_cannot_drop_below_usage(gpu, busy):
    capacity, usage, _ = busy
    assert error_of(gpu.set_capacity, capacity, usage, None, cards(nvidia_3090=-3), True, True) == (
        "invalid_argument",
        "usage.prod_count_map.nvidia-3090",
    )
    assert (
        error_of(gpu.set_capacity, capacity, usage, None, cards(a100=-1), False, True)[0]
        == "invalid_argument"
    )
    assert error_of(gpu.set_capacity, capacity, usage, None, cards(a100=-3), True, True) == (
        "invalid_argument",
        "capacity.prod_count_map.a100",
    )


def test_capacity_rollback_with_before_is_exact(gpu, busy):
    before, usage, _ = busy
    after, _ = gpu.set_capacity(before, usage, None, cards(h100=2, a100=-1), True, True)
    assert gpu.set_capacity(after, usage, before, None, False, False) == (before, usage)
    assert gpu.set_capacity(after, usage, None, before, False, False) == (before, usage)


def test_usage_matrix_and_source_priority(gpu, busy):
    capacity, usage, workload = busy
    empty = cards()
    assert gpu.set_usage(capacity, empty, None, None, [workload], True, True) == usage
    assert gpu.set_usage(capacity, usage, None, None, [workload], True, False) == empty
    assert gpu.set_usage(capacity, usage, None, None, [workload, workload], False, False) == cards(
        nvidia_3090=4
    )
    assert gpu.set_usage(capacity, usage, empty, None, [workload], False, True) == empty
    assert gpu.set_usage(capacity, usage, empty, cards(a100=1), [workload], False, True) == cards(a100=1)
    assert gpu.set_usage(capacity, usage, None, cards(a100=1), [], True, True) == cards(a100=1, nvidia_3090=2)
    assert (
        error_of(gpu.set_usage, capacity, empty, None, None, [workload], True, False)[0] == "invalid_argument"
    )
    assert (
        error_of(gpu.set_usage, capacity, usage, None, cards(a100=3), [], False, True)[0]
        == "invalid_argument"
    )


def test_apply_and_release(gpu, busy):
    _, usage, workload = busy
    assert gpu.apply_workloads(usage, [workload], False) == cards()
    assert error_of(gpu.apply_workloads, cards(), [workload], False) == (
        "invalid_argument",
        "usage.prod_count_map.nvidia-3090",
    )
    assert error_of(gpu.apply_workloads, usage, [workload], "yes")[0] == "invalid_argument"


def test_apply_workloads_pins_errors_and_leaves_usage_alone_without_workloads(gpu):
    """The shared kit's apply_workloads, pinned: the message when usage would go negative, workloads decoded
    before the usage, and no workloads leaving the usage as stored (so a stored 0 is still refused)."""
    with pytest.raises(BerthError) as caught:
        gpu.apply_workloads(cards(a=1), [cards(a=2)], False)
    assert caught.value.message == "usage.prod_count_map.a: must be at least 1, got -1"
    assert error_of(gpu.apply_workloads, "bad", ["bad"], True)[1] == "workloads_resource[0]"
    assert error_of(gpu.apply_workloads, cards(a=0), [], True)[1] == "usage.prod_count_map.a"


def test_usage_from_workloads_never_reads_the_capacity(gpu):
    assert gpu.usage_from_workloads("bad", [cards(b=1, a=2)]) == {"prod_count_map": {"a": 2, "b": 1}}


def test_diffs(gpu, busy):
    capacity, usage, workload = busy
    assert gpu.diffs(capacity, usage, [workload]) == []
    assert gpu.diffs(capacity, usage, [cards(a100=1)]) == [
        "node.GPUUsed != sum(workload.GPURequest): 2 != 1",
        "a100 not in usage",
        "nvidia-3090: actual(0) != usage(2)",
    ]
    assert gpu.diffs(capacity, usage, [cards(nvidia_3090=1), cards(nvidia_3090=1)]) == []


def test_usage_from_workloads(gpu, busy):
    capacity, usage, workload = busy
    assert gpu.usage_from_workloads(capacity, [workload]) == usage
    assert gpu.usage_from_workloads(capacity, []) == cards()


def test_load(gpu, busy):
    assert gpu.load(busy[0], busy[1]) == pytest.approx(2 / 6)
    assert gpu.load(*gpu.add_node(None, None)) == 0.0  # no cards reads as idle (eru)


def test_metrics(gpu, busy):
    labels = ["podname", "nodename", "product"]
    assert gpu.metrics_description() == [
        {"name": "gpu_capacity", "help": "node available gpu.", "type": "gauge", "labels": labels},
        {"name": "gpu_used", "help": "node used gpu.", "type": "gauge", "labels": labels},
    ]
    assert gpu.metrics("pod", "n.1", busy[0], busy[1]) == [
        {
            "name": "gpu_capacity",
            "labels": ["pod", "n.1", "a100"],
            "key": "core.node.n_1.gpu.a100.capacity",
            "value": 2,
        },
        {
            "name": "gpu_capacity",
            "labels": ["pod", "n.1", "nvidia-3090"],
            "key": "core.node.n_1.gpu.nvidia-3090.capacity",
            "value": 4,
        },
        {
            "name": "gpu_used",
            "labels": ["pod", "n.1", "a100"],
            "key": "core.node.n_1.gpu.a100.used",
            "value": 0,
        },
        {
            "name": "gpu_used",
            "labels": ["pod", "n.1", "nvidia-3090"],
            "key": "core.node.n_1.gpu.nvidia-3090.used",
            "value": 2,
        },
    ]
