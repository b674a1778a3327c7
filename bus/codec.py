"""MessagePack encoding with typed decoding (msgspec): every MessagePack berth reads or writes goes
through here.

A payload that fails to decode or validate raises `InvalidArgument` naming the field, so the
service runtime can answer `invalid_argument` instead of losing the endpoint to an exception.
A request's unknown key, at any depth, is refused too (DESIGN.md §8): request Structs forbid them
(`schemas.common.Request`), and where a request holds a Struct that replies or records share (and
so stays lenient) `decode` walks the payload for them. Bytes berth wrote itself (records, events,
kept answers) are read with `decode_stored` or a `decoder`, without those checks.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Collection
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as inspect

from schemas.errors import InvalidArgument
from schemas.patterns import in_words

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}

# msgspec names the failing place "... - at `$.a.b[0]`", or "... - at `key` in `$.a`" for a map key,
# and writes every map value as `[...]` whatever its key (see `error_field`).
_AT = re.compile(r"^(?P<reason>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[([^\]]*)\]")
_UNKNOWN: Any = object()  # no value at hand to find a map key in


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def _decoder(type_: Any) -> msgspec.msgpack.Decoder:
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return decoder


def decoder(type_: Any = Any) -> typing.Callable[[bytes], Any]:
    """A decoding function for bytes berth wrote itself (a record in Redis, an event, a kept answer):
    typed, with no depth check and no `InvalidArgument`, as a failure there is no caller's fault."""
    return _decoder(type_).decode


def decode_stored(data: bytes, type_: type[T] = Any) -> T:  # type: ignore[assignment]
    """`data`, which berth wrote itself, as `type_` (see `decoder`)."""
    return _decoder(type_).decode(data)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode a request's `data` as `type_`; any failure, an unknown key included, is an
    `InvalidArgument` naming the field at fault."""
    check_depth(data)
    try:
        value = _decoder(type_).decode(data)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error, value=_untyped(data), type_=type_) from None
    except msgspec.DecodeError as error:
        raise InvalidArgument("$", f"not a MessagePack map: {error}") from None
    if _holds_lenient(type_):
        refuse_unknown_fields(_untyped(data), type_, "")
    return value


MAX_DEPTH = 32  # maps and lists inside one another (DESIGN.md §8); msgspec itself recurses
# until Python's recursion limit, and code reading the decoded maps recurses too.
# Bytes that may open a map or a list (fixmap, fixarray, array 16/32, map 16/32), and the others.
_OPENERS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_OPENERS = bytes(sorted(set(range(256)) - set(_OPENERS)))
# Everything else by its first byte: (bytes of a length that follows, bytes besides that payload).
_SCALARS = {
    0xC0: (0, 0), 0xC2: (0, 0), 0xC3: (0, 0), 0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1),
    0xC8: (2, 1), 0xC9: (4, 1), 0xCA: (0, 4), 0xCB: (0, 8), 0xCC: (0, 1), 0xCD: (0, 2), 0xCE: (0, 4),
    0xCF: (0, 8), 0xD0: (0, 1), 0xD1: (0, 2), 0xD2: (0, 4), 0xD3: (0, 8), 0xD4: (0, 2), 0xD5: (0, 3),
    0xD6: (0, 5), 0xD7: (0, 9), 0xD8: (0, 17), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
}  # fmt: skip
_TEXT = {0xD9, 0xDA, 0xDB, *range(0xA0, 0xC0)}


def check_depth(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Refuse MessagePack nested deeper than `limit`, naming the path to the first map or list too deep.

    Checked on the bytes, before decoding. Such nesting needs more than `limit` bytes that could open
    a map or a list, which C counts at once; only then are the items walked (still not decoded)."""
    if len(bytes(data).translate(None, _NOT_OPENERS)) <= limit:
        return
    path = _too_deep(bytes(data), limit)
    if path is not None:
        raise InvalidArgument(path.lstrip(".") or "$", f"nested deeper than {limit} maps and lists")


