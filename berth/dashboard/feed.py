"""The messages waiting for one open page."""

from __future__ import annotations

import asyncio
from collections import deque


class Feed:
    """The messages waiting for one page. Closed when it falls `limit` messages behind, or on shutdown."""

    def __init__(self, first: str, limit: int = 5000) -> None:
        self.items: deque[str] = deque([first])
        self.limit = limit
        self.closed = False
        self._wake = asyncio.Event()

    def push(self, message: str) -> None:
        if self.closed:
            return
        if len(self.items) >= self.limit:
            self.close()  # the browser reconnects and gets a fresh snapshot
        else:
            self.items.append(message)
            self._wake.set()

    def close(self) -> None:
        self.closed = True
        self.items.clear()
        self._wake.set()

    async def next(self, timeout: float) -> str | None:
        """The next message; "" when none came within `timeout` (time for a keep-alive); None once closed."""
        if not self.items and not self.closed:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return ""
        if self.closed:
            return None
        return self.items.popleft()
