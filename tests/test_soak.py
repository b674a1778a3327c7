"""A short soak of every service (bench/soak.py's loops, issue 31): once the idempotency window has
passed, Redis keys and worker memory stop growing.

Each loop runs alone for `SECONDS` with a window of `WINDOW` seconds and is sampled every two
seconds. Past the warm-up (the window and a margin), what the loop keeps must level off: the keys at
the end at most half again as many as at the end of the warm-up (answers kept for the whole loop
would triple them), and each worker's RSS grown by at most a few MB and a tenth of a KB per loop
(an allocation worker kept 0.7 KB per loop before). The bounds are generous: the machine is shared.

The long soak (`pytest --long -m long tests/test_soak.py`) runs each loop for an hour with the
default window; README "Sizing Redis" has its figures.
"""

from __future__ import annotations

import pytest

from bench.soak import Run, Sample, at, soak
from bus.idempotency import DEFAULT_WINDOW

WINDOW = 4.0
WARMUP = WINDOW + 6.0
SECONDS = 20.0
RSS_SLACK = 4 << 20
RSS_PER_LOOP = 100


def check_levels_off(run: Run, warmup: float) -> None:
    first, last = at(run, warmup), run.samples[-1]
    assert last.loops > first.loops > 0, f"{run.name}: the loop did not run ({run.errors})"
    assert last.errors == first.errors == 0, f"{run.name}: errors {run.errors}"
    # What a loop keeps lives for the window: the keys follow the loops of the last window, which
    # rise and fall with the machine's load (a CI run once went from 380 to 640 loops/s).
    before, after = keys_per_window_loop(run, first), keys_per_window_loop(run, last)
    assert after <= 1.5 * before + 0.5, f"{run.name}: keys per loop of the window {before:.2f} -> {after:.2f}"
    allowed = RSS_SLACK + RSS_PER_LOOP * (last.loops - first.loops)
    for before, after in zip(first.rss, last.rss):
        assert after - before <= allowed, f"{run.name}: RSS {before} -> {after} (allowed +{allowed})"


def keys_per_window_loop(run: Run, sample: Sample) -> float:
    """Redis keys at `sample` per loop run in the window before it (answers kept for the whole run
    would make it grow with the run; kept for the window, it stays level)."""
    loops = sample.loops - at(run, sample.at - run.window).loops
    return sample.keys / max(loops, 1)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["allocation", "broker", "metrics", "agent"])
async def test_after_the_window_nothing_grows(loop, nats_url, redis_url):
    run = await soak(loop, nats_url, redis_url, seconds=SECONDS, window=WINDOW, sample=2.0, quiet=True)
    check_levels_off(run, WARMUP)


@pytest.mark.long
@pytest.mark.parametrize("loop", ["allocation", "broker", "broker-pool", "broker-launch", "metrics", "agent"])
async def test_an_hour_at_the_default_window(loop, nats_url, redis_url):
    run = await soak(loop, nats_url, redis_url, seconds=3600, window=DEFAULT_WINDOW, sample=30.0, quiet=True)
    check_levels_off(run, 3 * DEFAULT_WINDOW)
