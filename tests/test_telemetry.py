"""Prometheus metrics of real worker processes (`--metrics-port 0`), scraped over HTTP.

Each test starts workers that pick a free port and name it in their ready line, makes real
requests, scrapes `/metrics` with a plain HTTP client and reads it with prometheus_client's own
parser: request counts, errors by code and latency histograms per endpoint move; allocation
totals match the nodes added; broker pool sizes and launch kinds follow a warm apply; the metrics
agent times every provisioner. No timing thresholds: figures are polled until they show, within a
deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.cli import _metrics_args
from schemas.errors import BusError
from services.metrics.client import MetricsClient
from services.metrics.provisioners import PROVISIONER_NAMES
from tests.broker_helpers import FAST_ARGS, const_broker, marked, param
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

G = 1 << 30
METRICS = ("--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--metrics-refresh", "0")


def metrics_url(worker) -> str:
    tails = [token for token in worker.ready_line.split()[3:] if token.startswith("metrics=")]
    assert tails, f"no metrics URL in the ready line {worker.ready_line!r}"
    return tails[0].removeprefix("metrics=")


def get(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


class Scrape:
    """One scrape, parsed: `value(name, **labels)` is the sample's value (0 when absent)."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found)

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's (upper bound, cumulative count) pairs for one label set."""
        found = [
            (float(s.labels["le"]), s.value) for s in self.samples
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return sorted(found)


async def scrape(url: str) -> Scrape:
    status, headers, body = await asyncio.to_thread(get, url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return Scrape(body.decode())


async def scrape_until(url: str, check, timeout: float = 15.0) -> Scrape:
    """Scrape until `check(scrape)` holds (the last reply of a request may be counted just after
    the client has it); AssertionError with the last figures past the deadline."""

    async def attempt():
        result = await scrape(url)
        return result if check(result) else None

    return await eventually(attempt, timeout, interval=0.1)


def assert_histogram(s: Scrape, name: str, count: int, **labels: str) -> None:
    buckets = s.buckets(name, **labels)
    assert buckets and buckets[-1] == (float("inf"), count), buckets
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))  # cumulative
    assert s.value(f"{name}_count", **labels) == count and s.value(f"{name}_sum", **labels) > 0


# -- the request metrics, and the allocation figures ------------------------------------------------


