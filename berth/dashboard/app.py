"""The web side: a Starlette app on uvicorn, serving the page, its files and the live stream.

GET /              the page (static/index.html)
GET /favicon.ico   a small icon (an SVG), so that browsers asking for one get no 404
GET /static/...    its CSS and ES modules, from this package (nothing is fetched at run time)
GET /api/state     everything the page shows, as one JSON document
GET /api/stream    server-sent events: `snapshot` first, then each change (see live.py)
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from berth.dashboard.live import Live
from berth.settings import DashboardConfig

STATIC = Path(__file__).resolve().parent / "static"
KEEP_ALIVE = 15.0  # seconds between comments on an idle stream, so that proxies keep it open
# a berth: a hull on a line of water (an SVG, which browsers take at /favicon.ico too)
FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
           b'<path d="M2 8h12l-2 4H4z" fill="#3d5a80"/>'
           b'<path d="M1 14h14" stroke="#98c1d9" stroke-width="1.5"/></svg>')


def make_app(live: Live) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        await live.start()
        try:
            yield
        finally:
            await live.stop()

    async def index(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def favicon(request: Request) -> Response:
        return Response(FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    async def state(request: Request) -> JSONResponse:
        return JSONResponse(live.snapshot())

    async def stream(request: Request) -> StreamingResponse:
        feed = live.feed()

        async def messages():
            try:
                yield "retry: 1000\n\n"  # the browser reconnects a second after the stream ends
                while (message := await feed.next(KEEP_ALIVE)) is not None:
                    yield message or ": keep-alive\n\n"
            finally:
                live.unfeed(feed)

        return StreamingResponse(
            messages(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return Starlette(
        routes=[
            Route("/", index),
            Route("/favicon.ico", favicon),
            Route("/api/state", state),
            Route("/api/stream", stream),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        lifespan=lifespan,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, which closes the pages' streams first when it stops: an open stream
    would otherwise hold the shutdown until uvicorn's grace period runs out."""

    def __init__(self, config: uvicorn.Config, live: Live) -> None:
        super().__init__(config)
        self.live = live

    async def shutdown(self, sockets=None) -> None:
        self.live.close_feeds()
        await super().shutdown(sockets)


async def serve(config: DashboardConfig, announce: Callable[[str], None] | None = print) -> None:
    """Serve until SIGTERM or SIGINT. Port 0 takes a free one; `announce` gets the page's URL
    once the port listens (connections made from then on wait for the server, none is refused)."""
    host, port = config.host, config.port
    live = Live(config.nats, config.prefix, js_domain=config.js_domain)
    config = uvicorn.Config(
        make_app(live), log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=2
    )
    server = _Server(config, live)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    # uvicorn swaps in its own signal handlers while it serves and raises the signal again once
    # it has stopped: ours take that second delivery, so the process ends with status 0.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    if announce:
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        announce(f"dashboard: http://{shown}:{sock.getsockname()[1]}/")
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()


def run(config: DashboardConfig) -> int:
    announce = None if config.quiet else lambda line: print(line, flush=True)
    asyncio.run(serve(config, announce))
    return 0
