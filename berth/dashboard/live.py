"""What the dashboard shows, kept up to date from the bus and pushed to every open page.

The dashboard is a plain NATS client (the client user's rights are enough). Everything runs in
one asyncio loop, the web server's. Each part of the page has its own rule:

- services: `$SRV.STATS`, every `refresh` seconds (no event says that an instance came or went),
  shown for every service `berth up` starts (berth/registry.py), the node agents included;
- nodes: `resource.list-nodes`, page by page, every `resync` seconds; a node alone (`list-nodes`
  with its name) when one of its `events.resource.<node>.*` comes;
- pools: `broker.list-brokers`, on any broker event and every `refresh` seconds (`add-broker` and
  the end of a cooling publish no event);
- events: a subscription to `<prefix>.events.>`, and on start the latest ones the events stream
  keeps; metric samples go to the charts, not to the list;
- metrics: a `register-notifier` lease on each charted metric of each metrics agent, renewed, and
  the samples' events.

Until a part is first read (services, nodes, pools, the stream's events), it is marked as not
read yet (`available: None`, `events_read: False`), and the page says "connecting…" there rather
than claiming that there is nothing. A service that does not answer is shown as absent (its part
keeps what was last read, marked as such); nothing here stops because a service or the bus is gone.

A page calls `feed()`: it gets the whole state as one `snapshot` message, then every change as a
message of its own kind (`bus`, `services`, `nodes`, `node`, `node-removed`, `pools`, `events`,
`event`, `agents`, `sample`), formatted as server-sent events. A page that falls too far behind is
cut off; its browser reconnects and starts again from a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from berth.dashboard.charts import AgentCharts
from berth.dashboard.feed import Feed
from berth.dashboard.views import CHARTS, event_view, node_view, services_view, shown, sse
from bus import discovery
from bus.client import BusClient
from bus.codec import decode_stored
from bus.connection import connect, subscriptions_in_place
from bus.tasks import cancel_and_wait
from schemas.errors import BusError

log = logging.getLogger("berth.dashboard")


class Live:
    """What every open page shows, and the tasks that keep it current (`start`, `stop`)."""

    def __init__(
        self,
        nats_url: str | None,
        prefix: str = "berth",
        *,
        js_domain: str | None = None,
        refresh: float = 5.0,
        resync: float = 30.0,
        lease_seconds: float = 30.0,
        points: int = 180,
        events_kept: int = 100,
        max_agents: int = 16,
    ) -> None:
        self.nats_url = nats_url
        self.prefix = prefix
        self.js_domain = js_domain  # where the streams' API is (bus.events.EventBus)
        self._events_root = f"{prefix}.events."
        self.refresh, self.resync = refresh, resync
        self.max_agents = max_agents
        self.nc = None
        self.client: BusClient | None = None
        self.bus = {"connected": False, "error": "connecting"}
        self.services = services_view(prefix, [])
        self.services_available: bool | None = None  # None: not asked yet (the page says "connecting…")
        self.nodes: dict[str, dict[str, Any]] = {}
        self.nodes_available: bool | None = None  # None: not read yet
        self.pools: list[dict[str, Any]] = []
        self.pools_available: bool | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=events_kept)
        self.events_read = False  # the stream's latest events were read (or could not be)
        self.charts = AgentCharts(self.broadcast, points=points, lease_seconds=lease_seconds)
        self.feeds: set[Feed] = set()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._dirty_nodes: set[str] = set()
        self._all_nodes = True
        self._nodes_wake = asyncio.Event()
        self._pools_wake = asyncio.Event()

    # -- pages

    def snapshot(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "bus": self.bus,
            "services": self._services_message(),
            "nodes": self._nodes_message(),
            "pools": self._pools_message(),
            "events": list(self.events),
            "events_read": self.events_read,
            "charts": [{"metric": metric, "title": title, "unit": unit} for metric, title, unit in CHARTS],
            "agents": sorted(self.charts.series),
            "series": {
                node: {metric: list(points) for metric, points in series.items()}
                for node, series in self.charts.series.items()
            },
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

    def _services_message(self) -> dict[str, Any]:
        return {"available": self.services_available, "services": self.services}

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
        await cancel_and_wait(*self.charts.watches.values(), *self.charts.retired, *self._tasks)
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    def _set_bus(self, connected: bool, error: str = "") -> None:
        self.bus = {"connected": connected, "error": error}
        self.broadcast("bus", self.bus)

    async def _run(self) -> None:
        self.nc = await self._connect()
        self.client = BusClient(self.nc, prefix=self.prefix, timeout=5.0)
        self.charts.client = self.client
        await self.nc.subscribe(f"{self.prefix}.events.>", cb=self._on_event)
        try:  # "live" on the page means that no later event is missed
            await subscriptions_in_place(self.nc, 2.0, as_client=True)
        except Exception as error:  # the connection is moving: the reconnect re-reads everything
            log.debug("subscription barrier: %r", error)
        self._set_bus(True)
        await self._read_past_events()
        self.events_read = True  # from now on, an empty list means that no event is kept
        self.broadcast("events", list(self.events))
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
                if self.services_available is not False:
                    self.services_available = False  # the instances as last read stay, marked as such
                    self.broadcast("services", self._services_message())
            await asyncio.sleep(self.refresh)

    def _set_services(self, stats: list) -> None:
        before = {service["name"]: bool(service["instances"]) for service in self.services}
        self.services, self.services_available = services_view(self.prefix, stats), True
        self.broadcast("services", self._services_message())
        present = {service["name"]: bool(service["instances"]) for service in self.services}
        if present["allocation"] and not before["allocation"]:
            self._wake_nodes(every=True)
        if present["broker"] and not before["broker"]:
            self._pools_wake.set()
        agents = sorted(
            {
                instance["node"]
                for service in self.services
                if service["name"] == "metrics"
                for instance in service["instances"]
                if instance["node"]
            }
        )
        self.charts.watch(agents[: self.max_agents])

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
                pools, available = (
                    sorted(reply["brokers"], key=lambda broker: (broker["user"], broker["name"])),
                    True,
                )
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
            body = decode_stored(msg.data)
        except msgspec.DecodeError:
            return
        if not isinstance(body, dict):
            return
        subject = msg.subject.removeprefix(self._events_root)
        if not shown(subject):
            return
        tokens = subject.split(".")
        if tokens[0] == "metrics" and body.get("type") == "metric":
            self.charts.add_sample(tokens[1], body)
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
            js = self.nc.jetstream(domain=self.js_domain)
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
                body, subject = decode_stored(msg.data), msg.subject.removeprefix(self._events_root)
                if isinstance(body, dict) and shown(subject):
                    past.append(event_view(subject, body))
        except Exception as error:  # no stream yet, or not allowed to read it
            log.info("past events not read: %r", error)
            return
        seen = {
            (event["subject"], event["time"]) for event in self.events
        }  # came live since the subscription
        merged = [event for event in past if (event["subject"], event["time"]) not in seen] + list(
            self.events
        )
        self.events.clear()
        self.events.extend(merged)
