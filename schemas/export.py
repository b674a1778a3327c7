"""JSON Schema for every message, grouped by subject: `berth schema` or `python -m schemas.export`.

The output is one JSON document: for each service, each command's subject with its request and
reply schemas, then the common error body and event envelope. A client in another language reads
it to know what to send where.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import msgspec

from schemas.common import ErrorBody, Event
from services.registry import available


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


def document(prefix: str = "berth", extra_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "encoding": "MessagePack maps with string keys; see README 'Talking to berth'",
        "error_reply": msgspec.json.schema(ErrorBody),
        "event_envelope": msgspec.json.schema(Event),
        "services": {},
    }
    modules = {**available(), **{m: m for m in extra_modules}}
    for name, module_name in modules.items():
        module = importlib.import_module(module_name)
        commands = getattr(module, "COMMANDS", [])
        entry = command_schemas(prefix, commands)
        events = getattr(module, "EVENTS", {})
        if events:
            entry["events"] = {f"{prefix}.events.{pattern}": msgspec.json.schema(t) for pattern, t in events.items()}
        doc["services"][name] = entry
    return doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="berth schema", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="berth")
    parser.add_argument("-o", "--output", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = json.dumps(document(args.prefix), indent=2, sort_keys=False)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
