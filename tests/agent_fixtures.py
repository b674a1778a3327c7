"""Fixtures of the agent tests (a test module loads them with `pytest_plugins`).

`start_agent` runs a `berth agent` in this process, on a fake host tree of the shape asked
(tests/agent_hosts.py) or on this machine (`root="/"`); `spawn_agent` runs one as a process.
Each agent has a state folder of its own; every test ends with no process of its namespace alive
(`agent_processes` kills any left behind and fails the test that left it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from services.agent.config import AgentServiceConfig
from services.agent.worker import STREAM, make_agent
from services.metrics.config import MetricsServiceConfig
from tests.agent_helpers import HEARTBEAT, TTL
from tests.agent_hosts import fake_host
from tests.broker_helpers import CATALOG, kill_marked


@pytest.fixture
def agent_processes(prefix):
    """Fails a test that leaves an instance process alive (after killing it)."""
    yield
    left = kill_marked(prefix)
    assert not left, f"processes left behind: {left}"


def host_root(tmp_path: Path, node: str, root: str | None, host: dict[str, Any]) -> str:
    """`root` as given ("/": this machine), else a fake host tree of the shape `host` asks."""
    return root if root is not None else str(fake_host(tmp_path / f"{node}-host", **host))


@pytest_asyncio.fixture
async def start_agent(serve, nc, events, prefix, tmp_path, agent_processes):
    """`await start_agent("n1", cpus=4, numa_nodes=2, labels={...})`: an agent in this process.
    Keywords of `fake_host` shape its host; others are `AgentServiceConfig` fields. Closed at the
    end, stopping its instances."""
    agents = []

    async def start(node: str, *, root: str | None = None, **options: Any):
        host = {k: options.pop(k) for k in list(options) if k in fake_host.__kwdefaults__}
        config = AgentServiceConfig(
            metrics=MetricsServiceConfig(node=node, root=host_root(tmp_path, node, root, host)),
            state=str(tmp_path / f"{node}-state"), catalog=str(CATALOG), heartbeat=HEARTBEAT, ttl=TTL,
            stop_grace=1.0, cgroups=False, stop_on_exit=True, **options,
        )
        await events.ensure_stream(STREAM, memory=True)
        service, agent = make_agent(config, nc=nc, events=events, prefix=prefix)
        await agent.open()
        await serve(service)
        await agent.come_up()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.close()


@pytest.fixture
def spawn_agent(spawn_worker, tmp_path, agent_processes):
    """`spawn_agent("n1", "--label", "city=sz", cpus=8)`: a `berth agent` process on a fake host
    (or `root="/"`), with its own state folder (`state=` to reuse one: a restarted agent). On a fake
    host it makes no cgroups: their CPUs are not this machine's."""

    def spawn(node: str, *args: str, root: str | None = None, state: Path | None = None, **host: Any):
        fake = ["--no-cgroups"] if root is None else []
        return spawn_worker(
            "services.agent.worker", "--node", node, "--root", host_root(tmp_path, node, root, host), *fake,
            "--state", str(state or tmp_path / f"{node}-state"), "--catalog", str(CATALOG),
            "--heartbeat", str(HEARTBEAT), "--ttl", str(TTL), "--stop-grace", "1", "--interval", "1", *args,
        )

    return spawn
