"""Keeping worker processes running: start them, restart a crashed one, stop all on a signal.

Used by `berth worker` (N processes of one service) and `berth up` (one process per service).
A child that exits while we are not stopping is restarted after a short back-off; SIGTERM or
SIGINT sends SIGTERM to every child (they drain), waits, and kills what is left after the grace.
Children added with `client=True` (`berth up`'s dashboard, a client of the others) are stopped
first, so that they do not ask services that are stopping (and log that nobody answered).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("berth.supervisor")


@dataclass
class Child:
    label: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    client: bool = False  # stopped before the others

    def start(self) -> None:
        # Each child gets its own session so that a terminal's Ctrl-C reaches only the supervisor,
        # which then stops the children in order (drain first, kill after the grace period).
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        log.info("started %s (pid %d)", self.label, self.proc.pid)


@dataclass
class Supervisor:
    children: list[Child] = field(default_factory=list)
    grace: float = 15.0
    backoff: float = 1.0
    _stopping: bool = False

    def add(
        self, label: str, argv: list[str], env: dict[str, str] | None = None, *, client: bool = False
    ) -> None:
        self.children.append(Child(label, argv, env, client=client))

    def stop(self, *_: object) -> None:
        self._stopping = True

    def run(self) -> int:
        """Run until signalled; returns 0 after a clean stop."""
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for child in self.children:
                child.start()
            while not self._stopping:
                self._restart_crashed()
                time.sleep(0.2)
            return self._stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _restart_crashed(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            if child.next_start == 0.0:
                child.restarts += 1
                # Back off up to 10 s so a child that cannot start does not spin.
                child.next_start = now + min(10.0, self.backoff * child.restarts)
                log.warning("%s exited with %s; restarting", child.label, child.proc.returncode)
            elif now >= child.next_start:
                child.next_start = 0.0
                child.start()

    def _stop_all(self) -> int:
        # the clients first, with a short grace of their own (they have nothing to drain)
        clients_grace = min(5.0, self.grace)
        self._stop([child for child in self.children if child.client], time.monotonic() + clients_grace)
        self._stop([child for child in self.children if not child.client], time.monotonic() + self.grace)
        return 0

    def _stop(self, children: list[Child], deadline: float) -> None:
        running = [child.proc for child in children if child.proc is not None and child.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("pid %d did not drain within %.0f s; killing it", proc.pid, self.grace)
                proc.kill()
                proc.wait()


def worker_argv(module: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "bus.runner", module, *extra]
