"""A test-only service that exercises the runtime: slow calls, errors, typed input, idempotency.

Run in-process by the tests, or as worker processes: `python -m bus.runner tests.echo_service`.

Two commands let tests know what is in flight instead of sleeping and hoping:
- `echo.meet` {parties}: each request waits in its handler until `parties` requests of its group
  are there at once (a cyclic barrier in this process); so N replies prove N were served together;
- `echo.hold` {gate}: each request says it arrived (RPUSH `<prefix>:echo:gate:<gate>:arrived`) and
  waits until the test lets one through (BLPOP `<prefix>:echo:gate:<gate>:open`).
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated

import msgspec

from bus.events import StreamSpec
from bus.idempotency import IdempotencyStore
from bus.service import Command, Service
from schemas.errors import BerthError

NAME = "echo"
CONFIG = None  # no options of its own
EVENTS: dict[str, type] = {}
STREAM = StreamSpec("events", ("echo.>",), max_age=3600, max_bytes=1 << 20)


class Sleep(msgspec.Struct):
    seconds: Annotated[float, msgspec.Meta(ge=0, le=30)]
    tag: str = ""


class Fail(msgspec.Struct):
    code: str
    message: str = "failed on purpose"


class Grow(msgspec.Struct):
    size: Annotated[int, msgspec.Meta(ge=0)]


class Blob(msgspec.Struct):
    data: bytes


class Typed(msgspec.Struct):
    count: Annotated[int, msgspec.Meta(ge=0)]
    name: str
    flag: bool
    ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


class Increment(msgspec.Struct):
    key: str
    request_id: str = ""
    delay: Annotated[float, msgspec.Meta(ge=0, le=5)] = 0.0


class Meet(msgspec.Struct):
    parties: Annotated[int, msgspec.Meta(ge=1, le=1000)]
    group: str = ""
    tag: str = ""
    timeout: Annotated[float, msgspec.Meta(gt=0, le=60)] = 10.0


class Hold(msgspec.Struct):
    gate: Annotated[str, msgspec.Meta(min_length=1)]
    tag: str = ""
    timeout: Annotated[int, msgspec.Meta(ge=1, le=60)] = 30


class Empty(msgspec.Struct):
    pass


class Served(msgspec.Struct):
    tag: str
    pid: int
    instance: str
    in_flight: int = 0  # requests the service was running when this one entered its handler


class Counted(msgspec.Struct):
    value: int


class EchoHandlers:
    def __init__(self, service: Service, redis) -> None:
        self.service = service
        self.redis = redis
        self._barriers: dict[tuple[str, int], asyncio.Barrier] = {}

    def served(self, tag: str = "", in_flight: int = 0) -> Served:
        return Served(tag=tag, pid=os.getpid(), instance=self.service.id, in_flight=in_flight)

    async def meet(self, req: Meet) -> Served:
        in_flight = self.service.in_flight
        barrier = self._barriers.setdefault((req.group, req.parties), asyncio.Barrier(req.parties))
        try:
            async with asyncio.timeout(req.timeout):
                await barrier.wait()
        except (TimeoutError, asyncio.BrokenBarrierError):
            await barrier.abort()
            self._barriers.pop((req.group, req.parties), None)
            raise BerthError(
                f"{req.parties} requests of group {req.group!r} were never in the handler at once",
                code="not_met",
            ) from None
        return self.served(req.tag, in_flight)

    async def hold(self, req: Hold) -> Served:
        gate = f"{self.service.prefix}:echo:gate:{req.gate}"
        await self.redis.rpush(f"{gate}:arrived", self.service.id)
        if await self.redis.blpop([f"{gate}:open"], timeout=req.timeout) is None:
            raise BerthError(f"gate {req.gate!r} was not opened within {req.timeout} s", code="not_opened")
        return self.served(req.tag)

    async def sleep(self, req: Sleep) -> Served:
        await asyncio.sleep(req.seconds)
        return self.served(req.tag)

    async def fail(self, req: Fail) -> Empty:
        raise BerthError(req.message, code=req.code, details={"asked": req.code})

    async def crash(self, req: Empty) -> Empty:
        raise RuntimeError("boom")

    async def typed(self, req: Typed) -> Typed:
        return req

    async def grow(self, req: Grow) -> Blob:
        return Blob(b"x" * req.size)

    async def whoami(self, req: Empty) -> Served:
        return self.served()

    async def increment(self, req: Increment) -> Counted:
        await asyncio.sleep(req.delay)  # widens the window in which concurrent retries overlap
        return Counted(await self.redis.incr(f"{self.service.prefix}:echo:{req.key}"))


COMMANDS = [
    Command("echo.sleep", Sleep, Served, "sleep"),
    Command("echo.meet", Meet, Served, "meet"),
    Command("echo.hold", Hold, Served, "hold"),
    Command("echo.fail", Fail, Empty, "fail"),
    Command("echo.crash", Empty, Empty, "crash"),
    Command("echo.typed", Typed, Typed, "typed"),
    Command("echo.grow", Grow, Blob, "grow"),
    Command("echo.whoami", Empty, Served, "whoami"),
    Command("echo.increment", Increment, Counted, "increment", idempotent=True),
]


def make_service(prefix: str, redis, concurrency: int = 64) -> Service:
    service = Service(
        f"{prefix}-echo", prefix=prefix, concurrency=concurrency, idempotency=IdempotencyStore(redis, prefix=prefix)
    )
    service.bind(COMMANDS, EchoHandlers(service, redis))
    return service


async def build(ctx) -> Service:
    return make_service(ctx.prefix, ctx.redis, ctx.common.concurrency)
