"""Everyday commands of `berth`: `call`, `events`, `nodes` and `status`.

Each one connects to NATS as a short-lived client (`--nats`, env `NATS_URL`; `user:password@` in
the URL, or `--nats-creds FILE` as `berth up` writes them), under `--prefix` (env `BERTH_PREFIX`,
default `berth`). What a command answers goes to standard output and nothing else does: messages
about what went wrong go to standard error, and logging (also on standard error) is quiet unless
`-v` (`-vv` for debug).

Exit statuses, the same for every command:

    0  done
    1  the service refused the request: an error reply with a 4xx status (invalid_argument,
       node_not_found, insufficient_capacity, ...)
    2  usage: bad options, a payload that is not JSON, a malformed pattern or duration
    3  nobody answered: no responders on the subject (no worker of that service is running under
       this prefix), or no reply within --timeout
    4  the service failed: an error reply with a 5xx status (internal, unavailable, ...)
    5  NATS could not be reached, refused us (authorization, permissions) or was lost for good,
       or JetStream could not replay

`berth call` prints an error reply's body to standard output as JSON, with its status beside it
(`{"status": 404, "error": {"code", "message", "details"}}`), and one line on standard error.
Bytes in a reply or an event (MessagePack bin) are printed as base64 strings, as in the JSON
Schemas `berth schema` writes (msgspec's JSON encoding).

`berth events --since` replays from JetStream and then goes on live through the *same* consumer:
for each stream that keeps subjects of the pattern (found by subject), one ordered consumer that
starts at the given time, filtered to the pattern, delivers the stored events in stream order and
then every new one as the stream stores it. There is no hand-over between a replay and a live
subscription, so nothing is missed or seen twice at the boundary. Subjects of the pattern that no
stream keeps come from a plain subscription, which skips every subject a stream delivers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.micro.request import ERROR_CODE_HEADER

from bus import discovery
from bus.client import BusClient, error_from
from bus.connection import connect, nats_url, subscriptions_in_place
from bus.errors import BusError, NoResponders, RequestTimeout
from services.credentials import read_creds_file

log = logging.getLogger("berth.cli")

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NO_ANSWER = 3
EXIT_FAILED = 4
EXIT_UNREACHABLE = 5

EXIT_STATUSES = """exit status: 0 done; 1 an error reply with a 4xx status (the request was refused);
2 usage; 3 no responders or no reply in time; 4 an error reply with a 5xx status (the service
failed); 5 NATS unreachable, refusing us (authorization, permissions) or lost, or JetStream
unable to replay."""


class CommandError(Exception):
    """What the user is told on standard error, with the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# -- options, logging, connection ---------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `call`, `events`, `nodes` and `status` to the `berth` command's subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter

    call = sub.add_parser(
        "call",
        help="send one request: JSON in, MessagePack on the wire, JSON out",
        formatter_class=formatter,
        description="Send a request to a berth command and print the reply as JSON. Bytes in the reply are "
        'base64 strings. An error reply is printed as {"status", "error": {code, message, details}} '
        "on standard output, with one line on standard error.",
        epilog=EXIT_STATUSES,
    )
    call.add_argument(
        "subject", help="below the prefix (resource.add-node), or whole (berth.resource.add-node)"
    )
    call.add_argument(
        "payload",
        nargs="?",
        default=None,
        help="the request as JSON; - reads it from standard input; default {}",
    )
    call.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply (default 5)")
    call.add_argument("-c", "--compact", action="store_true", help="print the reply on one line")
    _connection_options(call)
    call.set_defaults(run=_runner(call_command))

    events = sub.add_parser(
        "events",
        help="print events as JSON lines, live (and replayed with --since)",
        formatter_class=formatter,
        description="Print every event on <prefix>.events.<pattern> as a JSON line {subject, event}; lines "
        "delivered by a JetStream stream also carry {stream, seq}. With --since, events the streams "
        "kept since then come first, then the live ones, with no gap and no duplicate. Ctrl-C stops.",
        epilog=EXIT_STATUSES,
    )
    events.add_argument(
        "pattern",
        nargs="?",
        default=">",
        help="NATS subject pattern below <prefix>.events. (default >): resource.n1.*, metrics.>",
    )
    events.add_argument(
        "--since",
        metavar="DURATION",
        help="replay from the streams first: 30s, 10m, 1h, 2d, 1h30m, or an ISO time",
    )
    events.add_argument("--count", type=int, metavar="N", help="stop after N events")
    events.add_argument("--timeout", type=float, default=5.0, help="seconds for each JetStream API call")
    _connection_options(events)
    events.set_defaults(run=_runner(events_command))

    nodes = sub.add_parser(
        "nodes",
        help="table of the allocation service's nodes",
        formatter_class=formatter,
        description="List every node (paging through resource.list-nodes): labels, CPU, memory, storage "
        "and GPUs as used/total.",
        epilog=EXIT_STATUSES,
    )
    nodes.add_argument(
        "--labels",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="only nodes with these labels (repeatable)",
    )
    nodes.add_argument("--json", action="store_true", help="a JSON document instead of the table")
    nodes.add_argument("--page-size", type=int, default=200, help="nodes asked per request (1-1000)")
    nodes.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each page")
    _connection_options(nodes)
    nodes.set_defaults(run=_runner(nodes_command))

    status = sub.add_parser(
        "status",
        help="live services: one line each (--endpoints: every endpoint of every instance)",
        formatter_class=formatter,
        epilog=EXIT_STATUSES,
        description="Ask every service instance for its statistics ($SRV.STATS) and print one line per "
        "service: instances, requests, errors, mean latency. --endpoints prints one line per endpoint "
        "of each instance.",
    )
    status.add_argument("--endpoints", action="store_true", help="one line per endpoint of each instance")
    status.add_argument("--json", action="store_true", help="a JSON document instead of the table")
    status.add_argument("--all", action="store_true", help="services of every prefix, not only --prefix's")
    status.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for the first answer")
    _connection_options(status)
    status.set_defaults(run=_runner(status_command))


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        default=os.environ.get("NATS_URL"),
        help="NATS URL(s), comma-separated; nats://user:password@host:port works (env NATS_URL)",
    )
    parser.add_argument(
        "--nats-creds",
        default=os.environ.get("BERTH_NATS_CREDS"),
        metavar="FILE",
        help="user=... and password=... lines, as .berth/credentials/client.nats (env BERTH_NATS_CREDS)",
    )
    parser.add_argument(
        "--prefix",
        default=os.environ.get("BERTH_PREFIX", "berth"),
        help="subject prefix (env BERTH_PREFIX, default berth)",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log to standard error (-vv: debug)"
    )


