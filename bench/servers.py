"""The servers a bench script talks to: those of `--nats` / `--redis`, or a nats-server and a
redis-server of its own on loopback (Redis without persistence), stopped when the run ends."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator

from services.servers import ServerProcess, start_nats, start_redis


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
