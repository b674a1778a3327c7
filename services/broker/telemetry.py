"""The broker's Prometheus metrics (the request metrics are `bus.telemetry`'s).

    berth_broker_launches_total{kind}                  resources a caller got: `warm` (sold from a pool),
                                                       `cold` (launched on the operator for it)
    berth_broker_apply_duration_seconds{result}        `apply` from request to answer (histogram);
                                                       result `sold`, `refused` (an error reply) or `error`
    berth_broker_pool_resources{user,broker,state}     resources in each broker's pool by state
                                                       (warming, idle, sold, deleting), read on scrape

The pool sizes are the whole deployment's (every broker replica reports the same figures), read
from Redis by a scrape at most every `--metrics-refresh` seconds: the broker list, then four
counts per broker in one pipeline each.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Counter, Histogram

from bus.telemetry import LATENCY_BUCKETS, GaugeTable
from services.broker.store import BrokerStore

LAUNCHES = Counter(
    "berth_broker_launches",
    "Resources a caller got: kind warm (sold from a broker's pool at once) or cold (launched on the operator).",
    ("kind",),
)
WARM = LAUNCHES.labels("warm")
COLD = LAUNCHES.labels("cold")
APPLY_DURATION = Histogram(
    "berth_broker_apply_duration_seconds",
    "Time of an apply from request to answer, by result: sold, refused (an error reply) or error.",
    ("result",),
    buckets=LATENCY_BUCKETS,
)
APPLY_SOLD = APPLY_DURATION.labels("sold")
APPLY_REFUSED = APPLY_DURATION.labels("refused")
APPLY_ERROR = APPLY_DURATION.labels("error")
POOL = GaugeTable(
    "berth_broker_pool_resources",
    "Resources in a broker's pool by state: warming, idle (ready to be sold), sold, deleting.",
    ("user", "broker", "state"),
)


class PoolSizes:
    def __init__(self, store: BrokerStore) -> None:
        self.store = store

    async def refresh(self) -> None:
        brokers = await self.store.brokers()
        values: dict[tuple[str, str, str], float] = {}
        for start in range(0, len(brokers), 50):
            part = brokers[start:start + 50]
            counts = await asyncio.gather(*(self.store.pool_counts(b.user, b.name) for b in part))
            for broker, count in zip(part, counts):
                for state, n in count.items():
                    values[broker.user, broker.name, state] = n
        POOL.replace(values)
