"""What the dashboard shows, kept up to date from the bus and pushed to every open page.

The dashboard is a plain NATS client (the client user's rights are enough). Everything runs in
one asyncio loop, the web server's. Each part of the page has its own rule:

- services: `$SRV.STATS`, every `refresh` seconds (no event says that an instance came or went);
- nodes: `resource.list-nodes`, page by page, every `resync` seconds; a node alone (`list-nodes`
  with its name) when one of its `events.resource.<node>.*` comes;
- pools: `broker.list-brokers`, on any broker event and every `refresh` seconds (`add-broker` and
  the end of a cooling publish no event);
- events: a subscription to `<prefix>.events.>`, and on start the latest ones the events stream
  keeps; metric samples go to the charts, not to the list;
- metrics: a `register-notifier` lease on each charted metric of each metrics agent, renewed, and
  the samples' events.

A service that does not answer is shown as absent (its part keeps what was last read, marked as
such); nothing here stops because a service or the bus is gone.

A page calls `feed()`: it gets the whole state as one `snapshot` message, then every change as a
message of its own kind (`bus`, `services`, `nodes`, `node`, `node-removed`, `pools`, `events`,
`event`, `agents`, `sample`), formatted as server-sent events. A page that falls too far behind is
cut off; its browser reconnects and starts again from a snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from datetime import UTC
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from bus import discovery
from bus.client import BusClient
from bus.connection import connect, subscriptions_in_place
from bus.errors import BusError

log = logging.getLogger("berth.dashboard")

SERVICES = ("allocation", "broker", "metrics")

# What is charted for each metrics agent: (metric, at node scope; title; unit).
CHARTS = (
    ("cpu.usage.ratio.system", "CPU busy", "ratio"),
    ("cpu.load.1min.system", "load, 1 min", "count"),
    ("mem.used.system", "memory used", "bytes"),
    ("procs.running.system", "runnable tasks", "count"),
)

PLUGIN_ORDER = {"cpumem": 0, "storage": 1, "gpu": 2}
UNITS = {"cpu": "cores", "memory": "bytes", "storage": "bytes"}


# -- what the page draws ---------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def node_view(node: dict[str, Any]) -> dict[str, Any]:
    """A `list-nodes` entry as the page draws it: labels, and a bar (used of total) per resource.

    A plugin's bars are its numeric capacity keys (cpumem: cpu, memory; storage: storage) and one
    per product of a `prod_count_map` (gpu); per-core maps and volumes are left out."""
    capacity, usage = node.get("capacity") or {}, node.get("usage") or {}
    bars = []
    for plugin in sorted(capacity, key=lambda p: (PLUGIN_ORDER.get(p, 9), p)):
        total, used = capacity[plugin] or {}, usage.get(plugin) or {}
        for key, value in total.items():
            if _number(value) and (value or used.get(key)):
                bars.append(_bar(plugin, key, used.get(key, 0), value, UNITS.get(key, "")))
        products, taken = total.get("prod_count_map") or {}, used.get("prod_count_map") or {}
        for product in sorted(products):
            bars.append(_bar(plugin, product, taken.get(product, 0), products[product], "count"))
    return {"nodename": node["nodename"], "labels": node.get("labels") or {}, "bars": bars}


def _bar(plugin: str, resource: str, used: Any, total: Any, unit: str) -> dict[str, Any]:
    return {
        "plugin": plugin,
        "resource": resource,
        "used": used if _number(used) else 0,
        "total": total,
        "unit": unit,
    }


def services_view(prefix: str, stats: list) -> list[dict[str, Any]]:
    """Every berth service of the prefix, with its live instances (none: the service is absent)."""
    return [
        {
            "name": name,
            "service": f"{prefix}-{name}",
            "instances": [_instance(s) for s in stats if s.name == f"{prefix}-{name}"],
        }
        for name in SERVICES
    ]


def _instance(stats) -> dict[str, Any]:
    requests = sum(e.num_requests for e in stats.endpoints)
    busy_ns = sum(e.processing_time for e in stats.endpoints)
    started = stats.started.replace(tzinfo=UTC).timestamp() if stats.started else None
    return {
        "id": stats.id,
        "version": stats.version,
        "started": started,
        "endpoints": len(stats.endpoints),
        "requests": requests,
        "errors": sum(e.num_errors for e in stats.endpoints),
        "avg_ms": round(busy_ns / requests / 1e6, 3) if requests else 0.0,
        "node": (stats.metadata or {}).get("node"),
    }


def event_view(subject: str, body: dict[str, Any]) -> dict[str, Any]:
    """An event for the list: `subject` is the part after `<prefix>.events.`."""
    return {
        "time": body.get("time"),
        "subject": subject,
        "service": subject.split(".", 1)[0],
        "type": body.get("type") or subject.rsplit(".", 1)[-1],
        "detail": summary(body),
    }


_NOT_SUMMARIZED = {"type", "time", "version", "nodename", "before", "after"}


def summary(body: dict[str, Any]) -> str:
    """The event's own fields in one short line: scalars as key=value, lists by their length."""
    parts = []
    for key, value in body.items():
        if key in _NOT_SUMMARIZED:
            continue
        if isinstance(value, list):
            parts.append(f"{key}: {len(value)}")
        elif isinstance(value, (str, int, float)) and value != "":
            parts.append(f"{key}={value}")
    return " ".join(parts)


