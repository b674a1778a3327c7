"""Several hosts on one machine: three `berth agent` processes with different topologies (fake host
trees), an allocation worker and a broker worker with the `allocation` operator, all real
processes. The broker launches on the nodes allocation chose; a SIGKILLed agent's node goes down
within its TTL and a warm pool replaces its servers elsewhere; a restarted agent adopts its
processes, and stops those whose workload was released while it was away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from schemas.errors import BusError
from services.agent.cgroups import CgroupRoot
from services.processes import procfs
from tests.agent_helpers import TTL, remove_parent_cgroup
from tests.broker_helpers import FAST_ARGS, ROOT, marked, param
from tests.bus_helpers import eventually

pytest_plugins = ["tests.agent_fixtures", "tests.broker_fixtures"]
pytestmark = pytest.mark.slow

U = "team-a"
TYPES = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 1, "mem_per_instance": 268435456}]'
GiB = 1 << 30


@pytest.fixture
def cluster(spawn_worker, spawn_agent):
    """An allocation worker, a broker worker on the `allocation` operator, and `agents(...)`."""
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    spawn_worker("services.broker.worker", "--operator", "allocation", "--instance-types", TYPES,
                 "--allocation-timeout", "2", *FAST_ARGS)

    def agents(*shapes: tuple[str, str, dict]):
        return {node: spawn_agent(node, "--label", f"city={city}", "--label", "platform=linux", **host)
                for node, city, host in shapes}

    return agents


async def ledger(client, node: str) -> set[str]:
    reply = await client.request("resource.get-allocations", {"nodename": node}, dict)
    return {a["workload_id"] for a in reply["allocations"]}


async def running_on(client, node: str) -> set[str]:
    reply = await client.request(f"agent.{node}.list", {"limit": 1000}, dict)
    return {i["instance"] for i in reply["instances"] if i["state"] != "exited"}


async def registered(client, *nodes: str) -> None:
    async def listed():
        reply = await client.request("resource.list-nodes", {"nodenames": list(nodes)}, dict)
        return len(reply["nodes"]) == len(nodes) and all(n["status"] == "up" for n in reply["nodes"])

    await eventually(listed, timeout=20)


async def test_the_broker_launches_where_allocation_placed(cluster, client, broker_call, prefix):
    cluster(("small", "sz", {"cpus": 2}), ("numa", "sz", {"cpus": 4, "numa_nodes": 2, "memory": 8 * GiB}),
            ("far", "gz", {"cpus": 8}))
    await registered(client, "small", "numa", "far")
    numa = (await client.request("resource.list-nodes", {"nodenames": ["numa"]}, dict))["nodes"][0]
    assert numa["capacity"]["cpumem"]["numa"] == {"0": "0", "1": "0", "2": "1", "3": "1"}  # its own topology

    b = broker_call
    await b("init", {"user": U, "resource_id": "job", "param": param()})
    reply = await b("launch", {"user": U, "resource_id": "job", "filter": {"least_instance": 1, "request_instance": 5}})
    assert reply["request_instance"] == 5  # 2 cores + 4 cores in city sz, bound: room for 6
    info = await b.wait_running(U, "job", timeout=30)
    assert (info["status"], info["current_instances"]) == ("running", 5)
    for node in ("small", "numa", "far"):
        assert await running_on(client, node) == await ledger(client, node)  # each runs what it holds
    assert await ledger(client, "far") == set()
    assert len(await ledger(client, "small")) + len(await ledger(client, "numa")) == 5
    for endpoint in info["available_endpoints"]:
        reader, writer = await asyncio.open_connection(endpoint["ip"], endpoint["ports"]["http"])
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        assert b"hello" in await reader.read()
        writer.close()
    await b("release", {"user": U, "resource_id": "job"})
    for node in ("small", "numa"):
        assert await running_on(client, node) == set() and await ledger(client, node) == set()
    assert not marked(prefix)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_a_lost_agents_node_goes_down_and_its_pool_servers_are_replaced_elsewhere(
    cluster, client, broker_call, events, spawn_agent, tmp_path, fault
):
    """SIGKILL: the agent is gone, and a new one starts on its state folder. SIGSTOP: the agent
    stalls past its TTL, then resumes as if nothing happened. Either way the broker failed its
    servers over meanwhile, and the agent that comes back stops them: nothing runs that nothing
    will release."""
    agents = cluster(("left", "sz", {"cpus": 2}), ("right", "sz", {"cpus": 2}))
    await registered(client, "left", "right")
    b = broker_call
    await b("add-broker", {"user": U, "name": "warm", "strategy": {"type": "const", "num": 2}, "param": param()})
    await b.wait_idle(U, "warm", 2, timeout=30)
    victim = "left" if await running_on(client, "left") else "right"
    survivor = "right" if victim == "left" else "left"
    lost = await running_on(client, victim)
    listed = (await client.request(f"agent.{victim}.list", {}, dict))["instances"]
    processes = [(i["pid"], procfs.start_time(i["pid"])) for i in listed]
    down = await events.subscribe(f"resource.{victim}.down")
    try:
        agents[victim].proc.send_signal(getattr(signal, fault))
        if fault == "SIGKILL":
            agents[victim].proc.wait(10)
        await down.next(timeout=TTL + 10)  # the fault hit: the node's lease lapsed
    finally:
        await down.close()
    listed = (await client.request("resource.list-nodes", {"nodenames": [victim]}, dict))["nodes"][0]
    assert listed["status"] == "down"
    assert all(procfs.is_running(*process) for process in processes)  # they outlived their agent

    async def replaced():  # two idle servers again, none of them on the dead node
        pool = await b.pool(U, "warm")
        return pool["idle"] == 2 and await ledger(client, victim) == set()

    await eventually(replaced, timeout=30)
    assert len(await running_on(client, survivor)) == 2
    # The agent comes back (on its state folder, or resumed): it adopts what still runs, and stops
    # what the broker released while it was away (nothing holds those workloads any more).
    stopped = await events.subscribe(f"agent.{victim}.stopped")
    await events.nc.flush()  # the subscription is in place before the agent (spawned blocking) starts
    try:
        if fault == "SIGKILL":
            spawn_agent(victim, "--label", "city=sz", "--label", "platform=linux",
                        state=tmp_path / f"{victim}-state", cpus=2)
        else:
            agents[victim].proc.send_signal(signal.SIGCONT)
        gone = {(await stopped.next(timeout=20))[1]["instance"] for _ in lost}
    finally:
        await stopped.close()
    assert gone == lost
    assert not any(procfs.is_running(*process) for process in processes)
    await b("remove-broker", {"user": U, "name": "warm"})
    await eventually(lambda: _empty(client, "left", "right"), timeout=20)


async def test_a_restarted_agent_adopts_its_processes(spawn_worker, spawn_agent, client, tmp_path, prefix):
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    first = spawn_agent("solo", cpus=2)
    await registered(client, "solo")
    await client.request("resource.allocate", {"nodename": "solo", "deploy_count": 1, "workload_ids": ["w"]}, dict)
    started = await client.request("agent.solo.start", {
        "instance": "one", "param": {"image": "http-server", "ports": {"http": "http"}}, "workload_id": "w"}, dict)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    spawn_agent("solo", state=tmp_path / "solo-state", cpus=2)

    async def adopted():
        found = (await client.request("agent.solo.status", {"instances": ["one"]}, dict))["instances"]
        return found[0] if found and found[0]["state"] == "ready" else None

    info = await eventually(adopted, timeout=20)
    assert info["pid"] == started["pid"] and info["ports"] == started["ports"]
    assert list(marked(prefix).values()) == [started["pid"]]  # one process, not a second one
    await client.request("agent.solo.stop", {"instance": "one"}, dict)
    assert not marked(prefix)


async def _empty(client, *nodes: str) -> bool:
    for node in nodes:
        if await running_on(client, node) or await ledger(client, node):
            return False
    return True


async def test_berth_agent_drain_waits_for_the_instances_to_end(spawn_worker, spawn_agent, client, nats_url, prefix):
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    spawn_agent("busy", cpus=2)
    await registered(client, "busy")
    await client.request("agent.busy.start", {
        "instance": "job", "param": {"image": "http-server", "ports": {"http": "http"}}}, dict)

    def drain_now(node: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "berth.cli", "agent", "--node", node, "--drain", "--wait", "0",
             "--nats", nats_url, "--prefix", prefix], cwd=ROOT, capture_output=True, text=True, timeout=60)

    # the exit status tells "no agent answered" (3) from "accepted, instances still run" (6)
    nobody = drain_now("nobody")
    assert nobody.returncode == 3 and "no agent serves node nobody" in nobody.stderr, nobody.stderr
    accepted = drain_now("busy")
    assert accepted.returncode == 6, accepted.stderr
    assert "node busy is draining (it takes no new placement) and still runs 1 instances after 0 s" in accepted.stderr
    await client.request("agent.busy.drain", {"draining": False}, dict)  # as it was, for the wait below
    drain = subprocess.Popen(
        [sys.executable, "-m", "berth.cli", "agent", "--node", "busy", "--drain", "--wait", "60",
         "--nats", nats_url, "--prefix", prefix], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async def draining():
            listed = await client.request("resource.list-nodes", {"nodenames": ["busy"]}, dict)
            return listed["nodes"][0]["status"] == "draining"

        await eventually(draining, timeout=20)
        assert drain.poll() is None  # it waits: an instance still runs
        await client.request("agent.busy.stop", {"instance": "job"}, dict)
        out, err = drain.communicate(timeout=30)
    finally:
        if drain.poll() is None:
            drain.kill()
    assert drain.returncode == 0, err
    assert "still run" in out and out.strip().endswith("drained, nothing runs there")
    resumed = subprocess.run(
        [sys.executable, "-m", "berth.cli", "agent", "--node", "busy", "--resume", "--nats", nats_url,
         "--prefix", prefix], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    listed = await client.request("resource.list-nodes", {"nodenames": ["busy"]}, dict)
    assert listed["nodes"][0]["status"] == "up"


async def test_the_agents_metrics_answer_for_the_instances_it_launched(spawn_worker, spawn_agent, client, prefix):
    """On this machine (root "/", cgroups on): an instance gets a cgroup of its own, pinned to the CPU
    it was bound to, and `metrics.<node>.get` answers for it as a pod of one container."""
    root = CgroupRoot(parent=f"berth-test-{prefix}")
    if root.mode() != "cgroup":
        pytest.skip("this host lets no cpuset cgroup be made")
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    agent = spawn_agent("here", "--cgroup-parent", root.parent, root="/")
    try:
        await registered(client, "here")
        started = await client.request("agent.here.start", {
            "instance": "w/1", "param": {"image": "http-server", "ports": {"http": "http"}},
            "cpus": [0], "mems": [0], "memory_limit": 256 << 20}, dict)
        assert started["pinning"] == "cgroup" and started["cgroup"].startswith(f"/{root.parent}/here/")
        status = Path(f"/proc/{started['pid']}/status").read_text()
        assert "Cpus_allowed_list:\t0\n" in status

        async def measured():
            try:
                return await client.request("metrics.here.get", {
                    "scope": "container", "metric": "mem.limit.container", "pod_uid": "w/1",
                    "container": "http-server"}, dict)
            except BusError as error:
                assert error.code == "metric_not_found"
                return None

        limit = await eventually(measured, timeout=20)
        assert limit["value"] == 256 << 20
        usage = await client.request("metrics.here.get", {
            "scope": "container", "metric": "mem.usage.container", "pod_uid": "w/1", "container": "http-server"},
            dict)
        assert 0 < usage["value"] <= 256 << 20
        await client.request("agent.here.stop", {"instance": "w/1"}, dict)
    finally:
        agent.signal(signal.SIGTERM)
        agent.wait(15)
        assert await remove_parent_cgroup(root) == []  # the agent removed the instance's cgroup


async def test_a_node_is_up_only_once_its_agent_answers(spawn_worker, spawn_agent, client, events):
    """The agent registers its node only after its endpoints serve: a client that acts on the
    node's `added` event at once reaches its agent (before, it met no responder for 14-28 ms)."""
    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    answers: list = []

    async def on_added(subject: str, event: dict) -> None:
        try:
            answers.append(await client.request("agent.early.info", {}, dict, timeout=5))
        except BusError as error:
            answers.append(error.code)

    subscription = await events.subscribe("resource.early.added", dict, on_added)
    try:
        await asyncio.to_thread(spawn_agent, "early", cpus=2)

        async def answered():
            return answers

        first = (await eventually(answered, timeout=20))[0]
    finally:
        await subscription.unsubscribe()
    assert isinstance(first, dict) and first["node"] == "early", first


