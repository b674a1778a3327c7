"""A short-lived NATS client for the everyday commands; its failures become exit statuses."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, Awaitable
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoServersError

from bus.connection import connect, nats_url, url_credentials
from bus.tasks import cancel_and_wait
from services.commands.exits import EXIT_UNREACHABLE, EXIT_USAGE, CommandError
from services.credentials import read_creds_file

log = logging.getLogger("berth.cli")


def redact(url: str) -> str:
    """A URL list without passwords, for messages."""
    shown = []
    for server in url.split(","):
        parts = urlsplit(server.strip() if "://" in server else f"nats://{server.strip()}")
        if parts.password is not None:
            host = parts.netloc.rsplit("@", 1)[1]
            parts = parts._replace(netloc=f"{parts.username}:***@{host}")
        shown.append(urlunsplit(parts))
    return ",".join(shown)


class Connection:
    """A client connection whose errors are kept for the messages we print, not logged as they come
    (with -v they are logged too)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url = nats_url(args.nats)
        self.creds = args.nats_creds
        self.tls_ca = args.tls_ca
        self.errors: list[Exception] = []
        self.refused = asyncio.Event()  # the server sent a permissions violation
        self.lost = asyncio.Event()  # the connection closed (reconnecting gave up) before we closed it
        self.closing = False
        self.nc: Client | None = None
        self.user: str | None = None  # the NATS user we log in as: with berth's accounts, our identity

    async def __aenter__(self) -> Client:
        async def on_error(error: Exception) -> None:
            self.errors.append(error)
            log.info("nats: %r", error)
            if "permissions violation" in str(error).lower():
                self.refused.set()

        async def on_disconnect() -> None:
            log.info("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        async def on_closed() -> None:
            if not self.closing:
                self.lost.set()

        options: dict[str, Any] = {
            "error_cb": on_error,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            "closed_cb": on_closed,
        }
        if self.creds:
            try:
                options["user"], options["password"] = read_creds_file(self.creds)
            except (OSError, ValueError) as error:
                raise CommandError(f"--nats-creds: {error}", EXIT_USAGE) from None
        self.user = options.get("user") or url_credentials(self.url.split(",")).get("user")
        try:
            self.nc = await connect(self.url, name="berth-cli", worker=False, tls_ca=self.tls_ca, **options)
        except (NoServersError, OSError, NatsError, TimeoutError) as error:
            reason = self.errors[-1] if self.errors else error
            if "authorization" in str(reason).lower():
                hint = "it wants a user and password it knows: nats://user:password@host:port or --nats-creds"
            else:
                hint = "give --nats or set NATS_URL"
            raise CommandError(
                f"cannot connect to NATS at {redact(self.url)}: {describe(reason)} ({hint})", EXIT_UNREACHABLE
            ) from None
        return self.nc

    async def __aexit__(self, *exc: Any) -> None:
        self.closing = True
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.close()
            except Exception as error:  # closing a connection that broke: nothing left to do
                log.info("closing the NATS connection: %r", error)

    def denied(self) -> str:
        """The server's last permissions violation."""
        for error in reversed(self.errors):
            if "permissions violation" in str(error).lower():
                return str(error).removeprefix("nats: ")
        return "permissions violation"

    async def unless_refused(self, work: Awaitable[Any]) -> Any:
        """`work`'s result, or the exit with status 5 as soon as the server refuses something of
        ours (publishing the request, subscribing to its reply), or the connection is lost for
        good: then no answer would ever come."""
        task = asyncio.ensure_future(work)
        refused = asyncio.ensure_future(self.refused.wait())
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, refused, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(refused, lost)
        if not task.done():
            await cancel_and_wait(task)
            if self.refused.is_set():
                raise CommandError(f"NATS refused: {self.denied()}", EXIT_UNREACHABLE)
            raise CommandError(f"lost the connection to NATS at {redact(self.url)}", EXIT_UNREACHABLE)
        return task.result()


def describe(error: BaseException) -> str:
    text = str(error).strip().removeprefix("nats: ").strip("'")
    return text or type(error).__name__


def full_subject(prefix: str, subject: str) -> str:
    """`subject` below the prefix, unless it already starts with `<prefix>.` or `$` (as `$SRV.PING`)."""
    if subject.startswith((f"{prefix}.", "$", "_INBOX.")):
        return subject
    return f"{prefix}.{subject}"
