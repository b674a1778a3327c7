"""Lua scripts kept as package files: `<name>.lua` beside the module that runs it (or in `bus/` for
the shared ones), each with its KEYS and ARGV documented at its top.

    self._claim = scripts.register(redis, "services.broker", "apply_claim")
    result = await self._claim(keys=[...], args=[...])   # or batch.script(self._claim, keys, args)

One way to call a script, two ways to load it. The scripts of a package are also one Redis
Functions library (`Library`, Redis >= 7.0) that an administrator loads (`berth up` does it,
`berth redis-functions` elsewhere). A client that finds the library loaded calls the script's
function with FCALL, so its Redis user needs no right to run Lua of its own choosing
(berth/credentials.py); a client that does not (Redis 6.2, or nobody loaded it) runs the script
with EVALSHA, registered with redis-py's `register_script`, which loads it on the server when it is
first needed (see `bus.redis.Pipelined` for pipelines). Each client asks once per library, on first
use (FUNCTION LIST; on a cluster every primary must have it).

A library's name, and so each of its function names, carries a hash of its code: function names
are global in a Redis, and two berth versions on one server (a rolling upgrade) load two libraries
side by side, each worker calling its own. A script's text is the body of its function unchanged:
the callback names its parameters KEYS and ARGV. A header line `-- function flags: no-writes`
gives the function Redis's flags: at `maxmemory` Redis refuses a function without flags before it
runs, where an EVALSHA script fails at its first write that takes memory.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from importlib.resources import files
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

FLAGS = re.compile(r"^-- function flags: (.+)$", re.MULTILINE)
HASH_LENGTH = 10  # hex digits of the code's SHA-256 in a library's name


class FunctionMissing(ResponseError):
    """Redis lacks a script's function: it lost it, or nobody loaded it and the user may not run
    the script itself."""


@dataclass(frozen=True)
class Library:
    """The scripts of one package as a Redis Functions library."""

    package: str
    sources: tuple[tuple[str, str], ...]  # (script name, its text), by name

    @classmethod
    def of(cls, package: str) -> Library:
        found = [entry for entry in files(package).iterdir() if entry.name.endswith(".lua")]
        return cls(package, tuple(sorted((entry.name.removesuffix(".lua"), entry.read_text(encoding="utf-8"))
                                         for entry in found)))

    @cached_property
    def name(self) -> str:
        stem = "berth_" + self.package.replace(".", "_")
        return f"{stem}_{hashlib.sha256(self._code(stem).encode()).hexdigest()[:HASH_LENGTH]}"

    @cached_property
    def code(self) -> str:
        """What FUNCTION LOAD takes."""
        return self._code(self.name)

    @property
    def functions(self) -> list[str]:
        return [_function_name(self.name, script) for script, _ in self.sources]

    def function(self, script: str) -> str:
        return _function_name(self.name, script)

    def source(self, script: str) -> str:
        return dict(self.sources)[script]

    def _code(self, name: str) -> str:
        return f"#!lua name={name}\n" + "".join(_registration(_function_name(name, script), text)
                                                 for script, text in self.sources)


def _function_name(library: str, script: str) -> str:
    return f"{library}_{script}"


def _registration(function: str, body: str) -> str:
    flags = FLAGS.search(body)
    named = ", ".join(f"'{flag}'" for flag in (flags.group(1).split() if flags else []))
    # The body on lines of its own: a last line that is a comment must not swallow the `end`.
    return (f"redis.register_function{{function_name='{function}', flags={{{named}}}, "
            f"callback=function(KEYS, ARGV)\n{body}\nend}}\n")


@cache
def library(package: str) -> Library:
    """The scripts of `package`, read once per process (importlib.resources, so it works from a
    wheel as well as from a source tree)."""
    return Library.of(package)


async def load(redis: Redis | RedisCluster, libraries: Iterable[Library]) -> None:
    """Load each library, replacing one of the same name (on a cluster redis-py sends FUNCTION LOAD
    to every primary; replicas get it from their primary, a replica that syncs later in the RDB)."""
    for each in libraries:
        await redis.function_load(each.code, replace=True)


_listed: "weakref.WeakKeyDictionary[Redis | RedisCluster, dict[str, bool]]" = weakref.WeakKeyDictionary()


async def loaded(redis: Redis | RedisCluster, library: Library) -> bool:
    """Whether the server holds `library` (every primary of a cluster), asked once per client."""
    known = _listed.setdefault(redis, {})
    if library.name not in known:
        try:
            listed = await redis.function_list(library.name)
        except ResponseError:  # Redis 6.2 has no FUNCTION, or the user may not list: EVALSHA then
            listed = []
        # A cluster client answers by primary, unless it has only one.
        known[library.name] = all(listed.values()) if isinstance(listed, dict) else bool(listed)
    return known[library.name]


class Script:
    """One script on one client: FCALL of its function where its library is loaded, else EVALSHA."""

    def __init__(self, redis: Redis | RedisCluster, library: Library, name: str) -> None:
        self.redis = redis
        self.library = library
        self.function = library.function(name)
        self.evalsha = redis.register_script(library.source(name))

    async def is_function(self) -> bool:
        return await loaded(self.redis, self.library)

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            if await self.is_function():
                return await self.redis.fcall(self.function, len(keys), *keys, *args)
            return await self.evalsha(keys=keys, args=args)
        except ResponseError as error:
            raise self.failure(error)

    def failure(self, error: Exception) -> Exception:
        """`error`, or one that says what to do when Redis has not the function (it lost its
        libraries, or nobody loaded them) and the user may not run the script itself."""
        lost = isinstance(error, ResponseError) and str(error).startswith("Function not found")
        refused = isinstance(error, NoPermissionError) and "'evalsha'" in str(error)
        if not (lost or refused):
            return error
        return FunctionMissing(f"Redis lacks the function {self.function} (library {self.library.name}): load "
                               f"berth's libraries as the Redis administrator (`berth redis-functions`); {error}")


_registered: "weakref.WeakKeyDictionary[Redis | RedisCluster, dict[tuple[str, str], Script]]" = (
    weakref.WeakKeyDictionary()
)


def register(redis: Redis | RedisCluster, package: str, name: str) -> Script:
    """`<name>.lua` of `package` on `redis` (the same object for every caller on it)."""
    held = _registered.setdefault(redis, {})
    script = held.get((package, name))
    if script is None:
        script = held[(package, name)] = Script(redis, library(package), name)
    return script
