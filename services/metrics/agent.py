"""The sampling loop: when each provisioner runs, and what happens with its samples.

Pacing follows katalyst's fetcher (katalyst-metrics.md §4.1) without its quirks:
- the first round is synchronized: every provisioner samples at once, with the same timestamps,
  and `synced` turns true when all have finished, even if some failed (`failed` names them);
- after that each provisioner runs on its own fixed-rate schedule (its `interval`), starting one
  interval after the first round (katalyst runs every provisioner twice back to back here); the
  schedules are spread over the interval (provisioner k of n starts k/n of it later), so that rounds
  do not compete for the interpreter and delay each other's events;
- a round reads files in a worker thread, writes the store, removes pods and cgroups that are gone,
  and then only *signals* the listeners (the notifier): no round ever waits for a subscriber.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable, Sequence

from services.metrics import telemetry
from services.metrics.provisioners import CgroupProvisioner, Provisioner, Sample
from services.metrics.store import Store

log = logging.getLogger("berth.metrics.agent")


class Agent:
    def __init__(self, store: Store, provisioners: Sequence[Provisioner]) -> None:
        self.store = store
        self.provisioners = list(provisioners)
        self.synced = False
        self.failed: list[str] = []
        self._listeners: list[Callable[[], None]] = []

    def on_round(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every round that wrote samples. It must return at once."""
        self._listeners.append(listener)

    async def run(self) -> None:
        """The first, synchronized round, then every provisioner on its own schedule (forever).

        One task runs every schedule (rounds are a few milliseconds and spread apart), so stopping
        the agent is cancelling one task.
        """
        started = time.monotonic()
        now = (started, time.time())
        succeeded = await asyncio.gather(*(self._round(p, now) for p in self.provisioners))
        self.failed = [p.name for p, ok in zip(self.provisioners, succeeded) if not ok]
        self.synced = True
        log.info("first round done; failed provisioners: %s", ", ".join(self.failed) or "none")
        n = len(self.provisioners)
        # (next round's monotonic time, provisioner index), earliest first
        schedule = [(started + p.interval * (1 + k / n), k) for k, p in enumerate(self.provisioners)]
        heapq.heapify(schedule)
        while schedule:
            deadline, k = heapq.heappop(schedule)
            await asyncio.sleep(deadline - time.monotonic())
            provisioner = self.provisioners[k]
            await self._round(provisioner)
            # Fixed rate: a slow round delays the next one but never makes rounds pile up.
            heapq.heappush(schedule, (max(deadline + provisioner.interval, time.monotonic()), k))

    async def _round(self, provisioner: Provisioner, now: tuple[float, float] | None = None) -> bool:
        """One round of one provisioner; False if it raised (logged, and the store is left alone)."""
        started = time.perf_counter()
        try:
            samples = await asyncio.to_thread(_sample, provisioner, now)
        except Exception:
            log.exception("provisioner %s failed", provisioner.name)
            telemetry.SAMPLING_FAILURES.labels(provisioner.name).inc()
            return False
        self.store.write(samples)
        telemetry.SAMPLING_DURATION.labels(provisioner.name).observe(time.perf_counter() - started)
        if isinstance(provisioner, CgroupProvisioner) and provisioner.discovery is not None:
            # The discovery of a round that succeeded: pods and cgroups it did not find are gone.
            self.store.retain_pods(provisioner.discovery.living_pods())
            self.store.retain_cgroups(provisioner.discovery.cgroups)
        for listener in self._listeners:
            listener()
        return True


def _sample(provisioner: Provisioner, now: tuple[float, float] | None) -> list[Sample]:
    """Runs in a worker thread. The clocks are read here, right before the files are."""
    now_monotonic, now_unix = now or (time.monotonic(), time.time())
    return provisioner.sample(now_monotonic, now_unix)
