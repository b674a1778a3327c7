"""The import direction of README "Layout" (DESIGN.md §1): each rule names who may import what, and
a test fails when an import goes the other way. Every import counts: one anywhere in a module (a
deferred one in a function too), a relative one (`from .plugin import X`), and a module named by a
string in `importlib.import_module(...)` or `__import__(...)` (of an f-string, the package its
constant head names); a name computed at run time is not seen.

    schemas/   the wire contract: imports none of bus/, services/, berth/
    bus/       the runtime (connection, codec, service, stores' primitives, the settings every
               worker shares, the worker runner): imports schemas/ only
    services/  allocation/, broker/, metrics/, agent/, and processes/ (which broker and agent
               share; it imports no service): nothing else; imports bus/ and schemas/, never berth/
    berth/     the product's face (the Python client, the `berth` CLI and its commands, `berth up`,
               the dashboard): imports any of the above, and none of them imports it

Every message Struct is in schemas/ (`schemas/<service>.py`); a service's table of commands and
events (`services/<service>/commands.py`) imports only schemas/ and bus/, so that `berth schema` and
clients read it without loading a worker. One service uses another only through that table, the
contract in schemas/ and its `config.py`, except the parts named in SHARED_PARTS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("schemas", "bus", "services", "berth")  # bottom to top: each imports only those below it
SERVICE_PACKAGES = ("allocation", "broker", "metrics", "agent")
SHARED = ("services.processes",)  # the services' shared part (DESIGN.md §1): it imports no service
ENTRY_POINT = "berth.cli"  # `berth = "berth.cli:main"`: imported by no module
CONTRACT_MODULES = ("commands",)
# Parts of one service another uses on purpose: the agent reads its host with the metrics
# service's kernel readers, and runs that node's metrics worker in its own process.
SHARED_PARTS = {
    ("agent", "metrics"): ("parsers", "cgroups", "provisioners", "worker"),
}
# The packages whose Redis keys are kept by store modules only; a `worker` module wires the connection.
STORE_KEEPING = ("services.broker", "services.metrics", "services.agent")
# Allocation's calculation core: pure and synchronous, unit-tested without a server (README "Layout").
PURE_ALLOCATION = ("plugins", "placement", "quantity", "records", "refusal", "selection", "view")
IO_MODULES = ("services.allocation.store", "redis", "nats")
IMPORT_FUNCTIONS = ("import_module", "__import__")  # importlib.import_module, or imported by name


def _modules() -> dict[str, Path]:
    found = {}
    for top in LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def imports(module: str) -> set[str]:
    """Every module `module` imports, wherever in it (`from a import b` is `a.b` when b is a module)."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """The modules `source` (module `module`'s text) imports: by `import`, by `from ... import`,
    relative ones resolved against `module`'s package, and those named by a string given to
    `import_module` or `__import__`."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in MODULES else base)
        elif isinstance(node, ast.Call) and _called_name(node.func) in IMPORT_FUNCTIONS and node.args:
            named = _string_head(node.args[0])
            if named and named.startswith("."):  # import_module(".x", __package__)
                level = len(named) - len(named.lstrip("."))
                named = _absolute(named[level:] or None, level, package)
            if named:
                found.add(named)
    return found


def _absolute(name: str | None, level: int, package: str) -> str:
    """`from <level dots><name> import ...` in a module of `package`, as an absolute name."""
    if level == 0:
        return name
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _string_head(arg: ast.expr) -> str | None:
    """A string literal, or of an f-string the dotted name its constant head makes sure of
    (`f"services.{name}.worker"`: `services`)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head.rpartition(".")[0] or None
    return None


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" and parts[1] in SERVICE_PACKAGES else None


def layer_of(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_the_rules_see_every_layer():
    """The walk finds the modules the rules speak of (a rule over nothing would pass for ever)."""
    for module in ("schemas.subjects", "schemas.metric_scopes", "bus.service", "bus.settings", "bus.runner",
                   "services.allocation.commands", "services.allocation.plugins.plugin_set", "services.processes",
                   "berth.cli", "berth.commands.connection", "berth.client", "berth.dashboard.app"):
        assert module in MODULES
    assert "bus.service" in imports("services.allocation.commands")
    assert "schemas.allocation" in imports("services.allocation.commands")


def test_the_rules_see_relative_imports_and_import_module():
    """A relative import is its absolute name, and a string given to import_module is a module
    imported (an f-string: the package its constant head names)."""
    cpumem = "services.allocation.plugins.cpumem"
    assert f"{cpumem}.nodes" in imports(f"{cpumem}.plugin")  # from .nodes import new_node
    assert f"{cpumem}.plugin" in imports(cpumem)  # from .plugin import CpuMemPlugin (an __init__)
    source = """
import importlib
from importlib import import_module
from . import nodes
from .. import kit
from ..interface import Plugin

def load(service):
    importlib.import_module("berth.cli")
    import_module(f"services.{service}.worker")
    import_module(".types", __package__)
    __import__("bus.codec")
"""
    plugins = "services.allocation.plugins"
    assert imports_in(source, f"{cpumem}.plugin") == {
        "importlib", f"{cpumem}.nodes", f"{plugins}.kit", f"{plugins}.interface", "berth.cli", "services",
        f"{cpumem}.types", "bus.codec"}
    assert {f"{cpumem}.nodes", f"{plugins}.kit"} <= imports_in(source, cpumem, is_package=True)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    """berth -> services -> bus -> schemas: no module imports one of a folder above its own (so
    nothing imports berth/, the product's face, and schemas/, the contract, imports no other)."""
    above = LAYERS[layer_of(module) + 1:]
    assert not {i for i in imports(module) if within(i, *above)}


def test_services_holds_the_services_and_their_shared_part_only():
    """DESIGN.md §1: services/ is allocation/, broker/, metrics/, agent/ and processes/, nothing else
    (the CLI, `berth up` and the dashboard are berth/'s; the settings and the runner bus/'s)."""
    top = {path.stem if path.suffix == ".py" else path.name for path in (ROOT / "services").iterdir()
           if path.suffix == ".py" or (path / "__init__.py").is_file()}
    assert top - {"__init__"} == set(SERVICE_PACKAGES) | {name.split(".", 1)[1] for name in SHARED}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.rsplit(".", 1)[-1] in CONTRACT_MODULES
                                          and service_of(m)))
