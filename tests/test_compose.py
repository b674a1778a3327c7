"""compose.yaml (issue 28 item 7). Docker is not on this machine: the file is parsed, and the same
deployment is run with the local binaries: `berth prepare` writes the state folder as compose's
`prepare` service does, nats-server and redis-server run with compose's own arguments (the state
volume's path and the ports aside), and each berth service of compose runs its own command with
its own environment file. Identities, TLS and one node identity per agent must all hold."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys

import msgpack
import nats
import pytest
import yaml

from berth.cli import parser
from berth.prepare import read_env
from berth.servers import find_binary, wait_for_port
from bus.connection import read_creds_file
from services.processes.ports import free_port
from tests.agent_hosts import fake_host
from tests.worker_helpers import ROOT

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
STATE = "/state"  # where compose mounts the state volume
DEFAULT = {name: spec for name, spec in COMPOSE.items() if "profiles" not in spec}


def berth_services() -> dict[str, list[str]]:
    """compose's berth processes of the default profile: name -> (environment file, berth arguments)."""
    return {name: spec["command"] for name, spec in DEFAULT.items() if spec.get("build") and name != "prepare"}


def test_the_default_deployment_has_identities_tls_and_an_identity_per_agent():
    assert set(DEFAULT) == {"prepare", "nats", "redis", "streams", "allocation", "broker", "agent-1", "agent-2"}
    prepare = parser().parse_args(DEFAULT["prepare"]["command"])
    assert prepare.command == "prepare" and prepare.agents == 2 and prepare.state == STATE
    assert prepare.nats_url.startswith("tls://") and prepare.redis_url.startswith("rediss://")
    for name, command in berth_services().items():
        env_name, args = command[0], command[1:]
        assert DEFAULT[name]["entrypoint"][-1].count("/state/env/$$0.env") == 1  # it sources its own file
        parsed, extra = parser().parse_known_args(args)
        assert extra == [] and parsed.command in ("worker", "setup-streams"), name
        assert env_name == (name if name != "streams" else "streams-admin")
    assert "ports" not in DEFAULT["redis"] and DEFAULT["nats"]["ports"] == ["127.0.0.1:4222:4222"]
    assert "--tls-port" in DEFAULT["redis"]["command"] and DEFAULT["redis"]["command"][0].endswith("redis.conf")
    assert "-c" in DEFAULT["nats"]["command"]
    assert not any("PASSWORD" in str(spec) for spec in DEFAULT.values())  # no secret in the file


def test_the_cluster_profile_is_marked_for_development_and_its_commands_exist():
    text = (ROOT / "compose.yaml").read_text()
    assert "FOR DEVELOPMENT ONLY" in text
    cluster = {name: spec for name, spec in COMPOSE.items() if "cluster" in spec.get("profiles", [])}
    workers = {name.removesuffix("-cluster"): spec for name, spec in cluster.items() if "build" in spec}
    assert set(workers) == {"allocation", "broker", "metrics", "agent"}
    for name, spec in workers.items():
        args, extra = parser().parse_known_args(spec["command"])
        assert (args.command, args.service, extra) == ("worker", name, [])
    assert sum(name.startswith("redis-") and name[-1].isdigit() for name in cluster) == 6


def localised(command: list[str], state: str, swaps: dict[str, str]) -> list[str]:
    """A compose command with the state volume's path made `state` and some arguments swapped."""
    return [swaps.get(arg, arg.replace(STATE, state)) for arg in command]


def run_berth(command: list[str], state: str, *extra: str) -> subprocess.Popen:
    """A compose berth service as its container runs it: its environment file, then `berth ...`."""
    env = {**os.environ, **read_env(f"{state}/env/{command[0]}.env")}
    return subprocess.Popen([sys.executable, "-m", "berth.cli", *command[1:], *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.slow
def test_the_default_deployment_runs_with_compose_s_own_configuration(tmp_path):
    state, nats_port, redis_port = str(tmp_path / "state"), free_port(), free_port()
    prepare = localised(DEFAULT["prepare"]["command"], state, {
        "tls://nats:4222": f"tls://localhost:{nats_port}", "rediss://redis:6379/0": f"rediss://localhost:{redis_port}/0"})
    subprocess.run([sys.executable, "-m", "berth.cli", *prepare], cwd=ROOT, check=True, capture_output=True)
    (tmp_path / "data").mkdir()
    servers = [
        subprocess.Popen([find_binary("nats-server"), *localised(DEFAULT["nats"]["command"], state, {
            "/data": str(tmp_path / "data")}), "-a", "127.0.0.1", "-p", str(nats_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True),
        subprocess.Popen([find_binary("redis-server"), *localised(DEFAULT["redis"]["command"], state, {
            "6379": str(redis_port), "/data": str(tmp_path / "data")}), "--bind", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True),
    ]
    processes: list[subprocess.Popen] = []
    try:
        for proc, port in zip(servers, (nats_port, redis_port)):
            wait_for_port(port, proc)
        streams = run_berth(DEFAULT["streams"]["command"], state)
        assert streams.wait(60) == 0
        processes += [run_berth(DEFAULT[name]["command"], state) for name in ("allocation", "broker")]
        for k in (1, 2):
            host = fake_host(tmp_path / f"host-{k}", cpus=2)
            processes.append(run_berth(DEFAULT[f"agent-{k}"]["command"], state, "--root", str(host), "--no-cgroups",
                                       "--state", str(tmp_path / f"agent-{k}"), "--heartbeat", "0.5"))
        asyncio.run(check_deployment(state))
    finally:
        for proc in [*processes, *servers]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [*processes, *servers]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


async def connect_as(state: str, process: str, errors: list[str] | None = None):
    env = read_env(f"{state}/env/{process}.env")
    user, password = read_creds_file(env["BERTH_NATS_CREDS"])

    async def error(e: Exception) -> None:
        if errors is not None:
            errors.append(str(e).lower())

    return await nats.connect(env["NATS_URL"], user=user, password=password, error_cb=error,
                              tls=ssl.create_default_context(cafile=env["BERTH_TLS_CA"]))


async def check_deployment(state: str) -> None:
    admin = await connect_as(state, "admin")
    try:
        nodes: dict = {}
        for _ in range(300):  # the workers and agents start
            try:
                msg = await admin.request("berth.resource.list-nodes", msgpack.packb({}), timeout=5)
                nodes = {n["nodename"]: n["status"] for n in msgpack.unpackb(msg.data).get("nodes", [])}
            except nats.errors.NoRespondersError:
                pass
            if nodes == {"node-1": "up", "node-2": "up"}:
                break
            await asyncio.sleep(0.2)
        assert nodes == {"node-1": "up", "node-2": "up"}
    finally:
        await admin.close()
    errors: list[str] = []
    agent = await connect_as(state, "agent-1", errors)
    try:  # agent-1 runs as node-1's identity: node-2's subjects are not its own
        await agent.publish("berth.resource.node.node-2.node-heartbeat", b"\x80")
        await agent.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.1)
        assert errors and "permissions violation for publish" in errors[0], errors
    finally:
        await agent.close()
