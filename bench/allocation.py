"""Allocation benchmarks with the request shapes real clients send, each figure beside its anchor.

    .venv/bin/python bench/allocation.py [--nodes 5000] [--placements 3000] [--clients 64]
                                         [--workers 1,2,3] [--nats URL --redis URL]

The load client is written from the contract alone: nats-py and plain `msgpack`, every `allocate`
carrying a unique `request_id`, requests packed before they are timed (only the request id is
spliced in per call), replies decoded only to read an error code. What it measures:

1. The CPU planner alone on one node: (a) 64 idle cores in 2 NUMA nodes -> 42 plans; (b) half the
   cores used and 8 at 30 free pieces -> 16 plans; (c) 128 idle cores -> 85 plans. Best of 7,
   beside eru's Go planner measured on this machine (0.94 / 0.2 / 3.9 ms).
2. calculate-deploy over the bus, p50/p99, beside the raw NATS round trip of a same-sized request.
3. get-nodes-deploy-capacity over 1,000 and 5,000 nodes, first call and again (eru Go: 1.2 s / 5-8 s).
4. list-nodes: a full pass over every page of 5,000 nodes.
5. Where one worker's CPU per pack placement goes: a bare echo, the service framework alone, the
   placement without a `request_id` and with one (CPU per 1,000 requests of each).
6. allocate, 1.5 bound CPUs + 2 GiB, deploy_count 1, from `--clients` concurrent clients: spread and
   pack, selecting nodes by a list of every name (93 KiB per request at 5,000 nodes) or by a label,
   with 1, 2 and 3 worker processes: placements/s, p50/p99/p99.9, errors by code, and each
   process's CPU use meanwhile (% of one core). Anchors from the same run: the same requests from
   the same clients on as many bare echo responders (nats-py, a queue group, one process each) as
   there are workers; the raw Redis Lua rate (a minimal check-and-increment script from the same
   number of clients); kube-scheduler's published floor of 680 pods/s.

Servers are started on free loopback ports unless URLs are given; everything stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import nats  # noqa: E402
import nats.js.errors  # noqa: E402

from bench.servers import given_or_started  # noqa: E402
from bench.stats import percentile  # noqa: E402
from bus.events import EventBus  # noqa: E402
from bus.redis import connect_redis  # noqa: E402
from services.allocation.plugins.cpumem.plans import PlanRequest, cpu_plans  # noqa: E402
from services.allocation.plugins.cpumem.resources import availability  # noqa: E402
from services.allocation.plugins.cpumem.types import decode_node_resource  # noqa: E402
from services.allocation.worker import STREAM, make_plugins  # noqa: E402

GiB = 1 << 30
REQUEST = {"cpumem": {"cpu-bind": True, "cpu-request": 1.5, "memory-request": 2 * GiB}}
LABELS = {"pool": "bench"}
ERU_MS = {"a": 0.94, "b": 0.2, "c": 3.9}
KUBE_SCHEDULER_FLOOR = 680.0
ERROR_CODE = "Nats-Service-Error-Code"


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
        header = ("measure", "berth", "anchor (same run)")
        widths = [max(len(r[i]) for r in self.rows + [header]) for i in range(3)]
        print("| " + " | ".join(c.ljust(w) for c, w in zip(header, widths)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row in self.rows:
            print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


# -- 1. the planner alone -------------------------------------------------------------------------


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
    return node, PlanRequest.of(1.5, 2 * GiB, 100, -1)


def bench_planner(table: Table) -> None:
    for name, expected in (("a", 42), ("b", 16), ("c", 85)):
        node, request = planner_case(name)
        assert len(cpu_plans(node, request)) == expected, name
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


# -- processes ------------------------------------------------------------------------------------


class Workers:
    """Allocation worker processes in one namespace; `started(pid)` runs on each before it serves
    (bench/scaling.py caps its CPU there, so that its "ready" already comes under the cap)."""

    def __init__(
        self, nats_url: str, redis_url: str, prefix: str, started: Callable[[int], None] = lambda pid: None,
        options: Sequence[str] = (), tree: Path = ROOT,
    ) -> None:
        # `tree`: whose code the workers run (bench/compare.py: another commit's; its runner moved
        # from services/ to bus/ once)
        runner = "bus.runner" if (tree / "bus" / "runner.py").exists() else "services.runner"
        self.argv = [sys.executable, "-m", runner, "services.allocation.worker",
                     "--nats", nats_url, "--redis", redis_url, "--prefix", prefix, "--memory-stream", *options]
        self.tree = tree
        self.started = started
        self.procs: list[subprocess.Popen] = []

    def scale(self, count: int) -> None:
        while len(self.procs) < count:
            proc = subprocess.Popen(self.argv, cwd=self.tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
            self.started(proc.pid)
            if not proc.stdout.readline().startswith("ready"):
                raise RuntimeError("an allocation worker did not start")
            self.procs.append(proc)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(30)
        self.procs.clear()


ECHO = """
import asyncio, sys
sys.path.insert(0, sys.argv[3])
from bus.connection import connect  # nats-py's connect, with a URL's credentials and BERTH_TLS_CA
async def main():
    nc = await connect(sys.argv[1], name="echo", inbox_prefix=sys.argv[4])
    async def echo(msg):
        await msg.respond(b"\\x80")
    await nc.subscribe(sys.argv[2], queue="echo", cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class EchoResponders:
    """Bare nats-py responders in a queue group, one process each: the most any NATS service with
    that many processes can answer on this machine."""

    def __init__(self, nats_url: str, subject: str, *, inbox_prefix: str = "_INBOX",
                 env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-c", ECHO, nats_url, subject, str(ROOT), inbox_prefix]
        self.env = env
        self.procs: list[subprocess.Popen] = []

    @property
    def subject(self) -> str:
        return self.argv[4]

    def scale(self, count: int) -> None:
        while len(self.procs) < count:
            proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True, env=self.env)
            assert proc.stdout.readline().startswith("ready")
            self.procs.append(proc)
        while len(self.procs) > count:
            self.procs.pop().kill()

    def stop(self) -> None:
        self.scale(0)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuShare:
    """Each process's CPU use over a stretch of time, as % of one core."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.started = time.perf_counter()
        self.before = {name: cpu_seconds(pid) for name, pid in pids.items()}

    def row(self) -> str:
        elapsed = time.perf_counter() - self.started
        used = {name: (cpu_seconds(pid) - self.before[name]) / elapsed * 100 for name, pid in self.pids.items()}
        return " ".join(f"{name} {share:.0f}%" for name, share in used.items())


class ProcessCpu:
    """The CPU time some processes spend from now on, per 1,000 requests they answer."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.before = sum(cpu_seconds(pid) for pid in pids)

    def per_thousand(self, answered: int) -> float:
        return (sum(cpu_seconds(pid) for pid in self.pids) - self.before) / max(1, answered) * 1000


# -- the client -----------------------------------------------------------------------------------


class Requests:
    """An allocate request packed once; each call splices in a fresh request_id (a map's entries
    may come in any order, so the id goes first, right after the map header)."""

    def __init__(self, fields: dict) -> None:
        count = len(fields) + 1
        assert count < 16
        self.header = bytes([0x80 | count]) + msgpack.packb("request_id")
        self.rest = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
        self.tag = uuid.uuid4().hex[:8]
        self.sent = 0

    def next(self) -> bytes:
        self.sent += 1
        return self.header + msgpack.packb(f"{self.tag}-{self.sent}") + self.rest

    def size(self) -> int:
        return len(self.next())


class Run:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.elapsed = 0.0

    def row(self) -> str:
        done = len(self.latencies)
        lat = self.latencies or [0.0]
        errors = ", ".join(f"{code} {n}" for code, n in sorted(self.errors.items())) or "none"
        return (f"{done / self.elapsed:,.0f}/s, p50/p99/p99.9 {ms(percentile(lat, .5))}/{ms(percentile(lat, .99))}/"
                f"{ms(percentile(lat, .999))} ms, errors: {errors}")

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed


async def load(nc, subject: str, make: callable, total: int, clients: int, timeout: float = 10.0) -> Run:
    """`total` requests from `clients` concurrent callers; a success is a reply without an error header."""
    run = Run()
    per_client = total // clients

    async def client() -> None:
        for _ in range(per_client):
            data = make()
            started = time.perf_counter()
            try:
                msg = await nc.request(subject, data, timeout=timeout)
            except nats.errors.TimeoutError:
                run.errors["timeout"] += 1
                continue
            if msg.headers and ERROR_CODE in msg.headers:
                run.errors[msgpack.unpackb(msg.data)["error"]["code"]] += 1
            else:
                run.latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    run.elapsed = time.perf_counter() - started
    return run


async def call(nc, subject: str, payload: dict, timeout: float = 60.0) -> dict:
    msg = await nc.request(subject, msgpack.packb(payload), timeout=timeout)
    body = msgpack.unpackb(msg.data, strict_map_key=False)
    if msg.headers and ERROR_CODE in msg.headers:
        raise RuntimeError(f"{subject}: {body['error']}")
    return body


async def add_nodes(nc, prefix: str, names: list[str], cores: int, labels: dict) -> None:
    slots = asyncio.Semaphore(64)
    resource = {"cpumem": node_request(cores)}

    async def add(name: str) -> None:
        async with slots:
            await call(nc, f"{prefix}.resource.add-node", {"nodename": name, "resource": resource, "labels": labels})

    await asyncio.gather(*(add(n) for n in names))


# -- 2-5. over the bus ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def namespace(nats_url: str, redis_url: str, prefix: str):
    """Allocation workers and echo responders in `prefix` (none started yet), a NATS connection and a
    Redis client; all stopped, and the namespace's keys deleted, at the end."""
    workers = Workers(nats_url, redis_url, prefix)
    echo = EchoResponders(nats_url, f"{prefix}.echo")
    nc = await nats.connect(nats_url, name="bench-allocation", max_reconnect_attempts=3)
    redis = connect_redis(redis_url)
    try:
        yield workers, echo, nc, redis
    finally:
        await delete_stream(nc, prefix)
        await nc.close()
        workers.stop()
        echo.stop()
        await delete_namespace(redis, prefix)
        await redis.aclose()


async def bench_bus(table: Table, args, nats_url: str, redis_url: str, servers: dict[str, int]) -> None:
    prefix = f"bench{os.getpid()}"
    async with namespace(nats_url, redis_url, prefix) as (workers, echo, nc, redis):
        workers.scale(1)
        echo.scale(1)
        await bench_single_node(table, nc, prefix, echo.subject)
        names = [f"node-{i:06d}-rack-b" for i in range(args.nodes)]  # 93 KiB as a list of 5,000
        started = time.perf_counter()
        await add_nodes(nc, prefix, names, 64, LABELS)
        table.add(f"add-node x {args.nodes} (64 concurrent)", f"{args.nodes / (time.perf_counter() - started):,.0f} nodes/s", "-")
        await bench_capacity(table, nc, prefix, names)
        await bench_list_nodes(table, nc, prefix, args.nodes)
        await bench_request_path(table, args, nc, prefix, echo, workers)
        await bench_allocate(table, args, nc, prefix, names, workers, echo, servers, redis)


async def delete_stream(nc, prefix: str) -> None:
    """The namespace's event stream, from a server that outlives the bench (its memory is JetStream's)."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await nc.jetstream().delete_stream(EventBus(nc, prefix=prefix).stream_name(STREAM))


async def delete_namespace(redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}:*", count=5000)]
    for i in range(0, len(keys), 5000):
        await redis.delete(*keys[i:i + 5000])


async def bench_single_node(table: Table, nc, prefix: str, echo_subject: str) -> None:
    await add_nodes(nc, prefix, ["big"], 128, {})
    request = msgpack.packb({"nodename": "big", "deploy_count": 1, "workload_resource_request": REQUEST})
    raw = await load(nc, echo_subject, lambda: request, 2000, 1)
    deploy = await load(nc, f"{prefix}.resource.calculate-deploy", lambda: request, 2000, 1)
    table.add(
        "calculate-deploy over the bus, 128 cores 2 NUMA, p50 / p99",
        f"{ms(percentile(deploy.latencies, .5))} / {ms(percentile(deploy.latencies, .99))} ms",
        f"raw NATS round trip {ms(percentile(raw.latencies, .5))} / {ms(percentile(raw.latencies, .99))} ms",
    )


async def bench_capacity(table: Table, nc, prefix: str, names: list[str]) -> None:
    for count in sorted({min(1000, len(names)), len(names)}):
        query = {"nodenames": names[:count], "workload_resource_request": REQUEST}
        for label in ("first call", "again"):
            started = time.perf_counter()
            reply = await call(nc, f"{prefix}.resource.get-nodes-deploy-capacity", query)
            elapsed = time.perf_counter() - started
            assert reply["total"] == 42 * count, reply["total"]
            anchor = "eru Go 1.2 s" if count == 1000 else "eru Go 5-8 s; goal < 1 s"
            table.add(f"get-nodes-deploy-capacity, {count:,} nodes, {label}", f"{elapsed:.3f} s", anchor)


async def bench_list_nodes(table: Table, nc, prefix: str, nodes: int) -> None:
    started = time.perf_counter()
    seen, offset, pages = 0, 0, 0
    while offset is not None:
        page = await call(nc, f"{prefix}.resource.list-nodes", {"offset": offset, "limit": 1000})
        seen += len(page["nodes"])
        offset, pages = page["next_offset"], pages + 1
    assert seen == nodes + 1, seen  # and the one 128-core node
    table.add(f"list-nodes, every page of {seen:,} nodes ({pages} pages, limit 1,000)",
              f"{time.perf_counter() - started:.3f} s", "goal well under 1 s")


async def bench_allocate(table: Table, args, nc, prefix, names, workers: Workers, echo: EchoResponders, servers, redis):
    """Allocate as clients do, beside the same load on bare echo responders (as many as workers)."""
    lua = await raw_lua_rate(redis, prefix, args.clients, 20000)
    table.add(f"anchor: raw Redis Lua check-and-increment, {args.clients} clients", f"{lua:,.0f}/s", "-")
    subject = f"{prefix}.resource.allocate"
    for count in args.workers:
        workers.scale(count)
        echo.scale(count)
        pids = {**servers, "client": os.getpid(), **{f"w{i}": p.pid for i, p in enumerate(workers.procs)}}
        for selector in ("names", "labels"):
            chosen = {"nodenames": names} if selector == "names" else {"labels": LABELS}
            size = Requests(chosen).size()
            echo_cpu = ProcessCpu([p.pid for p in echo.procs])
            raw = await load(nc, echo.subject, Requests(chosen).next, args.placements, args.clients)
            shown = f"{size / 1024:.1f} KiB" if size >= 1024 else f"{size} B"
            table.add(f"anchor: raw NATS, {count} echo responder(s), {shown} requests", raw.row(),
                      f"echo CPU {echo_cpu.per_thousand(len(raw.latencies)):.3f} s / 1,000 requests")
            for strategy in ("spread", "pack"):
                requests = Requests({**chosen, "strategy": strategy, "deploy_count": 1, "workload_resource_request": REQUEST})
                for _ in range(count * 4):  # every worker builds its view of the nodes before timing
                    await nc.request(subject, requests.next(), timeout=60)
                cpu = CpuShare(pids)
                worker_cpu = ProcessCpu([p.pid for p in workers.procs])
                run = await load(nc, subject, requests.next, args.placements, args.clients)
                what = f"allocate {strategy} by {selector}, {count} worker(s)"
                spent = worker_cpu.per_thousand(len(run.latencies))
                table.add(what, f"{run.row()}; worker CPU {spent:.3f} s / 1,000",
                          f"raw NATS {raw.rate:,.0f}/s ({run.rate / raw.rate:.2f} of it); CPU: {cpu.row()}")


async def bench_request_path(table: Table, args, nc, prefix: str, echo: EchoResponders, workers: Workers) -> None:
    """Where one worker's CPU per pack placement by label goes, step by step: a bare echo, the
    service framework alone (`resource.plugins`: decode, dispatch, answer, no store), the placement
    without a `request_id` (no claim, no look for earlier runs, no kept answer), and with one."""
    placing = {"labels": LABELS, "strategy": "pack", "deploy_count": 1, "workload_resource_request": REQUEST}
    steps = [
        ("bare echo of the request", echo.subject, lambda: msgpack.packb(placing), echo.procs),
        ("the service framework alone (resource.plugins)", f"{prefix}.resource.plugins", lambda: b"\x80",
         workers.procs),
        ("allocate pack by label, no request_id", f"{prefix}.resource.allocate", lambda: msgpack.packb(placing),
         workers.procs),
        ("allocate pack by label, a request_id each", f"{prefix}.resource.allocate", Requests(placing).next,
         workers.procs),
    ]
    for what, subject, make, procs in steps:
        cpu = ProcessCpu([p.pid for p in procs])
        run = await load(nc, subject, make, args.placements, args.clients)
        table.add(f"request path, 1 process: {what}", f"{cpu.per_thousand(len(run.latencies)):.3f} s CPU / 1,000",
                  f"{run.rate:,.0f}/s, errors: {dict(run.errors) or 'none'}")


async def raw_lua_rate(redis, prefix: str, clients: int, total: int) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--placements", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    args = parser.parse_args()
    table = Table()
    bench_planner(table)
    with given_or_started(args) as servers:
        asyncio.run(bench_bus(table, args, args.nats, args.redis, {s.name: s.proc.pid for s in servers}))
    table.print()


if __name__ == "__main__":
    main()
