"""The import direction of README "Layout": each rule names who may import what, and a test fails
when an import goes the other way (one anywhere in a module counts, a deferred one in a function too).

    schemas/   the wire contract: imports neither bus/ nor services/
    bus/       the transport and the stores' primitives: imports schemas/, never services/
    services/  shared modules (settings, processes/, accounts, credentials, tls, redis_functions),
               then the service packages (allocation/, broker/, metrics/, agent/), then the entry
               points (cli, commands/, runner, supervisor, servers, registry, dashboard/, and
               `berth up`'s up_lock and up_ready)
    berth/     the product's face (the Python client): imports any of the above, none of them it

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
SERVICE_PACKAGES = ("allocation", "broker", "metrics", "agent")
SHARED = ("services.processes", "berth.accounts", "berth.credentials", "berth.tls",
          "berth.redis_functions")
ENTRY_POINTS = ("berth.cli", "berth.commands", "berth.supervisor", "berth.servers",
                "berth.registry", "berth.dashboard", "berth.up_lock", "berth.up_ready")
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


def _modules() -> dict[str, Path]:
    found = {}
    for top in ("berth", "bus", "schemas", "services"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def imports(module: str) -> set[str]:
    """Every module `module` imports, wherever in it (`from a import b` is `a.b` when b is a module)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
    return found


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" and parts[1] in SERVICE_PACKAGES else None


def test_the_rules_see_every_layer():
    """The walk finds the modules the rules speak of (a rule over nothing would pass for ever)."""
    for module in ("schemas.subjects", "bus.service", "bus.settings", "services.allocation.commands",
                   "schemas.metric_scopes", "services.allocation.plugins.plugin_set", "berth.cli",
                   "berth.client"):
        assert module in MODULES
    assert "bus.service" in imports("services.allocation.commands")
    assert "schemas.allocation" in imports("services.allocation.commands")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, "schemas")))
def test_the_contract_layer_imports_no_other(module):
    assert not {i for i in imports(module) if within(i, "bus", "services")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not within(m, "berth")))
def test_nothing_imports_the_product_face(module):
    """berth/ is the top: the client imports services/, bus/ and schemas/, and none of them it."""
    assert not {i for i in imports(module) if within(i, "berth")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, "bus")))
def test_the_bus_imports_no_service(module):
    assert not {i for i in imports(module) if within(i, "services")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.rsplit(".", 1)[-1] in CONTRACT_MODULES
                                          and service_of(m)))
def test_a_services_command_table_imports_only_the_contract(module):
    assert not {i for i in imports(module) if within(i, "services")}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, *SHARED)))
def test_shared_modules_import_no_service_and_no_entry_point(module):
    services = tuple(f"services.{name}" for name in SERVICE_PACKAGES)
    assert not {i for i in imports(module) if within(i, *services, *ENTRY_POINTS)}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if service_of(m)))
def test_services_import_no_entry_point(module):
    assert not {i for i in imports(module) if within(i, *ENTRY_POINTS)}


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
