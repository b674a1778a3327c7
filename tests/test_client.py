"""`berth.Client` against real servers: how it connects, a method for every command of every table,
error replies as exception families, request ids and retries, events with replay, a metric watch,
and an example that type-checks."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

import berth
from berth import Client
from berth._commands import SUBJECTS
from berth._generate import TARGET, render_module
from berth.commands.connection import write_up_env
from berth.errors import from_bus
from berth.registry import contracts
from bus.codec import decoder, encode
from schemas.allocation import AllocateReply, ListNodesReply, NodeEvent, ReleaseReply
from schemas.errors import BusError
from schemas.metrics import MetricEvent
from services.metrics.config import MetricsServiceConfig
from services.metrics.worker import MetricsWorker

ROOT = Path(__file__).resolve().parent.parent
ONE_CORE = {"cpumem": {"cpu-request": 1, "memory-request": "1G"}}


@pytest.fixture
async def berth_client(nc, prefix):
    """A client in this test's namespace, over the session's connection."""
    async with Client(nc, prefix=prefix, timeout=5.0) as client:
        yield client


@pytest.fixture
async def alloc(serve_allocation, berth_client):
    """An allocation service with nodes n1, n2 (pool a) and n3 (pool b), 4 cores and 8G each."""
    await serve_allocation()
    for node, pool in (("n1", "a"), ("n2", "a"), ("n3", "b")):
        await berth_client.allocation.add_node(nodename=node, resource={"cpumem": {"cpu": 4, "memory": "8G"}},
                                               labels={"pool": pool})
    return berth_client


# -- one method per command ---------------------------------------------------------------------


class Recorder:
    """Stands in for the bus: records what a method sends, answers nothing."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, type, bool]] = []

    def __call__(self, change: bool):
        async def send(subject: str, payload: Any, response: type, **options: Any) -> None:
            self.sent.append((subject, payload, response, change))

        return send


def _resolve(client: Client, path: str):
    target: Any = client
    for name in path.split("."):
        target = getattr(target, name)
    return target


def _table_commands():
    for service, tables in contracts().items():
        for command in tables.COMMANDS:
            yield service, command


@pytest.mark.parametrize("service, command", list(_table_commands()),
                         ids=lambda value: value if isinstance(value, str) else value.subject)
async def test_every_command_of_every_table_has_a_method_that_sends_it(service, command):
    """Each command of each service's table (services/*/commands.py) has a method: named after the
    subject, taking the request's keys (dashes as underscores) and the node of a node-scoped
    subject first, sending to that subject, decoding the reply as the table's response, and
    sending a state change with a request id, retried (`BusClient.change`)."""
    assert command.subject in SUBJECTS, f"no method for {command.subject}: run python -m berth._generate"
    client = Client(_NoConnection(), prefix="p")
    recorder = Recorder()
    bus = client.allocation._bus
    bus.request, bus.change = recorder(False), recorder(True)  # type: ignore[method-assign]
    method = _resolve(client, SUBJECTS[command.subject])
    assert SUBJECTS[command.subject].startswith(service)

    keys = {info.encode_name for info in msgspec.structs.fields(command.request)} - {command.scope}
    parameters = inspect.signature(method).parameters
    node_scoped = "<node>" in command.subject or command.scope is not None
    if node_scoped:
        assert list(parameters)[0] == "node"
    assert set(parameters) - {"node", "timeout"} == {key.replace("-", "_") for key in keys}

    required = {name: f"<{name}>" for name, parameter in parameters.items()
                if parameter.default is inspect.Parameter.empty and name != "node"}
    await (method("n7", **required) if node_scoped else method(**required))
    [(subject, payload, response, change)] = recorder.sent
    assert subject == command.subject.replace("<node>", "n7").replace("*", "n7")
    assert response is command.response
    assert change == (command.idempotent and "request_id" in {i.encode_name for i in
                                                              msgspec.structs.fields(command.request)})
    if command.scope is not None:
        assert payload[command.scope] == "n7"
    assert {key: payload[key] for key in required} == required


def test_every_method_comes_from_a_table():
    subjects = {command.subject for _, command in _table_commands()}
    assert set(SUBJECTS) == subjects


def test_the_generated_methods_are_up_to_date_with_the_tables():
    assert TARGET.read_text() == render_module(), "berth/_commands.py is out of date: run python -m berth._generate"


class _NoConnection:
    connected_url = None


# -- connecting ----------------------------------------------------------------------------------


async def test_connect_takes_arguments_first(nats_url, prefix):
    env = {"NATS_URL": "nats://127.0.0.1:1", "BERTH_PREFIX": "other"}
    async with await Client.connect(nats_url, prefix=prefix, env=env) as client:
        assert client.prefix == prefix and client.source == "--nats" and client.nc.is_connected
    assert client.nc.is_closed  # its own connection: closed with it


