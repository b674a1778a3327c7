"""Lua scripts kept as package files: `<name>.lua` beside the module that runs it (or in `bus/` for
the shared ones), each with its KEYS and ARGV documented at its top.

    self._claim = scripts.register(redis, "services.broker", "apply_claim")

The text is read once per process (importlib.resources, so it works from a wheel as well as from
a source tree) and registered once per client with redis-py's `register_script`; redis-py loads it
on the server when it is first needed (see `bus.redis.Pipelined` for pipelines).
"""

from __future__ import annotations

import weakref
from functools import cache
from importlib.resources import files

from redis.asyncio import Redis, RedisCluster
from redis.commands.core import AsyncScript


@cache
def source(package: str, name: str) -> str:
    """The text of `<name>.lua` in `package`."""
    return files(package).joinpath(f"{name}.lua").read_text(encoding="utf-8")


_registered: "weakref.WeakKeyDictionary[Redis | RedisCluster, dict[tuple[str, str], AsyncScript]]" = (
    weakref.WeakKeyDictionary()
)


def register(redis: Redis | RedisCluster, package: str, name: str) -> AsyncScript:
    """`<name>.lua` of `package`, registered on `redis` (the same object for every caller on it)."""
    held = _registered.setdefault(redis, {})
    script = held.get((package, name))
    if script is None:
        script = held[(package, name)] = redis.register_script(source(package, name))
    return script
