"""bus.redis against a real Redis Cluster: the cluster URL, pipelines spread over slots, scripts on
every primary, and a primary that fails over while commands keep coming."""

from __future__ import annotations

import asyncio

from bus import scripts
from bus.redis import Pipelined, connect_redis, is_cluster, ready


async def test_a_cluster_url_gives_a_cluster_client_that_spans_every_slot(redis_cluster):
    client = connect_redis(redis_cluster.url)
    try:
        assert is_cluster(client)
        batch = Pipelined(client)
        keys = [f"spread:{i}" for i in range(64)]  # spread over every primary's slots
        assert await asyncio.gather(*(batch.execute_command("SET", key, i) for i, key in enumerate(keys)))
        assert await asyncio.gather(*(batch.execute_command("GET", key) for key in keys)) == [
            str(i).encode() for i in range(64)
        ]
    finally:
        await client.aclose()


async def test_scripts_run_on_every_primary_even_after_they_were_flushed(redis_cluster):
    client = connect_redis(redis_cluster.url)
    try:
        batch = Pipelined(client)
        script = scripts.register(client, "tests", "incr")
        keys = [f"scripted:{{slot{i}}}" for i in range(12)]
        assert await asyncio.gather(*(batch.script(script, [key], []) for key in keys)) == [1] * 12
        await client.script_flush()  # on every primary: as after a failover to a replica without it
        assert await asyncio.gather(*(batch.script(script, [key], []) for key in keys)) == [2] * 12
    finally:
        await client.aclose()


async def test_a_ready_cluster_client_takes_many_first_commands_at_once(redis_cluster):
    client = await ready(connect_redis(redis_cluster.url))
    try:
        async def increments() -> None:
            for _ in range(20):
                await client.incr("first-commands")

        await asyncio.gather(*(increments() for _ in range(64)))
        assert await client.get("first-commands") == b"1280"
    finally:
        await client.aclose()
