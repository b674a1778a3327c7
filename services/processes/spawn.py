"""Starting one process of a catalog entry: the one way the `process` operator and the agent do it.

The process runs the entry's argv directly (never a shell), with the environment `catalog.py` builds
from nothing plus the operator's variables (`PORT_<NAME>`, `VOLUME_<NAME>`, the marker
`BERTH_INSTANCE` that finds it again after a restart, and the caller's extra ones), in a session and
process group of its own (so it outlives its starter, and stopping the group stops its children),
with no terminal and no inherited stdin/stdout/stderr, as the entry's OS user.

`pre_exec` runs in the child between fork and exec: what must hold before the process runs a single
instruction of its own (its CPU affinity, or joining its cgroups), inherited by every child it
starts. It runs before the child takes the entry's user: joining a cgroup needs the starter's rights.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from collections.abc import Callable, Mapping
from typing import IO

from services.processes.catalog import Catalog, Entry, ProcessParam, variable
from services.processes.procfs import MARKER


class SpawnError(Exception):
    """The process could not be started (the program is missing, the user cannot run it...)."""


def operator_variables(
    param: ProcessParam, ports: Mapping[str, int], marker: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables the operator gives a process: its ports, its volumes' host folders, its marker,
    then `extra` (`BERTH_INSTANCE_INDEX`, `BERTH_RESOURCE_ID`...)."""
    return {
        **{variable("PORT", name): str(port) for name, port in ports.items()},
        **{variable("VOLUME", name): volume.host_dir for name, volume in param.volumes.items()},
        MARKER: marker,
        **(extra or {}),
    }


def identity(entry: Entry) -> dict:
    """Popen's arguments that run `entry` as its OS user: that user's group (or the entry's), and
    none of the starter's supplementary groups (root's would stay otherwise)."""
    if entry.user is None:
        return {}
    account = pwd.getpwnam(entry.user)
    return {"user": account.pw_uid, "group": entry.group or account.pw_gid, "extra_groups": []}


def spawn(
    catalog: Catalog,
    param: ProcessParam,
    *,
    marker: str,
    ports: Mapping[str, int],
    extra: Mapping[str, str] | None = None,
    cwd: str | None = None,
    log: int | IO | None = None,
    pre_exec: Callable[[], None] | None = None,
) -> subprocess.Popen:
    """Start the process of `param` (already checked with `check_command`). `log` takes its stdout and
    stderr (default: /dev/null). Blocks until the child has exec'ed: call it in a thread from a loop."""
    operator = operator_variables(param, ports, marker, extra)
    argv, env, entry = catalog.command(param, operator)
    preexec_fn, user = _child_setup(entry, pre_exec)
    output = subprocess.DEVNULL if log is None else log
    try:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
            preexec_fn=preexec_fn,  # noqa: PLW1509 -- kept trivial: a few syscalls, no locks
            **user,
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise SpawnError(f"cannot start {argv[0]!r}: {error}") from None


def _child_setup(entry: Entry, pre_exec: Callable[[], None] | None) -> tuple[Callable[[], None] | None, dict]:
    """The child's pre-exec function and Popen's identity arguments. Popen changes the user before
    it calls `preexec_fn`, so with a pre-exec step the child changes it itself, after the step (as
    Popen would: no supplementary groups, then the group, then the user)."""
    if pre_exec is None or entry.user is None:
        return pre_exec, identity(entry)
    user = identity(entry)
    uid = user["user"]
    gid = user["group"] if isinstance(user["group"], int) else grp.getgrnam(user["group"]).gr_gid

    def setup() -> None:
        pre_exec()
        os.setgroups([])
        os.setregid(gid, gid)
        os.setreuid(uid, uid)

    return setup, {}
