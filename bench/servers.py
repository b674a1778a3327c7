"""The servers a bench script talks to: those of `--nats` / `--redis`, or a nats-server and a
redis-server of its own on loopback (Redis without persistence), stopped when the run ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from berth.servers import ServerProcess, start_nats, start_redis
from services.processes import procfs


@contextlib.contextmanager
def given_or_started(args, *, nats_settings: str = "") -> Iterator[list[ServerProcess]]:
    """Set `args.nats` and `args.redis` to servers to use; yield those started here (none when both
    were given). `nats_settings`: nats-server configuration lines for a server started here."""
    if args.nats and args.redis:
        yield []
        return
    state = Path(tempfile.mkdtemp(prefix="berth-bench-"))
    config = None
    if nats_settings:
        config = state / "nats.conf"
        config.write_text(nats_settings)
    servers = [start_nats(state / "nats", config=config)]
    try:
        servers.append(start_redis(state / "redis", appendonly=False))
        args.nats, args.redis = servers[0].url, servers[1].url
        yield servers
    finally:
        for server in servers:
            server.stop()


def stop_workers(procs: list[subprocess.Popen], prefix: str) -> None:
    """SIGTERM the workers (a drain), kill one that does not exit in 15 s, then kill what they
    launched in `prefix`'s namespace and left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in procfs.marked_processes(f"{prefix}/").values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone meanwhile
