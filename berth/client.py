"""`berth.Client`: every command of every service as a typed async method, events as async iterators.

    from berth import Client

    async with await Client.connect() as berth:
        nodes = await berth.allocation.list_nodes(labels={"pool": "a"})
        placed = await berth.allocation.allocate(nodenames=["n1"], deploy_count=2,
            workload_resource_request={"cpumem": {"cpu-request": 1, "memory-request": "1G"}})
        await berth.allocation.release(workload_ids=[a.workload_id for a in placed.allocations])
        async with berth.metrics.watch("n1", "node", "cpu.usage.system") as samples:
            async for sample in samples:
                print(sample.value)

`Client.connect` finds the servers as the `berth` commands do (berth/commands/connection.py):
its keyword arguments, else NATS_URL and the BERTH_* variables (BERTH_NATS_CREDS, BERTH_TLS_CA,
BERTH_JS_DOMAIN, BERTH_PREFIX), else the `up.env` that `berth up` wrote in its state folder
(BERTH_STATE, default ./.berth), else nats://127.0.0.1:4222.

The methods (berth/_commands.py, generated from the services' command tables) take the request's
keys as keyword arguments and return the reply as the schemas' Struct; an error reply raises the
`berth.Error` of its family (berth/errors.py). A command that changes state is sent with a
`request_id` (one is made when none is given) and sent again with it while no definite answer came
(no reply in time, busy, outcome_unknown), for up to `retry_for` seconds: the service applies it once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client as Nats

from berth._base import Bus
from berth._commands import AgentCommands, AllocationCommands, BrokerCommands, MetricsCommands
from berth.commands.connection import Connection, redact, resolve_server
from berth.commands.exits import EXIT_USAGE, CommandError
from berth.errors import InvalidInput, Unavailable
from berth.events import Events, Since
from berth.settings import add_client_flags
from bus.client import DEFAULT_TIMEOUT, RETRY_FOR
from schemas.metrics import Scope
from services.metrics.client import MetricsClient, Watch


class Metrics(MetricsCommands):
    """`metrics.<node>.*`, and `watch`: a metric's new samples while an `async with` block runs."""

    def watch(self, node: str, scope: Scope, metric: str, *, lease_seconds: float | None = None,
              **ids: Any) -> Watch:
        """Register a notifier for the metric (ids as `get` takes them: core_id, pod_uid...), keep its
        lease renewed, and yield its `MetricEvent`s (`.value`, `.sample_time`); deregistered at the
        end (services/metrics/client.py)."""
        bus = self._bus
        metrics = MetricsClient(bus.nc, node, prefix=bus.prefix, timeout=bus.timeout)
        metrics.bus = bus  # its errors as berth.Errors
        return metrics.watch(scope, metric, lease_seconds=lease_seconds, **ids)


class Client:
    """A connection to one berth deployment; `async with` closes it."""

    allocation: AllocationCommands
    broker: BrokerCommands
    metrics: Metrics
    agent: AgentCommands

    def __init__(self, nc: Nats, *, prefix: str = "berth", js_domain: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, retry_for: float = RETRY_FOR,
                 connection: Connection | None = None) -> None:
        """A client over a NATS connection of your own (`Client.connect` makes one). `timeout`:
        seconds to wait for each reply (each call takes `timeout=` too); `retry_for`: how long a state
        change is sent again while no definite answer comes (0: once)."""
        self.nc = nc
        self.prefix = prefix
        self.js_domain = js_domain
        self.source: str | None = None  # where `connect` found the server (for messages)
        if connection is None:  # the events' feed asks it about refusals, which only its own connection sees
            connection = Connection(argparse.Namespace(nats=_url_of(nc), nats_creds=None, tls_ca=None))
            connection.nc = nc
        self._connection = connection
        self._owned = False  # whether close() closes the connection
        self._open_events: set[Events] = set()
        bus = Bus(nc, prefix=prefix, timeout=timeout, retry_for=retry_for)
        self.allocation = AllocationCommands(bus)
        self.broker = BrokerCommands(bus)
        self.metrics = Metrics(bus)
        self.agent = AgentCommands(bus)

    @classmethod
    async def connect(
        cls, url: str | None = None, *, creds: str | None = None, prefix: str | None = None,
        tls_ca: str | None = None, js_domain: str | None = None, timeout: float = DEFAULT_TIMEOUT,
        retry_for: float = RETRY_FOR, env: Mapping[str, str] | None = None,
    ) -> Client:
        """Connect as the `berth` commands do: each argument, else its variable (NATS_URL,
        BERTH_NATS_CREDS, BERTH_PREFIX, BERTH_TLS_CA, BERTH_JS_DOMAIN), else what `berth up` wrote in
        $BERTH_STATE/up.env (default .berth/up.env), else nats://127.0.0.1:4222 with prefix berth.
        `env`: the variables to read instead of the process's. Raises `berth.Unavailable` (code
        `unreachable`) when no server of the URL answers or it refuses us."""
        env = os.environ if env is None else env
        parser = argparse.ArgumentParser(add_help=False)
        add_client_flags(parser, env)
        parser.set_defaults(prefix=None)  # as every `berth` command: BERTH_PREFIX, else up.env's, else berth
        args = parser.parse_args([])
        given = {"nats": url, "nats_creds": creds, "tls_ca": tls_ca, "js_domain": js_domain, "prefix": prefix}
        for option, value in given.items():
            if value is not None:
                setattr(args, option, value)
        resolve_server(args, env)
        connection = Connection(args)
        try:
            nc = await connection.__aenter__()
        except CommandError as error:
            if error.status == EXIT_USAGE:
                raise InvalidInput("invalid_argument", str(error), {"field": "creds"}) from None
            raise Unavailable("unreachable", str(error), {"url": redact(args.nats), "source": args.nats_source},
                              status=503) from None
        client = cls(nc, prefix=args.prefix, js_domain=args.js_domain, timeout=timeout, retry_for=retry_for,
                     connection=connection)
        client._owned = True
        client.source = args.nats_source
        return client

    @property
    def url(self) -> str:
        return _url_of(self.nc)

    def events(self, pattern: str = ">", *, since: Since | None = None, timeout: float = 5.0) -> Events:
        """The events on `<prefix>.events.<pattern>` (`resource.*.allocated`, `broker.>`), as `Event`s:
        with `since` (a datetime, a timedelta back from now, unix seconds, or "10m", "1h30m", an ISO
        time), those the streams kept since then first, then the live ones, with no gap and no
        duplicate. `async with` it, then `async for`; `timeout`: seconds for each JetStream call."""
        return Events(self, pattern, since, timeout)

    async def close(self) -> None:
        """Stop the open event iterators; close the connection if `connect` made it."""
        for events in list(self._open_events):
            await events.aclose()
        if self._owned:
            await self._connection.__aexit__(None, None, None)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<berth.Client {redact(self.url)} prefix {self.prefix}>"


def _url_of(nc: Nats) -> str:
    url = nc.connected_url
    return url.geturl() if url is not None else "nats://(not connected)"
