"""PluginSet: fan-out to each plugin and merge of the answers, pure and without any server."""

from __future__ import annotations

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from schemas.errors import BerthError
from services.allocation.plugins.interface import DeployCapacity
from services.allocation.plugins.plugin_set import PluginSet, capacities, per_instance, split, usages
from services.allocation.records import NodeRecord, PluginState, decode_state, encode_state
from services.allocation.worker import make_plugins

Raw = dict


class Slots:
    """A toy plugin: a node has `slots`, an instance takes `n` of them (its request, default 1).
    `deploy_capacity` answers what the capacity map says (`cap`, `usage`, `rate`, `weight`), so a
    test can give each plugin any answer."""

    def __init__(self, name: str, priority: int = 1) -> None:
        self.name = name
        self.priority = priority
        self.asked = 0

    def add_node(self, resource, info):
        return {"slots": (resource or {}).get("slots", 0)}, {"used": 0}

    def validate_record(self, capacity, usage):
        if usage.get("used", 0) > capacity.get("slots", 0):
            raise BerthError("usage.used: more than the slots", code="invalid_argument", field="usage.used")

    def calculate_deploy(self, capacity, usage, count, request):
        n = (request or {}).get("n", 1)
        if usage["used"] + n * count > capacity["slots"]:
            raise BerthError("not enough slots", code="insufficient_resource")
        return [{"first": usage["used"] + i * n} for i in range(count)], [{"n": n} for _ in range(count)]

    def calculate_realloc(self, capacity, usage, workload, request):
        more = (request or {}).get("n", 0)
        return {"n": workload.get("n", 0) + more}, {"n": more}, {"n": workload.get("n", 0) + more}

    def calculate_remap(self, capacity, usage, workloads):
        return {wid: {"moved": self.name} for wid, workload in workloads.items() if workload.get("n")}

    def deploy_capacity(self, capacity, usage, request):
        self.asked += 1
        return DeployCapacity(capacity["cap"], capacity["usage"], capacity["rate"], capacity["weight"])

    def set_capacity(self, capacity, usage, resource, request, delta, incr):
        slots = (resource or {}).get("slots", 0)
        return {"slots": capacity["slots"] + slots if delta else slots}, usage

    def set_usage(self, capacity, usage, resource, request, workloads, delta, incr):
        return {"used": sum(w.get("n", 0) for w in workloads)}

    def apply_workloads(self, usage, workloads, incr):
        total = sum(w.get("n", 0) for w in workloads)
        return {"used": usage["used"] + (total if incr else -total)}

    def usage_from_workloads(self, capacity, workloads):
        return {"used": sum(w.get("n", 0) for w in workloads)}

    def diffs(self, capacity, usage, workloads):
        explained = sum(w.get("n", 0) for w in workloads)
        return [] if explained == usage["used"] else [f"{self.name}: used {usage['used']} != {explained}"]

    def load(self, capacity, usage):
        return usage["used"] / capacity["slots"]

    def metrics_description(self):
        return [{"name": f"{self.name}_used", "help": "", "type": "gauge", "labels": []}]

    def metrics(self, podname, nodename, capacity, usage):
        return [{"name": f"{self.name}_used", "labels": [podname, nodename], "key": "", "value": usage["used"]}]


def record(node: str, states: dict[str, PluginState]) -> NodeRecord:
    return NodeRecord(node, 1, {}, {name: encode_state(state) for name, state in states.items()})


def slots(count: int, used: int = 0) -> PluginState:
    return PluginState({"slots": count}, {"used": used})


answers = st.builds(
    DeployCapacity,
    capacity=st.integers(-2, 50),
    usage=st.floats(0, 1),
    rate=st.floats(0, 1),
    weight=st.floats(0, 10),
)


@given(st.lists(answers, min_size=1, max_size=4))
def test_capacity_of_the_set_is_the_minimum_over_its_plugins(per_plugin):
    names = [f"p{i}" for i in range(len(per_plugin))]
    plugins = PluginSet({name: Slots(name) for name in names})
    node = record("n1", {
        name: PluginState({"cap": a.capacity, "usage": a.usage, "rate": a.rate, "weight": a.weight}, {})
        for name, a in zip(names, per_plugin)
    })
    requests = dict.fromkeys(names)
    merged = plugins.capacity_function(names, requests, dict.fromkeys(names, b""), strict=True)(node)
    if any(a.capacity <= 0 for a in per_plugin):
        event("a plugin has no room: the node has none")
        assert merged is None
        return
    event("every plugin has room")
    assert merged is not None
    assert merged.capacity == min(a.capacity for a in per_plugin)
    assert merged.weight == pytest.approx(sum(a.weight for a in per_plugin))
    weight = sum(a.weight for a in per_plugin)
    assume(weight > 1e-6)  # a weightless node's rate and usage are 0 by definition
    assert merged.rate == pytest.approx(sum(a.rate * a.weight for a in per_plugin) / weight)
    assert min(a.usage for a in per_plugin) - 1e-9 <= merged.usage <= max(a.usage for a in per_plugin) + 1e-9