async def test_allocation_worker_counts_requests_errors_latency_and_totals(spawn_worker, client, prefix):
    worker = spawn_worker("services.allocation.worker", *METRICS)
    url = metrics_url(worker)
    service = f"{prefix}-allocation"

    async def call(command: str, payload: dict) -> dict:
        return await client.request(f"resource.{command}", payload, dict, timeout=10)

    for i in range(3):
        await call("add-node", {"nodename": f"m{i}", "resource": {
            "cpumem": {"cpu": 4, "memory": "8G"},
            "storage": {"volumes": ["/data:10G"], "storage": "20G"},
            "gpu": {"prod_count_map": {"nvidia-a100": 2}},
        }})
    request = {
        "cpumem": {"cpu-request": 1.5, "memory-request": "1G"},
        "storage": {"storage-request": "2G"},
        "gpu": {"prod_count_map": {"nvidia-a100": 1}},
    }
    placed = await call("allocate", {"nodenames": ["m0", "m1", "m2"], "strategy": "spread", "deploy_count": 4,
                                     "workload_resource_request": request})
    assert len(placed["allocations"]) == 4
    with pytest.raises(BusError) as missing:
        await call("get-node-resource-info", {"nodename": "nowhere"})
    with pytest.raises(BusError) as malformed:
        await call("add-node", {"nodename": "bad name"})
    assert (missing.value.code, malformed.value.code) == ("node_not_found", "invalid_argument")

    add = {"service": service, "endpoint": "resource.add-node"}
    info = {"service": service, "endpoint": "resource.get-node-resource-info"}
    s = await scrape_until(url, lambda s: s.value("berth_requests_total", **info) == 1)
    assert s.value("berth_requests_total", **add) == 4  # three nodes and the malformed one
    assert s.value("berth_requests_total", service=service, endpoint="resource.allocate") == 1
    assert s.value("berth_request_errors_total", **add, code="invalid_argument") == 1
    assert s.value("berth_request_errors_total", **info, code="node_not_found") == 1
    assert s.value("berth_request_errors_total", service=service, endpoint="resource.allocate") == 0
    assert_histogram(s, "berth_request_duration_seconds", 4, **add)
    assert s.families["berth_request_duration_seconds"].type == "histogram"
    assert s.families["berth_requests"].type == "counter"

    # Totals in base units over the three nodes; usage from the four instances placed.
    assert s.value("berth_allocation_nodes") == 3
    assert s.value("berth_allocation_workloads") == 4
    capacity = {(x.labels["plugin"], x.labels["resource"]): x.value
                for x in s.families["berth_allocation_capacity"].samples}
    usage = {(x.labels["plugin"], x.labels["resource"]): x.value for x in s.families["berth_allocation_usage"].samples}
    assert capacity == {
        ("cpumem", "cpu"): 12, ("cpumem", "memory"): 24 * G,
        ("storage", "storage"): 90 * G, ("storage", "volumes"): 30 * G, ("gpu", "nvidia-a100"): 6,
    }
    assert usage == {
        ("cpumem", "cpu"): 6, ("cpumem", "memory"): 4 * G,
        ("storage", "storage"): 8 * G, ("storage", "volumes"): 0, ("gpu", "nvidia-a100"): 4,
    }
    assert s.value("berth_allocation_placements_total") == 4
    assert s.value("berth_allocation_commit_deploys_count") >= 3  # one commit per node at least
    assert s.value("berth_allocation_commit_retries_total") == 0  # one worker, no contention

    released = await call("release", {"workload_ids": [a["workload_id"] for a in placed["allocations"]]})
    assert len(released["released"]) == 4
    s = await scrape_until(url, lambda s: s.value("berth_allocation_workloads") == 0)
    assert s.value("berth_allocation_released_total") == 4
    assert s.value("berth_allocation_usage", plugin="cpumem", resource="cpu") == 0
    assert s.value("berth_allocation_usage", plugin="gpu", resource="nvidia-a100") == 0


async def test_two_workers_report_the_same_totals_and_share_the_requests(spawn_worker, client, prefix):
    urls = [metrics_url(spawn_worker("services.allocation.worker", *METRICS)) for _ in range(2)]
    for i in range(6):  # the queue group spreads these over both workers
        node = {"nodename": f"w{i}", "resource": {"cpumem": {"cpu": 2, "memory": "2G"}}}
        await client.request("resource.add-node", node, dict, timeout=10)
    request = {"cpumem": {"cpu-request": 0.5, "memory-request": "256M"}}
    for i in range(6):
        await client.request("resource.allocate", {"nodename": f"w{i}", "deploy_count": 2,
                                                   "workload_resource_request": request}, dict, timeout=10)
    for url in urls:  # each worker learns the other's changes from their events
        await scrape_until(url, lambda s: s.value("berth_allocation_usage", plugin="cpumem", resource="cpu") == 6
                           and s.value("berth_allocation_nodes") == 6)
    scrapes = [await scrape(url) for url in urls]
    for s in scrapes:
        assert s.value("berth_allocation_capacity", plugin="cpumem", resource="cpu") == 12
        assert s.value("berth_allocation_usage", plugin="cpumem", resource="memory") == 12 * 256 << 20
        assert s.value("berth_allocation_workloads") == 12
    add = {"service": f"{prefix}-allocation", "endpoint": "resource.add-node"}
    assert sum(s.value("berth_requests_total", **add) for s in scrapes) == 6
    assert sum(s.value("berth_allocation_placements_total") for s in scrapes) == 12


