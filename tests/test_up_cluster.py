"""`berth up --cluster`: a 3-server NATS cluster and a 3-primary, 3-replica Redis Cluster on
loopback, every service on them, nothing left behind after Ctrl-C, and the same cluster and its data
when started again; the workers' events stream waits for a cluster whose JetStream is not ready."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from contextlib import contextmanager

import nats
import pytest

from berth.redis_functions import every_library
from berth.servers import start_nats_cluster
from bus.events import EventBus, StreamSpec
from tests.bus_helpers import eventually
from tests.cli_helpers import (
    BERTH,
    ROOT,
    client_options,
    memory_policy,
    nats_call,
    printed_variables,
    processes_mentioning,
    read_until,
    redis_admin,
)


@pytest.mark.slow
async def test_up_cluster_serves_an_allocation_ctrl_c_stops_every_server_and_a_restart_keeps_the_data(tmp_path):
    state = tmp_path / "state"
    with _up_cluster(state) as (urls, redis_nodes):
        # TLS by default, routes and the Redis cluster bus included (the cluster forms over it)
        assert urls["NATS_URL"].count("tls://") == 3 and urls["REDIS_URL"].startswith("rediss+cluster://")
        assert len(redis_nodes) == 6 and all(processes_mentioning(node) for node in redis_nodes)
        assert {memory_policy(state, node) for node in redis_nodes} == {(1 << 30, "noeviction")}
        nc = await nats.connect(**client_options(urls))
        try:
            add = {"nodename": "c1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}}
            allocate = {"nodename": "c1", "deploy_count": 2, "request_id": "up-cluster-1",
                        "workload_resource_request": {"cpumem": {"cpu-bind": True, "cpu-request": 1}}}
            await nats_call(nc, "berth.resource.add-node", add)
            placed = (await nats_call(nc, "berth.resource.allocate", allocate))["allocations"]
            assert [a["nodename"] for a in placed] == ["c1", "c1"]
            info = await nc.jetstream(domain=urls["BERTH_JS_DOMAIN"]).stream_info("berth-events")
            assert info.config.num_replicas == 3
        finally:
            await nc.close()
        assert all(_holds_every_library(state, node) for node in redis_nodes)  # primaries and replicas
    # Started again on the same folder (it used to fail with "Slot 0 is already busy"): the same
    # Redis Cluster, with what it held.
    with _up_cluster(state) as (urls, again):
        assert sorted(again) == sorted(redis_nodes)
        nc = await nats.connect(**client_options(urls))
        try:
            held = (await nats_call(nc, "berth.resource.get-allocations", {"nodename": "c1"}))["allocations"]
            assert sorted(a["workload_id"] for a in held) == sorted(a["workload_id"] for a in placed)
        finally:
            await nc.close()


def _holds_every_library(state, node: str) -> bool:
    with redis_admin(state, node) as admin:
        return all(admin.function_list(library.name) for library in every_library())


@contextmanager
def _up_cluster(state):
    """`berth up --cluster` on `state` until it is up: (its URLs, its Redis nodes); then Ctrl-C, after
    which no process of it may be left."""
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_REDIS_MAXMEMORY")}
    up = subprocess.Popen(
        [*BERTH, "up", "--cluster", "--no-dashboard", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE,
        text=True, env=env, start_new_session=True,
    )
    try:
        lines = read_until(up, "berth is starting")
        urls = printed_variables(lines)
        redis_nodes = urls["REDIS_URL"].split("://", 1)[1].split(",")
        yield urls, redis_nodes
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0
    assert processes_mentioning(str(state)) == []
    assert not any(processes_mentioning(node) for node in redis_nodes)


async def test_the_events_stream_waits_for_a_cluster_whose_jetstream_does_not_answer(tmp_path, caplog):
    """With its JetStream metadata leader not answering (here: stopped with SIGSTOP, as a server
    still starting on a busy machine, or one going away), a cluster answers no stream request until
    it has elected another: each step is asked again until the cluster answers, instead of failing
    the worker (`berth up --cluster` starts its workers while the new cluster elects its first)."""
    cluster = start_nats_cluster(tmp_path / "nats")
    logs = [tmp_path / "nats" / f"n{i}" / "nats-server.log" for i in range(len(cluster.members))]

    async def leader() -> int | None:
        said = [i for i, log in enumerate(logs) if "Self is new JetStream cluster metadata leader" in log.read_text()]
        return said[0] + 1 if len(said) == 1 else None  # + 1: index 0 is a leader too

    paused = cluster.members[await eventually(leader, timeout=30) - 1]
    others = [m.url for m in cluster.members if m is not paused]
    nc = await nats.connect(others + [paused.url], dont_randomize=True)  # on another server, knowing all three
    try:
        js = nc.jetstream()
        paused.proc.send_signal(signal.SIGSTOP)
        try:
            caplog.set_level("INFO", logger="berth.events")
            spec = StreamSpec("events", ("resource.>",), max_age=3600, max_bytes=1 << 20)
            creating = asyncio.create_task(EventBus(nc, prefix="lc").ensure_stream(spec))

            async def timed_out() -> bool:
                return creating.done() or "JetStream did not answer the stream" in caplog.text

            await eventually(timed_out, timeout=45)
            assert not creating.done(), creating.exception()  # the fault hit, and the worker did not give up
        finally:
            paused.proc.send_signal(signal.SIGCONT)
        await asyncio.wait_for(creating, 60)
        assert (await js.stream_info("lc-events")).config.num_replicas == 3
    finally:
        await nc.close()
        cluster.stop()
