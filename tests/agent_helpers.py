"""Helpers shared by the agent tests (the fixtures are in tests/agent_fixtures.py)."""

from __future__ import annotations

from typing import Any

from services.agent.messages import InstanceInfo

HEARTBEAT = 0.2  # seconds: agents in tests beat often, so that a lapse is seen soon
TTL = 0.8


def start_request(instance: str, image: str = "http-server", **fields: Any) -> dict[str, Any]:
    """An `agent.<node>.start` payload for the test server of tests/catalog.toml."""
    return {"instance": instance, "param": {"image": image, "ports": {"http": "http"}}, **fields}


def ready(info: dict | InstanceInfo) -> bool:
    state = info["state"] if isinstance(info, dict) else info.state
    return state == "ready"
