"""The metric store: reads that tell a missing entity from a missing metric, staleness, external
puts with TTLs, pod and cgroup clean-up, and katalyst's aggregation rules."""

from __future__ import annotations

import math

import pytest

from schemas.errors import BerthError, InvalidArgument
from schemas.metric_scopes import MetricValue, PodRef
from services.metrics.errors import MetricExpired, MetricNotFound
from services.metrics.provisioners import Sample
from services.metrics.store import Store


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> Store:
    return Store(clock=clock)


def write(store: Store, scope: str, ids: tuple, metric: str, value: float, time: float = 999_990.0) -> None:
    store.write([Sample(scope, ids, metric, value, time)])


def error_of(call) -> BerthError:
    with pytest.raises(BerthError) as caught:
        call()
    return caught.value


# ------------------------------------------------------------------------------------ get


def test_get_returns_value_and_sample_time(store):
    write(store, "node", (), "mem.total.system", 42.0, time=123.5)
    assert store.get("node", "mem.total.system") == MetricValue(42.0, 123.5)
    write(store, "node", (), "mem.total.system", 43.0, time=124.5)
    assert store.get("node", "mem.total.system") == MetricValue(43.0, 124.5)


def test_missing_node_metric_names_the_metric(store):
    error = error_of(lambda: store.get("node", "cpu.usage.system"))
    assert isinstance(error, MetricNotFound) and error.code == "metric_not_found" and error.status == 404
    assert error.details["missing"] == "metric" and error.details["metric"] == "cpu.usage.system"


def test_missing_cpu_is_an_entity_error(store):
    write(store, "cpu", (0,), "cpu.usage.ratio.cpu", 0.5)
    error = error_of(lambda: store.get("cpu", "cpu.usage.ratio.cpu", {"core_id": 7}))
    assert error.details == {
        "missing": "entity", "entity": "cpu", "scope": "cpu", "metric": "cpu.usage.ratio.cpu", "core_id": 7,
    }  # fmt: skip
    error = error_of(lambda: store.get("cpu", "cpu.iowait.ratio.cpu", {"core_id": 0}))
    assert error.details["missing"] == "metric" and error.details["core_id"] == 0


def test_container_lookup_names_the_pod_or_the_container(store):
    write(store, "container", ("pod-a", "app"), "mem.rss.container", 1.0)
    pod = error_of(
        lambda: store.get("container", "mem.rss.container", {"pod_uid": "pod-x", "container": "app"})
    )
    assert (pod.details["missing"], pod.details["entity"], pod.details["pod_uid"]) == (
        "entity",
        "pod",
        "pod-x",
    )
    assert "pod-x" in pod.message
    ctr = error_of(
        lambda: store.get("container", "mem.rss.container", {"pod_uid": "pod-a", "container": "db"})
    )
    assert (ctr.details["entity"], ctr.details["container"]) == ("container", "db")
    metric = error_of(
        lambda: store.get("container", "mem.cache.container", {"pod_uid": "pod-a", "container": "app"})
    )
    assert metric.details["missing"] == "metric" and metric.details["metric"] == "mem.cache.container"


def test_container_numa_lookup_names_the_numa_node(store):
    write(store, "container-numa", ("pod-a", "app", 0), "mem.anon.numa.container", 1.0)
    error = error_of(
        lambda: store.get(
            "container-numa",
            "mem.anon.numa.container",
            {"pod_uid": "pod-a", "container": "app", "numa_id": 1},
        )
    )
    assert (error.details["entity"], error.details["numa_id"]) == ("numa", 1)


def test_cgroup_lookup(store):
    write(store, "cgroup", ("/kubepods/burstable",), "mem.usage.cgroup", 5.0)
    assert store.get("cgroup", "mem.usage.cgroup", {"cgroup_path": "/kubepods/burstable"}).value == 5.0
    error = error_of(lambda: store.get("cgroup", "mem.usage.cgroup", {"cgroup_path": "/kubepods/besteffort"}))
    assert error.details["entity"] == "cgroup"


