"""The service runtime over a real nats-server: concurrency, errors, bad input, idempotency, drain."""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated

import msgpack
import msgspec
import pytest

from bus.codec import decode, encode
from schemas.errors import BusError, InvalidArgument, NoResponders, RequestTimeout
from tests import echo_service
from tests.bus_helpers import eventually
from tests.echo_service import Counted, Served, Typed


@pytest.fixture
async def echo(serve, prefix, redis):
    return await serve(echo_service.make_service(prefix, redis, concurrency=32))


async def test_slow_requests_are_served_in_parallel(echo, client):
    # Each request waits in its handler until all 20 are there at once: served one after another,
    # not one of them could return (they would answer not_met).
    replies = await asyncio.gather(
        *(client.request("echo.meet", {"parties": 20, "tag": str(i)}, Served) for i in range(20))
    )
    assert sorted(int(r.tag) for r in replies) == list(range(20))
    assert max(r.in_flight for r in replies) == 20


async def test_concurrency_is_bounded(serve, prefix, redis, client):
    await serve(echo_service.make_service(prefix, redis, concurrency=2))
    # Requests meet in pairs, so two run at once (both slots are used); none ever entered its handler
    # with more than two running.
    replies = await asyncio.gather(
        *(client.request("echo.meet", {"parties": 2, "tag": str(i)}, Served) for i in range(6))
    )
    assert sorted(int(r.tag) for r in replies) == list(range(6))
    assert max(r.in_flight for r in replies) == 2


@pytest.mark.parametrize(
    "code,status",
    [
        ("invalid_cpu", 400),
        ("node_not_found", 404),
        ("node_exists", 409),
        ("insufficient_capacity", 409),
        ("resource_already_released", 409),
        ("resource_not_running", 412),
        ("manager_not_running", 503),
        ("broker_cooling", 503),
        ("internal", 500),
    ],
)
async def test_domain_errors_map_to_headers_and_body(echo, client, nc, prefix, code, status):
    msg = await nc.request(f"{prefix}.echo.fail", encode({"code": code, "message": "nope"}), timeout=5)
    assert msg.headers["Nats-Service-Error-Code"] == str(status)
    assert msg.headers["Nats-Service-Error"] == "nope"
    assert msgpack.unpackb(msg.data) == {"error": {"code": code, "message": "nope", "details": {"asked": code}}}
    with pytest.raises(BusError) as caught:
        await client.request("echo.fail", {"code": code, "message": "nope"})
    assert (caught.value.code, caught.value.status, caught.value.details) == (code, status, {"asked": code})


async def test_srv_stats_count_the_work_done_in_the_request_task(echo, client, nc, prefix):
    """nats.micro's own counts end when its handler returns, before our task does the work
    (bus/micro.py completes them): `$SRV.STATS` shows the time spent and the errors."""
    await client.request("echo.sleep", {"seconds": 0.2}, Served)
    with pytest.raises(BusError):
        await client.request("echo.fail", {"code": "node_not_found", "message": "nope"})
    msg = await nc.request(f"$SRV.STATS.{prefix}-echo.{echo.id}", b"", timeout=5)
    endpoints = {e["name"]: e for e in msgspec.json.decode(msg.data)["endpoints"]}
    assert endpoints["echo-sleep"]["num_requests"] == 1
    assert endpoints["echo-sleep"]["processing_time"] >= 200_000_000  # nanoseconds
    assert endpoints["echo-fail"]["num_errors"] == 1
    assert endpoints["echo-fail"]["last_error"] == "404:node_not_found"  # not the message "nope"


async def test_unexpected_exception_is_internal_and_endpoint_survives(echo, client):
    with pytest.raises(BusError) as caught:
        await client.request("echo.crash", {})
    assert caught.value.code == "internal" and caught.value.status == 500
    assert "RuntimeError: boom" in caught.value.message
    assert (await client.request("echo.whoami", {}, Served)).pid > 0


