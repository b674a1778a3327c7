"""Allocation benchmarks, each figure beside its anchor measured in the same run.

    .venv/bin/python bench/allocation.py [--nodes 5000] [--placements 3000] [--nats URL --redis URL]

1. calculate-deploy over the bus on one 128-core, 2-NUMA node (1.5 bound CPUs + 2 GiB), p50/p99,
   beside the raw NATS round trip (a bare echo subscription).
2. The CPU planner alone on one node: (a) 64 idle cores in 2 NUMA nodes, 128 GiB each -> 42 plans;
   (b) half the cores fully used and 8 at 30 free pieces -> 16 plans; (c) 128 idle cores -> 85 plans.
   Best of 7, beside eru's Go planner measured on this machine (0.94 / 0.2 / 3.9 ms).
3. get-nodes-deploy-capacity over 1,000 and 5,000 nodes like (a): wall time, first call and again.
4. allocate with strategy spread over 5,000 such nodes from 64 concurrent clients, with 1 and 2
   worker processes: placements/s and p99, beside the raw Lua reserve rate (64 clients running a
   minimal check-and-increment script) and kube-scheduler's published floor of 680 pods/s.

Servers are started on free loopback ports unless URLs are given; everything stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stats import percentile  # noqa: E402
from bus.client import BusClient  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.redis import connect_redis  # noqa: E402
from services.allocation.cpumem.plans import PlanRequest, cpu_plans  # noqa: E402
from services.allocation.cpumem.resources import availability  # noqa: E402
from services.allocation.cpumem.types import decode_node_resource  # noqa: E402
from services.allocation.worker import make_plugins  # noqa: E402
from services.servers import start_nats, start_redis  # noqa: E402

GiB = 1 << 30
REQUEST = {"cpumem": {"cpu-bind": True, "cpu-request": 1.5, "memory-request": 2 * GiB}}
ERU_MS = {"a": 0.94, "b": 0.2, "c": 3.9}
KUBE_SCHEDULER_FLOOR = 680.0


def node_request(cores: int, numa_nodes: int = 2, numa_memory_gib: int = 128) -> dict:
    per = cores // numa_nodes
    return {
        "cpu": cores,
        "memory": f"{numa_memory_gib * numa_nodes}G",
        "numa-cpu": [",".join(str(c) for c in range(n * per, (n + 1) * per)) for n in range(numa_nodes)],
        "numa-memory": [f"{numa_memory_gib}G"] * numa_nodes,
    }


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, what: str, figure: str, anchor: str) -> None:
        self.rows.append((what, figure, anchor))
        print(f"  {what}: {figure}   [{anchor}]", file=sys.stderr, flush=True)

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows + [("measure", "berth", "anchor")]) for i in range(3)]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        print(line(("measure", "berth", "anchor")))
        print(line(tuple("-" * w for w in widths)))
        for row in self.rows:
            print(line(row))


# -- 2. the planner alone -------------------------------------------------------------------------


def planner_case(name: str):
    plugin = make_plugins()["cpumem"]
    cores = 128 if name == "c" else 64
    capacity, usage = plugin.add_node(node_request(cores), None)
    if name == "b":
        # Half the cores fully used (NUMA node 0), and 8 of the others at 30 free pieces.
        for core in range(32):
            usage["cpu_map"][str(core)] = 100
        for core in range(32, 40):
            usage["cpu_map"][str(core)] = 70
        usage["cpu"] = 32 + 8 * 0.7
    node = availability(decode_node_resource(capacity, "capacity"), decode_node_resource(usage, "usage"))
    request = PlanRequest.of(1.5, 2 * GiB, 100, -1)
    return node, request


def bench_planner(table: Table) -> None:
    for name, expected in (("a", 42), ("b", 16), ("c", 85)):
        node, request = planner_case(name)
        plans = cpu_plans(node, request)
        assert len(plans) == expected, (name, len(plans))
        best = float("inf")
        for _ in range(7):
            loops = 200
            started = time.perf_counter()
            for _ in range(loops):
                cpu_plans(node, request)
            best = min(best, (time.perf_counter() - started) / loops)
        table.add(
            f"planner ({name}) {expected} plans, per call", f"{best * 1e3:.3f} ms",
            f"eru Go {ERU_MS[name]} ms ({ERU_MS[name] / (best * 1e3):.1f}x)",
        )


# -- servers and workers --------------------------------------------------------------------------


class Workers:
    def __init__(self, nats_url: str, redis_url: str, prefix: str) -> None:
        self.argv = [sys.executable, "-m", "services.runner", "services.allocation.worker",
                     "--nats", nats_url, "--redis", redis_url, "--prefix", prefix, "--memory-stream"]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().startswith("ready")
        self.procs.append(proc)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)


async def nats_round_trip(nc, samples: int) -> list[float]:
    async def echo(msg):
        await msg.respond(msg.data)

    sub = await nc.subscribe("bench.echo", cb=echo)
    times = []
    payload = b"\x81\xa8nodename\xa2n1"
    for i in range(samples + 100):
        started = time.perf_counter()
        await nc.request("bench.echo", payload, timeout=5)
        if i >= 100:
            times.append(time.perf_counter() - started)
    await sub.unsubscribe()
    return times


async def add_nodes(client: BusClient, names: list[str], cores: int) -> None:
    slots = asyncio.Semaphore(64)
    resource = {"cpumem": node_request(cores)}

    async def add(name: str) -> None:
        async with slots:
            await client.request("resource.add-node", {"nodename": name, "resource": resource}, dict, timeout=30)

    await asyncio.gather(*(add(n) for n in names))


async def bench_bus(table: Table, nats_url: str, redis_url: str, nodes: int, placements: int) -> None:
    prefix = f"bench{os.getpid()}"
    workers = Workers(nats_url, redis_url, prefix)
    workers.start()
    nc = await connect(nats_url, name="bench-allocation", worker=False)
    client = BusClient(nc, prefix=prefix, timeout=60)
    redis = connect_redis(redis_url)
    try:
        # 1. calculate-deploy over the bus beside the raw NATS round trip.
        await add_nodes(client, ["big"], 128)
        raw = await nats_round_trip(nc, 2000)
        times = []
        request = {"nodename": "big", "deploy_count": 1, "workload_resource_request": REQUEST}
        for i in range(2100):
            started = time.perf_counter()
            await client.request("resource.calculate-deploy", request, dict)
            if i >= 100:
                times.append(time.perf_counter() - started)
        table.add(
            "calculate-deploy over the bus, 128 cores 2 NUMA, p50 / p99",
            f"{percentile(times, .5) * 1e3:.3f} / {percentile(times, .99) * 1e3:.3f} ms",
            f"raw NATS round trip {percentile(raw, .5) * 1e3:.3f} / {percentile(raw, .99) * 1e3:.3f} ms",
        )

        # 3. deploy capacity over many nodes.
        names = [f"n{i:05d}" for i in range(nodes)]
        started = time.perf_counter()
        await add_nodes(client, names, 64)
        table.add(f"add-node x {nodes} (64 concurrent)", f"{nodes / (time.perf_counter() - started):.0f} nodes/s", "-")
        for count in sorted({min(1000, nodes), nodes}):
            query = {"nodenames": names[:count], "workload_resource_request": REQUEST}
            for label in ("first call", "again"):
                started = time.perf_counter()
                reply = await client.request("resource.get-nodes-deploy-capacity", query, dict)
                elapsed = time.perf_counter() - started
                assert reply["total"] == 42 * count, reply["total"]
                anchor = "eru Go 1.2 s" if count == 1000 else "eru Go 5-8 s; goal < 1 s"
                table.add(f"get-nodes-deploy-capacity, {count} nodes, {label}", f"{elapsed:.3f} s", anchor)

        # 4. allocate with spread from 64 concurrent clients, 1 then 2 workers.
        lua_rate = await raw_lua_reserve_rate(redis, prefix, 64, 20000)
        for worker_count in (1, 2):
            while len(workers.procs) < worker_count:
                workers.start()
            rate, p99 = await allocate_spread(client, names, placements, 64, tag=f"w{worker_count}")
            table.add(
                f"allocate spread over {nodes} nodes, 64 clients, {worker_count} worker(s)",
                f"{rate:.0f} placements/s, p99 {p99 * 1e3:.1f} ms",
                f"raw Lua reserve {lua_rate:.0f}/s; kube-scheduler floor {KUBE_SCHEDULER_FLOOR:.0f}/s",
            )
    finally:
        await nc.close()
        workers.stop()
        keys = [k async for k in redis.scan_iter(match=f"{prefix}:*", count=5000)]
        for i in range(0, len(keys), 5000):
            await redis.delete(*keys[i:i + 5000])
        await redis.aclose()


async def raw_lua_reserve_rate(redis, prefix: str, clients: int, total: int) -> float:
    """A minimal reserve: check a counter against a limit and increment it, in one script."""
    script = redis.register_script(
        "local used = tonumber(redis.call('GET', KEYS[1]) or '0') "
        "if used + 1 > tonumber(ARGV[1]) then return 0 end "
        "redis.call('INCR', KEYS[1]) return 1"
    )
    key = f"{prefix}:lua-anchor"
    per_client = total // clients

    async def run() -> None:
        for _ in range(per_client):
            await script(keys=[key], args=[10**12])

    started = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(clients)))
    return per_client * clients / (time.perf_counter() - started)


async def allocate_spread(client: BusClient, names: list[str], placements: int, clients: int, tag: str):
    latencies: list[float] = []
    per_client = placements // clients
    request = {"nodenames": names, "strategy": "spread", "deploy_count": 1, "workload_resource_request": REQUEST}

    async def run() -> None:
        for _ in range(per_client):
            started = time.perf_counter()
            await client.request("resource.allocate", request, dict)
            latencies.append(time.perf_counter() - started)

    await client.request("resource.allocate", request, dict)  # the worker builds its view of the nodes
    started = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, percentile(latencies, 0.99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--placements", type=int, default=3200)
    args = parser.parse_args()
    table = Table()
    bench_planner(table)
    servers = []
    if not (args.nats and args.redis):
        state = Path(tempfile.mkdtemp(prefix="berth-bench-"))
        servers = [start_nats(state / "nats"), start_redis(state / "redis", appendonly=False)]
        args.nats, args.redis = servers[0].url, servers[1].url
    try:
        asyncio.run(bench_bus(table, args.nats, args.redis, args.nodes, args.placements))
    finally:
        for server in servers:
            server.stop()
    table.print()


if __name__ == "__main__":
    main()