def _runner(command: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[..., int]:
    def run(args: argparse.Namespace, extra: list[str]) -> int:
        level = logging.ERROR if not args.verbose else logging.INFO if args.verbose == 1 else logging.DEBUG
        logging.getLogger().setLevel(level)
        for handler in logging.getLogger().handlers:  # whatever configured it, never standard output
            if getattr(handler, "stream", None) is sys.stdout:
                handler.setStream(sys.stderr)
        try:
            return asyncio.run(command(args))
        except CommandError as error:
            print(f"berth {args.command}: {error}", file=sys.stderr, flush=True)
            return error.status
        except KeyboardInterrupt:
            return 130

    return run


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
        self.errors: list[Exception] = []
        self.refused = asyncio.Event()  # the server sent a permissions violation
        self.lost = asyncio.Event()  # the connection closed (reconnecting gave up) before we closed it
        self.closing = False
        self.nc: Client | None = None

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
        try:
            self.nc = await connect(self.url, name="berth-cli", worker=False, **options)
        except (NoServersError, OSError, NatsError, TimeoutError) as error:
            reason = self.errors[-1] if self.errors else error
            if "authorization" in str(reason).lower():
                hint = "it wants a user and password it knows: nats://user:password@host:port or --nats-creds"
            else:
                hint = "give --nats or set NATS_URL"
            raise CommandError(
                f"cannot connect to NATS at {redact(self.url)}: {_reason(reason)} ({hint})", EXIT_UNREACHABLE
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
            refused.cancel()
            lost.cancel()
        if not task.done():
            task.cancel()
            if self.refused.is_set():
                raise CommandError(f"NATS refused: {self.denied()}", EXIT_UNREACHABLE)
            raise CommandError(f"lost the connection to NATS at {redact(self.url)}", EXIT_UNREACHABLE)
        return task.result()


def _reason(error: BaseException) -> str:
    text = str(error).strip().removeprefix("nats: ").strip("'")
    return text or type(error).__name__


def full_subject(prefix: str, subject: str) -> str:
    """`subject` below the prefix, unless it already starts with `<prefix>.` or `$` (as `$SRV.PING`)."""
    if subject.startswith((f"{prefix}.", "$", "_INBOX.")):
        return subject
    return f"{prefix}.{subject}"


# -- output ---------------------------------------------------------------------------------------


def _enc_hook(value: Any) -> Any:
    if isinstance(value, msgspec.msgpack.Ext):  # no berth message has any; shown rather than lost
        return {"msgpack_ext": value.code, "data": msgspec.json.decode(msgspec.json.encode(value.data))}
    raise NotImplementedError(f"cannot print a {type(value).__name__}")


_json = msgspec.json.Encoder(enc_hook=_enc_hook)


def to_json(value: Any, *, pretty: bool = False) -> str:
    """JSON text of a decoded MessagePack value: bytes as base64, maps with any scalar keys."""
    data = _json.encode(value)
    return (msgspec.json.format(data, indent=2) if pretty else data).decode()


def decode_msgpack(data: bytes) -> Any:
    """A MessagePack body as Python values; an empty body is None."""
    return msgspec.msgpack.decode(data) if data else None


def emit(text: str) -> None:
    """A line on standard output, flushed (a reader of a live tail sees it at once)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


# -- berth call -----------------------------------------------------------------------------------


def read_payload(text: str | None) -> Any:
    if text is None:
        return {}
    source = "standard input" if text == "-" else "the payload"
    if text == "-":
        text = sys.stdin.read()
    try:
        return msgspec.json.decode(text.encode() if text.strip() else b"{}")
    except msgspec.DecodeError as error:
        raise CommandError(f"{source} is not JSON: {error}", EXIT_USAGE) from None


async def call_command(args: argparse.Namespace) -> int:
    subject = full_subject(args.prefix, args.subject)
    data = msgspec.msgpack.encode(read_payload(args.payload))
    connection = Connection(args)
    async with connection as nc:
        try:
            msg = await connection.unless_refused(nc.request(subject, data, timeout=args.timeout))
        except NoRespondersError:
            raise CommandError(
                f"no service answers on {subject} "
                f"(no worker of that service runs under prefix {args.prefix!r})",
                EXIT_NO_ANSWER,
            ) from None
        except NatsTimeout:
            raise CommandError(f"no reply on {subject} within {args.timeout:g} s", EXIT_NO_ANSWER) from None
    headers = msg.headers or {}
    if ERROR_CODE_HEADER in headers:
        error = error_from(headers, msg.data)
        body = {
            "status": error.status,
            "error": {"code": error.code, "message": error.message, "details": error.details},
        }
        emit(to_json(body, pretty=not args.compact))
        print(
            f"berth call: {subject}: {error.code} ({error.status}): {error.message}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REFUSED if 400 <= error.status < 500 else EXIT_FAILED
    try:
        reply = decode_msgpack(msg.data)
    except msgspec.DecodeError:
        try:  # not a berth service: the JetStream API and `$SRV` answer JSON
            reply = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            raise CommandError(
                f"the reply on {subject} is neither MessagePack nor JSON ({len(msg.data)} bytes)", EXIT_FAILED
            ) from None
    emit(to_json(reply, pretty=not args.compact))
    return EXIT_OK


# -- berth events ---------------------------------------------------------------------------------


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """The start time (UTC) of `--since`: a duration back from now (`10m`, `1h30m`, `45` seconds)
    or an ISO time (`2026-01-02T03:04:05Z`; without a zone, UTC)."""
    now = now or datetime.now(timezone.utc)
    text = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return now - timedelta(seconds=float(text))
    if text and _DURATION.sub("", text) == "":
        seconds = sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(text))
        return now - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(
            f"--since {text!r}: give a duration (30s, 10m, 1h, 2d, 1h30m) or an ISO time", EXIT_USAGE
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def check_pattern(pattern: str) -> str:
    tokens = pattern.split(".")
    if (
        any(not t or any(c.isspace() for c in t) for t in tokens)
        or ">" in tokens[:-1]
        or any(t != ">" and ">" in t or t != "*" and "*" in t for t in tokens)
    ):
        raise CommandError(
            f"pattern {pattern!r} is not a NATS subject pattern (tokens, * and a final >)", EXIT_USAGE
        )
    return pattern


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS wildcard `pattern` matches the literal `subject`."""
    ps, ss = pattern.split("."), subject.split(".")
    for i, p in enumerate(ps):
        if p == ">":
            return len(ss) > i
        if i >= len(ss) or (p != "*" and p != ss[i]):
            return False
    return len(ps) == len(ss)


def intersect(a: str, b: str) -> str | None:
    """The subjects two NATS patterns both match, as one pattern, or None when they share none."""
    ta, tb = a.split("."), b.split(".")
    out = []
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x == ">" and y is not None:
            return ".".join(out + tb[i:])
        if y == ">" and x is not None:
            return ".".join(out + ta[i:])
        if x is None or y is None:
            return None
        if x == "*" or x == y:
            out.append(y)
        elif y == "*":
            out.append(x)
        else:
            return None
    return ".".join(out)


async def streams_for(nc: Client, subject: str, timeout: float) -> list[tuple[str, list[str]]]:
    """(name, subjects) of every stream that keeps subjects `subject` matches."""
    try:
        msg = await nc.request(
            "$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), timeout=timeout
        )
    except NoRespondersError:
        raise CommandError("cannot replay: this NATS server has no JetStream", EXIT_UNREACHABLE) from None
    except NatsTimeout:
        raise CommandError(
            "cannot replay: JetStream did not answer (permissions?)", EXIT_UNREACHABLE
        ) from None
    answer = json.loads(msg.data)
    if "error" in answer:
        raise CommandError(
            f"cannot replay: JetStream: {answer['error'].get('description')}", EXIT_UNREACHABLE
        )
    js = nc.jetstream(timeout=timeout)
    found = []
    for name in answer.get("streams") or []:
        try:
            info = await js.stream_info(name)
        except (NatsError, NatsTimeout) as error:
            raise CommandError(f"cannot replay: stream {name}: {_reason(error)}", EXIT_UNREACHABLE) from None
        found.append((name, list(info.config.subjects or [])))
    return found


class EventPrinter:
    """Prints events as JSON lines until `count` is reached; `done` is set then (or on a closed pipe)."""

    def __init__(self, count: int | None) -> None:
        self.left = count
        self.done = asyncio.Event()

    def print(self, subject: str, data: bytes, **where: Any) -> None:
        if self.done.is_set():
            return
        line: dict[str, Any] = {"subject": subject}
        try:
            line["event"] = decode_msgpack(data)
        except msgspec.DecodeError:
            line["data"] = data  # not MessagePack: its bytes, as base64
        line.update(where)
        try:
            emit(to_json(line))
        except BrokenPipeError:  # the reader went away (`| head`): stop, quietly
            sys.stdout = open(os.devnull, "w")
            self.done.set()
            return
        if self.left is not None:
            self.left -= 1
            if self.left <= 0:
                self.done.set()


async def events_command(args: argparse.Namespace) -> int:
    pattern = check_pattern(args.pattern)
    if args.count is not None and args.count < 1:
        raise CommandError("--count must be at least 1", EXIT_USAGE)
    start = parse_since(args.since) if args.since else None
    subject = f"{args.prefix}.events.{pattern}"
    printer = EventPrinter(args.count)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    subscriptions = []
    kept: list[str] = []  # subjects the streams deliver: the live subscription skips them
    connection = Connection(args)
    async with connection as nc:
        try:
            if start is not None:
                streams = await connection.unless_refused(streams_for(nc, subject, args.timeout))
                if not streams:
                    print(
                        f"berth events: no stream keeps {subject}: live events only",
                        file=sys.stderr,
                        flush=True,
                    )
                js = nc.jetstream(timeout=args.timeout)
                for name, stream_subjects in streams:
                    filters = sorted({f for s in stream_subjects if (f := intersect(subject, s))})
                    if not filters:
                        continue
                    config = ConsumerConfig(
                        deliver_policy=DeliverPolicy.BY_START_TIME,
                        opt_start_time=start,
                        **(
                            {"filter_subject": filters[0]}
                            if len(filters) == 1
                            else {"filter_subjects": filters}
                        ),
                    )

                    async def deliver(msg, name=name) -> None:
                        printer.print(msg.subject, msg.data, stream=name, seq=msg.metadata.sequence.stream)

                    try:
                        subscriptions.append(
                            await connection.unless_refused(
                                js.subscribe(
                                    filters[0], stream=name, config=config, ordered_consumer=True, cb=deliver
                                )
                            )
                        )
                    except (NatsError, NatsTimeout) as error:
                        raise CommandError(
                            f"cannot replay from {name}: {_reason(error)}", EXIT_UNREACHABLE
                        ) from None
                    # The consumer exists. Should the ordered consumer ever restart it (after a missed
                    # heartbeat), it starts from the next sequence, where a start time is not allowed.
                    config.opt_start_time = None
                    kept += stream_subjects
                    log.info("replaying %s from %s since %s", filters, name, start.isoformat())

            async def live(msg) -> None:
                if not any(subject_matches(s, msg.subject) for s in kept):
                    printer.print(msg.subject, msg.data)

            subscriptions.append(await nc.subscribe(subject, cb=live))
            await connection.unless_refused(subscriptions_in_place(nc, args.timeout, as_client=True))
            log.info("live on %s", subject)
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(printer.done.wait())]
            try:  # until Ctrl-C, --count, or the server refusing our subscriptions
                await connection.unless_refused(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED))
            finally:
                for waiter in waiters:
                    waiter.cancel()
        finally:
            for subscription in subscriptions:
                try:
                    await subscription.unsubscribe()
                except Exception as error:
                    log.info("unsubscribing: %r", error)
    return EXIT_OK


