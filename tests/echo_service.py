"""A test-only service that exercises the runtime: slow calls, errors, typed input, idempotency.

Run in-process by the tests, or as worker processes: `python -m services.runner tests.echo_service`.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated

import msgspec

from bus.errors import BerthError
from bus.idempotency import IdempotencyStore
from bus.service import Command, Service

NAME = "echo"


class Sleep(msgspec.Struct):
    seconds: Annotated[float, msgspec.Meta(ge=0, le=30)]
    tag: str = ""


class Fail(msgspec.Struct):
    code: str
    message: str = "failed on purpose"


class Typed(msgspec.Struct):
    count: Annotated[int, msgspec.Meta(ge=0)]
    name: str
    flag: bool
    ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


class Increment(msgspec.Struct):
    key: str
    request_id: str = ""
    delay: Annotated[float, msgspec.Meta(ge=0, le=5)] = 0.0


class Empty(msgspec.Struct):
    pass


class Served(msgspec.Struct):
    tag: str
    pid: int
    instance: str


class Counted(msgspec.Struct):
    value: int


class EchoHandlers:
    def __init__(self, service: Service, redis) -> None:
        self.service = service
        self.redis = redis

    def served(self, tag: str = "") -> Served:
        return Served(tag=tag, pid=os.getpid(), instance=self.service.id)

    async def sleep(self, req: Sleep) -> Served:
        await asyncio.sleep(req.seconds)
        return self.served(req.tag)

    async def fail(self, req: Fail) -> Empty:
        raise BerthError(req.message, code=req.code, details={"asked": req.code})

    async def crash(self, req: Empty) -> Empty:
        raise RuntimeError("boom")

    async def typed(self, req: Typed) -> Typed:
        return req

    async def whoami(self, req: Empty) -> Served:
        return self.served()

    async def increment(self, req: Increment) -> Counted:
        await asyncio.sleep(req.delay)  # widens the window in which concurrent retries overlap
        return Counted(await self.redis.incr(f"{self.service.prefix}:echo:{req.key}"))


COMMANDS = [
    Command("echo.sleep", Sleep, Served, "sleep"),
    Command("echo.fail", Fail, Empty, "fail"),
    Command("echo.crash", Empty, Empty, "crash"),
    Command("echo.typed", Typed, Typed, "typed"),
    Command("echo.whoami", Empty, Served, "whoami"),
    Command("echo.increment", Increment, Counted, "increment", idempotent=True),
]


def make_service(prefix: str, redis, concurrency: int = 64) -> Service:
    service = Service(
        f"{prefix}-echo", prefix=prefix, concurrency=concurrency, idempotency=IdempotencyStore(redis, prefix=prefix)
    )
    service.bind(COMMANDS, EchoHandlers(service, redis))
    return service


def add_arguments(parser) -> None:
    pass


async def build(ctx) -> Service:
    return make_service(ctx.prefix, ctx.redis, ctx.args.concurrency)
