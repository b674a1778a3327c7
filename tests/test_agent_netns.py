"""Two hosts in network namespaces of their own (where this sandbox lets a test make them): each
agent runs in its namespace, behind a veth link, with an address of its own; NATS and Redis are
reached through relays on the links' far ends. The broker places a resource's instances on both,
and its callers reach each instance at its host's address, from outside the host."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.agent_helpers import HEARTBEAT, TTL
from tests.agent_hosts import fake_host
from tests.broker_helpers import CATALOG, FAST_ARGS, kill_marked, param
from tests.bus_helpers import eventually
from tests.tcp_proxy import TcpProxy
from tests.worker_helpers import start_worker, stop_workers

pytest_plugins = ["tests.broker_fixtures"]
pytestmark = pytest.mark.slow

U = "team-n"
TYPES = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 1, "mem_per_instance": 268435456}]'


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    """A network namespace `name` linked to this one by a veth pair: 10.231.<k>.1 here, .2 there."""

    def __init__(self, name: str, k: int) -> None:
        self.name, self.here, self.address = name, f"10.231.{k}.1", f"10.231.{k}.2"
        link = f"vb{name[-6:]}"
        ip("netns", "add", name)
        try:
            ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("addr", "add", f"{self.here}/24", "dev", link)
            ip("link", "set", link, "up")
            ip("-n", name, "addr", "add", f"{self.address}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError:
            self.remove()
            raise

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # its veth pair goes with it


class Relays:
    """TCP relays to the session's NATS and Redis, listening on each host's far end, run by a loop
    in a thread of their own (the test blocks its own loop while a worker starts)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxies: list[TcpProxy] = []

    def relay(self, url: str, listen: str, scheme: str) -> str:
        target = urlsplit(url)
        proxy = asyncio.run_coroutine_threadsafe(
            TcpProxy.start(target.hostname, target.port, listen=listen), self.loop).result(10)
        self.proxies.append(proxy)
        return proxy.url(scheme, target.path)

    def close(self) -> None:
        for proxy in self.proxies:
            asyncio.run_coroutine_threadsafe(proxy.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def hosts(nats_url, redis_url, prefix, tmp_path) -> Iterator[list[tuple[Host, str, str]]]:
    """Two namespaced hosts, each with (its relayed NATS URL, its relayed Redis URL)."""
    tag = uuid.uuid4().hex[:6]
    made: list[Host] = []
    relays = Relays()
    try:
        for k in (1, 2):
            try:
                made.append(Host(f"berth{tag}{k}", k))
            except (subprocess.CalledProcessError, FileNotFoundError) as error:
                pytest.skip(f"this sandbox makes no network namespace: {getattr(error, 'stderr', error)}")
        yield [(h, relays.relay(nats_url, h.here, "nats"), relays.relay(redis_url, h.here, "redis")) for h in made]
    finally:
        kill_marked(prefix)
        relays.close()
        for host in made:
            host.remove()


async def test_instances_on_namespaced_hosts_are_reached_at_their_hosts_addresses(
    hosts, spawn_worker, prefix, broker_call, client, tmp_path
):
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    spawn_worker("services.broker.worker", "--operator", "allocation", "--instance-types", TYPES, *FAST_ARGS)
    agents = []
    try:
        for host, nats, redis in hosts:
            root = fake_host(tmp_path / host.name, cpus=1)
            agents.append(await asyncio.to_thread(
                start_worker, "services.agent.worker", nats, redis, prefix, "--node", host.name,
                "--root", str(root), "--no-cgroups", "--state", str(tmp_path / f"{host.name}-state"),
                "--address", host.address, "--catalog", str(CATALOG), "--label", "city=sz",
                "--label", "platform=linux", "--heartbeat", str(HEARTBEAT), "--ttl", str(TTL),
                wrap=["ip", "netns", "exec", host.name]))
        b = broker_call
        await b("init", {"user": U, "resource_id": "spread", "param": param()})
        await b("launch", {"user": U, "resource_id": "spread", "filter": {"least_instance": 2, "request_instance": 2}})
        info = await b.wait_running(U, "spread", timeout=30)
        assert info["status"] == "running"
        addresses = sorted(endpoint["ip"] for endpoint in info["available_endpoints"])
        assert addresses == sorted(host.address for host, _, _ in hosts)  # one instance on each host
        for endpoint in info["available_endpoints"]:  # reached from here, across the veth link
            reader, writer = await asyncio.open_connection(endpoint["ip"], endpoint["ports"]["http"])
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            assert b"hello from" in await reader.read()
            writer.close()
            with pytest.raises(OSError):  # it listens on its host's address, not on this loopback
                await asyncio.open_connection("127.0.0.1", endpoint["ports"]["http"])
        await b("release", {"user": U, "resource_id": "spread"})

        async def nothing_runs():
            listed = [await client.request(f"agent.{h.name}.list", {}, dict) for h, _, _ in hosts]
            return all(not page["instances"] for page in listed)

        await eventually(nothing_runs, timeout=20)
    finally:
        stop_workers(agents)
