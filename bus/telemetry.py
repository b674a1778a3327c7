"""Prometheus metrics of a worker process: the request metrics every service shares, the tools the
services use for their own, and the HTTP server that `--metrics-port` starts.

Every worker counts, per endpoint (labels `service`, `endpoint`: the service's name and the
command's subject below the prefix):

    berth_requests_total                     counter    requests answered
    berth_request_errors_total{code}         counter    error replies, by error code (`node_not_found`, ...)
    berth_request_duration_seconds           histogram  from taking the request to sending its reply

The runtime (`bus.service`) gets one `EndpointMeter` per endpoint when it starts, which holds the
label children: a request costs two increments and one histogram observation, nothing is looked
up or built per request. Services define their own metrics next to their code (see
`services/*/telemetry.py`) in the process-wide default registry.

Figures that are read rather than counted (how many nodes there are, how full the pools are) are
computed when Prometheus scrapes: a service registers an async `on_scrape` hook that refreshes them
from Redis at most every `every` seconds (concurrent scrapes share one refresh), and publishes them
in a `GaugeTable`, whose label sets are replaced as a whole so that what went away disappears.

The server (`MetricsServer`) is a small HTTP/1.1 server on the worker's event loop: a scrape runs
the due hooks in the loop, then renders the registry in a worker thread (an allocation worker's
many endpoints make a long text, whose rendering would hold the loop: in a thread, requests keep
being served meanwhile). Rendering reads only thread-safe state: the client library's metrics lock their
values, and a `GaugeTable` is replaced whole, never changed in place. It answers `GET /metrics`
(and `/`), one request per connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

import msgspec
from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from bus.codec import decoder
from bus.tasks import cancel_and_wait
from schemas.common import ErrorBody

log = logging.getLogger("berth.telemetry")

# The `_created` series Prometheus' client adds beside every counter and histogram double the
# text a scrape renders and say nothing a process start time does not.
disable_created_metrics()

# Seconds, 0.1 ms to 10 s: a cached read answers in well under a millisecond, an allocation over
# thousands of nodes in tens of milliseconds, a broker launch in seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

REQUESTS = Counter("berth_requests", "Requests answered, by service and endpoint.", ("service", "endpoint"))
REQUEST_ERRORS = Counter(
    "berth_request_errors",
    "Requests answered with an error, by service, endpoint and error code (the code of the reply's error body).",
    ("service", "endpoint", "code"),
)
OUTCOMES_RESOLVED = Counter(
    "berth_outcomes_resolved",
    "Requests whose store failed after a change was sent, and that learned what happened and answered it "
    "(those that could not are answered outcome_unknown: berth_request_errors_total{code=\"outcome_unknown\"}).",
)
REQUEST_DURATION = Histogram(
    "berth_request_duration_seconds",
    "Time from taking a request to sending its reply (decode, handler, encode), by service and endpoint.",
    ("service", "endpoint"),
    buckets=LATENCY_BUCKETS,
)


_decode_error = decoder(ErrorBody)


def error_code(body: bytes, status: str | None) -> str:
    """The code of an error reply's body (`{"error": {"code": ...}}`); the status if it has none."""
    try:
        return _decode_error(body).error.code or status or "unknown"
    except msgspec.DecodeError:  # not our error body: a nats.micro error reply
        return status or "unknown"


class EndpointMeter:
    """One endpoint's request metrics, with their label children made once."""

    __slots__ = ("_duration", "_errors", "_requests", "endpoint", "service")

    def __init__(self, service: str, endpoint: str) -> None:
        self.service = service
        self.endpoint = endpoint
        self._requests = REQUESTS.labels(service, endpoint)
        self._duration = REQUEST_DURATION.labels(service, endpoint)
        self._errors: dict[str, Counter] = {}

    def record(self, seconds: float, error: str | None = None) -> None:
        """One answered request: how long it took and, for an error reply, its code."""
        self._requests.inc()
        self._duration.observe(seconds)
        if error is not None:
            child = self._errors.get(error)
            if child is None:
                child = self._errors[error] = REQUEST_ERRORS.labels(self.service, self.endpoint, error)
            child.inc()


