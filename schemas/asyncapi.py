"""An AsyncAPI 3.0.0 document of every subject: `berth schema --asyncapi`.

It is built from the same sources as the JSON Schema export (`schemas/export.py`): each service
module's `COMMANDS` (subject, request and reply Structs) and `EVENTS` (subject pattern and event
Struct), plus the error body and the event envelope of `schemas/common.py`. Payload schemas are
msgspec's JSON Schema of the Structs, shared under `components/schemas`.

The document describes berth's services, so its operations are theirs:

- every command is a channel on `<prefix>.<subject>` and an operation with `action: receive` (the
  service receives the request) whose `reply` names a reply channel without an address (the
  request's NATS reply subject, an inbox the caller chooses) and its two messages: the reply and
  the error reply (headers `Nats-Service-Error-Code` and `Nats-Service-Error`, body
  `{"error": {code, message, details}}`);
- every event pattern is a channel on `<prefix>.events.<...>` and an operation with
  `action: send` (the service publishes). `<name>` tokens of a pattern become `{name}`
  parameters, `<a|b|c>` a `{type}` parameter with that enum (the body's `type` is the subject's
  last token), and a part that spans a variable number of tokens (`[.<id>...]`, `<metric tokens>`)
  one `{path}` parameter; `x-nats-subject` gives the wildcard subject to subscribe to.

A client does the opposite of each operation: it sends requests and receives events. Every message
is MessagePack (`defaultContentType: application/msgpack`): maps with string keys, which the JSON
Schemas describe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable
from urllib.parse import urlsplit

import msgspec
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from schemas.common import ErrorBody, Event
from schemas.subjects import NAME_CHARS, NAME_PATTERN

ASYNCAPI_VERSION = "3.0.0"
CONTENT_TYPE = "application/msgpack"
DEFAULT_SERVERS = ("127.0.0.1:4222",)
MICRO_QUEUE_GROUP = "q"  # the queue group nats.micro endpoints share (bus.service: not for broadcast)
NATS_BINDING_VERSION = "0.1.0"
SCHEMAS = "#/components/schemas/"
# Keys of channels, operations, messages and components: what every AsyncAPI 3 tool accepts, and
# the names that subjects hold too (schemas.subjects).
KEY = NAME_PATTERN


@dataclass
class Address:
    """A subject pattern as an AsyncAPI channel address with parameters, and as a NATS subject."""

    address: str
    nats_subject: str
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_pattern(root: str, pattern: str) -> Address:
    """`<root>.<pattern>` as an address: literal tokens stay, `<name>` is `{name}`, `<a|b>` is
    `{type}` with an enum, and what spans a variable number of tokens is one `{path}` (NATS `>`)."""
    tokens = _split(pattern)
    address, nats, parameters = root.split("."), root.split("."), {}
    for i, token in enumerate(tokens):
        head, bracket, group = token.partition("[")
        if _variable(head):
            head, bracket, group = "", "[", token  # the whole token is variable
        if head:
            if not head.startswith("<"):
                address.append(head)
                nats.append(head)
            else:
                name, parameter = _parameter(head, parameters)
                parameters[name] = parameter
                address.append(f"{{{name}}}")
                nats.append("*")
        if bracket:
            rest = ".".join([("[" + group) if head else group, *tokens[i + 1 :]])
            parameters["path"] = {
                "description": f"`{rest}`: several subject tokens (ids are escaped, so they hold no `.`)",
            }
            address.append("{path}")
            nats.append(">")
            break
    return Address(".".join(address), ".".join(nats), parameters)


def _split(pattern: str) -> list[str]:
    """Split on `.` outside `[...]` groups."""
    tokens, depth, current = [], 0, ""
    for char in pattern:
        if char == "." and depth == 0:
            tokens.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    tokens.append(current)
    return tokens


def _variable(token: str) -> bool:
    """A token that stands for several subject tokens: `<metric tokens>`, `<id>...`."""
    return token.endswith(("...", " tokens>"))


def _parameter(token: str, taken: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    inner = token.strip("<>")
    if "|" in inner:
        name = "type" if "type" not in taken else f"type{len(taken)}"
        return name, {"enum": inner.split("|"), "description": "the event type (also the body's `type`)"}
    name = re.sub(r"\W+", "_", inner).strip("_")
    if name in taken:
        raise ValueError(f"parameter {name!r} appears twice in a subject")
    return name, {"description": f"`{token}`: one subject token"}


def server_host(url: str) -> str:
    """`host:port` of a NATS URL (`nats://user:password@host:port`): never its credentials."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or 4222}"


