"""Counters -> rates and deltas, including counters that reset, and /proc/stat CPU ratios."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.metrics.parsers import CpuTimes
from services.metrics.rates import Counters, cpu_ratios


def rounds(counters: Counters, readings: list[tuple[float, float]]) -> list[float | None]:
    """Feed (value, monotonic time) readings one per round; return the rate after each."""
    rates = []
    for value, now in readings:
        counters.new_round()
        rates.append(counters.rate("k", value, now))
    return rates


def test_first_reading_has_no_rate_then_per_second():
    assert rounds(Counters(), [(100, 10.0), (300, 12.0), (300, 13.0)]) == [None, 100.0, 0.0]


def test_counter_reset_gives_no_rate_and_becomes_the_new_baseline():
    # 1000 -> 10 is a reset (re-created cgroup, wrapped counter): no rate, never a negative one
    assert rounds(Counters(), [(1000, 1.0), (10, 2.0), (40, 3.0)]) == [None, None, 30.0]


def test_no_time_elapsed_gives_no_rate():
    assert rounds(Counters(), [(1, 5.0), (2, 5.0)]) == [None, None]
    assert rounds(Counters(), [(1, 5.0), (2, 4.0)]) == [None, None]  # a clock going backwards, too


def test_delta_per_round():
    counters = Counters()
    results = []
    for value in (100, 150, 150, 120, 130):
        counters.new_round()
        results.append(counters.delta("pgsteal", value, 0.0 + len(results)))
    assert results == [None, 50, 0, None, 10]


def test_counters_not_read_last_round_are_forgotten():
    counters = Counters()
    counters.new_round()
    counters.rate("gone", 10, 1.0)
    counters.rate("stays", 10, 1.0)
    counters.new_round()
    counters.rate("stays", 20, 2.0)  # "gone" vanished this round (its cgroup was removed)
    counters.new_round()
    assert counters.rate("stays", 30, 3.0) == 10
    assert counters.rate("gone", 30, 3.0) is None


def test_keys_are_independent():
    counters = Counters()
    counters.new_round()
    counters.rate(("/a", "cpu"), 0, 0.0)
    counters.rate(("/b", "cpu"), 0, 0.0)
    counters.new_round()
    assert counters.rate(("/a", "cpu"), 5, 1.0) == 5
    assert counters.rate(("/b", "cpu"), 7, 1.0) == 7


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.floats(0.001, 10)), min_size=1, max_size=30))
def test_rates_are_never_negative(steps):
    counters = Counters()
    now, previous = 0.0, None
    for value, elapsed in steps:
        before, now = now, now + elapsed
        counters.new_round()
        rate = counters.rate("k", value, now)
        if previous is None or value < previous:  # no reading yet, or the counter was reset
            assert rate is None
        else:
            assert rate == (value - previous) / (now - before) and rate >= 0
        previous = value


def ticks(user=0, system=0, idle=0, iowait=0, steal=0) -> CpuTimes:
    return CpuTimes(user=user, system=system, idle=idle, iowait=iowait, steal=steal)


def test_cpu_ratio_of_the_reference_measurement():
    # katalyst-metrics.md §9.2: a busy loop on cpu1 for one second at USER_HZ 100
    busy = cpu_ratios(ticks(user=626, idle=33457), ticks(user=726, idle=33457))
    assert busy is not None and busy.usage == 1.0
    quiet = cpu_ratios(ticks(user=336, idle=34123), ticks(user=337, idle=34222))
    assert quiet is not None and quiet.usage == pytest.approx(0.01)
    both = cpu_ratios(ticks(user=962, idle=67581), ticks(user=1063, idle=67679))
    assert both is not None and both.usage == pytest.approx(101 / 199)  # 0.503, about 1 core of 2


def test_cpu_ratio_counts_iowait_as_idle_and_reports_it_and_system():
    ratios = cpu_ratios(ticks(), ticks(user=20, system=10, idle=50, iowait=15, steal=5))
    assert ratios is not None
    assert ratios.usage == pytest.approx(0.35)  # user + system + steal
    assert ratios.iowait == pytest.approx(0.15)
    assert ratios.system == pytest.approx(0.10)


def test_cpu_ratio_without_ticks_or_with_a_reset_is_none():
    same = ticks(user=5, idle=5)
    assert cpu_ratios(same, same) is None
    # an unplugged and re-plugged CPU starts its counters again
    assert cpu_ratios(ticks(user=500, idle=500), ticks(user=2, idle=900)) is None


@given(
    st.lists(st.integers(0, 10**9), min_size=8, max_size=8),
    st.lists(st.integers(0, 10**6), min_size=8, max_size=8),
)
def test_cpu_ratios_stay_in_unit_interval(before, steps):
    ratios = cpu_ratios(CpuTimes(*before), CpuTimes(*(b + s for b, s in zip(before, steps))))
    if sum(steps) == 0:
        assert ratios is None
    else:
        assert ratios is not None
        for value in (ratios.usage, ratios.iowait, ratios.system):
            assert 0.0 <= value <= 1.0
