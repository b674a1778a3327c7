"""One `berth up` per state folder (berth/up_lock.py): a second one refuses at once, naming the
running deployment, and changes nothing of it; a deployment killed with SIGKILL blocks nothing, and
what it left running on the folder's data is stopped before the next one starts its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from berth.commands.connection import read_up_env, write_up_env
from berth.up_lock import FolderInUse, hold
from services.processes.procfs import is_running, start_time
from tests.cli_helpers import BERTH, ROOT, processes_mentioning, read_until

ENV = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_STATE")}


def test_the_lock_is_held_for_the_block_and_says_who_holds_it(tmp_path):
    state = tmp_path / "state"
    with hold(state) as lock:
        write_up_env(state / "up.env", {"NATS_URL": "tls://127.0.0.1:1", "REDIS_URL": "rediss://127.0.0.1:2/0",
                                        "BERTH_PREFIX": "p"})
        with pytest.raises(FolderInUse) as refused:  # another open of the file: flock refuses it too
            with hold(state):
                pass
        said = str(refused.value)
        assert said.startswith(f"{state} is in use by the `berth up` of pid {os.getpid()}, started ")
        assert "its servers: NATS_URL=tls://127.0.0.1:1, REDIS_URL=rediss://127.0.0.1:2/0, BERTH_PREFIX=p" in said
        assert json.loads((state / "up.lock").read_text())["pid"] == os.getpid() == lock.record["pid"]
    assert (state / "up.lock").read_text() == ""  # a clean stop leaves no record: nothing to clean up next time
    with hold(state):  # and the lock is free again
        pass


def _up(state: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as stderr:
        return subprocess.Popen([*BERTH, "up", "--no-dashboard", "--no-metrics", "--state", str(state)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=ENV, start_new_session=True)


def _status_lists_allocation(state: Path, timeout: float = 60) -> str:
    """`berth status` as a user runs it (BERTH_STATE set), until it lists the allocation service."""
    deadline = time.monotonic() + timeout
    while True:
        status = subprocess.run([*BERTH, "status"], capture_output=True, text=True, timeout=30, cwd=ROOT,
                                env={**ENV, "BERTH_STATE": str(state)})
        if "berth-allocation " in status.stdout or time.monotonic() > deadline:
            assert "berth-allocation " in status.stdout, (status.stdout, status.stderr)
            return status.stdout
        time.sleep(0.5)


def test_a_second_up_on_a_folder_in_use_refuses_at_once_and_a_killed_one_blocks_nothing(tmp_path):
    state, log = tmp_path / "state", tmp_path / "up.log"
    first = _up(state, log)
    third = None
    try:
        read_until(first, "berth is starting")
        _status_lists_allocation(state)  # its workers have started
        up_env = (state / "up.env").read_text()
        values = read_up_env(state / "up.env")
        credentials = (state / "credentials" / "credentials.json").read_text()
        running = sorted(processes_mentioning(str(state)))

        asked = time.monotonic()
        second = subprocess.run([*BERTH, "up", "--no-dashboard", "--no-metrics", "--state", str(state)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
        assert second.returncode == 1, second.stderr
        assert time.monotonic() - asked < 20  # at once: it starts nothing, waits for nothing
        said = second.stderr
        assert f"{state} is in use by the `berth up` of pid {first.pid}, started " in said
        assert f"NATS_URL={values['NATS_URL']}" in said and f"REDIS_URL={values['REDIS_URL']}" in said
        assert "Nothing of it was changed" in said and f"kill {first.pid}" in said
        # and it changed nothing: the file, the credentials, the processes; the first still answers
        assert (state / "up.env").read_text() == up_env
        assert (state / "credentials" / "credentials.json").read_text() == credentials
        assert sorted(processes_mentioning(str(state))) == running
        _status_lists_allocation(state)

        # killed with SIGKILL, it lets go of the lock; its servers and workers run on, headless
        servers = [pid for pid, _ in json.loads((state / "up.lock").read_text())["servers"]]
        left = {*servers, *processes_mentioning(str(state))} - {first.pid}
        assert len(servers) == 2 and len(left) > 2  # nats-server, redis-server, workers
        since = {pid: start_time(pid) for pid in left}
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        third = _up(state, log)
        lines = read_until(third, "berth is starting")
        assert any(f"the `berth up` of pid {first.pid}" in line and "ended without stopping" in line
                   for line in lines), lines
        assert not [pid for pid, at in since.items() if at is not None and is_running(pid, at)]
        assert read_up_env(state / "up.env")["BERTH_UP_PID"] == str(third.pid)
        _status_lists_allocation(state)
    finally:
        for proc in (first, third):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                assert proc.wait(60) == 0
    assert processes_mentioning(str(state)) == []
