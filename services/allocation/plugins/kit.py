"""Small pieces every resource plugin shares: strict decoding, errors, eru's set-* matrix, metrics.

Kept plugin-agnostic: nothing here knows a resource's shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

# The plugins refuse unknown keys in their maps as the bus refuses them in a request (DESIGN.md §8).
from bus.codec import invalid_argument_from, refuse_unknown_fields, refuse_unknown_keys  # noqa: F401
from schemas.errors import BerthError, InvalidArgument
from services.allocation.plugins.interface import Raw

T = TypeVar("T")
N = TypeVar("N")  # a plugin's typed node resource (capacity or usage)


def decode(raw: object, typ: type[T], field: str) -> T:
    """A typed Struct from a wire map; an absent value is the empty resource.

    Integral floats count as integers (DESIGN.md §8: byte sizes accept them); anything else that does not
    fit the type is `invalid_argument` naming the offending path, e.g. `usage.disks[0].read_IOPS`.
    """
    if raw is None:
        return typ()
    if not isinstance(raw, dict):
        raise InvalidArgument(field, f"must be a map, got {type(raw).__name__}")
    try:
        value = _integral_floats_as_ints(raw)
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        raise invalid_argument_from(exc, field, value=value, type_=typ) from None


def decode_each(
    workloads: object, parse: Callable[[object, str], T], field: str = "workloads_resource"
) -> list[T]:
    """A list of workload resources, each parsed under its own path (`workloads_resource[2]...`)."""
    if not isinstance(workloads, list):
        raise InvalidArgument(field, f"must be a list, got {type(workloads).__name__}")
    return [parse(raw, f"{field}[{index}]") for index, raw in enumerate(workloads)]


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    return value


def encode(value: msgspec.Struct) -> Raw:
    """The wire map of a Struct (MessagePack builtins only)."""
    return msgspec.to_builtins(value)


def field_error(code: str, field: str, reason: str) -> BerthError:
    """A validation error with a domain code (`invalid_volume`, `invalid_storage`, ...) naming the field."""
    return BerthError(f"{field}: {reason}", code=code, field=field)


def recoded(code: str, parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a strict parser, reporting its `invalid_argument` under a domain code instead."""
    try:
        return parse(*args, **kwargs)
    except InvalidArgument as exc:
        raise BerthError(exc.message, code=code, details=exc.details) from None


def insufficient_resource(message: str, **details: Any) -> BerthError:
    """What any storage or gpu shortfall raises, deploy and realloc alike (eru's ErrInsufficientResource;
    only cpumem's deploy and unbound realloc answer `insufficient_capacity`)."""
    return BerthError(message, code="insufficient_resource", details=details)


def check_count(value: object, field: str, *, minimum: int = 0) -> int:
    """A count such as `deploy_count`: an integer (not a boolean) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(field, f"must be an integer of at least {minimum}, got {value!r}")
    return value


def check_flags(**flags: object) -> None:
    """Booleans are booleans (DESIGN.md §8): `delta`, `incr` and the like."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgument(name, f"must be a boolean, got {value!r}")


def ratio(part: float, whole: float) -> float:
    """eru's AdvancedDivide: 0 when either side is 0, so empty nodes read as idle instead of failing."""
    return 0.0 if part == 0 or whole == 0 else part / whole


def chosen_source(request: T | None, resource: T | None, workloads: Sequence[T]) -> list[T]:
    """eru's source priority for set-* operations: the request, else the resource, else every workload."""
    if request is not None:
        return [request]
    if resource is not None:
        return [resource]
    return list(workloads)


def apply_matrix(
    origin: T, sources: Sequence[T], *, empty: T, delta: bool, incr: bool, combine: Callable[[T, T, int], T]
) -> T:
    """eru's calculateNodeResource: a delta adds (incr) or subtracts the sources from `origin`.

    An absolute write starts from `empty` and always adds: subtracting from nothing would store negated
    values (eru forces incr for the same reason). `combine(a, b, sign)` is a + sign * b.
    """
    result, sign = (origin, 1 if incr else -1) if delta else (empty, 1)
    for source in sources:
        result = combine(result, source, sign)
    return result


