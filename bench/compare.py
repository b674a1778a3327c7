"""Worker CPU per placement of this checkout beside another commit's, measured in the same run.

    .venv/bin/python bench/compare.py [--against HEAD] [--this REV] [--turns 6] [--nodes 2000]
                                      [--placements 1600] [--clients 64] [--nats URL --redis URL]

A figure from another day is no baseline on a shared machine: its speed drifts by half within an
hour. This starts one uncapped allocation worker of each tree side by side (this checkout as it is,
with its uncommitted changes, or the commit `--this`; and `--against`, each other commit checked out
into a temporary git worktree), each in a namespace of its own with `--nodes` nodes of 64 cores,
on the same servers and with the same load client, and places as `bench/allocation.py` does (1.5
bound CPUs + 2 GiB, deploy_count 1, a unique `request_id` per call, `--clients` concurrent
callers): spread and pack, by the list of every name and by label. Each row takes `--turns` turns
of `--placements` placements per tree, in the order A B, B A, A B..., so that a drift of the
machine hits both alike. A cell is the worker's CPU per 1,000 placements (from its /proc stat),
median and range over the turns; the last column is the ratio of each pair of turns. The anchor row
is a bare echo responder answering the same labelled request, once a row.

The load client and the servers are this checkout's; only the workers differ. Another tree runs on
this checkout's virtualenv, so it must be a commit whose dependencies that has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench.allocation import (  # noqa: E402
    LABELS, REQUEST, EchoResponders, ProcessCpu, Requests, Workers, add_nodes, delete_namespace, delete_stream,
    load,
)
from bench.servers import given_or_started  # noqa: E402
from bus.redis import connect_redis  # noqa: E402

ROWS = [(strategy, selector) for selector in ("names", "labels") for strategy in ("spread", "pack")]
ECHO_ROW = "anchor: bare echo of the labelled request"
PER_NODE = 42  # instances of 1.5 CPUs a node of 64 cores holds


@contextlib.contextmanager
def worktree(revision: str):
    """`revision` checked out into a temporary directory, removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="berth-compare-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), revision], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


def placing(chosen: dict, strategy: str) -> Requests:
    """Allocate requests of one instance on the `chosen` nodes, as bench/allocation.py sends them."""
    return Requests({**chosen, "strategy": strategy, "deploy_count": 1, "workload_resource_request": REQUEST})


