"""Volume binding strings: `src:dst[:flags][:size][:readIOPS:writeIOPS:readBPS:writeBPS]` (eru §3.1).

A source ending in `AUTO` (or empty) asks the scheduler to pick a volume of the node; any other source
is a path mounted as is. Flags are single letters: `r`, `w`, `m` (monopoly: the whole device), `o`.
"""

from __future__ import annotations

import msgspec

from schemas.errors import InvalidArgument
from schemas.sizes import parse_size
from services.allocation.plugins.kit import field_error
from services.allocation.plugins.storage.types import IO

AUTO = "AUTO"
_IO_PARTS = ("read IOPS", "write IOPS", "read BPS", "write BPS")  # parts 5 to 8, in order


class VolumeBinding(msgspec.Struct, frozen=True):
    source: str
    destination: str
    flags: str
    size: int = 0
    io: IO = IO()

    @property
    def key(self) -> tuple[str, str, str]:
        """eru's identity of a binding: the same mount, whatever its size or IO."""
        return (self.source, self.destination, self.flags)

    @property
    def requires_schedule(self) -> bool:
        return self.source.endswith(AUTO) or self.source == ""

    @property
    def monopoly(self) -> bool:
        return self.requires_schedule and "m" in self.flags

    @property
    def unlimited(self) -> bool:
        """An AUTO binding that asks for nothing: it shares the emptiest volume at size 0."""
        return self.requires_schedule and self.size == 0 and not self.io.nonzero()

    @property
    def requires_io(self) -> bool:
        return self.io.any()

    @property
    def needs_planning(self) -> bool:
        """Whether a node's volumes or disks must be consulted to place this binding."""
        return self.requires_schedule or self.requires_io

    def full(self) -> str:
        """The form used in stored workloads and as volume-plan keys; it parses back to the same binding."""
        return f"{self.source}:{self.destination}:{self.flags}:{self.size}:{self.io.render()}"

    def engine_form(self) -> str:
        """What the engine receives: no `m`, `o` spelled out as `ro`/`wo`, and only the parts that matter."""
        flags = self.flags.replace("m", "")
        if "o" in flags:
            flags = flags.replace("o", "").replace("r", "ro").replace("w", "wo")
        if self.io.nonzero():
            return f"{self.source}:{self.destination}:{flags}:{self.size}:{self.io.render()}"
        if not flags and self.size == 0:
            return f"{self.source}:{self.destination}"
        return f"{self.source}:{self.destination}:{flags}:{self.size}"

    def placed(self, device: str, planned_size: int) -> VolumeBinding:
        """This binding on its scheduled device: that device as source, a size at least the plan's."""
        return msgspec.structs.replace(self, source=device, size=max(self.size, planned_size))

    def plus(self, other: VolumeBinding) -> VolumeBinding:
        """Sizes and IO added: how a realloc delta changes a binding with the same key."""
        return msgspec.structs.replace(self, size=self.size + other.size, io=self.io + other.io)


def parse_binding(text: object, field: str, *, delta: bool = False) -> VolumeBinding:
    """A binding from its string. Sizes and IO values may be negative only in a delta (realloc) request.

    Problems with the binding are `invalid_volume`; a bad IO value is `invalid_argument`.
    """
    if not isinstance(text, str):
        raise field_error("invalid_volume", field, f"a volume must be a string, got {type(text).__name__}")
    parts = text.split(":")
    if not 2 <= len(parts) <= 8:
        raise field_error(
            "invalid_volume", field,
            f"{text!r} should be '<source>:<destination>' with optionally ':<flags>:<size>' and four IO "
            "limits after it (2 to 8 ':'-separated parts), such as 'AUTO:/data:rw:10G'",
        )
    source, destination, *rest = parts
    if not destination:
        raise field_error("invalid_volume", field, f"{text!r} has no destination")
    flags = "".join(sorted(rest[0])) if rest else ""
    size = _number(rest[1], field, "size", delta, "invalid_volume") if len(rest) > 1 else 0
    io_parts = zip(rest[2:], _IO_PARTS, strict=False)  # missing parts are 0
    io = IO(*(_number(part, field, name, delta, "invalid_argument") for part, name in io_parts))
    return VolumeBinding(source, destination, flags or "rw", size, io)


def _number(text: str, field: str, part: str, delta: bool, code: str) -> int:
    """One numeric part of a binding; the error says which part was wrong."""
    try:
        return parse_size(text, field, allow_negative=delta)
    except InvalidArgument as exc:
        raise field_error(code, field, f"{part}: {exc.message.removeprefix(field + ': ')}") from None


def parse_bindings(values: object, field: str, *, delta: bool = False) -> list[VolumeBinding]:
    if not isinstance(values, list):
        raise field_error(
            "invalid_volume", field, f"must be a list of volume strings, got {type(values).__name__}"
        )
    return [parse_binding(value, f"{field}[{index}]", delta=delta) for index, value in enumerate(values)]


def merge_bindings(delta: list[VolumeBinding], current: list[VolumeBinding]) -> list[VolumeBinding]:
    """eru's MergeVolumeBindings: bindings with the same key add up; one that ends below size 0 is dropped."""
    merged: dict[tuple[str, str, str], VolumeBinding] = {}
    for binding in current + delta:
        merged[binding.key] = merged[binding.key].plus(binding) if binding.key in merged else binding
    return sorted((b for b in merged.values() if b.size >= 0), key=lambda b: b.key)
