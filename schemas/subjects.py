"""Putting names and ids into NATS subjects (DESIGN.md §8, "All services").

Names used as subject tokens (node names, users, broker names, the subject prefix) match
`NAME_RULE`, `[A-Za-z0-9_-]+`: this module holds the one definition, as a compiled pattern
(`NAME_PATTERN`) and as msgspec types with each name's length limit (`NodeName`, `ShortName`), so
a request with another name is `invalid_argument` naming the field. Any other id (a cgroup path, a
container id, a disk name) is escaped so that it is exactly one token: no `.` (the token separator),
no wildcard, no whitespace.
"""

from __future__ import annotations

import re
from typing import Any

from schemas.patterns import END, matching

NAME_CHARS = "A-Za-z0-9_-"  # a regex character class's inside: `[^{NAME_CHARS}]` is any other character
NAME_RULE = f"[{NAME_CHARS}]+"  # as DESIGN.md §8 writes it (and error messages quote it)
NAME_REGEX = f"^{NAME_RULE}{END}"
NAME_PATTERN = re.compile(NAME_REGEX)
# Names joined by `.`, each part one subject token (metric names: `cpu.usage.ratio.cpu`).
DOTTED_NAME_REGEX = rf"^{NAME_RULE}(\.{NAME_RULE})*{END}"


NAME_WORDS = "letters, digits, '_' and '-' only"


def _name(max_length: int) -> Any:
    """A msgspec string type: a subject-token name of 1 to `max_length` characters."""
    return matching(NAME_REGEX, NAME_WORDS, min_length=1, max_length=max_length)


NodeName = _name(253)  # a node's name: at most a DNS host name's length
ShortName = _name(128)  # the broker's users and broker names
# The longest subject a service publishes on that holds ids from a request (metric events). NATS
# refuses a protocol line over its max_control_line (4 KiB by default) by closing the connection,
# which would cut the worker off: half of it leaves room for the reply subject and the rest.
MAX_SUBJECT_BYTES = 2048

_ESCAPES = {"%": "%25", ".": "%2E", "*": "%2A", ">": "%3E"}


def escape_token(text: str) -> str:
    """`text` as one subject token: `%`, `.`, `*`, `>` and whitespace become `%XX` (a space is `%20`)."""
    return "".join(_ESCAPES.get(ch) or (_percent(ch) if ch.isspace() else ch) for ch in text)


def _percent(ch: str) -> str:
    return "".join(f"%{byte:02X}" for byte in ch.encode())


# The services a host's agent serves for its node alone: their commands are `<service>.<node>.<command>`
# below the prefix (schemas/agent.py, schemas/metrics.py), answered by that node's agent or nobody.
NODE_SERVICES = ("agent", "metrics")


def served_node(subject: str) -> str | None:
    """The node whose agent alone answers `subject` (below the prefix: `metrics.n9.get` -> n9), else None."""
    tokens = subject.split(".")
    return tokens[1] if len(tokens) >= 3 and tokens[0] in NODE_SERVICES else None
