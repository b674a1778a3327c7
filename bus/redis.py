"""Redis connections for workers: one async client over a blocking pool sized to the concurrency,
and automatic pipelining of the commands concurrent requests send.

A `BlockingConnectionPool` makes a burst of requests wait for a connection instead of opening an
unbounded number of them (DESIGN.md §1). A Redis Cluster is named by listing some of its nodes:
`redis+cluster://[user:password@]host:port,host:port,...`; the client is redis-py's `RedisCluster`,
which finds the rest and follows slots as they move (a failover included). Over TLS the schemes
are `rediss://` and `rediss+cluster://`; the server's certificate is checked against the CA file
in `tls_ca` or `BERTH_TLS_CA` (the one `berth up` makes), else the system's.

A command sent on its own costs redis-py several times its share of a pipeline (pool checkout,
health check, its own write and read, a timeout context: docs/benchmarks.md, "Measurements behind the code"
has the figures). `Pipelined` gathers the commands
that concurrent tasks issue and sends them as one pipeline, so a worker serving 64 requests at
once pays the pipeline price. It keeps a bounded number of pipelines in flight: under light load
a command leaves in the next turn of the event loop; under heavy load commands gather while the
pipelines in flight are answered, so batches grow with the load and the write and read system
calls (on loopback, half of a busy worker's CPU) are paid once per batch, not once per request.
On a single Redis (not a cluster) a batch goes over a connection of its own (`RespConnections`):
hiredis packs the whole batch and parses the replies, with none of redis-py's per-command work
(argument encoding, a timeout context and a read call per reply), which took a large share of
an allocation worker's CPU.

What a failed command may have done (bus.outcome): `StoreNotReached` says it never left (no
connection could be made), `ReplyLost` that it was sent and its reply did not come (the
connection failed, or no reply within `command_timeout`: a silent link must not make a request
wait forever). Both are redis-py `ConnectionError`s.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from bus.scripts import Script

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# Seconds a command's reply may take before its link is taken for dead (every command berth sends
# is answered in milliseconds), and a connection's making.
COMMAND_TIMEOUT = 3.0
CONNECT_TIMEOUT = 2.0


class StoreNotReached(RedisConnectionError):
    """No connection to Redis could be made: the command was never sent."""


class ReplyLost(RedisConnectionError):
    """The command was sent and its reply did not come: it may have run."""


class _Reaching:
    """A redis-py connection whose failure to connect says that nothing was sent."""

    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[misc]
        except (RedisConnectionError, OSError, TimeoutError) as error:
            raise StoreNotReached(f"Redis could not be reached: {error}") from error


class ReachingConnection(_Reaching, Connection):
    pass


class ReachingSSLConnection(_Reaching, SSLConnection):
    pass


def redis_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def tls_options(url: str, tls_ca: str | None = None) -> dict[str, Any]:
    """redis-py options for a TLS URL (`rediss...`): the CA to check the server with, if one is given."""
    if not url.startswith("rediss"):
        return {}
    ca = tls_ca or os.environ.get("BERTH_TLS_CA")
    return {"ssl_ca_certs": ca} if ca else {}


def connect_redis(
    url: str | None = None, *, max_connections: int = 64, timeout: float = 10.0, tls_ca: str | None = None,
    command_timeout: float = COMMAND_TIMEOUT,
) -> Redis | RedisCluster:
    """`timeout`: how long a command waits for a free connection of the pool; `command_timeout`:
    for its reply."""
    url = redis_url(url)
    if url.startswith(CLUSTER_SCHEMES):
        return connect_cluster(url, max_connections=max_connections, tls_ca=tls_ca, command_timeout=command_timeout)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, health_check_interval=30,
        socket_timeout=command_timeout, socket_connect_timeout=CONNECT_TIMEOUT,
        connection_class=ReachingSSLConnection if url.startswith("rediss") else ReachingConnection,
        **tls_options(url, tls_ca),
    )
    return Redis(connection_pool=pool)


def connect_cluster(
    url: str, *, max_connections: int = 64, tls_ca: str | None = None, command_timeout: float = COMMAND_TIMEOUT
) -> RedisCluster:
    """`redis[s]+cluster://[user:password@]host:port,host:port,...`: any of the nodes is enough to start.

    No retries on a connection error: redis-py's cluster pipeline would send its whole batch again
    after one node failed, so a commit that a healthy node had run ran twice (the second found its
    own workload ids taken and left them behind). The error goes to the caller instead, who
    answers `unavailable`, and the client retries with its `request_id`. Redirections (MOVED, ASK)
    are followed as before: they are not retries."""
    rest = url.split("://", 1)[1]
    parts = urlsplit("redis://" + rest.split(",", 1)[0])
    hosts = rest.rsplit("@", 1)[-1].split("/", 1)[0].split(",")
    tls = tls_options(url, tls_ca)
    nodes = [ClusterNode(host.rsplit(":", 1)[0], int(host.rsplit(":", 1)[1])) for host in hosts]
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        max_connections=max_connections,
        health_check_interval=30,
        socket_timeout=command_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
        **({"ssl": True, **tls} if url.startswith("rediss") else {}),
    )


def is_cluster(redis: Redis | RedisCluster) -> bool:
    return isinstance(redis, RedisCluster)


async def ready(redis: Redis | RedisCluster) -> Redis | RedisCluster:
    """The client, ready for concurrent use: a cluster client learns the cluster's nodes and slots
    now. (redis-py does it lazily on the first command, and many first commands at once race:
    measured, 64 concurrent INCRs on a fresh RedisCluster failed with a half-made connection.)"""
    if is_cluster(redis):
        await redis.initialize()
    return redis


class RespConnections:
    """Connections to a single Redis that each send a batch of commands at once and read their
    replies back with hiredis: each reply is the command's result, or its error as redis-py's
    exception (NOSCRIPT, OOM, READONLY... keep their classes). A connection carries one batch at a
    time; a batch sent while others are in flight takes another connection. Connections are made
    by the client's own pool class, so they log in, select the database and speak TLS as the client
    does (redis-py's `_reader`/`_writer` of a connected connection are what this reads and writes).

    A connection idle longer than the pool's health check interval is pinged first, alone: a server
    that closed it meanwhile costs a new connection, never a batch sent into a dead socket.

    A connection that cannot be made raises `StoreNotReached` (nothing was sent); one that fails, or
    gives no reply within the pool's socket timeout, once the batch is written raises `ReplyLost`."""

    READ = 1 << 16

    def __init__(self, redis: Redis) -> None:
        self.pool = redis.connection_pool
        self.idle_limit = float(self.pool.connection_kwargs.get("health_check_interval") or 0)
        self.reply_timeout = self.pool.connection_kwargs.get("socket_timeout")
        self._idle: list[tuple[Any, float]] = []  # (connection, when it last answered)

    async def run(self, commands: list[tuple]) -> list[Any]:
        """The replies of `commands`, in order (an error reply is its exception, not raised). A
        connection that fails is dropped (see the class)."""
        conn = await self._take()
        try:
            replies = await self._exchange(conn, commands)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as error:
            await conn.disconnect()
            raise ReplyLost(f"Redis connection lost with {len(commands)} commands sent: {error!r}") from None
        except BaseException:
            await conn.disconnect()  # cancelled half way: replies left unread would answer the next batch
            raise
        self._idle.append((conn, asyncio.get_running_loop().time()))
        return replies

    async def _take(self):
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn, used = self._idle.pop()
            if not self.idle_limit or now - used <= self.idle_limit:
                return conn
            try:
                await self._exchange(conn, [("PING",)])
                return conn
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                await conn.disconnect()
        conn = self.pool.make_connection()
        await conn.connect()
        return conn

    async def _exchange(self, conn, commands: list[tuple]) -> list[Any]:
        conn._writer.writelines([hiredis.pack_command(command) for command in commands])
        await conn._writer.drain()
        reader, replies = hiredis.Reader(), []
        while len(replies) < len(commands):
            reply = reader.gets()
            if reply is False:
                async with asyncio.timeout(self.reply_timeout):  # not wait_for: no task per read
                    data = await conn._reader.read(self.READ)
                if not data:
                    raise asyncio.IncompleteReadError(b"", None)
                reader.feed(data)
                continue
            replies.append(BaseParser.parse_error(str(reply)) if isinstance(reply, hiredis.ReplyError) else reply)
        return replies

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.disconnect()


def _pairs_to_dict(reply: Any) -> Any:
    return dict(zip(reply[::2], reply[1::2])) if isinstance(reply, list) else reply


# What redis-py's response callbacks make of a reply, for the commands berth sends in batches: the
# rest come back as Redis sends them.
_REPLY_SHAPES = {"HGETALL": _pairs_to_dict}


class Pipelined:
    """Send the commands issued in one turn of the event loop together, in one pipeline.

        batch = Pipelined(redis)
        fields, held = await asyncio.gather(batch.execute_command("HGETALL", key), batch.script(s, keys, args))

    Commands keep their order and their own results or errors; nothing is a transaction.

    Scripts (`bus.scripts.register`) run as FCALL of their function where their library is loaded,
    else as EVALSHA, loaded by redis-py's own means. The first batch that runs a script with
    EVALSHA loads it: a plain Redis pipeline checks, before it sends, that the server holds it
    (`pipe.scripts`: SCRIPT EXISTS, and SCRIPT LOAD if missing); a Redis Cluster pipeline cannot
    (redis-py's `ClusterPipeline` has no `scripts`), so it is loaded on every primary first. Later
    batches send plain EVALSHA: checking in every batch would cost a round trip per batch (CPU
    per commit, and a round trip of latency for every scripted request, idempotency claims
    included). A command answered NOSCRIPT (the
    server lost its scripts: a restart, SCRIPT FLUSH, a failover to a replica without them) is sent
    again alone through `Script.__call__`, which has redis-py load the script and retry; so every
    command runs once. Functions are the administrator's to load: a lost one is an error that says
    so (`Script.failure`).
    """

    def __init__(self, redis: Redis | RedisCluster, *, max_batch: int = 512, max_in_flight: int = 1) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._scheduled = False
        self._queued: list[tuple[tuple[Any, ...], dict[str, Any], Script | None, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self._cluster = is_cluster(redis)
        self._loaded: set[AsyncScript] = set()  # EVALSHA scripts a batch has loaded
        self._resp = None if self._cluster else RespConnections(redis)

    @classmethod
    def of(cls, redis: Redis | RedisCluster) -> "Pipelined":
        """The one batcher of a client, shared by every store on it (the bigger the batch, the better)."""
        batcher = _batchers.get(redis)
        if batcher is None:
            batcher = _batchers[redis] = cls(redis)
        return batcher

    def execute_command(self, *args: Any, **options: Any) -> asyncio.Future:
        return self._queue(args, options, None)

    def script(self, script: Script, keys: list[Any], args: list[Any]) -> asyncio.Future:
        """Run a registered script (`bus.scripts.register`) in the next batch."""
        return self._queue((len(keys), *keys, *args), {}, script)

    def _queue(self, args: tuple, options: dict, script: Script | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued.append((args, options, script, future))
        if len(self._queued) >= self.max_batch:
            self._send(force=True)
        elif not self._scheduled and self._in_flight < self.max_in_flight:
            self._scheduled = True
            loop.call_soon(self._send)
        return future

    def _send(self, force: bool = False) -> None:
        """Send what is queued, unless enough pipelines are in flight: then the first of them to be
        answered sends it (a full batch goes at once)."""
        self._scheduled = False
        if not self._queued or (self._in_flight >= self.max_in_flight and not force):
            return
        batch, self._queued = self._queued[: self.max_batch], self._queued[self.max_batch:]
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        if self._queued and not self._scheduled:
            self._send()

    async def _run(self, batch: list) -> None:
        scripted = {script for _, _, script, _ in batch if script is not None}
        try:
            called = {script for script in scripted if await script.is_function()}
            loading = {script.evalsha for script in scripted - called} - self._loaded
            commands = [self._command(args, script, called) for args, _, script, _ in batch]
            if self._resp is not None:
                loads = [("SCRIPT", "LOAD", evalsha.script) for evalsha in loading]  # before the EVALSHAs
                results = (await self._resp.run(loads + commands))[len(loads):]
                results = [_REPLY_SHAPES.get(c[0], _same)(r) for c, r in zip(commands, results)]
            else:
                results = await self._run_cluster(batch, commands, loading)
            self._loaded |= loading
        except BaseException as error:  # the connection failed: every command of the batch failed
            for *_, future in batch:
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else ConnectionError("cancelled"))
            if not isinstance(error, Exception):
                raise
            return
        lost = []
        for (args, _, script, future), result in zip(batch, results):
            if future.done():
                continue  # its caller went away
            if isinstance(result, NoScriptError):  # not run: the server lost it (see the class docstring)
                lost.append(self._run_alone(script, args, future))
            elif isinstance(result, Exception):
                future.set_exception(result if script is None else script.failure(result))
            else:
                future.set_result(result)
        await asyncio.gather(*lost)

    @staticmethod
    def _command(args: tuple, script: Script | None, called: set[Script]) -> tuple:
        if script is None:
            return args
        return ("FCALL", script.function, *args) if script in called else ("EVALSHA", script.evalsha.sha, *args)

    async def _run_cluster(self, batch: list, commands: list[tuple], loading: set[AsyncScript]) -> list[Any]:
        """A Redis Cluster batch through redis-py's cluster pipeline, which routes each command to
        its slot's node; scripts it may run with EVALSHA are loaded on every primary first."""
        for evalsha in loading:
            await self.redis.script_load(evalsha.script)  # redis-py sends it to every primary
        async with self.redis.pipeline(transaction=False) as pipe:
            for command, (_, options, _, _) in zip(commands, batch):
                pipe.execute_command(*command, **options)
            return await pipe.execute(raise_on_error=False)

    async def _run_alone(self, script: Script, args: tuple, future: asyncio.Future) -> None:
        """Run a script on its own through redis-py, which loads it on the server again and retries."""
        count = args[0]
        try:
            result = await script(keys=args[1:1 + count], args=args[1 + count:])
        except Exception as error:
            if not future.done():
                future.set_exception(error)
        else:
            if not future.done():
                future.set_result(result)


def _same(reply: Any) -> Any:
    return reply


_batchers: "weakref.WeakKeyDictionary[Redis | RedisCluster, Pipelined]" = weakref.WeakKeyDictionary()