def test_a_services_command_table_imports_only_the_contract(module):
    assert not {i for i in imports(module) if within(i, "services")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, *SHARED)))
def test_the_shared_part_imports_no_service(module):
    assert not {i for i in imports(module) if within(i, *(f"services.{name}" for name in SERVICE_PACKAGES))}


def test_the_entry_point_is_imported_by_no_module():
    """`berth.cli` is the console script's; everything else is imported by it, never the other way."""
    assert not [m for m in MODULES if m != ENTRY_POINT and ENTRY_POINT in imports(m)]


def import_cycle(modules: list[str]) -> list[str]:
    """An import cycle among `modules` (their imports of each other, deferred ones too), [] if none."""
    edges = {m: sorted(i for i in imports(m) if i in modules and i != m) for m in modules}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = 2
        path.pop()
        return []

    for module in modules:
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_the_commands_import_one_way():
    """berth/commands/: `running` imports `connection`, which imports `exits`; no circle (their
    package imports every command, which is no circle of the commands themselves)."""
    commands = [m for m in MODULES if within(m, "berth.commands") and m != "berth.commands"]
    assert "berth.commands.exits" in imports("berth.commands.connection")
    assert import_cycle(commands) == []
    assert import_cycle(["berth.commands.exits", "berth.commands.connection"]) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if service_of(m)))
