"""What the kernel says about processes, read from /proc, and stopping a process group.

A pid alone does not identify a process across a broker or agent restart (pids are reused), so processes
are recorded with their start time (field 22 of /proc/<pid>/stat, in clock ticks since boot): a
pid whose start time differs is somebody else.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

PROC = Path("/proc")
MARKER = "BERTH_INSTANCE"
# Set by `berth up` in its workers' environment, so inherited by every process the broker launches:
# the processes of one deployment, which `berth up` stops when it stops.
DEPLOYMENT = "BERTH_DEPLOYMENT"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after it.
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 overall; fields[0] is field 3


def is_running(pid: int, started: int) -> bool:
    """The process that started at `started` still runs (a zombie or a reused pid does not)."""
    fields = _stat_fields(pid)
    return bool(fields) and int(fields[19]) == started and fields[0] not in ("Z", "X")


def marked_processes(prefix: str) -> dict[str, int]:
    """Live processes whose environment has `BERTH_INSTANCE=<value starting with prefix>`: value -> pid.

    A launch records its intent before it starts a process and the pid after; if the broker (or
    agent) dies in between, this is how its successor finds the process instead of starting a duplicate.
    """
    wanted = f"{MARKER}={prefix}".encode()
    found: dict[str, int] = {}
    for pid, environ in _environs():
        for item in environ:
            if item.startswith(wanted):
                if _alive(pid):
                    found[item.split(b"=", 1)[1].decode()] = pid
                break
    return found


def processes_with(variable: str, value: str) -> list[int]:
    """Live processes whose environment has `variable=value` exactly."""
    wanted = f"{variable}={value}".encode()
    return [pid for pid, environ in _environs() if wanted in environ and _alive(pid)]


def _alive(pid: int) -> bool:
    return (started := start_time(pid)) is not None and is_running(pid, started)


def _environs():
    """(pid, environment items) of every process whose environment can be read."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        yield int(entry.name), environ


async def stop_group(pid: int, started: int, grace: float, poll: float = 0.02) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL what is left after `grace` seconds.

    The group is only signalled if its leader is ours (same start time) or gone: the kernel does
    not hand out a pid still used as a group id, so a reused pid means our group no longer exists.
    Once the leader has exited, stragglers in its group are killed at once: nobody waits for them.
    """
    current = start_time(pid)
    if current is not None and current != started:
        return
    if not _signal_group(pid, signal.SIGTERM):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while is_running(pid, started) and loop.time() < deadline:
        await asyncio.sleep(poll)
    _signal_group(pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
