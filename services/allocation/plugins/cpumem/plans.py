"""CPU binding plans: eru's GetCPUPlans (reference §2.7), on plain integers.

A *plan* is the cpuset of one instance: a list of (core id, pieces). One call returns plans that
are mutually consistent, so applying all of them together never over-allocates a core or memory.

Vocabulary. A core has `share_base` pieces per CPU (100 by default; an oversold core has a multiple).
A request of 1.7 CPUs is 170 pieces: `full` = 1 whole core plus a `fragment` of 70 pieces.
An available core is a *full core* when its free pieces are a non-zero multiple of share_base,
else a *fragment core* when it has any free pieces. Full plans take `full` distinct full cores at
share_base pieces each; fragment plans take `fragment` pieces of one fragment core. Converting a
full core into a fragment core trades full plans for fragment plans; the planner converts the
most loaded full cores while that strictly raises the number of complete plans, up to `max_share`
fragment cores on the node.

Cores are handled as (free pieces, core id) tuples: sorting them puts the most loaded cores first,
which keeps idle cores whole. Ties go by numeric core id (eru compares ids as strings).
"""

from __future__ import annotations

import heapq

import msgspec

from schemas.sizes import MAX_INT

Core = tuple[int, int]  # (free pieces, core id)
Plan = list[tuple[int, int]]  # [(core id, pieces)], ascending core id


class PlanRequest(msgspec.Struct, frozen=True):
    """The shape of one instance, in pieces; `memory` caps the plan count (0: no cap)."""

    full: int
    fragment: int
    memory: int
    share_base: int
    max_share: int  # -1: no limit on fragment cores

    @classmethod
    def of(cls, cpu_request: float, memory_request: int, share_base: int, max_share: int) -> PlanRequest:
        pieces = int(cpu_request * share_base)  # truncation, as eru: 0.29 CPUs on 100 pieces is 28
        full, fragment = divmod(pieces, share_base)
        return cls(full, fragment, memory_request, share_base, max_share)

    @property
    def pieces(self) -> int:
        return self.full * self.share_base + self.fragment


class NodeAvailability(msgspec.Struct):
    """What is free on a node: pieces per core, memory, and memory per NUMA node."""

    cores: dict[int, int]
    memory: int
    numa_memory: dict[int, int]
    numa_cores: dict[int, list[int]]  # NUMA node -> its core ids, both ascending


class CpuPlan(msgspec.Struct):
    """One instance's cores, and the NUMA node they all belong to."""

    numa_node: int | None  # None for a plan that spans NUMA nodes
    cores: Plan


def cpu_plans(
    node: NodeAvailability,
    request: PlanRequest,
    origin: dict[int, int] | None = None,
    limit: int | None = None,
) -> list[CpuPlan]:
    """Plans for `request`: NUMA-local ones first (NUMA ids ascending), then cross-NUMA ones.

    `origin` is a realloc's current binding (cores it holds are preferred). `limit` stops once that
    many plans exist; the plans returned are then a prefix of the unlimited answer.
    """
    free = dict(node.cores)
    memory = node.memory
    plans: list[CpuPlan] = []
    for numa_node, core_ids in node.numa_cores.items():
        if limit is not None and len(plans) >= limit:
            return plans
        # Unbound workloads take total memory but no NUMA memory, so the total bounds a NUMA node too.
        numa_memory = node.numa_memory.get(numa_node, 0)
        cap = _memory_cap(min(numa_memory, memory), request.memory)
        local = plan_cores([(free[core], core) for core in core_ids], request, origin)[:cap]
        for plan in local:
            for core, pieces in plan:
                free[core] -= pieces
        memory -= len(local) * request.memory
        plans.extend(CpuPlan(numa_node, plan) for plan in local)
    if limit is not None and len(plans) >= limit:
        return plans
    cap = _memory_cap(memory, request.memory)
    cross = plan_cores([(pieces, core) for core, pieces in free.items()], request, origin)[:cap]
    plans.extend(CpuPlan(None, plan) for plan in cross)
    return plans