# -- berth nodes ----------------------------------------------------------------------------------


def parse_labels(values: list[str]) -> dict[str, str]:
    labels = {}
    for value in values:
        for pair in filter(None, (p.strip() for p in value.split(","))):
            key, sep, label = pair.partition("=")
            if not sep or not key:
                raise CommandError(f"--labels {pair!r}: give key=value", EXIT_USAGE)
            labels[key] = label
    return labels


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def node_row(node: dict[str, Any]) -> dict[str, Any]:
    """A node's figures: {used, total} of cpu, memory and storage (bytes), gpu (count, per product)."""
    capacity, usage = node.get("capacity") or {}, node.get("usage") or {}

    def pair(plugin: str, field: str) -> dict[str, Any] | None:
        total = _number((capacity.get(plugin) or {}).get(field))
        if total is None:
            return None
        return {"used": _number((usage.get(plugin) or {}).get(field)) or 0, "total": total}

    gpu = None
    products = (capacity.get("gpu") or {}).get("prod_count_map")
    if isinstance(products, dict):
        used = (usage.get("gpu") or {}).get("prod_count_map") or {}
        per_product = {p: {"used": used.get(p, 0), "total": n} for p, n in sorted(products.items())}
        gpu = {
            "used": sum(v["used"] for v in per_product.values()),
            "total": sum(v["total"] for v in per_product.values()),
            "products": per_product,
        }
    return {
        "nodename": node.get("nodename"),
        "labels": node.get("labels") or {},
        "cpu": pair("cpumem", "cpu"),
        "memory": pair("cpumem", "memory"),
        "storage": pair("storage", "storage"),
        "gpu": gpu,
    }


