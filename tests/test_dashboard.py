"""The dashboard in a real browser: Debian's Chromium, driven by Playwright.

`berth dashboard` runs as a process on a free port in the test's namespace; the page must show the
services coming up, a node added during the test, the usage an allocation takes, a warm pool
filling and selling, and a metrics agent's samples. Every wait on the page is one of Playwright's
expectations (it retries until its deadline), never a sleep. A second test runs the dashboard's bus
side as the reader identity `berth up` makes for it, on servers with berth's accounts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from berth.dashboard.live import Live
from tests.accounts_helpers import NODE as AGENT
from tests.accounts_helpers import Deployment
from tests.broker_helpers import FAST_ARGS, const_broker, marked, param
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("BERTH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000  # deadline of each expectation (services are re-read every 5 s)
GiB = 1 << 30
U = "dash"


@asynccontextmanager
async def browser_page(profile: Path):
    """A page of a fresh headless Chromium (the system's: no browser is downloaded)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: `make setup` installs Debian's chromium package "
            "(or set BERTH_CHROMIUM to a Chromium binary)"
        )
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("the Python package playwright is missing: `make setup` installs the dev extra")
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            yield page
        finally:
            await context.close()


@contextmanager
def running_dashboard(nats_url: str, prefix: str):
    """`berth dashboard` on a free port, as a process; its URL. It must stop cleanly on SIGTERM."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "berth.cli",
            "dashboard",
            "--nats",
            nats_url,
            "--prefix",
            prefix,
            "--port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("dashboard: http://"):
        proc.kill()
        raise RuntimeError(f"the dashboard did not start (exit {proc.wait()}): {line!r}")
    try:
        yield line.split()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


@pytest.fixture
def dashboard(nats_url, prefix):
    with running_dashboard(nats_url, prefix) as url:
        yield url


async def test_the_page_follows_services_nodes_allocations_pools_and_metrics(
    dashboard, spawn_worker, client, broker_call, broker_processes, prefix, tmp_path
):
    from playwright.async_api import expect

    async with browser_page(tmp_path / "profile") as page:
        errors = []
        page.on("pageerror", lambda error: errors.append(error))  # an exception in the page's scripts
        await page.goto(dashboard)
        # Nothing runs yet: the page says so, and stays up.
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)
        allocation = page.locator('[data-service="allocation"]')
        await expect(allocation).to_have_attribute("data-instances", "0")
        await expect(allocation).to_contain_text("absent")

        spawn_worker("services.allocation.worker")
        spawn_worker("services.broker.worker", *FAST_ARGS)
        spawn_worker("services.metrics.worker", "--node", "dash-agent", "--interval", "1")
        for service in ("allocation", "broker", "metrics"):
            await expect(page.locator(f'[data-service="{service}"]')).to_have_attribute(
                "data-instances", "1", timeout=WAIT_MS
            )

        # A node added now appears, with a bar per resource.
        resource = {"cpumem": {"cpu": 4, "memory": "8G"}, "gpu": {"prod_count_map": {"nvidia-3070": 2}}}
        await client.request(
            "resource.add-node", {"nodename": "dash-n1", "labels": {"city": "sz"}, "resource": resource}
        )
        node = page.locator('[data-node="dash-n1"]')
        cpu = node.locator('[data-resource="cpu"]')
        await expect(node).to_contain_text("city=sz", timeout=WAIT_MS)
        await expect(cpu).to_have_attribute("data-total", "4")
        await expect(cpu).to_have_attribute("data-used", "0")
        await expect(node.locator('[data-resource="nvidia-3070"]')).to_contain_text("0 / 2")
        status = node.locator("[data-status]")
        await expect(status).to_have_attribute("data-status", "up")
        await expect(status).to_contain_text("no agent")

        # An agent keeps it alive for a moment, then stops beating: the node shows down, with its agent.
        await client.request("resource.node-heartbeat", {
            "nodename": "dash-n1", "ttl_seconds": 1, "agent": {"address": "10.1.2.3", "instances": 2, "running": 2}})
        await expect(status).to_have_attribute("data-status", "down", timeout=WAIT_MS)
        await expect(status).to_contain_text("agent 10.1.2.3 · 2 running")
        await client.request("resource.node-heartbeat", {"nodename": "dash-n1", "ttl_seconds": 600})
        await expect(status).to_have_attribute("data-status", "up", timeout=WAIT_MS)

        # An allocation lands: the node's bars move, and the event is listed.
        request = {
            "cpumem": {"cpu-bind": True, "cpu-request": 1, "memory-request": GiB},
            "gpu": {"prod_count_map": {"nvidia-3070": 1}},
        }
        await client.request(
            "resource.allocate",
            {"nodename": "dash-n1", "deploy_count": 1, "workload_resource_request": request},
        )
        await expect(cpu).to_have_attribute("data-used", "1", timeout=WAIT_MS)
        await expect(cpu).to_contain_text("1 / 4 cores")
        await expect(node.locator('[data-resource="memory"]')).to_contain_text("1 GiB / 8 GiB")
        await expect(node.locator('[data-resource="nvidia-3070"]')).to_contain_text("1 / 2")
        await expect(page.locator("#events")).to_contain_text("resource.dash-n1.allocated")

        # A warm pool fills, then sells its resource.
        await broker_call("add-broker", const_broker(U, "warm", 1))
        pool = page.locator(f'[data-pool="{U}/warm"]')
        await expect(pool).to_have_attribute("data-idle", "1", timeout=WAIT_MS)
        await expect(pool).to_contain_text("ready")
        one = {"least_instance": 1, "request_instance": 1}
        await broker_call("apply", {"user": U, "resource_id": "job", "param": param(), "filter": one})
        await expect(pool).to_have_attribute("data-sold", "1", timeout=WAIT_MS)
        await expect(page.locator("#events")).to_contain_text(f"broker.{U}.warm.sold")

        # The metrics agent's samples reach its charts.
        chart = page.locator('[data-chart="cpu.load.1min.system"]')
        await expect(chart).to_have_attribute("data-count", re.compile(r"^([2-9]|\d\d+)$"), timeout=WAIT_MS)
        await expect(page.locator("#agent")).to_have_value("dash-agent")
        assert errors == []

    await broker_call("release", {"user": U, "resource_id": "job"})
    await broker_call("remove-broker", {"user": U, "name": "warm"})

    async def none_left():
        return not marked(prefix)

    await eventually(none_left)


async def test_a_reader_is_all_the_dashboard_needs(tmp_path, caplog):
    """On servers with `berth up`'s accounts, the dashboard (as the reader identity `berth up` makes
    for it) reads every part: past events from the stream, services, nodes, pools and an agent's
    metrics."""
    deployment = Deployment(tmp_path)
    live = None
    try:
        deployment.start_workers()
        client = await deployment.client("admin")
        await client.request(
            "resource.add-node", {"nodename": "early", "resource": {"cpumem": {"cpu": 2, "memory": "2G"}}}
        )
        reader_url = deployment.creds.nats_url("dashboard", deployment.nats.url)
        live = Live(reader_url, deployment.prefix, js_domain=deployment.prefix)
        await live.start()
        feed = live.feed()

        async def until(check) -> None:  # each change the dashboard makes comes as a message
            while not check(live.snapshot()):
                assert await feed.next(timeout=20) not in ("", None), f"no change; {live.snapshot()}"

        await until(
            lambda s: any(e["subject"] == "resource.early.added" for e in s["events"])
        )  # from the stream
        await until(lambda s: all(service["instances"] for service in s["services"]["services"]
                                  if service["name"] in deployment.services))
        await until(lambda s: [n["nodename"] for n in s["nodes"]["nodes"]] == ["early"])
        await client.request(
            "resource.allocate",
            {
                "nodename": "early",
                "deploy_count": 1,
                "workload_resource_request": {"cpumem": {"cpu-request": 1, "memory-request": "1G"}},
            },
        )
        await until(lambda s: s["nodes"]["nodes"][0]["bars"][0]["used"] == 1)
        await until(lambda s: s["pools"]["available"] is True)
        await until(lambda s: len(s["series"].get(AGENT, {}).get("cpu.load.1min.system", [])) >= 2)
    finally:
        if live is not None:
            await live.stop()
        await deployment.close_connections()
        deployment.stop()
    refused = [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage()]
    assert refused == []


def test_a_favicon_so_that_browsers_get_no_404(dashboard):
    import urllib.request

    with urllib.request.urlopen(dashboard + "favicon.ico", timeout=10) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"] == "image/svg+xml"
        assert answer.read().startswith(b"<svg")
    with urllib.request.urlopen(dashboard, timeout=10) as page:
        assert '<link rel="icon" href="/favicon.ico"' in page.read().decode()


def test_unbound_cpu_past_the_cores_is_shown_as_shared():
    from berth.dashboard.views import SHARED_CPU, node_view

    node = {"nodename": "n", "capacity": {"cpumem": {"cpu": 2, "memory": 1 << 30}},
            "usage": {"cpumem": {"cpu": 3, "memory": 1 << 29}}}
    bars = {bar["resource"]: bar for bar in node_view(node)["bars"]}
    assert (bars["cpu"]["used"], bars["cpu"]["total"], bars["cpu"]["note"]) == (3, 2, SHARED_CPU)
    assert "note" not in bars["memory"]


def test_an_owners_copy_of_a_node_event_is_not_listed_twice():
    """The page lists a node's `allocated`; the copy for the workloads' owner repeats it. A node
    named like the copies' token is still a node."""
    from berth.dashboard.views import shown

    assert shown("resource.n1.allocated") and shown("resource.workload.allocated")
    assert not shown("resource.workload.alice.n1.allocated")