# -- the broker's failover paths, with only the event path able to pass ------------------------------

SLOW_POOL = ["--pool-interval", "600"]  # longer than each test: only an event can make the pool act


@pytest_asyncio.fixture
async def warm_pool(spawn_worker, spawn_agent, client, broker_call):
    """Two agents (left, right), a warm pool of 2 filled by a broker with a fast pool loop, which is
    then replaced by one whose loop waits 600 s: what happens next is the events' doing."""

    made = []

    async def make() -> dict:
        made.append(True)
        spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
        agents = {node: spawn_agent(node, "--label", "city=sz", "--label", "platform=linux", cpus=2)
                  for node in ("left", "right")}
        await registered(client, "left", "right")
        broker = spawn_worker("services.broker.worker", "--operator", "allocation", "--instance-types", TYPES,
                              "--allocation-timeout", "2", *FAST_ARGS)
        await broker_call("add-broker", {"user": U, "name": "warm", "strategy": {"type": "const", "num": 2},
                                         "param": param()})
        await broker_call.wait_idle(U, "warm", 2, timeout=30)
        broker.signal(signal.SIGTERM)  # its leases go back at once
        broker.wait(30)
        spawn_worker("services.broker.worker", "--operator", "allocation", "--instance-types", TYPES,
                     "--allocation-timeout", "2", *FAST_ARGS, *SLOW_POOL)
        return agents

    yield make
    if made:  # the pool's servers go with it (a test leaves no process behind)
        await broker_call("remove-broker", {"user": U, "name": "warm"})
        await eventually(lambda: _empty(client, "left", "right"), timeout=30)


