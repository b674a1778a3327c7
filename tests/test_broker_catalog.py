"""No code from requests (issue 17, item 3), over the wire: the `process` operator runs only the
images of its catalog (tests/catalog.toml), never a command line of a request, and what it starts
gets a scrubbed environment: no `REDIS_URL`, no NATS credentials, only what the entry declares and
the operator's own variables."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from services.processes.catalog import Catalog, CatalogError
from tests.broker_helpers import (
    HTTP,
    ROOT,
    SERVER,
    const_broker,
    marked,
    param,
    server,
    tracked_pids,
)
from tests.bus_helpers import eventually

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}


def shell_lines(target: Path) -> list[str]:
    """Request images that would create `target` if anything ran them."""
    return [f"/bin/sh -c 'touch {target}'", f"touch {target}", "/usr/bin/touch"]


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in items if item)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


async def started(redis, prefix: str) -> list[tuple[str, int]]:
    """The launched processes once each has its pid recorded (the launch answers before that)."""
    tracked = await tracked_pids(redis, prefix)
    return tracked if tracked and all(pid for _, pid in tracked) else []


async def sentinel(b) -> None:
    """Launch a catalog image and wait until it runs: by then an earlier launch would have run too."""
    await b("init", {"user": U, "resource_id": "sentinel", "param": param()})
    await b("launch", {"user": U, "resource_id": "sentinel", "filter": ONE})
    assert (await b.wait_running(U, "sentinel"))["status"] == "running"


async def only_the_sentinel_ran(b, redis, prefix: str) -> None:
    assert [marker for marker, _ in await tracked_pids(redis, prefix)] == [f"{prefix}/{U}/sentinel/0"]
    assert sorted(marked(prefix)) == [f"{prefix}/{U}/sentinel/0"]
    await b("release", {"user": U, "resource_id": "sentinel"})


@pytest.mark.parametrize("line", range(3))
async def test_init_of_a_command_line_is_refused_and_nothing_runs(
    start_broker, broker_call, redis, prefix, tmp_path, line
):
    await start_broker()
    b = broker_call
    target = tmp_path / "ran"
    image = shell_lines(target)[line]
    refused = await b.error("init", {"user": U, "resource_id": "evil", "param": param(image)})
    launch = await b.error("launch", {"user": U, "resource_id": "evil", "filter": ONE})
    await sentinel(b)
    assert (refused.code, refused.details["field"]) == ("invalid_argument", "param.image")
    assert launch.code == "resource_not_found"  # the refusal wrote nothing
    assert not target.exists()
    await only_the_sentinel_ran(b, redis, prefix)


async def test_add_broker_and_apply_of_a_command_line_are_refused_and_nothing_runs(
    start_broker, broker_call, redis, prefix, tmp_path
):
    await start_broker()
    b = broker_call
    target = tmp_path / "ran"
    [image, *_] = shell_lines(target)
    added = await b.error("add-broker", const_broker(U, "evil", 1, image=image))
    await b("add-broker", const_broker(U, "good", 0))  # fits any request of city sz, worker v1
    applied = await b.error("apply", {"user": U, "resource_id": "caller", "param": param(image), "filter": ONE})
    await sentinel(b)
    for refused in (added, applied):
        assert (refused.code, refused.details["field"]) == ("invalid_argument", "param.image")
    assert [broker["name"] for broker in (await b("list-brokers", {"user": U}))["brokers"]] == ["good"]
    assert (await b.error("get-resource", {"user": U, "resource_id": "caller"})).code == "resource_not_found"
    assert not target.exists()
    await only_the_sentinel_ran(b, redis, prefix)
    await b("remove-broker", {"user": U, "name": "good"})


@pytest.mark.parametrize("name", ["LD_PRELOAD", "PATH", "PYTHONSTARTUP", "BERTH_INSTANCE"])
async def test_a_variable_the_image_does_not_take_is_refused(start_broker, broker_call, name):
    await start_broker()
    payload = {"user": U, "resource_id": "r", "param": param(env={name: "/tmp/evil"})}
    refused = await broker_call.error("init", payload)
    assert (refused.code, refused.details["field"]) == ("invalid_argument", f"param.env.{name}")


async def test_the_launched_process_gets_only_its_declared_environment(
    start_broker, broker_call, redis, prefix, monkeypatch
):
    # What a worker `berth up` starts holds: its Redis password, NATS credentials, berth settings.
    secrets = {
        "REDIS_URL": "redis://broker:s3cret@127.0.0.1:6379/0",
        "NATS_URL": "nats://broker:s3cret@127.0.0.1:4222",
        "NATS_PASSWORD": "s3cret",
        "BERTH_NATS_CREDS": "/state/credentials/broker.creds",
        "BERTH_PREFIX": prefix,
    }
    for variable, value in {**secrets, "BERTH_DEPLOYMENT": "/state"}.items():
        monkeypatch.setenv(variable, value)
    await start_broker()
    b = broker_call
    await b("init", {"user": U, "resource_id": "r", "param": param(**server("slow", DELAY="0"))})
    await b("launch", {"user": U, "resource_id": "r", "filter": ONE})
    await b.wait_running(U, "r")
    [(marker, pid)] = await tracked_pids(redis, prefix)
    env = environ(pid)
    assert not set(secrets) & set(env)
    assert env["DELAY"] == "0" and env["SLOW_INSTANCES"] == ""  # the request's, the entry's
    assert (env["BERTH_INSTANCE"], env["BERTH_INSTANCE_INDEX"], env["BERTH_RESOURCE_ID"]) == (marker, "0", "r")
    assert env["BERTH_DEPLOYMENT"] == "/state" and env["PORT_HTTP"].isdigit()
    allowed = {"PATH", "LANG", "LC_ALL", "TZ", "DELAY", "SLOW_INSTANCES", "PORT_HTTP", "BERTH_DEPLOYMENT", "BERTH_ADDRESS",
               "BERTH_INSTANCE", "BERTH_INSTANCE_INDEX", "BERTH_RESOURCE_ID"}  # fmt: skip
    assert set(env) <= allowed, set(env) - allowed
    await b("release", {"user": U, "resource_id": "r"})


async def test_a_request_value_stays_one_argument(start_broker, broker_call, redis, prefix, tmp_path):
    await start_broker()
    b = broker_call
    target = tmp_path / "ran"
    gate = f"{tmp_path}/gate; touch {target} $(touch {target})"
    await b("init", {"user": U, "resource_id": "r", "param": param(**server("gated", WAIT_FILE=gate))})
    await b("launch", {"user": U, "resource_id": "r", "filter": ONE})
    [(_, pid)] = await eventually(lambda: started(redis, prefix))
    assert cmdline(pid)[-2:] == ["--wait-file", gate]
    await b("release", {"user": U, "resource_id": "r"})
    assert not target.exists()


NOBODY_CATALOG = """
[images.http-server-nobody]
argv = ["python3", "$CATALOG_DIR/http_server.py", "--port", "$PORT_HTTP"]
env = { PYTHONDONTWRITEBYTECODE = "1" }
user = "nobody"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts a process as another user")
async def test_an_image_with_a_user_runs_as_that_user_without_the_brokers_groups(
    start_broker, broker_call, redis, prefix
):
    # The user must reach the server's file: the checkout may sit in a folder only root may enter
    # (a clone into `mktemp -d`), so the entry and its server go to a folder anyone may read.
    readable = Path(tempfile.mkdtemp(prefix="berth-nobody-"))
    readable.chmod(0o755)
    shutil.copy(ROOT / "tests" / "http_server.py", readable / "http_server.py")
    (readable / "catalog.toml").write_text(NOBODY_CATALOG)
    await start_broker(catalog=str(readable / "catalog.toml"))
    b = broker_call
    await b("init", {"user": U, "resource_id": "r", "param": param("http-server-nobody")})
    await b("launch", {"user": U, "resource_id": "r", "filter": ONE})
    assert (await b.wait_running(U, "r"))["status"] == "running"
    [(_, pid)] = await tracked_pids(redis, prefix)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65534"] * 4
    assert status["Groups"].split() == []
    assert environ(pid)["HOME"] == "/nonexistent" and environ(pid)["USER"] == "nobody"
    await b("release", {"user": U, "resource_id": "r"})


