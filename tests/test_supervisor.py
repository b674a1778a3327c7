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
from schemas.errors import NoResponders
from tests.bus_helpers import eventually
from tests.echo_service import Served

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


async def _instances(nc, name: str, ready, timeout: float = 20) -> set[str]:
    """The instance ids that answer $SRV.PING once `ready(ids)` holds (polled, with a deadline)."""
    found: set[str] = set()

    async def check():
        nonlocal found
        found = {p.id for p in await discovery.ping(nc, name)}
        return ready(found)

    await eventually(check, timeout=timeout, interval=0.2)
    return found


async def test_crashed_worker_is_restarted_and_sigterm_stops_all(
    nats_url, redis_url, prefix, nc, client, redis
):
    script = textwrap.dedent(f"""
        from berth.supervisor import Supervisor, worker_argv
        supervisor = Supervisor(backoff=0.2)
        for i in range(2):
            supervisor.add(f"echo[{{i}}]", worker_argv("tests.echo_service",
                ["--nats", "{nats_url}", "--redis", "{redis_url}", "--prefix", "{prefix}", "--memory-stream"]))
        raise SystemExit(supervisor.run())
    """)
    name = f"{prefix}-echo"
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        first = await _instances(nc, name, lambda ids: len(ids) == 2)

        victim = await client.request("echo.whoami", {}, Served)
        os.kill(victim.pid, signal.SIGKILL)
        # The survivor, and a new instance in place of the killed one.
        after = await _instances(nc, name, lambda ids: len(ids) == 2 and victim.instance not in ids)
        assert after & first == first - {victim.instance}

        pids = {(await client.request("echo.whoami", {}, Served)).pid for _ in range(20)}
        gate = f"{prefix}:echo:gate:stop"
        hold = {"gate": "stop"}
        in_flight = [
            asyncio.create_task(client.request("echo.hold", hold, Served, timeout=30)) for _ in range(4)
        ]
        for _ in range(4):  # all four are in the workers' handlers
            assert await redis.blpop([f"{gate}:arrived"], timeout=10) is not None
        supervisor.send_signal(signal.SIGTERM)

        async def draining():  # both workers stopped taking requests: no endpoint is subscribed
            try:
                await client.request("echo.whoami", {}, Served, timeout=1)
            except NoResponders:
                return True
            return False

        await eventually(draining, timeout=20)
        assert not any(call.done() for call in in_flight)
        await redis.rpush(f"{gate}:open", *["go"] * 4)
        assert len(await asyncio.gather(*in_flight)) == 4  # drained, not dropped
        assert await asyncio.to_thread(supervisor.wait, 30) == 0
        assert not any(_alive(pid) for pid in pids)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
