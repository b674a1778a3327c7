"""The dashboard as a user looks at it, in Debian's headless Chromium (Playwright), with pictures.

- While it cannot read anything yet, every part of the page says "connecting…" and claims nothing
  (no "no node yet", no "absent").
- Over a small fleet as `berth up` runs one (allocation, a broker, node agents that also serve their
  node's metrics) plus nodes added by hand, every panel has data: each service berth up starts is
  listed with its instances (the agents too), the placement heat map has one cell per node, the
  nodes, a warm pool, an agent's charts and the latest events are shown, and nothing says
  "connecting…" any more. Screenshots are saved (`BERTH_DASHBOARD_SHOTS=DIR` keeps them there too;
  `docs/dashboard.png` is written when `BERTH_DASHBOARD_SHOTS` is `docs`).
- A normal restart (allocation and an agent stopped and started again, the agent with its state
  folder) shows no error count, and allocation counts no refusal at all: the agent does not ask
  add-node for a node it added before (it was refused `node_exists` after every restart).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from bus import discovery
from berth.dashboard.live import Live
from tests.broker_helpers import FAST_ARGS, const_broker, marked
from tests.bus_helpers import eventually
from tests.test_dashboard import ROOT, WAIT_MS, browser_page, dashboard, running_dashboard  # noqa: F401

pytest_plugins = ["tests.broker_fixtures", "tests.agent_fixtures"]

GiB = 1 << 30
U = "pics"
# Agents beat every second with a long lease here: a busy machine must not mark them down.
AGENT_ARGS = ("--heartbeat", "1", "--ttl", "15")
SET_CAPACITY = 'endpoint="resource.node.*.set-node-resource-capacity"'
PANELS = ("#services", "#heatmap", "#nodes", "#pools tbody", "#charts", "#events")


def dead_nats_url() -> str:
    """A NATS URL where nothing listens (a port taken and let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{sock.getsockname()[1]}"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def keep_shot(shot: Path) -> None:
    """Copy a screenshot where `BERTH_DASHBOARD_SHOTS` says (`docs`: as docs/dashboard.png)."""
    where = os.environ.get("BERTH_DASHBOARD_SHOTS")
    if not where:
        return
    if where == "docs":
        if shot.name == "dashboard.png":
            shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, Path(where) / shot.name)


async def test_nothing_read_yet_is_shown_as_connecting(prefix, tmp_path):
    """The bus side marks every part as not read yet, and the page says "connecting…" in each of
    them (before this, it said "no node yet: add one" while it was still connecting)."""
    live = Live(dead_nats_url(), prefix)
    snapshot = live.snapshot()
    assert snapshot["services"]["available"] is None and snapshot["nodes"]["available"] is None
    assert snapshot["pools"]["available"] is None and snapshot["events_read"] is False

    from playwright.async_api import expect

    with running_dashboard(dead_nats_url(), prefix) as url:
        async with browser_page(tmp_path / "profile") as page:
            await page.goto(url)
            await expect(page.locator("#status")).to_contain_text("NATS", timeout=WAIT_MS)
            for line in ("#heat-empty", "#nodes-empty", "#pools-empty", "#metrics-empty", "#events-empty"):
                await expect(page.locator(line)).to_have_text("connecting…")
                await expect(page.locator(line)).to_be_visible()
            for service in ("allocation", "broker", "metrics", "agent"):
                tile = page.locator(f'.service[data-service="{service}"]')
                await expect(tile).to_contain_text("connecting…")
            text = await page.locator("body").inner_text()
            for claim in ("no node yet", "absent", "no warm pool", "no metrics agent", "no event yet"):
                assert claim not in text
            await page.screenshot(path=str(tmp_path / "connecting.png"), full_page=True)
            keep_shot(tmp_path / "connecting.png")


