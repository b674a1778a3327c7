"""The gpu plugin (eru resource-gpu): whole cards counted per product.

Requests, workload resources, engine params and node capacity and usage all share one shape,
`{"prod_count_map": {"nvidia-3090": 4}}`. Counts of 0 are never stored: arithmetic drops them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, Raw, Shortfall
from services.allocation.plugins.kit import (
    MatrixUpdates,
    check_count,
    chosen_source,
    decode,
    encode,
    insufficient_resource,
    metric,
    metric_description,
    ratio,
    refuse_unknown_fields,
    safe_name,
)

# eru's capacity for a request that asks for no card: "a big number", not MAX_INT.
EMPTY_REQUEST_CAPACITY = 1_000_000

Counts = dict[str, int]


class GpuResource(msgspec.Struct, forbid_unknown_fields=False):
    prod_count_map: Counts = {}


class GpuPlugin(MatrixUpdates[Counts]):
    name = "gpu"
    priority = 100
    _record_shape = _workload_shape = GpuResource

    def add_node(self, resource: Raw | None, info: EngineInfo | None) -> tuple[Raw, Raw]:
        """The requested cards; without any, the cards the engine reports (eru)."""
        capacity = _node_counts(resource, "resource", delta=False) or {}
        if not capacity and info is not None and "gpu" in info.resources:
            capacity = _node_counts(info.resources["gpu"], "info.resources.gpu", delta=False) or {}
        _check_record(capacity, {})
        return _wire(capacity), _wire({})

    def calculate_deploy(
        self, capacity: Raw, usage: Raw, deploy_count: int, request: Raw | None
    ) -> tuple[list[Raw], list[Raw]]:
        count = check_count(deploy_count, "deploy_count")
        wanted = _request(request, "workload_resource_request", minimum=1)
        free = _free(*_record(capacity, usage))
        for product, cards in wanted.items():
            if cards * count > free.get(product, 0):
                raise insufficient_resource(
                    f"not enough {product}: {cards * count} cards wanted, {free.get(product, 0)} free",
                    product=product,
                    requested=cards * count,
                    available=free.get(product, 0),
                    unit="cards",
                )
        return [_wire(wanted) for _ in range(count)], [_wire(wanted) for _ in range(count)]

    def engine_params(self, workload_resource: Raw) -> Raw:
        return _wire(_counts(workload_resource, "workload_resource", minimum=None))  # the cards it holds

    def deploy_capacity(self, capacity: Raw, usage: Raw, request: Raw | None) -> DeployCapacity:
        wanted = _request(request, "workload_resource_request", minimum=1)
        cap, used = _record(capacity, usage)
        free = _free(cap, used)
        fits = min((free.get(p, 0) // cards for p, cards in wanted.items()), default=EMPTY_REQUEST_CAPACITY)
        card_total = sum(cap.values())
        return DeployCapacity(
            capacity=fits,
            usage=ratio(sum(used.values()), card_total),
            rate=ratio(sum(wanted.values()), card_total),
            weight=1.0,
        )

    def shortfalls(self, capacity: Raw, usage: Raw, request: Raw | None, count: int) -> dict[str, Shortfall]:
        """`gpu`: the most cards of one product that `count` instances miss on the node."""
        wanted = _request(request, "workload_resource_request", minimum=1)
        free = _free(*_record(capacity, usage))
        missing = max((cards * count - max(free.get(p, 0), 0) for p, cards in wanted.items()), default=0)
        return {"gpu": Shortfall(min(missing, MAX_INT), "cards")} if missing > 0 else {}

    def calculate_realloc(
        self, capacity: Raw, usage: Raw, workload_resource: Raw, request: Raw | None
    ) -> tuple[Raw, Raw, Raw]:
        """eru's delta realloc: counts add to the current ones; one ending at 0 or below is dropped."""
        cap, used = _record(capacity, usage)
        current = _counts(workload_resource, "workload_resource", minimum=1)
        delta = _request(request, "workload_resource_request", minimum=None)
        wanted = {product: cards for product, cards in _sum(current, delta, 1).items() if cards > 0}
        returned = _sum(used, current, -1)
        if any(cards < 0 for cards in returned.values()):
            raise InvalidArgument(
                "workload_resource.prod_count_map", "holds more cards than the node's usage"
            )
        free = _free(cap, returned)
        short = [product for product, cards in wanted.items() if cards > free.get(product, 0)]
        if short:
            wants = ", ".join(f"{wanted[p]} {p} cards wanted, {max(free.get(p, 0), 0)} free" for p in short)
            raise insufficient_resource(
                f"not enough {', '.join(short)}: {wants}", products=short, unit="cards"
            )
        return _wire(wanted), _wire(_sum(wanted, current, -1)), _wire(wanted)

    def calculate_remap(self, capacity: Raw, usage: Raw, workloads: dict[str, Raw]) -> dict[str, Raw]:
        return {}  # cards are never remapped (eru)

    # set-node-resource-capacity and -usage, apply_workloads and usage_from_workloads (eru §2.12) are
    # MatrixUpdates'; these are their gpu steps.
    _empty = dict

    def _combine(self, a: Counts, b: Counts, sign: int) -> Counts:
        return _sum(a, b, sign)

    def _record(self, capacity: Raw, usage: Raw) -> tuple[Counts, Counts]:
        return _record(capacity, usage)

    def _capacity_sources(
        self, capacity: Counts, resource: Raw | None, request: Raw | None, delta: bool
    ) -> tuple[Counts, list[Counts]]:
        requested = _node_counts(request, "resource_request", delta)
        if not delta and request is not None and "prod_count_map" not in request:
            requested = capacity  # an absolute request keeps what it leaves out (eru's LoadFromOrigin)
        return capacity, chosen_source(requested, _node_counts(resource, "resource", delta), [])

    def _settled_capacity(self, capacity: Counts, usage: Counts, delta: bool) -> tuple[Raw, Raw]:
        _check_record(capacity, usage)
        return _wire(capacity), _wire(usage)

    def _usage_sources(
        self, resource: Raw | None, request: Raw | None, workloads: list[Raw], delta: bool
    ) -> list[Counts]:
        requested = _node_counts(request, "resource_request", delta)
        return chosen_source(requested, _node_counts(resource, "resource", delta), self._holdings(workloads))

    def _settled_usage(self, capacity: Counts, usage: Counts) -> Raw:
        _check_record(capacity, usage)
        return _wire(usage)

    def _holding(self, raw: object, field: str) -> Counts:
        """A workload's cards; a realloc delta (negative counts) is a workload resource too."""
        return _counts(raw, field, minimum=None)

    def _usage(self, usage: Raw) -> Counts:
        return _usage(usage)

    def _applied_usage(self, usage: Counts) -> Raw:
        _check_counts(usage, "usage", minimum=1)
        return _wire(usage)

    def _usage_shape(self, capacity: Raw) -> Callable[[Counts], Raw]:
        """Cards used are just their counts: the capacity is not read (nor refused)."""
        return _wire

    def diffs(self, capacity: Raw, usage: Raw, workloads: list[Raw]) -> list[str]:
        """eru's diffs: the card total first, then each product (ascending) the workloads do not explain."""
        _, used = _record(capacity, usage)
        explained = self._explained(workloads)
        diffs = []
        if sum(used.values()) != sum(explained.values()):
            diffs.append(
                f"node.GPUUsed != sum(workload.GPURequest): {sum(used.values())} != {sum(explained.values())}"
            )
        for product in sorted(used.keys() | explained.keys()):
            if product not in used:
                diffs.append(f"{product} not in usage")
            elif used[product] != explained.get(product, 0):
                diffs.append(f"{product}: actual({explained.get(product, 0)}) != usage({used[product]})")
        return diffs

    def load(self, capacity: Raw, usage: Raw) -> float:
        """Used cards over all cards; a node without cards reads as idle (eru)."""
        cap, used = _record(capacity, usage)
        return ratio(sum(used.values()), sum(cap.values()))

    def metrics_description(self) -> list[Raw]:
        labels = ["podname", "nodename", "product"]
        return [
            metric_description("gpu_capacity", "node available gpu.", labels),
            metric_description("gpu_used", "node used gpu.", labels),
        ]

    def metrics(self, podname: str, nodename: str, capacity: Raw, usage: Raw) -> list[Raw]:
        """One capacity and one used gauge per product of the node (used 0 included, so gauges fall back).

        eru keys every product under the same `core.node.<node>.gpu.capacity`; berth's keys are distinct.
        """
        cap, used = _record(capacity, usage)
        prefix = f"core.node.{safe_name(nodename)}.gpu"
        entries = [("gpu_capacity", "capacity", cap), ("gpu_used", "used", used)]
        return [
            metric(
                name,
                [podname, nodename, product],
                f"{prefix}.{safe_name(product)}.{suffix}",
                counts.get(product, 0),
            )
            for name, suffix, counts in entries
            for product in sorted(cap)
        ]


