"""How allocation workers add up: 1 to 4 worker processes, each capped at a share of one CPU, as
N machines would be, for spread and pack, by names and by labels.

    .venv/bin/python bench/scaling.py [--cpu-quota 0.25] [--workers 1,2,3,4] [--nodes 2000]
                                      [--placements 3000] [--clients 64] [--fixed-clients]
                                      [--isolate] [--nats URL --redis URL]

Each worker process gets a CPU cap of its own (`--cpu-quota` of one core): a cgroup v1 `cpu` group
with `cpu.cfs_quota_us` (or a cgroup v2 group with `cpu.max`), whichever this host has; when neither
can be written the script says so and stops. The servers and the load client are not capped. The
client is written from the contract: plain msgpack, a unique `request_id` per call, 1.5 bound CPUs +
2 GiB per placement on `--nodes` nodes of 64 cores. The load grows with the workers, as it does
when one adds machines because there is more to place: `--clients` concurrent callers and
`--placements` per worker (`--fixed-clients`: `--clients` in all, so each of N workers sees 1/N
of the callers; a worker batches fewer commits then, and spends more CPU per placement: the last
column is one worker with that share of the callers alone). Each row
is placements/s with N workers and its efficiency, rate(N) / (N x rate(1)); beside them, the
workers' CPU per 1,000 placements (from their own /proc stat) and, in the same run and under the
same caps, the rate of as many bare echo responders.

With `--isolate`, the capped processes run on the last core and everything else (the servers this
script starts and the load client) on the others, as on N machines, where a worker shares its core
with neither NATS, Redis nor the callers. Without it they all share every core: on a small host the
servers and the client then take CPU from the workers, the more the busier they are, and even the
echo responders do not add up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from bench.allocation import (  # noqa: E402
    LABELS, REQUEST, EchoResponders, ProcessCpu, Requests, Workers, add_nodes, delete_stream, load,
)
from bench.servers import given_or_started  # noqa: E402

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads made later inherit their maker's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


class CpuCaps:
    """A cgroup per capped process under a parent of this run's own; removed at the end. With
    `cpus`, a capped process also runs on those CPUs only."""

    def __init__(self, quota: float, cpus: set[int] | None = None) -> None:
        self.quota = quota
        self.cpus = cpus
        self.name = f"berth-scaling-{os.getpid()}"
        if (V1 / "cpu.cfs_quota_us").exists():
            self.kind, self.parent = "cgroup v1 cpu.cfs_quota_us", V1 / self.name
        elif (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text().split():
            self.kind, self.parent = "cgroup v2 cpu.max", V2 / self.name
        else:
            raise SystemExit("no cgroup cpu controller here (neither /sys/fs/cgroup/cpu nor a v2 cpu.max): "
                             "cannot cap the workers")
        try:
            self.parent.mkdir(exist_ok=True)
            if self.kind.startswith("cgroup v2"):
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
        except OSError as error:
            raise SystemExit(f"cannot write {self.parent} ({error}): cannot cap the workers") from None
        self.groups: list[Path] = []

    def cap(self, pid: int) -> None:
        group = self.parent / f"p{pid}"
        group.mkdir()
        quota = int(self.quota * PERIOD_US)
        if self.kind.startswith("cgroup v1"):
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))
        self.groups.append(group)
        if self.cpus:
            pin(pid, self.cpus)

    def close(self) -> None:
        root = V1 if self.kind.startswith("cgroup v1") else V2
        for group in self.groups:
            for pid in filter(None, (group / "cgroup.procs").read_text().split()):
                try:
                    (root / "cgroup.procs").write_text(pid)  # back to the root before the group goes
                except OSError:
                    pass
            group.rmdir()
        self.parent.rmdir()


async def measure(args, caps: CpuCaps, nats_url: str, redis_url: str) -> dict:
    results: dict = {}
    for count in args.workers:
        prefix = f"scale{uuid.uuid4().hex[:8]}"  # fresh nodes for each worker count
        workers = Workers(nats_url, redis_url, prefix, started=caps.cap)
        echo = EchoResponders(nats_url, f"{prefix}.echo")
        nc = await nats.connect(nats_url, name="bench-scaling")
        try:
            workers.scale(count)
            names = [f"node-{i:06d}-rack-b" for i in range(args.nodes)]
            await add_nodes(nc, prefix, names, 64, LABELS)
            echo.scale(count)
            for pid in (p.pid for p in echo.procs):
                caps.cap(pid)
            subject = f"{prefix}.resource.allocate"
            clients = args.clients if args.fixed_clients else args.clients * count
            for selector in ("names", "labels"):
                chosen = {"nodenames": names} if selector == "names" else {"labels": LABELS}
                raw = await load(nc, echo.subject, Requests(chosen).next, args.placements * count, clients)
                for strategy in ("spread", "pack"):
                    requests = Requests({**chosen, "strategy": strategy, "deploy_count": 1,
                                         "workload_resource_request": REQUEST})
                    for _ in range(count * 4):  # every worker builds its view before timing
                        await nc.request(subject, requests.next(), timeout=60)
                    cpu = ProcessCpu([p.pid for p in workers.procs])
                    run = await load(nc, subject, requests.next, args.placements * count, clients)
                    spent = cpu.per_thousand(len(run.latencies))
                    results[(strategy, selector, count)] = (run.rate, spent, raw.rate, dict(run.errors))
                    print(f"  {count} worker(s), {strategy} by {selector}: {run.row()}", file=sys.stderr, flush=True)
                    if args.fixed_clients and count == 1:  # one worker's share of the callers at the most workers
                        share = max(1, clients // args.workers[-1])
                        cpu = ProcessCpu([p.pid for p in workers.procs])
                        run = await load(nc, subject, requests.next, args.placements, share)
                        results[(strategy, selector, "share")] = (run.rate, cpu.per_thousand(len(run.latencies)))
                        print(f"  1 worker, {share} callers, {strategy} by {selector}: {run.row()}", file=sys.stderr,
                              flush=True)
        finally:
            workers.stop()
            echo.stop()
            await delete_stream(nc, prefix)
            await nc.close()
    return results


def table(args, results: dict, kind: str) -> None:
    callers = f"{args.clients} clients in all" if args.fixed_clients else f"{args.clients} clients per worker"
    print(f"allocate, each worker capped at {args.cpu_quota:g} CPU ({kind}), {args.nodes:,} nodes, "
          f"{callers}, a unique request_id per call")
    share = f"1 worker, {args.clients // args.workers[-1]} callers: placements/s, CPU s / 1,000"
    print("| allocate | " + " | ".join(f"{n} worker{'s' if n > 1 else ''}" for n in args.workers) + " | efficiency at "
          + ", ".join(str(n) for n in args.workers[1:]) + " | worker CPU s / 1,000 placements | "
          + "bare echo, same caps |" + (f" {share} |" if args.fixed_clients else ""))
    print("|---" * (len(args.workers) + 4 + args.fixed_clients) + "|")
    for strategy in ("spread", "pack"):
        for selector in ("names", "labels"):
            rates = [results[(strategy, selector, n)][0] for n in args.workers]
            base = rates[0]
            efficiency = [f"{rate / (n * base):.2f}" for rate, n in zip(rates[1:], args.workers[1:])]
            cpu = " / ".join(f"{results[(strategy, selector, n)][1]:.3f}" for n in args.workers)
            echo = [f"{results[(strategy, selector, n)][2]:,.0f}" for n in args.workers]
            alone = ""
            if args.fixed_clients:
                rate, spent = results[(strategy, selector, "share")]
                alone = f" {rate:,.0f}/s, {spent:.3f} |"
            print(f"| {strategy}, by {selector} | " + " | ".join(f"{r:,.0f}/s" for r in rates) + " | "
                  + ", ".join(efficiency) + f" | {cpu} | " + " / ".join(echo) + " |" + alone)
    errors = {key: result[3] for key, result in results.items() if len(result) > 3 and result[3]}
    if errors:
        print("errors:", errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    parser.add_argument("--cpu-quota", type=float, default=0.25, help="share of one CPU per worker process")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--placements", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=64, help="concurrent callers per worker")
    parser.add_argument("--fixed-clients", action="store_true",
                        help="--clients in all, whatever the number of workers (each sees less load)")
    parser.add_argument("--isolate", action="store_true",
                        help="the capped processes on the last core, the servers and the client on the others")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.isolate and (len(cores) < 2 or args.nats or args.redis):
        raise SystemExit("--isolate needs two cores or more, and servers this script starts (no --nats/--redis)")
    capped, rest = ({cores[-1]}, set(cores[:-1])) if args.isolate else (None, None)
    caps = CpuCaps(args.cpu_quota, capped)
    try:
        with given_or_started(args) as servers:
            if rest:
                for pid in (os.getpid(), *(server.proc.pid for server in servers)):
                    pin(pid, rest)
            results = asyncio.run(measure(args, caps, args.nats, args.redis))
        table(args, results, caps.kind + (f", capped processes on CPU {cores[-1]}, the rest on the others"
                                          if args.isolate else ""))
    finally:
        caps.close()


if __name__ == "__main__":
    main()