def test_capacity_is_memoised_on_the_stored_bytes():
    plugin = Slots("p")
    plugins = PluginSet({"p": plugin})
    state = PluginState({"cap": 3, "usage": 0.5, "rate": 0.1, "weight": 1.0}, {})
    compute = plugins.capacity_function(["p"], {"p": None}, {"p": b"\xc0"}, strict=True)
    for node in ("n1", "n2", "n3"):  # identical machines are planned once
        assert compute(record(node, {"p": state})).capacity == 3
    assert plugin.asked == 1


def test_a_node_without_the_plugin_is_missing_when_listed_and_full_otherwise():
    plugins = PluginSet({"p": Slots("p"), "q": Slots("q")})
    node = record("n1", {"p": PluginState({"cap": 3, "usage": 0.0, "rate": 0.0, "weight": 1.0}, {})})
    requests, keys = {"p": None, "q": None}, {"p": b"", "q": b""}
    assert plugins.capacity_function(["p", "q"], requests, keys, strict=False)(node) is None
    with pytest.raises(BerthError) as raised:
        plugins.capacity_function(["p", "q"], requests, keys, strict=True)(node)
    assert raised.value.code == "node_not_found" and raised.value.details["plugin"] == "q"
    with pytest.raises(BerthError):
        plugins.states(node, ["p", "q"])
    assert list(plugins.states(node, ["p"])) == ["p"]


@given(st.integers(1, 6), st.integers(0, 3), st.integers(0, 3))
def test_deploy_merges_each_instance_by_plugin(count, used_a, used_b):
    plugins = PluginSet({"a": Slots("a"), "b": Slots("b")})
    states = {"a": slots(20, used_a), "b": slots(20, used_b)}
    deployment = plugins.deploy(states, count, {"a": {"n": 2}, "b": None})
    assert len(deployment.engines_params) == len(deployment.workloads_resource) == count
    for i in range(count):
        assert deployment.engines_params[i] == {"a": {"first": used_a + 2 * i}, "b": {"first": used_b + i}}
        assert deployment.workloads_resource[i] == {"a": {"n": 2}, "b": {"n": 1}}


@given(st.integers(1, 5), st.integers(0, 12))
def test_deploy_on_stored_states_is_deploy_then_apply(count, used):
    plugins = PluginSet({"a": Slots("a"), "b": Slots("b")})
    states = {"a": slots(12, used), "b": slots(12, 0)}
    stored = {name: encode_state(state) for name, state in states.items()}
    requests = {"a": None, "b": {"n": 2}}
    keys = {"a": b"a", "b": b"b2"}
    try:
        expected = plugins.deploy(states, count, requests)
    except BerthError as error:
        event("does not fit")
        with pytest.raises(BerthError) as raised:
            plugins.deploy_stored("n1", stored, count, requests, keys)
        assert raised.value.code == error.code and raised.value.details["plugin"] == error.details["plugin"]
        return
    event("fits")
    deployment, after = plugins.deploy_stored("n1", stored, count, requests, keys)
    assert deployment == expected
    assert decode_state(after["a"]).usage == {"used": used + count}
    assert decode_state(after["b"]).usage == {"used": 2 * count}
    again, after_again = plugins.deploy_stored("n1", stored, count, requests, keys)  # from the memo
    assert again == deployment and after_again == after


@given(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5))
def test_realloc_gives_back_the_old_resource_and_takes_the_new(held, more, others):
    plugins = PluginSet({"a": Slots("a")})
    states = {"a": slots(100, held + others)}
    result = plugins.realloc(states, {"a": {"n": held}}, {"a": {"n": more}})
    assert result.workload_resource == {"a": {"n": held + more}} and result.delta_resource == {"a": {"n": more}}
    after = plugins.reallocated(states, {"a": {"n": held}}, result.workload_resource)
    assert after["a"].usage == {"used": others + held + more}
    assert after["a"].capacity == states["a"].capacity


