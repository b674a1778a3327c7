"""Contract: DESIGN.md §2 and §8 "All services", for all three services at once: micro service
names and endpoints (`$SRV.INFO`, plain NATS and JSON), names as subject tokens, escaped ids.

One worker of each service runs in the module's namespace; requests are plain `msgpack` maps.
The service names are checked as `<prefix>-<service>` in that namespace, and the default prefix
(`berth`, which makes them `berth-allocation`, ...) with one metrics worker started without
`--prefix`, on the test session's own servers only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from typing import Any

import pytest
import pytest_asyncio

from tests.broker_helpers import FAST_ARGS, ROOT, param
from tests.contract.conftest import ERROR_HEADER, Wire, WireReply, unique

# DESIGN.md §3 and §8: the eru plugin commands, served per plugin and by the manager.
PLUGIN_COMMANDS = [
    "calculate-deploy", "calculate-realloc", "calculate-remap", "add-node", "remove-node",
    "get-nodes-deploy-capacity", "set-node-resource-capacity", "get-node-resource-info",
    "set-node-resource-info", "set-node-resource-usage", "get-most-idle-node", "fix-node-resource",
    "get-metrics-description", "get-metrics",
]  # fmt: skip
PLUGINS = ["cpumem", "storage", "gpu"]
# §3 "plus: allocate, release, realloc, list-nodes, get-allocations"; §8 set-node-labels, plugins;
# the agents' node-heartbeat (README "Agents").
MANAGER_ONLY = [
    "allocate", "release", "realloc", "list-nodes", "get-allocations", "set-node-labels", "plugins",
    "node-heartbeat",
]  # fmt: skip
# §4 "Commands: ..."
BROKER_COMMANDS = [
    "init", "launch", "scale", "get-service-info", "is-service-preparing", "release", "apply",
    "add-broker", "remove-broker", "list-brokers", "get-instance-type", "get-namespace",
    "get-resource-detail", "list-resources", "get-resource",
]  # fmt: skip
# §5: get, aggregate, put, register-notifier, renew-notifier / deregister-notifier, has-synced, list.
METRICS_COMMANDS = [
    "get", "aggregate", "put", "register-notifier", "renew-notifier", "deregister-notifier", "has-synced",
    "list",
]  # fmt: skip


def expected_subjects(service: str, prefix: str, node: str) -> list[str]:
    if service == "allocation":
        manager = [f"resource.{c}" for c in PLUGIN_COMMANDS + MANAGER_ONLY]
        plugins = [f"resource.{p}.{c}" for p in PLUGINS for c in PLUGIN_COMMANDS]
        suffixes = manager + plugins
    elif service == "broker":
        suffixes = [f"broker.{c}" for c in BROKER_COMMANDS]
    else:
        suffixes = [f"metrics.{node}.{c}" for c in METRICS_COMMANDS]
    return sorted(f"{prefix}.{suffix}" for suffix in suffixes)


class Services:
    def __init__(self, wire: Wire, node: str) -> None:
        self.wire = wire
        self.node = node


async def answering(call, what: str) -> None:
    """Until `call()` succeeds (a first request right after "ready" can meet no responders)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            await call()
            return
        except Exception:
            assert time.monotonic() < deadline, f"{what} does not answer"
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def services(module_workers, wire: Wire):
    node = unique("node")
    module_workers("services.allocation.worker")
    module_workers("services.broker.worker", *FAST_ARGS)
    module_workers("services.metrics.worker", "--node", node, "--interval", "1")
    await answering(lambda: wire.ok("resource.plugins", {}, timeout=2), "allocation")
    await answering(lambda: wire.ok("broker.get-namespace", {"user": "probe"}, timeout=2), "broker")
    await answering(lambda: wire.ok(f"metrics.{node}.has-synced", {}, timeout=2), "metrics")
    return Services(wire, node)


