"""Helpers shared by the broker tests: the launched server, params, process checks, waiting.

The fixtures are in tests/broker_fixtures.py.
"""

from __future__ import annotations

import os
import signal
from dataclasses import fields
from pathlib import Path
from typing import Any

from services.broker.config import Timing
from services.broker.operators.process_store import ProcessTable
from services.processes import procfs

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "tests" / "catalog.toml"  # the images the tests' brokers may run
SERVER = "http-server"  # tests/http_server.py --port $PORT_HTTP
HTTP = {"http": "http"}

# Intervals short enough for tests, long enough not to spin on two CPUs.
FAST = Timing(
    pool_interval=0.1,
    lease_seconds=1.5,
    sweep_interval=0.1,
    claim_seconds=3.0,
    trace_timeout=20.0,
    ready_timeout=20.0,
    cooling_seconds=60.0,
    recycle_seconds=60.0,
    release_retry_seconds=0.5,
)

# The same as worker options, for spawned broker processes.
FAST_ARGS = [
    arg for f in fields(Timing) for arg in (f"--{f.name.replace('_', '-')}", str(getattr(FAST, f.name)))
] + ["--stop-grace", "1", "--catalog", str(CATALOG)]


def server(variant: str, **env: str) -> dict[str, Any]:
    """The param fields of a variant of the test server in tests/catalog.toml, with the values it
    takes from the request (`server("failing", FAIL_INSTANCES="0")`)."""
    return {"image": f"{SERVER}-{variant}", "env": env}


def param(image: str = SERVER, **fields: Any) -> dict[str, Any]:
    return {
        "city": "sz",
        "platform": "linux",
        "ports": HTTP,
        "image": image,
        "worker_version": "v1",
        **fields,
    }


def const_broker(
    user: str, name: str, num: int, image: str = SERVER, env: dict[str, str] | None = None, **fields: Any
) -> dict[str, Any]:
    return {
        "user": user,
        "name": name,
        "strategy": {"type": "const", "num": num},
        "param": param(image, **({"env": env} if env else {})),
        **fields,
    }


def marked(prefix: str) -> dict[str, int]:
    """Live processes launched in this test's namespace: marker -> pid."""
    return procfs.marked_processes(f"{prefix}/")


def kill_marked(prefix: str) -> list[str]:
    """SIGKILL every process launched in this namespace that is still alive; their markers."""
    left = marked(prefix)
    for pid in left.values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(left)


def marked_pids(prefix: str) -> list[tuple[str, int]]:
    """Every live process launched in this namespace as (marker, pid), duplicates included."""
    wanted = f"{procfs.MARKER}={prefix}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(wanted) and procfs.is_running(
                int(entry.name), procfs.start_time(int(entry.name)) or -1
            ):
                found.append((item.split(b"=", 1)[1].decode(), int(entry.name)))
    return sorted(found)


async def tracked_pids(redis, prefix: str) -> list[tuple[str, int]]:
    """Every process the broker has recorded, as (marker, pid)."""
    table = ProcessTable(redis, prefix)
    found = []
    start = f"{table.base}:proc:"
    async for key in redis.scan_iter(match=f"{start}*"):
        user, resource_id = key.decode().removeprefix(start).split(":", 1)
        for index, slot in (await table.load(user, resource_id)).items():
            found.append((f"{prefix}/{user}/{resource_id}/{index}", slot.pid))
    return sorted(found)


async def all_tracked_once(redis, prefix: str) -> list[tuple[str, int]]:
    """The launched processes, checked: what runs is what the broker recorded (no orphan), and
    no instance runs twice."""
    running, tracked = marked_pids(prefix), await tracked_pids(redis, prefix)
    assert running == tracked, (running, tracked)
    assert len({marker for marker, _ in running}) == len(running)
    return running
