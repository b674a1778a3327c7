"""Request/reply cost of the berth runtime vs a bare nats.micro endpoint vs a bare subscription.

    .venv/bin/python bench/bus.py [--requests 3000] [--nats URL]

The three responders run in one child process (so client and server do not share an event loop);
each answers a small MessagePack map. The bare ones echo bytes; the runtime decodes the request
into a Struct, runs the handler in its own task and encodes the reply. Sequential and 64 in flight,
in one run. Goal: the runtime costs at most 10 % over bare nats.micro.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
from nats.micro import ServiceConfig, add_service  # noqa: E402

from bench.stats import percentile  # noqa: E402
from bus.codec import encode  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.service import Service  # noqa: E402

PAYLOAD = encode({"nodename": "node-1", "deploy_count": 1, "request": {"cpu": 1.5, "memory": 2 << 30}})


class Req(msgspec.Struct):
    nodename: str
    deploy_count: int
    request: dict[str, float | int]


async def serve(url: str) -> None:
    nc = await connect(url, name="bench-responders")

    async def bare(msg):
        await msg.respond(msg.data)

    await nc.subscribe("bench.bare", cb=bare)

    async def micro_handler(request):
        await request.respond(request.data)

    micro = await add_service(nc, ServiceConfig(name="bench-micro", version="0.0.1"))
    await micro.add_endpoint(name="echo", subject="bench.micro", handler=micro_handler)

    runtime = Service("bench-runtime", prefix="bench")

    @runtime.endpoint("runtime", Req, Req)
    async def echo(req: Req) -> Req:
        return req

    await runtime.start(nc)
    print("ready", flush=True)
    await runtime.serve_until_signalled()
    await nc.drain()


async def measure(nc, subject: str, requests: int, in_flight: int) -> dict[str, float]:
    latencies: list[float] = []
    slots = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with slots:
            start = time.perf_counter()
            await nc.request(subject, PAYLOAD, timeout=10)
            latencies.append(time.perf_counter() - start)

    for _ in range(200):  # warm-up
        await nc.request(subject, PAYLOAD, timeout=10)
    started = time.perf_counter()
    if in_flight == 1:
        for _ in range(requests):
            await one()
    else:
        await asyncio.gather(*(one() for _ in range(requests)))
    elapsed = time.perf_counter() - started
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return {"rate": requests / elapsed, "p50": p50 * 1e3, "p99": p99 * 1e3}


async def run(url: str, requests: int, rounds: int) -> None:
    nc = await connect(url, name="bench-client", worker=False)
    subjects = {"bare subscription": "bench.bare", "bare nats.micro": "bench.micro", "berth runtime": "bench.runtime"}
    print(f"{'mode':<14} {'responder':<18} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'vs micro':>9}")
    for in_flight, label in ((1, "sequential"), (64, "64 in flight")):
        # Interleave rounds and keep the best rate of each, so machine noise hits all three alike.
        best: dict[str, dict[str, float]] = {}
        for _ in range(rounds):
            for name, subject in subjects.items():
                result = await measure(nc, subject, requests, in_flight)
                if name not in best or result["rate"] > best[name]["rate"]:
                    best[name] = result
        micro_rate = best["bare nats.micro"]["rate"]
        for name, r in best.items():
            cost = micro_rate / r["rate"] - 1
            print(f"{label:<14} {name:<18} {r['rate']:>9.0f} {r['p50']:>8.3f} {r['p99']:>8.3f} {cost:>+8.1%}")
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", help="use this NATS server instead of starting one")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return

    from berth.servers import start_nats

    server = None if args.nats else start_nats(Path(tempfile.mkdtemp(prefix="berth-bench-")), jetstream=False)
    url = args.nats or server.url
    responders = subprocess.Popen([sys.executable, __file__, "--serve", url], stdout=subprocess.PIPE, text=True)
    try:
        assert responders.stdout.readline().strip() == "ready"
        asyncio.run(run(url, args.requests, args.rounds))
    finally:
        responders.terminate()
        responders.wait(15)
        if server:
            server.stop()


if __name__ == "__main__":
    main()