def sse(kind: str, data: Any) -> str:
    """One server-sent event (JSON has no raw newline, so one `data:` line is enough)."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"


# -- pages -----------------------------------------------------------------------------------


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


# -- the bus side ----------------------------------------------------------------------------


class Live:
    def __init__(
        self,
        nats_url: str | None,
        prefix: str = "berth",
        *,
        refresh: float = 5.0,
        resync: float = 30.0,
        lease_seconds: float = 30.0,
        points: int = 180,
        events_kept: int = 100,
        max_agents: int = 16,
    ) -> None:
        self.nats_url = nats_url
        self.prefix = prefix
        self._events_root = f"{prefix}.events."
        self.refresh, self.resync, self.lease_seconds = refresh, resync, lease_seconds
        self.points, self.max_agents = points, max_agents
        self.nc = None
        self.client: BusClient | None = None
        self.bus = {"connected": False, "error": "connecting"}
        self.services = services_view(prefix, [])
        self.nodes: dict[str, dict[str, Any]] = {}
        self.nodes_available: bool | None = None  # None: not read yet
        self.pools: list[dict[str, Any]] = []
        self.pools_available: bool | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=events_kept)
        self.series: dict[str, dict[str, deque]] = {}  # metrics agent's node -> metric -> [[time, value]]
        self.feeds: set[Feed] = set()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._watches: dict[str, asyncio.Task] = {}
        self._dirty_nodes: set[str] = set()
        self._all_nodes = True
        self._nodes_wake = asyncio.Event()
        self._pools_wake = asyncio.Event()

    # -- pages

    def snapshot(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "bus": self.bus,
            "services": self.services,
            "nodes": self._nodes_message(),
            "pools": self._pools_message(),
            "events": list(self.events),
            "charts": [{"metric": m, "title": t, "unit": u} for m, t, u in CHARTS],
            "agents": sorted(self.series),
            "series": {node: {m: list(p) for m, p in series.items()} for node, series in self.series.items()},
        }

    def feed(self) -> Feed:
        """A new page's feed, starting with the snapshot (taken now: no change is missed or doubled)."""
        feed = Feed(sse("snapshot", self.snapshot()))
        self.feeds.add(feed)
        return feed

    def unfeed(self, feed: Feed) -> None:
        self.feeds.discard(feed)

    def close_feeds(self) -> None:
        for feed in self.feeds:
            feed.close()
        self.feeds.clear()

    def broadcast(self, kind: str, data: Any) -> None:
        if not self.feeds:
            return
        message = sse(kind, data)
        for feed in list(self.feeds):
            feed.push(message)
            if feed.closed:
                self.feeds.discard(feed)

    def _nodes_message(self) -> dict[str, Any]:
        return {"available": self.nodes_available, "nodes": [self.nodes[name] for name in sorted(self.nodes)]}

    def _pools_message(self) -> dict[str, Any]:
        return {"available": self.pools_available, "pools": self.pools}

    # -- life

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="dashboard")]

    async def stop(self) -> None:
        self._stopping = True
        self.close_feeds()
        tasks = [*self._watches.values(), *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    def _set_bus(self, connected: bool, error: str = "") -> None:
        self.bus = {"connected": connected, "error": error}
        self.broadcast("bus", self.bus)

    async def _run(self) -> None:
        self.nc = await self._connect()
        self.client = BusClient(self.nc, prefix=self.prefix, timeout=5.0)
        await self.nc.subscribe(f"{self.prefix}.events.>", cb=self._on_event)
        try:  # "live" on the page means that no later event is missed
            await subscriptions_in_place(self.nc, 2.0, as_client=True)
        except Exception as error:  # the connection is moving: the reconnect re-reads everything
            log.debug("subscription barrier: %r", error)
        self._set_bus(True)
        await self._read_past_events()
        await asyncio.gather(self._services_loop(), self._nodes_loop(), self._pools_loop())

    async def _connect(self):
        """Connect, trying again forever (as workers do); while NATS cannot be reached, the page
        shows why, and the log says it once per new reason rather than twice a second."""

        async def error(error: Exception) -> None:
            text = f"NATS: {error}"
            if self.bus["connected"]:
                log.error("nats error: %r", error)  # slow consumer, permissions violation...
            elif text != self.bus["error"]:
                log.warning("cannot reach NATS: %r", error)
                self._set_bus(False, text)

        async def disconnected() -> None:
            if not self._stopping:
                log.warning("nats disconnected")
                self._set_bus(False, "disconnected from NATS; reconnecting")

        async def reconnected() -> None:
            log.warning("nats reconnected")
            self._set_bus(True)
            self._wake_nodes(every=True)  # events may have been missed meanwhile
            self._pools_wake.set()

        while True:
            try:
                return await connect(
                    self.nats_url,
                    name="berth-dashboard",
                    worker=True,
                    error_cb=error,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                )
            except Exception as failure:  # refused outright (a bad URL...): say so, and try again
                log.warning("cannot connect to NATS: %r", failure)
                self._set_bus(False, f"cannot connect to NATS: {failure}")
                await asyncio.sleep(2.0)

    # -- services

    async def _services_loop(self) -> None:
        while True:
            try:
                self._set_services(await discovery.stats(self.nc, timeout=1.0))
            except Exception as error:
                log.warning("service discovery: %r", error)
            await asyncio.sleep(self.refresh)

    def _set_services(self, stats: list) -> None:
        before = {s["name"]: bool(s["instances"]) for s in self.services}
        self.services = services_view(self.prefix, stats)
        self.broadcast("services", self.services)
        present = {s["name"]: bool(s["instances"]) for s in self.services}
        if present["allocation"] and not before["allocation"]:
            self._wake_nodes(every=True)
        if present["broker"] and not before["broker"]:
            self._pools_wake.set()
        agents = sorted(
            {i["node"] for s in self.services if s["name"] == "metrics" for i in s["instances"] if i["node"]}
        )
        self._watch_agents(agents[: self.max_agents])

    # -- nodes

    def _wake_nodes(self, node: str | None = None, every: bool = False) -> None:
        if every:
            self._all_nodes = True
        elif node is not None:
            self._dirty_nodes.add(node)
        self._nodes_wake.set()

    async def _nodes_loop(self) -> None:
        self._nodes_wake.set()
        while True:
            try:
                await asyncio.wait_for(self._nodes_wake.wait(), self.resync)
            except TimeoutError:
                self._all_nodes = True
            self._nodes_wake.clear()
            every, names = self._all_nodes, self._dirty_nodes
            self._all_nodes, self._dirty_nodes = False, set()
            try:
                if every:
                    await self._read_all_nodes()
                elif names:
                    await self._read_nodes(sorted(names))
            except BusError as error:
                if error.code == "node_not_found":  # removed since its event: read them all
                    self._wake_nodes(every=True)
                else:
                    self._nodes_unavailable(error)
            except Exception as error:
                self._nodes_unavailable(error)

    async def _read_all_nodes(self) -> None:
        nodes: dict[str, dict[str, Any]] = {}
        offset = 0
        while offset is not None:
            page = await self.client.request("resource.list-nodes", {"offset": offset, "limit": 1000})
            for node in page["nodes"]:
                nodes[node["nodename"]] = node_view(node)
            offset = page.get("next_offset")
        self.nodes, self.nodes_available = nodes, True
        self.broadcast("nodes", self._nodes_message())

    async def _read_nodes(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):
            page = await self.client.request(
                "resource.list-nodes", {"nodenames": names[start : start + 1000], "limit": 1000}
            )
            for node in page["nodes"]:
                view = node_view(node)
                if self.nodes.get(view["nodename"]) != view:
                    self.nodes[view["nodename"]] = view
                    self.broadcast("node", view)
        if not self.nodes_available:
            self.nodes_available = True
            self.broadcast("nodes", self._nodes_message())

    def _nodes_unavailable(self, error: Exception) -> None:
        log.info("nodes not read: %r", error)
        if self.nodes_available is not False:
            self.nodes_available = False  # the last nodes read stay, marked as such
            self.broadcast("nodes", self._nodes_message())

    # -- pools

    async def _pools_loop(self) -> None:
        while True:
            try:
                reply = await self.client.request("broker.list-brokers", {})
                pools, available = sorted(reply["brokers"], key=lambda b: (b["user"], b["name"])), True
            except Exception as error:
                log.info("pools not read: %r", error)
                pools, available = self.pools, False
            if (pools, available) != (self.pools, self.pools_available):
                self.pools, self.pools_available = pools, available
                self.broadcast("pools", self._pools_message())
            try:
                await asyncio.wait_for(self._pools_wake.wait(), self.refresh)
            except TimeoutError:
                pass
            self._pools_wake.clear()

    # -- events

    async def _on_event(self, msg) -> None:
        try:
            body = msgspec.msgpack.decode(msg.data)
        except msgspec.DecodeError:
            return
        if not isinstance(body, dict):
            return
        subject = msg.subject.removeprefix(self._events_root)
        tokens = subject.split(".")
        if tokens[0] == "metrics" and body.get("type") == "metric":
            self._add_sample(tokens[1], body)
            return
        view = event_view(subject, body)
        self.events.append(view)
        self.broadcast("event", view)
        if tokens[0] == "resource" and len(tokens) >= 3:
            node = tokens[1]
            if tokens[-1] == "removed" and self.nodes.pop(node, None) is not None:
                self.broadcast("node-removed", {"nodename": node})
            self._wake_nodes(node)  # read it again (a removal too: a node of several plugins may stay)
        elif tokens[0] == "broker":
            self._pools_wake.set()

    async def _read_past_events(self) -> None:
        """The latest events the `<prefix>-events` stream keeps, so that a page opened now is not
        empty (best effort: without the stream, the list starts with the next event)."""
        stream = f"{self.prefix}-events"
        try:
            js = self.nc.jetstream()
            state = (await js.stream_info(stream)).state
            if not state.messages:
                return
            past = []
            for seq in range(
                max(state.first_seq, state.last_seq - self.events.maxlen + 1), state.last_seq + 1
            ):
                try:
                    msg = await js.get_msg(stream, seq)
                except NotFoundError:
                    continue  # deleted
                body = msgspec.msgpack.decode(msg.data)
                if isinstance(body, dict):
                    past.append(event_view(msg.subject.removeprefix(self._events_root), body))
        except Exception as error:  # no stream yet, or not allowed to read it
            log.info("past events not read: %r", error)
            return
        seen = {(e["subject"], e["time"]) for e in self.events}  # came live since the subscription
        merged = [e for e in past if (e["subject"], e["time"]) not in seen] + list(self.events)
        self.events.clear()
        self.events.extend(merged)
        self.broadcast("events", list(self.events))

    # -- metrics

    def _watch_agents(self, agents: list[str]) -> None:
        if agents == sorted(self._watches):
            return
        for node in [n for n in self._watches if n not in agents]:
            self._watches.pop(node).cancel()
            self.series.pop(node, None)
        for node in agents:
            if node not in self._watches:
                self.series[node] = {metric: deque(maxlen=self.points) for metric, _, _ in CHARTS}
                self._watches[node] = asyncio.create_task(self._watch(node), name=f"dashboard-watch-{node}")
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
                except Exception as error:  # the agent is gone: the lease ends by itself
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
            self._add_sample(node, {**entry, "sample_time": entry.get("time")})

    def _add_sample(self, node: str, body: dict[str, Any]) -> None:
        series = self.series.get(node)
        if series is None or body.get("scope") != "node" or body.get("metric") not in series:
            return
        points = series[body["metric"]]
        t, v = body.get("sample_time") or body.get("time"), body.get("value")
        if not (_number(t) and _number(v)) or (points and t <= points[-1][0]):
            return
        points.append([t, v])
        self.broadcast("sample", {"node": node, "metric": body["metric"], "t": t, "v": v})