class Side:
    """One tree's worker in a namespace of its own, on nodes of its own, and a client for it."""

    def __init__(self, name: str, tree: Path) -> None:
        self.name = name
        self.tree = tree
        self.prefix = f"compare{uuid.uuid4().hex[:8]}"
        self.workers: Workers | None = None
        self.nc = self.redis = None

    async def start(self, args, nats_url: str, redis_url: str) -> None:
        self.nc = await nats.connect(nats_url, name="bench-compare", max_reconnect_attempts=3)
        self.redis = connect_redis(redis_url)
        self.workers = Workers(nats_url, redis_url, self.prefix, tree=self.tree)
        self.workers.scale(1)
        self.names = [f"c{i:05d}" for i in range(args.nodes)]
        await add_nodes(self.nc, self.prefix, self.names, 64, LABELS)

    def requests(self, strategy: str, selector: str) -> Requests:
        return placing({"nodenames": self.names} if selector == "names" else {"labels": LABELS}, strategy)

    async def stretch(self, requests: Requests, args) -> float:
        """CPU s per 1,000 placements of `args.placements` placements."""
        cpu = ProcessCpu([p.pid for p in self.workers.procs])
        run = await load(self.nc, f"{self.prefix}.resource.allocate", requests.next, args.placements, args.clients)
        if run.errors:
            raise SystemExit(f"{self.name}: allocate failed: {dict(run.errors)}")
        return cpu.per_thousand(len(run.latencies))

    async def warm(self, requests: Requests) -> None:
        for _ in range(4):  # the worker builds its view of the nodes before timing
            await self.nc.request(f"{self.prefix}.resource.allocate", requests.next(), timeout=60)

    async def stop(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self.nc is not None:
            await delete_stream(self.nc, self.prefix)
            await self.nc.close()
        if self.redis is not None:
            await delete_namespace(self.redis, self.prefix)
            await self.redis.aclose()


async def echo_stretch(args, echo: EchoResponders, nc) -> float:
    requests = placing({"labels": LABELS}, "pack")
    cpu = ProcessCpu([p.pid for p in echo.procs])
    run = await load(nc, echo.subject, requests.next, args.placements, args.clients)
    return cpu.per_thousand(len(run.latencies))


def cell(figures: list[float]) -> str:
    if not figures:
        return "-"
    return f"{statistics.median(figures):.3f} ({min(figures):.3f}-{max(figures):.3f})"


async def compare(args, nats_url: str, redis_url: str, this: Path, other: Path) -> None:
    if args.this == args.against:  # an A/A run: how far apart the same code measures (the noise)
        args.against += " (again)"
    sides = [Side(args.this, this), Side(args.against, other)]
    echo = EchoResponders(nats_url, f"compare{uuid.uuid4().hex[:8]}.echo")
    echo.scale(1)
    echo_nc = await nats.connect(nats_url, name="bench-compare-echo")
    rows: dict[str, tuple[list[float], list[float], list[float]]] = {}
    anchor: list[float] = []
    try:
        for side in sides:
            await side.start(args, nats_url, redis_url)
        for strategy, selector in ROWS:
            requests = [side.requests(strategy, selector) for side in sides]
            for side, made in zip(sides, requests):
                await side.warm(made)
            this_cpu, that_cpu, ratios = rows.setdefault(f"allocate {strategy} by {selector}", ([], [], []))
            for stretch in range(args.turns):
                turn = (0, 1) if stretch % 2 == 0 else (1, 0)  # A B, B A, ...: a drift hits both alike
                spent = {i: await sides[i].stretch(requests[i], args) for i in turn}
                this_cpu.append(spent[0])
                that_cpu.append(spent[1])
                if spent[0] and spent[1]:  # a short turn may take less than a clock tick of CPU
                    ratios.append(spent[0] / spent[1])
            anchor.append(await echo_stretch(args, echo, echo_nc))
            print(f"allocate {strategy} by {selector}: done", file=sys.stderr)
    finally:
        for side in sides:
            await side.stop()
        await echo_nc.close()
        echo.stop()
    print(f"\nWorker CPU s per 1,000 placements, 1 uncapped worker a tree, {args.nodes:,} nodes each, "
          f"{args.clients} callers, {args.turns} turns of {args.placements:,} placements a tree and row: "
          "median (range)\n")
    print(f"| row | {args.this} | {args.against} | this / that, turn by turn |")
    print("|---|---|---|---|")
    for row, (this_cpu, that_cpu, ratios) in rows.items():
        print(f"| {row} | {cell(this_cpu)} | {cell(that_cpu)} | {cell(ratios)} |")
    print(f"| {ECHO_ROW} | {cell(anchor)} | (the same turns) | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--this", help="a commit to measure in place of this checkout as it is")
    parser.add_argument("--turns", type=int, default=6, help="turns per tree and row")
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--placements", type=int, default=1600, help="placements per turn")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    args = parser.parse_args()
    placed, room = len(ROWS) * args.turns * args.placements, args.nodes * PER_NODE
    if placed > room:
        parser.error(f"{placed:,} placements a tree, but {args.nodes:,} nodes hold {room:,}: "
                     "fewer turns or placements")
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(worktree(args.against))
        this = stack.enter_context(worktree(args.this)) if args.this else ROOT
        args.this = args.this or "this checkout"
        stack.enter_context(given_or_started(args))
        asyncio.run(compare(args, args.nats, args.redis, this, other))


if __name__ == "__main__":
    main()