async def test_connect_reads_nats_url_and_the_berth_variables(nats_url, prefix, tmp_path):
    creds = tmp_path / "me.nats"
    creds.write_text("user=alice\npassword=secret\n")  # the test server has no users: it lets anyone in
    env = {"NATS_URL": nats_url, "BERTH_PREFIX": prefix, "BERTH_NATS_CREDS": str(creds), "BERTH_JS_DOMAIN": "d1",
           "BERTH_STATE": str(tmp_path / "none")}
    async with await Client.connect(env=env) as client:
        assert (client.prefix, client.js_domain, client.source) == (prefix, "d1", "NATS_URL")
        assert client._connection.user == "alice"


async def test_connect_finds_what_berth_up_wrote(nats_url, prefix, tmp_path):
    creds = tmp_path / "admin.nats"
    creds.write_text("user=admin\npassword=secret\n")
    write_up_env(tmp_path / "up.env", {"NATS_URL": nats_url, "BERTH_NATS_CREDS": str(creds), "BERTH_JS_DOMAIN": prefix,
                                       "BERTH_PREFIX": prefix, "BERTH_UP_PID": str(os.getpid())})
    async with await Client.connect(env={"BERTH_STATE": str(tmp_path)}) as client:
        assert (client.prefix, client.js_domain) == (prefix, prefix)
        assert client.source is not None and "up.env" in client.source
        assert client._connection.user == "admin"
    # the variables win over the file, as for the `berth` commands
    async with await Client.connect(env={"BERTH_STATE": str(tmp_path), "BERTH_PREFIX": "mine"}) as client:
        assert client.prefix == "mine"


async def test_connect_to_nothing_is_unavailable(tmp_path):
    with pytest.raises(berth.Unavailable) as caught:
        await Client.connect("nats://127.0.0.1:1", env={"BERTH_STATE": str(tmp_path)})
    assert (caught.value.code, caught.value.status) == ("unreachable", 503)
    assert "127.0.0.1:1" in caught.value.message


# -- allocation round trip, errors, request ids ------------------------------------------------


async def test_list_allocate_release_round_trip(alloc):
    client = alloc
    nodes = await client.allocation.list_nodes(labels={"pool": "a"})
    assert isinstance(nodes, ListNodesReply) and [node.nodename for node in nodes.nodes] == ["n1", "n2"]

    placed = await client.allocation.allocate(nodenames=["n1"], strategy="spread", deploy_count=2,
                                              workload_resource_request=ONE_CORE)
    assert isinstance(placed, AllocateReply) and [a.nodename for a in placed.allocations] == ["n1", "n1"]
    held = await client.allocation.node.get_allocations("n1")  # the node-scoped subject
    assert {a.workload_id for a in held.allocations} == {a.workload_id for a in placed.allocations}
    info = await client.allocation.cpumem.get_node_resource_info(nodename="n1")  # a plugin's own command
    assert info.capacity["cpu"] == 4

    released = await client.allocation.release(workload_ids=[a.workload_id for a in placed.allocations])
    assert isinstance(released, ReleaseReply) and sorted(released.released) == sorted(
        a.workload_id for a in placed.allocations)


@pytest.mark.parametrize("status, family", [(400, berth.InvalidInput), (403, berth.PermissionDenied),
                                            (404, berth.NotFound), (409, berth.Conflict), (412, berth.Conflict),
                                            (429, berth.Unavailable), (503, berth.Unavailable),
                                            (504, berth.Unavailable), (500, berth.Internal)])
def test_each_status_has_its_family(status, family):
    error = from_bus(BusError("some_code", "what happened", {"field": "x"}, status=status))
    assert type(error) is family and isinstance(error, berth.Error) and isinstance(error, BusError)
    assert (error.code, error.status, error.details, error.message) == ("some_code", status, {"field": "x"},
                                                                        "what happened")


async def test_error_replies_raise_their_family_with_code_status_and_details(alloc):
    client = alloc
    with pytest.raises(berth.Conflict) as caught:
        await client.allocation.allocate(nodenames=["n1"], deploy_count=100, workload_resource_request=ONE_CORE)
    assert (caught.value.code, caught.value.status) == ("insufficient_capacity", 409) and caught.value.details

    with pytest.raises(berth.Conflict) as caught:
        await client.allocation.add_node(nodename="n1", resource={"cpumem": {"cpu": 1, "memory": "1G"}})
    assert (caught.value.code, caught.value.details["field"]) == ("node_exists", "nodename")

    with pytest.raises(berth.InvalidInput) as caught:
        await client.allocation.allocate(nodenames=["n1"], deploy_count=0, workload_resource_request=ONE_CORE)
    assert (caught.value.code, caught.value.status, caught.value.details["field"]) == (
        "invalid_argument", 400, "deploy_count")

    with pytest.raises(berth.NotFound) as caught:
        await client.allocation.get_allocations(nodename="nope")
    assert (caught.value.code, caught.value.status) == ("node_not_found", 404)

    with pytest.raises(berth.Unavailable) as caught:  # no broker runs in this namespace
        await client.broker.list_brokers(timeout=1)
    assert (caught.value.code, caught.value.status) == ("no_responders", 503)

    try:
        await client.allocation.release(workload_ids=["never-placed"])
    except berth.Error as error:  # the base class catches every family
        assert error.status >= 400


