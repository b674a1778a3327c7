"""`berth call`: one request, JSON in, MessagePack on the wire, JSON out.

A state change (a command of a service's table that takes a `request_id`) is sent with one (made
for it when the payload has none) and sent again with it while the answer says nothing definite
(no reply in time, `outcome_unknown`, `busy`), until `--retry-for` seconds have passed
(bus.client's `change`, which the services answer the same way for every send of one id).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from functools import cache
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.micro.request import ERROR_CODE_HEADER

from berth.commands.connection import Connection, full_subject
from berth.commands.exits import EXIT_FAILED, EXIT_NO_ANSWER, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CommandError
from berth.commands.output import decode_msgpack, emit, to_json
from berth.commands.running import add_command
from berth.registry import contracts
from bus.client import NOT_DEFINITE, RETRY_FOR, error_from, with_request_id
from bus.codec import encode
from schemas.errors import NoResponders
from schemas.subjects import served_node


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "call",
        call_command,
        help="send one request: JSON in, MessagePack on the wire, JSON out",
        description="Send a request to a berth command and print the reply as JSON. Bytes in the reply are "
        'base64 strings. An error reply is printed as {"status", "error": {code, message, details}} '
        "on standard output, with one line on standard error.",
    )
    parser.add_argument(
        "subject", help="below the prefix (resource.add-node), or whole (berth.resource.add-node)"
    )
    parser.add_argument(
        "payload",
        nargs="?",
        default=None,
        help="the request as JSON; - reads it from standard input; default {}",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the reply (default 5)"
    )
    parser.add_argument(
        "--retry-for", type=float, default=RETRY_FOR, metavar="SECONDS",
        help="a state change is sent again, with its request_id, while no definite answer came, for this long "
        f"(default {RETRY_FOR:g}, the services' default idempotency window; 0: send it once)",
    )
    parser.add_argument("-c", "--compact", action="store_true", help="print the reply on one line")


async def _send(
    connection: Connection, nc, prefix: str, subject: str, data: bytes, timeout: float, *, definite: bool
):
    """The reply, or None when none came in time (which a retried change sends again)."""
    try:
        return await connection.unless_refused(nc.request(subject, data, timeout=timeout))
    except NoRespondersError:
        below = subject[len(prefix) + 1:] if subject.startswith(f"{prefix}.") else ""
        if node := served_node(below):
            raise CommandError(NoResponders(subject, node).message, EXIT_NO_ANSWER) from None
        raise CommandError(
            f"no service answers on {subject} (no worker of that service runs under prefix {prefix!r})",
            EXIT_NO_ANSWER,
        ) from None
    except NatsTimeout:
        if definite:
            raise CommandError(f"no reply on {subject} within {timeout:g} s", EXIT_NO_ANSWER) from None
        return None


def _error_code(msg) -> str | None:
    """The error code of a reply (None: a success), "timeout" for no reply."""
    if msg is None:
        return "timeout"
    headers = msg.headers or {}
    return error_from(headers, msg.data).code if ERROR_CODE_HEADER in headers else None


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


@cache
def _state_changes() -> list[re.Pattern[str]]:
    """The subjects (below the prefix) of every command that changes state: `<node>` is any token."""
    return [
        re.compile(re.sub(r"<[^>]+>", "[^.]+", re.escape(command.subject)))
        for tables in contracts().values() for command in tables.COMMANDS if command.idempotent
    ]


def changes_state(prefix: str, subject: str) -> bool:
    below = subject[len(prefix) + 1:] if subject.startswith(f"{prefix}.") else subject
    return any(pattern.fullmatch(below) for pattern in _state_changes())


async def call_command(args: argparse.Namespace) -> int:
    subject = full_subject(args.prefix, args.subject)
    payload = read_payload(args.payload)
    retry_for = 0.0
    if isinstance(payload, dict) and changes_state(args.prefix, subject) and args.retry_for > 0:
        payload, retry_for = with_request_id(payload), args.retry_for
    data = encode(payload)
    connection = Connection(args)
    async with connection as nc:
        give_up, pause = time.monotonic() + retry_for, 0.1
        while True:
            msg = await _send(connection, nc, args.prefix, subject, data, args.timeout, definite=retry_for == 0)
            code = _error_code(msg)
            if code is None or code not in NOT_DEFINITE or time.monotonic() + pause > give_up:
                break
            print(f"berth call: {subject}: {code or 'no reply'}; sending it again with request_id "
                  f"{payload['request_id']}", file=sys.stderr, flush=True)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
    if msg is None:
        raise CommandError(f"no reply on {subject} within {args.timeout:g} s", EXIT_NO_ANSWER)
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
