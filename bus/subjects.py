"""Putting ids into NATS subjects (DESIGN.md §8, "All services").

Names used as subject tokens (node names, users, broker names) must match `NAME_PATTERN`. Any other
id (a cgroup path, a container id, a disk name) is escaped so that it is exactly one token: no `.`
(the token separator), no wildcard, no whitespace.
"""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")

_ESCAPES = {"%": "%25", ".": "%2E", "*": "%2A", ">": "%3E"}


def escape_token(text: str) -> str:
    """`text` as one subject token: `%`, `.`, `*`, `>` and whitespace become `%XX` (a space is `%20`)."""
    return "".join(_ESCAPES.get(ch) or (_percent(ch) if ch.isspace() else ch) for ch in text)


def _percent(ch: str) -> str:
    return "".join(f"%{byte:02X}" for byte in ch.encode())
