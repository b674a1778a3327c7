"""What a worker keeps in memory between requests, each with a bound, and the size of each as a
Prometheus gauge: a worker under a steady load for days must not grow.

Every cache registers itself (`watch(name, entries, bytes_, limit)`: functions that read its size
now) in the process-wide `CACHES`, which reports at every scrape:

    berth_cache_entries{cache}   gauge   entries held now
    berth_cache_bytes{cache}     gauge   bytes held now (for caches that count them)
    berth_cache_limit{cache}     gauge   the bound: entries, or bytes for caches that count them

`Memo` is the bounded memo the calculation caches use: a dict whose oldest entries go first once
what it holds passes its byte budget (insertion order, no reordering on a hit: a memo of
calculations is rebuilt cheaply, while keeping it in recency order would cost every hit).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

K = TypeVar("K")
V = TypeVar("V")


class _Watched:
    def __init__(self, entries: Callable[[], int], bytes_: Callable[[], int] | None,
                 limit: int | Callable[[], int]) -> None:
        self.entries = entries
        self.bytes = bytes_
        self.limit = limit

    def bound(self) -> int:
        return self.limit() if callable(self.limit) else self.limit


class Caches(Collector):
    """The caches of this process, by name (a name registered again replaces the first: a worker
    rebuilt in a test, say)."""

    def __init__(self) -> None:
        self._watched: dict[str, _Watched] = {}

    def watch(self, name: str, entries: Callable[[], int], *, bytes_: Callable[[], int] | None = None,
              limit: int | Callable[[], int]) -> None:
        """Report cache `name`: its entries (and bytes) now, and its bound (fixed, or one that
        follows what the cache serves, as a view's heap follows the view's nodes)."""
        self._watched[name] = _Watched(entries, bytes_, limit)

    def sizes(self) -> dict[str, tuple[int, int | None, int]]:
        """name -> (entries, bytes or None, limit), now."""
        return {name: (w.entries(), w.bytes() if w.bytes else None, w.bound()) for name, w in self._watched.items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        entries = GaugeMetricFamily("berth_cache_entries", "Entries a worker's cache holds now.", labels=["cache"])
        held = GaugeMetricFamily("berth_cache_bytes", "Bytes a worker's cache holds now (caches that count them).",
                                 labels=["cache"])
        limit = GaugeMetricFamily("berth_cache_limit", "A cache's bound: bytes for caches that count them, else "
                                  "entries.", labels=["cache"])
        for name, (count, size, bound) in sorted(self.sizes().items()):
            entries.add_metric([name], count)
            if size is not None:
                held.add_metric([name], size)
            limit.add_metric([name], bound)
        yield from (entries, held, limit)


CACHES = Caches()
REGISTRY.register(CACHES)


class Memo(Generic[K, V]):
    """Memoised results, at most `limit` bytes of them as `size(key, value)` counts (oldest first out)."""

    def __init__(self, name: str, limit: int, size: Callable[[K, V], int]) -> None:
        self.limit = limit
        self.size = size
        self.bytes = 0
        self._held: dict[K, V] = {}
        ref = weakref.ref(self)
        CACHES.watch(name, lambda: len(m._held) if (m := ref()) else 0,
                     bytes_=lambda: m.bytes if (m := ref()) else 0, limit=limit)

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: K) -> V | None:
        return self._held.get(key)

    def put(self, key: K, value: V) -> V:
        if key in self._held:
            return self._held[key]
        self._held[key] = value
        self.bytes += self.size(key, value)
        while self.bytes > self.limit and self._held:
            oldest = next(iter(self._held))
            self.bytes -= self.size(oldest, self._held.pop(oldest))
        return value
