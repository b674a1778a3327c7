"""refusal.py and the plugins' `shortfalls`: why a request could not place, pure and without any
server (the bus tests are in test_allocation_refusals.py)."""

from __future__ import annotations

import pytest

from schemas.errors import BerthError
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity, Shortfall
from services.allocation.plugins.plugin_set import PluginSet
from services.allocation.records import DRAINING, NodeRecord, PluginState, encode_states
from services.allocation.refusal import Verdict, amount, explain, explains, in_words, judge, summary
from services.allocation.worker import make_plugins

GiB = 1 << 30
PLUGINS = PluginSet(make_plugins())


def node(name: str, cpu: int = 4, memory: str = "8G", status: str = "up", *, used: dict | None = None,
         without: tuple[str, ...] = (), **resources) -> NodeRecord:
    """A node's record as add-node makes it (cpumem `cpu` and `memory`, other plugins' resources),
    with cpumem's usage replaced by `used` and the plugins in `without` left out."""
    states = PLUGINS.added(list(PLUGINS), keyed(cpumem={"cpu": cpu, "memory": memory}, **resources), None)
    if used is not None:
        states["cpumem"] = PluginState(states["cpumem"].capacity, {**states["cpumem"].usage, **used})
    raw = encode_states({name: state for name, state in states.items() if name not in without})
    return NodeRecord(name, 1, {}, raw, status=status)


def keyed(**requests) -> dict:
    return {name: requests.get(name) for name in PLUGINS}


BOUND = keyed(cpumem={"cpu-bind": True, "cpu-request": 3, "memory-request": "2G"})


# -- the arithmetic over a selection ----------------------------------------------------------------

def test_summary_counts_each_reason_and_the_largest_shortfall():
    verdicts = [
        Verdict("down"), Verdict(DRAINING), Verdict(DRAINING),
        Verdict(fit=0, lacks={"cpu": Shortfall(1.0, "cores")}),
        Verdict(fit=0, lacks={"cpu": Shortfall(2.5, "cores"), "memory": Shortfall(GiB, "bytes")}),
        Verdict(fit=3),
        Verdict(fit=1),
    ]
    assert summary(verdicts, need=1) == {
        "nodes": 7, "unschedulable": 3, "down": 1, "draining": 2, "with_room": 2,
        "lacking": {"cpu": {"nodes": 2, "largest_shortfall": 2.5, "unit": "cores"},
                    "memory": {"nodes": 1, "largest_shortfall": GiB, "unit": "bytes"}},
        "fit": 4,
    }
    # `each` (or one node alone) wants `need` on a node and counts at most that many a node.
    assert summary(verdicts, need=2, most=2)["fit"] == 3
    assert summary(verdicts, need=2, most=2)["with_room"] == 1


def test_fit_saturates_and_nothing_selected_is_zero():
    assert summary([Verdict(fit=MAX_INT), Verdict(fit=MAX_INT)], need=1)["fit"] == MAX_INT
    assert summary([], need=1) == {"nodes": 0, "unschedulable": 0, "down": 0, "draining": 0, "with_room": 0,
                                   "lacking": {}, "fit": 0}


