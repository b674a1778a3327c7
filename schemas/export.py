"""JSON Schema for every message, grouped by subject: `berth schema` or `python -m schemas.export`.

With `--asyncapi`, an AsyncAPI 3.0.0 document of every subject instead (`schemas/asyncapi.py`),
built from the same service modules.

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
    parser.add_argument(
        "--asyncapi", action="store_true",
        help="an AsyncAPI 3.0.0 document (JSON) of every subject instead: see schemas/asyncapi.py",
    )
    parser.add_argument(
        "--server", action="append", metavar="URL",
        help="with --asyncapi: a NATS server to list (host:port or a nats:// URL; repeatable; "
        "credentials are left out; default 127.0.0.1:4222)",
    )
    args = parser.parse_args(argv)
    if args.asyncapi:
        from schemas.asyncapi import DEFAULT_SERVERS
        from schemas.asyncapi import document as asyncapi_document

        doc = asyncapi_document(args.prefix, servers=args.server or DEFAULT_SERVERS)
    else:
        doc = document(args.prefix)
    text = json.dumps(doc, indent=2, sort_keys=False)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
