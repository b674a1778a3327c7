"""`berth call`: one request, JSON in, MessagePack on the wire, JSON out."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.micro.request import ERROR_CODE_HEADER

from bus.client import error_from
from bus.codec import encode
from services.commands.connection import Connection, full_subject
from services.commands.exits import (
    EXIT_FAILED,
    EXIT_NO_ANSWER,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CommandError,
    add_command,
)
from services.commands.output import decode_msgpack, emit, to_json


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
    parser.add_argument("-c", "--compact", action="store_true", help="print the reply on one line")


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
    data = encode(read_payload(args.payload))
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
