"""A short-lived NATS client for the everyday commands; its failures become exit statuses."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from pathlib import Path
from typing import Any, Awaitable, Mapping
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoServersError

from berth.commands.exits import EXIT_UNREACHABLE, EXIT_USAGE, CommandError
from berth.settings import state_dir
from bus.connection import DEFAULT_NATS_URL, connect, read_creds_file, url_credentials
from bus.tasks import cancel_and_wait

log = logging.getLogger("berth.cli")

# `berth up` writes what a client needs to reach the deployment it started (the lines it prints:
# NATS_URL, REDIS_URL, BERTH_NATS_CREDS, BERTH_JS_DOMAIN, BERTH_TLS_CA, and BERTH_PREFIX) to
# `up.env` in its state folder (.berth/ of the current directory, or $BERTH_STATE), and removes it
# when it stops. The state folder rather than $XDG_RUNTIME_DIR: the file names the creds file and
# the CA that live there, and it belongs to that one deployment (two clones, each with its own
# `berth up`, never read each other's); a command run from the same folder finds it with nothing
# set. It is a shell file too: `set -a; . .berth/up.env; set +a`.
UP_ENV = "up.env"
UP_PID = "BERTH_UP_PID"  # the `berth up` that wrote it, to tell a stale file from a live one


def up_env_path(env: Mapping[str, str] | None = None) -> Path:
    return Path(state_dir(env)) / UP_ENV


def write_up_env(path: Path, values: Mapping[str, str]) -> None:
    """The file `berth up` leaves for the other commands (never a password: only names of files)."""
    lines = [f"{name}={shlex.quote(value)}" for name, value in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# written by `berth up`, removed when it stops\n" + "\n".join(lines) + "\n")
    tmp.replace(path)


def read_up_env(path: Path) -> dict[str, str] | None:
    """The variables of a `berth up` file, None if there is none (or it cannot be read)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() and not name.lstrip().startswith("#"):
            words = shlex.split(value, comments=True) if value.strip() else [""]
            values[name.strip()] = words[0] if words else ""
    return values if values.get("NATS_URL") else None


def remove_up_env(path: Path, pid: int) -> None:
    """Remove the file when it is the one `berth up` process `pid` wrote."""
    values = read_up_env(path)
    if values is not None and values.get(UP_PID) == str(pid):
        path.unlink(missing_ok=True)


def _alive(pid: str | None) -> bool:
    try:
        os.kill(int(pid or ""), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def resolve_server(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """Which NATS server (and prefix) a command asks: --nats, else NATS_URL, else the file `berth
    up` wrote in the state folder (with its creds file, CA, JS domain and prefix, each unless given),
    else the default nats://127.0.0.1:4222. `args.nats_source` says which, for the messages."""
    env = os.environ if env is None else env
    if args.nats:
        args.nats_source = "NATS_URL" if args.nats == env.get("NATS_URL") else "--nats"
    elif (path := up_env_path(env)) and (values := read_up_env(path)) is not None:
        args.nats = values["NATS_URL"]
        stale = "" if _alive(values.get(UP_PID)) else (
            f"; the `berth up` that wrote it (pid {values.get(UP_PID)}) no longer runs: remove the file or "
            "start `berth up` again")
        args.nats_source = f"{path}, written by `berth up`{stale}"
        for option, name in (("nats_creds", "BERTH_NATS_CREDS"), ("tls_ca", "BERTH_TLS_CA"),
                             ("js_domain", "BERTH_JS_DOMAIN")):
            if getattr(args, option, None) is None and values.get(name):
                setattr(args, option, values[name])
        if getattr(args, "prefix", "") is None and not env.get("BERTH_PREFIX"):
            args.prefix = values.get("BERTH_PREFIX") or None
    else:
        args.nats = DEFAULT_NATS_URL
        args.nats_source = f"the default: no --nats, NATS_URL or {up_env_path(env)}"
    if getattr(args, "prefix", "") is None:
        args.prefix = env.get("BERTH_PREFIX") or "berth"


def asked(args: argparse.Namespace) -> str:
    """The server and prefix a command asked, for its messages."""
    source = getattr(args, "nats_source", None)
    return f"{redact(args.nats)} (prefix {args.prefix}{'; from ' + source if source else ''})"


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
        if not args.nats:
            resolve_server(args)
        self.url = args.nats
        self.source = getattr(args, "nats_source", None)
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
                hint = "give --nats or set NATS_URL, or start `berth up` in this folder"
            if self.source and not self.source.startswith("--nats"):
                hint = f"from {self.source}; {hint}"
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
