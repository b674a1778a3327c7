"""`berth schema --asyncapi`: an AsyncAPI 3.0.0 document of every subject (schemas/asyncapi.py).

The document is checked twice: against `asyncapi3`'s object model of the AsyncAPI 3.0 specification
(pydantic; the dev extra installs it), and by `problems()` below, which checks what a model of the
objects cannot: every `$ref` resolves, operations name messages of their own channel, addresses
and parameters agree, and every command and event of every service is there with the payload
schema its Struct has.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from berth.registry import contracts
from schemas.asyncapi import document, parse_pattern
from schemas.export import document as json_schema_document

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ("tests.echo_service",)
KEY = re.compile(r"^[A-Za-z0-9_-]+$")
NOT_DRAFT_07 = {
    "prefixItems",
    "$defs",
    "unevaluatedProperties",
    "unevaluatedItems",
    "dependentRequired",
    "dependentSchemas",
    "$anchor",
    "$dynamicRef",
}


def modules(extra: tuple[str, ...] = EXTRA) -> dict[str, Any]:
    return contracts(extra)


def resolve(doc: dict, ref: str) -> Any:
    """The node a local `$ref` (a JSON pointer) names; KeyError when there is none."""
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def deref(doc: dict, node: Any) -> Any:
    """`node`, or what its `$ref` chain ends at."""
    while isinstance(node, dict) and "$ref" in node:
        node = resolve(doc, node["$ref"])
    return node


def refs(node: Any, where: str = "#") -> list[tuple[str, str]]:
    """(location, ref) of every `$ref` in `node`."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                found.append((where, v))
            else:
                found += refs(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += refs(v, f"{where}/{i}")
    return found


def inline(schema: Any, root: dict, prefix: str, stack: tuple = ()) -> Any:
    """`schema` with its `$ref`s to `prefix` replaced by what they name (a cycle is marked), and
    a JSON Schema `discriminator` object as AsyncAPI's (the property's name)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith(prefix):
            if ref in stack:
                return {"recursive": True}
            return inline(resolve(root, ref), root, prefix, (*stack, ref))
        out = {k: inline(v, root, prefix, stack) for k, v in schema.items()}
        if isinstance(out.get("discriminator"), dict):
            out["discriminator"] = out["discriminator"]["propertyName"]
        return out
    if isinstance(schema, list):
        return [inline(v, root, prefix, stack) for v in schema]
    return schema


def address_of(prefix: str, subject: str) -> str:
    """`metrics.<node>.get` -> `<prefix>.metrics.{node}.get`."""
    return f"{prefix}." + re.sub(r"<([A-Za-z0-9_]+)>", r"{\1}", subject)


def problems(doc: dict, prefix: str, extra: tuple[str, ...] = EXTRA) -> list[str]:
    """What is wrong with `doc` as berth's AsyncAPI 3.0.0 document; empty when nothing is."""
    out: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.append(what)

    # required fields of an AsyncAPI 3.0.0 document, and keys every tool accepts
    need(doc.get("asyncapi") == "3.0.0", "asyncapi is not 3.0.0")
    info = doc.get("info") or {}
    need(
        isinstance(info.get("title"), str) and isinstance(info.get("version"), str),
        "info needs title and version",
    )
    need(doc.get("defaultContentType") == "application/msgpack", "defaultContentType is not MessagePack")
    for name, server in (doc.get("servers") or {}).items():
        need(
            isinstance(server.get("host"), str) and server.get("protocol") == "nats",
            f"server {name}: host, protocol nats",
        )
    need(bool(doc.get("servers")), "no server")
    sections = {"channels": doc.get("channels") or {}, "operations": doc.get("operations") or {}}
    sections.update({f"components/{k}": v for k, v in (doc.get("components") or {}).items()})
    for section, entries in sections.items():
        need(all(KEY.match(k) for k in entries), f"{section}: a key is not [A-Za-z0-9_-]+")

    # every $ref resolves
    for where, ref in refs(doc):
        try:
            resolve(doc, ref)
        except (KeyError, IndexError, ValueError, AssertionError):
            out.append(f"{where}: $ref {ref} does not resolve")

    channels, operations = sections["channels"], sections["operations"]
    for cid, channel in channels.items():
        address = channel.get("address")
        params = set(re.findall(r"\{([^}]+)\}", address or ""))
        need(
            params == set(channel.get("parameters") or {}), f"channel {cid}: parameters {params} of {address}"
        )
        need(bool(channel.get("messages")), f"channel {cid}: no message")
        for key, message in (channel.get("messages") or {}).items():
            try:
                target = deref(doc, message)
            except KeyError:
                continue  # reported with the $refs
            need(
                target.get("contentType", doc.get("defaultContentType")) == "application/msgpack",
                f"channel {cid} message {key}: not MessagePack",
            )
            need("payload" in target, f"channel {cid} message {key}: no payload")

    def messages_of(channel_ref: str, message_refs: list[dict], what: str) -> None:
        for message in message_refs:
            need(
                message.get("$ref", "").startswith(channel_ref + "/messages/"),
                f"{what}: message {message} is not one of its channel's",
            )

    for oid, op in operations.items():
        need(op.get("action") in ("send", "receive"), f"operation {oid}: action")
        channel_ref = (op.get("channel") or {}).get("$ref", "")
        need(channel_ref.startswith("#/channels/"), f"operation {oid}: channel is not a $ref to #/channels")
        messages_of(channel_ref, op.get("messages") or [], f"operation {oid}")
        need(bool(op.get("messages")), f"operation {oid}: no message")
        if "reply" in op:
            reply_ref = (op["reply"].get("channel") or {}).get("$ref", "")
            need(reply_ref.startswith("#/channels/"), f"operation {oid}: reply channel is not a $ref")
            messages_of(reply_ref, op["reply"].get("messages") or [], f"operation {oid} reply")

    # every command of every service: a channel on its subject, an operation receiving it and
    # replying with its reply or the error reply, payloads as their Structs' schemas
    by_address = {channel.get("address"): cid for cid, channel in channels.items()}
    receiving = {op["channel"]["$ref"]: op for op in operations.values() if op.get("action") == "receive"}
    sending = {op["channel"]["$ref"]: op for op in operations.values() if op.get("action") == "send"}
    exported = json_schema_document(modules(extra), prefix)
    for service, module in modules(extra).items():
        for command in getattr(module, "COMMANDS", []):
            cid = by_address.get(address_of(prefix, command.subject))
            if cid is None:
                out.append(f"{service}: no channel for {command.subject}")
                continue
            op = receiving.get(f"#/channels/{cid}")
            if op is None or "reply" not in op:
                out.append(f"{service}: no request/reply operation for {command.subject}")
                continue
            try:
                replies = [deref(doc, m) for m in op["reply"]["messages"]]
                need(
                    any(ERROR_HEADER_NAME in (m.get("headers") or {}).get("properties", {}) for m in replies),
                    f"{command.subject}: the error reply is not among the replies",
                )
                entry = exported["services"][service]["subjects"][f"{prefix}.{command.subject}"]
                defs = exported["services"][service]
                for part, messages in (("request", op["messages"]), ("reply", op["reply"]["messages"][:1])):
                    ours = inline(deref(doc, messages[0])["payload"], doc, "#/components/schemas/")
                    theirs = inline(entry[part], defs, "#/$defs/")
                    need(
                        ours == theirs,
                        f"{command.subject}: the {part} payload differs from the JSON Schema export",
                    )
            except KeyError as error:
                out.append(f"{command.subject}: {error!r} does not resolve")
        for pattern in getattr(module, "EVENTS", {}):
            found = [cid for cid, channel in channels.items() if channel.get("title") == f"events.{pattern}"]
            need(len(found) == 1, f"{service}: no single channel for events.{pattern}")
            need(
                all(f"#/channels/{cid}" in sending for cid in found),
                f"{service}: nothing sends events.{pattern}",
            )

    def discriminators(node: Any) -> list[Any]:
        if isinstance(node, dict):
            return ([node["discriminator"]] if "discriminator" in node else []) + [
                d for v in node.values() for d in discriminators(v)
            ]
        return [d for v in node for d in discriminators(v)] if isinstance(node, list) else []

    found = discriminators(doc.get("components", {}).get("schemas", {}))
    need(all(isinstance(d, str) for d in found), "a schema's discriminator is not a property name")
    used = json.dumps(doc.get("components", {}).get("schemas", {}))
    for keyword in NOT_DRAFT_07:
        need(f'"{keyword}"' not in used, f"schemas use {keyword}, which the AsyncAPI schema format lacks")
    return out


ERROR_HEADER_NAME = "Nats-Service-Error-Code"


@pytest.fixture(scope="module")
def doc() -> dict:
    return document(modules(), "p")


def validate_with_asyncapi3(doc: dict) -> None:
    with warnings.catch_warnings():  # the package warns about its own field names on import
        warnings.simplefilter("ignore")
        from asyncapi3 import AsyncAPI3
    AsyncAPI3.model_validate(doc)


def test_the_document_is_valid_asyncapi_3(doc):
    validate_with_asyncapi3(doc)
    assert problems(doc, "p") == []


def test_every_command_and_event_is_there(doc):
    commands = sum(len(getattr(m, "COMMANDS", [])) for m in modules().values())
    events = sum(len(getattr(m, "EVENTS", {})) for m in modules().values())
    assert len(doc["operations"]) == commands + events
    assert len(doc["channels"]) == 2 * commands + events  # each command has a reply channel

    add_node = doc["operations"]["resource_add-node"]
    assert add_node["action"] == "receive" and add_node["x-berth-idempotent"] is True
    assert add_node["bindings"]["nats"]["queue"] == "q"
    request = resolve(doc, resolve(doc, add_node["messages"][0]["$ref"])["$ref"])
    assert request["contentType"] == "application/msgpack"
    assert resolve(doc, request["payload"]["$ref"])["required"] == ["nodename"]
    reply_channel = resolve(doc, add_node["reply"]["channel"]["$ref"])
    assert reply_channel["address"] is None  # the request's reply subject: dynamic
    error = resolve(doc, reply_channel["messages"]["error"]["$ref"])
    assert error["headers"]["required"] == ["Nats-Service-Error-Code", "Nats-Service-Error"]
    body = resolve(doc, error["payload"]["$ref"])
    assert resolve(doc, body["properties"]["error"]["$ref"])["required"] == ["code", "message"]
    envelope = resolve(doc, doc["components"]["messages"]["event_envelope"]["payload"]["$ref"])
    assert {"type", "time"} <= set(envelope["properties"])

    put = doc["channels"]["metrics_node_put"]
    assert put["address"] == "p.metrics.{node}.put" and set(put["parameters"]) == {"node"}
    assert "bindings" not in doc["operations"]["metrics_node_put"]  # broadcast: every agent receives it

    metric = doc["channels"]["events_metrics_node_scope_path"]
    assert metric["address"] == "p.events.metrics.{node}.{scope}.{path}"
    assert metric["x-nats-subject"] == "p.events.metrics.*.*.>"
    resource = doc["channels"]["events_resource_node_type"]
    assert resource["parameters"]["type"]["enum"] == [
        "added",
        "removed",
        "capacity",
        "usage",
        "allocated",
        "released",
        "labels",
        "down",
        "up",
        "draining",
    ]
    assert doc["operations"]["events_resource_node_type"]["action"] == "send"
    start = doc["channels"]["agent_node_start"]  # each host's agent answers on its own subjects
    assert start["address"] == "p.agent.{node}.start" and set(start["parameters"]) == {"node"}
    exited = doc["channels"]["events_agent_node_type"]
    assert "exited" in exited["parameters"]["type"]["enum"]


def test_the_checks_catch_a_broken_document(doc):
    for break_it, complaint in [
        (lambda d: d["operations"]["resource_add-node"].pop("action"), "action"),
        (
            lambda d: d["operations"].pop("resource_allocate"),
            "no request/reply operation for resource.allocate",
        ),
        (lambda d: d["channels"].pop("resource_plugins"), "no channel for resource.plugins"),
        (lambda d: d["components"]["schemas"].pop("AddNode"), "does not resolve"),
        (lambda d: d["channels"]["metrics_node_get"].pop("parameters"), "parameters"),
        (lambda d: d["operations"]["resource_add-node"]["reply"]["messages"].pop(), "error reply"),
        (
            lambda d: d["operations"]["resource_add-node"]["messages"].append(
                {"$ref": "#/channels/resource_plugins/messages/request"}
            ),
            "not one of its channel's",
        ),
        (lambda d: d["components"]["schemas"]["AddNode"]["properties"].pop("labels"), "differs"),
        (
            lambda d: d["components"]["schemas"]["AddBroker"]["properties"]["strategy"].update(
                discriminator={"propertyName": "type"}
            ),
            "discriminator",
        ),
    ]:
        broken = copy.deepcopy(doc)
        break_it(broken)
        found = problems(broken, "p")
        assert any(complaint in problem for problem in found), (complaint, found)
    broken = copy.deepcopy(doc)
    broken["operations"]["resource_add-node"].pop("action")
    with pytest.raises(Exception):
        validate_with_asyncapi3(broken)


def test_patterns_become_addresses_with_parameters():
    where = parse_pattern("b.events", "broker.resource.<user>.<resource_id>.<init|running>")
    assert where.address == "b.events.broker.resource.{user}.{resource_id}.{type}"
    assert where.nats_subject == "b.events.broker.resource.*.*.*"
    assert where.parameters["type"]["enum"] == ["init", "running"]
    where = parse_pattern("b.events", "metrics.<node>.<scope>[.<id>...].<metric tokens>")
    assert (where.address, where.nats_subject) == (
        "b.events.metrics.{node}.{scope}.{path}",
        "b.events.metrics.*.*.>",
    )
    assert parse_pattern("b", "resource.cpumem.add-node").address == "b.resource.cpumem.add-node"


def test_berth_schema_asyncapi_writes_it(tmp_path):
    out = tmp_path / "asyncapi.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "berth.cli",
            "schema",
            "--asyncapi",
            "--prefix",
            "q",
            "-o",
            str(out),
            "--server",
            "nats://client:s3cret@10.0.0.7:4333",
            "--server",
            "nats-b:4222",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "s3cret" not in text
    written = json.loads(text)
    assert [s["host"] for s in written["servers"].values()] == ["10.0.0.7:4333", "nats-b:4222"]
    assert written["channels"]["resource_add-node"]["address"] == "q.resource.add-node"
    validate_with_asyncapi3(written)
    assert problems(written, "q", extra=()) == []