def _too_deep(data: bytes, limit: int) -> str | None:
    """The path (as `error_field` writes it) to a map or list at depth `limit` + 1, or None.

    A frame per open map or list: [items in all (a map's keys and values), items read, is a map,
    the step to its current item]. A malformed payload ends the walk: msgspec says what is wrong."""
    frames: list[list] = []
    at = 0
    try:
        while at < len(data):
            is_key = bool(frames) and _enter_item(frames[-1])
            opened = _opened(data, at)
            if opened is not None:
                if len(frames) == limit:
                    return "".join(frame[3] for frame in frames)
                frame, at = opened
                frames.append(frame)
            else:
                start, at = _scalar(data, at)
                if is_key and start is not None:
                    frames[-1][3] = "." + data[start:at].decode(errors="replace")
            while frames and frames[-1][1] == frames[-1][0]:
                frames.pop()
    except (IndexError, KeyError):
        return None
    return None


def _enter_item(frame: list) -> bool:
    """Count the next item of `frame` read; whether it is a map key (else its step is set here)."""
    read = frame[1]
    frame[1] += 1
    if not frame[2]:
        frame[3] = f"[{read}]"
        return False
    return read % 2 == 0


def _opened(data: bytes, at: int) -> tuple[list, int] | None:
    """A map or list starting at `at`: its new frame and where its items start; else None."""
    first = data[at]
    if 0x80 <= first <= 0x9F:
        size, is_map, header = first & 0x0F, first < 0x90, 1
    elif first in (0xDC, 0xDE):
        size, is_map, header = int.from_bytes(data[at + 1:at + 3], "big"), first == 0xDE, 3
    elif first in (0xDD, 0xDF):
        size, is_map, header = int.from_bytes(data[at + 1:at + 5], "big"), first == 0xDF, 5
    else:
        return None
    return [size * 2 if is_map else size, 0, is_map, ""], at + header


def _scalar(data: bytes, at: int) -> tuple[int | None, int]:
    """Where a scalar's text starts (None if it is no string) and where the scalar ends."""
    first = data[at]
    if first < 0x80 or first >= 0xE0:  # fixints
        return None, at + 1
    if 0xA0 <= first <= 0xBF:
        return at + 1, at + 1 + (first & 0x1F)
    length_bytes, fixed = _SCALARS[first]
    start = at + 1 + length_bytes
    length = int.from_bytes(data[at + 1:start], "big") if length_bytes else 0
    return (start if first in _TEXT else None), start + fixed + length


def decode_as(data: bytes, type_: type[T], field: str) -> T:
    """Decode a part of a payload kept raw (`msgspec.Raw`) so that errors name its field."""
    try:
        return _decoder(type_).decode(data)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error, prefix=field, value=_untyped(data), type_=type_) from None
    except msgspec.DecodeError as error:
        raise InvalidArgument(field, f"malformed: {error}") from None