def test_in_words_names_the_most_common_reason_first():
    told = summary([Verdict("down"), Verdict(fit=0, lacks={"memory": Shortfall(3 * GiB // 2, "bytes")}),
                    Verdict(fit=0, lacks={"cpu": Shortfall(1.0, "cores"), "memory": Shortfall(GiB, "bytes")})], 1)
    assert in_words(told, 1) == ("0/3 selected nodes have room for 1 instance: 1 down, 2 short of memory "
                                 "(by up to 1.5 GiB), 1 short of cpu (by up to 1 core); 0 instances fit")
    assert in_words(summary([Verdict(fit=1), Verdict(fit=1)], 1), 1) == (
        "2/2 selected nodes have room for 1 instance: none is down, draining or short of a resource; 2 instances fit")


@pytest.mark.parametrize("value,unit,words", [
    (1, "instances", "1 instance"), (0, "instances", "0 instances"), (2.5, "cores", "2.5 cores"),
    (1.0, "cores", "1 core"), (GiB, "bytes", "1 GiB"), (80 * GiB, "bytes", "80 GiB"),
    (3 * GiB // 2, "bytes", "1.5 GiB"), (512, "bytes", "512 bytes"), (1 << 40, "bytes", "1 TiB"),
    (1, "cards", "1 card"),
])
def test_amounts_in_words(value, unit, words):
    assert amount(value, unit) == words


def test_explain_keeps_the_refusals_code_and_its_own_details():
    error = BerthError("cannot place 3 instances: the nodes have room for 1", code="insufficient_capacity",
                       details={"wanted": 3, "available": 1, "unit": "instances", "nodes": "kept"})
    told = explain(error, [Verdict(fit=1)], need=1)
    assert (told.code, told.status) == ("insufficient_capacity", 409)
    assert told.details["nodes"] == "kept"  # a key the refusal had is never replaced
    assert (told.details["wanted"], told.details["fit"], told.details["with_room"]) == (3, 1, 1)
    assert told.message.startswith("cannot place 3 instances: the nodes have room for 1; 1/1 selected nodes")


def test_which_refusals_explain_themselves():
    assert explains(BerthError("", code="insufficient_capacity"))
    assert explains(BerthError("", code="insufficient_resource"))
    assert explains(BerthError("", code="node_draining"))
    assert explains(BerthError("", code="node_not_found", field="labels"))
    assert not explains(BerthError("", code="node_not_found", field="nodename"))
    assert not explains(BerthError("", code="workload_exists"))


# -- judging one node -------------------------------------------------------------------------------

def test_judge_a_node_down_or_draining_only_by_its_status_unless_told_to_look():
    drained = node("d1", cpu=1, status=DRAINING)
    assert judge(drained, PLUGINS, BOUND, 1) == Verdict(DRAINING)
    looked = judge(drained, PLUGINS, BOUND, 1, statuses=False)
    assert looked.unschedulable is None and looked.fit == 0 and set(looked.lacks) == {"cpu"}


def test_judge_splits_cpumem_into_cpu_and_memory():
    assert judge(node("c1", cpu=2), PLUGINS, BOUND, 1).lacks == {"cpu": Shortfall(1.0, "cores")}
    assert judge(node("m1", memory="1G"), PLUGINS, BOUND, 1).lacks == {"memory": Shortfall(GiB, "bytes")}
    both = judge(node("b1", cpu=4, memory="3G"), PLUGINS, BOUND, 2)
    assert (both.fit, both.lacks) == (1, {"cpu": Shortfall(2.0, "cores"), "memory": Shortfall(GiB, "bytes")})
    fits = judge(node("ok", cpu=8), PLUGINS, BOUND, 2)
    assert (fits.fit, fits.lacks) == (2, {})


def test_a_node_without_a_plugins_record_lacks_that_plugin_wholly():
    verdict = judge(node("g0", without=("gpu",)), PLUGINS, keyed(), 3)
    assert (verdict.fit, verdict.lacks) == (0, {"gpu": Shortfall(3, "instances")})


def test_judge_shares_the_work_between_nodes_in_the_same_state():
    memo: dict = {}
    for name in ("a", "b", "c"):
        judge(node(name, cpu=2), PLUGINS, BOUND, 1, memo=memo)
    assert len(memo) == len(PLUGINS)  # one entry per plugin: the three nodes' states are equal


class Opaque:
    """A plugin that says how many fit and nothing of why (no `shortfalls`)."""

    name, priority = "opaque", 1

    def deploy_capacity(self, capacity, usage, request):
        return DeployCapacity(capacity["room"], 0.0, 0.0, 1.0)


def test_a_plugin_that_cannot_say_why_lacks_the_instances_that_do_not_fit():
    plugins = PluginSet({"opaque": Opaque()})
    record = NodeRecord("o1", 1, {}, encode_states({"opaque": PluginState({"room": 1}, {})}))
    assert judge(record, plugins, {"opaque": None}, 3).lacks == {"opaque": Shortfall(2, "instances")}


# -- each plugin's shortfalls ------------------------------------------------------------------------

def shortfalls(plugin: str, record: NodeRecord, request: dict | None, count: int) -> dict:
    state = record.plugins[plugin]
    return PLUGINS[plugin].shortfalls(state.capacity, state.usage, request, count)


def test_unbound_cpu_is_short_only_beyond_the_nodes_cores():
    record = node("u1", cpu=2, memory="4G")
    assert shortfalls("cpumem", record, {"cpu-request": 1.5, "memory-request": "1G"}, 4) == {}
    assert shortfalls("cpumem", record, {"cpu-request": 3, "memory-request": "1G"}, 6) == {
        "cpu": Shortfall(1.0, "cores"), "memory": Shortfall(2 * GiB, "bytes")}


def test_bound_cores_free_in_all_but_in_fragments_miss_what_the_instances_ask():
    # Two cores, each half used: a whole core is free in all, but no core is whole.
    record = node("f1", cpu=2, used={"cpu": 1.0, "cpu_map": {"0": 50, "1": 50}})
    assert shortfalls("cpumem", record, {"cpu-bind": True, "cpu-request": 1}, 1) == {"cpu": Shortfall(1.0, "cores")}
    assert shortfalls("cpumem", record, {"cpu-bind": True, "cpu-request": 0.5}, 2) == {}


def test_storage_and_volume_shortfalls_in_bytes():
    record = node("s1", storage={"volumes": ["/a:100G", "/b:100G"], "storage": "0"})
    # A 150G volume fits on neither 100G device, though 200G are free in all: the instance's 150G.
    assert shortfalls("storage", record, {"volumes": ["AUTO:/d:rw:150G"]}, 1) == {
        "volumes": Shortfall(150 * GiB, "bytes")}
    assert shortfalls("storage", record, {"volumes": ["AUTO:/d:rw:80G"]}, 3) == {
        "volumes": Shortfall(40 * GiB, "bytes"), "storage": Shortfall(40 * GiB, "bytes")}


def test_gpu_shortfall_is_the_most_cards_of_one_product():
    record = node("g1", gpu={"prod_count_map": {"a100": 1, "h100": 4}})
    assert shortfalls("gpu", record, {"prod_count_map": {"a100": 1, "h100": 1}}, 3) == {"gpu": Shortfall(2, "cards")}
    assert shortfalls("gpu", record, {"prod_count_map": {"h100": 2}}, 2) == {}
    assert shortfalls("gpu", record, {"prod_count_map": {"v100": 1}}, 1) == {"gpu": Shortfall(1, "cards")}