def _counts(raw: object, field: str, *, minimum: int | None) -> Counts:
    """A prod_count_map, products sorted, checked: named products and counts of at least `minimum`."""
    _check_count_types(raw, field)
    counts = decode(raw, GpuResource, field).prod_count_map
    _check_counts(counts, field, minimum=minimum)
    return dict(sorted(counts.items()))


def _request(raw: object, field: str, *, minimum: int | None) -> Counts:
    """A prod_count_map a client sends: `_counts`, and a key other than `prod_count_map` is refused
    (stored records decode leniently)."""
    refuse_unknown_fields(raw, GpuResource, field)
    return _counts(raw, field, minimum=minimum)


def _node_counts(raw: object, field: str, delta: bool) -> Counts | None:
    """A node request or resource: None when absent; counts may be negative only in a delta."""
    if raw is None:
        return None
    return {p: cards for p, cards in _request(raw, field, minimum=None if delta else 0).items() if cards}


def _check_count_types(raw: object, field: str) -> None:
    """Name the product whose count is not a whole number (a decoder names only the map)."""
    counts = raw.get("prod_count_map") if isinstance(raw, dict) else None
    for product, cards in counts.items() if isinstance(counts, dict) else ():
        integral = isinstance(cards, int) or (isinstance(cards, float) and math.isfinite(cards) and cards.is_integer())
        if isinstance(cards, bool) or not integral:
            raise InvalidArgument(f"{field}.prod_count_map.{product}", f"a card count must be an integer, got {cards!r}")


