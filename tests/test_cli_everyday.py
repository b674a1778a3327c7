"""`berth call`, `events`, `nodes` and `status` against real workers (berth/commands/).

Every command runs as the user runs it, `python -m berth.cli ...` in a process of its own, on
this test's prefix. Besides what each test checks, `berth()` checks that no log line ever reaches
standard output.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack

from berth import streams
from berth.accounts import STREAMS_ADMIN
from berth.credentials import prepare
from berth.servers import start_nats, start_redis
from bus.callers import Role
from bus.connection import subscriptions_in_place
from schemas.common import Event
from services.processes.ports import free_port
from tests.bus_helpers import eventually
from tests.conftest import new_prefix
from tests.worker_helpers import start_worker, stop_workers

ROOT = Path(__file__).resolve().parent.parent
BERTH = [sys.executable, "-m", "berth.cli"]
ALLOCATION = "services.allocation.worker"
ECHO = "tests.echo_service"
LOG_MARK = "level="  # every log line carries it (bus/runner.py configure_logging)

N1 = {
    "nodename": "n1",
    "labels": {"city": "sz"},
    "resource": {
        "cpumem": {"cpu": 8, "memory": "16G"},
        "storage": {"volumes": ["/data:100G"], "storage": "200G"},
        "gpu": {"prod_count_map": {"nvidia-3070": 2}},
    },
}


def berth(nats_url: str, prefix: str, *args: str, input: str | None = None, env: dict | None = None):
    result = subprocess.run(
        [*BERTH, *args, "--nats", nats_url, "--prefix", prefix],
        capture_output=True,
        text=True,
        input=input,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert LOG_MARK not in result.stdout, result.stdout
    return result


async def start_berth(nats_url: str, prefix: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *BERTH,
        *args,
        "--nats",
        nats_url,
        "--prefix",
        prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )


async def line_with(stream: asyncio.StreamReader, marker: str) -> str:
    """The first line of `stream` that holds `marker` (the test fails if the stream ends first)."""
    seen = []
    async with asyncio.timeout(60):
        while line := (await stream.readline()).decode():
            if marker in line:
                return line
            seen.append(line)
    raise AssertionError(f"{marker!r} never came; got {seen}")


async def json_lines(stream: asyncio.StreamReader, n: int) -> list[dict]:
    out = []
    async with asyncio.timeout(60):
        while len(out) < n:
            line = (await stream.readline()).decode()
            assert line, f"the output ended after {len(out)} of {n} lines"
            out.append(json.loads(line))  # every line is JSON: no log line among them
    return out


def test_call_replies_in_json_and_exits_by_the_class_of_error(spawn_worker, nats_url, prefix):
    spawn_worker(ALLOCATION)
    spawn_worker(ECHO)

    added = berth(nats_url, prefix, "call", "resource.add-node", json.dumps(N1))
    assert added.returncode == 0, added.stderr
    assert added.stderr == ""  # quiet unless -v
    reply = json.loads(added.stdout)
    assert reply["capacity"]["cpumem"]["cpu"] == 8 and reply["capacity"]["cpumem"]["memory"] == 16 << 30

    # the payload from standard input, the subject given whole, one line with -c
    info = berth(
        nats_url,
        prefix,
        "call",
        f"{prefix}.resource.get-node-resource-info",
        "-",
        "-c",
        input='{"nodename": "n1"}',
    )
    assert info.returncode == 0, info.stderr
    assert len(info.stdout.splitlines()) == 1
    assert json.loads(info.stdout)["capacity"]["gpu"]["prod_count_map"] == {"nvidia-3070": 2}
    assert json.loads(berth(nats_url, prefix, "call", "resource.plugins").stdout) == {
        "plugins": ["cpumem", "storage", "gpu"]
    }

    # an error reply: its body (and status) as JSON on standard output, exit 1 for 4xx
    missing = berth(nats_url, prefix, "call", "resource.get-node-resource-info", '{"nodename": "nope"}')
    assert missing.returncode == 1
    body = json.loads(missing.stdout)
    assert body["status"] == 404 and body["error"]["code"] == "node_not_found"
    assert body["error"]["details"]["field"] == "nodename"
    assert "node_not_found (404)" in missing.stderr
    invalid = berth(nats_url, prefix, "call", "resource.add-node", '{"nodename": 5}')
    assert invalid.returncode == 1
    assert json.loads(invalid.stdout)["error"] == {
        "code": "invalid_argument",
        "message": json.loads(invalid.stdout)["error"]["message"],
        "details": {"field": "nodename"},
    }
    busy = berth(nats_url, prefix, "call", "echo.fail", '{"code": "busy"}')
    assert (busy.returncode, json.loads(busy.stdout)["status"]) == (1, 429)

    # 5xx: the service failed, exit 4
    crashed = berth(nats_url, prefix, "call", "echo.crash")
    assert crashed.returncode == 4
    assert json.loads(crashed.stdout)["error"]["code"] == "internal"
    unavailable = berth(nats_url, prefix, "call", "echo.fail", '{"code": "unavailable"}')
    assert (unavailable.returncode, json.loads(unavailable.stdout)["status"]) == (4, 503)

    # usage, exit 2: nothing is sent
    bad = berth(nats_url, prefix, "call", "resource.add-node", "{not json")
    assert bad.returncode == 2 and bad.stdout == "" and "not JSON" in bad.stderr
    assert berth(nats_url, prefix, "call").returncode == 2

    # nobody answers, exit 3
    nobody = berth(nats_url, prefix, "call", "broker.list-brokers", "{}")
    assert nobody.returncode == 3 and nobody.stdout == ""
    assert f"no service answers on {prefix}.broker.list-brokers" in nobody.stderr


async def test_call_that_gets_no_reply_in_time_and_a_server_that_is_not_there(nc, nats_url, prefix):
    silent = await nc.subscribe(f"{prefix}.silent.command")  # receives, never answers
    await subscriptions_in_place(nc)
    try:
        late = berth(nats_url, prefix, "call", "silent.command", "--timeout", "0.5")
    finally:
        await silent.unsubscribe()
    assert late.returncode == 3 and late.stdout == ""
    assert f"no reply on {prefix}.silent.command within 0.5 s" in late.stderr

    nowhere = f"nats://someone:hunter2@127.0.0.1:{free_port()}"
    for command in (["call", "resource.plugins"], ["nodes"], ["status"], ["events", "--count", "1"]):
        result = berth(nowhere, prefix, *command)
        assert result.returncode == 5, (command, result.stderr)
        assert result.stdout == ""
        assert "cannot connect to NATS at nats://someone:***@127.0.0.1" in result.stderr
        assert "hunter2" not in result.stderr


async def test_call_sends_a_state_change_again_with_its_request_id_until_an_answer_comes(
    nc, spawn_worker, client, nats_url, prefix
):
    """A state change answered by nobody in time is sent again with the same request_id (made for
    it): here the first sends go to a member of the service's queue group that never answers, and
    once the real worker serves, the next send reaches it. Applied once."""
    deliveries = []
    silent = await nc.subscribe(f"{prefix}.resource.add-node", queue="q", cb=functools.partial(_noted, deliveries))
    await subscriptions_in_place(nc)
    called = await start_berth(nats_url, prefix, "call", "resource.add-node", json.dumps(N1), "--timeout", "0.5")
    await eventually(lambda: asyncio.sleep(0, len(deliveries) >= 2))  # sent, and sent again
    await asyncio.to_thread(spawn_worker, ALLOCATION)
    await silent.unsubscribe()
    stdout, stderr = await called.communicate()
    assert called.returncode == 0, stderr
    assert json.loads(stdout)["capacity"]["cpumem"]["cpu"] == 8
    [request_id] = {msgpack.unpackb(data)["request_id"] for data in deliveries}  # one and the same, on every send
    assert f"sending it again with request_id {request_id}" in stderr.decode()
    nodes = await client.request("resource.list-nodes", {}, dict)
    assert [n["nodename"] for n in nodes["nodes"]] == ["n1"]  # applied once


async def _noted(deliveries: list, msg) -> None:
    deliveries.append(msg.data)


async def test_events_live_prints_one_json_line_per_event(spawn_worker, client, nats_url, prefix):
    spawn_worker(ALLOCATION)
    await client.request("resource.add-node", N1)  # before the tail started: not shown without --since
    tail = await start_berth(nats_url, prefix, "events", "resource.*.labels", "--count", "2", "-v")
    await line_with(tail.stderr, "live on")  # -v logs (to standard error) once it is subscribed
    for pool in ("a", "b"):
        await client.request("resource.set-node-labels", {"nodename": "n1", "labels": {"pool": pool}})
    lines = await json_lines(tail.stdout, 2)
    assert await tail.wait() == 0
    assert [line["subject"] for line in lines] == [f"{prefix}.events.resource.n1.labels"] * 2
    assert [line["event"]["after"]["labels"]["pool"] for line in lines] == ["a", "b"]
    assert all(line["event"]["type"] == "labels" and "seq" not in line for line in lines)
    assert await tail.stdout.read() == b""


async def test_events_since_replays_the_stream_then_goes_live_without_gap_or_duplicate(
    spawn_worker, client, nats_url, prefix
):
    """Events published before the tail starts, while its consumer is being made, and after it is
    live: each is printed once, in stream order."""
    spawn_worker(ALLOCATION)
    await client.request("resource.add-node", N1)  # 3 events: `added`, one per plugin
    published = 3

    async def relabel(i: int) -> None:
        nonlocal published
        await client.request("resource.set-node-labels", {"nodename": "n1", "labels": {"i": str(i)}})
        published += 1

    for i in range(5):
        await relabel(i)
    tail = await start_berth(nats_url, prefix, "events", "resource.n1.>", "--since", "10m")
    started = asyncio.Event()

    async def keep_publishing() -> None:  # until the tail has printed its first line
        i = 5
        while not started.is_set() and i < 2000:
            await relabel(i)
            i += 1
        for j in range(i, i + 5):  # and some more once it prints: these come live
            await relabel(j)

    publisher = asyncio.create_task(keep_publishing())
    try:
        first = await json_lines(tail.stdout, 1)
        started.set()
        await publisher
        lines = first + await json_lines(tail.stdout, published - 1)
    finally:
        publisher.cancel()
        tail.send_signal(signal.SIGINT)  # Ctrl-C
    assert await tail.wait() == 0
    assert {line["stream"] for line in lines} == {f"{prefix}-events"}
    assert [line["seq"] for line in lines] == list(range(1, published + 1))  # no gap, no duplicate
    assert [line["event"]["type"] for line in lines[:3]] == ["added"] * 3
    assert [int(line["event"]["after"]["labels"]["i"]) for line in lines[3:]] == list(range(published - 3))
    assert (await tail.stderr.read()).decode() == ""  # quiet: nothing but events


async def test_events_since_over_every_service_and_subjects_no_stream_keeps(
    spawn_worker, client, events, nats_url, prefix
):
    """`>` spans two services' subjects in one stream (one consumer, two filters) and subjects no
    stream keeps (the plain subscription): each event once, the stream's in order."""
    spawn_worker(ALLOCATION)
    spawn_worker(ECHO)  # its events go to the same stream, <prefix>-events, under echo.>
    await client.request("resource.add-node", N1)  # seq 1-3
    await events.publish("echo.e1.ping", Event(type=""))  # seq 4
    tail = await start_berth(nats_url, prefix, "events", "--since", "1h", "--count", "6", "-v")
    assert "'" + f"{prefix}.events.echo.>', '{prefix}.events.resource.>'" in await line_with(
        tail.stderr, "replaying"
    )
    await line_with(tail.stderr, "live on")
    await events.publish("adhoc.y.pong", Event(type=""))  # kept by no stream
    await events.publish("echo.e2.ping", Event(type=""))  # seq 5, live
    lines = await json_lines(tail.stdout, 6)
    assert await tail.wait() == 0
    kept = [line for line in lines if "stream" in line]
    assert [line["seq"] for line in kept] == [1, 2, 3, 4, 5]
    assert [line["subject"].split(".")[2] for line in kept] == ["resource"] * 3 + ["echo"] * 2
    assert [line["subject"] for line in lines if "stream" not in line] == [f"{prefix}.events.adhoc.y.pong"]