def count_cpu_plans(node: NodeAvailability, request: PlanRequest) -> int:
    """len(cpu_plans(node, request)), mostly without building the plans (deploy capacity's fast path).

    Each NUMA pass is counted arithmetically. Only when the pieces and memory left over might still
    form a cross-NUMA plan do we need to know *which* pieces were taken, and build the plans.
    """
    total = 0
    memory = node.memory
    for numa_node, core_ids in node.numa_cores.items():
        cap = _memory_cap(min(node.numa_memory.get(numa_node, 0), memory), request.memory)
        count = min(count_core_plans([(node.cores[core], core) for core in core_ids], request), cap)
        total += count
        memory -= count * request.memory
    if node.numa_cores:
        pieces_left = sum(pieces for pieces in node.cores.values() if pieces > 0) - total * request.pieces
        if pieces_left < request.pieces or _memory_cap(memory, request.memory) == 0:
            return total
        return len(cpu_plans(node, request))
    cores = [(pieces, core) for core, pieces in node.cores.items()]
    return min(count_core_plans(cores, request), _memory_cap(memory, request.memory))


def plan_cores(cores: list[Core], request: PlanRequest, origin: dict[int, int] | None = None) -> list[Plan]:
    """Plans on one set of cores, ignoring memory (eru's host.getCPUPlans)."""
    full, fragment, share_base = request.full, request.fragment, request.share_base
    if full == 0 and fragment == 0:
        return []  # a request below one piece
    full_cores, fragment_cores = _classify(cores, share_base)
    affinity = bool(origin)
    if affinity:
        full_cores, fragment_cores = _reorder_by_affinity(full_cores, fragment_cores, origin, share_base)
    full_plans = _full_plans_in_order if affinity else _full_plans_by_heap
    if fragment == 0:
        return [
            [(core, share_base) for core in sorted(plan)] for plan in full_plans(full_cores, full, share_base)
        ]
    if full == 0:
        moved = _max_moved(full_cores, fragment_cores, request)
        fragment_ids = _fragment_plans(fragment_cores + full_cores[:moved], fragment)
        return [[(core, fragment)] for core in fragment_ids]
    moved, capacity = _best_split(full_cores, fragment_cores, request, affinity)
    full_ids = full_plans(full_cores[moved:], full, share_base)[:capacity]
    fragment_ids = _fragment_plans(fragment_cores + full_cores[:moved], fragment, capacity)
    return [
        sorted([(core, share_base) for core in whole] + [(part, fragment)])
        for whole, part in zip(full_ids, fragment_ids, strict=True)
    ]


