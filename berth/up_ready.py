"""What `berth up` prints last: once every service it started answers, that it is ready and what to
do next (the commands to try, the dashboard, how to stop).

The workers log as they start, after "berth is starting": the next steps come once they answer
`$SRV.PING` (asked as the dashboard's reader identity, or as given), so that they end the start-up
output instead of scrolling away under it. If some service does not answer within `WAIT_SECONDS`,
they come anyway, naming it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time

from berth.accounts import served
from bus import discovery
from bus.client import BusClient
from bus.connection import connect

WAIT_SECONDS = 90.0
POLL_SECONDS = 0.5


def berth_command(argv0: str | None = None) -> str:
    """How to run `berth` as this one was run: `berth` when that is on the PATH (or when run as
    `python -m ...`), else the path it was run by (`.venv/bin/berth` after `make up`)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if os.path.basename(argv0) != "berth":
        return "berth"
    found = shutil.which("berth")
    return "berth" if found and os.path.exists(argv0) and os.path.samefile(found, argv0) else argv0


def next_steps(*, berth: str, where: str, node: str | None, dashboard: str | None) -> list[str]:
    """The lines after "berth is ready": `where` says from where the commands find the deployment."""
    tries = [(f"{berth} status", "the services, their instances and requests"),
             (f"{berth} nodes", "the nodes and what they hold"),
             (f"{berth} events 'resource.*.*' --since 10m", "the nodes' allocation events so far, then live")]
    width = max(len(command) for command, _ in tries)
    lines = [f"next, from another shell {where}:", *(f"  {command:<{width}}  {what}" for command, what in tries)]
    if node:
        request = ('{"nodenames": ["%s"], "deploy_count": 1, "dry_run": true, '
                   '"workload_resource_request": {"cpumem": {"cpu-request": 1, "memory-request": "1G"}}}' % node)
        lines += [f"  {berth} call resource.allocate '{request}'",
                  f"  {'':<{width}}  where a workload would go on node {node}, this machine "
                  "(dry_run: nothing is held)"]
    if dashboard:
        lines.append(f"  the dashboard: {dashboard}")
    lines.append("  Ctrl-C here stops everything; `berth up` again on this state folder keeps the data")
    return lines


def services_of(prefix: str, started: list[str]) -> list[str]:
    """The micro service names (`<prefix>-<service>`) the started workers serve (an agent is its
    node's metrics service too)."""
    return [f"{prefix}-{name}" for service in started for name in served(service)]


async def _registered(nc, prefix: str, node: str) -> bool:
    """Whether allocation lists `node` (its agent registers it once allocation answers)."""
    client = BusClient(nc, prefix=prefix, timeout=2.0)
    reply: dict = await client.request("resource.list-nodes", {"nodenames": [node]})
    return bool(reply.get("nodes"))


async def missing(url: str, tls_ca: str | None, prefix: str, names: list[str], node: str | None, wait: float,
                  stopping: threading.Event) -> list[str]:
    """What has not answered within `wait` seconds: the services among `names` (`$SRV.PING`), then
    `node` (listed by allocation)."""
    async def quiet(*_) -> None:  # a connection refused or lost while waiting is told by what follows
        return None

    deadline = time.monotonic() + wait
    left, unlisted = list(names), node
    nc = None
    try:
        while (left or unlisted) and not stopping.is_set() and time.monotonic() < deadline:
            try:
                if nc is None or nc.is_closed:
                    nc = await connect(url, name="berth-up", worker=False, tls_ca=tls_ca, error_cb=quiet,
                                       disconnected_cb=quiet, reconnected_cb=quiet)
                answered = {ping.name for ping in await discovery.ping(nc, timeout=1.0)}
                left = [name for name in left if name not in answered]
                if not left and unlisted and await _registered(nc, prefix, unlisted):
                    unlisted = None
            except Exception:  # not up yet: ask again
                pass
            if left or unlisted:
                await asyncio.sleep(POLL_SECONDS)
    finally:
        if nc is not None and not nc.is_closed:
            await nc.close()
    return left + ([f"node {unlisted}"] if unlisted else [])


def announce(url: str, tls_ca: str | None, prefix: str, started: list[str], node: str | None, lines: list[str],
             stopping: threading.Event, wait: float = WAIT_SECONDS) -> threading.Thread:
    """Print "berth is ready" and `lines` once every service of the `started` workers answers, and
    allocation lists the local `node` (in a thread: the supervisor keeps the main one); nothing
    once `stopping` is set."""
    names = services_of(prefix, started)

    def run() -> None:
        left = asyncio.run(missing(url, tls_ca, prefix, names, node, wait, stopping))
        if stopping.is_set():
            return
        ready = ", ".join(service for each in started for service in served(each))
        registered = f"; node {node} is this machine" if node else ""
        head = (f"berth is ready: {ready} answer{registered}" if not left else
                f"berth started, but after {wait:g} s still waits for {', '.join(left)} (see the log above)")
        print("\n".join([head, *lines]), flush=True)

    thread = threading.Thread(target=run, name="berth-up-ready", daemon=True)
    thread.start()
    return thread