class GaugeTable(Collector):
    """A gauge family whose samples are replaced all at once by whoever computes them.

        POOL = GaugeTable("berth_broker_pool_resources", "...", ("user", "broker", "state"))
        POOL.replace({("u", "b", "idle"): 3, ...})

    Registered in the default registry on creation (once per process: define it at module level).
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        if registry is not None:
            registry.register(self)

    def replace(self, values: Mapping[tuple[str, ...], float]) -> None:
        self.values = dict(values)  # a new dict: a scrape rendering the old one meanwhile is unaffected

    def set(self, value: float) -> None:
        """For a family without labels."""
        self.values = {(): value}

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in sorted(self.values.items()):
            family.add_metric(labels, value)
        yield family


# -- refreshing figures on scrape ------------------------------------------------------------------


class ScrapeHook:
    """An async refresh run before a scrape renders, at most every `every` seconds."""

    def __init__(self, name: str, refresh: Callable[[], Awaitable[None]], every: float) -> None:
        self.name = name
        self.refresh = refresh
        self.every = every
        self.done_at = -float("inf")  # monotonic time the last refresh finished
        self._running: asyncio.Task | None = None

    async def run_if_due(self) -> None:
        if self._running is None:
            if time.monotonic() - self.done_at < self.every:
                return
            self._running = asyncio.create_task(self._run())
        # Scrapes that arrive during a refresh wait for the same one; a scrape that gives up
        # (its client went away) does not cancel it for the others.
        await asyncio.shield(self._running)

    async def _run(self) -> None:
        try:
            await self.refresh()
        except Exception as error:  # Redis unreachable, say: the figures stay as they were
            log.warning("metrics refresh %s failed: %r", self.name, error)
        finally:
            self.done_at = time.monotonic()
            self._running = None


_HOOKS: list[ScrapeHook] = []


def on_scrape(
    name: str, refresh: Callable[[], Awaitable[None]], every: float = 10.0
) -> Callable[[], Awaitable[None]]:
    """Run `refresh` before a scrape renders, at most every `every` seconds. Returns the async
    remover (a worker's clean-up)."""
    hook = ScrapeHook(name, refresh, every)
    _HOOKS.append(hook)

    async def remove() -> None:
        if hook in _HOOKS:
            _HOOKS.remove(hook)

    return remove


async def refresh_all(timeout: float = 5.0) -> None:
    """Run the due hooks; one that takes longer than `timeout` goes on, and the scrape renders
    what there is (it finishes for a later scrape)."""
    due = [hook.run_if_due() for hook in list(_HOOKS)]
    if due:
        done = asyncio.gather(*due)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            log.warning("metrics refresh took more than %.0f s; rendering what is there", timeout)


# -- the HTTP server ---------------------------------------------------------------------------------

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_MAX_HEAD = 16 * 1024  # request line and headers
_READ_TIMEOUT = 10.0


class MetricsServer:
    """`GET /metrics` on `host:port` (port 0: a free one; `port` says which after `start`)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, registry: CollectorRegistry = REGISTRY) -> None:
        self.host = host
        self.port = port
        self.registry = registry
        self._server: asyncio.base_events.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=_MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening (the port is free when this returns) and end the scrapes in progress."""
        if self._server is None:
            return
        self._server.close()
        await cancel_and_wait(*self._handlers, *(hook._running for hook in _HOOKS))
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, asyncio.LimitOverrunError, ValueError):
            pass  # a client that went away, dawdled or sent too much: nothing to answer
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            self._handlers.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return await self._respond(writer, 400, b"bad request\n")
        method, target, _ = parts
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return await self._respond(writer, 405, b"only GET\n", extra=(("Allow", "GET, HEAD"),))
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return await self._respond(writer, 404, b"not found: the metrics are at /metrics\n")
        await refresh_all()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = await asyncio.to_thread(encoder, self.registry)
        await self._respond(writer, 200, body, content_type, head_only=method == "HEAD")

    async def _respond(
        self, writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
        *, extra: Iterable[tuple[str, str]] = (), head_only: bool = False,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in extra)]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        await writer.drain()