def count_core_plans(cores: list[Core], request: PlanRequest) -> int:
    """len(plan_cores(cores, request)) without building a plan."""
    full, fragment, share_base = request.full, request.fragment, request.share_base
    if full == 0 and fragment == 0:
        return 0
    full_cores, fragment_cores = _classify(cores, share_base)
    if fragment == 0:
        return count_full_plans([pieces // share_base for pieces, _ in full_cores], full)
    if full == 0:
        moved = _max_moved(full_cores, fragment_cores, request)
        return sum(pieces // fragment for pieces, _ in fragment_cores + full_cores[:moved])
    return _best_split(full_cores, fragment_cores, request, affinity=False)[1]


def count_full_plans(units: list[int], full: int) -> int:
    """How many plans of `full` distinct cores the heap builds from cores with `units` whole CPUs free.

    `units` must be ascending (full cores are sorted by load). Taking the `full` cores with the most
    units each round is optimal, and the optimum is the largest t with sum(min(u, t)) >= full * t.
    That holds iff for every j < full the units outside the j largest cores fill the other
    full - j places of t plans: t <= rest_j // (full - j).
    """
    if len(units) < full:
        return 0
    rest = sum(units)
    best = rest // full
    for j in range(1, full):
        rest -= units[-j]
        best = min(best, rest // (full - j))
    return best


def _classify(cores: list[Core], share_base: int) -> tuple[list[Core], list[Core]]:
    """(full cores, fragment cores), each most loaded first; cores with nothing free are dropped."""
    full_cores = []
    fragment_cores = []
    for core in cores:
        pieces = core[0]
        if pieces >= share_base and pieces % share_base == 0:
            full_cores.append(core)
        elif pieces > 0:  # a 0-piece core is not a fragment core (eru PR #501)
            fragment_cores.append(core)
    full_cores.sort()
    fragment_cores.sort()
    return full_cores, fragment_cores


def _reorder_by_affinity(
    full_cores: list[Core], fragment_cores: list[Core], origin: dict[int, int], share_base: int
) -> tuple[list[Core], list[Core]]:
    """Move the cores a realloc'd workload already holds to the front, in the order of its own binding.

    The origin's cores are classified like available ones: its whole cores lead the full list, its
    fragment cores lead the fragment list. The sort is stable, so other cores keep their order.
    """
    held_full, held_fragment = _classify([(pieces, core) for core, pieces in origin.items()], share_base)
    return _held_first(full_cores, held_full), _held_first(fragment_cores, held_fragment)


def _held_first(cores: list[Core], held: list[Core]) -> list[Core]:
    rank = {core: position for position, (_, core) in enumerate(held)}
    return sorted(cores, key=lambda item: rank.get(item[1], len(rank)))


def _max_moved(full_cores: list[Core], fragment_cores: list[Core], request: PlanRequest) -> int:
    """How many full cores may become fragment cores: up to max_share fragment cores in all.

    A node never needs more fragment cores than the cores left after the full part of one plan.
    A max_share below the fragment cores already there means no conversion (eru would panic).
    """
    limit = len(full_cores) + len(fragment_cores) - request.full
    if request.max_share >= 0:
        limit = min(limit, request.max_share)
    return max(min(limit - len(fragment_cores), len(full_cores)), 0)


def _best_split(
    full_cores: list[Core], fragment_cores: list[Core], request: PlanRequest, affinity: bool
) -> tuple[int, int]:
    """(how many of the most loaded full cores to convert into fragment cores, plans that gives).

    Converting a core adds its fragment plans and can only lower the full plans, so the plan count
    min(full, fragment) rises until the fragment side catches up and falls after; the first best
    split wins ties. The in-order scheme used with affinity is not provably monotone, so with
    affinity every split is tried, as eru does.
    """
    full, fragment, share_base = request.full, request.fragment, request.share_base
    units = [pieces // share_base for pieces, _ in full_cores]
    fragment_capacity = sum(pieces // fragment for pieces, _ in fragment_cores)
    best_moved, best = 0, -1
    for moved in range(_max_moved(full_cores, fragment_cores, request) + 1):
        if moved:
            fragment_capacity += full_cores[moved - 1][0] // fragment
        if affinity:
            full_capacity = len(_full_plans_in_order(full_cores[moved:], full, share_base))
        else:
            full_capacity = count_full_plans(units[moved:], full)
        capacity = min(full_capacity, fragment_capacity)
        if capacity > best:
            best_moved, best = moved, capacity
        if fragment_capacity >= full_capacity and not affinity:
            break
    return best_moved, best


def _full_plans_by_heap(cores: list[Core], full: int, share_base: int) -> list[list[int]]:
    """Plans of `full` core ids: repeatedly take the `full` cores with the most free pieces.

    Afterwards plans are ordered by the summed positions of their cores in `cores`, so plans on
    loaded cores come first (eru sorts unstably; ties here keep the order of construction).
    """
    if full == 1:
        # The heap would turn every free CPU into a plan ranked by its core's position: skip it.
        return [[core] for pieces, core in cores for _ in range(pieces // share_base)]
    heap = [(-pieces, -core, position) for position, (pieces, core) in enumerate(cores)]
    heapq.heapify(heap)
    ranked: list[tuple[int, int, list[int]]] = []
    while len(heap) >= full:
        picked = [heapq.heappop(heap) for _ in range(full)]
        ranked.append((sum(entry[2] for entry in picked), len(ranked), [-entry[1] for entry in picked]))
        for negative_pieces, negative_core, position in picked:
            if -negative_pieces > share_base:
                heapq.heappush(heap, (negative_pieces + share_base, negative_core, position))
    ranked.sort()
    return [plan for _, _, plan in ranked]


def _full_plans_in_order(cores: list[Core], full: int, share_base: int) -> list[list[int]]:
    """Affinity's scheme: cut the list into consecutive groups of `full`.

    Cores with pieces left after a pass rejoin at the front of the list for the next pass.
    """
    left = [pieces for pieces, _ in cores]
    order = list(range(len(cores)))
    plans: list[list[int]] = []
    while len(order) >= full:
        groups = len(order) // full
        kept = []
        for start in range(0, groups * full, full):
            group = order[start : start + full]
            plans.append([cores[position][1] for position in group])
            for position in group:
                left[position] -= share_base
                if left[position] > 0:
                    kept.append(position)
        order = kept + order[groups * full :]
    return plans


def _fragment_plans(cores: list[Core], fragment: int, limit: int | None = None) -> list[int]:
    """Single-core fragment plans (up to `limit`), as core ids, taking the cores in list order."""
    plans: list[int] = []
    for pieces, core in cores:
        plans.extend([core] * (pieces // fragment))
        if limit is not None and len(plans) >= limit:
            return plans[:limit]
    return plans


def _memory_cap(free_memory: int, memory_request: int) -> int:
    """How many instances the free memory holds; no cap without a memory request."""
    if memory_request <= 0:
        return MAX_INT
    return max(free_memory // memory_request, 0)
