"""A fleet over a network (issue 28): `berth up --listen` on a bridge of its own, with identities
and TLS on (its defaults), and three hosts in network namespaces of their own, each joined with
the bundle of its own node identity (`berth user bundle`). From host A, A's identity cannot act
for B (every probe of item 1); cutting B's link makes B's node down within its TTL while A and C
stay up; restoring it brings B back. With a warm pool on A and B, B's server is relaunched on A
while B is cut, and B, back, stops it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import nats
import pytest

from tests.agent_hosts import fake_host
from tests.broker_helpers import CATALOG, param
from tests.cli_helpers import BERTH, ROOT, berth_up, client_options
from tests.test_agent_netns import ip

pytestmark = pytest.mark.slow

BRIDGE_NET = "10.233.7"
TTL = 2.0


class Bridge:
    """A bridge here (`BRIDGE_NET.1`) and a namespace per host on it (`BRIDGE_NET.<k+2>`)."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.name = f"brb{self.tag}"
        self.address = f"{BRIDGE_NET}.1"
        self.hosts: dict[str, tuple[str, str, str]] = {}  # host -> (namespace, its link here, its address)
        ip("link", "add", self.name, "type", "bridge")
        ip("addr", "add", f"{self.address}/24", "dev", self.name)
        ip("link", "set", self.name, "up")

    def add(self, host: str) -> str:
        k = len(self.hosts) + 2
        namespace, link = f"fl{self.tag}{k}", f"vf{self.tag}{k}"
        ip("netns", "add", namespace)
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "set", link, "master", self.name)
        ip("link", "set", link, "up")
        ip("-n", namespace, "addr", "add", f"{BRIDGE_NET}.{k}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        self.hosts[host] = (namespace, link, f"{BRIDGE_NET}.{k}")
        return namespace

    def cut(self, host: str, down: bool) -> None:
        ip("link", "set", self.hosts[host][1], "down" if down else "up")

    def remove(self) -> None:
        """Every host goes, with whatever still runs in it: the servers an agent launched outlive
        the agent on purpose (a restarted agent adopts them), and nothing else would stop them."""
        for namespace, _, _ in self.hosts.values():
            listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
            for pid in map(int, listed.split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.name], capture_output=True)


@pytest.fixture
def bridge():
    try:
        made = Bridge()
    except subprocess.CalledProcessError as error:
        pytest.skip(f"no bridge or network namespace here: {error.stderr.strip()}")
    yield made
    made.remove()


def berth_user(state: Path, *args: str) -> str:
    done = subprocess.run([*BERTH, "user", "--state", str(state), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def join(state: Path, bridge: Bridge, host: str, *labels: str) -> subprocess.Popen:
    """`berth user add` and `bundle` on the control plane, then `berth agent --bundle` on the host."""
    berth_user(state, "add", host, "--role", "agent", "--node", host)
    bundle = state / f"{host}.bundle"
    berth_user(state, "bundle", host, "-o", str(bundle))
    namespace = bridge.hosts[host][0]
    root = fake_host(state / f"{host}-host", cpus=2)
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, *BERTH, "agent", "--bundle", str(bundle), "--root", str(root),
         "--state", str(state / f"{host}-state"), "--no-cgroups", "--heartbeat", "0.5", "--ttl", str(TTL),
         "--address", bridge.hosts[host][2], "--catalog", str(CATALOG),
         *(arg for label in labels for arg in ("--label", label))],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(state / f"{host}.log", "w"), text=True,
        start_new_session=True)


