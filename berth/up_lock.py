"""One `berth up` per state folder: the lock it holds for its deployment's life.

`berth up` takes an exclusive `flock` on `<state>/up.lock` before it touches anything of the folder
(credentials, TLS, servers, `up.env`) and holds it while it runs. A second `berth up` on the folder
finds it taken and refuses at once, naming the running one; it changes nothing (a second
nats-server and redis-server on the same data, the first's workers stopped, its `up.env` deleted
are what it did before). The kernel lets a lock go when its process ends, however it ends: a
deployment killed with SIGKILL blocks nothing.

The file stays (removing it would let a third `berth up` lock a new file while a second still holds
the old one); it says who holds it, as JSON: the pid, when it started, and the servers it started
(pid and start time, as services/processes/procfs.py tells a process from a later one with its
pid). A clean stop empties it. A record found in it by the next `berth up` is a deployment that
ended without stopping: the servers it names, and the processes marked with its state folder
(`BERTH_DEPLOYMENT`: its workers and what they launched), may still run on the folder's data; they
are stopped before anything starts again.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from berth.commands.connection import UP_ENV, read_up_env
from services.processes import procfs

LOCK = "up.lock"


class FolderInUse(Exception):
    """Another `berth up` holds the folder; the message names it."""


class UpLock:
    """The held lock: its record is rewritten as servers start."""

    def __init__(self, fd: int, state: Path) -> None:
        self.fd, self.state = fd, state
        self.record: dict = {"pid": os.getpid(), "started": time.time(), "servers": []}
        self._write()

    def note_servers(self, server) -> None:
        """Record a server (a `ServerProcess`, or a cluster of them) that this deployment started."""
        for member in getattr(server, "members", [server]):
            pid = member.proc.pid
            self.record["servers"].append([pid, procfs.start_time(pid)])
        self._write()

    def _write(self) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.record).encode(), 0)

    def release(self) -> None:
        """A clean stop: the record emptied (nothing left running), then the lock let go."""
        os.ftruncate(self.fd, 0)
        os.close(self.fd)


@contextmanager
def hold(state: Path) -> Iterator[UpLock]:
    """The lock of `state` for the block (FolderInUse when another `berth up` holds it); what a
    deployment that ended without stopping left running is stopped first."""
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise FolderInUse(in_use(state, holder)) from None
    previous = _read(fd)
    lock = UpLock(fd, state)
    if previous:
        left = stop_leftovers(state, previous)
        if left:
            print(f"the `berth up` of pid {previous.get('pid', '?')} (started {_when(previous)}) ended without "
                  f"stopping: stopped what it left running on {state}: {left}", flush=True)
    try:
        yield lock
    finally:
        lock.release()


def _read(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _when(record: dict) -> str:
    started = record.get("started")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"


def in_use(state: Path, holder: dict) -> str:
    """What a second `berth up` is told: who runs the folder, where its servers are, and what to do."""
    pid = holder.get("pid")
    who = f"the `berth up` of pid {pid}, started {_when(holder)}" if pid else "another `berth up`"
    values = read_up_env(state / UP_ENV)
    if values:
        urls = ", ".join(f"{name}={values[name]}" for name in ("NATS_URL", "REDIS_URL", "BERTH_PREFIX")
                         if values.get(name))
        where = f"; its servers: {urls} (from {state / UP_ENV})"
    else:
        where = f"; it is still starting, or its URLs carry a password ({state / UP_ENV} is not there)"
    return (f"{state} is in use by {who}{where}. Nothing of it was changed. Use that deployment (`berth status` "
            f"with BERTH_STATE={state}), stop it first (Ctrl-C where it runs{f', or kill {pid}' if pid else ''}), "
            "or give another --state")


def stop_leftovers(state: Path, previous: dict, grace: float = 5.0) -> str:
    """Stop the workers (and what they launched) and then the servers a deployment that ended
    without stopping left running; what was stopped, "" for nothing."""
    from services.broker.operators.process import stop_deployment

    groups = asyncio.run(stop_deployment(str(state), grace))
    servers = [(pid, started) for pid, started in previous.get("servers", [])
               if isinstance(pid, int) and started is not None and procfs.is_running(pid, started)]

    async def stop_servers() -> None:
        await asyncio.gather(*(procfs.stop_group(pid, started, grace) for pid, started in servers))

    asyncio.run(stop_servers())
    said = []
    if groups:
        said.append(f"{groups} worker or launched process groups")
    if servers:
        said.append(f"servers of pids {', '.join(str(pid) for pid, _ in servers)}")
    return " and ".join(said)
