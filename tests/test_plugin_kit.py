"""The shared plugin helpers: decode_each and the MatrixUpdates steps of set-node-resource-capacity/-usage,
apply_workloads and usage_from_workloads."""

from __future__ import annotations

import pytest

from schemas.errors import InvalidArgument
from services.allocation.plugins.kit import MatrixUpdates, chosen_source, decode_each


def _count(raw: object, field: str) -> int:
    if not isinstance(raw, int):
        raise InvalidArgument(field, "must be an integer")
    return raw


def test_decode_each_names_each_item_by_its_index():
    assert decode_each([1, 2], _count) == [1, 2]
    with pytest.raises(InvalidArgument) as caught:
        decode_each([1, "x"], _count)
    assert caught.value.field == "workloads_resource[1]"
    with pytest.raises(InvalidArgument) as caught:
        decode_each({"a": 1}, _count, "held")
    assert (caught.value.field, caught.value.message) == ("held", "held: must be a list, got dict")


class Counter(MatrixUpdates[int]):
    """A toy plugin whose node resource is one integer: what the template leaves to a plugin."""

    _empty = int

    def __init__(self) -> None:
        self.steps: list[str] = []

    def _combine(self, a: int, b: int, sign: int) -> int:
        return a + sign * b

    def _record(self, capacity: object, usage: object) -> tuple[int, int]:
        self.steps.append("record")
        return _count(capacity, "capacity"), _count(usage, "usage")

    def _capacity_sources(self, capacity, resource, request, delta):
        self.steps.append("sources")
        return capacity, chosen_source(request, resource, [])

    def _settled_capacity(self, capacity, usage, delta):
        if usage > capacity:
            raise InvalidArgument("usage", "exceeds the capacity")
        return capacity, usage

    def _usage_sources(self, resource, request, workloads, delta):
        return chosen_source(request, resource, decode_each(workloads, _count))

    def _settled_usage(self, capacity, usage):
        return usage

    def _holding(self, raw: object, field: str) -> int:
        self.steps.append(field)
        return _count(raw, field)

    def _usage(self, usage: object) -> int:
        self.steps.append("usage")
        return _count(usage, "usage")

    def _applied_usage(self, usage: int) -> int:
        if usage < 0:
            raise InvalidArgument("usage", "must not be negative")
        return usage

    def _usage_shape(self, capacity: object):
        self.steps.append("capacity")
        return lambda usage: {"capacity": capacity, "usage": usage}


class Totalled(Counter):
    """A plugin that charges the workloads' total at once (as cpumem does)."""

    def _charges(self, holdings: list[int]) -> list[int]:
        self.steps.append(f"total of {len(holdings)}")
        return [self._total(holdings)]


@pytest.mark.parametrize(
    ("delta", "incr", "capacity"),
    [(True, True, 13), (True, False, 7), (False, True, 3), (False, False, 3)],  # absolute always adds
)
def test_set_capacity_runs_erus_matrix(delta, incr, capacity):
    assert Counter().set_capacity(10, 2, None, 3, delta, incr) == (capacity, 2)


def test_set_usage_takes_request_then_resource_then_workloads():
    plugin = Counter()
    assert plugin.set_usage(10, 2, 5, 1, [4], True, True) == 3
    assert plugin.set_usage(10, 2, 5, None, [4], True, True) == 7
    assert plugin.set_usage(10, 2, None, None, [4, 1], True, True) == 7
    assert plugin.set_usage(10, 2, None, None, [4, 1], False, False) == 5


def test_flags_are_checked_first_and_the_settled_result_may_refuse():
    plugin = Counter()
    with pytest.raises(InvalidArgument) as caught:
        plugin.set_capacity("bad", 2, None, 3, None, True)
    assert caught.value.field == "delta" and plugin.steps == []
    with pytest.raises(InvalidArgument) as caught:
        plugin.set_capacity(10, 2, None, 9, True, False)
    assert caught.value.field == "usage" and plugin.steps == ["record", "sources"]


def test_apply_workloads_adds_or_returns_each_holding_after_decoding_them_all():
    plugin = Counter()
    assert plugin.apply_workloads(10, [1, 2], True) == 13 and plugin.apply_workloads(10, [1, 2], False) == 7
    assert plugin.steps == ["workloads_resource[0]", "workloads_resource[1]", "usage"] * 2
    with pytest.raises(InvalidArgument) as caught:
        plugin.apply_workloads(2, [1, 2], False)
    assert caught.value.field == "usage"
    with pytest.raises(InvalidArgument) as caught:
        plugin.apply_workloads("bad", [1, "x"], True)
    assert caught.value.field == "workloads_resource[1]"
    with pytest.raises(InvalidArgument) as caught:
        plugin.apply_workloads(10, [1], 1)
    assert caught.value.field == "incr"


def test_a_plugin_may_charge_the_total_at_once():
    plugin = Totalled()
    assert plugin.apply_workloads(10, [1, 2], False) == 7 and plugin.apply_workloads(10, [], True) == 10
    assert plugin.steps[-2:] == ["total of 0", "usage"]


def test_usage_from_workloads_shapes_the_total_for_the_capacity_read_first():
    plugin = Counter()
    assert plugin.usage_from_workloads(9, [1, 2]) == {"capacity": 9, "usage": 3}
    assert plugin.usage_from_workloads(9, []) == {"capacity": 9, "usage": 0}
    assert plugin.steps == ["capacity", "workloads_resource[0]", "workloads_resource[1]", "capacity"]
