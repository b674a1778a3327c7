"""`berth worker`'s supervisor: N processes, a crashed one is restarted, SIGTERM drains all."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from bus import discovery
from tests.echo_service import Served

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


async def _instances(nc, name: str, want: int, timeout: float = 20) -> set[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = {p.id for p in await discovery.ping(nc, name)}
        if len(found) == want or loop.time() > deadline:
            return found
        await asyncio.sleep(0.2)


async def test_crashed_worker_is_restarted_and_sigterm_stops_all(nats_url, redis_url, prefix, nc, client):
    script = textwrap.dedent(f"""
        from services.supervisor import Supervisor, worker_argv
        supervisor = Supervisor(backoff=0.2)
        for i in range(2):
            supervisor.add(f"echo[{{i}}]", worker_argv("tests.echo_service",
                ["--nats", "{nats_url}", "--redis", "{redis_url}", "--prefix", "{prefix}", "--memory-stream"]))
        raise SystemExit(supervisor.run())
    """)
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        first = await _instances(nc, f"{prefix}-echo", 2)
        assert len(first) == 2

        victim = await client.request("echo.whoami", {}, Served)
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        after = await _instances(nc, f"{prefix}-echo", 2)
        assert len(after) == 2 and victim.instance not in after and after & first

        pids = {(await client.request("echo.whoami", {}, Served)).pid for _ in range(20)}
        in_flight = [asyncio.create_task(client.request("echo.sleep", {"seconds": 1}, Served)) for _ in range(4)]
        await asyncio.sleep(0.3)
        supervisor.send_signal(signal.SIGTERM)
        assert len(await asyncio.gather(*in_flight)) == 4  # drained, not dropped
        assert await asyncio.to_thread(supervisor.wait, 30) == 0
        assert not any(_alive(pid) for pid in pids)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
