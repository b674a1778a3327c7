"""Credentials (berth/credentials.py): a nats-server and a redis-server started with the users
`berth up` writes, with berth's Redis Functions loaded as `berth up` loads them, real workers on
their own users, and what a user without rights cannot do.
What identities and roles may do on the bus is in tests/test_tenancy.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import socket
import stat

import pytest
import redis as sync_redis
from nats.errors import Error as NatsError
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from berth import accounts, credentials, redis_functions
from berth.credentials import REDIS_ADMIN, load, prepare
from berth.servers import start_redis_cluster
from bus import discovery, scripts
from bus.callers import Role
from bus.connection import connect, read_creds_file
from bus.redis import Pipelined, connect_redis
from bus.scripts import FunctionMissing
from tests.accounts_helpers import NODE, Deployment
from tests.broker_helpers import HTTP, SERVER
from tests.bus_helpers import eventually


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("credentials"), {"u1": Role.TENANT})
    try:
        d.start_workers()
        yield d
    finally:
        d.stop()


# -- every service works on its own users ---------------------------------------------------------


async def test_every_service_answers_on_its_own_users_and_writes_only_its_own_keys(deployment):
    d = deployment
    client, tenant = await d.client("admin"), await d.client("u1")
    try:
        added = await client.request("resource.add-node", {"nodename": "n1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}})
        assert added["capacity"]["cpumem"]["cpu"] == 4
        placed = await tenant.request("resource.allocate", {
            "nodename": "n1", "deploy_count": 2, "request_id": "creds-1",
            "workload_resource_request": {"cpumem": {"cpu-bind": True, "cpu-request": 1}},
        })
        assert [a["nodename"] for a in placed["allocations"]] == ["n1", "n1"]
        assert await client.request("broker.list-brokers", {}) == {"brokers": []}
        param = {"city": "sz", "platform": "linux", "image": SERVER, "ports": HTTP, "worker_version": "v1"}
        await tenant.request("broker.init", {"user": "u1", "resource_id": "r1", "param": param, "request_id": "creds-3"})
        assert (await tenant.request("broker.get-resource", {"user": "u1", "resource_id": "r1"}))["status"] == "init"
        synced = await client.request(f"metrics.{NODE}.has-synced", {})
        assert {"synced", "failed", "interval_seconds"} <= set(synced)
        lease = await client.request(f"metrics.{NODE}.register-notifier",
                                     {"scope": "node", "metric": "mem.total.system", "request_id": "creds-2"})
        assert lease["key"]
        # discovery works for an identity, and lists every service
        names = {ping.name for ping in await discovery.ping(tenant.nc)}
        assert {f"{d.prefix}-{s}" for s in d.services} <= names
    finally:
        await d.close_connections()

    keys = {k.decode() for k in d.redis_admin().scan_iter(match=f"{d.prefix}:*", count=1000)}
    for service in d.services:
        own = [k for k in keys if any(_glob(k, p) for p in credentials.redis_key_patterns(d.prefix, service))]
        assert {k.split(":")[1] for k in own} == {service, "idem"}, own  # records and kept answers
    patterns = [p for s in d.services for p in credentials.redis_key_patterns(d.prefix, s)]
    assert all(any(_glob(k, p) for p in patterns) for k in keys), keys  # nobody wrote outside its space
    calls = {name: stats["calls"] for name, stats in d.redis_admin().info("commandstats").items()}
    assert calls["cmdstat_fcall"] > 0 and "cmdstat_evalsha" not in calls  # its scripts ran as functions


def _glob(key: str, pattern: str) -> bool:
    return key.startswith(pattern.removesuffix("*"))


# -- NATS ----------------------------------------------------------------------------------------


async def test_nats_refuses_a_connection_without_credentials_or_with_a_wrong_password(deployment):
    wrong = deployment.creds.nats_url("admin", deployment.nats.url).replace("@", "x@")
    for url in (deployment.nats.url, wrong):
        with pytest.raises(NatsError, match="Authorization Violation"):
            await connect(url, worker=False, allow_reconnect=False, max_reconnect_attempts=0)


# -- Redis: every user in its own key space --------------------------------------------------------


def test_a_service_user_cannot_read_another_services_keys(deployment):
    d, p = deployment, deployment.prefix
    admin = d.redis_admin()
    broker_key, metrics_key = f"{p}:broker:{{{p}}}:index", f"{p}:metrics:{{{NODE}}}:secret"
    broker_answer = f"{p}:idem:{p}-broker:broker.apply:r1"
    for key in (broker_key, metrics_key, broker_answer):
        admin.set(key, "theirs")
    allocation = d.redis_as("allocation")
    assert allocation.set(f"{p}:allocation:probe", "mine") and allocation.get(f"{p}:allocation:probe") == b"mine"
    for key in (broker_key, metrics_key, broker_answer):
        with pytest.raises(NoPermissionError):
            allocation.get(key)
        with pytest.raises(NoPermissionError):
            allocation.delete(key)
    with pytest.raises(NoPermissionError):  # nor through a function of its own
        allocation.fcall(_function("allocation", "lease_hold"), 1, broker_key, "me", 1000)
    with pytest.raises(NoPermissionError):  # nor list the key names
        allocation.scan(0)
    metrics = d.redis_as("metrics")
    with pytest.raises(NoPermissionError):
        metrics.get(f"{p}:allocation:probe")
    assert metrics.get(metrics_key) == b"theirs"  # its own
    for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("PUBLISH", "c", "m"),
                    ("SCRIPT", "FLUSH"), ("CLIENT", "TRACKING", "on", "BCAST")):
        with pytest.raises(NoPermissionError):
            allocation.execute_command(*command)
    assert admin.get(broker_key) == b"theirs"


def test_a_service_user_runs_no_lua_of_its_own_and_calls_only_its_own_functions(deployment):
    d, p = deployment, deployment.prefix
    allocation, metrics = d.redis_as("allocation"), d.redis_as("metrics")
    own = f"{p}:allocation:{{n1}}:lease"
    sha = d.redis_admin().script_load("return 1")
    for command in (("EVAL", "return 1", 0), ("EVALSHA", sha, 0), ("SCRIPT", "LOAD", "return 1"),
                    ("FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('mine', function() end)"),
                    ("FUNCTION", "DELETE", redis_functions.libraries("allocation")[0].name), ("FUNCTION", "FLUSH"),
                    ("FCALL", _function("broker", "set_if_exists"), 1, own)):  # another service's function
        with pytest.raises(NoPermissionError):
            allocation.execute_command(*command)
    assert allocation.fcall(_function("allocation", "lease_hold"), 1, own, "me", 1000) == 1
    # A function's own Redis calls are checked too: notifier_live reads keys named by its ARGV.
    index = f"{p}:metrics:{{{NODE}}}:probe-index"
    metrics.sadd(index, "x")
    with pytest.raises(ResponseError, match="(?i)can't access|no permissions"):
        metrics.fcall(_function("metrics", "notifier_live"), 1, index, f"{p}:broker:{{{NODE}}}:")


async def test_a_worker_whose_library_nobody_loaded_is_told_to_load_it(deployment):
    client = connect_redis(deployment.creds.redis_url("allocation", deployment.redis.url))
    try:
        unloaded = scripts.Script(client, scripts.library("tests"), "incr")  # not loaded: EVALSHA, refused
        with pytest.raises(FunctionMissing, match=f"{unloaded.function}.*berth redis-functions"):
            await unloaded(keys=[f"{deployment.prefix}:allocation:n"])
    finally:
        await client.aclose()


def _function(service: str, script: str) -> str:
    """The name of one of `service`'s functions."""
    return next(library.function(script) for library in redis_functions.libraries(service)
                if script in dict(library.sources))