def key(text: str) -> str:
    """A component or channel key from a subject: `{node}` and `.` become `_`."""
    return re.sub(f"[^{NAME_CHARS}]+", "_", text).strip("_")


def _ref(*path: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(part.replace("~", "~0").replace("/", "~1") for part in path)}


def _payload_schemas(types: list[type]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """msgspec's JSON Schemas of `types` with shared components; component names made keys."""
    schemas, components = msgspec.json.schema_components(types, ref_template=SCHEMAS + "{name}")
    renamed = {name: key(name) for name in components}
    if len(set(renamed.values())) != len(renamed):
        raise ValueError("two schema components share a key")

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith(SCHEMAS):
                out["$ref"] = SCHEMAS + renamed[ref[len(SCHEMAS) :]]
            if isinstance(out.get("discriminator"), dict):
                # msgspec writes OpenAPI's {propertyName, mapping} for a tagged union; AsyncAPI's
                # Schema Object takes the property's name (each variant's schema holds its tag value).
                out["discriminator"] = out["discriminator"]["propertyName"]
            return out
        if isinstance(node, (list, tuple)):
            return [rewrite(v) for v in node]
        return node

    return rewrite(list(schemas)), {renamed[name]: rewrite(schema) for name, schema in components.items()}


def _version() -> str:
    try:
        return metadata.version("berth")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def document(
    services: Mapping[str, Any], prefix: str = "berth", servers: Iterable[str] = DEFAULT_SERVERS
) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of `services` (name -> a module or object with `COMMANDS` and
    `EVENTS`: each service's commands.py, as `berth.registry.contracts()` gives them)."""
    modules = services
    commands = [(service, c) for service, module in modules.items() for c in getattr(module, "COMMANDS", [])]
    events = [
        (service, pattern, type_)
        for service, module in modules.items()
        for pattern, type_ in getattr(module, "EVENTS", {}).items()
    ]
    types = [ErrorBody, Event]
    for _, command in commands:
        types += [command.request, command.response]
    types += [type_ for _, _, type_ in events]
    payloads, schemas = _payload_schemas(types)
    payload = dict(zip(map(id, types), payloads))  # a type's payload schema (a $ref to its component)

    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {
        "error": {
            "name": "error",
            "title": "Error reply",
            "summary": "The reply to a request that failed: status and message headers, the error body.",
            "contentType": CONTENT_TYPE,
            "headers": {
                "type": "object",
                "properties": {
                    ERROR_CODE_HEADER: {
                        "type": "string",
                        "pattern": "^[0-9]{3}$",
                        "description": "HTTP-like status: 400, 403, 404, 409, 412, 429, 500, 503 "
                        "(unavailable: nothing applied), 504 (outcome_unknown: the change may have been "
                        "made; a retry with the same request_id gives the real answer)",
                    },
                    ERROR_HEADER: {"type": "string", "description": "the error message"},
                },
                "required": [ERROR_CODE_HEADER, ERROR_HEADER],
            },
            "payload": payload[id(ErrorBody)],
        },
        "event_envelope": {
            "name": "event",
            "title": "Event envelope",
            "summary": "What every event body holds: `type` (the subject's last token) and `time` "
            "(unix seconds); each event's message adds its fields.",
            "contentType": CONTENT_TYPE,
            "payload": payload[id(Event)],
        },
    }

    def add_channel(channel_id: str, channel: dict[str, Any]) -> None:
        if not KEY.match(channel_id) or channel_id in channels:
            raise ValueError(f"channel key {channel_id!r} is not a key or not unique")
        channels[channel_id] = channel

    for service, command in commands:
        where = parse_pattern(prefix, command.subject)
        cid = key(command.subject)
        reply_id = f"{cid}_reply"
        request_type, reply_type = command.request, command.response
        messages[f"{cid}_request"] = {
            "name": command.subject,
            "title": request_type.__name__,
            "contentType": CONTENT_TYPE,
            "payload": payload[id(request_type)],
        }
        messages[f"{cid}_reply"] = {
            "name": f"{command.subject} reply",
            "title": reply_type.__name__,
            "contentType": CONTENT_TYPE,
            "payload": payload[id(reply_type)],
        }
        channel = {
            "address": where.address,
            "title": command.subject,
            "description": f"Requests to the {service} service's `{command.subject}` command.",
            "messages": {"request": _ref("components", "messages", f"{cid}_request")},
        }
        if where.parameters:
            channel["parameters"] = where.parameters
        add_channel(cid, channel)
        add_channel(
            reply_id,
            {
                "address": None,
                "title": f"{command.subject} reply",
                "description": "The reply to a request: sent to the request's NATS reply subject (an inbox "
                "the caller chooses), so the address is dynamic.",
                "messages": {
                    "reply": _ref("components", "messages", f"{cid}_reply"),
                    "error": _ref("components", "messages", "error"),
                },
            },
        )
        operation: dict[str, Any] = {
            "action": "receive",
            "channel": _ref("channels", cid),
            "title": command.subject,
            "summary": f"{service}: answer `{command.subject}` with a {reply_type.__name__} or an error.",
            "messages": [_ref("channels", cid, "messages", "request")],
            "reply": {
                "channel": _ref("channels", reply_id),
                "messages": [
                    _ref("channels", reply_id, "messages", "reply"),
                    _ref("channels", reply_id, "messages", "error"),
                ],
            },
            "tags": [{"name": service}],
            "x-berth-idempotent": command.idempotent,
        }
        if command.idempotent:
            operation["description"] = (
                "Changes state; a `request_id` makes a retry within 24 h return the first answer."
            )
        if command.broadcast:
            operation["x-berth-broadcast"] = True  # every instance receives it: no shared queue group
        else:
            operation["bindings"] = {
                "nats": {"queue": MICRO_QUEUE_GROUP, "bindingVersion": NATS_BINDING_VERSION}
            }
        operations[cid] = operation

    for service, pattern, event_type in events:
        where = parse_pattern(f"{prefix}.events", pattern)
        cid = key(f"events.{where.address.removeprefix(prefix + '.events.')}")
        messages[cid] = {
            "name": f"events.{pattern}",
            "title": event_type.__name__,
            "contentType": CONTENT_TYPE,
            "payload": payload[id(event_type)],
        }
        channel = {
            "address": where.address,
            "title": f"events.{pattern}",
            "description": f"Events of the {service} service: `{prefix}.events.{pattern}`. Subscribe to "
            f"`{where.nats_subject}`.",
            "messages": {"event": _ref("components", "messages", cid)},
            "x-nats-subject": where.nats_subject,
        }
        if where.parameters:
            channel["parameters"] = where.parameters
        add_channel(cid, channel)
        operations[cid] = {
            "action": "send",
            "channel": _ref("channels", cid),
            "title": f"events.{pattern}",
            "summary": f"{service}: publish a {event_type.__name__} on every such change.",
            "messages": [_ref("channels", cid, "messages", "event")],
            "tags": [{"name": service}],
        }

    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "berth",
            "version": _version(),
            "description": (
                "berth's services over NATS (subject prefix `" + prefix + "`). Each command is NATS "
                "request/reply: the service receives the request and answers on its reply subject. Each "
                "event is published by a service; JetStream streams `"
                + prefix
                + "-events` and `"
                + prefix
                + "-metrics` keep them for replay. Messages are MessagePack maps with string keys. A "
                "request's unknown key, at any level, is refused (`invalid_argument` naming it); replies and "
                "events may gain keys, which a client ignores."
            ),
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            f"nats{i}" if i else "nats": {
                "host": server_host(url),
                "protocol": "nats",
                "description": "A NATS server of the deployment (`berth up` prints its URL).",
                "security": [_ref("components", "securitySchemes", "user_password")],
            }
            for i, url in enumerate(servers)
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": messages,
            "securitySchemes": {
                "user_password": {
                    "type": "userPassword",
                    "description": "NATS user and password: `berth up` makes one user per service and one "
                    "per identity (`berth user add`; docs/security.md); servers started with --no-auth "
                    "need none.",
                },
            },
        },
    }