def _check_counts(counts: Counts, field: str, *, minimum: int | None) -> None:
    for product, cards in counts.items():
        where = f"{field}.prod_count_map.{product}"
        if not product.strip():
            raise InvalidArgument(f"{field}.prod_count_map", "a gpu product must be named")
        if minimum is not None and cards < minimum:
            raise InvalidArgument(where, f"must be at least {minimum}, got {cards}")
        if abs(cards) > MAX_INT:
            raise InvalidArgument(where, f"{cards} is larger than {MAX_INT}")


def _check_record(capacity: Counts, usage: Counts) -> None:
    """Stored counts are positive, and no product is used beyond its capacity (eru checks only the former)."""
    _check_counts(capacity, "capacity", minimum=1)
    _check_counts(usage, "usage", minimum=1)
    for product, cards in usage.items():
        if cards > capacity.get(product, 0):
            raise InvalidArgument(
                f"usage.prod_count_map.{product}",
                f"{cards} used exceeds the capacity {capacity.get(product, 0)}",
            )


def _record(capacity: Raw, usage: Raw) -> tuple[Counts, Counts]:
    cap, used = _counts(capacity, "capacity", minimum=None), _usage(usage)
    _check_record(cap, used)
    return cap, used


def _usage(usage: Raw) -> Counts:
    return _counts(usage, "usage", minimum=None)


def _sum(a: Counts, b: Counts, sign: int) -> Counts:
    """a + sign * b per product, dropping products that reach 0 (eru's Add/Sub), sorted by product."""
    summed = dict(a)
    for product, cards in b.items():
        summed[product] = summed.get(product, 0) + sign * cards
    return {product: cards for product, cards in sorted(summed.items()) if cards}


def _free(capacity: Counts, usage: Counts) -> Counts:
    return {product: cards - usage.get(product, 0) for product, cards in capacity.items()}


def _wire(counts: Counts) -> Raw:
    return encode(GpuResource(counts))
