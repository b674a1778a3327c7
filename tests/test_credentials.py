"""Credentials (services/credentials.py): a nats-server and a redis-server started with the users
`berth up` writes, with berth's Redis Functions loaded as `berth up` loads them, real workers on
their own users, and what a user without rights cannot do.

The three workers take their NATS user three ways: allocation a creds file (`--nats-creds`), the
broker NATS_USER/NATS_PASSWORD, metrics `user:password@` in the URL; each its own Redis URL.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import socket
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import pytest_asyncio
import redis as sync_redis
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js.errors import NotFoundError
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from bus import discovery, scripts
from bus.client import BusClient
from bus.connection import connect, subscriptions_in_place
from bus.redis import Pipelined, connect_redis
from bus.scripts import FunctionMissing
from services import credentials, redis_functions
from services.credentials import REDIS_ADMIN, inbox_prefix, prepare
from services.servers import start_nats, start_redis, start_redis_cluster
from tests.broker_helpers import CATALOG, HTTP, SERVER
from tests.bus_helpers import until
from tests.conftest import start_worker, stop_workers

NODE = "cred-node"


class Deployment:
    def __init__(self, directory: Path) -> None:
        self.prefix = f"t{uuid.uuid4().hex[:10]}"
        self.creds = prepare(directory / "credentials", self.prefix, redis_functions=True)
        self.nats = start_nats(directory / "nats", config=self.creds.nats_config)
        self.redis = start_redis(directory / "redis", appendonly=False, config=self.creds.redis_config)
        asyncio.run(redis_functions.load(self.creds.redis_url(REDIS_ADMIN, self.redis.url)))
        self.workers = []

    def start_workers(self) -> None:
        c, p = self.creds, self.prefix
        launches = [
            ("services.allocation.worker", self.nats.url, c.redis_url("allocation", self.redis.url),
             ["--nats-creds", str(c.nats_creds("allocation"))], None),
            ("services.broker.worker", self.nats.url, c.redis_url("broker", self.redis.url), ["--catalog", str(CATALOG)],
             {"NATS_USER": "broker", "NATS_PASSWORD": c.nats_passwords["broker"]}),
            ("services.metrics.worker", c.nats_url("metrics", self.nats.url), c.redis_url("metrics", self.redis.url),
             ["--node", NODE, "--interval", "1"], None),
        ]
        with ThreadPoolExecutor(len(launches)) as pool:
            started = [pool.submit(start_worker, module, nats, redis, p, *args, env=env)
                       for module, nats, redis, args, env in launches]
            self.workers = [future.result() for future in started]

    def admin(self) -> sync_redis.Redis:
        user, password = self.creds.redis_admin
        return sync_redis.Redis(port=self.redis_port, username=user, password=password)

    def redis_as(self, user: str) -> sync_redis.Redis:
        return sync_redis.Redis(port=self.redis_port, username=user, password=self.creds.redis_passwords[user])

    @property
    def redis_port(self) -> int:
        return int(self.redis.url.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        stop_workers(self.workers)
        self.nats.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("credentials"))
    try:
        d.start_workers()
        yield d
    finally:
        d.stop()


class Errors:
    """A NATS connection's asynchronous errors (permissions violations), to wait for."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    async def callback(self, error: Exception) -> None:
        await self.queue.put(str(error).lower())

    async def expect(self, *fragments: str, timeout: float = 5.0) -> str:
        async with asyncio.timeout(timeout):
            while True:
                message = await self.queue.get()
                if all(fragment.lower() in message for fragment in fragments):
                    return message


async def connect_as(d: Deployment, user: str, errors: Errors | None = None, **options):
    if user != credentials.CLIENT:
        options.setdefault("inbox_prefix", inbox_prefix(d.prefix, user))
    if errors is not None:
        options["error_cb"] = errors.callback
    return await connect(d.creds.nats_url(user, d.nats.url), name=f"test-{user}", worker=False, **options)


@pytest_asyncio.fixture
async def client_nc(deployment):
    errors = Errors()
    nc = await connect_as(deployment, "client", errors)
    nc.errors = errors
    yield nc
    await nc.close()


# -- every service works on its own users ---------------------------------------------------------