def test_redis_refuses_the_default_user_without_password_and_a_wrong_password(deployment):
    with socket.create_connection(("127.0.0.1", deployment.redis_port), timeout=5) as conn:
        conn.sendall(f"GET {deployment.prefix}:allocation:probe\r\n".encode())
        assert conn.recv(256).startswith(b"-NOAUTH")  # no AUTH: the default user, refused
    once = Retry(NoBackoff(), 0)
    with pytest.raises(AuthenticationError):
        sync_redis.Redis(port=deployment.redis_port, username="allocation", password="wrong", retry=once).ping()
    with pytest.raises(AuthenticationError):
        sync_redis.Redis(port=deployment.redis_port, username="default", password="", retry=once).ping()


async def test_a_redis_cluster_gets_the_same_users_and_a_promoted_replica_the_functions(tmp_path):
    creds = prepare(tmp_path / "credentials", "tc", redis_functions=True)
    # start_redis_cluster waits for the replica's link to its primary: it logs in as the admin
    cluster = start_redis_cluster(tmp_path / "cluster", primaries=1, replicas=1, config=creds.redis_config,
                                  auth=creds.redis_admin, extra=["--repl-diskless-sync-delay", "0"])
    try:
        await redis_functions.load(creds.redis_url(REDIS_ADMIN, cluster.url))
        client = connect_redis(creds.redis_url("allocation", cluster.url))
        try:
            lease = scripts.register(client, "bus", "lease_hold")
            assert await Pipelined(client).script(lease, ["tc:allocation:{n1}:lease"], ["me", 60_000]) == 1
            assert await lease.is_function()
            with pytest.raises(NoPermissionError):
                await client.eval("return 1", 0)
            with pytest.raises(NoPermissionError):
                await client.get("tc:broker:{tc}:index")
            # The replica has the libraries from its primary; promoted, it runs them. (A manual
            # failover waits for the replica to hold all its primary wrote.)
            user, password = creds.redis_admin
            replica = sync_redis.Redis(port=int(cluster.members[1].url.rsplit(":", 1)[1].split("/")[0]),
                                       username=user, password=password)
            replica.execute_command("CLUSTER FAILOVER")
            await eventually(
                lambda: asyncio.to_thread(lambda: replica.execute_command("ROLE")[0] == b"master"))
            assert all(replica.function_list(library.name) for library in redis_functions.libraries("allocation"))
            assert await Pipelined(client).script(lease, ["tc:allocation:{n1}:lease"], ["me", 60_000]) == 1
            replica.close()
        finally:
            await client.aclose()
    finally:
        cluster.stop()


