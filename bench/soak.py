"""Days, not minutes: every service under a steady loop, and whether Redis or a worker keeps growing.

    .venv/bin/python bench/soak.py [--minutes 6] [--window 60] [--warmup 2] [--sample 15]
                                   [--services allocation,broker,broker-pool,broker-launch,metrics,agent]
                                   [--nats URL --redis URL]

Each loop runs alone, in a prefix of its own, for `--minutes`, its workers started with
`--idempotency-window` `--window`. The loops change state and give it back, so what the platform
holds stays the same and anything that grows is kept per request:
- allocation: 200 nodes of 64 cores selected by label, 48 clients in a loop of `allocate` (spread,
  one instance, a unique `request_id`) then `release` of it (its own `request_id`);
- broker: 32 clients in a loop of `init` then `release` (no launch);
- broker-pool: a warm pool of 4 servers (`const`), 4 clients in a loop of `apply` then `release`
  (each sale launches a new server, each release stops one);
- broker-launch: 4 clients in a loop of `init`, `launch` (a real process) and `release`;
- metrics: 16 clients in a loop of `put` (a unique `request_id`), `register-notifier`,
  `renew-notifier` and `deregister-notifier`;
- agent: an agent on a fake host (heartbeat every 0.1 s) beside an allocation worker, 4 clients in a
  loop of `start` then `stop` of an instance (a real process).
Every `--sample` seconds it reads Redis (`used_memory`, the prefix's keys) and each worker's RSS.
The table gives them at the end of the warm-up (`--warmup` minutes, which should exceed the window)
and at the end, with their growth per minute in between; a flat service grows by noise only.
Anchors of the same run: Redis's own `used_memory` with no key (the floor), and what the same
requests would keep with answers kept whole for 24 h (the bytes per loop before issue 31, measured
there: allocation 2.0 KB, broker 2.9 KB, metrics 1.6 KB).
Servers of its own are started on loopback unless URLs are given; everything stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import given_or_started, stop_workers  # noqa: E402
from bus.client import BusClient  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.redis import connect_redis  # noqa: E402
from schemas.errors import BusError  # noqa: E402
from tests.agent_hosts import fake_host  # noqa: E402

CATALOG = ROOT / "tests" / "catalog.toml"
SERVER = {"city": "sz", "platform": "linux", "ports": {"http": "http"}, "image": "http-server", "worker_version": "1"}
ONE = {"least_instance": 1, "request_instance": 1}
BROKER_ARGS = ["--pool-interval", "0.2", "--sweep-interval", "0.2", "--stop-grace", "1",
               "--release-retry-seconds", "1", "--catalog", str(CATALOG)]
BEFORE_KB = {"allocation": 2.0, "broker": 2.9, "metrics": 1.6}  # per loop, answers kept whole for 24 h


def rss(pid: int) -> int:
    """A process's resident memory, bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Sample:
    at: float  # seconds since the loop began
    loops: int
    errors: int
    redis_bytes: int
    keys: int
    rss: list[int]


@dataclass
class Run:
    """One service's steady loop: its workers, clients and samples."""

    name: str
    prefix: str
    nats: str
    redis: str
    window: float
    state: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    loops: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def start(self, module: str, *args: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "bus.runner", module, "--nats", self.nats, "--redis", self.redis,
                "--prefix", self.prefix, "--memory-stream", "--idempotency-window", str(self.window), *args]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not proc.stdout.readline().startswith("ready"):
            raise RuntimeError(f"{module} did not start")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        stop_workers(self.procs, self.prefix)

    def failed(self, error: Exception) -> None:
        code = error.code if isinstance(error, BusError) else type(error).__name__
        self.errors[code] = self.errors.get(code, 0) + 1


Step = Callable[[BusClient, int], Awaitable[None]]


def rid() -> str:
    return uuid.uuid4().hex


# -- the loops ------------------------------------------------------------------------------------


async def allocation(run: Run, client: BusClient) -> tuple[int, Step]:
    run.start("services.allocation.worker")
    resource = {"cpumem": {"cpu": 64, "memory": "256G"}}
    for start in range(0, 200, 50):
        await asyncio.gather(*(client.request("resource.add-node", {
            "nodename": f"n{i}", "resource": resource, "labels": {"pool": "soak"}}) for i in range(start, start + 50)))
    request = {"labels": {"pool": "soak"}, "strategy": "spread", "deploy_count": 1,
               "workload_resource_request": {"cpumem": {"cpu-request": 1, "memory-request": "1G"}}}

    async def step(client: BusClient, _: int) -> None:
        placed = await client.request("resource.allocate", {**request, "request_id": rid()})
        ids = [a["workload_id"] for a in placed["allocations"]]
        await client.request("resource.release", {"workload_ids": ids, "request_id": rid()})

    return 48, step