# Run on host A with A's identity: publish on each subject given, subscribe to each `sub:` one, and
# print what the server said of each, one line each.
ATTACK = """
import asyncio, ssl, sys, nats
async def main():
    said = []
    async def error(e): said.append(str(e))
    user, password = [line.split("=", 1)[1] for line in open(sys.argv[2]).read().splitlines()[:2]]
    nc = await nats.connect(sys.argv[1], user=user, password=password, error_cb=error,
                            tls=ssl.create_default_context(cafile=sys.argv[3]))
    for subject in sys.argv[4:]:
        if subject.startswith("sub:"):
            await nc.subscribe(subject[4:])
        else:
            await nc.publish(subject, b"\\x80")
        await nc.flush()
    await asyncio.sleep(1)
    print("\\n".join(said))
    await nc.close()
asyncio.run(main())
"""
# What host A tries against host B (issue 28 item 1's probes).
AGAINST_B = ["berth.resource.node.host-b.node-heartbeat", "berth.resource.add-node", "berth.resource.remove-node",
             "berth.resource.release", "berth.events.agent.host-b.exited", "berth.agent.host-b.start",
             "$JS.berth.API.STREAM.UPDATE.berth-events", "sub:berth.agent.host-b.>", "sub:berth.metrics.host-b.>"]


async def statuses(options: dict, nodes: list[str]) -> dict[str, str]:
    nc = await nats.connect(**options)
    try:
        msg = await nc.request("berth.resource.list-nodes", msgpack.packb({"nodenames": nodes}), timeout=5)
        return {n["nodename"]: n["status"] for n in msgpack.unpackb(msg.data)["nodes"]}
    finally:
        await nc.close()


async def until(options: dict, nodes: list[str], wanted: dict[str, str], timeout: float) -> float:
    started = time.monotonic()
    while (seen := await statuses(options, nodes)) != wanted:
        assert time.monotonic() - started < timeout, seen
        await asyncio.sleep(0.2)
    return time.monotonic() - started


def test_hosts_join_with_their_own_identities_over_tls_and_act_for_their_own_node_only(bridge, tmp_path):
    a, b, c = bridge.add("host-a"), bridge.add("host-b"), bridge.add("host-c")
    everyone = ["host-a", "host-b", "host-c"]
    state = tmp_path / "control"
    env = {"BERTH_NODE": "control"}
    with berth_up(state, "--listen", bridge.address, env=env) as (printed, _):
        assert printed["NATS_URL"].startswith(f"tls://{bridge.address}:")
        agents = [join(state, bridge, host) for host in everyone]
        try:
            options = client_options(printed)
            asyncio.run(until(options, everyone, dict.fromkeys(everyone, "up"), 30))

            # from host A's network, A's identity may not heartbeat B (nor anything but its own node)
            creds = Path(f"{state / 'host-a.bundle'}.d") / "host-a.nats"
            ca = Path(f"{state / 'host-a.bundle'}.d") / "ca.pem"
            attack = subprocess.run(
                ["ip", "netns", "exec", a, sys.executable, "-c", ATTACK, printed["NATS_URL"], str(creds), str(ca),
                 *AGAINST_B], capture_output=True, text=True, timeout=60)
            said = attack.stdout.lower()
            for probe in AGAINST_B:
                kind = "subscription" if probe.startswith("sub:") else "publish"
                assert f'permissions violation for {kind} to "{probe.removeprefix("sub:").lower()}"' in said, (
                    probe, attack.stdout, attack.stderr)

            # B's link cut: its node is down within its TTL (and the sweep), A and C stay up
            bridge.cut("host-b", True)
            took = asyncio.run(until(options, everyone, {**dict.fromkeys(everyone, "up"), "host-b": "down"}, TTL + 5))
            assert took <= TTL + 3
            bridge.cut("host-b", False)
            asyncio.run(until(options, everyone, dict.fromkeys(everyone, "up"), 30))
        finally:
            for agent in agents:
                os.killpg(agent.pid, 15)
                agent.wait(30)
    bundle = json.loads((state / "host-b.bundle").read_text())
    assert bundle["node"] == "host-b" and bundle["nats_url"] == printed["NATS_URL"]
    assert f"@{bridge.address}:" in bundle["redis_url"]  # the host reaches Redis too, as its own user
    assert "StoreNotReached" not in (state / "host-b.log").read_text()
    assert oct((state / "host-b.bundle").stat().st_mode & 0o777) == "0o600"
    assert a and b and c  # the three namespaces were made