async def test_events_since_with_no_stream_for_the_pattern_goes_on_live(events, nats_url, prefix):
    tail = await start_berth(nats_url, prefix, "events", "adhoc.>", "--since", "1h", "--count", "1", "-v")
    assert "no stream keeps" in await line_with(tail.stderr, "no stream keeps")
    await line_with(tail.stderr, "live on")
    await events.publish("adhoc.x.ping", Event(type=""))
    [line] = await json_lines(tail.stdout, 1)
    assert await tail.wait() == 0
    assert line["subject"] == f"{prefix}.events.adhoc.x.ping" and line["event"]["type"] == "ping"
    assert "stream" not in line


async def test_events_tail_ends_with_status_5_when_its_server_goes_away(tmp_path, prefix):
    server = start_nats(tmp_path / "nats")
    try:
        tail = await start_berth(server.url, prefix, "events", "-v")
        await line_with(tail.stderr, "live on")
    finally:
        server.stop()
    assert "lost the connection to NATS" in await line_with(tail.stderr, "berth events:")
    assert await tail.wait() == 5
    assert await tail.stdout.read() == b""


def test_events_usage_errors(nats_url, prefix):
    for args in (["a.>.b"], ["a..b"], ["--since", "soon"], ["--count", "0"]):
        result = berth(nats_url, prefix, "events", *args)
        assert result.returncode == 2 and result.stdout == "", (args, result.stderr)


