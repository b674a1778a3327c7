"""Finding every live service instance: scatter-gather over `$SRV.PING/INFO/STATS`.

A request on `$SRV.<VERB>` (or `$SRV.<VERB>.<name>`) is answered by every instance, so we collect
replies on one inbox until none has arrived for `quiet` seconds (or `timeout` passes).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats


async def gather(nc: Client, subject: str, *, timeout: float = 1.0, quiet: float = 0.15) -> list[dict[str, Any]]:
    inbox = nc.new_inbox()
    replies: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=replies.put)
    try:
        await nc.publish(subject, b"", reply=inbox)
        await nc.flush()
        found = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        wait = timeout
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await asyncio.wait_for(replies.get(), min(wait, left))
            except asyncio.TimeoutError:
                break
            if not msg.data:
                break  # the server's "no responders" status: nobody runs a service
            found.append(json.loads(msg.data))
            wait = quiet  # after the first answer, stop once the others have had their chance
        return found
    finally:
        await sub.unsubscribe()


def _control(verb: str, name: str | None) -> str:
    return f"$SRV.{verb}" + (f".{name}" if name else "")


async def ping(nc: Client, name: str | None = None, **kw) -> list[ServicePing]:
    return [ServicePing.from_dict(d) for d in await gather(nc, _control("PING", name), **kw)]


async def info(nc: Client, name: str | None = None, **kw) -> list[ServiceInfo]:
    return [ServiceInfo.from_dict(d) for d in await gather(nc, _control("INFO", name), **kw)]


async def stats(nc: Client, name: str | None = None, **kw) -> list[ServiceStats]:
    return sorted(
        (ServiceStats.from_dict(d) for d in await gather(nc, _control("STATS", name), **kw)),
        key=lambda s: (s.name, s.id),
    )