TYPES = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 1, "mem_per_instance": 268435456}]'


async def call(options: dict, subject: str, payload: dict) -> dict:
    nc = await nats.connect(**options)
    try:
        reply = msgpack.unpackb((await nc.request(f"berth.{subject}", msgpack.packb(payload), timeout=10)).data)
    finally:
        await nc.close()
    assert "error" not in reply, reply
    return reply


async def running(options: dict, node: str) -> dict[str, int]:
    """Instance -> pid of what runs on `node`'s agent."""
    listed = await call(options, f"agent.{node}.list", {"limit": 100})
    return {i["instance"]: i["pid"] for i in listed["instances"] if i["state"] != "exited"}


async def eventually_(check, timeout: float, *seen):
    """`check()`'s truthy result, within `timeout`; else fail naming the check and `seen()`."""
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{check.__name__}: not within {timeout} s; {[await s() for s in seen]}")
        await asyncio.sleep(0.3)
    return result


def test_a_cut_host_s_warm_servers_are_relaunched_elsewhere_and_stopped_when_it_returns(bridge, tmp_path):
    bridge.add("host-a"), bridge.add("host-b")
    state = tmp_path / "control"
    env = {"BERTH_NODE": "control", "BERTH_BROKER_OPERATOR": "allocation", "BERTH_BROKER_INSTANCE_TYPES": TYPES,
           "BERTH_CATALOG": str(CATALOG)}
    with berth_up(state, "--listen", bridge.address, env=env) as (printed, _):
        agents = [join(state, bridge, host, "city=sz", "platform=linux") for host in ("host-a", "host-b")]
        try:
            options = client_options(printed)
            asyncio.run(scenario(options, bridge))
        finally:
            for agent in agents:
                os.killpg(agent.pid, 15)
                agent.wait(30)


async def scenario(options: dict, bridge: Bridge) -> None:
    await until(options, ["host-a", "host-b"], {"host-a": "up", "host-b": "up"}, 30)
    await call(options, "broker.add-broker", {"user": "team-f", "name": "warm", "param": param(),
                                              "strategy": {"type": "const", "num": 2}})

    async def pool():
        return (await call(options, "broker.list-brokers", {"user": "team-f"}))["brokers"]

    async def one_on_each():  # and the pool warm, so that what host-b loses is an idle server
        a, b = await running(options, "host-a"), await running(options, "host-b")
        idle = (await pool())[0]["idle"]
        return (a, b) if len(a) == 1 and len(b) == 1 and idle == 2 else None

    async def on_both():
        return await running(options, "host-a"), await running(options, "host-b")

    before_a, before_b = await eventually_(one_on_each, 60, on_both, pool)
    bridge.cut("host-b", True)
    await until(options, ["host-a", "host-b"], {"host-a": "up", "host-b": "down"}, TTL + 5)

    async def replaced_on_a():
        a = await running(options, "host-a")
        ledger = await call(options, "resource.get-allocations", {"nodename": "host-b"})
        return a if len(a) == 2 and not ledger["allocations"] else None

    async def on_a_and_b_ledger():
        return await running(options, "host-a"), await call(options, "resource.get-allocations", {"nodename": "host-b"})

    after_a = await eventually_(replaced_on_a, 60, on_a_and_b_ledger, pool)
    assert all(after_a[instance] == pid for instance, pid in before_a.items())  # A's own server untouched
    bridge.cut("host-b", False)
    await until(options, ["host-a", "host-b"], {"host-a": "up", "host-b": "up"}, 30)

    async def b_stopped_what_was_replaced():
        return not await running(options, "host-b")

    await eventually_(b_stopped_what_was_replaced, 30, on_both)
    assert await running(options, "host-a") == after_a  # and nothing else changed