def assert_invalid(reply: WireReply, field: str) -> None:
    """§2: `invalid_argument` (400), with both headers and the error body, naming `field`."""
    assert not reply.ok, f"expected invalid_argument, got success {reply.body!r}"
    assert (reply.status, reply.code) == (400, "invalid_argument"), reply.body
    assert set(reply.error) == {"code", "message", "details"}
    assert reply.headers[ERROR_HEADER] == reply.error["message"]
    assert reply.details.get("field") == field, reply.details


async def info(nc, name: str) -> dict[str, Any]:
    """`$SRV.INFO.<name>` as any NATS client asks it: a JSON reply."""
    msg = await nc.request(f"$SRV.INFO.{name}", b"", timeout=5)
    return json.loads(msg.data)


# -- micro service names and endpoints ---------------------------------------------------------------


@pytest.mark.parametrize("service", ["allocation", "broker", "metrics"])
async def test_micro_service_name_is_prefix_dash_service(services, nc, namespace, service):
    # §8: "Micro service names: `berth-allocation`, `berth-broker`, `berth-metrics`" -- `berth` being
    # the subject prefix (§2 "Subject prefix `berth` (configurable)"): here, the module's prefix.
    reply = await info(nc, f"{namespace}-{service}")
    assert reply["name"] == f"{namespace}-{service}"


@pytest.mark.parametrize("service", ["allocation", "broker", "metrics"])
async def test_info_lists_one_endpoint_per_command(services, nc, namespace, service):
    # §8: "one endpoint per command (no wildcard endpoints), so `$SRV.INFO` lists every subject".
    reply = await info(nc, f"{namespace}-{service}")
    subjects = sorted(endpoint["subject"] for endpoint in reply["endpoints"])
    assert subjects == expected_subjects(service, namespace, services.node)
    assert not any(token in ("*", ">") for subject in subjects for token in subject.split("."))
    assert len({endpoint["name"] for endpoint in reply["endpoints"]}) == len(subjects)


def session_owns_the_servers() -> bool:
    return not (os.environ.get("NATS_URL") and os.environ.get("REDIS_URL"))


