"""The `berth` command: compose entries, `up` with embedded servers, `status`, `schema`,
`redis-functions`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import stat
import subprocess
import time
from pathlib import Path

import msgpack
import nats
import pytest

from berth.redis_functions import every_library
from berth.registry import SERVICES
from tests.cli_helpers import (
    BERTH,
    ROOT,
    answered,
    berth_up,
    client_options,
    memory_policy,
    nats_call,
    printed_variables,
    processes_mentioning,
    read_until,
    redis_admin,
)


def test_up_starts_everything_status_lists_it_and_ctrl_c_leaves_nothing(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_REDIS_MAXMEMORY")}
    up = subprocess.Popen(
        [*BERTH, "up", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        lines = read_until(up, "berth is starting")
        urls = printed_variables(lines)
        # credentials and TLS by default: the admin identity's creds file and the CA, never a password
        assert urls["NATS_URL"].startswith("tls://127.0.0.1:") and urls["REDIS_URL"].startswith("rediss://127.0.0.1:")
        assert urls["BERTH_NATS_CREDS"] == str(state / "credentials" / "admin.nats")
        assert urls["BERTH_TLS_CA"] == str(state / "tls" / "ca.pem") and urls["BERTH_JS_DOMAIN"] == "berth"
        stored = json.loads((state / "credentials" / "credentials.json").read_text())
        passwords = [*stored["nats"].values(), *stored["redis"].values(),
                     *(identity["password"] for identity in stored["identities"].values())]
        printed = "\n".join(lines)
        # NATS: 3 workers, streams-admin, join-service; Redis: 3 workers, default; admin, dashboard, the local agent
        assert len(passwords) == 12 and not any(p in printed for p in passwords)
        assert memory_policy(state, urls["REDIS_URL"]) == (1 << 30, "noeviction")  # full: refuse, never evict
        assert processes_mentioning(str(state))  # the embedded servers run from the state folder
        expected = {f"berth-{name}" for name in SERVICES if (ROOT / "services" / name / "worker.py").exists()}
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run(  # as a user would: the variables `berth up` printed
                [*BERTH, "status"], capture_output=True, text=True, timeout=30, cwd=ROOT, env={**env, **urls}
            )
            assert status.returncode == 0, status.stderr
            running = {line.split()[0] for line in status.stdout.splitlines()[2:-1]}  # after "asked ..."
            if expected <= running or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert expected <= running, status.stdout
        if not expected:
            assert "no berth service answers at " in status.stdout
        _next_steps_work(up, state, env)
    finally:
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert up.wait(60) == 0
    assert "berth stopped" in up.stdout.read()
    nats_port = urls["NATS_URL"].rsplit(":", 1)[1]
    assert processes_mentioning(str(state)) == []
    assert processes_mentioning(f"nats://127.0.0.1:{nats_port}") == []


def _next_steps_work(up: subprocess.Popen, state: Path, env: dict[str, str]) -> None:
    """`berth up` ends its start-up output, once its services answer and its agent has registered
    this machine, with what to do next; each command it suggests works as printed."""
    import shlex

    from bus.settings import default_node

    lines = read_until(up, "Ctrl-C here stops everything", timeout=120)
    start = next(i for i, line in enumerate(lines) if line.startswith("berth is ready: "))
    steps = lines[start:]
    node = default_node()
    assert steps[0] == f"berth is ready: allocation, broker, agent, metrics answer; node {node} is this machine"
    assert steps[1] == f"next, from another shell with BERTH_STATE={state} set:"
    tries = [shlex.split(line.strip().split("  ")[0]) for line in steps[2:] if line.strip().startswith("berth ")]
    assert [argv[:2] for argv in tries] == [["berth", "status"], ["berth", "nodes"], ["berth", "events"],
                                            ["berth", "call"]]
    assert any(line.startswith("  the dashboard: http://127.0.0.1:") for line in steps)
    user = {**env, "BERTH_STATE": str(state)}  # as the line says
    for argv in tries:
        if argv[1] == "events":
            argv = [*argv, "--count", "1"]  # the node's registration, replayed
        done = subprocess.run([*BERTH, *argv[1:]], capture_output=True, text=True, timeout=60, cwd=ROOT, env=user)
        assert done.returncode == 0, (argv, done.stderr)
    placed = json.loads(done.stdout)  # the dry run: where one workload would go
    assert [a["nodename"] for a in placed["allocations"]] == [node]


def test_schema_groups_messages_by_subject(tmp_path):
    out = tmp_path / "schema.json"
    result = subprocess.run([*BERTH, "schema", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["error_reply"]["$defs"]["ErrorInfo"]["required"] == ["code", "message"]
    assert {"type", "time"} <= set(doc["event_envelope"]["$defs"]["Event"]["properties"])
    for service in doc["services"].values():
        for subject, entry in service["subjects"].items():
            assert subject.startswith("berth.") and {"request", "reply"} <= set(entry)


def test_schema_export_of_a_service_module():
    from berth.registry import contracts
    from schemas.export import document

    doc = document(contracts(("tests.echo_service",)), "p")
    subjects = doc["services"]["tests.echo_service"]["subjects"]
    assert subjects["p.echo.increment"]["idempotent"] is True
    typed = subjects["p.echo.typed"]["request"]
    assert typed == {"$ref": "#/$defs/Typed"}
    assert doc["services"]["tests.echo_service"]["$defs"]["Typed"]["required"] == ["count", "name", "flag"]


def test_ctrl_c_on_up_stops_the_processes_the_broker_launched(tmp_path):
    """The `process` operator starts each instance in a session of its own (to outlive a broker
    restart); `berth up` stopping must stop them too. Its broker runs them itself when told so (env
    BERTH_BROKER_OPERATOR, which wins over `berth up`'s choice of its local agent)."""
    from services.processes.procfs import (
        DEPLOYMENT,
        is_running,
        marked_processes,
        processes_with,
        start_time,
    )

    state = tmp_path / "state"
    env = {**{k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")},
           "BERTH_BROKER_OPERATOR": "process"}
    up = subprocess.Popen(
        [*BERTH, "up", "--no-dashboard", "--no-metrics", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE,
        text=True, env=env, start_new_session=True,
    )
    image = "http-server"  # of the development catalog.toml, which `berth up` gives the broker
    user = f"lc{os.getpid()}"  # the marker BERTH_INSTANCE=berth/<user>/r1/<index> finds this test's processes

    async def launch(options: dict) -> None:
        nc = await nats.connect(**options)
        try:
            for command, payload in (
                ("init", {"user": user, "resource_id": "r1", "param": {"ports": {"http": "tcp"}, "image": image}}),
                ("launch", {"user": user, "resource_id": "r1", "filter": {"least_instance": 1, "request_instance": 2}}),
            ):
                for _ in range(300):  # until the broker worker serves
                    try:
                        msg = await nc.request(f"berth.broker.{command}", msgpack.packb(payload), timeout=5)
                        break
                    except nats.errors.NoRespondersError:
                        await asyncio.sleep(0.1)
                assert not (msg.headers or {}).get("Nats-Service-Error-Code"), msgpack.unpackb(msg.data)
        finally:
            await nc.close()

    try:
        urls = printed_variables(read_until(up, "berth is starting"))
        asyncio.run(launch(client_options(urls)))
        launched = set(marked_processes(f"berth/{user}/r1/").values())
        assert len(launched) == 2 and all("http_server.py" in _cmdline(pid) for pid in launched)
        started = {pid: start_time(pid) for pid in launched}
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0
    assert not any(is_running(pid, at) for pid, at in started.items())  # gone (a zombie waiting for init is)
    assert processes_with(DEPLOYMENT, str(state)) == []
    assert "stopped 2 launched process groups" in up.stdout.read()


def _cmdline(pid: int) -> str:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


# -- transport security (issue 17 item 6) -----------------------------------------------------------


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].split(",")[0].split("/")[0].rsplit(":", 1)
    return host, int(port)


def _nats_answers_in_clear(url: str, creds: str) -> bool:
    """Whether nats-server answers a PING sent in clear after a CONNECT with the admin's password."""
    from bus.connection import read_creds_file

    user, password = read_creds_file(creds)
    connect = json.dumps({"user": user, "pass": password, "verbose": False, "pedantic": False})
    received = b""
    with socket.create_connection(_host_port(url), timeout=10) as sock:
        received += sock.recv(4096)  # INFO
        sock.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
        try:
            while chunk := sock.recv(4096):  # until the server answers, or closes the connection
                received += chunk
                if b"PONG" in received:
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    return b"PONG" in received


async def _allocates(options: dict) -> list[str]:
    """A node added and two workloads placed on it through NATS, as the admin: the workers serve."""
    nc = await nats.connect(**options)
    try:
        node = {"nodename": "t1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}}
        await nats_call(nc, "berth.resource.add-node", node)
        placed = await nats_call(nc, "berth.resource.allocate", {
            "nodename": "t1", "deploy_count": 2, "request_id": f"tls-{os.getpid()}",
            "workload_resource_request": {"cpumem": {"cpu-bind": True, "cpu-request": 1}}})
        return [a["nodename"] for a in placed["allocations"]]
    finally:
        await nc.close()


async def test_up_serves_over_tls_only_with_its_own_ca(tmp_path):
    import redis

    state = tmp_path / "state"
    with berth_up(state) as (printed, _):
        ca = printed["BERTH_TLS_CA"]
        assert printed["NATS_URL"].startswith("tls://") and printed["REDIS_URL"].startswith("rediss://")
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(ca).parent.iterdir()} == {
            name: 0o600 for name in ("ca.pem", "ca.key", "server.pem", "server.key")}
        # in clear: NATS does not answer (it wants TLS first), Redis closes the connection
        assert not _nats_answers_in_clear(printed["NATS_URL"], printed["BERTH_NATS_CREDS"])
        with redis_admin(state, printed["REDIS_URL"], tls=False) as plain, pytest.raises(redis.ConnectionError):
            plain.ping()
        # over TLS with the CA: both answer, and the workers (on TLS themselves) serve
        with redis_admin(state, printed["REDIS_URL"]) as admin:
            assert admin.ping()
        assert await _allocates(client_options(printed)) == ["t1", "t1"]
        with redis_admin(state, printed["REDIS_URL"]) as admin:  # berth's scripts ran as Functions
            assert all(admin.function_list(library.name) for library in every_library())
            stats = admin.info("commandstats")
            assert "cmdstat_fcall" in stats and "cmdstat_evalsha" not in stats
        # over TLS without the CA: the server's certificate is not trusted
        with pytest.raises((ssl.SSLCertVerificationError, nats.errors.NoServersError)):
            await nats.connect(**{**client_options(printed), "tls": ssl.create_default_context()},
                               max_reconnect_attempts=0, allow_reconnect=False)
        ca_made = Path(ca).read_bytes()
    with berth_up(state) as (printed, _):  # the CA is made once: clients handed it keep trusting the deployment
        assert Path(printed["BERTH_TLS_CA"]).read_bytes() == ca_made
        nc = await nats.connect(**client_options(printed))
        try:
            held = await nats_call(nc, "berth.resource.get-allocations", {"nodename": "t1"})
        finally:
            await nc.close()
        assert len(held["allocations"]) == 2


@pytest.mark.parametrize("off", [["--no-tls"], []], ids=["flag", "env"])
async def test_up_without_tls_serves_in_clear(tmp_path, off):

    state = tmp_path / "state"
    with berth_up(state, *off, env={} if off else {"BERTH_TLS": "0"}) as (printed, _):
        assert printed["NATS_URL"].startswith("nats://") and printed["REDIS_URL"].startswith("redis://")
        assert "BERTH_TLS_CA" not in printed and not (state / "tls").exists()
        assert _nats_answers_in_clear(printed["NATS_URL"], printed["BERTH_NATS_CREDS"])
        with redis_admin(state, printed["REDIS_URL"], tls=False) as plain:
            assert plain.ping()
        assert await _allocates(client_options(printed)) == ["t1", "t1"]


def test_redis_functions_loads_every_library_and_prints_rules_a_service_user_works_with(tmp_path):
    import redis

    from berth.servers import start_redis

    server = start_redis(tmp_path / "redis", appendonly=False)
    try:
        loaded = subprocess.run([*BERTH, "redis-functions", "--prefix", "p"], capture_output=True, text=True,
                                timeout=60, cwd=ROOT, env={**os.environ, "REDIS_URL": server.url})
        assert loaded.returncode == 0, loaded.stderr
        assert [line.split()[1].rstrip(":") for line in loaded.stdout.splitlines() if line.startswith("loaded ")] == [
            library.name for library in every_library()]
        [rules] = [line.split()[3:] for line in loaded.stdout.splitlines() if line.startswith("user allocation ")]
        with redis.Redis.from_url(server.url) as admin:
            assert all(admin.function_list(library.name) for library in every_library())
            admin.acl_setuser("allocation", enabled=True, passwords=["+pw"])
            admin.execute_command("ACL", "SETUSER", "allocation", *rules)
        with redis.Redis.from_url(server.url, username="allocation", password="pw") as allocation:
            lease = next(library.function("lease_hold") for library in every_library() if library.package == "bus")
            assert allocation.fcall(lease, 1, "p:allocation:{n1}:lease", "me", 1000) == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                allocation.eval("return 1", 0)
    finally:
        server.stop()




def test_every_identity_has_a_standard_nats_context_that_connects_as_it(tmp_path):
    """ADR-21's context fields (url, user, password, ca, jetstream_domain, inbox_prefix), read as a
    standard client reads them: the admin reaches the streams, an agent its own node's subjects."""
    state = tmp_path / "state"
    with berth_up(state, env={"BERTH_NODE": "ctx-node"}) as (printed, _):
        added = subprocess.run([*BERTH, "user", "--state", str(state), "add", "web-9", "--role", "agent"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert added.returncode == 0 and "web-9.context.json" in added.stdout, added.stderr

        async def as_context(name: str):
            context = json.loads((state / "credentials" / f"{name}.context.json").read_text())
            assert context["url"] == printed["NATS_URL"]
            options = {"inbox_prefix": context["inbox_prefix"]} if "inbox_prefix" in context else {}
            nc = await nats.connect(context["url"], user=context["user"], password=context["password"],
                                    tls=ssl.create_default_context(cafile=context["ca"]), **options)
            return nc, context

        async def check() -> None:
            admin, context = await as_context("admin")
            try:
                info = await admin.jetstream(domain=context["jetstream_domain"]).stream_info("berth-events")
                assert info.config.name == "berth-events"
            finally:
                await admin.close()
            agent, _ = await as_context("web-9")
            try:
                msg = await answered(agent, "berth.resource.node.web-9.get-allocations", {"nodename": "web-9"})
                reply = msgpack.unpackb(msg.data)  # its own node's subject answers: the node is not added yet
                assert reply["error"]["code"] == "node_not_found", reply
            finally:
                await agent.close()

        asyncio.run(check())
