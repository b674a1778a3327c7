"""Take docs/dashboard.png: the real dashboard over a small, busy berth.

    .venv/bin/python scripts/screenshot.py [-o docs/dashboard.png]

Starts nats-server and redis-server on free ports in a temporary folder, two allocation workers,
a broker and a metrics agent, adds a few nodes, places workloads on them, fills warm pools (their
servers are `python -m http.server`), sells from one and lets another fail and cool down; then
opens `berth dashboard` in Debian's headless Chromium (Playwright) and saves the page. Everything
it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from berth.servers import start_nats, start_redis  # noqa: E402
from bus.client import BusClient  # noqa: E402
from bus.connection import connect  # noqa: E402

PREFIX = "berth"
GiB = 1 << 30
CHROMIUM = os.environ.get("BERTH_CHROMIUM", "/usr/bin/chromium")
HTTP_SERVER = (
    f"{sys.executable} -m http.server $PORT_HTTP --bind 127.0.0.1 --directory {tempfile.gettempdir()}"
)
BROKER_TIMING = ["--pool-interval", "0.2", "--sweep-interval", "0.2", "--cooling-seconds", "600"]

NODES = {
    "sz-web-01": (
        {"city": "sz", "pool": "web"},
        {"cpumem": {"cpu": 16, "memory": "64G"}, "storage": {"storage": "500G"}},
    ),
    "sz-web-02": (
        {"city": "sz", "pool": "web"},
        {"cpumem": {"cpu": 16, "memory": "64G"}, "storage": {"storage": "500G"}},
    ),
    "sz-build-01": (
        {"city": "sz", "pool": "build"},
        {"cpumem": {"cpu": 32, "memory": "128G"}, "storage": {"storage": "2T"}},
    ),
    "gz-gpu-01": (
        {"city": "gz", "pool": "ml"},
        {
            "cpumem": {"cpu": 24, "memory": "192G"},
            "gpu": {"prod_count_map": {"nvidia-a100": 4, "nvidia-3070": 2}},
        },
    ),
    "gz-web-01": ({"city": "gz", "pool": "web"}, {"cpumem": {"cpu": 8, "memory": "32G"}}),
}


def start(module: str, nats_url: str, redis_url: str, *args: str) -> subprocess.Popen:
    """A worker process; returns once it says "ready"."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bus.runner",
            module,
            "--nats",
            nats_url,
            "--redis",
            redis_url,
            "--prefix",
            PREFIX,
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    if not proc.stdout.readline().startswith("ready"):
        raise SystemExit(f"{module} did not start")
    return proc


async def until(check, seconds: float) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit(f"{check.__name__}: not reached within {seconds} s")
        await asyncio.sleep(0.2)


def broker(user: str, name: str, strategy: dict, image: str = HTTP_SERVER, version: str = "v1") -> dict:
    param = {
        "city": "sz",
        "platform": "linux",
        "ports": {"http": "http"},
        "image": image,
        "worker_version": version,
    }
    return {"user": user, "name": name, "strategy": strategy, "param": param}


