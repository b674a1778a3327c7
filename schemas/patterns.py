"""Strings a field must match, with what they allow said in words: a refusal quotes the words
(`bus.codec` puts them in place of msgspec's "matching regex '...'"), the JSON Schema keeps the regex."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

# `$(?!\n)`: Python's `$` also matches before a final newline, so `"n1\n"` would pass `^...$`; the
# look-ahead refuses it, and reads the same in JSON Schema (ECMA regexes), where `\Z` does not exist.
END = r"$(?!\n)"
WORDS: dict[str, str] = {}  # regex -> what it allows, in words


def matching(regex: str, words: str, **meta: Any) -> Any:
    """A msgspec string type that must match `regex`; a value that does not is refused with "must be
    <words>" (e.g. "letters, digits, '_' and '-' only")."""
    WORDS[regex] = words
    return Annotated[str, Meta(pattern=regex, **meta)]


def printable(**meta: Any) -> Any:
    """Any printable text (no control character): an id that goes into subjects escaped and into
    launched processes' environment."""
    return matching(rf"^[^\x00-\x1f\x7f]+{END}", "printable text, without control characters", **meta)


def in_words(reason: str) -> str:
    """msgspec's reason for a string that does not match, said with the pattern's words."""
    prefix = "Expected `str` matching regex '"
    if not reason.startswith(prefix):
        return reason
    quoted = reason[len(prefix):-1]
    for regex, words in WORDS.items():
        if quoted in (regex, regex.replace("\\", "\\\\")):
            return f"must be {words}"
    return reason