async def test_every_service_answers_the_client_user_and_writes_only_its_own_keys(deployment, client_nc):
    d, client = deployment, BusClient(client_nc, prefix=deployment.prefix, timeout=10)
    added = await client.request("resource.add-node", {"nodename": "n1", "resource": {"cpumem": {"cpu": 4, "memory": "8G"}}})
    assert added["capacity"]["cpumem"]["cpu"] == 4
    placed = await client.request("resource.allocate", {
        "nodename": "n1", "deploy_count": 2, "request_id": "creds-1",
        "workload_resource_request": {"cpumem": {"cpu-bind": True, "cpu-request": 1}},
    })
    assert [a["nodename"] for a in placed["allocations"]] == ["n1", "n1"]
    assert await client.request("broker.list-brokers", {}) == {"brokers": []}
    param = {"city": "sz", "platform": "linux", "image": SERVER, "ports": HTTP, "worker_version": "v1"}
    await client.request("broker.init", {"user": "u1", "resource_id": "r1", "param": param, "request_id": "creds-3"})
    assert (await client.request("broker.get-resource", {"user": "u1", "resource_id": "r1"}))["status"] == "init"
    synced = await client.request(f"metrics.{NODE}.has-synced", {})
    assert {"synced", "failed", "interval_seconds"} <= set(synced)
    lease = await client.request(f"metrics.{NODE}.register-notifier",
                                 {"scope": "node", "metric": "mem.total.system", "request_id": "creds-2"})
    assert lease["key"]
    # discovery works for the client user, and lists every service
    names = {ping.name for ping in await discovery.ping(client_nc)}
    assert {f"{d.prefix}-{s}" for s in credentials.SERVICES} <= names

    keys = {k.decode() for k in d.admin().scan_iter(match=f"{d.prefix}:*", count=1000)}
    for service in credentials.SERVICES:
        own = [k for k in keys if any(_glob(k, p) for p in credentials.redis_key_patterns(d.prefix, service))]
        assert {k.split(":")[1] for k in own} == {service, "idem"}, own  # records and kept answers
    patterns = [p for s in credentials.SERVICES for p in credentials.redis_key_patterns(d.prefix, s)]
    assert all(any(_glob(k, p) for p in patterns) for k in keys), keys  # nobody wrote outside its space
    calls = {name: stats["calls"] for name, stats in d.admin().info("commandstats").items()}
    assert calls["cmdstat_fcall"] > 0 and "cmdstat_evalsha" not in calls  # its scripts ran as functions


def _glob(key: str, pattern: str) -> bool:
    return key.startswith(pattern.removesuffix("*"))


# -- NATS: what the client user cannot do ---------------------------------------------------------


async def test_the_client_user_cannot_serve_a_command(deployment, client_nc):
    d = deployment
    served, unserved = f"{d.prefix}.resource.add-node", f"{d.prefix}.resource.no-such-command"
    for subject in (served, unserved):
        await client_nc.subscribe(subject)
        await client_nc.errors.expect("permissions violation for subscription", subject)
    # Refused by the server: a subject only this client would serve has no responder.
    with pytest.raises(NoRespondersError):
        await client_nc.request(unserved, msgpack.packb({}), timeout=5)
    # The same subscription by a user with the right to serve does answer (so the above is the refusal).
    allocation = await connect_as(d, "allocation")
    try:
        async def serve(msg) -> None:
            await msg.respond(b"served")

        sub = await allocation.subscribe(unserved, cb=serve)
        await subscriptions_in_place(allocation)
        assert (await client_nc.request(unserved, b"", timeout=5)).data == b"served"
        await sub.unsubscribe()
    finally:
        await allocation.close()


async def test_the_client_user_cannot_publish_a_fake_event(deployment, client_nc):
    d = deployment
    events = await client_nc.subscribe(f"{d.prefix}.events.resource.>")  # the client may watch events
    fake = f"{d.prefix}.events.resource.x.added"
    await client_nc.publish(fake, msgpack.packb({"type": "added", "time": time.time(), "nodename": "x"}))
    await client_nc.errors.expect("permissions violation for publish", fake)
    # Sentinel: allocation publishes a real event after it. Had the fake gone through, this very
    # connection would have received it first (the server handles a connection's messages in order).
    await BusClient(client_nc, prefix=d.prefix).request(
        "resource.add-node", {"nodename": "sentinel", "resource": {"cpumem": {"cpu": 1, "memory": "1G"}}}, timeout=10)
    first = await events.next_msg(timeout=5)
    assert first.subject == f"{d.prefix}.events.resource.sentinel.added"
    assert msgpack.unpackb(first.data)["nodename"] == "sentinel"
    # nor is it in the events stream (read with the client's replay rights)
    js = client_nc.jetstream()
    with pytest.raises(NotFoundError):
        await js.get_last_msg(f"{d.prefix}-events", fake)
    assert (await js.get_last_msg(f"{d.prefix}-events", first.subject)).subject == first.subject
    await events.unsubscribe()