# -- the files and the wiring ----------------------------------------------------------------------


def test_files_are_private_and_passwords_survive_a_restart_with_rules_for_the_new_prefix(tmp_path):
    first = prepare(tmp_path / "c", "one")
    second = prepare(tmp_path / "c", "two")
    assert (first.nats_passwords, first.redis_passwords) == (second.nats_passwords, second.redis_passwords)
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700
    for path in (tmp_path / "c").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert '"two.resource.>"' in second.nats_config.read_text() and "one." not in second.nats_config.read_text()
    assert "~two:allocation:*" in second.redis_acl.read_text()
    assert read_creds_file(second.nats_creds("broker")) == ("broker", second.nats_passwords["broker"])
    assert {name: i.role for name, i in second.identities.items()} == {"admin": Role.ADMIN, "dashboard": Role.READER}
    assert second.identities == first.identities  # the same passwords: creds files handed out stay valid


def test_berth_user_adds_lists_and_removes_identities_of_a_state_folder(tmp_path):
    """`berth user` on a state folder (no server running: the configuration is written for the next
    start), keeping the prefix `berth up` used."""
    import subprocess
    import sys

    prepare(tmp_path / "credentials", "kept")

    def berth(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "berth.cli", "user", "--state", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=60)

    added = berth("add", "alice", "--role", "tenant")
    assert added.returncode == 0, added.stderr
    creds = load(tmp_path / "credentials")
    alice = creds.identities["alice"]
    assert alice.role == Role.TENANT and alice.password not in added.stdout  # the file's path, never the password
    assert f"BERTH_NATS_CREDS={creds.nats_creds('alice')}" in added.stdout
    assert read_creds_file(creds.nats_creds("alice")) == ("alice", alice.password)
    config = creds.nats_config.read_text()
    assert '"tenant_alice"' in config and '"kept.resource.>"' in config
    assert berth("add", "alice", "--role", "reader").returncode == 0  # a new role, the same password
    assert load(tmp_path / "credentials").identities["alice"] == accounts.Identity("alice", Role.READER, alice.password)
    listed = berth("list").stdout.splitlines()
    assert [line.split()[:2] for line in listed[1:]] == [["admin", "admin"], ["alice", "reader"], ["dashboard", "reader"]]
    for bad in ("allocation", "resource", "a.b", "x" * 65):
        refused = berth("add", bad, "--role", "tenant")
        assert refused.returncode != 0 and "berth user:" in refused.stderr, bad
    assert berth("remove", "alice").returncode == 0
    assert "alice" not in load(tmp_path / "credentials").identities and not creds.nats_creds("alice").exists()
    assert berth("remove", "alice").returncode != 0


def test_a_worker_gets_no_secret_on_its_command_line(tmp_path):
    creds = prepare(tmp_path / "c", "p")
    argv, env = creds.worker_launch("broker", "nats://127.0.0.1:1", "redis://127.0.0.1:2/0")
    assert not any(pw in arg for arg in argv for pw in (*creds.nats_passwords.values(), *creds.redis_passwords.values()))
    assert argv[argv.index("--nats-creds") + 1] == str(creds.nats_creds("broker"))
    assert env == {"REDIS_URL": f"redis://broker:{creds.redis_passwords['broker']}@127.0.0.1:2/0"}
    # `berth worker` too: a URL that carries a password goes in the environment
    from berth.cli import _url_args

    given = argparse.Namespace(nats="nats://u:secret@127.0.0.1:1", redis="redis://127.0.0.1:2/0", prefix="p")
    argv, env = _url_args(given)
    assert argv == ["--prefix", "p", "--redis", "redis://127.0.0.1:2/0"] and env["NATS_URL"] == given.nats
    cluster = creds.redis_url("metrics", "redis+cluster://127.0.0.1:1,127.0.0.1:2")
    assert cluster == f"redis+cluster://metrics:{creds.redis_passwords['metrics']}@127.0.0.1:1,127.0.0.1:2"


def test_the_streams_and_subjects_the_permissions_name_are_the_services_own():
    from berth.registry import available

    assert set(available()) <= set(accounts.SERVICES)
    for service, name in available().items():
        module = importlib.import_module(name)
        assert module.STREAM.name == accounts.STREAM[service]
        assert {subject.split(".")[0] for subject in module.STREAM.subjects} == {accounts.EVENT_TOKEN[service]}
        tokens = {command.subject.split(".")[0] for command in module.COMMANDS}
        assert tokens == {accounts.COMMAND_TOKEN[service]}
        assert {pattern.split(".")[0] for pattern in module.EVENTS} == {accounts.EVENT_TOKEN[service]}