class MatrixUpdates(Generic[N]):
    """set-node-resource-capacity and -usage, the same steps for every plugin (eru §2.12): the flags
    are booleans, the record is read, one input is chosen by priority (request > resource > workloads),
    the delta/incr matrix runs over the capacity or the usage, and the plugin settles the result.
    apply_workloads and usage_from_workloads are the same matrix run over the workloads' holdings.

    A plugin supplies the steps that know its shape: `_record` (capacity and usage, decoded and
    checked), `_capacity_sources` and `_usage_sources` (the chosen input), `_empty` and `_combine` (for
    `apply_matrix`), and `_settled_capacity` and `_settled_usage` (the new record completed, checked,
    and encoded). For the workload sums: `_holding` (what one workload holds), `_usage` (a usage decoded
    alone), `_applied_usage` (apply_workloads' result checked and encoded), `_usage_shape` (the explained
    usage written for a capacity) and, when it charges differently, `_charges`. For what a client sends
    in a stored shape: `_record_shape` and `_workload_shape` (the Structs whose keys are accepted)
    and, when `_record` does not check while decoding, `_validate`.
    """

    _empty: Callable[[], N]
    _combine: Callable[[N, N, int], N]
    _record_shape: type  # a capacity or usage as the plugin stores it
    _workload_shape: type  # a workload resource as the plugin stores it

    def check_workload_keys(self, workload: Raw | None, field: str) -> None:
        """Refuse a key a client's workload resource has that this plugin does not read (a ledger's
        resources stay lenient: they are never checked here)."""
        refuse_unknown_fields(workload, self._workload_shape, field)

    def validate_record(self, capacity: Raw, usage: Raw) -> None:
        """A record a client gives to be stored as is: unknown keys are refused too."""
        refuse_unknown_fields(capacity, self._record_shape, "capacity")
        refuse_unknown_fields(usage, self._record_shape, "usage")
        self._validate(*self._record(capacity, usage))

    def _validate(self, capacity: N, usage: N) -> None:
        """Check a decoded record beyond what `_record` checks (nothing, unless a plugin says so)."""

    def set_capacity(
        self, capacity: Raw, usage: Raw, resource: Raw | None, request: Raw | None, delta: bool, incr: bool
    ) -> tuple[Raw, Raw]:
        check_flags(delta=delta, incr=incr)
        node_capacity, node_usage = self._record(capacity, usage)
        origin, sources = self._capacity_sources(node_capacity, resource, request, delta)
        after = self._matrix(origin, sources, delta, incr)
        return self._settled_capacity(after, node_usage, delta)

    def set_usage(
        self,
        capacity: Raw,
        usage: Raw,
        resource: Raw | None,
        request: Raw | None,
        workloads: list[Raw],
        delta: bool,
        incr: bool,
    ) -> Raw:
        check_flags(delta=delta, incr=incr)
        node_capacity, node_usage = self._record(capacity, usage)
        sources = self._usage_sources(resource, request, workloads, delta)
        return self._settled_usage(node_capacity, self._matrix(node_usage, sources, delta, incr))

    def apply_workloads(self, usage: Raw, workloads: list[Raw], incr: bool) -> Raw:
        """Usage plus (incr) or minus the workloads' holdings (commit and release): a delta update whose
        sources are the workloads, refused by `_applied_usage` if it goes negative or invalid.

        The workloads are decoded before the usage, so a bad workload is the error reported first.
        """
        check_flags(incr=incr)
        charges = self._charges(self._holdings(workloads))
        return self._applied_usage(self._matrix(self._usage(usage), charges, True, incr))

    def usage_from_workloads(self, capacity: Raw, workloads: list[Raw]) -> Raw:
        """The usage the workloads explain (fix-node-resource): their total, written for the capacity. It is
        not checked: it states what the workloads hold, which a repair must be able to write back."""
        shape = self._usage_shape(capacity)  # the capacity is decoded before the workloads
        return shape(self._explained(workloads))

    def _holdings(self, workloads: list[Raw]) -> list[N]:
        """Each workload's holding, in order, decoded under its own path (`workloads_resource[2]...`)."""
        return decode_each(workloads, self._holding)

    def _explained(self, workloads: list[Raw]) -> N:
        """The usage the workloads account for: the total of their holdings."""
        return self._total(self._holdings(workloads))

    def _total(self, holdings: list[N]) -> N:
        """The holdings added up from the empty resource (an absolute write of them)."""
        return self._matrix(self._empty(), holdings, False, True)

    def _charges(self, holdings: list[N]) -> list[N]:
        """What apply_workloads adds to or takes from the usage, in order: each holding by default, so
        that no workloads leave the usage exactly as decoded."""
        return holdings

    def _matrix(self, origin: N, sources: list[N], delta: bool, incr: bool) -> N:
        empty, combine = self._empty(), self._combine
        return apply_matrix(origin, sources, empty=empty, delta=delta, incr=incr, combine=combine)

    def _record(self, capacity: Raw, usage: Raw) -> tuple[N, N]:
        raise NotImplementedError

    def _capacity_sources(
        self, capacity: N, resource: Raw | None, request: Raw | None, delta: bool
    ) -> tuple[N, list[N]]:
        """The capacity the matrix starts from (a plugin may drop parts first) and the chosen input."""
        raise NotImplementedError

    def _settled_capacity(self, capacity: N, usage: N, delta: bool) -> tuple[Raw, Raw]:
        raise NotImplementedError

    def _usage_sources(
        self, resource: Raw | None, request: Raw | None, workloads: list[Raw], delta: bool
    ) -> list[N]:
        raise NotImplementedError

    def _settled_usage(self, capacity: N, usage: N) -> Raw:
        raise NotImplementedError

    def _holding(self, raw: object, field: str) -> N:
        """What one workload resource holds of the node, as a node resource (a realloc delta is one too)."""
        raise NotImplementedError

    def _usage(self, usage: Raw) -> N:
        """A stored usage decoded alone (no capacity to check it against), as `usage`."""
        raise NotImplementedError

    def _applied_usage(self, usage: N) -> Raw:
        """The usage after apply_workloads, checked on its own (nothing negative or malformed) and encoded."""
        raise NotImplementedError

    def _usage_shape(self, capacity: Raw) -> Callable[[N], Raw]:
        """How a sum of holdings is written as the usage of a node with this capacity (decoded here)."""
        raise NotImplementedError


def safe_name(name: str) -> str:
    """A node or product name made safe for a dotted statsd key."""
    return name.replace(".", "_")


def metric_description(name: str, help_text: str, labels: list[str]) -> Raw:
    return {"name": name, "help": help_text, "type": "gauge", "labels": labels}


def metric(name: str, labels: list[str], key: str, value: int | float) -> Raw:
    return {"name": name, "labels": labels, "key": key, "value": value}
