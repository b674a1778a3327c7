"""Scripts as Redis Functions (bus/scripts.py, berth/redis_functions.py): FCALL where a script's
library is loaded, EVALSHA where it is not, libraries of two versions side by side, a lost
function told apart, every primary and replica of a cluster.

The session's own Redis never gets a library loaded: every other test runs its scripts there with
EVALSHA. These tests load theirs on servers of their own, or, on the session's cluster, only the
tests' own library, deleted again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import Redis

from berth import redis_functions
from berth.servers import start_redis
from bus import scripts
from bus.redis import Pipelined, connect_redis
from bus.scripts import FunctionMissing, Library
from tests.bus_helpers import eventually
from tests.cluster_helpers import ask, role

ROOT = Path(__file__).resolve().parent.parent
TESTS = scripts.library("tests")  # tests/incr.lua


@pytest.fixture
async def own_redis(tmp_path):
    """A redis-server of this test's own, with a client on it."""
    server = start_redis(tmp_path / "redis", appendonly=False)
    client = Redis.from_url(server.url)
    yield client
    await client.aclose()
    server.stop()


async def calls(redis: Redis) -> dict[str, int]:
    """How often the server ran FCALL and EVALSHA."""
    stats = await redis.info("commandstats")
    return {command: stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in ("fcall", "evalsha")}


def test_every_script_is_in_a_library_that_berth_loads():
    lua = [path for top in ("bus", "services") for path in (ROOT / top).rglob("*.lua")]
    found = {".".join(path.parent.relative_to(ROOT).parts) for path in lua}
    assert found == {library.package for library in redis_functions.every_library()}


async def test_without_its_library_a_script_runs_with_evalsha(redis, prefix):
    script = scripts.register(redis, "tests", "incr")
    before = await calls(redis)
    assert not await script.is_function()
    assert await script(keys=[f"{prefix}:n"]) == 1
    assert await Pipelined(redis).script(script, [f"{prefix}:n"], []) == 2
    after = await calls(redis)
    assert after["evalsha"] >= before["evalsha"] + 2 and after["fcall"] == before["fcall"]


async def test_with_its_library_loaded_a_script_is_called_as_a_function(own_redis):
    await scripts.load(own_redis, [TESTS])
    script = scripts.register(own_redis, "tests", "incr")
    assert await script(keys=["n"]) == 1
    batch = Pipelined(own_redis)
    assert await asyncio.gather(*(batch.script(script, ["n"], []) for _ in range(3))) == [2, 3, 4]
    assert await calls(own_redis) == {"fcall": 4, "evalsha": 0}


async def test_every_library_of_berth_loads_with_its_flags(own_redis):
    libraries = redis_functions.every_library()
    await scripts.load(own_redis, libraries)
    flags = {}
    for library in libraries:
        [listed] = await own_redis.function_list(library.name)
        for function in map(_fields, _fields(listed)[b"functions"]):
            flags[function[b"name"].decode()] = function[b"flags"]
    assert set(flags) == {function for library in libraries for function in library.functions}
    read_with_ledger = scripts.library("services.allocation").function("read_with_ledger")
    assert {name: named for name, named in flags.items() if named} == {read_with_ledger: [b"no-writes"]}


def _fields(flat: list) -> dict:
    """A RESP2 map (key, value, key, value, ...) as a dict."""
    return dict(zip(flat[::2], flat[1::2]))


async def test_libraries_of_two_versions_live_side_by_side(own_redis):
    older = TESTS
    newer = Library("tests", (("incr", "return redis.call('INCRBY', KEYS[1], 10)"),))
    assert older.name != newer.name and older.function("incr") != newer.function("incr")
    await scripts.load(own_redis, [older, newer])
    await scripts.load(own_redis, [older])  # loaded again (a restart of the older version): the newer stays
    assert await scripts.Script(own_redis, older, "incr")(keys=["n"]) == 1
    assert await scripts.Script(own_redis, newer, "incr")(keys=["n"]) == 11
    assert (await calls(own_redis))["evalsha"] == 0


async def test_a_lost_function_is_an_error_that_says_how_to_load_it(own_redis):
    await scripts.load(own_redis, [TESTS])
    script = scripts.register(own_redis, "tests", "incr")
    assert await script(keys=["n"]) == 1
    await own_redis.function_flush()  # as on a server that lost them
    for run in (script(keys=["n"]), Pipelined(own_redis).script(script, ["n"], [])):
        with pytest.raises(FunctionMissing, match=f"{script.function}.*berth redis-functions"):
            await run


async def test_on_a_cluster_a_library_reaches_every_primary_and_replica(redis_cluster):
    client = connect_redis(redis_cluster.url)
    try:
        await scripts.load(client, [TESTS])
        script = scripts.register(client, "tests", "incr")
        assert await script.is_function()
        keys = [f"functions:{{slot{i}}}" for i in range(12)]  # over every primary's slots
        batch = Pipelined(client)
        assert await asyncio.gather(*(batch.script(script, [key], []) for key in keys)) == [1] * 12
        members = redis_cluster.members
        await eventually(lambda: asyncio.to_thread(  # replicas included
            lambda: all(ask(member, "FUNCTION", "LIST", "LIBRARYNAME", TESTS.name) for member in members)))
        primary = next(member for member in members if member.proc.poll() is None and role(member) == "master")
        ask(primary, "FUNCTION", "DELETE", TESTS.name)  # a primary without it: a new client uses EVALSHA
        other = connect_redis(redis_cluster.url)
        assert not await scripts.register(other, "tests", "incr").is_function()
        await other.aclose()
    finally:
        # The session's cluster runs the tests' script with EVALSHA elsewhere, and has no other library.
        await client.function_flush()
        await client.aclose()
