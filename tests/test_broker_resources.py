"""The broker's resource commands over a real NATS and Redis, with real processes (`process` operator):
the crm lifecycle, every error code, bad input, idempotency, events."""

from __future__ import annotations

import asyncio
import urllib.request

import msgpack
import pytest

from services.broker.model import ready_enough
from tests.broker_helpers import HTTP, SERVER, marked, param, server, tracked_pids
from tests.bus_helpers import EventLog, eventually, idempotency_keys

pytest_plugins = ["tests.broker_fixtures"]

U = "team-a"
ONE = {"least_instance": 1, "request_instance": 1}


def ref(resource_id: str, user: str = U) -> dict:
    return {"user": user, "resource_id": resource_id}


async def launched(b, resource_id: str, instances: int = 1, image: str = SERVER, **fields) -> dict:
    await b("init", {**ref(resource_id), "param": param(image, **fields)})
    return await b(
        "launch", {**ref(resource_id), "filter": {"least_instance": 1, "request_instance": instances}}
    )


def fetch(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


# -- lifecycle ---------------------------------------------------------------------------------


async def test_launch_reaches_running_and_serves_pages(start_broker, broker_call, subscribe, prefix):
    await start_broker()
    b = broker_call
    stream = await subscribe(f"broker.resource.{U}.>")
    await b("init", {**ref("job-1"), "param": param()})
    assert (await b("is-service-preparing", ref("job-1"))) == {"preparing": True}
    reply = await b("launch", {**ref("job-1"), "filter": {"least_instance": 1, "request_instance": 2}})
    assert reply == {"request_instance": 2, "broker_resource_id": ""}

    info = await b.wait_running(U, "job-1")
    assert info["status"] == "running" and info["request_instances"] == 2 and info["current_instances"] == 2
    assert [set(e["ports"]) for e in info["available_endpoints"]] == [{"http"}, {"http"}]  # names as given
    pages = [
        await asyncio.to_thread(fetch, f"http://{e['ip']}:{e['ports']['http']}/")
        for e in info["available_endpoints"]
    ]
    assert pages == [f"hello from {prefix}/{U}/job-1/{i}\n" for i in range(2)]

    record = await b("get-resource", ref("job-1"))
    assert record["status"] == "running" and record["request_instance"] == 2
    assert record["no_ready_instance"] == 0 and record["resource_block_key"] == "local"
    assert record["param"]["ports"] == HTTP and record["updated_at"] > 0
    assert (await b("is-service-preparing", ref("job-1"))) == {"preparing": False}

    statuses = []
    while len(statuses) < 3:
        subject, event = await stream.next(timeout=5)
        statuses.append(event["type"])
        assert subject == f"{prefix}.events.broker.resource.{U}.job-1.{event['type']}"
        assert event["resource_id"] == "job-1" and event["user"] == U
    assert statuses == ["init", "deploying", "running"]
    await b("release", ref("job-1"))
    assert not marked(prefix)


async def test_init_twice_and_launch_errors(start_broker, broker_call):
    await start_broker()
    b = broker_call
    err = await b.error("launch", {**ref("nope"), "filter": ONE})
    assert (err.code, err.status, err.details["field"]) == ("resource_not_found", 404, "resource_id")

    await b("init", {**ref("r"), "param": param()})
    err = await b.error("init", {**ref("r"), "param": param()})
    assert (err.code, err.status, err.details["field"]) == ("resource_already_init", 409, "resource_id")
    err = await b.error("get-service-info", ref("r"))
    assert (err.code, err.status) == ("application_not_found", 404)
    err = await b.error("scale", {**ref("r"), "filter": ONE})
    assert (err.code, err.status, err.details["status"]) == ("resource_not_running", 412, "init")

    await b("launch", {**ref("r"), "filter": ONE})
    err = await b.error("launch", {**ref("r"), "filter": ONE})
    assert (err.code, err.status) == ("application_already_launched", 409)
    err = await b.error("init", {**ref("r"), "param": param()})
    assert err.code == "resource_already_init"
    # Another user does not see this user's resources.
    err = await b.error("get-resource", ref("r", user="team-b"))
    assert err.code == "resource_not_found"
    await b.wait_running(U, "r")
    await b("release", ref("r"))


async def test_release_twice_and_released_records(start_broker, broker_call, prefix):
    await start_broker()
    b = broker_call
    await launched(b, "gone")
    await b.wait_running(U, "gone")
    assert len(marked(prefix)) == 1
    await b("release", ref("gone"))
    assert not marked(prefix)

    err = await b.error("release", ref("gone"))
    assert (err.code, err.status) == ("resource_not_found", 404)
    for command, payload in [
        ("get-service-info", ref("gone")),
        ("launch", {**ref("gone"), "filter": ONE}),
        ("scale", {**ref("gone"), "filter": ONE}),
    ]:
        assert (await b.error(command, payload)).code == "resource_not_found", command
    record = await b("get-resource", ref("gone"))
    assert record["status"] == "released" and record["no_ready_instance"] == 0
    listed = await b("list-resources", {"status": "released"})
    assert [r["resource_id"] for r in listed["resources"]] == ["gone"] and listed["total"] == 1
    # Unknown and released ids are simply not preparing (crm deletes released records); a released
    # id can start a new life (as in crm).
    assert await b("is-service-preparing", ref("never")) == {"preparing": False}
    assert await b("is-service-preparing", ref("gone")) == {"preparing": False}
    await b("init", {**ref("gone"), "param": param()})
    assert (await b("get-resource", ref("gone")))["status"] == "init"


async def test_scale_adds_instances_to_a_running_resource(start_broker, broker_call, prefix):
    await start_broker()
    b = broker_call
    await launched(b, "grow")
    await b.wait_running(U, "grow")
    reply = await b("scale", {**ref("grow"), "filter": {"least_instance": 1, "request_instance": 2}})
    assert reply["request_instance"] == 3
    assert (await b("get-resource", ref("grow")))["status"] == "deploying"
    info = await b.wait_running(U, "grow")
    assert info["current_instances"] == 3 and len(marked(prefix)) == 3
    assert (await b("get-resource", ref("grow")))["status"] == "running"
    await b("release", ref("grow"))
    assert not marked(prefix)


async def test_capacity_and_the_instance_filter(start_broker, broker_call):
    await start_broker(max_instances=3)
    b = broker_call
    await b("init", {**ref("big"), "param": param()})
    err = await b.error("launch", {**ref("big"), "filter": {"least_instance": 4, "request_instance": 5}})
    assert (err.code, err.status, err.details["field"]) == (
        "no_enough_resources",
        409,
        "filter.least_instance",
    )
    assert err.details == {"field": "filter.least_instance", "available": 3, "least": 4}
    # min(available, request): 3 of the 5 asked for.
    assert (await b("launch", {**ref("big"), "filter": {"least_instance": 2, "request_instance": 5}}))[
        "request_instance"
    ] == 3
    detail = await b("get-resource-detail", {"user": U})
    [block] = detail["blocks"]
    assert block["block"] == "local" and block["total_instance"] == 3
    # The answered launch has its processes: all three in use at once, reserved until they answer.
    assert block["used_instance"] == 3 and 0 <= block["not_ready_instance"] <= 3
    await b.wait_running(U, "big")
    detail = await b("get-resource-detail", {"user": U})
    assert detail["blocks"] == [
        {
            "block": "local",
            "total_instance": 3,
            "used_instance": 3,
            "report_instance": 0,
            "available_instance": 0,
            "not_ready_instance": 0,
            "cpu_total": 0.0,
            "cpu_used": 0.0,
            "mem_total": 0,
            "mem_used": 0,
        }
    ]
    assert [(r["resource_id"], r["status"], r["request_instance"]) for r in detail["resources"]] == [
        ("big", "running", 3)
    ]
    await b("init", {**ref("small"), "param": param()})
    assert (await b.error("launch", {**ref("small"), "filter": ONE})).code == "no_enough_resources"
    await b("release", ref("big"))
    await b("launch", {**ref("small"), "filter": ONE})
    await b.wait_running(U, "small")
    await b("release", ref("small"))


async def test_not_ready_reservation_shrinks_as_instances_come_up(start_broker, broker_call):
    await start_broker()
    b = broker_call
    await launched(b, "half", instances=2, **server("slow", DELAY="30", SLOW_INSTANCES="1"))
    assert (await b("get-resource", ref("half")))["no_ready_instance"] == 2

    async def one_up():
        info = await b("get-service-info", ref("half"))
        return info if info["current_instances"] == 1 else None

    info = await eventually(one_up)
    assert info["status"] == "staging" and info["message"] == "1 of 2 instances ready"
    record = await b("get-resource", ref("half"))
    assert (record["status"], record["no_ready_instance"]) == ("deploying", 1)
    block = (await b("get-resource-detail", {"user": U}))["blocks"][0]
    assert block["not_ready_instance"] == 1
    await b("release", ref("half"))
    assert (await b("get-resource-detail", {"user": U}))["blocks"][0]["not_ready_instance"] == 0


async def test_failed_launch_and_exited_process_report_failed(start_broker, broker_call):
    await start_broker()
    b = broker_call
    await launched(b, "no-binary", image="missing-binary")
    info = await b.wait_running(U, "no-binary")
    assert info["status"] == "failed" and info["message"].startswith("launch failed: ")
    assert (await b("get-resource", ref("no-binary")))["status"] == "running"  # crm: finished, not healthy

    await launched(b, "crashes", instances=2, **server("failing", FAIL_INSTANCES="1"))
    info = await b.wait_running(U, "crashes")
    assert info["status"] == "failed" and info["message"] == "1 of 2 instances exited"
    assert info["current_instances"] == 1 and info["available_endpoints"][0]["name"] == "crashes-0"
    await b("release", ref("no-binary"))
    await b("release", ref("crashes"))


async def test_deployment_not_finished_in_time_is_released(start_broker, broker_call, prefix):
    await start_broker(trace_timeout=0.8)
    b = broker_call
    await launched(b, "slow", **server("slow", DELAY="30"))

    async def released():
        return (await b("get-resource", ref("slow")))["status"] == "released"

    await eventually(released, timeout=10)
    assert not marked(prefix)


async def test_release_stops_the_whole_group_with_sigkill_after_the_grace(
    start_broker, broker_call, redis, prefix, tmp_path
):
    await start_broker()  # stop grace 1 s
    b = broker_call
    terms = tmp_path / "terms"
    await launched(b, "stubborn", **server("stubborn", TERM_LOG=str(terms)))
    await b.wait_running(U, "stubborn")
    [(_, pid)] = await tracked_pids(redis, prefix)  # the server (its child carries the same marker)
    await b("release", ref("stubborn"))
    # SIGTERM came first, and the server ignored it; what stopped it after that is SIGKILL.
    assert terms.read_text() == f"SIGTERM ignored by {pid}\n"
    assert not marked(prefix)  # the server and its child, in the same group, are gone


def test_readiness_threshold_more_than_half():
    assert [n for n in range(5) if ready_enough(1, n)] == [1, 2, 3, 4]
    assert [n for n in range(5) if ready_enough(2, n)] == [2, 3, 4]
    assert [n for n in range(5) if ready_enough(3, n)] == [2, 3, 4]
    assert [n for n in range(5) if ready_enough(4, n)] == [3, 4]


# -- configuration commands ------------------------------------------------------------------------


async def test_instance_type_and_namespace(start_broker, broker_call):
    rules = '[{"platform": "linux", "group": "sz", "cpu_per_instance": 4, "mem_per_instance": 8589934592}]'
    await start_broker(cpu_per_instance=2.0, mem_per_instance=1 << 30, instance_types=rules)
    b = broker_call
    assert await b("get-instance-type", {"user": U, "platform": "linux", "group": "sz"}) == {
        "cpu_per_instance": 4.0,
        "mem_per_instance": 8 << 30,
    }
    assert await b("get-instance-type", {"user": U, "platform": "windows", "group": "sz"}) == {
        "cpu_per_instance": 2.0,
        "mem_per_instance": 1 << 30,
    }
    assert await b("get-namespace", {"user": U}) == {"namespace": U}


async def test_configured_namespace(start_broker, broker_call):
    await start_broker(namespace="build-farm")
    assert await broker_call("get-namespace", {"user": U}) == {"namespace": "build-farm"}


# -- listing ---------------------------------------------------------------------------------------


async def test_list_resources_filters_and_pages(start_broker, broker_call):
    await start_broker()
    b = broker_call
    for i in range(5):
        await b("init", {**ref(f"r{i}"), "param": param()})
    await b("init", {**ref("other", user="team-b"), "param": param()})
    page = await b("list-resources", {"user": U, "offset": 1, "limit": 2})
    assert [r["resource_id"] for r in page["resources"]] == ["r1", "r2"] and page["total"] == 5
    assert (await b("list-resources", {}))["total"] == 6
    assert (await b("list-resources", {"status": "running"}))["total"] == 0
    assert (await b("list-resources", {"broker_sold": True}))["total"] == 0
    assert (await b("list-resources", {"user": "team-b"}))["resources"][0]["resource_id"] == "other"


# -- idempotency, subscribe, bad input -------------------------------------------------------------


async def test_request_id_replays_the_first_answer(start_broker, broker_call, prefix):
    await start_broker()
    b = broker_call
    init = {**ref("once"), "param": param(), "request_id": "init-1"}
    assert await b("init", init) == {}
    assert await b("init", init) == {}  # a retry, not a second init
    launch = {**ref("once"), "filter": ONE, "request_id": "launch-1"}
    first, second = await asyncio.gather(b("launch", launch), b("launch", launch))
    assert first == second == {"request_instance": 1, "broker_resource_id": ""}
    await b.wait_running(U, "once")
    assert len(marked(prefix)) == 1
    release = {**ref("once"), "request_id": "release-1"}
    assert await b("release", release) == {} and await b("release", release) == {}


async def test_resource_ids_are_escaped_in_event_subjects(start_broker, broker_call, subscribe, prefix):
    await start_broker()
    stream = await subscribe(f"broker.resource.{U}.*.init")
    await broker_call("init", {**ref("a.b c*"), "param": param()})
    subject, event = await stream.next(timeout=5)
    assert subject == f"{prefix}.events.broker.resource.{U}.a%2Eb%20c%2A.init"
    assert event["resource_id"] == "a.b c*" and event["type"] == "init" and event["time"] > 0


@pytest.mark.parametrize(
    "command,payload,field",
    [
        ("init", {"user": "a.b", "resource_id": "r", "param": {}}, "user"),
        ("init", {"user": U, "resource_id": "", "param": {}}, "resource_id"),
        ("init", {"user": U, "resource_id": "r"}, "param"),
        ("init", {"user": U, "resource_id": "r", "param": {"image": ""}}, "param.image"),
        ("init", {"user": U, "resource_id": "r", "param": {"image": "run 'unclosed"}}, "param.image"),
        ("init", {"user": U, "resource_id": "r", "param": {"image": "run $PORT_WEB"}}, "param.image"),
        ("init", {"user": U, "resource_id": "r", "param": {"image": "run $"}}, "param.image"),
        (
            "init",
            {"user": U, "resource_id": "r", "param": {"image": "x", "ports": {"web": "udp"}}},
            "param.ports.web",
        ),
        (
            "init",
            {"user": U, "resource_id": "r", "param": {"image": "x", "ports": {"a.b": "tcp"}}},
            "param.ports",
        ),
        (
            "init",
            {"user": U, "resource_id": "r", "param": {"image": "x", "ports": {"a-b": "tcp", "a_b": "tcp"}}},
            "param.ports",
        ),
        ("init", {"user": U, "resource_id": "r", "param": {"image": "x", "env": {"1X": "y"}}}, "param.env"),
        ("init", {"user": U, "resource_id": "r", "param": {"image": "x", "env": {"X": 1}}}, "param.env.X"),
        ("launch", {"user": U, "resource_id": "r"}, "filter"),
        (
            "launch",
            {"user": U, "resource_id": "r", "filter": {"least_instance": 2, "request_instance": 1}},
            "filter.least_instance",
        ),
        (
            "launch",
            {"user": U, "resource_id": "r", "filter": {"least_instance": 1, "request_instance": 0}},
            "filter.request_instance",
        ),
        (
            "launch",
            {"user": U, "resource_id": "r", "filter": {"least_instance": -1, "request_instance": 1}},
            "filter.least_instance",
        ),
        (
            "launch",
            {"user": U, "resource_id": "r", "filter": {"least_instance": 1.5, "request_instance": 2}},
            "filter.least_instance",
        ),
        ("scale", {"user": U, "resource_id": 7, "filter": ONE}, "resource_id"),
        ("release", {"resource_id": "r"}, "user"),
        ("get-resource", {"user": None, "resource_id": "r"}, "user"),
        ("list-resources", {"status": "gone"}, "status"),
        ("list-resources", {"limit": 0}, "limit"),
        ("list-resources", {"broker_sold": "yes"}, "broker_sold"),
        ("get-resource-detail", {"user": U, "offset": -1}, "offset"),
        (
            "add-broker",
            {"user": U, "name": "b", "strategy": {"type": "fancy"}, "param": param()},
            "strategy.type",
        ),
        (
            "add-broker",
            {"user": U, "name": "b", "strategy": {"type": "const"}, "param": param()},
            "strategy.num",
        ),
        (
            "add-broker",
            {"user": U, "name": "b", "strategy": {"type": "reactive", "min": 3, "max": 2}, "param": param()},
            "strategy.min",
        ),
        (
            "add-broker",
            {"user": U, "name": "b.c", "strategy": {"type": "const", "num": 1}, "param": param()},
            "name",
        ),
        (
            "add-broker",
            {
                "user": U,
                "name": "b",
                "strategy": {"type": "const", "num": 1},
                "param": param(),
                "instance": 0,
            },
            "instance",
        ),
        (
            "add-broker",
            {
                "user": U,
                "name": "b",
                "strategy": {"type": "const", "num": 1},
                "param": param(),
                "fit_fields": ["colour"],
            },
            "fit_fields[0]",
        ),
        (
            "add-broker",
            {
                "user": U,
                "name": "b",
                "strategy": {"type": "const", "num": 1},
                "param": param(),
                "idle_keep_seconds": -1,
            },
            "idle_keep_seconds",
        ),
        (
            "add-broker",
            {
                "user": U,
                "name": "b",
                "strategy": {"type": "const", "num": 1},
                "param": param(),
                "release_loop": None,
            },
            "release_loop",
        ),
        ("apply", {"user": U, "resource_id": "r", "param": param()}, "filter"),
        ("remove-broker", {"user": U}, "name"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    start_broker, broker_call, nc, redis, prefix, command, payload, field
):
    await start_broker()
    b = broker_call
    log = await EventLog.open(nc, prefix, "broker.>")
    request = {**payload, "request_id": f"bad-{command}"}
    err = await b.error(command, request)
    assert (err.code, err.status) == ("invalid_argument", 400), err
    assert err.details["field"] == field, err
    assert err.message.startswith(f"{field}: ") and len(err.message) > len(field) + 2, err.message  # a reason
    again = await b.error(command, request)  # a retry answers the same
    assert (again.code, again.status, again.message, again.details) == (
        err.code, err.status, err.message, err.details
    )
    # Nothing changed: no record, no broker, no answer kept for the request id, no event.
    assert await b("list-resources", {}) == {"resources": [], "total": 0}
    assert await b("list-brokers", {}) == {"brokers": []}
    assert await idempotency_keys(redis, prefix) == []
    await b("init", {**ref("sentinel"), "param": param()})  # an event that must come
    assert await log.before(log.subject(f"broker.resource.{U}.sentinel.init")) == []
    await log.close()


async def test_garbage_payload_and_plain_msgpack(start_broker, nc, prefix, broker_call):
    await start_broker()
    msg = await nc.request(f"{prefix}.broker.init", b"\xc1garbage", timeout=5)
    assert msg.headers["Nats-Service-Error-Code"] == "400"
    assert msgpack.unpackb(msg.data)["error"]["code"] == "invalid_argument"
    msg = await nc.request(
        f"{prefix}.broker.is-service-preparing", msgpack.packb({"user": U, "resource_id": "x"}), timeout=5
    )
    assert msgpack.unpackb(msg.data) == {"preparing": False}


async def test_every_command_has_its_own_endpoint(start_broker, nc, prefix):
    from bus.discovery import gather

    service, _ = await start_broker()
    [info] = [i for i in await gather(nc, f"$SRV.INFO.{prefix}-broker") if i["id"] == service.id]
    subjects = sorted(e["subject"] for e in info["endpoints"])
    names = [
        "add-broker",
        "apply",
        "get-instance-type",
        "get-namespace",
        "get-resource",
        "get-resource-detail",
        "get-service-info",
        "init",
        "is-service-preparing",
        "launch",
        "list-brokers",
        "list-resources",
        "release",
        "remove-broker",
        "scale",
    ]
    assert subjects == sorted(f"{prefix}.broker.{n}" for n in names)


async def test_launch_takes_city_override(start_broker, broker_call):
    await start_broker()
    b = broker_call
    await b("init", {**ref("moved"), "param": param()})
    await b("launch", {**ref("moved"), "city": "gz", "filter": ONE})
    assert (await b("get-resource", ref("moved")))["param"]["city"] == "gz"
    await b.wait_running(U, "moved")
    await b("release", ref("moved"))
