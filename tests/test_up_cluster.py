"""`berth up --cluster`: a 3-server NATS cluster and a 3-primary, 3-replica Redis Cluster on
loopback, every service on them, and nothing left behind after Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import msgpack
import nats
import pytest

from tests.test_cli import BERTH, ROOT, _memory_policy, _processes_mentioning, _read_until


@pytest.mark.slow
async def test_up_cluster_serves_an_allocation_and_ctrl_c_stops_every_server(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_REDIS_MAXMEMORY")}
    up = subprocess.Popen(
        [*BERTH, "up", "--cluster", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        lines = _read_until(up, "berth is up")
        urls = dict(line.split("=", 1) for line in lines if "_URL=" in line)
        assert urls["NATS_URL"].count("nats://") == 3 and urls["REDIS_URL"].startswith("redis+cluster://")
        redis_nodes = urls["REDIS_URL"].removeprefix("redis+cluster://").split(",")
        assert len(redis_nodes) == 6 and all(_processes_mentioning(node) for node in redis_nodes)
        assert {_memory_policy(state, node) for node in redis_nodes} == {(1 << 30, "noeviction")}
        nc = await nats.connect(urls["NATS_URL"].split(","))
        try:
            add = {"nodename": "c1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}}
            allocate = {"nodename": "c1", "deploy_count": 2, "request_id": "up-cluster-1",
                        "workload_resource_request": {"cpumem": {"cpu-bind": True, "cpu-request": 1}}}
            for subject, payload in (("berth.resource.add-node", add), ("berth.resource.allocate", allocate)):
                msg = await _answered(nc, subject, payload)
                assert not (msg.headers or {}).get("Nats-Service-Error-Code"), msgpack.unpackb(msg.data)
            placed = msgpack.unpackb(msg.data)["allocations"]
            assert [a["nodename"] for a in placed] == ["c1", "c1"]
            info = await nc.jetstream().stream_info("berth-events")
            assert info.config.num_replicas == 3
        finally:
            await nc.close()
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0
    assert _processes_mentioning(str(state)) == []
    assert not any(_processes_mentioning(node) for node in redis_nodes)


async def _answered(nc, subject: str, payload: dict, wait: float = 60.0):
    """The reply, once a worker serves the subject (workers start once JetStream has a leader)."""
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await nc.request(subject, msgpack.packb(payload), timeout=5)
        except nats.errors.NoRespondersError:
            assert asyncio.get_running_loop().time() < deadline, f"nobody served {subject}"
            await asyncio.sleep(0.2)
