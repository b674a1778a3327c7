"""The services berth knows, by CLI name, and the worker module that runs each."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

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


def contracts(extra_modules: tuple[str, ...] = ()) -> dict[str, ModuleType]:
    """Each installed service's command and event tables (its `commands.py`: `COMMANDS`, `EVENTS`),
    and any other module with such tables by its name: what `berth schema` exports. Importing them
    starts no worker and loads no service's code beyond its messages."""
    names = {name: module.rsplit(".", 1)[0] + ".commands" for name, module in available().items()}
    names.update({module: module for module in extra_modules})
    return {name: importlib.import_module(module) for name, module in names.items()}
