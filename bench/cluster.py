"""berth on clusters vs on single servers, in one run.

    .venv/bin/python bench/cluster.py [--nodes 2000] [--placements 3200] [--clients 64]

Two setups on this machine's loopback: one nats-server and one redis-server; a 3-server NATS cluster
(JetStream streams replicated three times) and a 3-primary, 3-replica Redis Cluster. In each, one
allocation worker serves `allocate` (spread by a label, a unique request_id per call, 1.5 bound CPUs
+ 2 GiB, from `--clients` clients written from the contract), and a subscriber measures the event
path: from the `time` stamped in an `allocated` event by the worker to its arrival, with the
subscriber connected to another server of the cluster than the worker where there is one.
Anchors from the same run: the raw NATS round trip and the raw Redis Lua rate of each setup.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import nats  # noqa: E402

from bench.allocation import (  # noqa: E402
    LABELS,
    REQUEST,
    CpuShare,
    EchoResponders,
    Requests,
    Table,
    Workers,
    add_nodes,
    load,
    raw_lua_rate,
)
from bench.stats import percentile  # noqa: E402
from berth.servers import start_nats, start_nats_cluster, start_redis, start_redis_cluster  # noqa: E402
from bus.redis import connect_redis, ready  # noqa: E402


async def measure(table: Table, label: str, nats_url: str, redis_url: str, pids: dict[str, int], args) -> None:
    prefix = f"bench{os.getpid()}"
    servers = nats_url.split(",")
    workers = Workers(servers[0], redis_url, prefix)  # the worker on the first server
    workers.scale(1)
    echo = EchoResponders(servers[0], f"{prefix}.echo")
    echo.scale(1)
    nc = await nats.connect(servers[-1:])  # the clients and the subscriber on the last one
    redis = await ready(connect_redis(redis_url))
    try:
        await add_nodes(nc, prefix, [f"node-{i:05d}" for i in range(args.nodes)], 64, LABELS)
        ping = Requests({"labels": LABELS})
        raw = await load(nc, f"{prefix}.echo", ping.next, args.placements, args.clients)
        table.add(f"{label}: anchor, raw NATS request/reply across the servers", raw.row(), "-")
        lua = await raw_lua_rate(redis, prefix, args.clients, 20000)
        table.add(f"{label}: anchor, raw Redis Lua check-and-increment", f"{lua:,.0f}/s", "-")

        delays: list[float] = []

        async def arrived(msg) -> None:
            delays.append(time.time() - msgpack.unpackb(msg.data)["time"])

        sub = await nc.subscribe(f"{prefix}.events.resource.*.allocated", cb=arrived)
        requests = Requests({"labels": LABELS, "strategy": "spread", "deploy_count": 1, "workload_resource_request": REQUEST})
        subject = f"{prefix}.resource.allocate"
        for _ in range(4):
            await nc.request(subject, requests.next(), timeout=60)
        cpu = CpuShare({**pids, "client": os.getpid(), "worker": workers.procs[0].pid})
        run = await load(nc, subject, requests.next, args.placements, args.clients)
        table.add(f"{label}: allocate spread by label, 1 worker", run.row(), f"raw NATS {raw.rate:,.0f}/s; CPU: {cpu.row()}")
        await nc.flush()
        await sub.unsubscribe()
        table.add(
            f"{label}: event path, worker to subscriber, p50/p99",
            f"{percentile(delays, .5) * 1e3:.2f} / {percentile(delays, .99) * 1e3:.2f} ms ({len(delays)} events)", "-",
        )
    finally:
        await nc.close()
        workers.stop()
        echo.stop()
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--placements", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    table = Table()
    state = Path(tempfile.mkdtemp(prefix="berth-bench-cluster-"))
    single = [start_nats(state / "nats"), start_redis(state / "redis", appendonly=False)]
    try:
        pids = {"nats": single[0].proc.pid, "redis": single[1].proc.pid}
        asyncio.run(measure(table, "single servers", single[0].url, single[1].url, pids, args))
    finally:
        for server in single:
            server.stop()
    clusters = [start_nats_cluster(state / "nats-cluster"), start_redis_cluster(state / "redis-cluster")]
    try:
        pids = {m.name: m.proc.pid for cluster in clusters for m in cluster.members}
        asyncio.run(measure(table, "clusters", clusters[0].url, clusters[1].url, pids, args))
    finally:
        for cluster in clusters:
            cluster.stop()
    table.print()


if __name__ == "__main__":
    main()
