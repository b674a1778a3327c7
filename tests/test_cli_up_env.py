"""Where the everyday commands talk to: `--nats` > `NATS_URL` > the `up.env` file `berth up` leaves in
its state folder > nats://127.0.0.1:4222; and every message about nothing answering, or NATS
failing, names the server (and prefix) asked (berth/commands/connection.py).

No test here reaches the default server: this machine may run an unrelated one on 4222.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from berth.commands.connection import read_up_env, resolve_server, write_up_env
from berth.servers import start_nats
from tests.cli_helpers import read_until

ROOT = Path(__file__).resolve().parent.parent
BERTH = [sys.executable, "-m", "berth.cli"]
SET = ("NATS_URL", "REDIS_URL", "BERTH_PREFIX", "BERTH_STATE", "BERTH_NATS_CREDS", "BERTH_TLS_CA",
       "BERTH_JS_DOMAIN", "BERTH_REDIS_MAXMEMORY")
CLEAN = {k: v for k, v in os.environ.items() if k not in SET}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def berth(*args: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`berth ...` run from `cwd` (where it looks for .berth/up.env), with none of the variables set."""
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**CLEAN, "PYTHONPATH": str(ROOT), **(env or {})})


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"nats": None, "nats_creds": None, "tls_ca": None, "js_domain": None,
                                 "prefix": None, **given})


def test_precedence_flag_then_env_then_file_then_default(tmp_path):
    state = tmp_path / ".berth"
    write_up_env(state / "up.env", {
        "NATS_URL": "tls://127.0.0.1:1111", "BERTH_NATS_CREDS": "/s/admin.nats", "BERTH_TLS_CA": "/s/ca.pem",
        "BERTH_JS_DOMAIN": "p1", "BERTH_PREFIX": "p1", "BERTH_UP_PID": str(os.getpid()),
    })
    env = {"BERTH_STATE": str(state)}
    assert read_up_env(state / "up.env")["BERTH_TLS_CA"] == "/s/ca.pem"

    from_file = _args()
    resolve_server(from_file, env)  # no flag, no NATS_URL: the file, with its creds file, CA, domain, prefix
    got = (from_file.nats, from_file.nats_creds, from_file.tls_ca, from_file.js_domain, from_file.prefix)
    assert got == ("tls://127.0.0.1:1111", "/s/admin.nats", "/s/ca.pem", "p1", "p1")
    assert from_file.nats_source.startswith(f"{state / 'up.env'}, written by `berth up`")
    assert "no longer runs" not in from_file.nats_source  # its writer (this process) runs

    given = _args(prefix="mine", tls_ca="/other/ca.pem")
    resolve_server(given, env)  # what is given wins over the file's
    assert (given.nats, given.prefix, given.tls_ca) == ("tls://127.0.0.1:1111", "mine", "/other/ca.pem")

    from_env = _args(nats="nats://10.0.0.1:4222")  # as argparse reads NATS_URL
    resolve_server(from_env, {**env, "NATS_URL": "nats://10.0.0.1:4222"})
    assert (from_env.nats, from_env.nats_source, from_env.nats_creds, from_env.prefix) == (
        "nats://10.0.0.1:4222", "NATS_URL", None, "berth")

    flag = _args(nats="nats://10.0.0.2:4222")
    resolve_server(flag, {**env, "NATS_URL": "nats://10.0.0.1:4222", "BERTH_PREFIX": "q"})
    assert (flag.nats, flag.nats_source, flag.prefix) == ("nats://10.0.0.2:4222", "--nats", "q")

    default = _args()
    resolve_server(default, {"BERTH_STATE": str(tmp_path / "nothing")})
    assert (default.nats, default.prefix) == ("nats://127.0.0.1:4222", "berth")
    assert default.nats_source.startswith("the default")


def test_a_stale_file_does_not_hang_and_says_which_server_it_asked(tmp_path):
    port = free_port()  # nothing listens there
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid runs no process now
    values = {"NATS_URL": f"nats://127.0.0.1:{port}", "BERTH_PREFIX": "p2", "BERTH_UP_PID": str(ended.pid)}
    write_up_env(tmp_path / ".berth" / "up.env", values)
    started = time.monotonic()
    for command in (["status"], ["call", "resource.plugins"], ["nodes"]):
        result = berth(*command, cwd=tmp_path)
        assert result.returncode == 5 and result.stdout == "", (command, result.stderr)
        assert f"cannot connect to NATS at nats://127.0.0.1:{port}" in result.stderr
        assert ".berth/up.env, written by `berth up`" in result.stderr
        assert "no longer runs" in result.stderr
    assert time.monotonic() - started < 45

    # NATS_URL wins over the file: the server it names is the one asked (and named)
    other = free_port()
    result = berth("status", cwd=tmp_path, env={"NATS_URL": f"nats://127.0.0.1:{other}"})
    assert result.returncode == 5 and f"nats://127.0.0.1:{other}" in result.stderr
    assert f":{port}" not in result.stderr


