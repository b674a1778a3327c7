"""The `berth` command: compose entries, `up` with embedded servers, `status`, `schema`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from services.cli import parser
from services.registry import SERVICES

ROOT = Path(__file__).resolve().parent.parent
BERTH = [sys.executable, "-m", "services.cli"]


def test_every_compose_service_command_exists_in_the_cli():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for profile, suffix, redis_scheme in ((None, "", "redis://"), ("cluster", "-cluster", "redis+cluster://")):
        workers = {
            name.removesuffix(suffix): spec for name, spec in compose["services"].items()
            if "build" in spec and spec.get("profiles", [None])[0] == profile
        }
        assert set(workers) == set(SERVICES), profile
        for name, spec in workers.items():
            args, extra = parser().parse_known_args(spec["command"])
            assert (args.command, args.service, extra) == ("worker", name, [])
            assert spec["environment"]["NATS_URL"].startswith("nats://")
            assert spec["environment"]["REDIS_URL"].startswith(redis_scheme)
    assert "-js" in compose["services"]["nats"]["command"]
    assert "--appendonly" in compose["services"]["redis"]["command"]
    cluster_nats = [spec for name, spec in compose["services"].items() if name.startswith("nats-")]
    assert len(cluster_nats) == 3 and all("--routes" in spec["command"] for spec in cluster_nats)
    assert sum(name.startswith("redis-") and name[-1].isdigit() for name in compose["services"]) == 6


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 60) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not seen; got {lines}")


def _memory_policy(state: Path, address: str) -> tuple[int, str]:
    """(maxmemory, maxmemory-policy) of a redis-server `berth up` started, asked as its administrator."""
    import redis

    password = json.loads((state / "credentials" / "credentials.json").read_text())["redis"]["default"]
    host, port = address.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    with redis.Redis(host=host, port=int(port), username="default", password=password) as admin:
        config = admin.config_get("maxmemory*")
    return int(config["maxmemory"]), config["maxmemory-policy"]


def test_up_starts_everything_status_lists_it_and_ctrl_c_leaves_nothing(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL", "BERTH_REDIS_MAXMEMORY")}
    up = subprocess.Popen(
        [*BERTH, "up", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        lines = _read_until(up, "berth is up")
        urls = dict(line.split("=", 1) for line in lines if "_URL=" in line)
        # credentials by default: the URL printed is the client user's (services/credentials.py)
        assert urls["NATS_URL"].startswith("nats://client:") and urls["NATS_URL"].rsplit("@", 1)[1].startswith("127.0.0.1:")
        assert urls["REDIS_URL"].startswith("redis://")
        assert _memory_policy(state, urls["REDIS_URL"]) == (1 << 30, "noeviction")  # full: refuse, never evict
        assert _processes_mentioning(str(state))  # the embedded servers run from the state folder
        expected = {f"berth-{name}" for name in SERVICES if (ROOT / "services" / name / "worker.py").exists()}
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run(
                [*BERTH, "status", "--nats", urls["NATS_URL"]], capture_output=True, text=True, timeout=30, cwd=ROOT
            )
            assert status.returncode == 0, status.stderr
            running = {line.split()[0] for line in status.stdout.splitlines()[1:-1]}
            if expected <= running or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert expected <= running, status.stdout
        if not expected:
            assert "no service instance answered" in status.stdout
    finally:
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert up.wait(60) == 0
    assert "berth stopped" in up.stdout.read()
    nats_port = urls["NATS_URL"].rsplit(":", 1)[1]
    assert _processes_mentioning(str(state)) == []
    assert _processes_mentioning(f"nats://127.0.0.1:{nats_port}") == []


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
    from schemas.export import document

    doc = document("p", extra_modules=("tests.echo_service",))
    subjects = doc["services"]["tests.echo_service"]["subjects"]
    assert subjects["p.echo.increment"]["idempotent"] is True
    typed = subjects["p.echo.typed"]["request"]
    assert typed == {"$ref": "#/$defs/Typed"}
    assert doc["services"]["tests.echo_service"]["$defs"]["Typed"]["required"] == ["count", "name", "flag"]


def test_ctrl_c_on_up_stops_the_processes_the_broker_launched(tmp_path):
    """The `process` operator starts each instance in a session of its own (to outlive a broker
    restart); `berth up` stopping must stop them too."""
    import asyncio

    import msgpack
    import nats

    from services.broker.operators.procfs import (
        DEPLOYMENT,
        is_running,
        marked_processes,
        processes_with,
        start_time,
    )

    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    up = subprocess.Popen(
        [*BERTH, "up", "--no-dashboard", "--no-metrics", "--state", str(state)], cwd=ROOT, stdout=subprocess.PIPE,
        text=True, env=env, start_new_session=True,
    )
    image = "http-server"  # of the development catalog.toml, which `berth up` gives the broker
    user = f"lc{os.getpid()}"  # the marker BERTH_INSTANCE=berth/<user>/r1/<index> finds this test's processes

    async def launch(url: str) -> None:
        nc = await nats.connect(url)
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
        urls = dict(line.split("=", 1) for line in _read_until(up, "berth is up") if "_URL=" in line)
        asyncio.run(launch(urls["NATS_URL"]))
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
