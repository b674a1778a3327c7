"""The services berth knows, by CLI name, and the worker module that runs each."""

from __future__ import annotations

import importlib.util

SERVICES: dict[str, str] = {
    "allocation": "services.allocation.worker",
    "broker": "services.broker.worker",
    "metrics": "services.metrics.worker",
    "agent": "services.agent.worker",
}


def available() -> dict[str, str]:
    """The services whose worker module exists in this installation (in start order)."""
    found = {}
    for name, module in SERVICES.items():
        try:
            if importlib.util.find_spec(module) is not None:
                found[name] = module
        except ModuleNotFoundError:
            pass
    return found
