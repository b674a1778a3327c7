"""`berth events`: events as JSON lines, live, and replayed first with `--since`.

`berth events --since` replays from JetStream and then goes on live through the *same* consumer:
for each stream that keeps subjects of the pattern (found by subject), one pull consumer that
starts at the given time, filtered to the pattern, delivers the stored events in stream order and
then every new one as the stream stores it (`Replay`). There is no hand-over between a replay and a
live subscription, so nothing is missed or seen twice at the boundary. Subjects of the pattern that no
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
from typing import Any, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ServiceUnavailableError

from berth.accounts import CONSUMER_SLOTS, Identity, event_patterns, streams
from berth.commands.connection import Connection, describe
from berth.commands.exits import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CommandError
from berth.commands.output import decode_msgpack, emit, to_json
from berth.commands.running import add_command
from bus.callers import Role
from bus.connection import subscriptions_in_place
from bus.tasks import cancel_and_wait

log = logging.getLogger("berth.cli")

# Where an event goes: `(subject, data, **where)`, where being the stream and sequence of a replayed one.
Deliver = Callable[..., None]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "events",
        events_command,
        help="print events as JSON lines, live (and replayed with --since)",
        description="Print every event on <prefix>.events.<pattern> as a JSON line {subject, event}; lines "
        "delivered by a JetStream stream also carry {stream, seq}. With --since, events the streams "
        "kept since then come first, then the live ones, with no gap and no duplicate. Ctrl-C stops.",
    )
    parser.add_argument(
        "pattern",
        nargs="?",
        default=">",
        help="NATS subject pattern below <prefix>.events. (default >): resource.n1.*, metrics.>",
    )
    parser.add_argument(
        "--since",
        metavar="DURATION",
        help="replay from the streams first: 30s, 10m, 1h, 2d, 1h30m, or an ISO time",
    )
    parser.add_argument("--count", type=int, metavar="N", help="stop after N events")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for each JetStream API call")


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
        seconds = sum(float(amount) * _UNITS[unit] for amount, unit in _DURATION.findall(text))
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
        any(not token or any(char.isspace() for char in token) for token in tokens)
        or ">" in tokens[:-1]
        or any(token != ">" and ">" in token or token != "*" and "*" in token for token in tokens)
    ):
        raise CommandError(
            f"pattern {pattern!r} is not a NATS subject pattern (tokens, * and a final >)", EXIT_USAGE
        )
    return pattern


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS wildcard `pattern` matches the literal `subject`."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(wanted) == len(tokens)


def intersect(first: str, second: str) -> str | None:
    """The subjects two NATS patterns both match, as one pattern, or None when they share none."""
    first_tokens, second_tokens = first.split("."), second.split(".")
    out = []
    for index in range(max(len(first_tokens), len(second_tokens))):
        mine = first_tokens[index] if index < len(first_tokens) else None
        theirs = second_tokens[index] if index < len(second_tokens) else None
        if mine == ">" and theirs is not None:
            return ".".join(out + second_tokens[index:])
        if theirs == ">" and mine is not None:
            return ".".join(out + first_tokens[index:])
        if mine is None or theirs is None:
            return None
        if mine == "*" or mine == theirs:
            out.append(theirs)
        elif theirs == "*":
            out.append(mine)
        else:
            return None
    return ".".join(out)


async def streams_for(nc: Client, subject: str, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, subjects) of every stream that keeps subjects `subject` matches: asked of JetStream,
    or, where the streams live in an account of their own (`--js-domain`), berth's own streams
    (an identity may not list them)."""
    if args.js_domain:
        return [(name, subjects) for name, subjects in streams(args.prefix).items()
                if any(intersect(subject, kept) for kept in subjects)]
    try:
        msg = await nc.request(
            "$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), timeout=args.timeout
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
    js = nc.jetstream(timeout=args.timeout)
    found = []
    for name in answer.get("streams") or []:
        try:
            info = await js.stream_info(name)
        except (NatsError, NatsTimeout) as error:
            raise CommandError(f"cannot replay: stream {name}: {describe(error)}", EXIT_UNREACHABLE) from None
        found.append((name, list(info.config.subjects or [])))
    return found


class Replay:
    """One stream's events since a time, then its new ones as it stores them, through one pull
    consumer: in stream order, none missed or seen twice.

    With berth's accounts an identity may hold only the consumers named `<name>-<k>`
    (berth/accounts.py): the replay takes the first of them that is free. A consumer that goes
    away (a server restart) is made again from the next sequence."""

    BATCH = 256
    WAIT = 5.0  # seconds a fetch waits for new events
    IDLE = 30.0  # a consumer nobody fetches from is removed after this long (a killed `berth events`)

    def __init__(self, js, stream: str, filters: list[str], start: datetime, slots: list[str] | None,
                 allowed: str = "") -> None:
        self.js, self.stream, self.filters, self.slots = js, stream, filters, slots
        self.allowed = allowed  # what a refusal says may be replayed instead
        self.position: dict[str, Any] = {"deliver_policy": DeliverPolicy.BY_START_TIME, "opt_start_time": start}
        self.pull = None
        self.consumer: str | None = None

    async def open(self) -> None:
        filters = {"filter_subject": self.filters[0]} if len(self.filters) == 1 else {"filter_subjects": self.filters}
        for name in self.slots or [None]:
            if name is not None and await self._taken(name):
                continue
            config = ConsumerConfig(name=name, ack_policy=AckPolicy.NONE, inactive_threshold=self.IDLE,
                                    **filters, **self.position)
            try:
                info = await self.js.add_consumer(self.stream, config)
            except ServiceUnavailableError as error:
                if error.code is not None:  # JetStream itself is not ready: not a refusal
                    raise
                # nobody answers that subject: the identity's account has no import for it
                raise CommandError(
                    f"cannot replay {', '.join(self.filters)} from {self.stream}: not allowed (a tenant's consumers "
                    f"filter only the events it may see){self.allowed}", EXIT_UNREACHABLE) from None
            self.consumer = info.name
            self.pull = await self.js.pull_subscribe_bind(info.name, stream=self.stream)
            return
        raise CommandError(f"cannot replay from {self.stream}: every consumer of yours ({', '.join(self.slots)}) "
                           "is in use", EXIT_UNREACHABLE)

    async def _taken(self, name: str) -> bool:
        try:
            await self.js.consumer_info(self.stream, name)
            return True
        except NotFoundError:
            return False

    async def deliver(self, deliver: Deliver) -> None:
        """Fetch and hand on until cancelled."""
        while True:
            try:
                batch = await self.pull.fetch(self.BATCH, timeout=self.WAIT)
            except NatsTimeout:
                continue
            except (NotFoundError, NoRespondersError):  # the consumer is gone: again, from the next event
                log.info("the consumer on %s went away; making it again", self.stream)
                await self.pull.unsubscribe()
                await self.open()
                continue
            for msg in batch:
                sequence = msg.metadata.sequence.stream
                self.position = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": sequence + 1}
                deliver(msg.subject, msg.data, stream=self.stream, seq=sequence)

    async def close(self) -> None:
        """Unsubscribe (on a connection that goes on, as the Python client's, a pull subscription
        left behind would hold up its drain) and remove the consumer."""
        if self.pull is not None:
            try:
                await self.pull.unsubscribe()
            except Exception as error:
                log.info("unsubscribing from the consumer: %r", error)
        if self.consumer is not None:
            try:
                await self.js.delete_consumer(self.stream, self.consumer)
            except Exception as error:  # it times out by itself (IDLE)
                log.info("deleting the consumer: %r", error)


def _allowed(prefix: str, pattern: str, user: str | None) -> str:
    """For a refused replay (only a tenant's is: berth/accounts.py), the patterns its role may
    give, those within `pattern` first."""
    if not user:
        return ""
    patterns = event_patterns(prefix, Identity(user, Role.TENANT, password=""))
    within = [narrower for allowed in patterns if (narrower := intersect(pattern, allowed))]
    said = f": give one of {', '.join(patterns)}"
    return said + (f" (within {pattern}: {', '.join(within)})" if within else "")


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


class Feed:
    """The events on `subject` (a pattern below nothing: the prefix included), each handed to
    `deliver(subject, data, **where)`: with a `start`, those the streams kept since then first,
    through one `Replay` per stream, which then goes on live; a plain subscription brings the
    subjects no stream keeps. `note` is told where events will be live only. `berth events` prints
    what it delivers; `berth.Client.events` iterates it. `args` gives the prefix, the JetStream
    domain and the timeout of each JetStream call."""

    def __init__(self, connection: Connection, nc: Client, args: argparse.Namespace, subject: str,
                 start: datetime | None, deliver: Deliver, note: Callable[[str], None]) -> None:
        self.connection, self.nc, self.args, self.subject, self.start = connection, nc, args, subject, start
        self.deliver, self.note = deliver, note
        self.replays: list[Replay] = []
        self.fetching: list[asyncio.Task] = []  # the replays' deliveries: one that fails ends the feed
        self.kept: list[str] = []  # subjects the streams deliver: the live subscription skips them
        self.subscription: Subscription | None = None

    async def open(self) -> None:
        """Replay and subscribe (undone by `close`, which is due even when this fails)."""
        connection, nc, args, start = self.connection, self.nc, self.args, self.start
        if start is not None:
            kept_by = await connection.unless_refused(streams_for(nc, self.subject, args))
            if not kept_by:
                self.note(f"no stream keeps {self.subject}: live events only")
            js = nc.jetstream(timeout=args.timeout, domain=args.js_domain)
            slots = ([f"{connection.user}-{k}" for k in range(CONSUMER_SLOTS)]
                     if args.js_domain and connection.user else None)
            for name, stream_subjects in kept_by:
                filters = sorted({part for kept in stream_subjects
                                  if (part := intersect(self.subject, kept))})
                if not filters:
                    continue
                pattern = self.subject.removeprefix(f"{args.prefix}.events.")
                replay = Replay(js, name, filters, start, slots, _allowed(args.prefix, pattern, connection.user))
                try:
                    await connection.unless_refused(replay.open())
                except NotFoundError:  # berth's stream of a service that never ran
                    self.note(f"no stream {name} (yet): live events only for {', '.join(filters)}")
                    continue
                except (NatsError, NatsTimeout) as error:
                    raise CommandError(f"cannot replay from {name}: {describe(error)}", EXIT_UNREACHABLE) from None
                self.replays.append(replay)
                self.kept += stream_subjects
                log.info("replaying %s from %s since %s", filters, name, start.isoformat())
            self.fetching = [asyncio.ensure_future(replay.deliver(self.deliver)) for replay in self.replays]

        async def live(msg) -> None:
            if not any(subject_matches(stream_subject, msg.subject) for stream_subject in self.kept):
                self.deliver(msg.subject, msg.data)

        self.subscription = await nc.subscribe(self.subject, cb=live)
        await connection.unless_refused(subscriptions_in_place(nc, args.timeout, as_client=True))
        log.info("live on %s", self.subject)

    def failed(self) -> BaseException | None:
        """The error of a replay that ended."""
        for replay in self.fetching:
            if replay.done() and not replay.cancelled() and replay.exception():
                return replay.exception()
        return None

    async def close(self) -> None:
        await cancel_and_wait(*self.fetching)
        for replay in self.replays:
            await replay.close()
        if self.subscription is not None:
            try:
                await self.subscription.unsubscribe()
            except Exception as error:
                log.info("unsubscribing: %r", error)


async def events_command(args: argparse.Namespace) -> int:
    pattern = check_pattern(args.pattern)
    if args.count is not None and args.count < 1:
        raise CommandError("--count must be at least 1", EXIT_USAGE)
    start = parse_since(args.since) if args.since else None
    printer = EventPrinter(args.count)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    connection = Connection(args)
    async with connection as nc:
        feed = Feed(connection, nc, args, f"{args.prefix}.events.{pattern}", start, printer.print,
                    lambda text: print(f"berth events: {text}", file=sys.stderr, flush=True))
        try:
            await feed.open()
            waiters: list[asyncio.Task] = [asyncio.ensure_future(stop.wait()),
                                           asyncio.ensure_future(printer.done.wait())]
            waiters += feed.fetching  # a replay that fails ends the command with its error
            try:  # until Ctrl-C, --count, or the server refusing our subscriptions
                await connection.unless_refused(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED))
                if (error := feed.failed()) is not None:
                    raise error
            finally:
                await cancel_and_wait(*waiters)
        finally:
            await feed.close()
    return EXIT_OK