async def test_a_state_change_gets_a_request_id_and_is_sent_again_with_it_after_a_timeout(nc, prefix):
    client = Client(nc, prefix=prefix, timeout=0.3, retry_for=10)
    seen: list[str] = []

    async def answer_the_second(msg) -> None:
        seen.append(decoder()(msg.data)["request_id"])
        if len(seen) == 2:
            await msg.respond(encode(ReleaseReply(released=["w1"])))

    sub = await nc.subscribe(f"{prefix}.resource.release", cb=answer_the_second)
    await nc.flush()
    try:
        reply = await client.allocation.release(workload_ids=["w1"])
        assert reply.released == ["w1"]
        assert len(seen) == 2 and seen[0] and seen[0] == seen[1]

        seen.clear()  # a request id of the caller's own is kept
        await client.allocation.release(workload_ids=["w1"], request_id="mine")
        assert seen == ["mine", "mine"]

        seen.clear()  # a read is sent once: its timeout is the caller's
        with pytest.raises(berth.Unavailable) as caught:
            await client.allocation.list_nodes()
        assert caught.value.code in ("timeout", "no_responders")
    finally:
        await sub.unsubscribe()


# -- events and metrics ------------------------------------------------------------------------


async def test_events_live_and_replayed_from_a_time(alloc):
    client = alloc
    async with client.events("resource.*.allocated") as events:
        placed = await client.allocation.allocate(nodenames=["n2"], deploy_count=1, workload_resource_request=ONE_CORE)
        event = await asyncio.wait_for(anext(events), timeout=5)
    assert event.subject == "resource.n2.allocated"
    assert isinstance(event.message, NodeEvent) and event.message.nodename == "n2" and event.stream is None
    workload = placed.allocations[0].workload_id

    async with client.events("resource.n2.*", since=timedelta(minutes=1)) as replayed:
        seen = [await asyncio.wait_for(anext(replayed), timeout=5)]
        while seen[-1].subject != "resource.n2.allocated":
            seen.append(await asyncio.wait_for(anext(replayed), timeout=5))
    assert seen[0].subject == "resource.n2.added"  # what the streams kept, in their order
    assert all(e.stream == f"{client.prefix}-events" and e.seq for e in seen)
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    assert workload in seen[-1].message.workload_ids

    with pytest.raises(berth.InvalidInput):
        async with client.events("resource.>.x"):
            pass
    with pytest.raises(berth.InvalidInput):
        async with client.events(">", since="yesterday-ish"):
            pass
    assert not client._open_events


async def test_metrics_watch_yields_the_samples_put(nc, redis, prefix, serve, berth_client):
    worker = MetricsWorker(nc, redis, prefix, MetricsServiceConfig(node="n1", insurance_seconds=60), provisioners=[])
    worker.start()
    try:
        await serve(worker.service)
        async with berth_client.metrics.watch("n1", "node", "ext.temperature") as samples:
            await berth_client.metrics.put("n1", scope="node", metric="ext.temperature", value=21.5)
            sample = await asyncio.wait_for(anext(aiter(samples)), timeout=10)
        assert isinstance(sample, MetricEvent) and sample.value == 21.5
        value = await berth_client.metrics.get("n1", scope="node", metric="ext.temperature")
        assert value.value == 21.5
        with pytest.raises(berth.NotFound) as caught:
            await berth_client.metrics.get("n1", scope="node", metric="ext.nothing")
        assert caught.value.code == "metric_not_found"
    finally:
        await worker.stop()


# -- the example type-checks -------------------------------------------------------------------


def _mypy() -> list[str] | None:
    if shutil.which("mypy", path=str(Path(sys.executable).parent)):
        return [str(Path(sys.executable).parent / "mypy")]
    try:
        import mypy  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "mypy"]


# The client's modules; the rest of berth/ (the CLI, `berth up`, the dashboard) is not checked here.
CLIENT_MODULES = ("__init__", "_base", "_commands", "_generate", "client", "errors", "events")


def test_the_example_and_the_client_type_check():
    """examples/quickstart.py and the client's modules pass mypy (what they import is checked only as
    they use it)."""
    mypy = _mypy()
    if mypy is None:
        pytest.skip("mypy is not installed in this environment (pip install mypy)")
    run = subprocess.run(
        [*mypy, "--follow-imports=silent", "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary",
         "examples/quickstart.py", *(f"berth/{name}.py" for name in CLIENT_MODULES)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
