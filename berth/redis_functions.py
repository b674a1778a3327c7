"""Berth's Lua scripts as Redis Functions (bus/scripts.py): the libraries each service's code calls,
the ACL rules that let a service's Redis user call those functions and run no Lua of its own, and
loading every library as the Redis administrator (`berth up` on Redis >= 7.0, and `berth
redis-functions` for other deployments).
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
    "agent": ("bus", "services.metrics"),  # a `berth agent` runs its node's metrics service
}


def libraries(service: str) -> list[Library]:
    return [scripts.library(package) for package in PACKAGES[service]]


def every_library() -> list[Library]:
    return [scripts.library(package) for package in dict.fromkeys(p for ps in PACKAGES.values() for p in ps)]


def fcall_rules(service: str) -> list[str]:
    """A service user's rights to scripts, after `-@scripting`: listing libraries (how a worker
    tells whether its own are loaded) and calling its own functions by name (an ACL rule
    `+command|first-argument` allows a command for that first argument only)."""
    functions = [function for library in libraries(service) for function in library.functions]
    return ["+function|list", *(f"+fcall|{function}" for function in functions)]


async def load(url: str, tls_ca: str | None = None) -> list[Library]:
    """Load every library on the Redis at `url` (an administrator's), every primary of a cluster."""
    redis = await ready(connect_redis(url, max_connections=1, tls_ca=tls_ca))
    try:
        loaded = every_library()
        await scripts.load(redis, loaded)
        return loaded
    finally:
        await redis.aclose()