async def test_totals_are_read_at_most_once_per_refresh_period(spawn_worker, client):
    """With a refresh period of an hour, a node added after the first scrape does not show: scrapes
    answer from the figures read once, however many come."""
    worker = spawn_worker("services.allocation.worker", "--metrics-port", "0", "--metrics-refresh", "3600")
    url = metrics_url(worker).replace("0.0.0.0", "127.0.0.1")
    node = {"nodename": "c0", "resource": {"cpumem": {"cpu": 2, "memory": "1G"}}}
    await client.request("resource.add-node", node, dict, timeout=10)
    first = await scrape(url)
    assert first.value("berth_allocation_nodes") == 1
    await client.request("resource.add-node", {**node, "nodename": "c1"}, dict, timeout=10)
    scrapes = await asyncio.gather(*(scrape(url) for _ in range(8)))
    assert {s.value("berth_allocation_nodes") for s in scrapes} == {1}
    assert {s.value("berth_allocation_capacity", plugin="cpumem", resource="cpu") for s in scrapes} == {2}
    # ...while the request counters are live.
    assert scrapes[-1].value("berth_requests_total", endpoint="resource.add-node") == 2


# -- broker ---------------------------------------------------------------------------------------------

U = "team-m"
ONE = {"least_instance": 1, "request_instance": 1}


async def test_broker_pool_sizes_and_warm_and_cold_launches(spawn_worker, broker_call, broker_processes, prefix):
    worker = spawn_worker("services.broker.worker", *FAST_ARGS, *METRICS)
    url = metrics_url(worker)
    b = broker_call
    await b("add-broker", const_broker(U, "warm", 1))
    await b.wait_idle(U, "warm", 1)
    s = await scrape(url)
    assert s.value("berth_broker_pool_resources", user=U, broker="warm", state="idle") == 1
    assert s.value("berth_broker_launches_total", kind="warm") == 0

    sold = (await b("apply", {"user": U, "resource_id": "task", "param": param(), "filter": ONE}))["broker_resource_id"]
    assert sold.startswith("bwarm-")
    with pytest.raises(BusError) as refused:  # no broker of this user fits: an error by code
        await b("apply", {"user": "nobody", "resource_id": "t2", "param": param(), "filter": ONE})
    assert refused.value.code == "broker_param_not_fit"
    # A cold launch: the user has no broker, so the operator launches it for the caller.
    await b("init", {"user": "solo", "resource_id": "cold", "param": param()})
    await b("launch", {"user": "solo", "resource_id": "cold", "filter": ONE})

    apply = {"service": f"{prefix}-broker", "endpoint": "broker.apply"}
    s = await scrape_until(url, lambda s: s.value("berth_requests_total", **apply) == 2
                           and s.value("berth_broker_pool_resources", user=U, broker="warm", state="sold") == 1)
    assert s.value("berth_broker_launches_total", kind="warm") == 1
    assert s.value("berth_broker_launches_total", kind="cold") == 1
    assert s.value("berth_request_errors_total", **apply, code="broker_param_not_fit") == 1
    assert_histogram(s, "berth_broker_apply_duration_seconds", 1, result="sold")
    assert_histogram(s, "berth_broker_apply_duration_seconds", 1, result="refused")
    states = {x.labels["state"] for x in s.families["berth_broker_pool_resources"].samples}
    assert states == {"warming", "idle", "sold", "deleting"}
    # The pool refills to one unsold resource beside the sold one.
    await b.wait_idle(U, "warm", 1)
    s = await scrape(url)
    assert s.value("berth_broker_pool_resources", user=U, broker="warm", state="idle") == 1
    assert s.value("berth_broker_pool_resources", user=U, broker="warm", state="sold") == 1

    await b("release", {"user": U, "resource_id": "task"})
    await b("release", {"user": "solo", "resource_id": "cold"})
    await b("remove-broker", {"user": U, "name": "warm"})
    s = await scrape(url)  # a removed broker leaves the table
    assert not [x for x in s.families["berth_broker_pool_resources"].samples if x.labels["broker"] == "warm"]

    async def none_left():
        return not marked(prefix)

    await eventually(none_left, 20)


