"""Pool sizing strategies: how many unsold resources a broker keeps (warming plus idle).

`const` is crm's: always `num`. `reactive` follows demand: the number of applies this broker saw
(served or missed) in the last `window_seconds`, never below `min` nor above `max`. When demand
falls, surplus idle resources go once they have been idle for `keep_seconds`, so a short lull does
not throw away warm servers that the next burst needs.
"""

from __future__ import annotations

from schemas.broker import ConstStrategy, ReactiveStrategy, Strategy
from schemas.errors import InvalidArgument

# How far back demand is kept for brokers whose strategy does not look at it (list-brokers, events).
DEFAULT_WINDOW = 60.0


def window(strategy: Strategy) -> float:
    return strategy.window_seconds if isinstance(strategy, ReactiveStrategy) else DEFAULT_WINDOW


def target(strategy: Strategy, demand: int) -> int:
    """Unsold resources to keep, given the applies seen in the last window."""
    if isinstance(strategy, ConstStrategy):
        return strategy.num
    return max(strategy.min, min(strategy.max, demand))


def surplus_may_go(strategy: Strategy, idle_since: float, now: float) -> bool:
    """Whether an idle resource above the target may be released now."""
    if isinstance(strategy, ConstStrategy):
        return True
    return now - idle_since >= strategy.keep_seconds


def check(strategy: Strategy) -> None:
    """Rules a Struct cannot express."""
    if isinstance(strategy, ReactiveStrategy) and strategy.min > strategy.max:
        raise InvalidArgument("strategy.min", f"must not exceed strategy.max ({strategy.max})")
