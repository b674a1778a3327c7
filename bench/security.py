"""What berth's accounts (identities, roles, the caller header) and TLS cost on `allocate`.

    .venv/bin/python bench/security.py [--nodes 500] [--placements 3200] [--clients 64] [--rounds 2]

Three deployments, one after the other, each with its own nats-server and redis-server on loopback
and one allocation worker, as `berth up` starts them:

- plain: no users, no TLS (`berth up --no-auth --no-tls`): every caller is the services' own;
- accounts: berth's NATS accounts and Redis ACL users (`--no-tls`): the load comes from a tenant
  identity, so every request crosses a service import that adds the `Nats-Request-Info` header,
  the worker reads the caller from it and checks the role, and the reply is mapped back;
- accounts + TLS: the same over TLS to both servers (`berth up`'s default).

In each: `allocate` spread by a label (1.5 bound CPUs + 2 GiB, a unique request_id per call) from
`--clients` concurrent clients, and one client's sequential round trip; beside them, the anchor of
the same deployment: a bare echo responder on the same path (for accounts, served by the
allocation service's own NATS user, so a tenant reaches it through the same import); and node
`n0`'s heartbeats on its own subject (`resource.node.n0.node-heartbeat`), as its agent identity
where there are identities (bound to its node by its permissions). The rounds
alternate the deployments, so that a noisy neighbour spreads over all of them. Everything stops by
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from statistics import mean
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
from bench.allocation import LABELS, REQUEST, EchoResponders, Requests, Table, add_nodes, load, ms  # noqa: E402
from bench.stats import percentile  # noqa: E402
from berth import streams  # noqa: E402
from berth.accounts import STREAMS_ADMIN  # noqa: E402
from berth.credentials import Credentials, prepare  # noqa: E402
from berth.servers import ServerProcess, start_nats, start_redis  # noqa: E402
from berth.tls import prepare as prepare_tls  # noqa: E402
from bus.callers import Role  # noqa: E402
from bus.connection import connect, inbox_prefix  # noqa: E402

PREFIX = "sec"
ECHO_SUBJECT = f"{PREFIX}.resource.echo-anchor"
HEARTBEAT_NODE = "n0"  # the node whose agent identity beats (its own node's subject only)
HEARTBEAT = f"{PREFIX}.resource.node.{HEARTBEAT_NODE}.node-heartbeat"
@dataclass
class Deployment:
    name: str
    servers: list[ServerProcess]
    client_url: str  # the load's identity (a tenant), or no user at all
    admin_url: str  # who adds the nodes
    agent_url: str  # node HEARTBEAT_NODE's agent identity, or no user at all
    tls_ca: str | None
    worker: subprocess.Popen
    echo: EchoResponders

    def stop(self) -> None:
        self.worker.terminate()
        self.worker.wait(30)
        self.echo.stop()
        for server in self.servers:
            server.stop()


def start(name: str, state: Path, accounts: bool, tls: bool) -> Deployment:
    files = prepare_tls(state / "tls") if tls else None
    creds: Credentials | None = None
    if accounts:
        creds = prepare(state / "credentials", PREFIX).with_identity("loadgen", Role.TENANT)
        creds = creds.with_identity("bench-agent", Role.AGENT, HEARTBEAT_NODE)
        creds.write()
    nats = start_nats(state / "nats", config=creds.nats_config if creds else None, tls=files)
    redis = start_redis(state / "redis", appendonly=False, config=creds.redis_config if creds else None, tls=files)
    env = {**os.environ, **({"BERTH_TLS_CA": str(files.ca)} if files else {})}
    if creds:  # the streams first, as `berth up` does: no worker's user may set one up
        asyncio.run(streams.set_up(nats.url, PREFIX, user=STREAMS_ADMIN, password=creds.nats_password(STREAMS_ADMIN),
                                   memory=True, tls_ca=str(files.ca) if files else None))
        argv, extra = creds.worker_launch("allocation", nats.url, redis.url)
        env.update(extra)
        service_url = creds.nats_url("allocation", nats.url)
        client_url, admin_url = creds.nats_url("loadgen", nats.url), creds.nats_url("admin", nats.url)
        agent_url = creds.nats_url("bench-agent", nats.url)
    else:
        argv = ["--prefix", PREFIX, "--nats", nats.url, "--redis", redis.url]
        service_url = client_url = admin_url = agent_url = nats.url
    worker = subprocess.Popen(
        [sys.executable, "-m", "bus.runner", "services.allocation.worker", "--memory-stream", *argv],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = worker.stdout.readline()
    assert line.startswith("ready"), f"{name}: {line!r}"
    # served by allocation's own NATS user (its inbox root), so a tenant reaches it as it reaches allocation
    echo = EchoResponders(service_url, ECHO_SUBJECT, inbox_prefix=inbox_prefix(PREFIX, "allocation"), env=env)
    echo.scale(1)
    return Deployment(name, [nats, redis], client_url, admin_url, agent_url, str(files.ca) if files else None, worker,
                      echo)


async def sequential(nc, subject: str, make, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        await nc.request(subject, make(), timeout=10)
        latencies.append(time.perf_counter() - started)
    return latencies


async def measure(d: Deployment, args) -> dict:
    nc = await connect(d.client_url, name="bench", worker=False, tls_ca=d.tls_ca)
    admin = await connect(d.admin_url, name="bench-admin", worker=False, tls_ca=d.tls_ca)
    try:
        await add_nodes(admin, PREFIX, [f"n{i}" for i in range(args.nodes)], 64, LABELS)
        requests = Requests({"labels": LABELS, "strategy": "spread", "deploy_count": 1,
                             "workload_resource_request": REQUEST})
        subject = f"{PREFIX}.resource.allocate"
        for _ in range(20):  # the worker builds its view first
            await nc.request(subject, requests.next(), timeout=60)
        echo = ECHO_SUBJECT
        raw = await load(nc, echo, Requests({"labels": LABELS}).next, args.placements, args.clients)
        run = await load(nc, subject, requests.next, args.placements, args.clients)
        raw_rtt = await sequential(nc, echo, Requests({"labels": LABELS}).next, 300)
        rtt = await sequential(nc, subject, requests.next, 300)
        beats = await heartbeats(d, args)
        return {"rate": run.rate, "p99": percentile(run.latencies, .99), "errors": sum(run.errors.values()),
                "raw": raw.rate, "rtt": rtt, "raw_rtt": raw_rtt, **beats}
    finally:
        await nc.close()
        await admin.close()


async def heartbeats(d: Deployment, args) -> dict:
    """Node HEARTBEAT_NODE's heartbeats on its own subject, as its agent identity where there are
    identities (its node-bound permissions, the subject's node checked against the request's)."""
    inbox = inbox_prefix(PREFIX, "agent", HEARTBEAT_NODE)
    agent = await connect(d.agent_url, name="bench-agent", worker=False, tls_ca=d.tls_ca, inbox_prefix=inbox)
    try:
        beat = msgpack.packb({"nodename": HEARTBEAT_NODE, "ttl_seconds": 30})
        run = await load(agent, HEARTBEAT, lambda: beat, args.placements, 16)
        rtt = await sequential(agent, HEARTBEAT, lambda: beat, 300)
        return {"beats": run.rate, "beat_errors": sum(run.errors.values()), "beat_rtt": rtt}
    finally:
        await agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--placements", type=int, default=3200)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    table = Table()
    modes = [("plain", False, False), ("accounts", True, False), ("accounts + TLS", True, True)]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in modes}
    for round_ in range(args.rounds):
        for name, accounts, tls in modes:
            state = Path(tempfile.mkdtemp(prefix="berth-bench-sec-"))
            d = start(name, state, accounts, tls)
            try:
                figures = asyncio.run(measure(d, args))
            finally:
                d.stop()
            results[name].append(figures)
            print(f"round {round_ + 1}, {name}: allocate {figures['rate']:,.0f}/s, echo {figures['raw']:,.0f}/s",
                  file=sys.stderr, flush=True)
    plain = mean([r["rate"] for r in results["plain"]])
    plain_beats = mean([r["beats"] for r in results["plain"]])
    for name, _, _ in modes:
        runs = results[name]
        rates, raws = [r["rate"] for r in runs], [r["raw"] for r in runs]
        table.add(f"{name}: allocate, {args.clients} clients",
                  f"{mean(rates):,.0f}/s ({min(rates):,.0f}-{max(rates):,.0f}), p99 {ms(max(r['p99'] for r in runs))} ms, "
                  f"errors {sum(r['errors'] for r in runs)}; {mean(rates) / plain:.2f} of plain",
                  f"echo on the same path {mean(raws):,.0f}/s ({min(raws):,.0f}-{max(raws):,.0f})")
        rtt, raw_rtt = [x for r in runs for x in r["rtt"]], [x for r in runs for x in r["raw_rtt"]]
        table.add(f"{name}: allocate, one client, round trip p50/p99",
                  f"{ms(percentile(rtt, .5))}/{ms(percentile(rtt, .99))} ms",
                  f"echo {ms(percentile(raw_rtt, .5))}/{ms(percentile(raw_rtt, .99))} ms")
        beats, beat_rtt = [r["beats"] for r in runs], [x for r in runs for x in r["beat_rtt"]]
        table.add(f"{name}: heartbeats of one node, 16 at once / one at a time p50",
                  f"{mean(beats):,.0f}/s, errors {sum(r['beat_errors'] for r in runs)}; "
                  f"{mean(beats) / plain_beats:.2f} of plain / {ms(percentile(beat_rtt, .5))} ms",
                  f"echo {mean(raws):,.0f}/s / {ms(percentile(raw_rtt, .5))} ms")
    table.print()


if __name__ == "__main__":
    main()
