"""Berth's Lua scripts as Redis Functions (bus/scripts.py): the libraries each service's code calls,
and loading every library as the Redis administrator.
"""

from __future__ import annotations

from bus import scripts
from bus.redis import connect_redis, ready
from bus.scripts import Library

FIRST_VERSION = (7, 0)  # Redis Functions came with Redis 7.0

# The packages whose scripts each service runs (bus's are every service's); a library each.
PACKAGES = {
    "allocation": ("bus", "services.allocation"),
    "broker": ("bus", "services.broker", "services.broker.operators"),
    "metrics": ("bus", "services.metrics"),
}


def libraries(service: str) -> list[Library]:
    return [scripts.library(package) for package in PACKAGES[service]]


def every_library() -> list[Library]:
    return [scripts.library(package) for package in dict.fromkeys(p for ps in PACKAGES.values() for p in ps)]


async def load(url: str, tls_ca: str | None = None) -> list[Library]:
    """Load every library on the Redis at `url` (an administrator's), every primary of a cluster."""
    redis = await ready(connect_redis(url, max_connections=1, tls_ca=tls_ca))
    try:
        loaded = every_library()
        await scripts.load(redis, loaded)
        return loaded
    finally:
        await redis.aclose()