def broker_resources(clients: int, *, launch: bool) -> Callable[[Run, BusClient], Awaitable[tuple[int, Step]]]:
    """`init`, `launch` when asked (a real process), then `release`, from `clients` clients."""

    async def start(run: Run, client: BusClient) -> tuple[int, Step]:
        run.start("services.broker.worker", *BROKER_ARGS)

        async def step(client: BusClient, _: int) -> None:
            resource = {"user": "soak", "resource_id": rid()}
            await client.request("broker.init", {**resource, "param": SERVER, "request_id": rid()})
            if launch:
                await client.request("broker.launch", {**resource, "filter": ONE, "request_id": rid()})
            await client.request("broker.release", {**resource, "request_id": rid()})

        return clients, step

    return start


async def broker_pool(run: Run, client: BusClient) -> tuple[int, Step]:
    run.start("services.broker.worker", *BROKER_ARGS)
    await client.request("broker.add-broker", {"user": "soak", "name": "pool", "param": SERVER,
                                               "strategy": {"type": "const", "num": 4}})

    async def step(client: BusClient, _: int) -> None:
        caller = rid()
        try:
            await client.request("broker.apply", {"user": "soak", "resource_id": caller, "param": SERVER,
                                                  "filter": ONE, "request_id": rid()})
        except BusError as error:
            if error.code != "broker_not_enough_resources":
                raise
            await asyncio.sleep(0.2)  # the pool is refilling: a miss, and a pause
            return
        await client.request("broker.release", {"user": "soak", "resource_id": caller, "request_id": rid()})

    return 4, step


async def metrics(run: Run, client: BusClient) -> tuple[int, Step]:
    run.start("services.metrics.worker", "--node", "soak", "--interval", "1")
    group = "metrics.soak"

    async def step(client: BusClient, i: int) -> None:
        await client.request(f"{group}.put", {"scope": "node", "metric": "soak.value", "value": float(i),
                                              "request_id": rid()})
        lease = await client.request(f"{group}.register-notifier", {"scope": "node", "metric": "soak.value",
                                                                    "request_id": rid()})
        await client.request(f"{group}.renew-notifier", {"key": lease["key"], "request_id": rid()})
        await client.request(f"{group}.deregister-notifier", {"key": lease["key"], "request_id": rid()})

    return 16, step


async def agent(run: Run, client: BusClient) -> tuple[int, Step]:
    run.start("services.allocation.worker", "--lease-interval", "0.2")
    host = fake_host(run.state / "host", cpus=8)
    run.start("services.agent.worker", "--node", "soak", "--root", str(host), "--no-cgroups",
              "--state", str(run.state / "agent"), "--catalog", str(CATALOG), "--heartbeat", "0.1",
              "--ttl", "3", "--interval", "5")
    param = {"image": "http-server", "ports": {"http": "http"}}

    async def step(client: BusClient, i: int) -> None:
        instance = f"i{i % 64}-{rid()[:8]}"
        await client.request("agent.soak.start", {"instance": instance, "param": param}, timeout=30)
        await client.request("agent.soak.stop", {"instance": instance}, timeout=30)

    return 4, step


LOOPS: dict[str, Callable[[Run, BusClient], Awaitable[tuple[int, Step]]]] = {
    "allocation": allocation, "broker": broker_resources(32, launch=False), "broker-pool": broker_pool,
    "broker-launch": broker_resources(4, launch=True),
    "metrics": metrics, "agent": agent,
}


# -- running and measuring -----------------------------------------------------------------------


async def measure(run: Run, redis) -> Sample:
    info = await redis.info("memory")
    keys = 0
    async for _ in redis.scan_iter(match=f"{run.prefix}:*", count=5000):
        keys += 1
    return Sample(0.0, run.loops, sum(run.errors.values()), int(info["used_memory"]), keys,
                  [rss(proc.pid) for proc in run.procs])