@pytest.mark.parametrize(
    ("scope", "ids", "field"),
    [
        ("galaxy", {}, "scope"),
        ("cpu", {}, "core_id"),
        ("cpu", {"core_id": "0"}, "core_id"),
        ("cpu", {"core_id": True}, "core_id"),
        ("numa", {"numa_id": -1}, "numa_id"),
        ("container", {"pod_uid": "p"}, "container"),
        ("device", {"device": ""}, "device"),
    ],
)
def test_bad_ids_are_invalid_arguments_naming_the_field(store, scope, ids, field):
    error = error_of(lambda: store.get(scope, "m", ids))
    assert isinstance(error, InvalidArgument) and error.field == field


def test_unknown_ids_are_ignored(store):
    write(store, "node", (), "mem.total.system", 1.0)
    assert store.get("node", "mem.total.system", {"core_id": 3, "extra": "x"}).value == 1.0


# --------------------------------------------------------------------------------- expiry


def test_insurance_period_is_off_by_default(store, clock):
    write(store, "node", (), "m", 1.0, time=10.0)
    assert store.get("node", "m").value == 1.0


def test_insurance_period_is_at_least_a_minute():
    assert Store(insurance_seconds=5).insurance_seconds == 60
    assert Store(insurance_seconds=90).insurance_seconds == 90
    with pytest.raises(ValueError):
        Store(insurance_seconds=math.nan)


def test_expired_value_travels_with_the_error(clock):
    store = Store(insurance_seconds=60, clock=clock)
    write(store, "numa", (0,), "mem.free.numa", 7.0, time=clock.now - 30)
    assert store.get("numa", "mem.free.numa", {"numa_id": 0}).value == 7.0
    write(store, "numa", (0,), "mem.free.numa", 8.0, time=clock.now - 61)
    error = error_of(lambda: store.get("numa", "mem.free.numa", {"numa_id": 0}))
    assert isinstance(error, MetricExpired) and error.code == "metric_expired" and error.status == 412
    assert (error.details["value"], error.details["time"]) == (8.0, clock.now - 61)
    assert error.data == MetricValue(8.0, clock.now - 61)


def test_epoch_time_is_never_stale(clock):
    store = Store(insurance_seconds=60, clock=clock)
    write(store, "node", (), "m", 1.0, time=0.0)
    assert store.get("node", "m") == MetricValue(1.0, 0.0)


def test_aggregates_are_not_checked_for_staleness(clock):
    store = Store(insurance_seconds=60, clock=clock)
    write(store, "cpu", (0,), "cpu.usage.ratio.cpu", 0.5, time=1.0)
    assert store.aggregate("cores", "sum", "cpu.usage.ratio.cpu", cpuset="0") == MetricValue(0.5, clock.now)


# ------------------------------------------------------------------------------------ put


def test_put_without_time_uses_now(store, clock):
    assert store.put("node", "external.score", 3) == MetricValue(3.0, clock.now)
    assert store.get("node", "external.score") == MetricValue(3.0, clock.now)
    store.put("device", "io.custom", 1.5, {"device": "vda"}, time=12.0)
    assert store.get("device", "io.custom", {"device": "vda"}) == MetricValue(1.5, 12.0)


def test_put_with_ttl_expires(store, clock):
    store.put("container", "custom.qps", 10, {"pod_uid": "p", "container": "c"}, ttl_seconds=30)
    clock.now += 29
    assert store.get("container", "custom.qps", {"pod_uid": "p", "container": "c"}).value == 10
    clock.now += 2
    error = error_of(lambda: store.get("container", "custom.qps", {"pod_uid": "p", "container": "c"}))
    assert error.code == "metric_not_found" and error.details["entity"] == "pod"  # nothing else was stored
    assert store.list() == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"value": math.nan}, "value"),
        ({"value": math.inf}, "value"),
        ({"value": "1"}, "value"),
        ({"value": True}, "value"),
        ({"value": 1, "time": -1}, "time"),
        ({"value": 1, "ttl_seconds": 0}, "ttl_seconds"),
        ({"value": 1, "metric": ""}, "metric"),
    ],
)
def test_put_rejects_bad_values(store, kwargs, field):
    arguments = {"scope": "node", "metric": "m", **kwargs}
    error = error_of(lambda: store.put(**arguments))
    assert isinstance(error, InvalidArgument) and error.field == field


