"""The charts of each metrics agent: a `register-notifier` lease on each charted metric, renewed,
and the points its samples (change events, and a first `list`) give."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from berth.dashboard.views import CHARTS, is_number
from bus.client import BusClient
from schemas.errors import NoResponders

log = logging.getLogger("berth.dashboard")


class AgentCharts:
    """The series of every watched agent (`series`: node -> metric -> deque of [time, value]).

    `broadcast(kind, data)` tells the pages of every change (`agents`, `sample`); `client` is set
    once the dashboard is connected, before the first `watch`."""

    def __init__(self, broadcast: Callable[[str, Any], None], *, points: int, lease_seconds: float) -> None:
        self.broadcast = broadcast
        self.points, self.lease_seconds = points, lease_seconds
        self.client: BusClient | None = None
        self.series: dict[str, dict[str, deque]] = {}
        self.watches: dict[str, asyncio.Task] = {}
        self.retired: set[asyncio.Task] = set()  # cancelled watches, until they have ended (`stop` waits)

    def watch(self, agents: list[str]) -> None:
        """Watch exactly these agents (by node): new ones get series, gone ones lose theirs."""
        if agents == sorted(self.watches):
            return
        for node in [watched for watched in self.watches if watched not in agents]:
            retired = self.watches.pop(node)
            retired.cancel()
            self.retired.add(retired)
            retired.add_done_callback(self.retired.discard)
            self.series.pop(node, None)
        for node in agents:
            if node not in self.watches:
                self.series[node] = {metric: deque(maxlen=self.points) for metric, _, _ in CHARTS}
                self.watches[node] = asyncio.create_task(self._watch(node), name=f"dashboard-watch-{node}")
        self.broadcast("agents", {"agents": sorted(self.series)})

    async def _watch(self, node: str) -> None:
        """Keep a notifier lease on each charted metric of an agent: register, renew, register
        again when the agent forgot it (restarted, or the lease ran out while it was away)."""
        keys: dict[str, str] = {}
        try:
            while True:
                registered = False
                for metric, _, _ in CHARTS:
                    try:
                        if metric in keys:
                            await self._call_agent(node, "renew-notifier", {"key": keys[metric]})
                        else:
                            ask = {"scope": "node", "metric": metric, "lease_seconds": self.lease_seconds}
                            keys[metric] = (await self._call_agent(node, "register-notifier", ask))["key"]
                            registered = True
                    except Exception as error:
                        log.info("metric %s of %s: %r", metric, node, error)
                        keys.pop(metric, None)
                if registered:
                    await self._seed(node)
                await asyncio.sleep(self.lease_seconds / 3)
        finally:
            for key in keys.values():
                try:
                    await self._call_agent(node, "deregister-notifier", {"key": key}, timeout=1.0)
                except NoResponders as error:  # the agent is gone (stopped with us): the lease ends by itself
                    log.debug("deregistering from %s: %r", node, error)
                except Exception as error:
                    log.info("deregistering from %s: %r", node, error)

    async def _call_agent(
        self, node: str, command: str, payload: dict[str, Any], timeout: float = 3.0
    ) -> Any:
        return await self.client.request(f"metrics.{node}.{command}", payload, timeout=timeout)

    async def _seed(self, node: str) -> None:
        """The current values, so that a chart does not wait a whole interval for its first point
        (`list`, not `get`: a metric not sampled yet is simply not there, not an error)."""
        try:
            entries = (await self._call_agent(node, "list", {"scope": "node", "limit": 2000}))["entries"]
        except Exception as error:
            log.info("metrics of %s not listed: %r", node, error)
            return
        for entry in entries:
            self.add_sample(node, {**entry, "sample_time": entry.get("time")})

    def add_sample(self, node: str, body: dict[str, Any]) -> None:
        series = self.series.get(node)
        if series is None or body.get("scope") != "node" or body.get("metric") not in series:
            return
        points = series[body["metric"]]
        sampled, value = body.get("sample_time") or body.get("time"), body.get("value")
        if not (is_number(sampled) and is_number(value)) or (points and sampled <= points[-1][0]):
            return
        points.append([sampled, value])
        self.broadcast("sample", {"node": node, "metric": body["metric"], "t": sampled, "v": value})