async def soak(name: str, nats: str, redis_url: str, *, seconds: float, window: float, sample: float,
               quiet: bool = False) -> Run:
    """Run loop `name` for `seconds`, sampling every `sample` seconds; its workers stopped at the end."""
    run = Run(name, f"soak{uuid.uuid4().hex[:8]}", nats, redis_url, window, Path(tempfile.mkdtemp(prefix="soak-")))
    nc = await connect(nats, name="berth-soak", worker=False)
    redis = connect_redis(redis_url)
    client = BusClient(nc, prefix=run.prefix, timeout=10.0)
    try:
        clients, step = await LOOPS[name](run, client)
        began = time.monotonic()
        stop = began + seconds
        counter = iter(range(1 << 62))

        async def loop() -> None:
            while time.monotonic() < stop:
                try:
                    await step(client, next(counter))
                    run.loops += 1
                except Exception as error:  # counted, and the loop goes on
                    run.failed(error)

        async def sampler() -> None:
            while True:
                taken = await measure(run, redis)
                taken.at = time.monotonic() - began
                run.samples.append(taken)
                if not quiet:
                    print(f"  {name} {taken.at:5.0f} s: {taken.loops} loops, {taken.errors} errors, "
                          f"Redis {taken.redis_bytes / 1e6:.1f} MB {taken.keys} keys, RSS "
                          f"{', '.join(f'{r / 1e6:.0f}' for r in taken.rss)} MB", file=sys.stderr, flush=True)
                if time.monotonic() >= stop:
                    return
                await asyncio.sleep(min(sample, max(0.0, stop - time.monotonic())))

        await asyncio.gather(sampler(), *(loop() for _ in range(clients)))
    finally:
        run.stop()
        keys = [key async for key in redis.scan_iter(match=f"{run.prefix}:*", count=5000)]
        for start in range(0, len(keys), 1000):
            await redis.delete(*keys[start:start + 1000])
        await redis.aclose()
        await nc.close()
    return run


def at(run: Run, seconds: float) -> Sample:
    """The first sample taken at or after `seconds` (the last one if none)."""
    return next((s for s in run.samples if s.at >= seconds), run.samples[-1])


def growth(run: Run, warmup: float) -> dict[str, float]:
    """Per minute from the end of the warm-up to the end: Redis bytes, keys, the largest worker RSS."""
    first, last = at(run, warmup), run.samples[-1]
    minutes = max((last.at - first.at) / 60, 1e-9)
    return {
        "redis_bytes": (last.redis_bytes - first.redis_bytes) / minutes,
        "keys": (last.keys - first.keys) / minutes,
        "rss": max((b - a for a, b in zip(first.rss, last.rss)), default=0) / minutes,
    }


def table(runs: list[Run], warmup: float, floor: int) -> str:
    lines = [
        f"Redis with no key (floor): {floor / 1e6:.1f} MB",
        "",
        "| loop | loops/s | errors | Redis MB at warm-up / end | /min | keys at warm-up / end | /min "
        "| worker RSS MB at warm-up / end | /min | before issue 31: Redis /min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        first, last = at(run, warmup), run.samples[-1]
        slope = growth(run, warmup)
        rate = (last.loops - first.loops) / max(last.at - first.at, 1e-9)
        before = BEFORE_KB.get(run.name)
        old = f"{before * rate * 60 / 1e3:.1f} MB" if before else "-"
        rss = " + ".join(f"{a / 1e6:.0f} / {b / 1e6:.0f}" for a, b in zip(first.rss, last.rss))
        lines.append(
            f"| {run.name} | {rate:.0f} | {_errors(run)} "
            f"| {first.redis_bytes / 1e6:.1f} / {last.redis_bytes / 1e6:.1f} "
            f"| {slope['redis_bytes'] / 1e6:+.2f} | {first.keys} / {last.keys} | {slope['keys']:+.0f} | {rss} "
            f"| {slope['rss'] / 1e6:+.2f} | {old} |"
        )
    return "\n".join(lines)


def _errors(run: Run) -> str:
    return ", ".join(f"{count} {code}" for code, count in sorted(run.errors.items())) or "0"


async def main(args: argparse.Namespace) -> None:
    redis = connect_redis(args.redis)
    floor = int((await redis.info("memory"))["used_memory"])
    await redis.aclose()
    runs = []
    for name in args.services.split(","):
        print(f"{name}: {args.minutes} min, window {args.window:g} s", file=sys.stderr, flush=True)
        runs.append(await soak(name, args.nats, args.redis, seconds=args.minutes * 60, window=args.window,
                               sample=args.sample))
    print(table(runs, args.warmup * 60, floor))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=6.0, help="how long each loop runs")
    parser.add_argument("--window", type=float, default=60.0, help="the workers' --idempotency-window, seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="minutes before growth is measured")
    parser.add_argument("--sample", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--services", default=",".join(LOOPS), help="the loops to run, in order")
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    arguments = parser.parse_args()
    with given_or_started(arguments):
        asyncio.run(main(arguments))