def _amount(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def human_bytes(value: float) -> str:
    for unit in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if abs(value) < 1024 or unit == "Pi":
            return f"{value:.1f}".rstrip("0").rstrip(".") + unit if unit else str(int(value))
        value /= 1024
    return str(value)


def format_nodes(rows: list[dict[str, Any]], total: int) -> str:
    def used_total(entry: dict[str, Any] | None, show: Callable[[Any], str]) -> str:
        return f"{show(entry['used'])}/{show(entry['total'])}" if entry else "-"

    if not rows:
        return "no node"
    table = [
        (
            row["nodename"],
            ",".join(f"{k}={v}" for k, v in sorted(row["labels"].items())) or "-",
            used_total(row["cpu"], _amount),
            used_total(row["memory"], human_bytes),
            used_total(row["storage"], human_bytes),
            used_total(row["gpu"], _amount),
        )
        for row in rows
    ]
    lines = format_table(("name", "labels", "cpu", "memory", "storage", "gpu"), table)
    lines.append(f"{len(rows)} nodes" + (f" of {total}" if total != len(rows) else ""))
    return "\n".join(lines)


async def nodes_command(args: argparse.Namespace) -> int:

    labels = parse_labels(args.labels)
    if not 1 <= args.page_size <= 1000:
        raise CommandError("--page-size must be between 1 and 1000", EXIT_USAGE)
    nodes: list[dict[str, Any]] = []
    total = 0
    connection = Connection(args)
    async with connection as nc:
        client = BusClient(nc, prefix=args.prefix, timeout=args.timeout)
        offset: int | None = 0
        while offset is not None:
            request = {"offset": offset, "limit": args.page_size, **({"labels": labels} if labels else {})}
            try:
                page = await connection.unless_refused(client.request("resource.list-nodes", request, dict))
            except NoResponders:
                raise CommandError(
                    f"no allocation service answers on {client.subject('resource.list-nodes')} "
                    f"(is `berth worker allocation` running under prefix {args.prefix!r}?)",
                    EXIT_NO_ANSWER,
                ) from None
            except RequestTimeout as error:
                raise CommandError(error.message, EXIT_NO_ANSWER) from None
            except BusError as error:
                if error.code == "node_not_found" and error.field == "labels":
                    break  # no node has these labels: an empty listing
                raise CommandError(
                    f"{error.code} ({error.status}): {error.message}",
                    EXIT_REFUSED if 400 <= error.status < 500 else EXIT_FAILED,
                ) from None
            nodes += page.get("nodes") or []
            total = page.get("total", len(nodes))
            following = page.get("next_offset")
            offset = following if isinstance(following, int) and following > offset else None
    rows = [node_row(node) for node in nodes]
    if args.json:
        emit(to_json({"nodes": rows, "total": total}, pretty=True))
    else:
        emit(format_nodes(rows, total))
    return EXIT_OK


# -- berth status ---------------------------------------------------------------------------------


def _ms(nanoseconds: float) -> float:
    return round(nanoseconds / 1e6, 3)


def of_prefix(name: str, prefix: str) -> bool:
    """Whether a service name (`<prefix>-<service>`) belongs to `prefix` (not to `<prefix>-x`)."""
    return name.startswith(f"{prefix}-") and "-" not in name[len(prefix) + 1 :]


def summarize(instances: list) -> list[dict[str, Any]]:
    services: dict[str, dict[str, Any]] = {}
    for inst in instances:
        entry = services.setdefault(
            inst.name,
            {"name": inst.name, "instances": 0, "requests": 0, "errors": 0, "processing_ns": 0, "ids": []},
        )
        entry["instances"] += 1
        entry["ids"].append(inst.id)
        for ep in inst.endpoints:
            entry["requests"] += ep.num_requests
            entry["errors"] += ep.num_errors
            entry["processing_ns"] += ep.processing_time or 0
    out = []
    for entry in sorted(services.values(), key=lambda e: e["name"]):
        ns = entry.pop("processing_ns")
        entry["mean_ms"] = _ms(ns / entry["requests"]) if entry["requests"] else None
        out.append(entry)
    return out


def format_services(services: list[dict[str, Any]]) -> str:
    rows = [
        (
            s["name"],
            str(s["instances"]),
            str(s["requests"]),
            str(s["errors"]),
            f"{s['mean_ms']:.3f}" if s["mean_ms"] is not None else "-",
        )
        for s in services
    ]
    lines = format_table(("service", "instances", "requests", "errors", "mean ms"), rows)
    lines.append(f"{len(services)} services, {sum(s['instances'] for s in services)} instances")
    return "\n".join(lines)


def endpoint_entries(instances: list) -> list[dict[str, Any]]:
    return [
        {
            "name": inst.name,
            "id": inst.id,
            "version": inst.version,
            "started": inst.started.isoformat() if hasattr(inst.started, "isoformat") else str(inst.started),
            "endpoints": [
                {
                    "name": ep.name,
                    "subject": ep.subject,
                    "requests": ep.num_requests,
                    "errors": ep.num_errors,
                    "mean_ms": _ms(ep.average_processing_time or 0) if ep.num_requests else None,
                    "last_error": ep.last_error or None,
                }
                for ep in sorted(inst.endpoints, key=lambda e: e.subject)
            ],
        }
        for inst in instances
    ]


def format_endpoints(instances: list[dict[str, Any]]) -> str:
    rows = [
        (
            inst["name"],
            inst["id"],
            ep["subject"],
            str(ep["requests"]),
            str(ep["errors"]),
            f"{ep['mean_ms'] or 0:.3f}",
        )
        for inst in instances
        for ep in inst["endpoints"]
    ]
    lines = format_table(("service", "instance", "endpoint", "requests", "errors", "avg ms"), rows)
    lines.append(f"{len(instances)} instances, {len(rows)} endpoints")
    return "\n".join(lines)


async def status_command(args: argparse.Namespace) -> int:
    connection = Connection(args)
    async with connection as nc:
        instances = await connection.unless_refused(discovery.stats(nc, timeout=args.timeout))
    if not args.all:
        instances = [inst for inst in instances if of_prefix(inst.name, args.prefix)]
    if args.endpoints:
        entries = endpoint_entries(instances)
        if args.json:
            emit(to_json({"instances": entries}, pretty=True))
        else:
            emit(format_endpoints(entries) if entries else _nobody(args))
    else:
        services = summarize(instances)
        if args.json:
            emit(to_json({"services": services}, pretty=True))
        else:
            emit(format_services(services) if services else _nobody(args))
    return EXIT_OK


def _nobody(args: argparse.Namespace) -> str:
    where = "" if args.all else f" under prefix {args.prefix!r}"
    return f"no service instance answered{where}"
