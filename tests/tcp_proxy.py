"""A TCP relay on loopback that a test can cut and restore: a network partition between one
process and one server (a worker and Redis, a worker and NATS), the server itself untouched.

    proxy = await TcpProxy.start("127.0.0.1", 6379)
    worker = start_worker(..., redis_url=proxy.url("redis"))
    proxy.cut("reset")   # live connections reset; new ones reset at once (a refused link)
    proxy.cut("drop")    # live connections reset; new ones accepted and never answered (a black hole)
    proxy.cut("stall")   # nothing closed, nothing relayed: a silent partition; bytes wait in the relay
    proxy.cut("swallow") # nothing closed, every byte either way thrown away, and a side's close
                         # too: a silent link whose peers notice only by their own timeouts and pings
    proxy.restore()      # relay again; connections the black hole held are reset, a stall's bytes
                         # are delivered late (as TCP retransmits once a short partition heals), and
                         # a link that lost bytes to `swallow` is reset (its stream has a gap)

Counters say what a cut touched, so that a test can show that its fault hit: `accepted`
(connections relayed since start), `cut_live` (live connections a cut closed), `refused` and
`held` (connections that came during a cut), `swallowed` (bytes thrown away), `ended` (links that
ended by a side closing), `server_closed` (links whose server side closed them: a server drops a
client that stopped answering its pings).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field

MODES = ("reset", "drop", "stall", "swallow")


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST, not a FIN: the peer's next read or write fails at once, as when the
    other end or a middlebox forgot the connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed
    writer.transport.abort()


@dataclass(eq=False)  # kept in a set: hashed by identity
class Link:
    """One relayed connection: the client side, the server side, and the two pumps between them."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    pumps: list[asyncio.Task] = field(default_factory=list)
    gap: bool = False  # bytes were thrown away: what the peers read next is out of step

    def close(self) -> None:
        for pump in self.pumps:
            pump.cancel()
        reset(self.client)
        reset(self.server)


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.mode: str | None = None  # None: relaying; else the cut's mode
        self.accepted = 0
        self.cut_live = 0
        self.refused = 0
        self.held = 0
        self.swallowed = 0
        self.ended = 0
        self.server_closed = 0
        self._links: set[Link] = set()
        self._black_hole: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()  # cleared while stalled: every pump waits before it writes
        self._flowing.set()

    @classmethod
    async def start(cls, host: str, port: int, *, listen: str = "127.0.0.1") -> "TcpProxy":
        """A relay to (host, port), on a free port of `listen` (loopback, or a test's own veth)."""
        proxy = cls(host, port)
        proxy._server = await asyncio.start_server(proxy._accept, listen, 0)
        return proxy

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def url(self, scheme: str, path: str = "") -> str:
        host = self._server.sockets[0].getsockname()[0]
        return f"{scheme}://{host}:{self.port}{path}"

    def cut(self, mode: str = "reset") -> int:
        """Partition the link: every live connection is reset, and new ones are reset at once
        (`reset`) or held without a byte relayed (`drop`). Returns how many live ones it closed.
        `stall` closes nothing: live and new connections stay open, and no byte crosses until
        `restore`; returns how many live connections it froze."""
        assert mode in MODES, mode
        self.mode = mode
        if mode in ("stall", "swallow"):
            if mode == "stall":
                self._flowing.clear()
            self.cut_live += len(self._links)
            return len(self._links)
        links, self._links = self._links, set()
        for link in links:
            link.close()
        self.cut_live += len(links)
        return len(links)

    def restore(self) -> None:
        """Heal the link. What the black hole held is reset: its bytes never went anywhere, so the
        peer must connect again (through the relay, now)."""
        self.mode = None
        self._flowing.set()
        held, self._black_hole = self._black_hole, set()
        for writer in held:
            reset(writer)
        for link in [link for link in self._links if link.gap]:
            self._links.discard(link)
            link.close()

    async def close(self) -> None:
        self.cut("reset")
        self.restore()
        self._server.close()
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            self.refused += 1
            reset(writer)
        elif self.mode in ("drop", "swallow"):
            self.held += 1
            self._black_hole.add(writer)  # never read, never answered: the peer waits
        else:
            if self.mode == "stall":
                self.held += 1  # relayed once the link heals
            await self._relay(reader, writer)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            reset(writer)  # the server itself is down: as a refused connection
            return
        if self.mode in ("reset", "drop"):  # cut while we were connecting
            reset(server_writer)
            reset(writer)
            return
        link = Link(writer, server_writer)
        link.pumps = [asyncio.create_task(self._pump(reader, server_writer, link)),
                      asyncio.create_task(self._pump(server_reader, writer, link, from_server=True))]
        self._links.add(link)
        self.accepted += 1

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, link: Link, *, from_server: bool = False
    ) -> None:
        try:
            while data := await source.read(65536):
                await self._flowing.wait()
                if self.mode == "swallow":
                    self.swallowed += len(data)
                    link.gap = True
                    continue
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass  # either side went away: the link ends
        if from_server:
            self.server_closed += 1
        if self.mode == "swallow":  # the close is swallowed too: the other side sees nothing
            link.gap = True
            return
        # One side closed or failed: end the whole link, as a plain TCP path would for both peers.
        if link in self._links:
            self.ended += 1
            self._links.discard(link)
            for pump in link.pumps:
                if pump is not asyncio.current_task():
                    pump.cancel()
            link.client.close()
            link.server.close()
