"""Connecting to NATS the way a long-running worker should.

Workers reconnect forever and ping every second (three missed pings: the link is dead, connect
again), so a restarted nats-server or a silent link costs seconds, not a crash; disconnects,
reconnects and asynchronous errors (slow consumers above all) are logged, never silent. A NATS cluster is given as a comma-separated list of URLs; the client also learns
the other servers from the one it reaches, and moves to another when its server goes away.
Credentials come as `user`/`password` options or in the URLs (`nats://user:password@host:port`).
`tls://` URLs check the server's certificate against the CA file in `tls_ca` or `BERTH_TLS_CA`
(the one `berth up` makes), else against the system's CAs. A worker's own inbox root
(`inbox_prefix`, which the permissions `berth up` writes expect) and `--nats-creds` files are here too.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError, SlowConsumerError

log = logging.getLogger("berth.bus")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def _not_tls_eof_notice(record: logging.LogRecord) -> bool:
    """False for asyncio's "returning true from eof_received() has no effect when using ssl": nats-py
    upgrades a connection to TLS after connecting, so its stream protocol does not know it is over
    TLS, and asyncio says so each time a server closes a TLS connection (every clean stop of
    `berth up`, every worker's or client's close). Harmless, and it would reach every user of the
    Python client through logging's last-resort handler."""
    return not str(record.msg).startswith("returning true from eof_received()")


logging.getLogger("asyncio").addFilter(_not_tls_eof_notice)


def nats_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("NATS_URL") or DEFAULT_NATS_URL


async def connect(
    url: str | None = None, *, name: str = "berth", worker: bool = True, tls_ca: str | None = None, **options
) -> Client:
    """Open a NATS connection. `worker=False` suits short-lived clients: they give up after a few tries."""
    nc: Client | None = None

    async def on_error(error: Exception) -> None:
        if isinstance(error, SlowConsumerError):
            log.error("slow consumer on %s (sid %s): messages were dropped", error.subject, error.sid)
        else:
            log.error("nats error: %r", error)

    async def on_disconnect() -> None:
        if nc is not None and nc.is_closed:  # closed (a drain, a stop): nats-py calls this on the way out too
            log.debug("nats connection closed")
        else:
            log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.warning("nats reconnected to %s", nc.connected_url.netloc if nc and nc.connected_url else "?")

    settings = dict(
        servers=[server.strip() for server in nats_url(url).split(",")],  # a cluster: several URLs
        name=name,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        ping_interval=1 if worker else 5,
        max_outstanding_pings=3,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1 if worker else 3,
        allow_reconnect=True,
        connect_timeout=5,
    )
    settings.update(url_credentials(settings["servers"]))
    settings.update(_tls_context(settings["servers"], tls_ca))
    settings.update(options)
    nc = await nats.connect(**settings)
    return nc


def _tls_context(servers: list[str], tls_ca: str | None) -> dict[str, ssl.SSLContext]:
    """nats-py's `tls` option for `tls://` servers whose CA is given (nats-py's default context
    knows the system's CAs only)."""
    ca = tls_ca or os.environ.get("BERTH_TLS_CA")
    if not ca or not any(server.startswith("tls://") for server in servers):
        return {}
    return {"tls": ssl.create_default_context(cafile=ca)}


def url_credentials(servers: list[str]) -> dict[str, str]:
    """`user`/`password` options from the first URL that carries `user:password@`.

    nats-py sends a URL's credentials to that server only; a cluster's other servers, learned from
    the one it reaches, would get none. As options, they go to whichever server it connects to."""
    for server in servers:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        if parts.username is not None and parts.password is not None:
            return {"user": unquote(parts.username), "password": unquote(parts.password)}
    return {}


# -- a worker's inbox root, and creds files (`--nats-creds`, as `berth up` writes them) ------------


def inbox_prefix(prefix: str, service: str, node: str | None = None) -> str:
    """The inbox root of a service's own requests (nats-py `inbox_prefix`), private to it; a node
    agent's is its node's (`_INBOX_P-agent.<node>`): no agent reads another's answers."""
    root = f"_INBOX_{prefix}-{service}"
    return f"{root}.{node}" if node else root


def read_creds_file(path: str | Path) -> tuple[str, str]:
    """(user, password) from a `--nats-creds` file."""
    values = creds_values(path)
    return values["user"], values["password"]


def creds_values(path: str | Path) -> dict[str, str]:
    """A `--nats-creds` file's values: `user=...` and `password=...` lines, and `node=...` for a
    node agent's identity."""
    values: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    if "user" not in values or "password" not in values:
        raise ValueError(f"{path}: expected user=... and password=... lines")
    return values


async def subscriptions_in_place(nc: Client, timeout: float = 10.0, *, as_client: bool = False) -> None:
    """Return once the server has registered every subscription this connection asked for so far.

    `nc.flush()` is not enough: nats-py writes its PING straight to the socket, while SUB commands
    wait in the client's pending buffer for its flusher task. A flush right after a run of
    `subscribe` calls (as `Service.start` makes) can thus get its PONG before the server has seen
    the SUBs, and a request sent by another client at that moment gets "no responders".

    A request, though, goes through the same buffer as the SUBs, behind them, and the server handles
    one connection's commands in order: a request that nobody serves comes back as "no responders"
    once every subscription before it is in place. It goes to a fresh subject under this
    connection's own inbox or, `as_client`, to a `$SRV.PING` of a service that does not exist:
    `berth up`'s client user may publish on `$SRV.>` but not on `_INBOX.>`.
    """
    unserved = nc.new_inbox()
    if as_client:
        unserved = "$SRV.PING." + unserved.rsplit(".", 1)[-1]
    try:
        await nc.request(unserved, b"", timeout=timeout)
    except NoRespondersError:
        return