@given(st.lists(st.integers(0, 4), max_size=5), st.integers(0, 10))
def test_released_and_fixed_agree_with_the_workloads(sizes, others):
    plugins = PluginSet({"a": Slots("a"), "b": Slots("b")})
    workloads = [{"a": {"n": n}, "b": {"n": 2 * n}} for n in sizes]
    total = sum(sizes)
    states = {"a": slots(100, total + others), "b": slots(100, 2 * total), "gone": slots(1)}
    released = plugins.released(states, workloads)
    assert set(released) == {"a", "b"}  # a plugin this worker does not run is left alone
    assert released["a"].usage == {"used": others} and released["b"].usage == {"used": 0}
    known = {"a": states["a"], "b": states["b"]}
    diffs = plugins.diffs(known, workloads)
    assert diffs == ([] if others == 0 else [f"a: used {total + others} != {total}"])
    event("usage explained" if not diffs else "usage off")
    fixed = plugins.fixed(known, workloads)
    assert plugins.diffs(fixed, workloads) == []


@given(st.dictionaries(st.sampled_from(["n1", "n2", "n3", "n4"]), st.tuples(st.integers(0, 9), st.integers(0, 9)),
                       min_size=1))
def test_most_idle_is_decided_by_the_highest_priority_plugin(used):
    plugins = PluginSet({"low": Slots("low", priority=1), "high": Slots("high", priority=100)})
    nodes = {node: {"low": slots(10, low), "high": slots(10, high)} for node, (low, high) in used.items()}
    node, priority = plugins.most_idle(["low", "high"], nodes)
    assert priority == 100
    assert node == min(used, key=lambda n: (used[n][1], n))
    if len({high for _, high in used.values()}) < len(used):
        event("a tie, broken by name")


def test_add_set_and_validate_go_to_each_selected_plugin():
    plugins = PluginSet({"a": Slots("a"), "b": Slots("b")})
    added = plugins.added(["a"], {"a": {"slots": 4}, "b": {"slots": 9}}, None)
    assert added == {"a": slots(4)}
    grown = plugins.with_capacity(added, {"a": {"slots": 2}}, {"a": None}, True, True)
    assert capacities(grown) == {"a": {"slots": 6}} and usages(grown) == {"a": {"used": 0}}
    used = plugins.with_usage(grown, {"a": None}, {"a": None}, [{"a": {"n": 3}}, {"b": {"n": 1}}], False, True)
    assert usages(used) == {"a": {"used": 3}}
    with pytest.raises(BerthError) as raised:
        plugins.validate({"a": slots(1, 2)})
    assert raised.value.details["plugin"] == "a"  # errors say which plugin raised them


def test_remap_metrics_and_names():
    plugins = PluginSet({"a": Slots("a"), "b": Slots("b")})
    states = {"a": slots(4, 1), "b": slots(4, 0)}
    remapped = plugins.remap(states, {"w2": {"a": {"n": 1}}, "w1": {"a": {"n": 1}, "b": {"n": 1}}, "w3": None})
    assert list(remapped) == ["w1", "w2"]
    assert remapped["w1"] == {"a": {"moved": "a"}, "b": {"moved": "b"}}
    assert [m["value"] for m in plugins.metrics(states, "pod", "n1")] == [1, 0]
    assert [d["name"] for d in plugins.metrics_description(["b"])] == ["b_used"]
    assert list(plugins) == ["a", "b"] and "a" in plugins and len(plugins) == 2
    assert plugins.covers(["a", "b"]) and not plugins.covers(["a"])
    assert split([{"a": {"n": 1}}, None, {"b": {}}], "a") == [{"n": 1}, {}, {}]
    assert per_instance(2, [("a", [1, 2], [3, 4])]).engines_params == [{"a": 1}, {"a": 2}]


def test_the_real_plugins_deploy_through_the_set():
    plugins = PluginSet(make_plugins())
    states = plugins.added(list(plugins), {"cpumem": {"cpu": 4, "memory": "8G"}, "storage": None, "gpu": None}, None)
    requests = {"cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": 1 << 30}, "storage": None, "gpu": None}
    deployment = plugins.deploy(states, 2, requests)
    assert [list(engine) for engine in deployment.engines_params] == [["cpumem", "storage", "gpu"]] * 2
    cpus = [engine["cpumem"]["cpu_map"] for engine in deployment.engines_params]
    assert all(len(cpu) == 1 for cpu in cpus) and cpus[0] != cpus[1]
