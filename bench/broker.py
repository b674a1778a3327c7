"""Warm pool vs cold start: `apply` from a warm pool against `init` + `launch` until running.

    .venv/bin/python bench/broker.py [--pool 20] [--applies 100] [--rounds 5] [--cold 5]
                                     [--nats URL --redis URL]

Broker worker processes (the `process` operator) are started with 1, then 2 replicas, each run in
its own prefix. The launched server is tests/http_server.py with a one-second start (`--delay 1`).
Per replica count, with a `const` pool of `--pool` servers:
- warm: `--applies` applies at a steady pace (one per `--interval`, which the pool keeps up with),
  each caller released after its apply (not timed);
- burst: the full pool drained by back-to-back applies, `--rounds` times; the refill time is from
  the last apply until the pool is full again (while it refills, the new servers start on the same
  machine, so these applies share the CPUs with them);
- cold: `--cold` sequential init + launch, polling get-service-info until the server is running.
Anchors measured in the same run and at the same pace: a bare NATS request/reply to another
process and a bare Redis GET (an apply is one NATS round trip and three Redis ones, two of them
concurrent).
Everything runs on loopback; servers of its own are started unless URLs are given, and stopped.
Goal: warm apply p99 under 5 ms and more than 100 times faster than a cold start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import stop_workers  # noqa: E402
from bench.stats import percentile  # noqa: E402
from bus.client import BusClient  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.redis import connect_redis  # noqa: E402

USER = "bench"
PARAM = {
    "city": "local",
    "platform": "linux",
    "ports": {"http": "http"},
    "image": "http-server-slow",  # tests/catalog.toml
    "env": {"DELAY": "1"},
    "worker_version": "1",
}
ONE = {"least_instance": 1, "request_instance": 1}
WORKER_ARGS = ["--pool-interval", "0.2", "--sweep-interval", "0.2", "--stop-grace", "2",
               "--catalog", str(ROOT / "tests" / "catalog.toml")]


def start_workers(count: int, nats: str, redis: str, prefix: str) -> list[subprocess.Popen]:
    workers = []
    for _ in range(count):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bus.runner",
                "services.broker.worker",
                "--nats",
                nats,
                "--redis",
                redis,
                "--prefix",
                prefix,
                "--memory-stream",
                *WORKER_ARGS,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if not proc.stdout.readline().startswith("ready"):
            raise RuntimeError("a broker worker did not start")
        workers.append(proc)
    return workers


async def wait_pool(client: BusClient, size: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        [pool] = (await client.request("broker.list-brokers", {"user": USER}, dict))["brokers"]
        if pool["idle"] >= size:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"the pool did not reach {size} ready servers in {timeout} s")


async def apply(client: BusClient, caller: str) -> float:
    started = time.perf_counter()
    await client.request(
        "broker.apply", {"user": USER, "resource_id": caller, "param": PARAM, "filter": ONE}, dict
    )
    return time.perf_counter() - started


async def release(client: BusClient, callers: list[str]) -> None:
    for caller in callers:
        await client.request("broker.release", {"user": USER, "resource_id": caller}, dict)


async def steady(client: BusClient, applies: int, interval: float) -> list[float]:
    """Apply latencies (s) at one apply per `interval`, a pace the pool keeps up with."""
    latencies = []
    for i in range(applies):
        started = time.perf_counter()
        latencies.append(await apply(client, f"steady-{i}"))
        await release(client, [f"steady-{i}"])
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    return latencies


async def bursts(client: BusClient, pool: int, rounds: int) -> tuple[list[float], list[float]]:
    """Latencies (s) of draining a full pool back to back, and the times (s) it takes to refill."""
    latencies, refills = [], []
    for round_ in range(rounds):
        await wait_pool(client, pool)
        callers = [f"burst-{round_}-{i}" for i in range(pool)]
        latencies += [await apply(client, caller) for caller in callers]
        drained = time.perf_counter()
        await wait_pool(client, pool)
        refills.append(time.perf_counter() - drained)
        await release(client, callers)
    return latencies, refills


async def cold(client: BusClient, count: int) -> list[float]:
    """Seconds from init to a running server, `count` times in sequence."""
    times = []
    for i in range(count):
        rid = f"cold-{i}"
        started = time.perf_counter()
        await client.request("broker.init", {"user": USER, "resource_id": rid, "param": PARAM}, dict)
        await client.request("broker.launch", {"user": USER, "resource_id": rid, "filter": ONE}, dict)
        while (await client.request("broker.get-service-info", {"user": USER, "resource_id": rid}, dict))[
            "status"
        ] != "running":
            await asyncio.sleep(0.005)
        times.append(time.perf_counter() - started)
        await release(client, [rid])
    return times


async def echo(nats: str) -> None:
    """The anchor's responder (run in a process of its own with `--echo URL`)."""
    nc = await connect(nats, name="bench-echo")

    async def respond(msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench-anchor.echo", cb=respond)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def anchors(nats: str, redis_url: str, samples: int, pace: float) -> dict[str, float]:
    """p50 and p99 (s) of a bare NATS request/reply to another process and of a bare Redis GET,
    back to back (pace 0) or one per `pace` seconds, like the applies they are compared with."""
    responder = subprocess.Popen(
        [sys.executable, __file__, "--echo", nats], stdout=subprocess.PIPE, text=True
    )
    try:
        assert responder.stdout.readline().strip() == "ready"
        nc = await connect(nats, name="bench-anchor", worker=False)
        redis = connect_redis(redis_url)
        nats_times, redis_times = [], []
        for _ in range(samples):
            started = time.perf_counter()
            await nc.request("bench-anchor.echo", b"\x80", timeout=5)
            nats_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            await redis.get("bench-anchor")
            redis_times.append(time.perf_counter() - started)
            await asyncio.sleep(pace)
        await nc.close()
        await redis.aclose()
    finally:
        responder.terminate()
        responder.wait(10)
    return {
        "nats_p50": percentile(nats_times, 0.5),
        "nats_p99": percentile(nats_times, 0.99),
        "redis_p50": percentile(redis_times, 0.5),
        "redis_p99": percentile(redis_times, 0.99),
    }


async def measure(nats: str, redis: str, replicas: int, args) -> dict[str, float]:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    workers = start_workers(replicas, nats, redis, prefix)
    nc = await connect(nats, name="bench-client", worker=False)
    client = BusClient(nc, prefix=prefix, timeout=10)
    try:
        await client.request(
            "broker.add-broker",
            {"user": USER, "name": "warm", "param": PARAM, "strategy": {"type": "const", "num": args.pool}},
            dict,
        )
        await wait_pool(client, args.pool)
        paced = await steady(client, args.applies, args.interval)
        burst, refills = await bursts(client, args.pool, args.rounds)
        await client.request("broker.remove-broker", {"user": USER, "name": "warm"}, dict, timeout=30)
        cold_times = await cold(client, args.cold)
    finally:
        await nc.close()
        stop_workers(workers, prefix)  # and what they launched, if anything is left
    return {
        "warm_p50": percentile(paced, 0.5),
        "warm_p99": percentile(paced, 0.99),
        "burst_p50": percentile(burst, 0.5),
        "burst_p99": percentile(burst, 0.99),
        "cold_p50": percentile(cold_times, 0.5),
        "cold_p99": percentile(cold_times, 0.99),
        "refill": statistics.median(refills),
        "samples": len(paced),
        "burst_samples": len(burst),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


async def run(nats: str, redis: str, args) -> None:
    results = {replicas: await measure(nats, redis, replicas, args) for replicas in (1, 2)}
    paced = await anchors(nats, redis, args.applies, args.interval)
    burst = await anchors(nats, redis, args.applies, 0.0)
    print(f"pool of {args.pool} servers that take 1 s to start; broker options {' '.join(WORKER_ARGS)}")
    header = "".join(f"{f'{n} replica' + ('s' if n > 1 else ''):>12}" for n in results)
    print(f"{'':<46}{header}   anchor (same pace): bare NATS RTT, Redis GET")
    timed = [
        (f"warm apply, 1 per {args.interval:g} s, p50 (ms)", "warm_p50", paced, "p50"),
        (f"warm apply, 1 per {args.interval:g} s, p99 (ms)", "warm_p99", paced, "p99"),
        (f"warm apply, {args.pool} back to back, p50 (ms)", "burst_p50", burst, "p50"),
        (f"warm apply, {args.pool} back to back, p99 (ms)", "burst_p99", burst, "p99"),
    ]
    for label, key, anchor, q in timed:
        cells = "".join(f"{ms(r[key]):>12}" for r in results.values())
        print(f"{label:<46}{cells}   {ms(anchor[f'nats_{q}'])}, {ms(anchor[f'redis_{q}'])}")
    derived = [
        ("cold init+launch until running p50 (ms)", lambda r: f"{r['cold_p50'] * 1e3:.0f}"),
        ("cold init+launch until running p99 (ms)", lambda r: f"{r['cold_p99'] * 1e3:.0f}"),
        (
            f"cold p50 / warm p99, 1 per {args.interval:g} s",
            lambda r: f"{r['cold_p50'] / r['warm_p99']:.0f}x",
        ),
        ("cold p50 / warm p99, back to back", lambda r: f"{r['cold_p50'] / r['burst_p99']:.0f}x"),
        (f"refill of a drained pool of {args.pool} (s)", lambda r: f"{r['refill']:.2f}"),
        ("applies measured (paced / back to back)", lambda r: f"{r['samples']}/{r['burst_samples']}"),
    ]
    for label, cell in derived:
        print(f"{label:<46}" + "".join(f"{cell(r):>12}" for r in results.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", help="use this NATS server (with --redis) instead of starting one")
    parser.add_argument("--redis", help="use this Redis server (with --nats) instead of starting one")
    parser.add_argument("--pool", type=int, default=20, help="warm pool size")
    parser.add_argument("--applies", type=int, default=100, help="warm applies measured at a steady pace")
    parser.add_argument("--interval", type=float, default=0.15, help="seconds between steady applies")
    parser.add_argument("--rounds", type=int, default=5, help="times the pool is drained and refilled")
    parser.add_argument("--cold", type=int, default=5, help="cold starts measured")
    parser.add_argument("--echo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        asyncio.run(echo(args.echo))
        return
    from bench.servers import given_or_started

    with given_or_started(args):
        asyncio.run(run(args.nats, args.redis, args))


if __name__ == "__main__":
    main()
