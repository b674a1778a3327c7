"""Worker processes for the tests: `python -m bus.runner <module>` in a test's namespace.

`spawning` gives the one way to start them for a scope and stop them at its end: the `spawn_worker`
fixture (tests/conftest.py, one test) and `module_workers` (tests/contract/conftest.py, one module)
are made with it. Tests that manage the processes themselves (clusters, faults, namespaced hosts)
call `start_worker` and `stop_workers` directly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """A worker process started with `python -m bus.runner`."""

    def __init__(self, proc: subprocess.Popen, ready_line: str) -> None:
        self.proc = proc
        self.ready_line = ready_line

    @property
    def instance_id(self) -> str:
        return self.ready_line.split()[2]  # "ready <name> <id>", then "metrics=<url>" with --metrics-port

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 15) -> int:
        return self.proc.wait(timeout)


def start_worker(
    module: str, nats_url: str, redis_url: str, prefix: str, *args: str, env: dict[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> Worker:
    """Start `python -m bus.runner <module>` and wait for its "ready" line. `wrap` runs it through
    another command (`wrap=["ip", "netns", "exec", name]`: inside a network namespace)."""
    argv = [
        *wrap, sys.executable, "-m", "bus.runner", module,
        "--nats", nats_url, "--redis", redis_url, "--prefix", prefix, "--memory-stream", *args,
    ]
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        through = f" (through {' '.join(wrap)})" if wrap else ""
        raise RuntimeError(f"worker {module}{through} did not start (exit {proc.wait()}): {line!r}")
    return Worker(proc, line.strip())


def stop_workers(workers: list[Worker]) -> None:
    """SIGTERM (drain) every worker, then wait; one that does not exit in 15 s is killed."""
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


@contextmanager
def spawning(nats_url: str, redis_url: str, prefix: str) -> Iterator[Callable[..., Worker]]:
    """`spawn(module, *args, env=...)` starts a worker in `prefix`'s namespace; every one it started
    is stopped (`stop_workers`) when the block ends."""
    workers: list[Worker] = []

    def spawn(module: str, *args: str, env: dict[str, str] | None = None) -> Worker:
        workers.append(start_worker(module, nats_url, redis_url, prefix, *args, env=env))
        return workers[-1]

    try:
        yield spawn
    finally:
        stop_workers(workers)
