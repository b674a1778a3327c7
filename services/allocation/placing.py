"""Placing: how an allocate finds where its instances go and commits them, all or nothing.

`Placer.allocate` first looks for what an earlier run of the same request placed (a retry is
answered from the ledger, never placed twice), plans on the fleet's capacity view (`_plan`: pack,
spread over a drawn sample, or each), refuses a plan whose answer NATS could not carry, and hands
the plan to the committer; a node that filled up under the plan is planned around again. A
refusal for want of room is explained (explain.py) only once it is final. `placements` reads back
what a request placed, as the ledger holds it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from bus.callers import current_caller
from bus.codec import encode
from bus.failpoints import failpoint
from bus.idempotency import current_claim
from schemas.allocation import Allocation
from schemas.errors import BerthError
from services.allocation.committer import Committer, NodeFilledUp, workload_ids
from services.allocation.dry_run import preview
from services.allocation.errors import no_room, reply_too_large, workload_exists
from services.allocation.explain import Explainer
from services.allocation.fleet import Fleet
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.refusal import explains
from services.allocation.selection import Selection
from services.allocation.store import NodeStore
from services.allocation.view import Reservation, SpreadSample

log = logging.getLogger("berth.allocation")

Raw = dict[str, Any]

# Runs of a request an allocate looks for placements of before it places (after the idempotency
# window a retry starts again at run 0, and its first answer may have come from a later run).
LOOKED_BACK_RUNS = 4


@dataclass
class Placer:
    """Places an allocate's instances: plans on the fleet's views, commits through the committer,
    and answers a retried request with what its earlier run placed. The manager builds one and
    hands it the parts it shares (store, plugins, fleet, committer, explainer)."""

    store: NodeStore
    plugins: PluginSet
    fleet: Fleet
    committer: Committer
    explainer: Explainer
    spread_sample: SpreadSample  # how a spread over a large selection draws its nodes (view.py)

    async def allocate(
        self,
        nodes: Selection,
        strategy: str,
        count: int,
        requests: Keyed,
        given_ids: list[str] | None,
        request_id: str,
        *,
        dry_run: bool = False,
        replans: int = 20,
        reply_bytes: int | None = None,
    ) -> list[Allocation]:
        """Place `count` instances on `nodes` (`count` on each for `each`); all or nothing.
        `dry_run`: answer the plan, committing nothing (dry_run.py).

        A refusal for want of room says why (refusal.py): worked out only once refused."""
        try:
            return await self._allocate(nodes, strategy, count, requests, given_ids, request_id, dry_run=dry_run,
                                        replans=replans, reply_bytes=reply_bytes)
        except BerthError as error:
            if not explains(error):
                raise
            raise await self.explainer.allocate(error, nodes, strategy, count, requests) from None

    async def _allocate(
        self, nodes: Selection, strategy: str, count: int, requests: Keyed, given_ids: list[str] | None,
        request_id: str, *, dry_run: bool, replans: int, reply_bytes: int | None,
    ) -> list[Allocation]:
        """The plan is made from a snapshot of the nodes; if a node filled up before its commit, the
        instances already placed are returned and we plan again from a fresh snapshot. A plan
        whose answer would take more than `reply_bytes` is refused before it commits.
        """
        run = current_claim.get()
        attempt = run.attempt if run is not None and run.request_id == request_id else 0
        # ids derived from this request and its runs (a dry run places none)
        own_ids = given_ids is None and bool(request_id) and not dry_run
        if own_ids:
            failpoint("run-start")
            instances = await self._instances(nodes, strategy, count)
            if attempt:
                await self.committer.forget_runs(request_id, attempt, instances)
            earlier = await self._placed_before(request_id, attempt, instances)
            if earlier:
                return earlier
        elif given_ids is not None:
            await self._refuse_held(given_ids)
        cleared = False

        async def lost_run_found(error: BerthError) -> list[Allocation] | None:
            """The placement of this run's number that an earlier run made, or None to refuse."""
            nonlocal cleared
            if not own_ids or cleared:
                return None
            cleared = True
            return await self._lost_run(error, request_id, attempt, nodes, strategy, count)

        views = self.fleet.views
        failure: BerthError | None = None
        for replan in range(replans):
            reservation = Reservation.none()
            try:
                plan, reservation = await self._plan(nodes, strategy, count, requests, fresh=replan > 0)
                if dry_run:  # a plan nobody commits holds no room in the view, not even for a moment
                    reservation.settle_all()
                instances = sum(plan.values())
                # A dry run mints no id for what it does not place: the given ones, else "".
                unnamed = dry_run and given_ids is None
                ids = [""] * instances if unnamed else workload_ids(instances, given_ids, request_id, attempt)
                if reply_bytes is not None:
                    await self._check_reply_fits(plan, ids, requests, reply_bytes)
                if dry_run:
                    return await preview(self.store, self.plugins, plan, ids, requests)
                # spread decides on usage: a node another worker changed since is planned again
                # (but the last replan commits where it planned: spread is never refused for this)
                unmoved = strategy == "spread" and not nodes.single and replan < replans - 1
                return await self.committer.place(plan, ids, requests, reservation, unmoved=unmoved)
            except BerthError as error:
                found = await lost_run_found(error)
                if found is None:
                    raise
                if found:
                    return found
                failure = error
            except NodeFilledUp as filled:
                views.invalidate(filled.node, urgent=True)  # its record changed under the view: read it now
                views.contend(filled.node)
                failure = filled.error
                if nodes.single or replan == replans - 1:
                    found = await lost_run_found(filled.error)
                    if found is None:
                        raise filled.error from None
                    if found:
                        return found
                else:
                    log.debug("node %s filled up during allocate; planning again", filled.node)
            finally:
                reservation.settle_all()
        raise failure  # every replan met a node that filled up first

    async def _instances(self, nodes: Selection, strategy: str, count: int) -> int:
        """How many instances an allocate places in all (`each`: `count` on every selected node)."""
        return count * len(await self.fleet.members(nodes)) if strategy == "each" else count

    async def _lost_run(
        self, error: BerthError, request_id: str, attempt: int, nodes: Selection, strategy: str, count: int
    ) -> list[Allocation] | None:
        """`error` may come from this very request's own earlier run: its claim was lost (a Redis
        failover lost the claim's last writes), so this run has that run's number and finds its ids
        taken (`workload_exists`) or the room it took gone (a capacity refusal: the index may have
        lost its entries in the same failover, so the selected nodes' ledgers are searched). That
        run's placement is the answer (it may have been answered); [] means none was found: plan
        again, once. None: `error` is not of that kind."""
        capacity = no_room(error)
        if error.code != "workload_exists" and not capacity:
            return None
        instances = await self._instances(nodes, strategy, count)
        where = await self.fleet.members(nodes) if capacity else None
        await self.committer.find_runs(request_id, range(attempt, attempt + 1), instances, where)
        found = await self._placed_before(request_id, attempt, instances, runs=1)
        if found:
            log.warning("request %s: an earlier run of the same number had placed it; answering that", request_id)
        return found

    async def _placed_before(
        self, request_id: str, attempt: int, instances: int, runs: int = LOOKED_BACK_RUNS
    ) -> list[Allocation]:
        """What an earlier run of this request placed under this run's number or a later one (a
        retry after the idempotency window starts again at run 0; a failover can make a run repeat
        a number): the placements of the first such run that a node still holds, or []. The ledger
        is the truth: an allocate never places twice."""
        by_run = [workload_ids(instances, None, request_id, run) for run in range(attempt, max(attempt + 1, runs))]
        located = await self.store.locate([wid for ids in by_run for wid in ids])
        for ids in by_run:
            if any(wid in located for wid in ids):
                found = await self.placements(ids)
                if found:
                    return found
        return []

    async def placements(self, ids: list[str]) -> list[Allocation]:
        """The placements of those of `ids` a node holds for the caller (placed for it, not only
        visible to it), in the order of `ids`, as the ledger holds them (an instance released since
        is left out)."""
        caller = current_caller.get()
        located = await self.store.located(ids)
        read = await asyncio.gather(*(self.store.load_with_ledger(n, held) for n, held in located.nodes.items()))
        order = {wid: i for i, wid in enumerate(ids)}
        found = [
            Allocation(wid, record.name, resource, self.plugins.engine_params(resource))
            for record, ledger in read if record is not None
            for wid, resource in ledger.resources.items() if ledger.owner(wid) == caller.name
        ]
        return sorted(found, key=lambda allocation: order[allocation.workload_id])

    async def _plan(
        self, nodes: Selection, strategy: str, count: int, requests: Keyed, *, fresh: bool = False
    ) -> tuple[dict[str, int], Reservation]:
        """Where the instances go, reserved in the view until each node's deploy is settled
        (`fresh`: a plan before was refused at its commit: wait for the view's nodes to be read)."""
        if nodes.single:
            return {nodes.single: count}, Reservation.none()
        # pack plans on this worker's own nodes first: only those need reading again (see view.plan);
        # sampled spread reads only the nodes it draws (see Fleet.plan_sampled)
        sample = self.spread_sample if strategy == "spread" else None
        view = await self.fleet.view(list(self.plugins), nodes, requests, planning=strategy == "pack",
                                     sample=sample, fresh=fresh)
        if strategy == "each":
            return view.plan_each(count)

        async def plan() -> tuple[dict[str, int], Reservation]:
            if sample is not None and sample.applies(view):
                return await self.fleet.plan_sampled(view, nodes, count, sample)
            # pack steps aside from a node another worker is filling; spread must not (it would
            # take a busier node), it plans again when the node it chose moved (`unmoved`)
            return view.plan(strategy, count, self.fleet.views.contended if strategy == "pack" else _never)

        try:
            return await plan()
        except BerthError as error:
            if error.code != "insufficient_capacity" or not view.stale:
                raise
        # Other workers' nodes that changed were not read again for planning; before refusing, do.
        await self.fleet.refresh(view, nodes)
        return await plan()

    async def _check_reply_fits(self, plan: dict[str, int], ids: list[str], requests: Keyed, limit: int) -> None:
        """Refuse a plan whose answer NATS could not carry: placed and unanswered, it would hold
        capacity nobody knows of. The size is one instance's entry times the instances; the entry is
        computed (one instance on the plan's first node) only when even empty entries come near."""
        longest_id, longest_node = max(ids, key=len), max(plan, key=len)
        floor = _entry_size(Allocation(longest_id, longest_node, {}, {}))
        if len(ids) * floor * 32 > limit:  # a computed entry is rarely 32 times an empty one
            entry = await self._sample_entry(next(iter(sorted(plan))), requests)
            floor = _entry_size(Allocation(longest_id, longest_node, *entry)) if entry else floor
        if len(ids) * floor > limit:
            raise reply_too_large("deploy_count", len(ids) * floor, limit, "allocate fewer instances at once")

    async def _sample_entry(self, node: str, requests: Keyed) -> tuple[Raw, Raw] | None:
        """One instance's (workload resource, engine params) on `node`, or None when none fits
        there now (the commit will say so)."""
        record = await self.store.load(node)
        if record is None:
            return None
        try:
            deployment = self.plugins.deploy(self.plugins.states(record, list(self.plugins)), 1, requests)
        except BerthError:
            return None
        return deployment.workloads_resource[0], deployment.engines_params[0]

    async def _refuse_held(self, ids: list[str]) -> None:
        """Workload ids are unique across the platform: an id that any node holds, whoever placed
        it, is `workload_exists` (a node's own commit refuses one it holds; this finds the others)."""
        held = await self.store.held_owners((await self.store.located(ids)).nodes)
        if held:
            raise workload_exists(min(held))


def _never(node: str) -> bool:
    return False


def _entry_size(entry: Allocation) -> int:
    return len(encode(entry)) + 1  # and a byte or so of the list around them
