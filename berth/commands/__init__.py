"""Everyday commands of `berth`: `call`, `events`, `nodes` and `status`, a module each, and `agent`
(which runs a host's agent, or drains it).

Each one connects to NATS as a short-lived client (`--nats`, env `NATS_URL`, else the `up.env` file
`berth up` leaves in its state folder, else nats://127.0.0.1:4222; `user:password@` in the URL, or
`--nats-creds FILE` as `berth up` writes them), under `--prefix` (env `BERTH_PREFIX`, default
`berth`). A message about nothing answering, or NATS failing, names the server and prefix asked.
What a command answers goes to standard output and nothing else does: messages about what went
wrong go to standard error, and logging (also on standard error) is quiet unless `-v` (`-vv` for
debug).

Exit statuses, the same for every command:

    0  done
    1  the service refused the request: an error reply with a 4xx status (invalid_argument,
       node_not_found, insufficient_capacity, ...)
    2  usage: bad options, a payload that is not JSON, a malformed pattern or duration
    3  nobody answered: no responders on the subject (no worker of that service is running under
       this prefix), or no reply within --timeout
    4  the service failed: an error reply with a 5xx status (internal, unavailable, ...)
    5  NATS could not be reached, refused us (authorization, permissions) or was lost for good,
       or JetStream could not replay
    6  accepted, not done within the wait: `agent --drain` was accepted (the node takes no new
       placement) and instances still run after --wait (3 is no agent answering)

`berth call` prints an error reply's body to standard output as JSON, with its status beside it
(`{"status": 404, "error": {"code", "message", "details"}}`), and one line on standard error.
Bytes in a reply or an event (MessagePack bin) are printed as base64 strings, as in the JSON
Schemas `berth schema` writes (msgspec's JSON encoding).

Shared by the four: `exits` (statuses, `CommandError`), `connection` (a short-lived NATS client
whose failures become exit statuses), `running` (a command's subparser, and running it: a
`CommandError` becomes its exit status) and `output` (JSON, tables). They import one way:
`running` -> `connection` -> `exits`.
"""

from __future__ import annotations

import argparse

from berth.commands import agent, call, events, nodes, status


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `call`, `events`, `nodes`, `status` and `agent` to the `berth` command's subparsers."""
    for command in (call, events, nodes, status, agent):
        command.add_parser(sub)