@pytest.mark.skipif(not session_owns_the_servers(), reason="would use the `berth` prefix on shared servers")
async def test_default_prefix_names_the_services_berth(services, nats_url, redis_url, nc, redis):
    # §8: "Micro service names: `berth-allocation`, `berth-broker`, `berth-metrics`"; §2 "Subject
    # prefix `berth`"; §8 "`--node NAME` (default: the host name)". A metrics worker started with
    # neither `--prefix` nor `--node` (nor their env variables) is `berth-metrics` and serves
    # `berth.metrics.<host>.*`.
    js = nc.jetstream()
    try:
        await js.stream_info("berth-metrics")
        stream_was_there = True
    except Exception:
        stream_was_there = False
    unset = ("BERTH_PREFIX", "BERTH_NODE", "BERTH_METRICS_INTERVAL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    argv = [sys.executable, "-m", "bus.runner", "services.metrics.worker", "--nats", nats_url,
            "--redis", redis_url, "--memory-stream"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert (await asyncio.to_thread(proc.stdout.readline)).startswith("ready berth-metrics ")
        host = socket.gethostname().split(".")[0]
        reply = await info(nc, "berth-metrics")
        assert reply["name"] == "berth-metrics"
        assert sorted(e["subject"] for e in reply["endpoints"]) == expected_subjects("metrics", "berth", host)
        # §8 "`--interval SECONDS` (default 5)".
        default = Wire(nc, "berth")
        await answering(lambda: default.ok(f"metrics.{host}.has-synced", {}, timeout=2), "the default agent")
        assert (await default.ok(f"metrics.{host}.has-synced", {}))["interval_seconds"] == 5.0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        keys = [k async for k in redis.scan_iter(match="berth:*")]
        if keys:
            await redis.delete(*keys)
        if not stream_was_there:
            await js.delete_stream("berth-metrics")


# -- names used as subject tokens ---------------------------------------------------------------------

BAD_NAMES = {
    "dot": "a.b", "space": "a b", "star": "a*", "gt": ">", "empty": "", "accent": "é", "percent": "a%b",
    "slash": "a/b", "tab": "a\tb", "trailing-newline": "a\n",
}  # fmt: skip


def _broker_request(command: str) -> dict[str, Any]:
    """A well-formed request of each broker command, for a valid user."""
    rid = {"resource_id": "r"}
    one = {"filter": {"least_instance": 1, "request_instance": 1}}
    return {
        "init": {**rid, "param": param()},
        "launch": {**rid, **one},
        "scale": {**rid, **one},
        "get-service-info": rid,
        "is-service-preparing": rid,
        "release": rid,
        "apply": {**rid, "param": param(), **one},
        "add-broker": {"name": "b", "strategy": {"type": "const", "num": 0}, "param": param()},
        "remove-broker": {"name": "b"},
        "list-brokers": {},
        "get-instance-type": {"platform": "linux", "group": "sz"},
        "get-namespace": {},
        "get-resource-detail": {},
        "list-resources": {},
        "get-resource": rid,
    }[command]


# (place, command, field holding the name)
NAME_PLACES = [(f"{command}.user", command, "user") for command in BROKER_COMMANDS] + [
    ("add-broker.name", "add-broker", "name"),
    ("remove-broker.name", "remove-broker", "name"),
    ("list-resources.broker_name", "list-resources", "broker_name"),
]


@pytest.mark.parametrize("bad", BAD_NAMES)
@pytest.mark.parametrize("place,command,field", NAME_PLACES, ids=[p[0] for p in NAME_PLACES])
async def test_names_used_as_subject_tokens_must_match_the_pattern(services, place, command, field, bad):
    # §8: "Names used as subject tokens (node names, users, broker names) match `[A-Za-z0-9_-]+`;
    # anything else is `invalid_argument`."
    payload = {"user": "valid-user_1", **_broker_request(command), field: BAD_NAMES[bad]}
    assert_invalid(await services.wire.request(f"broker.{command}", payload), field)


@pytest.mark.parametrize("place,command,field", NAME_PLACES, ids=[p[0] for p in NAME_PLACES])
async def test_names_matching_the_pattern_are_accepted(services, place, command, field):
    # The same requests with a name of every allowed kind of character are not refused as invalid.
    payload = {"user": unique("user"), **_broker_request(command), field: "Az09_-x"}
    reply = await services.wire.request(f"broker.{command}", payload)
    assert reply.ok or reply.code != "invalid_argument", reply.body
    if command == "init":
        await services.wire.ok("broker.release", {"user": payload["user"], "resource_id": "r"})
    if command == "add-broker":
        await services.wire.ok("broker.remove-broker", {"user": payload["user"], "name": payload["name"]})


def test_metrics_node_name_must_be_a_token(nats_url, redis_url, namespace):
    # §8: node names are subject tokens and must match `[A-Za-z0-9_-]+`: a metrics worker refuses a
    # `--node` that does not (it has no request to answer, so it refuses to start).
    argv = [sys.executable, "-m", "bus.runner", "services.metrics.worker", "--nats", nats_url,
            "--redis", redis_url, "--prefix", namespace, "--node", "node.one"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and not done.stdout.startswith("ready")
    assert "--node" in done.stderr and "[A-Za-z0-9_-]+" in done.stderr


# -- ids escaped in subjects --------------------------------------------------------------------------

# §8: "`%` -> `%25`, `.` -> `%2E`, `*` -> `%2A`, `>` -> `%3E`, whitespace -> `%20`".
ESCAPES = {
    "percent": ("a%b", "a%25b"),
    "dot": ("a.b", "a%2Eb"),
    "star": ("a*b", "a%2Ab"),
    "gt": ("a>b", "a%3Eb"),
    "space": ("a b", "a%20b"),
    "all": ("/kube pods/x.y*>%z", "/kube%20pods/x%2Ey%2A%3E%25z"),
    "escape-like": ("%2E.", "%252E%2E"),
}
# Metrics scopes whose ids go into event subjects: scope -> (the id under test, other ids).
METRIC_IDS = {
    "cgroup_path": ("cgroup", {}),
    "container": ("container", {"pod_uid": "pod-1"}),
    "device": ("device", {}),
}


async def metric_event(services, scope: str, ids: dict[str, Any]) -> tuple[str, dict]:
    """Register a metric of the entity `ids`, put a value, and return its event."""
    wire, node = services.wire, services.node
    metric = f"ext.{unique('esc')}"
    capture = await wire.capture(f"metrics.{node}.{scope}.>")
    try:
        await wire.ok(f"metrics.{node}.register-notifier", {"scope": scope, "metric": metric, **ids})
        await wire.ok(f"metrics.{node}.put", {"scope": scope, "metric": metric, "value": 1.0, **ids})
        deadline = time.monotonic() + 15
        while True:
            for subject, body in capture.events:
                if body.get("metric") == metric:
                    return subject, body
            await capture.wait_for(len(capture.events) + 1, max(0.0, deadline - time.monotonic()))
    finally:
        await capture.close()


def id_token(services, subject: str, scope: str, metric: str, before: list[str]) -> str:
    """The token of the id that follows the scope (and the ids `before` it) in a metrics subject."""
    head = services.wire.subject(".".join(["events.metrics", services.node, scope, *before])) + "."
    assert subject.startswith(head) and subject.endswith("." + metric), subject
    return subject[len(head) : -len(metric) - 1]


@pytest.mark.parametrize("case", ESCAPES)
@pytest.mark.parametrize("key", METRIC_IDS)
async def test_metrics_ids_in_event_subjects_are_escaped(services, key, case):
    # §5: "`berth.events.metrics.<node>.<scope>[.<id>...].<metric name tokens>` (ids escaped so they
    # contain no `.`)"; §8 the escapes; unescaping gives the id back, the body carries it raw.
    raw, escaped = ESCAPES[case]
    scope, others = METRIC_IDS[key]
    subject, body = await metric_event(services, scope, {**others, key: raw})
    token = id_token(services, subject, scope, body["metric"], list(others.values()))
    assert token == escaped
    assert urllib.parse.unquote(token) == raw and body[key] == raw


@pytest.mark.parametrize("whitespace", ["\t", "\n", "\u00a0"], ids=["tab", "newline", "no-break-space"])
async def test_other_whitespace_in_ids_is_escaped_and_round_trips(services, whitespace):
    # §8 "whitespace -> `%20`": read with the round trip it promises, every whitespace character
    # is escaped (no whitespace is left in the subject) and unescaping gives the id back.
    raw = f"disk{whitespace}1"
    subject, body = await metric_event(services, "device", {"device": raw})
    token = id_token(services, subject, "device", body["metric"], [])
    assert not any(ch.isspace() for ch in subject) and token.startswith("disk%")
    assert urllib.parse.unquote(token) == raw and body["device"] == raw


@pytest.mark.parametrize("case", ESCAPES)
async def test_broker_resource_ids_in_event_subjects_are_escaped(services, case):
    # §4: "`berth.events.broker.resource.<user>.<resource_id>.<status>`", the id escaped as §8 says;
    # the body carries the raw id.
    raw, escaped = ESCAPES[case]
    wire, user = services.wire, unique("u")
    capture = await wire.capture(f"broker.resource.{user}.>")
    try:
        await wire.ok("broker.init", {"user": user, "resource_id": raw, "param": param()})
        [(subject, body)] = await capture.wait_for(1)
    finally:
        await capture.close()
        await wire.request("broker.release", {"user": user, "resource_id": raw})
    assert subject == wire.subject(f"events.broker.resource.{user}.{escaped}.init")
    token = subject.split(".")[-2]
    assert urllib.parse.unquote(token) == raw and body["resource_id"] == raw