def test_nothing_answers_names_the_server_and_prefix(tmp_path):
    nats = start_nats(tmp_path / "nats", jetstream=False)  # a server, but no berth service on it
    try:
        status = berth("status", "--nats", nats.url, "--prefix", "nobody", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert status.stdout.strip() == f"no berth service answers at {nats.url} (prefix nobody; from --nats)"
        doc = berth("status", "--json", "--nats", nats.url, "--prefix", "nobody", cwd=tmp_path)
        assert '"nats": "' + nats.url + '"' in doc.stdout and '"prefix": "nobody"' in doc.stdout

        call = berth("call", "resource.plugins", "--prefix", "nobody", cwd=tmp_path,
                     env={"NATS_URL": nats.url})
        assert call.returncode == 3
        assert "no service answers on nobody.resource.plugins" in call.stderr
        assert f"asked {nats.url} (prefix nobody; from NATS_URL)" in call.stderr
        nodes = berth("nodes", "--nats", nats.url, "--prefix", "nobody", cwd=tmp_path)
        assert nodes.returncode == 3 and f"asked {nats.url} (prefix nobody; from --nats)" in nodes.stderr
        # a node's own subjects: no agent serves that node
        for command in (["call", "metrics.n9.get", '{"scope": "node", "metric": "cpu.usage.system"}'],
                        ["agent", "--node", "n9", "--drain"]):
            agentless = berth(*command, "--nats", nats.url, "--prefix", "nobody", cwd=tmp_path)
            assert agentless.returncode == 3, agentless.stderr
            assert "no agent serves node n9 (nobody answers on nobody." in agentless.stderr
            assert "is `berth agent` running there?)" in agentless.stderr and "no worker" not in agentless.stderr
            assert f"asked {nats.url} (prefix nobody; from --nats)" in agentless.stderr
    finally:
        nats.stop()


PYTHON_CLIENT = """
import asyncio
from berth import Client

async def main():
    async with await Client.connect() as berth:
        print(len((await berth.allocation.list_nodes()).nodes))

asyncio.run(main())
"""


def test_up_writes_the_file_status_reads_it_and_a_stop_removes_it(tmp_path):
    """`berth up` in a folder, `berth status` in the same folder with nothing set: it asks the
    servers `berth up` started (over TLS, as the admin identity) and says so on its first line."""
    log = tmp_path / "up.log"
    with open(log, "w") as stderr:
        up = subprocess.Popen([*BERTH, "up", "--no-metrics", "--prefix", "upenv"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                              env={**CLEAN, "PYTHONPATH": str(ROOT)})
    path = tmp_path / ".berth" / "up.env"
    try:
        lines = read_until(up, "berth is starting")
        values = read_up_env(path)
        printed = dict(line.split("=", 1) for line in lines if "=" in line and line.split("=")[0].isupper())
        assert values is not None and {k: values[k] for k in printed} == printed
        assert (values["BERTH_PREFIX"], values["BERTH_UP_PID"]) == ("upenv", str(up.pid))
        assert values["NATS_URL"].startswith("tls://127.0.0.1:")
        assert "password" not in path.read_text()
        deadline = time.monotonic() + 30
        while True:
            status = berth("status", cwd=tmp_path)
            assert status.returncode == 0, status.stderr
            first, *rest = status.stdout.splitlines()
            if any(line.startswith("upenv-allocation ") for line in rest) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        source = "from .berth/up.env, written by `berth up`"
        assert first == f"asked {values['NATS_URL']} (prefix upenv; {source})"
        assert any(line.startswith("upenv-allocation ") for line in rest), status.stdout
        # the Python client finds it the same way, and its close over TLS is quiet too
        client = subprocess.run([sys.executable, "-c", PYTHON_CLIENT], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60, env={**CLEAN, "PYTHONPATH": str(ROOT)})
        assert (client.returncode, client.stderr) == (0, ""), client.stderr
        assert int(client.stdout) >= 0
        # --nats beats the file: a server that is not there is asked, and named
        elsewhere = f"nats://127.0.0.1:{free_port()}"
        result = berth("status", "--nats", elsewhere, cwd=tmp_path)
        assert result.returncode == 5 and elsewhere in result.stderr
    finally:
        before = log.stat().st_size
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert up.wait(60) == 0
    assert not path.exists()
    # a clean stop is quiet: no disconnect warnings, no "no responders" (the dashboard stops first)
    logged = log.read_text()[before:]
    assert "draining" in logged
    assert "nats disconnected" not in logged and "NoResponders" not in logged and "eof_received" not in logged