async def fill(client: BusClient) -> None:
    call = client.request
    for name, (labels, resource) in NODES.items():
        await call("resource.add-node", {"nodename": name, "labels": labels, "resource": resource})

    async def place(nodename: str, count: int, cpu: float, memory: int, bind: bool = True, **more) -> None:
        request = {"cpumem": {"cpu-bind": bind, "cpu-request": cpu, "memory-request": memory}, **more}
        await call(
            "resource.allocate",
            {"nodename": nodename, "deploy_count": count, "workload_resource_request": request},
        )

    await place("sz-web-01", 6, 2, 6 * GiB, storage={"storage-request": "40G"})
    await place("sz-web-02", 3, 1, 4 * GiB)
    await place("sz-build-01", 7, 4, 14 * GiB, storage={"storage-request": "200G"})
    await place("gz-gpu-01", 3, 4, 40 * GiB, gpu={"prod_count_map": {"nvidia-a100": 1}})
    await place("gz-web-01", 1, 0.5, 2 * GiB, bind=False)

    await call("broker.add-broker", broker("ci", "linux-v1", {"type": "const", "num": 3}))
    await call("broker.add-broker", broker("ci", "linux-v2", {"type": "const", "num": 2}, version="v2"))
    await call(
        "broker.add-broker", broker("ci", "broken", {"type": "const", "num": 1}, image="false", version="v3")
    )
    await call("broker.add-broker", broker("qa", "smoke", {"type": "reactive", "min": 1, "max": 4}))

    async def pools() -> dict[str, dict]:
        return {b["name"]: b for b in (await call("broker.list-brokers", {}))["brokers"]}

    async def settled() -> bool:
        p = await pools()
        return (
            p["linux-v1"]["idle"] >= 3
            and p["linux-v2"]["idle"] >= 2
            and p["smoke"]["idle"] >= 1
            and p["broken"]["cooling_until"] > 0
        )

    await until(settled, 120)
    one = {"least_instance": 1, "request_instance": 1}
    for job in ("job-1", "job-2"):
        param = broker("ci", "linux-v1", {})["param"]
        await call("broker.apply", {"user": "ci", "resource_id": job, "param": param, "filter": one})
    # A late node and a short-lived workload, so that the latest events are not all the broker's.
    await call(
        "resource.add-node",
        {
            "nodename": "gz-web-02",
            "labels": {"city": "gz", "pool": "web"},
            "resource": {"cpumem": {"cpu": 8, "memory": "32G"}},
        },
    )
    await place("gz-web-02", 2, 2, 8 * GiB)
    request = {"cpumem": {"cpu-request": 1, "memory-request": GiB}}
    placed = await call(
        "resource.allocate",
        {"nodename": "gz-web-01", "deploy_count": 1, "workload_resource_request": request},
    )
    await call("resource.release", {"workload_ids": [a["workload_id"] for a in placed["allocations"]]})


async def shoot(url: str, output: Path) -> None:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        with tempfile.TemporaryDirectory() as profile:
            context = await pw.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                viewport={"width": 1440, "height": 900},
                device_scale_factor=1,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = context.pages[0] if context.pages else await context.new_page()
            await page.goto(url)
            # Enough samples for the charts to show a shape, and every pool settled.
            await page.wait_for_function(
                "() => [...document.querySelectorAll('[data-chart]')]"
                ".filter((chart) => Number(chart.dataset.count) >= 25).length === 4",
                timeout=120_000,
            )
            await page.wait_for_function("() => document.querySelectorAll('[data-pool]').length === 4")
            await page.screenshot(path=str(output), full_page=True)
            await context.close()


async def main(output: Path) -> None:
    state = Path(tempfile.mkdtemp(prefix="berth-screenshot-"))
    nats, redis = start_nats(state / "nats"), start_redis(state / "redis", appendonly=False)
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(2):
            procs.append(start("services.allocation.worker", nats.url, redis.url))
        procs.append(start("services.broker.worker", nats.url, redis.url, *BROKER_TIMING))
        procs.append(
            start("services.metrics.worker", nats.url, redis.url, "--node", "sz-web-01", "--interval", "1")
        )
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "berth.cli", "dashboard", "--nats", nats.url, "--prefix", PREFIX],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(dashboard)
        url = dashboard.stdout.readline().split()[-1]
        nc = await connect(nats.url, worker=False)
        client = BusClient(nc, prefix=PREFIX, timeout=10.0)
        await fill(client)
        await shoot(url, output)
        for job in ("job-1", "job-2"):
            await client.request("broker.release", {"user": "ci", "resource_id": job})
        for user, name in (("ci", "linux-v1"), ("ci", "linux-v2"), ("ci", "broken"), ("qa", "smoke")):
            await client.request("broker.remove-broker", {"user": user, "name": name})

        async def all_released() -> bool:  # the pools' servers are stopped before the broker is
            listing = await client.request("broker.list-resources", {"status": "running", "limit": 100})
            return not listing["resources"]

        await until(all_released, 60)
        await nc.close()
        print(f"wrote {output}")
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        nats.stop()
        redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "docs" / "dashboard.png")
    options = parser.parse_args()
    options.output.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(options.output))
