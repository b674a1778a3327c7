"""`berth up`'s broker launches through the local agent (issue 30): a warm pool's server is an
allocation on this machine's node, pinned to the CPUs it bound, run by the node's agent and counted
under the node, as on any host of a fleet; Ctrl-C stops it with everything else, and `berth up`
again on the folder warms the pool again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.request
from pathlib import Path

import nats

from bus.settings import default_node
from services.processes.procfs import DEPLOYMENT, is_running, processes_with, start_time
from tests.bus_helpers import eventually
from tests.cli_helpers import answered, berth_up, client_options, nats_call

USER = f"up{os.getpid()}"
NODE = default_node()  # this machine's node, as `berth up` names it
# As docs/broker.md's walk: `berth up` labels its own node city=local, platform=linux.
PARAM = {"city": "local", "platform": "linux", "image": "http-server", "ports": {"http": "http"},
         "worker_version": "v1"}
WAIT = 60.0


def test_the_broker_launches_through_the_agent_where_up_runs_one_unless_told_otherwise(monkeypatch):
    from berth.cli import _operator_args

    everything = dict.fromkeys(["allocation", "broker", "agent"], "")
    monkeypatch.delenv("BERTH_BROKER_OPERATOR", raising=False)
    assert _operator_args("broker", everything) == ["--operator", "allocation"]
    assert _operator_args("agent", everything) == []
    no_agent = dict.fromkeys(["allocation", "broker", "metrics"], "")
    assert _operator_args("broker", no_agent) == []  # the broker's default: process
    monkeypatch.setenv("BERTH_BROKER_OPERATOR", "process")  # which the broker reads itself
    assert _operator_args("broker", everything) == []


def test_a_warm_pool_server_is_a_pinned_placement_on_this_machines_node_run_by_its_agent(tmp_path):
    state = tmp_path / "state"
    with berth_up(state) as (printed, _):
        instance = asyncio.run(warm_pool(client_options(printed)))
        pid, started = instance["pid"], start_time(instance["pid"])
        cgroup = instance["cgroup"]  # none where the agent pins by CPU affinity alone
        assert not cgroup or cgroup_dirs(cgroup)
    assert not is_running(pid, started)  # Ctrl-C stopped what the agent launched
    assert processes_with(DEPLOYMENT, str(state)) == []
    assert not cgroup or cgroup_dirs(cgroup) == []  # stopped by its agent, which removed its cgroup
    with berth_up(state) as (printed, _):  # again on the same folder
        asyncio.run(warm_again(client_options(printed), instance["workload_id"]))
    assert processes_with(DEPLOYMENT, str(state)) == []


def cgroup_dirs(path: str) -> list[Path]:
    """The directories of the cgroup `path` in each hierarchy mounted under /sys/fs/cgroup."""
    root, relative = Path("/sys/fs/cgroup"), path.strip("/")
    return [d for d in (root / relative, *(h / relative for h in root.iterdir() if h.is_dir())) if d.is_dir()]


@contextlib.asynccontextmanager
async def admin(options: dict):
    """`call(subject, payload)` as the admin identity `berth up` printed, once its broker serves."""
    nc = await nats.connect(**options)
    try:
        await answered(nc, "berth.broker.list-brokers", {"user": USER}, wait=WAIT)
        yield lambda subject, payload: nats_call(nc, f"berth.{subject}", payload)
    finally:
        await nc.close()


async def pool(call) -> dict:
    return (await call("broker.list-brokers", {"user": USER}))["brokers"][0]


async def placed(call) -> list[dict]:
    """The node's allocation ledger."""
    return (await call("resource.get-allocations", {"nodename": NODE}))["allocations"]


async def warm_pool(options: dict) -> dict:
    """A pool of one server, made as docs/broker.md's walk makes it, then sold; the server as its
    agent reports it."""
    async with admin(options) as call:
        await call("broker.add-broker", {"user": USER, "name": "web", "strategy": {"type": "const", "num": 1},
                                         "param": PARAM, "instance": 1})

        async def warm() -> bool:
            return (await pool(call))["idle"] == 1

        await eventually(warm, WAIT, 0.3)
        # a placement in allocation, on this machine's node, with CPUs bound to it
        [placement] = await placed(call)
        assert placement["workload_id"].startswith(f"broker/{USER}/"), placement
        cpus = sorted(int(core) for core in placement["workload_resource"]["cpumem"]["cpu_map"])
        assert cpus, placement
        # run by the node's agent, under the placement's id, pinned to those CPUs
        status = await call(f"agent.{NODE}.status", {"instances": [placement["workload_id"]]})
        [instance] = status["instances"]
        assert (instance["state"], instance["cpus"], instance["owner"]["user"]) == ("ready", cpus, USER)
        assert sorted(os.sched_getaffinity(instance["pid"])) == cpus

        async def listed_under_the_node() -> bool:  # what `berth nodes` and the dashboard show of it
            [node] = (await call("resource.list-nodes", {"nodenames": [NODE]}))["nodes"]
            return node["lease"]["agent"]["running"] == 1 and node["usage"]["cpumem"]["cpu"] == len(cpus)

        await eventually(listed_under_the_node, WAIT, 0.3)
        # a caller is served from the pool, and reaches the server where its agent says
        await call("broker.apply", {"user": USER, "resource_id": "job-1", "param": PARAM,
                                    "filter": {"least_instance": 1, "request_instance": 1}})
        info = await call("broker.get-service-info", {"user": USER, "resource_id": "job-1"})
        [endpoint] = info["available_endpoints"]
        url = f"http://{endpoint['ip']}:{endpoint['ports']['http']}/"
        said = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        assert said.startswith("hello from "), said
        return instance


async def warm_again(options: dict, sold: str) -> None:
    """After a restart the pool replaces the server it lost (its placement freed, a new one made and
    run on the node), and the one sold reports `failed`, its placement left to its caller."""
    async with admin(options) as call:
        async def replaced() -> bool:
            counts = await pool(call)
            listed = (await call(f"agent.{NODE}.list", {}))["instances"]
            running = {i["workload_id"] for i in listed if i["state"] == "ready"}
            ledger = {p["workload_id"] for p in await placed(call)}
            warm = (counts["idle"], counts["deleting"]) == (1, 0)
            return warm and len(running) == 1 and ledger == running | {sold}

        await eventually(replaced, WAIT, 0.3)
        info = await call("broker.get-service-info", {"user": USER, "resource_id": "job-1"})
        assert info["status"] == "failed", info