# -- metrics agent --------------------------------------------------------------------------------------


async def test_metrics_agent_times_every_provisioner_and_counts_events(spawn_worker, nc, prefix):
    worker = spawn_worker("services.metrics.worker", "--node", "tele", "--interval", "1", *METRICS)
    url = metrics_url(worker)
    agent = MetricsClient(nc, "tele", prefix=prefix)

    async def synced():
        answer = await agent.has_synced()
        return answer if answer.synced else None

    answer = await eventually(synced, 20)
    lease = await agent.register("node", "cpu.usage.system", lease_seconds=30)
    s = await scrape_until(url, lambda s: s.value("berth_metrics_events_published_total") >= 1, timeout=20)
    for name in PROVISIONER_NAMES:
        if name not in answer.failed:
            assert s.value("berth_metrics_sampling_duration_seconds_count", provisioner=name) >= 1, name
            assert s.buckets("berth_metrics_sampling_duration_seconds", provisioner=name)[-1][0] == float("inf")
    assert s.value("berth_metrics_registrations", node="tele") == 1
    assert s.value("berth_requests_total", service=f"{prefix}-metrics", endpoint="metrics.tele.register-notifier") == 1
    await agent.deregister(lease.key)
    s = await scrape(url)
    assert s.value("berth_metrics_registrations", node="tele") == 0


# -- the server -------------------------------------------------------------------------------------------


async def test_server_answers_only_metrics_and_frees_its_port_on_stop(spawn_worker):
    worker = spawn_worker("services.allocation.worker", *METRICS)
    url = metrics_url(worker)
    base = url.removesuffix("/metrics")
    status, headers, body = await asyncio.to_thread(get, base + "/")
    assert status == 200 and b"# HELP berth_requests_total" in body
    status, headers, body = await asyncio.to_thread(get, base + "/elsewhere")
    assert status == 404
    status, headers, body = await asyncio.to_thread(get, url, "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    status, headers, body = await asyncio.to_thread(get, url, "POST")
    assert status == 405
    # OpenMetrics when Prometheus asks for it.
    status, headers, body = await asyncio.to_thread(
        get, url, "GET", {"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    # Process metrics from the client library come along.
    assert (await scrape(url)).value("process_cpu_seconds_total") > 0

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    worker.signal(15)
    assert await asyncio.to_thread(worker.wait, 20) == 0
    with socket.socket() as probe:  # nothing listens on the port any more: a new server may take it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every server does (TIME_WAIT)
        probe.bind(("127.0.0.1", port))
        probe.listen()


def test_metrics_are_off_by_default(spawn_worker):
    worker = spawn_worker("services.allocation.worker")
    assert worker.ready_line.split()[3:] == []


def test_a_port_in_use_is_refused_before_ready(nats_url, redis_url, prefix):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "bus.runner", "services.allocation.worker", "--nats", nats_url, "--redis", redis_url, "--prefix", prefix,
             "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"],
            capture_output=True, text=True, timeout=60, check=False,
        )
    assert done.returncode != 0 and not done.stdout.startswith("ready")
    assert f"--metrics-port {port}" in done.stderr


def test_berth_worker_gives_each_process_its_own_port():
    assert [_metrics_args(9100, i) for i in range(3)] == [
        ["--metrics-port", "9100"], ["--metrics-port", "9101"], ["--metrics-port", "9102"],
    ]
    assert _metrics_args(0, 2, "127.0.0.1") == ["--metrics-port", "0", "--metrics-addr", "127.0.0.1"]
    assert _metrics_args(None, 0) == []
