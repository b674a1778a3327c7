"""A typed request/reply client.

    client = BusClient(nc, prefix="berth")
    reply = await client.request("resource.add-node", AddNode(...), AddNodeReply, timeout=2.0)

An error reply raises `BusError` with the code, message and details the service sent. The timeout
is explicit on every call (nats-py's own default, 0.5 s, is too short for real work).

A state change goes through `change`: it carries a `request_id` (one is made for it when it has
none), and is sent again with it while the answer is not definite (a timeout, `outcome_unknown`,
`busy`), with a growing pause, until an answer comes or the idempotency window has passed: the
service answers every send of one request id the same way, and applies it at most once.
`unavailable` is definite (nothing was applied), and so is every other answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from bus.codec import decode_stored, encode
from schemas.common import ErrorBody
from schemas.errors import BusError, NoResponders, RequestTimeout
from schemas.subjects import served_node

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
# Answers that say nothing definite about a request: send it again with the same request_id.
NOT_DEFINITE = frozenset({"timeout", "outcome_unknown", "busy"})
RETRY_FOR = 120.0  # seconds: the services' default idempotency window (bus.idempotency.DEFAULT_WINDOW)


class BusClient:
    def __init__(self, nc: Client, *, prefix: str = "berth", timeout: float = DEFAULT_TIMEOUT) -> None:
        self.nc = nc
        self.prefix = prefix
        self.timeout = timeout

    def subject(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    async def request(self, subject: str, payload: Any, response: type[T] = dict, *, timeout: float | None = None) -> T:
        """Send `payload` (a Struct or map) to `<prefix>.<subject>` and decode the reply as `response`."""
        return decode_reply(await self.request_raw(subject, encode(payload), timeout=timeout), response)

    async def change(
        self, subject: str, payload: Any, response: type[T] = dict, *, timeout: float | None = None,
        retry_for: float = RETRY_FOR,
    ) -> T:
        """Send the state change `payload` (a map or a Struct with a `request_id`) until its answer is
        definite or `retry_for` seconds have passed (see the module); the last error then."""
        payload = with_request_id(payload)
        give_up = time.monotonic() + retry_for
        pause = 0.1
        while True:
            try:
                return await self.request(subject, payload, response, timeout=timeout)
            except BusError as error:
                if error.code not in NOT_DEFINITE or time.monotonic() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def request_raw(self, subject: str, data: bytes, *, timeout: float | None = None):
        """The raw reply message (headers and bytes) for already-encoded `data`."""
        full = self.subject(subject)
        wait = self.timeout if timeout is None else timeout
        try:
            return await self.nc.request(full, data, timeout=wait)
        except NoRespondersError:
            raise NoResponders(full, served_node(subject)) from None
        except NatsTimeout:
            raise RequestTimeout(full, wait) from None


def with_request_id(payload: Any) -> Any:
    """`payload` with a `request_id`: its own, else a new one."""
    if isinstance(payload, dict):
        return payload if payload.get("request_id") else {**payload, "request_id": uuid.uuid4().hex}
    if not getattr(payload, "request_id", None):
        return msgspec.structs.replace(payload, request_id=uuid.uuid4().hex)
    return payload


def decode_reply(msg, response: type[T]) -> T:
    """The reply body as `response`, or the `BusError` an error reply carries."""
    headers = msg.headers or {}
    if ERROR_CODE_HEADER in headers:
        raise error_from(headers, msg.data)
    return decode_stored(msg.data, response)


def error_from(headers: dict[str, str], data: bytes) -> BusError:
    status = int(headers.get(ERROR_CODE_HEADER, "500") or 500)
    try:
        info = decode_stored(data, ErrorBody).error
        return BusError(info.code, info.message, info.details, status=status)
    except (msgspec.DecodeError, msgspec.ValidationError):
        # An error from a plain nats.micro responder (no berth body): keep what the headers say.
        return BusError("internal", headers.get(ERROR_HEADER, ""), {}, status=status)