async def test_nodes_table_pages_and_json(spawn_worker, client, nats_url, prefix):
    assert berth(nats_url, prefix, "nodes").returncode == 3  # no allocation worker yet

    spawn_worker(ALLOCATION)
    await client.request("resource.add-node", N1)
    for name in ("n2", "n3"):
        await client.request(
            "resource.add-node",
            {
                "nodename": name,
                "labels": {"pool": "a"},
                "resource": {"cpumem": {"cpu": 4, "memory": "8G"}},
            },
        )
    await client.request(
        "resource.allocate",
        {
            "nodename": "n1",
            "deploy_count": 1,
            "workload_resource_request": {
                "cpumem": {"cpu-bind": True, "cpu-request": 1.5, "memory-request": "2G"},
                "storage": {"storage-request": "10G"},
                "gpu": {"prod_count_map": {"nvidia-3070": 1}},
            },
        },
    )

    table = berth(nats_url, prefix, "nodes", "--page-size", "1", "-v")  # three pages
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["name", "status", "labels", "cpu", "memory", "storage", "gpu"]
    assert lines[1].split() == ["n1", "up", "(no", "agent)", "city=sz", "1.5/8", "2Gi/16Gi", "10Gi/300Gi", "1/2"]
    assert lines[2].split() == ["n2", "up", "(no", "agent)", "pool=a", "0/4", "0/8Gi", "0/0", "0/0"]
    assert [line.split()[0] for line in lines[1:-1]] == ["n1", "n2", "n3"]
    assert lines[-1] == "3 nodes"

    selected = berth(nats_url, prefix, "nodes", "--labels", "pool=a", "--json")
    assert selected.returncode == 0, selected.stderr
    doc = json.loads(selected.stdout)
    assert [node["nodename"] for node in doc["nodes"]] == ["n2", "n3"] and doc["total"] == 2
    assert doc["nodes"][0]["cpu"] == {"used": 0, "total": 4} and doc["nodes"][0]["memory"]["total"] == 8 << 30

    everything = json.loads(berth(nats_url, prefix, "nodes", "--json").stdout)["nodes"][0]
    assert (everything["status"], everything["agent"]) == ("up", False)
    assert everything["gpu"] == {"used": 1, "total": 2, "products": {"nvidia-3070": {"used": 1, "total": 2}}}
    assert everything["storage"] == {"used": 10 << 30, "total": 300 << 30}

    none = berth(nats_url, prefix, "nodes", "--labels", "pool=z")
    assert (none.returncode, none.stdout.strip()) == (0, "no node")
    assert berth(nats_url, prefix, "nodes", "--labels", "pool").returncode == 2


