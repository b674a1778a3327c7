"""Worker CPU per placement of this checkout beside another commit's, measured in the same run.

    .venv/bin/python bench/compare.py [--against HEAD] [--this REV] [--rounds 3] [--nodes 2000]
                                      [--placements 3200] [--clients 64] [--nats URL --redis URL]

A figure from another day is no baseline on a shared machine: its speed drifts by half within an
hour. This runs one uncapped allocation worker of each tree in turn (this checkout as it is, with
its uncommitted changes, and `--against`, checked out into a temporary git worktree), `--rounds`
times in the order A B, B A, A B... so that a drift hits both alike, on the same servers and with
the same load client (`--this REV`: that commit in place of this checkout). Each round gives each tree fresh nodes of its own (`--nodes` of 64 cores,
labelled), and places on them as `bench/allocation.py` does (1.5 bound CPUs + 2 GiB, deploy_count
1, a unique `request_id` per call, `--clients` concurrent callers, `--placements` per row):
spread and pack, by the list of every name and by label. Each row is the worker's CPU per 1,000
placements (from its /proc stat), median and range over the rounds, and the ratio of the medians;
the anchor row, in the same rounds, is a bare echo responder answering the same labelled request.

The load client and the servers are this checkout's; only the workers differ. The other tree runs
on this checkout's virtualenv, so `--against` must be a commit whose dependencies it has.
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
    LABELS, REQUEST, EchoResponders, ProcessCpu, Requests, add_nodes, delete_namespace, delete_stream, load,
)
from bench.servers import given_or_started  # noqa: E402
from bus.redis import connect_redis  # noqa: E402

ROWS = [(strategy, selector) for selector in ("names", "labels") for strategy in ("spread", "pack")]
ECHO_ROW = "anchor: bare echo of the labelled request"


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


def start_worker(tree: Path, nats_url: str, redis_url: str, prefix: str) -> subprocess.Popen:
    """One allocation worker of `tree`'s own code (its runner moved from services/ to bus/ once)."""
    runner = "bus.runner" if (tree / "bus" / "runner.py").exists() else "services.runner"
    proc = subprocess.Popen(
        [sys.executable, "-m", runner, "services.allocation.worker", "--nats", nats_url, "--redis", redis_url,
         "--prefix", prefix, "--memory-stream"],
        cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    if not proc.stdout.readline().startswith("ready"):
        proc.kill()
        raise SystemExit(f"an allocation worker of {tree} did not start")
    return proc


async def one_round(tree: Path, args, nats_url: str, redis_url: str) -> dict[str, float]:
    """CPU s per 1,000 placements of each row, for one worker of `tree` on fresh nodes."""
    prefix = f"compare{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(nats_url, name="bench-compare", max_reconnect_attempts=3)
    redis = connect_redis(redis_url)
    worker = start_worker(tree, nats_url, redis_url, prefix)
    try:
        names = [f"c{i:05d}" for i in range(args.nodes)]
        await add_nodes(nc, prefix, names, 64, LABELS)
        subject = f"{prefix}.resource.allocate"
        spent = {}
        for strategy, selector in ROWS:
            chosen = {"nodenames": names} if selector == "names" else {"labels": LABELS}
            requests = Requests({**chosen, "strategy": strategy, "deploy_count": 1,
                                 "workload_resource_request": REQUEST})
            for _ in range(4):  # the worker builds its view of the nodes before timing
                await nc.request(subject, requests.next(), timeout=60)
            cpu = ProcessCpu([worker.pid])
            run = await load(nc, subject, requests.next, args.placements, args.clients)
            if run.errors:
                raise SystemExit(f"{tree}: allocate {strategy} by {selector} failed: {dict(run.errors)}")
            spent[f"allocate {strategy} by {selector}"] = cpu.per_thousand(len(run.latencies))
        return spent
    finally:
        worker.terminate()
        worker.wait(30)
        await delete_stream(nc, prefix)
        await nc.close()
        await delete_namespace(redis, prefix)
        await redis.aclose()


async def echo_round(args, nats_url: str) -> float:
    echo = EchoResponders(nats_url, f"compare{uuid.uuid4().hex[:8]}.echo")
    echo.scale(1)
    nc = await nats.connect(nats_url, name="bench-compare-echo")
    try:
        requests = Requests({"labels": LABELS, "strategy": "pack", "deploy_count": 1,
                             "workload_resource_request": REQUEST})
        cpu = ProcessCpu([p.pid for p in echo.procs])
        run = await load(nc, echo.subject, requests.next, args.placements, args.clients)
        return cpu.per_thousand(len(run.latencies))
    finally:
        await nc.close()
        echo.stop()


def cell(figures: list[float]) -> str:
    return f"{statistics.median(figures):.3f} ({min(figures):.3f}-{max(figures):.3f})"


async def compare(args, nats_url: str, redis_url: str, this: Path, other: Path) -> None:
    if args.this == args.against:  # an A/A run: how far apart the same code measures (the noise)
        args.against += " (again)"
    trees = {args.this: this, args.against: other}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    echo: list[float] = []
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            for row, spent in (await one_round(trees[name], args, nats_url, redis_url)).items():
                figures[name].setdefault(row, []).append(spent)
        echo.append(await echo_round(args, nats_url))
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    this, that = figures[args.this], figures[args.against]
    print(f"\nWorker CPU s per 1,000 placements, 1 uncapped worker, {args.nodes:,} nodes, {args.clients} callers, "
          f"{args.placements:,} placements a row: median (range) of {args.rounds} rounds\n")
    print(f"| row | {args.this} | {args.against} | this / that |")
    print("|---|---|---|---|")
    for row in this:
        ratio = statistics.median(this[row]) / statistics.median(that[row])
        print(f"| {row} | {cell(this[row])} | {cell(that[row])} | {ratio:.2f} |")
    print(f"| {ECHO_ROW} | {cell(echo)} | (same rounds) | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--this", help="a commit to measure in place of this checkout as it is")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--placements", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(worktree(args.against))
        this = stack.enter_context(worktree(args.this)) if args.this else ROOT
        args.this = args.this or "this checkout"
        stack.enter_context(given_or_started(args))
        asyncio.run(compare(args, args.nats, args.redis, this, other))


if __name__ == "__main__":
    main()