async def idle_on(client, broker_call, node: str) -> dict[str, int]:
    """The pool's idle servers on `node`: instance -> pid."""
    listed = (await client.request(f"agent.{node}.list", {"limit": 100}, dict))["instances"]
    return {i["instance"]: i["pid"] for i in listed if i["state"] != "exited"}


async def test_a_draining_node_s_idle_pool_servers_are_recycled_elsewhere_at_once(warm_pool, client, broker_call):
    await warm_pool()
    on_left = await idle_on(client, broker_call, "left")
    assert on_left  # spread: one on each node
    await client.request("agent.left.drain", {"draining": True}, dict)

    async def moved():
        pool = await broker_call.pool(U, "warm")
        left, right = await idle_on(client, broker_call, "left"), await idle_on(client, broker_call, "right")
        return pool["idle"] == 2 and not left and len(right) == 2

    await eventually(moved, timeout=30)


async def test_a_sold_resource_on_a_node_that_goes_down_reports_failed(warm_pool, client, broker_call, events,
                                                                        spawn_agent, tmp_path):
    agents = await warm_pool()
    sold = await broker_call("apply", {"user": U, "resource_id": "job", "param": param(),
                                       "filter": {"least_instance": 1, "request_instance": 1}})
    mine = f"broker/{U}/{sold['broker_resource_id']}/"
    node = [n for n in ("left", "right") if any(i.startswith(mine) for i in await idle_on(client, broker_call, n))][0]
    down = await events.subscribe(f"resource.{node}.down")
    try:
        agents[node].proc.send_signal(signal.SIGKILL)
        await down.next(timeout=TTL + 10)
    finally:
        await down.close()

    async def failed():
        info = await broker_call("get-service-info", {"user": U, "resource_id": sold["broker_resource_id"]})
        return info["status"] == "failed"

    await eventually(failed, timeout=20)
    # its caller lets it go; the node's agent, back, stops what it ran (nothing runs that nothing will release)
    await broker_call("release", {"user": U, "resource_id": sold["broker_resource_id"]})
    spawn_agent(node, "--label", "city=sz", "--label", "platform=linux", state=tmp_path / f"{node}-state", cpus=2)