# ----------------------------------------------------------------------------------- list


def test_list_is_ordered_and_filtered(store):
    write(store, "cpu", (1,), "cpu.usage.ratio.cpu", 0.2)
    write(store, "cpu", (0,), "cpu.usage.ratio.cpu", 0.1)
    write(store, "node", (), "mem.total.system", 1.0)
    entries = store.list()
    assert [(e.scope, e.ids) for e in entries] == [
        ("node", {}),
        ("cpu", {"core_id": 0}),
        ("cpu", {"core_id": 1}),
    ]
    assert [e.value for e in store.list("cpu")] == [0.1, 0.2]
    assert error_of(lambda: store.list("pods")).code == "invalid_argument"


# ------------------------------------------------------------------------------- clean-up


def pod_entries(store: Store) -> set[tuple]:
    return {(e.scope, tuple(e.ids.values()), e.metric) for e in store.list() if e.scope != "node"}


def test_retain_pods_removes_dead_pods_from_every_pod_scope(store):
    for pod in ("alive", "dead"):
        write(store, "container", (pod, "app"), "mem.rss.container", 1.0)
        write(store, "container-numa", (pod, "app", 0), "mem.anon.numa.container", 1.0)
        write(store, "pod-volume", (pod, "data"), "used.volume.pod.container", 1.0)
    write(store, "node", (), "mem.total.system", 1.0)
    assert store.retain_pods({"alive": ["app"]}) == 3
    assert pod_entries(store) == {
        ("container", ("alive", "app"), "mem.rss.container"),
        ("container-numa", ("alive", "app", 0), "mem.anon.numa.container"),
        ("pod-volume", ("alive", "data"), "used.volume.pod.container"),
    }
    assert store.get("node", "mem.total.system").value == 1.0
    error = error_of(
        lambda: store.get("pod-volume", "used.volume.pod.container", {"pod_uid": "dead", "volume": "data"})
    )
    assert error.details["entity"] == "pod"


def test_retain_pods_removes_containers_that_are_gone(store):
    write(store, "container", ("p", "old-id"), "mem.rss.container", 1.0)
    write(store, "container", ("p", "new-id"), "mem.rss.container", 2.0)
    write(store, "pod-volume", ("p", "data"), "used.volume.pod.container", 1.0)
    store.retain_pods({"p": ["new-id"]})
    assert pod_entries(store) == {
        ("container", ("p", "new-id"), "mem.rss.container"),
        ("pod-volume", ("p", "data"), "used.volume.pod.container"),
    }


def test_clean_up_never_removes_put_entries(store):
    write(store, "container", ("dead", "app"), "mem.rss.container", 1.0)
    store.put("container", "custom.qps", 5, {"pod_uid": "dead", "container": "app"})
    store.put("pod-volume", "used.volume.pod.container", 5, {"pod_uid": "dead", "volume": "v"})
    store.put("cgroup", "custom.cg", 5, {"cgroup_path": "/gone"})
    write(store, "cgroup", ("/gone",), "mem.usage.cgroup", 1.0)
    write(store, "cgroup-numa", ("/gone", 0), "mem.anon.numa.cgroup", 1.0)
    assert store.retain_pods({}) == 1
    assert store.retain_cgroups(["/kubepods"]) == 2
    assert pod_entries(store) == {
        ("container", ("dead", "app"), "custom.qps"),
        ("pod-volume", ("dead", "v"), "used.volume.pod.container"),
        ("cgroup", ("/gone",), "custom.cg"),
    }


# ---------------------------------------------------------------------------- aggregation


def test_cores_sum_and_avg_divide_by_cpus_with_data(store, clock):
    # katalyst's test: cpu0=1, cpu1=2, cpu2=1, cpu3 missing
    for cpu, value in ((0, 1.0), (1, 2.0), (2, 1.0)):
        write(store, "cpu", (cpu,), "cpu.usage.ratio.cpu", value)
    assert store.aggregate("cores", "sum", "cpu.usage.ratio.cpu", cpuset="0-3") == MetricValue(4.0, clock.now)
    assert store.aggregate("cores", "avg", "cpu.usage.ratio.cpu", cpuset="0-3").value == pytest.approx(4 / 3)
    assert store.aggregate("cores", "avg", "cpu.usage.ratio.cpu", cpuset=[2, 0, 0]).value == 1.0


