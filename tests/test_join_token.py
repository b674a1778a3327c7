"""Joining a host with a one-time token (issue 28 item 5), against a real `berth up` (identities and
TLS on): the token brings the host in as its own node's agent, works once, and a used, expired,
unknown or forged one is refused saying which; removing the host cuts it off at once."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import msgpack
import nats
import pytest

from tests.agent_hosts import fake_host
from tests.cli_helpers import BERTH, ROOT, berth_up, client_options

pytestmark = pytest.mark.slow

TTL = 2.0


def user(state: Path, *args: str) -> str:
    done = subprocess.run([*BERTH, "user", "--state", str(state), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def token_of(printed: str) -> str:
    return re.search(r"--token (\S+)", printed).group(1)


def agent(tmp_path: Path, url: str, token: str, *extra: str) -> subprocess.Popen:
    """`berth agent --join` in its own folder (where it keeps the bundle it fetched)."""
    return subprocess.Popen(
        [*BERTH, "agent", "--join", url, "--token", token, "--root", str(fake_host(tmp_path / "host", cpus=2)),
         "--no-cgroups", "--heartbeat", "0.5", "--ttl", str(TTL), *extra],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)


def refused_join(tmp_path: Path, url: str, token: str) -> str:
    proc = agent(tmp_path, url, token)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    return err


async def status(options: dict, node: str) -> str | None:
    nc = await nats.connect(**options)
    try:
        try:
            msg = await nc.request("berth.resource.list-nodes", msgpack.packb({"nodenames": [node]}), timeout=5)
        except nats.errors.NoRespondersError:  # the allocation worker is starting
            return None
        nodes = msgpack.unpackb(msg.data)["nodes"]
        return nodes[0]["status"] if nodes else None
    finally:
        await nc.close()


async def until(options: dict, node: str, wanted: str, timeout: float, host: subprocess.Popen | None = None) -> None:
    """Until `node`'s status is `wanted`; a failure says what the host's agent said if it ended."""
    deadline = time.monotonic() + timeout
    while (seen := await status(options, node)) != wanted:
        ended = host is not None and host.poll() is not None
        assert time.monotonic() < deadline and not ended, (seen, host.communicate() if ended else "")
        await asyncio.sleep(0.2)


def test_a_token_joins_a_host_once_and_every_other_token_is_refused_saying_why(tmp_path):
    state = tmp_path / "control"
    with berth_up(state, env={"BERTH_NODE": "control"}) as (printed, _):
        url, options = printed["NATS_URL"], client_options(printed)
        issued = user(state, "join-token", "host-j", "--ttl", "60")
        assert "a new agent identity of node host-j" in issued
        token = token_of(issued)
        host = tmp_path / "host-j"
        host.mkdir()
        joined = agent(host, url, token)
        try:
            asyncio.run(until(options, "host-j", "up", 30, joined))
            bundle = host / ".berth" / "agent" / "host-j.bundle"
            assert oct(bundle.stat().st_mode & 0o777) == "0o600"

            again = tmp_path / "again"
            again.mkdir()
            assert "was used already" in refused_join(again, url, token)
            assert "unknown" in refused_join(again, url, "deadbeef.nothing")
            second = token_of(user(state, "join-token", "host-j", "--ttl", "60"))
            # its id with another secret: refused, and the token is not used up by it
            assert "unknown (or its secret wrong)" in refused_join(again, url, second.split(".")[0] + ".wrong")
            short = token_of(user(state, "join-token", "host-j", "--ttl", "0.2"))
            time.sleep(0.5)
            assert "expired" in refused_join(again, url, short)

            # a token whose id alone was tried is still good for its holder
            other = tmp_path / "other"
            other.mkdir()
            second_host = agent(other, url, second, "--state", str(other / "state"))
            try:
                out = second_host.stdout.readline()
                assert "joined as node host-j's agent" in out, out
            finally:
                os.killpg(second_host.pid, signal.SIGTERM)
                second_host.wait(30)

            user(state, "remove", "host-j")  # the host leaves: its identity is revoked at once
            asyncio.run(until(options, "host-j", "down", TTL + 5))
        finally:
            os.killpg(joined.pid, signal.SIGTERM)
            joined.wait(30)


async def test_a_joining_host_waits_for_a_join_service_that_is_starting_and_then_says_none_answered(nc, prefix):
    """A fleet boots all at once: a host may ask before `berth up` serves joins. It asks again
    until one answers, and past its wait says that none did (not a bare NoRespondersError)."""
    from berth import join

    subject = f"{prefix}.join.redeem"
    asking = asyncio.create_task(join._redeem(nc, subject, b"{}", wait=10))
    await asyncio.sleep(1.5)  # asked at least once with nobody there
    assert not asking.done()
    async def answer(msg) -> None:
        await msg.respond(b"answered")

    sub = await nc.subscribe(subject, cb=answer)
    try:
        assert (await asyncio.wait_for(asking, 15)).data == b"answered"
    finally:
        await sub.unsubscribe()
    with pytest.raises(join.TokenRefused, match="no join service answered .* within 0.5 s"):
        await join._redeem(nc, subject, b"{}", wait=0.5)
