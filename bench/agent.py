"""What an agent costs and how fast it makes the platform react (docs/agents.md).

    .venv/bin/python bench/agent.py [--nodes 1000] [--beats 5000] [--launches 10] [--deaths 5]
                                    [--nats URL --redis URL]

Everything runs on loopback, with real processes: an allocation worker, agent processes on fake host
trees (8 CPUs each), broker workers. Servers of its own are started unless URLs are given.
- registration: from starting an agent process to its node listed `up`, and the host read plus
  `add-node` alone (the part that is the agent's, without Python's start);
- heartbeat: one `resource.node-heartbeat` round trip, `--beats` of them from 64 callers over
  `--nodes` nodes, and the allocation worker's CPU per 1,000 heartbeats; anchors of the same run: a
  bare NATS request/reply of the same size to another process, and the lease script alone on Redis;
- launch to ready: `init` + `launch` until `get-service-info` says running, through the agent of a
  node (`allocation` operator) and with the local `process` operator;
- death to leaving selections: from SIGKILL of an agent to its node missing from
  `get-nodes-deploy-capacity` by labels (TTL 3 s, heartbeat 1 s, lease sweep every 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.allocation import EchoResponders, cpu_seconds  # noqa: E402
from bench.servers import stop_workers  # noqa: E402
from bench.stats import percentile  # noqa: E402
from bus.client import BusClient  # noqa: E402
from bus.connection import connect  # noqa: E402
from bus.redis import connect_redis  # noqa: E402
from schemas.errors import BusError  # noqa: E402
from services.agent.host import node_resource, read_host  # noqa: E402
from services.allocation.store import NodeStore  # noqa: E402
from tests.agent_hosts import fake_host  # noqa: E402

CATALOG = ROOT / "tests" / "catalog.toml"
PARAM = {"city": "sz", "platform": "linux", "ports": {"http": "http"}, "image": "http-server", "worker_version": "1"}
ONE = {"least_instance": 1, "request_instance": 1}
TYPES = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 1, "mem_per_instance": 268435456}]'
BROKER_ARGS = ["--pool-interval", "0.2", "--sweep-interval", "0.05", "--stop-grace", "1", "--catalog", str(CATALOG)]


class Bench:
    def __init__(self, nats: str, redis: str, state: Path) -> None:
        self.nats, self.redis, self.state = nats, redis, state
        self.prefix = f"bench{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen] = []

    def start(self, module: str, *args: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "bus.runner", module, "--nats", self.nats, "--redis", self.redis,
                "--prefix", self.prefix, "--memory-stream", *args]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not proc.stdout.readline().startswith("ready"):
            raise RuntimeError(f"{module} did not start")
        self.procs.append(proc)
        return proc

    def agent(self, node: str, *args: str, city: str = "sz") -> subprocess.Popen:
        root = fake_host(self.state / f"{node}-host", cpus=8)
        return self.start("services.agent.worker", "--node", node, "--root", str(root), "--no-cgroups",
                          "--state", str(self.state / f"{node}-state"), "--catalog", str(CATALOG),
                          "--label", f"city={city}", "--label", "platform=linux", "--interval", "30", *args)

    def stop(self) -> None:
        stop_workers(self.procs, self.prefix)


async def until(check, timeout: float = 60.0, pause: float = 0.002) -> float:
    """Seconds until `check()` is true."""
    started = time.perf_counter()
    while not await check():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("condition not met")
        await asyncio.sleep(pause)
    return time.perf_counter() - started


async def node_up(client: BusClient, node: str) -> bool:
    nodes = (await client.request("resource.list-nodes", {"nodenames": [node]}, dict))["nodes"]
    return bool(nodes) and nodes[0]["status"] == "up"


async def registration(bench: Bench, client: BusClient, count: int) -> dict[str, list[float]]:
    started_to_up = []
    for i in range(count):
        node = f"reg{i}"
        began = time.perf_counter()
        proc = await asyncio.to_thread(bench.agent, node, city="registered")  # out of the launches' way
        await until(lambda: node_up(client, node))
        started_to_up.append(time.perf_counter() - began)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 15)
    host_root = fake_host(bench.state / "read-host", cpus=8)
    own = []
    for i in range(count * 5):
        began = time.perf_counter()
        resource = node_resource(read_host(str(host_root)))
        await client.request("resource.add-node", {"nodename": f"own{i}", "resource": resource,
                                                   "labels": {"city": "bench"}}, dict)
        own.append(time.perf_counter() - began)
    return {"process": started_to_up, "own": own}


async def heartbeats(bench: Bench, client: BusClient, allocation: subprocess.Popen, nodes: int, beats: int):
    resource = {"cpumem": {"cpu": 8, "memory": "16G"}}
    for start in range(0, nodes, 100):
        await asyncio.gather(*(client.request("resource.add-node", {
            "nodename": f"hb{i}", "resource": resource, "labels": {"city": "hb"}}, dict)
            for i in range(start, min(nodes, start + 100))))
    agent = {"address": "10.0.0.1", "instances": 3, "running": 3, "pinning": "cgroup", "started_at": time.time()}

    def beat(i: int) -> dict:
        return {"nodename": f"hb{i % nodes}", "ttl_seconds": 600, "agent": agent}

    single = []
    for i in range(500):
        began = time.perf_counter()
        await client.request("resource.node-heartbeat", beat(i), dict)
        single.append(time.perf_counter() - began)
    cpu_before, began = cpu_seconds(allocation.pid), time.perf_counter()
    queue = iter(range(beats))

    async def caller() -> None:
        for i in queue:
            await client.request("resource.node-heartbeat", beat(i), dict)

    await asyncio.gather(*(caller() for _ in range(64)))
    elapsed = time.perf_counter() - began
    cpu = cpu_seconds(allocation.pid) - cpu_before
    return single, beats / elapsed, cpu / beats * 1000


async def anchors(bench: Bench, size: int) -> tuple[list[float], float]:
    """A bare NATS round trip of `size` bytes to another process, and the lease script's rate
    alone on Redis (64 at once), in this run."""
    responder = EchoResponders(bench.nats, "bench-anchor.echo")
    responder.scale(1)
    try:
        nc = await connect(bench.nats, name="bench-anchor", worker=False)
        payload, times = b"x" * size, []
        for _ in range(500):
            began = time.perf_counter()
            await nc.request("bench-anchor.echo", payload, timeout=5)
            times.append(time.perf_counter() - began)
        await nc.close()
    finally:
        responder.stop()
    redis = connect_redis(bench.redis, max_connections=64)
    store = NodeStore(redis, bench.prefix)
    queue = iter(range(5000))

    async def renew() -> None:
        for i in queue:
            await store.renew_lease(f"hb{i % 100}", 600_000, b"x" * 40)

    began = time.perf_counter()
    await asyncio.gather(*(renew() for _ in range(64)))
    rate = 5000 / (time.perf_counter() - began)
    await redis.aclose()
    return times, rate


async def launches(client: BusClient, count: int) -> list[float]:
    times = []
    for i in range(count):
        rid = f"l{i}-{uuid.uuid4().hex[:6]}"
        began = time.perf_counter()
        await client.request("broker.init", {"user": "bench", "resource_id": rid, "param": PARAM}, dict)
        await client.request("broker.launch", {"user": "bench", "resource_id": rid, "filter": ONE}, dict)

        async def running() -> bool:
            info = await client.request("broker.get-service-info", {"user": "bench", "resource_id": rid}, dict)
            if info["status"] == "failed":
                raise RuntimeError(f"launch of {rid} failed: {info['message']}")
            return info["status"] == "running"

        await until(running)
        times.append(time.perf_counter() - began)
        await client.request("broker.release", {"user": "bench", "resource_id": rid}, dict)
    return times


async def deaths(bench: Bench, client: BusClient, count: int) -> list[float]:
    times = []
    for i in range(count):
        node = f"dead{i}"
        proc = await asyncio.to_thread(bench.agent, node, "--heartbeat", "1", "--ttl", "3")
        labels = {"city": "sz", "platform": "linux"}
        await until(lambda: node_up(client, node))

        async def gone() -> bool:
            try:
                reply = await client.request("resource.get-nodes-deploy-capacity", {
                    "labels": labels, "workload_resource_request": {"cpumem": {"cpu-request": 0.1}}}, dict)
            except BusError as error:  # it was the only node of these labels
                return error.code == "node_not_found"
            return node not in reply["nodes_deploy_capacity_map"]

        await asyncio.sleep(1.2)  # kill it at a random point of its heartbeat cycle
        proc.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        await until(gone, pause=0.01)
        times.append(time.perf_counter() - killed)
        await asyncio.to_thread(proc.wait, 10)
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


async def run(nats: str, redis: str, state: Path, args) -> None:
    bench = Bench(nats, redis, state)
    nc = await connect(nats, name="bench-agent", worker=False)
    client = BusClient(nc, prefix=bench.prefix, timeout=30)
    try:
        allocation = bench.start("services.allocation.worker", "--lease-interval", "0.5")
        reg = await registration(bench, client, args.registrations)
        single, rate, cpu_per_k = await heartbeats(bench, client, allocation, args.nodes, args.beats)
        echo_times, script_rate = await anchors(bench, 160)
        bench.start("services.broker.worker", "--operator", "allocation", "--instance-types", TYPES, *BROKER_ARGS)
        await asyncio.to_thread(bench.agent, "runner")
        remote = await launches(client, args.launches)
        await asyncio.to_thread(bench.stop)
        bench.procs.clear()
        bench.prefix = f"bench{uuid.uuid4().hex[:8]}"
        client = BusClient(nc, prefix=bench.prefix, timeout=30)
        bench.start("services.allocation.worker", "--lease-interval", "0.5")
        bench.start("services.broker.worker", *BROKER_ARGS)
        local = await launches(client, args.launches)
        died = await deaths(bench, client, args.deaths)
    finally:
        await nc.close()
        bench.stop()
    rows = [
        ("registration: agent process start -> node up, p50 (ms)", ms(percentile(reg["process"], 0.5)), ""),
        ("registration: read host + add-node, p50 (ms)", ms(percentile(reg["own"], 0.5)),
         f"bare NATS RTT p50 {ms(percentile(echo_times, 0.5))}"),
        ("heartbeat round trip, one at a time, p50 (ms)", ms(percentile(single, 0.5)),
         f"bare NATS RTT p50 {ms(percentile(echo_times, 0.5))}"),
        ("heartbeat round trip, one at a time, p99 (ms)", ms(percentile(single, 0.99)),
         f"bare NATS RTT p99 {ms(percentile(echo_times, 0.99))}"),
        (f"heartbeats/s, 64 callers over {args.nodes} nodes", f"{rate:.0f}",
         f"lease script alone on Redis {script_rate:.0f}/s"),
        ("allocation worker CPU per 1,000 heartbeats (s)", f"{cpu_per_k:.3f}", ""),
        ("launch -> running, through a node's agent, p50 (ms)", ms(percentile(remote, 0.5)), ""),
        ("launch -> running, local process operator, p50 (ms)", ms(percentile(local, 0.5)), ""),
        ("agent SIGKILL -> out of selections, p50 (s)", f"{percentile(died, 0.5):.2f}", "TTL 3 s, sweep 0.5 s"),
        ("agent SIGKILL -> out of selections, max (s)", f"{max(died):.2f}", ""),
    ]
    width = max(len(label) for label, _, _ in rows)
    print(f"{'':<{width}}  {'measured':>10}   anchor (same run)")
    for label, value, anchor in rows:
        print(f"{label:<{width}}  {value:>10}   {anchor}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", help="use this NATS server (with --redis) instead of starting one")
    parser.add_argument("--redis", help="use this Redis server (with --nats) instead of starting one")
    parser.add_argument("--registrations", type=int, default=5, help="agent processes started for registration")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes the heartbeats go to")
    parser.add_argument("--beats", type=int, default=5000, help="heartbeats timed with 64 callers")
    parser.add_argument("--launches", type=int, default=10, help="launches timed per operator")
    parser.add_argument("--deaths", type=int, default=5, help="agents killed")
    args = parser.parse_args()
    from bench.servers import given_or_started

    state = Path(tempfile.mkdtemp(prefix="berth-bench-agent-"))
    with given_or_started(args):
        asyncio.run(run(args.nats, args.redis, state, args))


if __name__ == "__main__":
    main()