def test_pods_sum_and_avg_divide_by_pods_with_data(store):
    # katalyst's test: pod1 {c1=1, c2=1}, pod2 {c3=1}, and a pod without data
    write(store, "container", ("pod1", "c1"), "m", 1.0)
    write(store, "container", ("pod1", "c2"), "m", 1.0)
    write(store, "container", ("pod2", "c3"), "m", 1.0)
    pods = [PodRef("pod1", ["c1", "c2"]), PodRef("pod2", ["c3"]), PodRef("pod3", ["c4"])]
    assert store.aggregate("pods", "sum", "m", pods=pods).value == 3.0
    assert store.aggregate("pods", "avg", "m", pods=pods).value == 1.5


def test_a_pod_listed_twice_counts_once(store):
    write(store, "container", ("pod1", "c1"), "m", 2.0)
    write(store, "container", ("pod2", "c1"), "m", 4.0)
    pods = [PodRef("pod1", ["c1"]), PodRef("pod1", ["c1"]), PodRef("pod2", ["c1", "c1"])]
    assert store.aggregate("pods", "sum", "m", pods=pods).value == 6.0
    assert store.aggregate("pods", "avg", "m", pods=pods).value == 3.0


def test_a_repeated_pod_counts_if_its_first_listing_found_nothing(store):
    # katalyst only remembers pods that contributed, so a later listing of the same pod can count
    write(store, "container", ("pod1", "c1"), "m", 2.0)
    pods = [PodRef("pod1", ["other"]), PodRef("pod1", ["c1"]), PodRef("pod1", ["c1"])]
    assert store.aggregate("pods", "sum", "m", pods=pods).value == 2.0


def test_pods_numa_uses_container_numa_values(store):
    write(store, "container-numa", ("pod1", "c1", 0), "mem.anon.numa.container", 10.0)
    write(store, "container-numa", ("pod1", "c1", 1), "mem.anon.numa.container", 20.0)
    write(store, "container-numa", ("pod2", "c1", 1), "mem.anon.numa.container", 40.0)
    pods = [PodRef("pod1", ["c1"]), PodRef("pod2", ["c1"])]
    assert store.aggregate("pods-numa", "sum", "mem.anon.numa.container", pods=pods, numa_id=1).value == 60.0
    assert store.aggregate("pods-numa", "avg", "mem.anon.numa.container", pods=pods, numa_id=0).value == 10.0


def test_no_data_gives_zero_at_now(store, clock):
    assert store.aggregate("pods", "avg", "m", pods=[PodRef("nobody", ["c"])]) == MetricValue(0.0, clock.now)
    assert store.aggregate("cores", "sum", "m", cpuset="") == MetricValue(0.0, clock.now)


def test_aggregate_time_is_the_newest_sample_and_at_least_now(store, clock):
    write(store, "cpu", (0,), "m", 1.0, time=clock.now - 5)
    assert store.aggregate("cores", "sum", "m", cpuset="0").time == clock.now
    write(store, "cpu", (1,), "m", 1.0, time=clock.now + 5)  # a source clock ahead of ours
    assert store.aggregate("cores", "sum", "m", cpuset="0-1").time == clock.now + 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "pods", "agg": "max"}, "agg"),
        ({"kind": "nodes", "agg": "sum"}, "kind"),
        ({"kind": "cores", "agg": "sum", "cpuset": "3-1"}, "cpuset"),
        ({"kind": "cores", "agg": "sum", "cpuset": [-1]}, "cpuset"),
        ({"kind": "cores", "agg": "sum"}, "cpuset"),
        ({"kind": "pods-numa", "agg": "sum"}, "numa_id"),
        ({"kind": "pods", "agg": "sum", "pods": [PodRef("", ["c"])]}, "pods"),
    ],
)
def test_aggregate_rejects_bad_requests(store, kwargs, field):
    error = error_of(lambda: store.aggregate(metric="m", **kwargs))
    assert isinstance(error, InvalidArgument) and error.field == field
