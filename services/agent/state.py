"""The agent's state folder: what it runs, on disk, so that a restarted agent adopts it.

    <state_dir>/lock                     flock'ed by the agent that uses the folder (one at a time)
    <state_dir>/instances/<name>.json    one `Record` per instance (<name>: `safe_name` of its id)

A record is written before the agent acts on it (the intent before the process is spawned), each
time atomically (a temporary file, fsync, rename, fsync of the folder): after a crash or a power
cut a record is the old one or the new one, never half of each.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
from pathlib import Path

import msgspec

from schemas.agent import InstanceStateName, StartInstance

log = logging.getLogger(__name__)

SUFFIX = ".json"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class StateLocked(Exception):
    """Another agent uses this state folder: two agents would both adopt (and stop) its processes."""


class Record(msgspec.Struct):
    """One instance as persisted. `pid` 0: only the intent is recorded (the spawn may not have
    happened); `start_time` (clock ticks after boot, /proc/<pid>/stat field 22) tells our process
    from a later one that reuses its pid."""

    spec: StartInstance
    ports: dict[str, int] = {}
    pid: int = 0
    start_time: int = 0
    cgroup: str = ""  # relative to each hierarchy's root; "" for none
    pinning: str = "none"
    state: InstanceStateName = "starting"
    started_at: float = 0.0
    exit_code: int | None = None
    exited_at: float | None = None

    @property
    def instance(self) -> str:
        return self.spec.instance


def safe_name(text: str, limit: int = 100) -> str:
    """A file and cgroup name for `text`: its characters outside [A-Za-z0-9_.-] replaced, cut to
    `limit`, and a hash of the whole text appended, so that two texts never get the same name."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', text)[: limit - len(digest) - 1]}-{digest}"


class StateDir:
    """The records of one agent's instances, and the lock that makes the folder that agent's."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records = self.path / "instances"
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take the folder, or raise `StateLocked` at once (never wait: the other agent runs on)."""
        self.records.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StateLocked(
                f"state folder {self.path} is in use by another agent (pid {holder}): one agent per folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def save(self, record: Record) -> None:
        """Write `record` atomically and durably."""
        target = self._file(record.instance)
        temporary = target.with_name(f"{target.name}.tmp")
        with open(temporary, "wb") as f:
            f.write(msgspec.json.encode(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
        self._sync_folder()

    def delete(self, instance: str) -> None:
        self._file(instance).unlink(missing_ok=True)
        self._sync_folder()

    def load_all(self) -> list[Record]:
        """Every record. A leftover temporary file (a crash mid-write) is dropped: its rename never
        happened, so the record it was replacing is the one that counts. A record that cannot be
        decoded is logged and left where it is, for a person to look at."""
        found = []
        for path in sorted(self.records.iterdir()):
            if path.name.endswith(f"{SUFFIX}.tmp"):
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                found.append(msgspec.json.decode(path.read_bytes(), type=Record))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
                log.error("instance record %s cannot be read, skipped: %s", path, error)
        return found

    def _file(self, instance: str) -> Path:
        return self.records / f"{safe_name(instance)}{SUFFIX}"

    def _sync_folder(self) -> None:
        fd = os.open(self.records, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
