"""Turning cumulative kernel counters into rates, per-round deltas and CPU ratios.

A counter that goes backwards (a reset, a re-created cgroup, a device that was removed and came
back under the same name) gives no value for that round, never a negative one; the new reading
becomes the baseline, so the next round has a rate again. Elapsed time is always measured with the
monotonic clock, because wall time can jump.
"""

from __future__ import annotations

from collections.abc import Hashable

import msgspec

from services.metrics.parsers import CpuTimes


class Counters:
    """The previous reading of every counter a provisioner tracks, keyed by anything hashable.

    Call `new_round()` once at the start of every sampling round: a counter that was not read
    during the previous round (its cgroup or device is gone) is forgotten, so the state never
    grows with entities that no longer exist.
    """

    def __init__(self) -> None:
        self._previous: dict[Hashable, tuple[float, float]] = {}
        self._current: dict[Hashable, tuple[float, float]] = {}

    def new_round(self) -> None:
        self._previous, self._current = self._current, {}

    def _advance(self, key: Hashable, value: float, now: float) -> tuple[float, float] | None:
        """(counter increase, seconds elapsed) since the previous reading, or None."""
        previous = self._previous.get(key)
        self._current[key] = (value, now)
        if previous is None:
            return None
        increase, elapsed = value - previous[0], now - previous[1]
        if increase < 0 or elapsed <= 0:
            return None
        return increase, elapsed

    def rate(self, key: Hashable, value: float, now: float) -> float | None:
        """Increase per second since the previous reading of `key` (now is monotonic seconds)."""
        step = self._advance(key, value, now)
        return None if step is None else step[0] / step[1]

    def delta(self, key: Hashable, value: float, now: float) -> float | None:
        """Increase since the previous reading of `key`: a per-round delta."""
        step = self._advance(key, value, now)
        return None if step is None else step[0]


class CpuRatios(msgspec.Struct, frozen=True):
    """Fractions of one CPU's (or all CPUs') time between two /proc/stat readings, each in [0, 1]."""

    usage: float
    iowait: float
    system: float


def cpu_ratios(previous: CpuTimes, current: CpuTimes) -> CpuRatios | None:
    """Busy, iowait and system fractions between two readings of the same `cpu` line.

    None when no tick elapsed (two readings in the same tick) or when any column went backwards
    (the CPU was unplugged and plugged back, which restarts its counters).
    """
    steps = [now - before for now, before in zip(_columns(current), _columns(previous))]
    total = sum(steps)
    if total <= 0 or min(steps) < 0:
        return None
    idle = current.idle_all - previous.idle_all
    return CpuRatios(
        usage=(total - idle) / total,
        iowait=(current.iowait - previous.iowait) / total,
        system=(current.system - previous.system) / total,
    )


def _columns(times: CpuTimes) -> tuple[int, ...]:
    return msgspec.structs.astuple(times)
