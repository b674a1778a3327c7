"""A deployment as `berth up` makes it, for the tests of identities, roles and ownership: a
nats-server with berth's accounts (berth/accounts.py), a redis-server with the services' ACL
users and berth's Redis Functions loaded, real workers on their own users, and a connection per
identity.

    d = Deployment(tmp_path, {"alice": Role.TENANT, "bob": Role.TENANT})
    d.start_workers()
    alice = await d.client("alice")           # a BusClient speaking as alice
    await alice.request("resource.allocate", {...})
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis as sync_redis
from nats.aio.client import Client

from berth import redis_functions, streams
from berth.accounts import STREAMS_ADMIN
from berth.credentials import Credentials, prepare
from berth.servers import reload_nats, set_redis_users, start_nats, start_redis
from bus.callers import Role
from bus.client import BusClient
from bus.connection import connect
from schemas.errors import BusError
from tests.agent_hosts import fake_host
from tests.broker_helpers import CATALOG
from tests.worker_helpers import Worker, start_worker, stop_workers

NODE = "acc-node"  # the metrics worker's node
# Who the tenancy tests speak as, besides the admin: two tenants and a reader.
IDENTITIES = {"alice": Role.TENANT, "bob": Role.TENANT, "watcher": Role.READER}


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


class Deployment:
    def __init__(self, directory: Path, identities: dict[str, Role] | None = None) -> None:
        self.directory = directory
        self.prefix = f"t{uuid.uuid4().hex[:10]}"
        creds = prepare(directory / "credentials", self.prefix, redis_functions=True)
        for name, role in (identities or {}).items():
            creds = creds.with_identity(name, role)
        creds.write()
        self.creds: Credentials = creds
        self.workers: list[Worker] = []
        self._connections: list[Client] = []
        self.nats = start_nats(directory / "nats", config=creds.nats_config)
        try:
            self.redis = start_redis(directory / "redis", appendonly=False, config=creds.redis_config)
            with self.redis_admin() as admin:  # as `berth up` loads them (sync: a test may run in a loop)
                for library in redis_functions.every_library():
                    admin.function_load(library.code, replace=True)
            self.set_up_streams()
        except BaseException:  # no server of a deployment that never started is left behind
            self.nats.stop()
            if hasattr(self, "redis"):
                self.redis.stop()
            raise

    def set_up_streams(self) -> None:
        """As `berth up` does before its workers (in memory, as the test workers' `--memory-stream`):
        no worker's user may set a stream up."""
        password = self.creds.nats_password(STREAMS_ADMIN)
        setting_up = streams.set_up(self.nats.url, self.prefix, user=STREAMS_ADMIN, password=password, memory=True)
        with ThreadPoolExecutor(1) as pool:  # a test may call it from its event loop
            pool.submit(asyncio.run, setting_up).result()

    def start_workers(self, *extra_broker: str) -> None:
        """The three services, each on its own NATS and Redis user, as `berth up` starts them."""
        launches = [
            ("allocation", []),
            ("broker", ["--catalog", str(CATALOG), *extra_broker]),
            ("metrics", ["--node", NODE, "--interval", "1"]),
        ]
        self.services = [service for service, _ in launches]
        with ThreadPoolExecutor(len(launches)) as pool:
            list(pool.map(lambda launch: self.start_worker(*launch), launches))

    def start_worker(self, service: str, extra: Sequence[str] = (), env: dict[str, str] | None = None,
                     user: str | None = None) -> Worker:
        """One worker of `service` on the service's own NATS and Redis user, or `user`'s (`env`: more
        of its environment, as `BERTH_FAILPOINTS`); stopped with the deployment."""
        argv, own_env = self.creds.worker_launch(user or service, self.nats.url, self.redis.url)
        nats, redis = own_env.pop("NATS_URL", self.nats.url), own_env.pop("REDIS_URL", self.redis.url)
        own = argv[argv.index("--prefix") + 2:]  # worker_launch's options after the prefix
        worker = start_worker(f"services.{service}.worker", nats, redis, self.prefix, *own, *extra,
                              env={**own_env, **(env or {})})
        self.workers.append(worker)  # from the pool's threads too: an append is atomic
        return worker

    def start_agent(self, node: str, *labels: str, identity: str | None = None, **host) -> Worker:
        """A `berth agent` for `node` as `identity` (default: `node`'s own agent identity, made if
        missing), on a fake host tree of the shape `host` asks (tests/agent_hosts.py), with
        `labels` ("city=sz")."""
        if identity is None:
            identity = node
            if self.creds.agent_of(node) is None:
                self.add_identity(node, Role.AGENT, node)
        root = fake_host(self.directory / f"{node}-host", **host)
        extra = ["--node", node, "--root", str(root), "--no-cgroups", "--state", str(self.directory / f"{node}-state"),
                 "--catalog", str(CATALOG), "--heartbeat", "0.5", "--interval", "1", "--stop-grace", "1",
                 *(arg for label in labels for arg in ("--label", label))]
        return self.start_worker("agent", extra, user=identity)

    def add_identity(self, name: str, role: Role, node: str | None = None) -> None:
        """As `berth user add`: written, and the running servers told."""
        self.creds = self.creds.with_identity(name, role, node)
        self.creds.write()
        self.reload(name)

    def reload(self, name: str) -> None:
        """The servers told of identity `name`, as `berth user` tells them."""
        assert reload_nats(self.directory) == 1
        admin = self.creds.redis_admin
        assert set_redis_users(self.redis.url, admin, {name: self.creds.redis_user_of(name)}) == 1

    def remove_identity(self, name: str) -> None:
        self.creds = self.creds.without_identity(name)
        self.creds.write()
        self.reload(name)

    async def connect(self, user: str, errors: Errors | None = None, **options) -> Client:
        """A connection as `user` (an identity, or a service's user)."""
        if errors is not None:
            options["error_cb"] = errors.callback
        nc = await connect(self.creds.nats_url(user, self.nats.url), name=f"test-{user}", worker=False, **options)
        self._connections.append(nc)
        return nc

    async def client(self, user: str, timeout: float = 10.0) -> BusClient:
        return BusClient(await self.connect(user), prefix=self.prefix, timeout=timeout)

    def jetstream(self, nc: Client):
        """The streams' JetStream API as an identity reaches it (berth/accounts.py `js_api`)."""
        return nc.jetstream(domain=self.prefix)

    def redis_admin(self) -> sync_redis.Redis:
        user, password = self.creds.redis_admin
        return sync_redis.Redis(port=self.redis_port, username=user, password=password)

    def redis_as(self, user: str) -> sync_redis.Redis:
        """A connection as Redis user `user`: a service's, or a node agent's identity."""
        agent = self.creds.identities.get(user)
        password = agent.password if agent is not None else self.creds.redis_passwords[user]
        return sync_redis.Redis(port=self.redis_port, username=user, password=password)

    @property
    def redis_port(self) -> int:
        return int(self.redis.url.rsplit(":", 1)[1].split("/")[0])

    async def close_connections(self) -> None:
        for nc in self._connections:
            if not nc.is_closed:
                await nc.close()
        self._connections.clear()

    def stop(self) -> None:
        stop_workers(self.workers)
        self.nats.stop()
        self.redis.stop()


@contextmanager
def deployed(directory: Path, *broker_args: str) -> Iterator[Deployment]:
    """A deployment of `IDENTITIES` with its workers running, stopped afterwards."""
    d = Deployment(directory, IDENTITIES)
    try:
        d.start_workers(*broker_args)
        yield d
    finally:
        d.stop()


async def refused(call: Awaitable, code: str = "permission_denied") -> BusError:
    """The error `call` is refused with, which must have `code`."""
    with pytest.raises(BusError) as caught:
        await call
    assert caught.value.code == code, caught.value
    return caught.value
