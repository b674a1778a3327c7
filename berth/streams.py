"""The administrator's step of a deployment with accounts: its events streams are set up before any
worker starts, as the streams' own user (berth/accounts.py `STREAMS_ADMIN`), because no service
user may create, change or delete a stream. `berth up` runs it on every start (a stream that is
there already gets only the subjects it lacks; its limits stay as they are), and an upgrade that
adds a service's subjects runs it again."""

from __future__ import annotations

from berth.registry import contracts
from bus.connection import connect
from bus.events import EventBus, StreamSpec


def every_stream() -> list[StreamSpec]:
    """The streams of every installed service (several share one; their subjects add up)."""
    return [module.STREAM for module in contracts().values()]


async def set_up(
    nats_url: str, prefix: str, *, user: str, password: str, memory: bool = False, tls_ca: str | None = None
) -> None:
    """Create every stream, or add the subjects it lacks, connected to `nats_url` as `user`."""
    nc = await connect(nats_url, name=f"{prefix}-streams-admin", worker=False, tls_ca=tls_ca, user=user,
                       password=password)
    try:
        events = EventBus(nc, prefix=prefix)  # the streams' account: its own `$JS.API`
        for spec in every_stream():
            await events.ensure_stream(spec, memory=memory)
    finally:
        await nc.close()
