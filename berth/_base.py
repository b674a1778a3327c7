"""What every generated method of berth/_commands.py calls: one request on the bus, its reply decoded
as the command's response Struct, an error reply raised as its family's `berth.Error`."""

from __future__ import annotations

from typing import Any, TypeVar

from nats.aio.client import Client as Nats

from berth.errors import from_bus
from bus.client import RETRY_FOR, BusClient
from schemas.errors import BusError

T = TypeVar("T")


class Bus(BusClient):
    """`bus.client.BusClient` whose errors are `berth.Error`s (its `change` retries on their code)."""

    def __init__(self, nc: Nats, *, prefix: str, timeout: float, retry_for: float = RETRY_FOR) -> None:
        super().__init__(nc, prefix=prefix, timeout=timeout)
        self.retry_for = retry_for

    async def request(self, subject: str, payload: Any, response: type[T] = dict, *,  # type: ignore[assignment]
                      timeout: float | None = None) -> T:
        try:
            return await super().request(subject, payload, response, timeout=timeout)
        except BusError as error:
            raise from_bus(error) from None


class Commands:
    """A group of commands on one connection: the classes of berth/_commands.py derive from it."""

    def __init__(self, bus: Bus, group: str = "") -> None:
        self._bus = bus
        self._group = group  # what follows `resource` in the eru plugin commands' subjects: "" or ".<plugin>"

    async def _call(self, subject: str, response: type[T], payload: dict[str, Any], *, change: bool,
                    timeout: float | None) -> T:
        """Send the given keys of `payload` (None: not given, the service's default applies). A state
        change goes with a `request_id` (one is made when it has none) and is sent again with it
        while the answer is not definite (`BusClient.change`); anything else is sent once."""
        given = {key: value for key, value in payload.items() if value is not None}
        if change:
            return await self._bus.change(subject, given, response, timeout=timeout, retry_for=self._bus.retry_for)
        return await self._bus.request(subject, given, response, timeout=timeout)
