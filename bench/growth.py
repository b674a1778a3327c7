"""How one allocation worker grows with the fleet: the same operations at 5,000 and at 50,000 nodes,
in one table, with the anchors measured in the same run.

    .venv/bin/python bench/growth.py [--sizes 5000,50000] [--placements 3000] [--clients 64]
                                     [--idle 15] [--nats URL --redis URL]

For each size, a fresh namespace and a fresh worker process (uncapped), then:
- add-node for every node (64 concurrent callers; nodes of 64 cores in 2 NUMA nodes, one label);
- get-nodes-deploy-capacity over every node (by the label), the first call and again;
- allocate by the label, spread and pack, 1.5 bound CPUs + 2 GiB, from `--clients` callers;
- a full `list-nodes` pass (pages of 1,000);
- the worker's resident memory per node: its RSS after all of the above less its RSS before the
  first node was added, divided by the nodes;
- the worker's CPU while nothing is asked of it for `--idle` seconds (default 15: three of its
  sweeps, which compare every node's version with the store to catch a lost event), % of one core,
  from 12 s after the last request (the first sweep after a busy spell has more to do, once).
The NATS server it starts takes messages of up to 8 MiB (a capacity answer over 50,000 nodes is
about 3 MiB; over the default 1 MiB it is refused, naming the selection). Anchors: a bare NATS echo
responder answering the same allocate request, and the raw Redis Lua rate (a minimal
check-and-increment script), both measured at each size.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.allocation import (  # noqa: E402
    LABELS, REQUEST, ProcessCpu, Requests, add_nodes, call, cpu_seconds, load, namespace, raw_lua_rate,
)
from bench.servers import given_or_started  # noqa: E402
from bench.stats import percentile  # noqa: E402

MAX_PAYLOAD = 8 << 20
IDLE_SETTLE = 12.0  # seconds: past the outboxes' grace (5 s) and the next sweep (every 5 s)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def timed(step) -> float:
    started = time.perf_counter()
    await step()
    return time.perf_counter() - started


async def one_size(args, size: int, nats_url: str, redis_url: str) -> dict[str, str]:
    prefix = f"grow{uuid.uuid4().hex[:8]}"
    row: dict[str, str] = {}
    async with namespace(nats_url, redis_url, prefix) as (workers, echo, nc, redis):
        workers.scale(1)
        echo.scale(1)
        pid = workers.procs[0].pid
        empty = rss_bytes(pid)
        names = [f"node-{i:06d}-rack-b" for i in range(size)]
        added = await timed(lambda: add_nodes(nc, prefix, names, 64, LABELS))
        row["add-node (64 callers)"] = f"{size / added:,.0f} nodes/s"
        query = {"labels": LABELS, "workload_resource_request": REQUEST}
        for label in ("first call", "again"):
            reply: dict = {}

            async def capacity() -> None:
                reply.update(await call(nc, f"{prefix}.resource.get-nodes-deploy-capacity", query))

            row[f"capacity over every node, {label}"] = f"{await timed(capacity):.3f} s"
            assert reply["total"] == 42 * size, reply["total"]
        raw = await load(nc, echo.subject, Requests({"labels": LABELS}).next, args.placements, args.clients)
        row["anchor: bare echo of the same request"] = f"{raw.rate:,.0f}/s"
        for strategy in ("spread", "pack"):
            requests = Requests({"labels": LABELS, "strategy": strategy, "deploy_count": 1,
                                 "workload_resource_request": REQUEST})
            await nc.request(f"{prefix}.resource.allocate", requests.next(), timeout=60)  # its view, untimed
            cpu = ProcessCpu([pid])
            run = await load(nc, f"{prefix}.resource.allocate", requests.next, args.placements, args.clients)
            assert not run.errors, run.errors
            p99 = percentile(run.latencies, .99) * 1e3
            spent = cpu.per_thousand(len(run.latencies))
            row[f"allocate {strategy} by label"] = f"{run.rate:,.0f}/s, p99 {p99:.1f} ms, {spent:.3f} CPU s / 1,000"

        async def list_all() -> None:
            offset = 0
            while offset is not None:
                page = await call(nc, f"{prefix}.resource.list-nodes", {"offset": offset, "limit": 1000})
                offset = page["next_offset"]

        row["list-nodes, every page"] = f"{await timed(list_all):.3f} s"
        row["worker memory per node (RSS)"] = f"{(rss_bytes(pid) - empty) / size:,.0f} B"
        # Settled first: the sweep that follows a busy spell publishes or forgets the outboxes of
        # every node committed to (bus.outbox), once; what is measured is what idling costs.
        await asyncio.sleep(min(IDLE_SETTLE, args.idle))
        before = cpu_seconds(pid)
        await asyncio.sleep(args.idle)
        row["worker CPU while idle"] = f"{(cpu_seconds(pid) - before) / args.idle * 100:.1f} % of a core"
        lua = await raw_lua_rate(redis, prefix, args.clients, 20000)
        row["anchor: raw Redis Lua check-and-increment"] = f"{lua:,.0f}/s"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[5000, 50000])
    parser.add_argument("--placements", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--idle", type=float, default=15.0, help="seconds the worker is watched while idle")
    args = parser.parse_args()
    # A capacity answer over 50,000 nodes takes about 3 MiB: more than NATS's default 1 MiB.
    rows = {}
    with given_or_started(args, nats_settings=f"max_payload: {MAX_PAYLOAD}\n"):
        for size in args.sizes:
            rows[size] = asyncio.run(one_size(args, size, args.nats, args.redis))
            print(f"  {size:,} nodes: {rows[size]}", file=sys.stderr, flush=True)
    print("| measure | " + " | ".join(f"{size:,} nodes" for size in args.sizes) + " |")
    print("|---" * (len(args.sizes) + 1) + "|")
    for measure in rows[args.sizes[0]]:
        print(f"| {measure} | " + " | ".join(rows[size][measure] for size in args.sizes) + " |")
    for strategy in ("spread", "pack"):
        measure = f"allocate {strategy} by label"
        rates = [float(rows[size][measure].split("/s")[0].replace(",", "")) for size in args.sizes]
        print(f"allocate {strategy} by label at {args.sizes[-1]:,} nodes: {rates[-1] / rates[0]:.2f} of its rate at "
              f"{args.sizes[0]:,} (goal: at least 0.8)")


if __name__ == "__main__":
    main()
