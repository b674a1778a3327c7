"""Helpers shared by the agent tests (the fixtures are in tests/agent_fixtures.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.agent import InstanceInfo
from services.agent.cgroups import CgroupRoot

HEARTBEAT = 0.2  # seconds: agents in tests beat often, so that a lapse is seen soon
TTL = 0.8


def start_request(instance: str, image: str = "http-server", **fields: Any) -> dict[str, Any]:
    """An `agent.<node>.start` payload for the test server of tests/catalog.toml."""
    return {"instance": instance, "param": {"image": image, "ports": {"http": "http"}}, **fields}


def ready(info: dict | InstanceInfo) -> bool:
    state = info["state"] if isinstance(info, dict) else info.state
    return state == "ready"


async def remove_parent_cgroup(root: CgroupRoot) -> list[str]:
    """Remove a test's parent cgroup from every hierarchy; the instances' cgroups found left in it
    (an agent should have removed each with its instance)."""
    root.mode()  # finds the hierarchies
    left = sorted({f"/{root.parent}/{node.name}/{path.name}"
                   for node in _children(root, root.parent) for path in node.iterdir() if path.is_dir()})
    for path in left:
        await root.remove(path)
    for node in _children(root, root.parent):
        node.rmdir()
    for hierarchy in root.hierarchies.values():
        if Path(hierarchy, root.parent).is_dir():
            Path(hierarchy, root.parent).rmdir()
    return left


def _children(root: CgroupRoot, path: str) -> list[Path]:
    """The child cgroups of `path` in every hierarchy of `root`."""
    found = []
    for hierarchy in root.hierarchies.values():
        top = Path(hierarchy, path)
        found += [child for child in top.iterdir() if child.is_dir()] if top.is_dir() else []
    return found
