"""JSON Schema for every message, grouped by subject: what `berth schema` prints.

(`berth schema --asyncapi` prints an AsyncAPI 3.0.0 document of the same tables instead:
`schemas/asyncapi.py`.)

The output is one JSON document: for each service, each command's subject with its request and
reply schemas, then the common error body and event envelope. A client in another language reads
it to know what to send where. The services' tables (`COMMANDS`, `EVENTS` of each
`services/<service>/commands.py`) are handed in by the caller: the contract layer imports no service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from schemas.common import ErrorBody, Event


def command_schemas(prefix: str, commands: list) -> dict[str, Any]:
    requests = [c.request for c in commands]
    replies = [c.response for c in commands]
    (schemas, components) = msgspec.json.schema_components(requests + replies, ref_template="#/$defs/{name}")
    out: dict[str, Any] = {}
    for i, command in enumerate(commands):
        out[f"{prefix}.{command.subject}"] = {
            "request": schemas[i],
            "reply": schemas[len(commands) + i],
            "idempotent": command.idempotent,
        }
    return {"subjects": out, "$defs": components}


def document(services: Mapping[str, Any], prefix: str = "berth") -> dict[str, Any]:
    """The JSON Schema document of `services` (name -> a module or object with `COMMANDS` and
    `EVENTS`)."""
    doc: dict[str, Any] = {
        "encoding": "MessagePack maps with string keys; a request's unknown key, at any level, is refused "
        "(invalid_argument naming it), replies and events may gain keys; see docs/concepts.md 'Talking to "
        "berth'",
        "error_reply": msgspec.json.schema(ErrorBody),
        "event_envelope": msgspec.json.schema(Event),
        "services": {},
    }
    for name, module in services.items():
        commands = getattr(module, "COMMANDS", [])
        entry = command_schemas(prefix, commands)
        events = getattr(module, "EVENTS", {})
        if events:
            entry["events"] = {f"{prefix}.events.{pattern}": msgspec.json.schema(t) for pattern, t in events.items()}
        doc["services"][name] = entry
    return doc
