"""Automatic pipelining (bus/redis.py Pipelined) against a real Redis: one pipeline per turn of the
event loop, each command its own result or error, scripts that survive the server losing them."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError, ResponseError

from bus import scripts
from bus.redis import Pipelined, connect_redis
from services.processes.ports import free_port


class Counting(Pipelined):
    """A Pipelined that counts the pipelines it sends."""

    sent = 0

    async def _run(self, batch: list) -> None:
        self.sent += 1
        await super()._run(batch)


async def test_commands_of_one_turn_go_in_one_pipeline_with_their_own_results(redis, prefix):
    batch = Counting(redis)
    key = f"{prefix}:counter"
    results = await asyncio.gather(*(batch.execute_command("INCR", key) for _ in range(50)))
    assert sorted(results) == list(range(1, 51))
    assert batch.sent == 1
    assert await batch.execute_command("GET", key) == b"50"
    assert batch.sent == 2


async def test_an_error_fails_only_its_own_command(redis, prefix):
    batch = Pipelined(redis)
    text, number = f"{prefix}:text", f"{prefix}:number"
    await redis.set(text, "not a number")
    outcomes = await asyncio.gather(
        batch.execute_command("INCR", number), batch.execute_command("INCR", text), batch.execute_command("INCR", number),
        return_exceptions=True,
    )
    assert outcomes[0] == 1 and outcomes[2] == 2
    assert isinstance(outcomes[1], ResponseError)


async def test_scripts_run_once_each_even_after_the_server_lost_them(redis, prefix):
    batch = Pipelined(redis)
    key = f"{prefix}:scripted"
    script = scripts.register(redis, "tests", "incr")
    assert await asyncio.gather(*(batch.script(script, [key], []) for _ in range(3))) == [1, 2, 3]
    await redis.script_flush()  # as after a restart of the server
    assert sorted(await asyncio.gather(*(batch.script(script, [key], []) for _ in range(3)))) == [4, 5, 6]
    assert await redis.get(key) == b"6"


async def test_a_script_is_loaded_by_its_first_batch_only(redis, prefix):
    batch = Pipelined(redis)
    key = f"{prefix}:checked"
    script = scripts.register(redis, "tests", "incr")

    async def checks() -> int:
        return (await redis.info("commandstats")).get("cmdstat_script|load", {}).get("calls", 0)

    first = await checks()
    assert await batch.script(script, [key], []) == 1
    loaded = await checks()
    assert loaded > first  # the first batch loaded it, ahead of its EVALSHA
    for count in range(2, 5):
        assert await batch.script(script, [key], []) == count
    assert await checks() == loaded  # later batches send plain EVALSHA


async def test_a_failed_connection_fails_every_command_of_the_batch():
    client = connect_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    batch = Pipelined(client)
    outcomes = await asyncio.gather(*(batch.execute_command("PING") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(outcome, ConnectionError) for outcome in outcomes), outcomes
    await client.aclose()


@pytest.mark.parametrize("count", [1, 600])
async def test_big_bursts_are_split_but_all_answered(redis, prefix, count):
    batch = Counting(redis, max_batch=256)
    key = f"{prefix}:burst"
    results = await asyncio.gather(*(batch.execute_command("INCR", key) for _ in range(count)))
    assert sorted(results) == list(range(1, count + 1))
    assert batch.sent == -(-count // 256)
