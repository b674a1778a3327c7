"""Shared by the bench scripts, so that every table computes its percentiles the same way."""

from __future__ import annotations

import math


def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least q of all samples at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