async def test_the_client_user_replays_events_from_the_stream(deployment, client_nc):
    d, js = deployment, client_nc.jetstream()
    await BusClient(client_nc, prefix=d.prefix).request(
        "resource.add-node", {"nodename": "replayed", "resource": {"cpumem": {"cpu": 1, "memory": "1G"}}}, timeout=10)
    subject = f"{d.prefix}.events.resource.replayed.added"
    pull = await js.pull_subscribe(subject, stream=f"{d.prefix}-events")  # an ephemeral pull consumer
    [msg] = await pull.fetch(1, timeout=5)
    await msg.ack()
    assert msgpack.unpackb(msg.data)["nodename"] == "replayed"
    await pull.unsubscribe()
    ordered = await js.subscribe(subject, ordered_consumer=True)  # a push consumer on an inbox
    assert msgpack.unpackb((await ordered.next_msg(timeout=5)).data)["nodename"] == "replayed"
    await ordered.unsubscribe()
    await client_nc.flush()
    assert client_nc.errors.queue.empty()  # no call above was refused


async def test_a_client_cannot_make_a_service_answer_onto_another_service_events(deployment, client_nc):
    """Why replies are allowed by subject and not with `allow_responses`: a request names any reply
    subject, and a response permission would let allocation publish onto the broker's events."""
    d = deployment
    events = await client_nc.subscribe(f"{d.prefix}.events.broker.>")
    ping = f"$SRV.PING.{d.prefix}-allocation"
    await client_nc.publish(ping, b"", reply=f"{d.prefix}.events.broker.u.b.sold")
    # Sentinel: the same service answers a second ping, sent after it, to the client's inbox; the
    # service handles the pings in order, so the first answer, had it been let through, came first.
    assert (await client_nc.request(ping, b"", timeout=5)).data
    assert events.pending_msgs == 0
    await events.unsubscribe()


async def test_nats_refuses_a_connection_without_credentials_or_with_a_wrong_password(deployment):
    wrong = deployment.creds.nats_url("client", deployment.nats.url).replace("@", "x@")
    for url in (deployment.nats.url, wrong):
        with pytest.raises(NatsError, match="Authorization Violation"):
            await connect(url, worker=False, allow_reconnect=False, max_reconnect_attempts=0)


# -- Redis: every user in its own key space --------------------------------------------------------


def test_a_service_user_cannot_read_another_services_keys(deployment):
    d, p = deployment, deployment.prefix
    admin = d.admin()
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
    sha = d.admin().script_load("return 1")
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
            await until(lambda: asyncio.to_thread(lambda: replica.execute_command("ROLE")[0] == b"master"))
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
    assert credentials.read_creds_file(second.nats_creds("broker")) == ("broker", second.nats_passwords["broker"])


def test_a_worker_gets_no_secret_on_its_command_line(tmp_path):
    creds = prepare(tmp_path / "c", "p")
    argv, env = creds.worker_launch("broker", "nats://127.0.0.1:1", "redis://127.0.0.1:2/0")
    assert not any(pw in arg for arg in argv for pw in (*creds.nats_passwords.values(), *creds.redis_passwords.values()))
    assert argv[argv.index("--nats-creds") + 1] == str(creds.nats_creds("broker"))
    assert env == {"REDIS_URL": f"redis://broker:{creds.redis_passwords['broker']}@127.0.0.1:2/0"}
    # `berth worker` too: a URL that carries a password goes in the environment
    from services.cli import _url_args

    given = argparse.Namespace(nats="nats://u:secret@127.0.0.1:1", redis="redis://127.0.0.1:2/0", prefix="p")
    argv, env = _url_args(given)
    assert argv == ["--prefix", "p", "--redis", "redis://127.0.0.1:2/0"] and env["NATS_URL"] == given.nats
    cluster = creds.redis_url("metrics", "redis+cluster://127.0.0.1:1,127.0.0.1:2")
    assert cluster == f"redis+cluster://metrics:{creds.redis_passwords['metrics']}@127.0.0.1:1,127.0.0.1:2"


def test_the_streams_and_subjects_the_permissions_name_are_the_services_own():
    for service in credentials.SERVICES:
        module = importlib.import_module(f"services.{service}.worker")
        assert module.STREAM.name == credentials.STREAM[service]
        assert {subject.split(".")[0] for subject in module.STREAM.subjects} == {credentials.EVENT_TOKEN[service]}
        tokens = {command.subject.split(".")[0] for command in module.COMMANDS}
        assert tokens == {credentials.COMMAND_TOKEN[service]}
        assert {pattern.split(".")[0] for pattern in module.EVENTS} == {credentials.EVENT_TOKEN[service]}