def convert(value: Any, type_: type[T], *, path: str = "") -> T:
    """Validate an already-decoded value (for example one plugin's sub-map) as `type_`."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as error:
        raise invalid_argument_from(error, prefix=path, value=value, type_=type_) from None


def invalid_argument_from(
    error: msgspec.ValidationError, prefix: str = "", *, value: Any = _UNKNOWN, type_: Any = None
) -> InvalidArgument:
    if str(error).startswith(_UNKNOWN_FIELD) and value is not _UNKNOWN and type_ is not None:
        # A Struct that forbids unknown fields met one: find it in the value, to list the accepted keys.
        refuse_unknown_fields(value, type_, prefix)
    return InvalidArgument(*error_field(str(error), prefix, value=value, type_=type_))


# -- unknown keys -----------------------------------------------------------------------------------

_UNKNOWN_FIELD = "Object contains unknown field"
_LISTS = (inspect.ListType, inspect.SetType, inspect.FrozenSetType, inspect.VarTupleType)
_NESTING = (inspect.StructType, inspect.DictType, inspect.UnionType, *_LISTS)


def unknown_key(field: str, key: object, accepted: Collection[str]) -> InvalidArgument:
    """A key a client sent that nothing reads at `field` ("" for the payload's top): a typo must never
    place a workload on every node, lose a request id or register an empty node (DESIGN.md §8)."""
    listed = f"accepted: {', '.join(sorted(accepted))}" if accepted else "it takes no keys"
    return InvalidArgument(_joined(field, key), f"unknown key {str(key)!r}; {listed}",
                           accepted=sorted(accepted))


def refuse_unknown_keys(raw: object, accepted: Collection[str], field: str) -> None:
    """Refuse the first key of a client's map (in the order sent) that is not in `accepted`."""
    if isinstance(raw, dict) and any(key not in accepted for key in raw):
        raise unknown_key(field, next(key for key in raw if key not in accepted), accepted)


def refuse_unknown_fields(raw: object, type_: Any, field: str) -> None:
    """Refuse a key a client sent that `type_` does not read, at any depth (`disks[0].read_iops`), under
    its wire name (a tagged Struct's tag key included).

    For a Struct that replies or stored records share, which therefore stays lenient (old data may
    carry keys no longer read): what a client sends in that shape is checked here. Values of the
    wrong type are left to the decoder.
    """
    _refuse_unknown(raw, _type_info(type_), field)


@functools.lru_cache(maxsize=None)
def _type_info(type_: Any) -> inspect.Type:
    return inspect.type_info(type_)


@functools.lru_cache(maxsize=None)
def _holds_lenient(type_: Any) -> bool:
    """Whether a Struct that does not forbid unknown fields is part of `type_` (then `decode` walks)."""
    seen: set[type] = set()

    def lenient(info: inspect.Type) -> bool:
        if isinstance(info, inspect.StructType):
            if info.cls in seen:
                return False
            seen.add(info.cls)
            return not info.forbid_unknown_fields or any(lenient(f.type) for f in info.fields)
        if isinstance(info, _LISTS):
            return lenient(info.item_type)
        if isinstance(info, inspect.DictType):
            return lenient(info.value_type)
        if isinstance(info, inspect.UnionType):
            return any(lenient(member) for member in info.types)
        return False

    return lenient(_type_info(type_))


def _joined(field: str, key: object) -> str:
    return f"{field}.{key}" if field else str(key)


def _refuse_unknown(value: object, info: inspect.Type, field: str) -> None:
    if isinstance(info, inspect.StructType):
        if isinstance(value, dict):
            fields = {f.encode_name: f.type for f in info.fields}
            refuse_unknown_keys(value, fields.keys() | ({info.tag_field} if info.tag_field else set()), field)
            for key, item in value.items():
                if key in fields and isinstance(fields[key], _NESTING):
                    _refuse_unknown(item, fields[key], _joined(field, key))
    elif isinstance(info, _LISTS):
        if isinstance(value, list) and isinstance(info.item_type, _NESTING):
            for index, item in enumerate(value):
                _refuse_unknown(item, info.item_type, f"{field}[{index}]")
    elif isinstance(info, inspect.DictType):
        if isinstance(value, dict) and isinstance(info.value_type, _NESTING):
            for key, item in value.items():
                _refuse_unknown(item, info.value_type, _joined(field, key))
    elif isinstance(info, inspect.UnionType):
        member = _member(value, info)
        if member is not None:
            _refuse_unknown(value, member, field)


def _member(value: object, union: inspect.UnionType) -> inspect.Type | None:
    """The member of `union` that `value` decodes as, as far as keys go: a tagged Struct by its tag."""
    for member in union.types:
        if isinstance(member, inspect.StructType) and isinstance(value, dict):
            if member.tag_field is None or value.get(member.tag_field) == member.tag:
                return member
        elif isinstance(member, inspect.DictType) and isinstance(value, dict):
            return member
        elif isinstance(member, _LISTS) and isinstance(value, list):
            return member
    return None


def error_field(message: str, prefix: str = "", *, value: Any = _UNKNOWN, type_: Any = None) -> tuple[str, str]:
    """(field, reason) from a msgspec validation message; the one parser of msgspec's paths.

    `prefix` is the field the validated value sits at. The field is the whole path: `prefix.a.b[0]`;
    for a missing required key the key itself (`prefix.a.x`, "required field is missing"); for a bad
    map key the map (`prefix.a`, "map key: ..."). msgspec spells any map value `[...]`; given the
    `value` that failed and its `type_`, the map's real key takes its place (`prefix.cpu_map.3`), else
    the field ends at the map.
    """
    match = _AT.match(message)
    assert match is not None  # every part of the pattern is optional
    reason, path = match["reason"], match["path"] or ""
    if match["key"]:
        reason = f"map key: {reason}"
    if "[...]" in path:
        path = _with_map_keys(path, value, type_)
    field = (prefix + path).lstrip(".") or "$"
    if reason.startswith(("Object missing required field", _UNKNOWN_FIELD)):
        # "Object missing required field `x`", "... unknown field `x`": the key is the field, not its parent.
        key = reason.split("`")[1]
        field = f"{field}.{key}" if field != "$" else key
        reason = f"unknown key {key!r}" if reason.startswith(_UNKNOWN_FIELD) else "required field is missing"
    return field, in_words(reason)


def split_field(field: str) -> tuple[str, list[str]]:
    """A field path's first name and its steps, in the grammar `error_field` writes:
    `workloads_resource[0].cpu_map.3` -> ("workloads_resource", ["[0]", ".cpu_map", ".3"])."""
    head = field.split(".", 1)[0].split("[", 1)[0]
    rest = field[len(head) :]
    steps = [step.group() for step in _STEP.finditer(rest)]
    return head, steps if "".join(steps) == rest else [rest]


def _with_map_keys(path: str, value: Any, type_: Any) -> str:
    """`path` with each `[...]` replaced by `.key`, the first key of that map whose value fails (msgspec
    checks a map in order and stops at the first error); cut before a `[...]` whose key is not found."""
    resolved = ""
    for name, index in _STEP.findall(path):
        if index == "...":
            key = _failing_key(value, type_)
            if key is _UNKNOWN:
                break
            name, value, type_ = str(key), value[key], _item_type(type_, 1)
            resolved += f".{name}"
            continue
        resolved += f".{name}" if name else f"[{index}]"
        value, type_ = _step(value, type_, name, index)
    return resolved


def _failing_key(value: Any, type_: Any) -> Any:
    item_type = _item_type(type_, 1)
    if not isinstance(value, dict) or item_type is None:
        return _UNKNOWN
    for key, item in value.items():
        try:
            msgspec.convert(item, item_type)
        except msgspec.ValidationError:
            return key
    return _UNKNOWN


def _step(value: Any, type_: Any, name: str, index: str) -> tuple[Any, Any]:
    """The value and type one step (a Struct field `name`, or list item `index`) further down."""
    type_ = _plain(type_)
    if name and isinstance(value, dict) and isinstance(type_, type) and issubclass(type_, msgspec.Struct):
        fields = dict(zip(type_.__struct_encode_fields__, type_.__struct_fields__))
        try:
            field_type = typing.get_type_hints(type_, include_extras=True)[fields[name]]
        except (KeyError, NameError, TypeError):  # not a field, or an annotation that does not resolve
            return _UNKNOWN, None
        return value.get(name, _UNKNOWN), field_type
    if index.isdigit() and isinstance(value, list | tuple) and int(index) < len(value):
        args = typing.get_args(type_)
        fixed = typing.get_origin(type_) is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        return value[int(index)], _item_type(type_, int(index)) if fixed else _item_type(type_, 0)
    return _UNKNOWN, None


def _item_type(type_: Any, position: int) -> Any:
    """The type argument at `position` (a map's values are at 1, a list's items at 0), if any."""
    args = typing.get_args(_plain(type_))
    return args[position] if position < len(args) else None


def _plain(type_: Any) -> Any:
    """`type_` without `Annotated[...]` and without `| None`."""
    while True:
        origin = typing.get_origin(type_)
        if origin is typing.Annotated:
            type_ = typing.get_args(type_)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [arg for arg in typing.get_args(type_) if arg is not type(None)]
            if len(options) != 1:
                return type_
            type_ = options[0]
        else:
            return type_


def _untyped(data: bytes) -> Any:
    """The payload as plain builtins, to look map keys up in after a typed decode failed."""
    try:
        return msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return _UNKNOWN