async def test_a_broker_without_a_catalog_runs_nothing(start_broker, broker_call):
    await start_broker(catalog=None)
    refused = await broker_call.error("init", {"user": U, "resource_id": "r", "param": param(SERVER, ports=HTTP)})
    assert (refused.code, refused.details["field"]) == ("invalid_argument", "param.image")
    assert "no catalog" in str(refused)


@pytest.mark.parametrize(
    "text,says",
    [
        ('[images.x]\nagrv = ["/bin/true"]\n', "agrv"),
        ('[images.x]\nargv = ["/bin/echo", "$PORT"]\n', "$PORT"),
        ('[images.x]\nargv = ["/bin/true"]\nrequest_env = ["BERTH_INSTANCE"]\n', "BERTH_INSTANCE"),
        ('[images.x]\nargv = ["/bin/true"]\nuser = "no-such-user-here"\n', "no-such-user-here"),
        ('[images."-x"]\nargv = ["/bin/true"]\n', "images.-x"),
    ],
)
def test_a_catalog_with_a_mistake_is_refused_when_the_broker_starts(tmp_path, text, says):
    path = tmp_path / "catalog.toml"
    path.write_text(text)
    with pytest.raises(CatalogError) as caught:
        Catalog.load(path)
    assert says in str(caught.value) and str(path) in str(caught.value)
