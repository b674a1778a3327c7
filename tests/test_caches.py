"""Bounded caches (bus/caches.py): a memo never holds more than its byte budget, and every cache a
worker keeps is reported with its bound."""

from __future__ import annotations

from bus.caches import CACHES, Memo


def test_a_memo_drops_its_oldest_entries_beyond_its_byte_budget():
    memo: Memo[int, bytes] = Memo("test memo", limit=1000, size=lambda key, value: len(value))
    for key in range(100):
        memo.put(key, b"x" * 30)
        assert memo.bytes <= 1000
    assert len(memo) == 33 and memo.get(0) is None and memo.get(99) == b"x" * 30
    assert memo.put(99, b"other") == b"x" * 30  # a memo keeps the first result for a key
    assert CACHES.sizes()["test memo"] == (33, 990, 1000)


async def test_the_allocation_caches_are_reported_with_their_bounds(redis, prefix):
    from services.allocation.manager import AllocationManager
    from services.allocation.store import NodeStore
    from services.allocation.worker import make_plugins

    manager = AllocationManager(NodeStore(redis, prefix), make_plugins())
    sizes = CACHES.sizes()
    for name in ("allocation capacity memo", "allocation deploy memo", "allocation views", "allocation records",
                 "allocation view heap items"):
        entries, _, bound = sizes[name]
        assert 0 <= entries <= bound
    assert manager.fleet.views is not None
