"""Redis connections for workers: one async client over a blocking pool sized to the concurrency.

A `BlockingConnectionPool` makes a burst of requests wait for a connection instead of opening an
unbounded number of them (DESIGN.md §1).
"""

from __future__ import annotations

import os

from redis.asyncio import BlockingConnectionPool, Redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def connect_redis(url: str | None = None, *, max_connections: int = 64, timeout: float = 10.0) -> Redis:
    pool = BlockingConnectionPool.from_url(
        redis_url(url), max_connections=max_connections, timeout=timeout, health_check_interval=30
    )
    return Redis(connection_pool=pool)
