"""Which nodes this allocation worker plans on first, so that workers add up instead of racing.

Every worker places on the node its strategy likes best. With several workers that is the same
node for all of them (pack: the fullest that fits; spread: one of the emptiest), so their commits
meet on one record and all but one compute again; and every worker reads again each node another
one changed, whether or not it will place there. So the nodes are split between the workers: each
node has an owner, chosen by rendezvous hashing over the live workers (the worker whose hash of
(worker, node) is highest). pack plans on the nodes its worker owns first (the fullest of them that
fits) and on the others only when none of its own fits, and reads again only its own nodes that
changed; spread stays exact over the whole selection and takes the worker's own nodes first only
among equally used ones (view.py). The split is only a preference: every commit still re-checks
its node, so two workers on one node cost a retry, never an over-commit.

Workers find each other through Redis: a sorted set `<prefix>:allocation:workers` of worker ids
scored by when their membership ends (ms of the Redis server's clock), renewed every second for
three. A worker that stops leaves the set at once; one that dies leaves it when its membership
ends; either way the others take its nodes over (rendezvous hashing moves only its share).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.allocation.store import NodeStore

MEMBERSHIP_MS = 3000


class Shards:
    def __init__(self, store: NodeStore, worker: str | None = None) -> None:
        self.store = store
        self.worker = worker or uuid.uuid4().hex
        self.workers: tuple[str, ...] = (self.worker,)
        self._others: tuple[bytes, ...] = ()
        self._owned: dict[str, bool] = {}  # the answers so far, until the workers change

    def mine(self, node: str) -> bool:
        """Whether this worker owns `node` (every node, while it is the only worker)."""
        if not self._others:
            return True
        owned = self._owned.get(node)
        if owned is None:
            name, me = node.encode(), self.worker.encode()
            mine = (_weight(name, me), me)  # the worker id breaks a tie of weights
            owned = self._owned[node] = all(mine > (_weight(name, other), other) for other in self._others)
        return owned

    async def renew(self) -> bool:
        """Renew this worker's membership and read the others'; whether the workers changed."""
        workers = tuple(await self.store.renew_worker(self.worker, MEMBERSHIP_MS))
        if workers == self.workers:
            return False
        self.workers = workers
        self._others = tuple(w.encode() for w in workers if w != self.worker)
        self._owned.clear()
        return True

    async def leave(self) -> None:
        await self.store.leave_workers(self.worker)


def _weight(node: bytes, worker: bytes) -> bytes:
    # A keyed cryptographic hash, not a CRC: a CRC is linear in its seed, so one worker would win
    # most nodes of a given name length whatever the name.
    return hashlib.blake2b(node, key=worker[:64], digest_size=8).digest()