@pytest.mark.parametrize(
    "payload,field",
    [
        (b"\xc1\x00garbage", "$"),
        (b"", "$"),
        (msgpack.packb([1, 2, 3]), "$"),
        (msgpack.packb({"name": "a", "flag": True}), "count"),
        (msgpack.packb({"count": "3", "name": "a", "flag": True}), "count"),
        (msgpack.packb({"count": -1, "name": "a", "flag": True}), "count"),
        (msgpack.packb({"count": 1, "name": 5, "flag": True}), "name"),
        (msgpack.packb({"count": 1, "name": "a", "flag": None}), "flag"),
        (msgpack.packb({"count": 1, "name": "a", "flag": 1}), "flag"),
        (msgpack.packb({"count": 1, "name": "a", "flag": True, "ratio": float("nan")}), "ratio"),
        (msgpack.packb({"count": 2**64 - 1, "name": "a", "flag": True, "ratio": 2.0}), "ratio"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(echo, client, nc, prefix, payload, field):
    msg = await nc.request(f"{prefix}.echo.typed", payload, timeout=5)
    assert msg.headers["Nats-Service-Error-Code"] == "400"
    body = msgpack.unpackb(msg.data)
    assert body["error"]["code"] == "invalid_argument"
    assert body["error"]["details"]["field"] == field
    assert field in body["error"]["message"]
    # The endpoint keeps serving after bad input.
    good = await client.request("echo.typed", {"count": 3, "name": "a", "flag": False}, Typed)
    assert good == Typed(count=3, name="a", flag=False)


async def test_an_unknown_key_is_invalid_argument_naming_it_in_any_request_type(echo, client):
    """DESIGN.md §8: unknown keys are refused at every level, also for a request Struct that does not
    forbid them itself (`Typed` is a plain Struct): the bus checks the keys it was sent."""
    sent = {"count": 3, "name": "a", "flag": False, "extra": 1}
    caught = await error_of(client.request("echo.typed", sent, Typed))
    assert (caught.code, caught.status, caught.field) == ("invalid_argument", 400, "extra")
    assert caught.message == "extra: unknown key 'extra'; accepted: count, flag, name, ratio"
    assert caught.details["accepted"] == ["count", "flag", "name", "ratio"]


async def test_a_reply_over_the_max_payload_is_an_error_naming_it_not_a_timeout(echo, client, nc):
    caught = await error_of(client.request("echo.grow", {"size": nc.max_payload + 1}, dict))
    assert caught.code == "invalid_argument" and caught.field == "request"
    assert caught.details["reply_bytes"] > nc.max_payload and "max payload" in str(caught)
    assert (await client.request("echo.grow", {"size": 10}, dict))["data"] == b"x" * 10  # it still serves


async def error_of(call) -> BusError:
    with pytest.raises(BusError) as caught:
        await call
    return caught.value


async def test_reply_is_plain_msgpack(echo, nc, prefix):
    msg = await nc.request(f"{prefix}.echo.typed", msgpack.packb({"count": 7, "name": "x", "flag": True}), timeout=5)
    assert msgpack.unpackb(msg.data) == {"count": 7, "name": "x", "flag": True, "ratio": 0.5}


async def test_concurrent_retries_have_one_effect(echo, client):
    request = {"key": "k", "request_id": "r-1", "delay": 0.3}
    replies = await asyncio.gather(*(client.request("echo.increment", request, Counted) for _ in range(5)))
    assert {r.value for r in replies} == {1}
    # A later retry still gets the first answer; a new id runs again.
    assert (await client.request("echo.increment", request, Counted)).value == 1
    assert (await client.request("echo.increment", {**request, "request_id": "r-2"}, Counted)).value == 2
    # No request id: every call has its effect.
    assert (await client.request("echo.increment", {"key": "k"}, Counted)).value == 3


async def test_request_id_reused_for_another_request_is_refused(echo, client):
    await client.request("echo.increment", {"key": "a", "request_id": "same"}, Counted)
    with pytest.raises(BusError) as caught:
        await client.request("echo.increment", {"key": "b", "request_id": "same"}, Counted)
    assert caught.value.code == "invalid_argument" and caught.value.details["field"] == "request_id"


async def test_client_timeout_and_no_responders(echo, client):
    with pytest.raises(RequestTimeout):  # held at a gate nobody opens: no answer can come in time
        await client.request("echo.hold", {"gate": "never", "timeout": 1}, Served, timeout=0.2)
    with pytest.raises(NoResponders):
        await client.request("echo.nothing-here", {}, timeout=1)


async def test_in_flight_requests_complete_on_sigterm(spawn_worker, client, redis, prefix):
    worker = spawn_worker("tests.echo_service")
    gate = f"{prefix}:echo:gate:drain"
    calls = [
        asyncio.create_task(client.request("echo.hold", {"gate": "drain", "tag": str(i)}, Served, timeout=30))
        for i in range(10)
    ]
    for _ in range(10):  # every request is in a handler, waiting at the gate
        assert await redis.blpop([f"{gate}:arrived"], timeout=10) is not None
    worker.signal(signal.SIGTERM)

    async def draining():  # the worker takes nothing new: its endpoints are unsubscribed
        try:
            await client.request("echo.whoami", {}, Served, timeout=1)
        except NoResponders:
            return True
        return False

    await eventually(draining)
    assert not any(call.done() for call in calls)  # ... while the ten are still in flight
    await redis.rpush(f"{gate}:open", *["go"] * 10)
    replies = await asyncio.gather(*calls)
    assert sorted(int(r.tag) for r in replies) == list(range(10))
    assert await asyncio.to_thread(worker.wait, 15) == 0
    with pytest.raises(NoResponders):
        await client.request("echo.whoami", {}, Served, timeout=1)


class Labelled(msgspec.Struct):
    labels: dict[Annotated[str, msgspec.Meta(min_length=1)], str] = {}


def test_a_bad_map_key_names_the_map():
    with pytest.raises(InvalidArgument) as caught:
        decode(msgpack.packb({"labels": {"": "x"}}), Labelled)
    assert caught.value.field == "labels" and "map key" in caught.value.message