async def test_every_panel_has_data_and_a_restart_shows_no_error(
    dashboard, spawn_worker, spawn_agent, client, broker_call, broker_processes, nc, prefix, tmp_path
):
    from playwright.async_api import expect

    allocation = spawn_worker("services.allocation.worker")
    spawn_worker("services.broker.worker", *FAST_ARGS)
    # This machine's agent (its metrics are real: the charts move), and two on fake hosts.
    spawn_agent("pic-host", "--no-cgroups", "--label", "city=sz", "--label", "pool=web", *AGENT_ARGS,
                root="/")
    spawn_agent("pic-sz-2", "--label", "city=sz", "--label", "pool=web", *AGENT_ARGS, cpus=8, memory=16 * GiB)
    restarted = spawn_agent("pic-gz-1", "--label", "city=gz", "--label", "pool=batch", *AGENT_ARGS,
                            cpus=16, memory=32 * GiB)
    # And nodes added by hand, one without a city.
    by_hand = {
        "pic-gz-2": ({"city": "gz", "pool": "batch"}, {"cpumem": {"cpu": 16, "memory": "32G"}}),
        "pic-gz-3": ({"city": "gz", "pool": "batch"}, {"cpumem": {"cpu": 16, "memory": "32G"}}),
        "pic-ml-1": ({"pool": "ml"}, {"cpumem": {"cpu": 24, "memory": "64G"},
                                      "gpu": {"prod_count_map": {"nvidia-a100": 4}}}),
    }
    for name, (labels, resource) in by_hand.items():
        await client.request("resource.add-node", {"nodename": name, "labels": labels, "resource": resource})
    nodes = sorted([*by_hand, "pic-host", "pic-sz-2", "pic-gz-1"])

    async def all_up():
        listed = await client.request("resource.list-nodes", {"nodenames": nodes}, dict)
        return len(listed["nodes"]) == len(nodes) and all(n["status"] == "up" for n in listed["nodes"])

    await eventually(all_up, timeout=30)

    # Placements the heat map tells apart: packed onto two gz nodes, spread over two others.
    def request(cpu: int, memory: int, **more) -> dict:
        return {"cpumem": {"cpu-bind": True, "cpu-request": cpu, "memory-request": memory}, **more}

    async def place(count: int, asked: dict, **where) -> None:
        await client.request("resource.allocate", {"deploy_count": count, "workload_resource_request": asked,
                                                   **where})

    await place(12, request(2, 2 * GiB), nodenames=["pic-gz-2", "pic-gz-3"], strategy="pack")
    await place(4, request(1, GiB), nodenames=["pic-sz-2", "pic-gz-1"], strategy="spread")
    await place(2, request(4, 16 * GiB, gpu={"prod_count_map": {"nvidia-a100": 1}}), nodename="pic-ml-1")
    await broker_call("add-broker", const_broker(U, "warm", 1))

    async with browser_page(tmp_path / "profile") as page:
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        await page.goto(dashboard)
        await expect(page.locator("#status")).to_have_text("live", timeout=WAIT_MS)

        # Every service berth up starts, the agents included (each also serves its node's metrics).
        for service, count in (("allocation", 1), ("broker", 1), ("agent", 3), ("metrics", 3)):
            await expect(page.locator(f'.service[data-service="{service}"]')).to_have_attribute(
                "data-instances", str(count), timeout=WAIT_MS)
        await expect(page.locator('.service[data-service="agent"]')).to_contain_text("pic-gz-1")

        # The heat map: one cell per node, in name order, grouped by a label when asked.
        cells = page.locator("[data-heat-node]")
        await expect(cells).to_have_count(len(nodes), timeout=WAIT_MS)
        assert [await cell.get_attribute("data-heat-node") for cell in await cells.all()] == nodes
        await page.wait_for_function(  # packed: one of the two full, the other half
            "() => ['pic-gz-2', 'pic-gz-3']"
            ".map((name) => document.querySelector(`[data-heat-node='${name}']`)?.dataset.fraction)"
            ".sort().join() === '0.500,1.000'", timeout=WAIT_MS)
        spread = page.locator('[data-heat-node="pic-sz-2"]')
        await expect(spread).not_to_have_attribute("data-fraction", "0.000")
        await expect(page.locator('[data-heat-node="pic-ml-1"]')).to_have_attribute("data-fraction", "0.333")
        await page.select_option("#heat-group", "city")
        await expect(page.locator(".heat-group")).to_have_count(3)  # gz, sz, and "no city"
        await expect(page.locator('[data-group="city=gz"] [data-heat-node]')).to_have_count(3)
        await expect(page.locator('[data-group="no city"]')).to_contain_text("pic-ml-1")
        await page.select_option("#heat-measure", "nvidia-a100")
        await expect(page.locator('[data-heat-node="pic-ml-1"]')).to_have_attribute("data-fraction", "0.500")
        await expect(page.locator('[data-heat-node="pic-gz-1"]')).to_have_attribute("data-fraction", "")
        await page.fill("#node-filter", "pool=batch")
        await expect(cells).to_have_count(3)
        await expect(page.locator("#heat-count")).to_have_text(f"3 of {len(nodes)} nodes")
        await page.fill("#node-filter", "")
        await page.locator("#node-filter").blur()
        await page.select_option("#heat-measure", "cpu")
        await expect(cells).to_have_count(len(nodes))

        # The other panels: nodes, the warm pool, this machine's charts, the events.
        await expect(page.locator("#nodes [data-node]")).to_have_count(len(nodes))
        pool = page.locator(f'[data-pool="{U}/warm"]')
        await expect(pool).to_have_attribute("data-idle", "1", timeout=WAIT_MS)
        await page.select_option("#agent", "pic-host")
        for chart in ("cpu.usage.ratio.system", "mem.used.system"):
            await expect(page.locator(f'[data-chart="{chart}"]')).not_to_have_attribute(
                "data-count", "0", timeout=WAIT_MS)
        await expect(page.locator("#events li").first).to_be_visible()
        await _every_panel_has_data(page, expect)
        await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        keep_shot(tmp_path / "dashboard.png")
        await expect(page.locator("[data-errors]:not([data-errors='0'])")).to_have_count(0)

        # A normal restart: allocation and an agent stop and start again (the agent with its state).
        allocation.signal(signal.SIGTERM)
        restarted.signal(signal.SIGTERM)
        allocation.wait()
        restarted.wait()
        allocation = spawn_worker("services.allocation.worker", "--metrics-port", "0")
        spawn_agent("pic-gz-1", "--label", "city=gz", "--label", "pool=batch", *AGENT_ARGS,
                    cpus=16, memory=32 * GiB)
        # The agent knew its node (its state folder): it set the capacity, and no add-node was refused
        # (Prometheus counts every refusal; `$SRV.STATS` counts none of the agents' node-scoped calls).
        scraped = await asyncio.to_thread(scrape, allocation.ready_line.split("metrics=")[1])
        assert 'code="node_exists"' not in scraped
        assert any(line.startswith("berth_requests_total{") and SET_CAPACITY in line
                   for line in scraped.splitlines())
        registrations = page.locator('#events li[data-type="registered"]',
                                     has_text="agent.pic-gz-1.host.registered")
        await expect(registrations).to_have_count(2, timeout=WAIT_MS)
        # The page shows the new allocation instance with at least what it has answered by now.
        stats = await discovery.stats(nc, f"{prefix}-allocation", timeout=2.0)
        (instance,) = [i for i in stats if i.id == allocation.instance_id]
        answered = sum(endpoint.num_requests for endpoint in instance.endpoints)
        await page.wait_for_function(
            "([id, n]) => Number(document.querySelector(`[data-instance='${id}']`)?.dataset.requests ?? -1)"
            " >= n", arg=[instance.id, answered], timeout=WAIT_MS)
        await expect(page.locator("[data-errors]:not([data-errors='0'])")).to_have_count(0)
        await expect(page.locator("#services td.bad")).to_have_count(0)
        await _every_panel_has_data(page, expect)
        await page.screenshot(path=str(tmp_path / "restarted.png"), full_page=True)
        keep_shot(tmp_path / "restarted.png")
        assert errors == []

    await broker_call("remove-broker", {"user": U, "name": "warm"})

    async def none_left():
        return not marked(prefix)

    await eventually(none_left)


async def _every_panel_has_data(page, expect) -> None:
    """No panel is empty, and nothing says "connecting…" any more."""
    for panel in PANELS:
        await expect(page.locator(f"{panel} > *").first).to_be_visible(timeout=WAIT_MS)
    await expect(page.locator("[data-pending='true']:visible")).to_have_count(0, timeout=WAIT_MS)
    assert "connecting" not in await page.locator("body").inner_text()