async def test_status_compact_endpoints_and_json(spawn_worker, client, nats_url, prefix):
    nobody = berth(nats_url, prefix, "status")
    assert (nobody.returncode, nobody.stdout.strip()) == (
        0,
        f"no berth service answers at {nats_url} (prefix {prefix}; from --nats)",
    )

    allocation = [spawn_worker(ALLOCATION), spawn_worker(ALLOCATION)]
    echo = spawn_worker(ECHO)
    for name in ("n1", "n2", "n3"):
        await client.request(
            "resource.add-node", {"nodename": name, "resource": {"cpumem": {"cpu": 2, "memory": "1G"}}}
        )
    assert berth(nats_url, prefix, "call", "resource.get-allocations", '{"nodename": "nope"}').returncode == 1

    compact = berth(nats_url, prefix, "status", "-v")
    assert compact.returncode == 0, compact.stderr
    lines = compact.stdout.splitlines()
    assert lines[0] == f"asked {nats_url} (prefix {prefix}; from --nats)"  # the server and prefix asked
    assert lines[1].split() == ["service", "instances", "requests", "errors", "mean", "ms"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert set(rows) == {f"{prefix}-allocation", f"{prefix}-echo"}  # only this prefix's services
    assert rows[f"{prefix}-allocation"][:3] == ["2", "4", "1"]
    assert float(rows[f"{prefix}-allocation"][3]) > 0
    assert rows[f"{prefix}-echo"] == ["1", "0", "0", "-"]
    assert lines[-1] == "2 services, 3 instances"

    doc = json.loads(berth(nats_url, prefix, "status", "--json").stdout)
    assert (doc["nats"], doc["prefix"]) == (nats_url, prefix)
    by_name = {service["name"]: service for service in doc["services"]}
    assert sorted(by_name[f"{prefix}-allocation"]["ids"]) == sorted(w.instance_id for w in allocation)
    assert (by_name[f"{prefix}-allocation"]["requests"], by_name[f"{prefix}-allocation"]["errors"]) == (4, 1)
    assert by_name[f"{prefix}-echo"] == {
        "name": f"{prefix}-echo",
        "instances": 1,
        "requests": 0,
        "errors": 0,
        "ids": [echo.instance_id],
        "mean_ms": None,
    }

    detail = berth(nats_url, prefix, "status", "--endpoints")
    lines = detail.stdout.splitlines()
    assert lines[1].split() == ["service", "instance", "endpoint", "requests", "errors", "avg", "ms"]
    endpoints = [line.split() for line in lines[2:-1]]
    assert {row[1] for row in endpoints} == {w.instance_id for w in [*allocation, echo]}
    assert sum(int(row[3]) for row in endpoints if row[2] == f"{prefix}.resource.add-node") == 3
    assert [
        int(row[4]) for row in endpoints if row[2] == f"{prefix}.resource.get-allocations" and row[4] != "0"
    ] == [1]
    assert lines[-1] == f"3 instances, {len(endpoints)} endpoints"

    detail_json = json.loads(berth(nats_url, prefix, "status", "--endpoints", "--json").stdout)
    assert len(detail_json["instances"]) == 3
    subjects = {ep["subject"] for inst in detail_json["instances"] for ep in inst["endpoints"]}
    assert {f"{prefix}.resource.list-nodes", f"{prefix}.echo.whoami"} <= subjects
    failed = [ep for inst in detail_json["instances"] for ep in inst["endpoints"] if ep["errors"]]
    assert [ep["last_error"].split(":")[0] for ep in failed] == ["404"]


def test_no_log_line_on_standard_output_even_when_verbose(spawn_worker, nats_url, prefix):
    spawn_worker(ALLOCATION)
    env = {"BERTH_LOG_LEVEL": "DEBUG"}
    for args in (
        ["call", "resource.plugins", "-vv"],
        ["nodes", "--json", "-vv"],
        ["status", "--json", "-vv"],
    ):
        result = berth(nats_url, prefix, *args, env=env)
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)  # the whole of standard output is the answer
        assert LOG_MARK in result.stderr  # the logging went to standard error
    quiet = berth(nats_url, prefix, "call", "resource.plugins", env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_as_the_identities_berth_up_gives_out(tmp_path):
    """On servers with berth's accounts, the admin identity can call, list, ask for status and
    replay events from the stream (through a pull consumer of its own), a tenant replays what it
    may see and is refused the rest; a wrong password and a subject it may not publish on are told
    apart from a service that does not answer (exit 5, not 3)."""
    prefix = new_prefix()
    creds = prepare(tmp_path / "credentials", prefix).with_identity("ten", Role.TENANT)
    creds.write()
    nats = start_nats(tmp_path / "nats", config=creds.nats_config)
    redis = start_redis(tmp_path / "redis", appendonly=False, config=creds.redis_config)
    workers = []
    try:
        # as `berth up` does before its workers: no worker's user may set a stream up
        asyncio.run(streams.set_up(nats.url, prefix, user=STREAMS_ADMIN, password=creds.nats_password(STREAMS_ADMIN),
                                   memory=True))
        workers.append(
            start_worker(
                ALLOCATION,
                nats.url,
                creds.redis_url("allocation", redis.url),
                prefix,
                "--nats-creds",
                str(creds.nats_creds("allocation")),
                "--js-domain",
                prefix,
            )
        )
        client = creds.nats_url("admin", nats.url)  # nats://admin:<password>@host:port
        password = creds.identities["admin"].password
        domain = ["--js-domain", prefix]

        added = berth(client, prefix, "call", "resource.add-node", json.dumps(N1))
        assert added.returncode == 0, added.stderr
        replayed = berth(client, prefix, "events", "--since", "1h", "--count", "3", *domain)
        assert replayed.returncode == 0, replayed.stderr
        lines = [json.loads(line) for line in replayed.stdout.splitlines()]
        assert [(line["stream"], line["seq"], line["event"]["type"]) for line in lines] == [
            (f"{prefix}-events", seq, "added") for seq in (1, 2, 3)
        ]
        tenant = creds.nats_url("ten", nats.url)
        own = berth(tenant, prefix, "events", "resource.*.added", "--since", "1h", "--count", "3", *domain)
        assert own.returncode == 0, own.stderr
        assert [json.loads(line)["seq"] for line in own.stdout.splitlines()] == [1, 2, 3]
        everything = berth(tenant, prefix, "events", "resource.>", "--since", "1h", "--count", "1", *domain)
        assert everything.returncode == 5 and "not allowed" in everything.stderr
        # the refusal names the patterns a tenant may give, those within the one refused first
        allowed = ("resource.*.added, resource.*.removed, resource.*.capacity, resource.*.labels, resource.*.down, "
                   "resource.*.up, resource.*.draining, resource.workload.ten.>, broker.ten.>, broker.resource.ten.>, "
                   "metrics.>")
        assert f"give one of {allowed} (within resource.>: resource.*.added, " in everything.stderr
        one_node = berth(tenant, prefix, "events", "resource.n1.>", "--since", "1h", "--count", "1", *domain)
        assert one_node.returncode == 5 and f"give one of {allowed} (within resource.n1.>: resource.n1.added, " \
            "resource.n1.removed, resource.n1.capacity, resource.n1.labels, resource.n1.down, resource.n1.up, " \
            "resource.n1.draining)" in one_node.stderr, one_node.stderr
        suggested = berth(tenant, prefix, "events", "resource.n1.added", "--since", "1h", "--count", "1", *domain)
        assert suggested.returncode == 0, suggested.stderr  # what it names works
        assert berth(client, prefix, "nodes").stdout.splitlines()[1].split()[0] == "n1"
        assert berth(client, prefix, "status").stdout.splitlines()[2].split()[:2] == [
            f"{prefix}-allocation",
            "1",
        ]
        with_file = berth(
            nats.url, prefix, "call", "resource.plugins", "--nats-creds", str(creds.nats_creds("admin"))
        )
        assert with_file.returncode == 0, with_file.stderr

        wrong = berth(client.replace(password, "not-the-password"), prefix, "call", "resource.plugins")
        assert wrong.returncode == 5 and "cannot connect to NATS" in wrong.stderr
        assert "not-the-password" not in wrong.stderr and "admin:***@" in wrong.stderr

        # only services may publish events: the server refuses, and the command says so at once
        refused = berth(client, prefix, "call", "events.resource.n1.added", "{}", "--timeout", "60")
        assert refused.returncode == 5, refused.stderr
        assert "NATS refused: permissions violation for publish" in refused.stderr
    finally:
        stop_workers(workers)
        nats.stop()
        redis.stop()
