"""Contract tests: DESIGN.md §2 and §8, line by line, as a client written from the contract sees them.

These tests never use berth's own Structs, codec or client: requests are plain `msgpack.packb` maps
sent with nats-py, replies are decoded with `msgpack.unpackb`, and errors are read from the raw
headers and body. A test here fails when the wire changes, whatever our code thinks the wire is.

Each module talks to real worker processes (`python -m bus.runner ...`) started once for the
module in a namespace of its own; tests keep apart by using their own node, user and resource names.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import pytest_asyncio

from tests.bus_helpers import EventLog
from tests.conftest import clean_namespace, new_prefix
from tests.worker_helpers import spawning

ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"

_names = itertools.count()


def unique(stem: str) -> str:
    """A name no other test of the session uses (node names, users, resource ids)."""
    return f"{stem}-{next(_names)}"


@dataclass
class WireReply:
    """A reply as a contract client reads it: the raw headers and the unpacked body."""

    headers: dict[str, str]
    body: Any
    data: bytes

    @property
    def ok(self) -> bool:
        return ERROR_CODE_HEADER not in self.headers

    @property
    def status(self) -> int | None:
        return int(self.headers[ERROR_CODE_HEADER]) if not self.ok else None

    @property
    def error(self) -> dict[str, Any]:
        assert not self.ok, f"expected an error reply, got {self.body!r}"
        return self.body["error"]

    @property
    def code(self) -> str:
        return self.error["code"]

    @property
    def details(self) -> dict[str, Any]:
        return self.error["details"]

    def expect_ok(self) -> Any:
        assert self.ok, f"expected success, got {self.status} {self.body!r}"
        return self.body


class Wire:
    """Plain nats-py + msgpack requests under one namespace's prefix."""

    def __init__(self, nc, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix

    def subject(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    async def request(self, suffix: str, payload: Any = None, *, timeout: float = 10.0) -> WireReply:
        """`payload` is a map (packed with msgpack), or bytes sent as they are."""
        data = payload if isinstance(payload, bytes) else msgpack.packb({} if payload is None else payload)
        msg = await self.nc.request(self.subject(suffix), data, timeout=timeout)
        return WireReply(dict(msg.headers or {}), msgpack.unpackb(msg.data, strict_map_key=False), msg.data)

    async def ok(self, suffix: str, payload: Any = None, *, timeout: float = 10.0) -> Any:
        return (await self.request(suffix, payload, timeout=timeout)).expect_ok()

    async def capture(self, pattern: str) -> EventLog:
        """Collect the events on `<prefix>.events.<pattern>` from now on."""
        return await EventLog.open(self.nc, self.prefix, pattern)


CLIENT_PROCESS = """
import asyncio, json, sys
import nats

async def main(url, subject, payload):
    nc = await nats.connect(url)
    print("connected", flush=True)
    sys.stdin.readline()  # wait for "go", so that every process sends at once
    msg = await nc.request(subject, bytes.fromhex(payload), timeout=20)
    print(json.dumps({"headers": dict(msg.headers or {}), "data": msg.data.hex()}), flush=True)
    await nc.close()

asyncio.run(main(*sys.argv[1:]))
"""


async def send_from_processes(nats_url: str, subject: str, data: bytes, count: int = 2) -> list[WireReply]:
    """Send one request from `count` separate OS processes at the same moment; their replies."""
    argv = [sys.executable, "-c", CLIENT_PROCESS, nats_url, subject, data.hex()]
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        for proc in procs:
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "connected"
        for proc in procs:  # every one is connected and waiting: release them together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [await asyncio.to_thread(proc.communicate, timeout=30) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    replies = [json.loads(out) for out, _ in outputs]
    return [WireReply(r["headers"], msgpack.unpackb(bytes.fromhex(r["data"])), bytes.fromhex(r["data"])) for r in replies]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def namespace(nc, redis):
    """One namespace (subject and key prefix) for a whole contract module."""
    name = new_prefix()
    yield name
    await clean_namespace(nc, redis, name)


@pytest.fixture(scope="module")
def module_workers(nats_url, redis_url, namespace):
    """Start worker processes in the module's namespace; all are stopped after the module."""
    with spawning(nats_url, redis_url, namespace) as spawn:
        yield spawn


@pytest.fixture(scope="module")
def wire(nc, namespace) -> Wire:
    return Wire(nc, namespace)