def test_a_service_uses_another_through_its_contract(module):
    mine = service_of(module)
    wrong = set()
    for target in imports(module):
        theirs = service_of(target)
        if theirs is None or theirs == mine:
            continue
        allowed = CONTRACT_MODULES + ("config",) + SHARED_PARTS.get((mine, theirs), ())
        if not within(target, *(f"services.{theirs}.{part}" for part in allowed)):
            wrong.add(target)
    assert not wrong


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, *(f"services.allocation.{p}"
                                                                               for p in PURE_ALLOCATION))))
def test_allocations_calculation_core_does_no_io(module):
    assert not {i for i in imports(module) if within(i, *IO_MODULES)}


def allocation_reached_from(module: str) -> set[str]:
    """The allocation modules `module` imports, and those they import, and so on."""
    seen, todo = set(), [module]
    while todo:
        for target in imports(todo.pop()):
            if within(target, "services.allocation") and target not in seen and target in MODULES:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, "services.allocation.plugins")))
def test_allocations_plugins_import_nothing_above_them(module):
    """plugins/ is the bottom of allocation: the manager level (placement, view, fleet, commits,
    committer, manager, endpoints...) imports it, never the other way, not even through another
    module. Outside plugins/ it reaches only the neutral values every level shares: `records` (a
    node's record and states, plain values), `errors` (the domain errors, built from schemas/) and
    `quantity` (parsing and saturating sums); and `selection`, which `errors` names in a type hint
    (a node selection, plain values). Each of these imports only schemas/ and bus/, or each other,
    which the transitive walk checks: one of them importing the manager level fails here too."""
    neutral = tuple(f"services.allocation.{name}" for name in ("records", "errors", "quantity", "selection"))
    above = {m for m in allocation_reached_from(module) if not within(m, "services.allocation.plugins", *neutral)}
    assert not above


def test_the_plugins_rule_follows_imports_through_other_modules():
    """The walk above goes past direct imports: plugin_set reaches `selection` only through `errors`."""
    plugin_set = "services.allocation.plugins.plugin_set"
    assert "services.allocation.selection" not in imports(plugin_set)
    assert "services.allocation.selection" in allocation_reached_from(plugin_set)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "bus.codec"))
def test_messagepack_goes_through_the_codec(module):
    """One place encodes and decodes MessagePack (bus/codec.py: typed decoders, the depth check,
    errors that name the field); a module calling msgspec.msgpack itself would bypass them."""
    source = MODULES[module].read_text()
    assert not [call for call in ("msgspec.msgpack.encode", "msgspec.msgpack.decode", "msgspec.msgpack.Decoder",
                                  "msgspec.msgpack.Encoder") if call in source]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if service_of(m) == "allocation"
                                          and m != "services.allocation.store"))
def test_only_allocations_store_talks_to_redis(module):
    assert not {i for i in imports(module) if within(i, "redis", "bus.redis", "bus.cas", "bus.scripts")}


def may_import_redis(module: str) -> bool:
    """A worker (it connects, and hands the connection to the stores) or a store (`store`,
    `process_store`, `notifier_store`...: a module whose last name part ends with `store`)."""
    last = module.rsplit(".", 1)[-1]
    return last == "worker" or last.endswith("store")


def test_the_redis_rule_sees_redis_imports():
    """The rule below sees an import of `redis` (the workers' are), and checks the modules that
    once talked to Redis themselves before their stores were split off."""
    assert "redis.asyncio" in imports("services.broker.worker")
    assert "redis.asyncio" in imports("services.metrics.notifier_store")
    for module in ("services.broker.operators.process", "services.broker.operators.allocation",
                   "services.metrics.notifier", "services.metrics.telemetry"):
        assert within(module, *STORE_KEEPING) and not may_import_redis(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, *STORE_KEEPING)
                                          and not may_import_redis(m)))
def test_only_stores_talk_to_redis_in_the_broker_metrics_and_agent(module):
    """As in allocation: the keys, and how they are read and written, are in store modules; the
    operators, the notifier and the rest use those and never a connection of their own."""
    assert not {i for i in imports(module) if within(i, "redis")}
