"""The `process` operator's bookkeeping with real processes and Redis: a process started by a broker
that died before recording it is adopted (not started twice), a launch paused past its lease stops
what it starts when it resumes, and a reused pid is never signalled."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from schemas.broker import ResourceParam
from services.broker.operators.base import LaunchSpec
from services.broker.operators.process import ProcessOperator
from services.broker.operators.process_store import ProcessTable, Slot
from services.processes import procfs
from services.processes.catalog import Catalog
from services.processes.ports import free_port
from tests.broker_helpers import CATALOG, HTTP, ROOT, SERVER, marked
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

PARAM = ResourceParam(ports=HTTP, image=SERVER)


def operator(redis, prefix: str) -> ProcessOperator:
    catalog = Catalog.load(CATALOG)
    return ProcessOperator(ProcessTable(redis, prefix), prefix=prefix, stop_grace=1.0, catalog=catalog)


async def test_a_process_started_before_a_crash_is_adopted(redis, prefix, broker_processes):
    ops = operator(redis, prefix)
    port = free_port()
    # What a broker leaves behind when it dies between starting a process and recording its pid.
    await ops.table.set_slot("u", "r", 0, None, Slot(ports={"http": port}))
    env = {**os.environ, "PORT_HTTP": str(port), "BERTH_INSTANCE": ops.marker("u", "r", 0)}
    orphan = subprocess.Popen([sys.executable, f"{ROOT}/tests/http_server.py", "--port", str(port)],
                              env=env, start_new_session=True)
    # A process of another resource whose id only starts alike is not taken for it.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env={**env, "BERTH_INSTANCE": ops.marker("u", "r/x", 0)})
    try:
        await ops.launch(LaunchSpec("u", "r", PARAM, 1))
        slots = await ops.table.load("u", "r")
        assert slots[0].pid == orphan.pid and slots[0].start_time == procfs.start_time(orphan.pid)
        assert sorted(marked(prefix).values()) == sorted([orphan.pid, other.pid])  # nothing new started

        async def running():
            return (await ops.status("u", "r")).status == "running"

        await eventually(running)
        await ops.release("u", "r", 1)
        # Stopped by the release's SIGTERM (the server does not ignore it), so no SIGKILL came.
        assert await asyncio.to_thread(orphan.wait, 5) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        orphan.kill()
        orphan.wait()


async def test_a_launch_resumed_after_a_takeover_stops_what_it_started(redis, prefix, broker_processes):
    """Issue 21: a launch paused between recording its intent and starting its process, while
    another launch of the resource took the instance over, must not leave a second process."""
    paused, other = operator(redis, prefix), operator(redis, prefix)
    spec = LaunchSpec("u", "r", PARAM, 1)
    intent = Slot(ports={"http": free_port()})
    await paused.table.set_slot("u", "r", 0, None, intent)  # the paused launch got this far
    await other.launch(spec)  # finds no process of that intent: starts the instance on ports of its own
    [(_, kept)] = marked(prefix).items()
    assert (await other.table.load("u", "r"))[0].ports != intent.ports
    # The paused launch resumes: it starts its process, finds the instance taken and stops it.
    late = await asyncio.to_thread(paused._spawn, spec, 0, intent)
    await paused._record(spec, 0, intent, late.pid)
    assert await asyncio.to_thread(late.wait, 5) == -signal.SIGTERM
    assert list(marked(prefix).values()) == [kept] and (await other.table.load("u", "r"))[0].pid == kept
    await other.release("u", "r", 1)


async def test_a_reused_pid_is_neither_ours_nor_signalled(redis, prefix):
    ops = operator(redis, prefix)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    bystander = subprocess.Popen(sleeper, start_new_session=True)
    try:
        started = procfs.start_time(bystander.pid)
        # The record says this pid started at another time: the process it names has exited.
        await ops.table.set_slot("u", "old", 0, None, Slot(ports={"http": free_port()}, pid=bystander.pid,
                                                           pgid=bystander.pid, start_time=started - 1))
        info = await ops.status("u", "old")
        assert (info.status, info.message) == ("failed", "1 of 1 instances exited")
        assert await ops.running_instances("u", ["old"]) == [0]
        await ops.release("u", "old", 1)
        assert bystander.poll() is None  # not signalled
        assert await ops.table.load("u", "old") == {}
    finally:
        bystander.kill()
        bystander.wait()
