"""Helpers shared by the tests of the `berth` command line (tests/test_cli.py, tests/test_up_cluster.py):
the processes it leaves, what `berth up` prints, and its servers, asked as their administrator."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import msgpack
import nats

ROOT = Path(__file__).resolve().parent.parent
BERTH = [sys.executable, "-m", "berth.cli"]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 60) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not seen; got {lines}")


@contextmanager
def berth_up(state: Path, *flags: str, env: dict[str, str] | None = None):
    """`berth up` (no dashboard, no metrics) until it is up: the variables it printed and all it
    printed; stopped with Ctrl-C afterwards, which it must survive cleanly."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_TLS")}, **(env or {})}
    up = subprocess.Popen([*BERTH, "up", "--no-dashboard", "--no-metrics", "--state", str(state), *flags], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        lines = read_until(up, "berth is starting")
        yield printed_variables(lines), "\n".join(lines)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0


def printed_variables(lines: list[str]) -> dict[str, str]:
    """The VARIABLE=value lines `berth up` prints: URLs, the admin's creds file, the CA."""
    return dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_]+=", line))


def redis_admin(state: Path, address: str, *, tls: bool = True):
    """A redis-server `berth up` started, as its administrator (over TLS with the state's CA)."""
    import redis

    password = json.loads((state / "credentials" / "credentials.json").read_text())["redis"]["default"]
    host, port = address.split("://")[-1].split("/")[0].rsplit(":", 1)
    options = {"ssl": True, "ssl_ca_certs": str(state / "tls" / "ca.pem")} if tls else {}
    return redis.Redis(host=host, port=int(port), username="default", password=password, **options)


def memory_policy(state: Path, address: str) -> tuple[int, str]:
    """(maxmemory, maxmemory-policy) of a redis-server `berth up` started, asked as its administrator."""
    with redis_admin(state, address) as admin:
        config = admin.config_get("maxmemory*")
    return int(config["maxmemory"]), config["maxmemory-policy"]


def client_options(printed: dict[str, str]) -> dict:
    """nats.connect options for the admin identity `berth up` printed: its creds file and CA."""
    import ssl

    from bus.connection import read_creds_file

    options = {"servers": printed["NATS_URL"].split(",")}
    if "BERTH_NATS_CREDS" in printed:
        options["user"], options["password"] = read_creds_file(printed["BERTH_NATS_CREDS"])
    if "BERTH_TLS_CA" in printed:
        options["tls"] = ssl.create_default_context(cafile=printed["BERTH_TLS_CA"])
    return options


async def nats_call(nc, subject: str, payload: dict) -> dict:
    msg = await answered(nc, subject, payload)
    assert not (msg.headers or {}).get("Nats-Service-Error-Code"), msgpack.unpackb(msg.data)
    return msgpack.unpackb(msg.data)


async def answered(nc, subject: str, payload: dict, wait: float = 60.0):
    """The reply, once a worker serves the subject (workers start once JetStream has a leader)."""
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await nc.request(subject, msgpack.packb(payload), timeout=5)
        except nats.errors.NoRespondersError:
            assert asyncio.get_running_loop().time() < deadline, f"nobody served {subject}"
            await asyncio.sleep(0.2)