async def test_an_instance_that_exits_on_an_agent_is_replaced_at_once(warm_pool, client, broker_call):
    await warm_pool()
    before = {**await idle_on(client, broker_call, "left"), **await idle_on(client, broker_call, "right")}
    victim, pid = next(iter(before.items()))
    os.kill(pid, signal.SIGKILL)

    async def replaced():
        pool = await broker_call.pool(U, "warm")
        now = {**await idle_on(client, broker_call, "left"), **await idle_on(client, broker_call, "right")}
        return pool["idle"] == 2 and victim not in now and len(now) == 2

    await eventually(replaced, timeout=30)


async def test_an_agent_whose_link_went_silent_stops_what_was_released_meanwhile(
    spawn_worker, spawn_agent, client, nats_url, events
):
    """The agent's link stalls past its TTL (a link that is down: nothing is lost, all is late): its
    node goes down, and the instance's workload is released meanwhile. When the link heals, the
    beats it held back reach allocation at once; the one that finds the node down is answered to a request that timed out long before. The
    agent still compares what it runs with the ledger, and stops the released instance, at once
    (not at its next periodic reconcile, a minute later)."""
    from urllib.parse import urlsplit

    from tests.tcp_proxy import TcpProxy

    spawn_worker("services.allocation.worker", "--lease-interval", "0.05")
    target = urlsplit(nats_url)
    proxy = await TcpProxy.start(target.hostname, target.port)
    try:
        # in a thread: the proxy relays on this loop while the agent starts
        await asyncio.to_thread(spawn_agent, "silent", "--nats", proxy.url("nats"), "--reconcile-interval", "600",
                                cpus=2)
        await registered(client, "silent")
        await client.request("resource.allocate", {"nodename": "silent", "deploy_count": 1, "workload_ids": ["w"]},
                             dict)
        await client.request("agent.silent.start", {
            "instance": "one", "param": {"image": "http-server", "ports": {"http": "http"}}, "workload_id": "w"}, dict)
        down = await events.subscribe("resource.silent.down")
        try:
            proxy.cut("stall")  # as a link that is down: TCP holds the bytes, and delivers them when it is up
            await down.next(timeout=TTL + 10)  # the fault hit: the node's lease lapsed
        finally:
            await down.close()
        await client.request("resource.release", {"workload_ids": ["w"]}, dict)
        stopped = await events.subscribe("agent.silent.stopped")
        try:
            proxy.restore()
            _, event = await stopped.next(timeout=20)
        finally:
            await stopped.close()
        assert event["instance"] == "one"
    finally:
        await proxy.close()
