"""Node records and ledgers in Redis (the values themselves are in records.py).

Every key starts with `<prefix>:allocation:` (one ACL pattern covers the service). Per node, these
keys share the hash tag `{node:<name>}` (so each per-node script is Redis-Cluster safe):
- `<prefix>:allocation:{node:<name>}:node`, a hash: `v` (version), `labels`, `status` (`down` or
  `draining`; absent: up) and `p:<plugin>` with that plugin's `{capacity, usage}`;
- `<prefix>:allocation:{node:<name>}:ledger`, a hash: workload id -> `{plugin: workload resource}`;
- `<prefix>:allocation:{node:<name>}:owners`, a hash: workload id -> the identity that placed it
  (bus.callers), for the ledger's workloads that have one; a workload without an entry is the
  services' own (placed by a service, an account-less deployment, or before owners were kept).
  Owners are a hash of their own rather than a part of each ledger value so that the ledger stays
  what the plugins read (`{plugin: workload resource}`); the commit that writes a ledger entry
  writes its owner, and the one that removes it removes the owner;
- `<prefix>:allocation:{node:<name>}:lease`, a hash: the node's lease, renewed by its agent's
  heartbeats (`ends` and `beat`, ms of the Redis server's clock; `ttl` ms; `agent`, what the agent
  reported). It is not part of the record: a heartbeat does not change the node's version, only a
  change of status does (see `LeaseKeeping` in leases.py).

A removed node leaves a tombstone for a week (`v` and `gone`), so that a node removed and added
again keeps counting versions up: an event consumer that skips versions it has seen never skips
the new node's changes.

Every change goes through one Lua script, `commit`: it re-checks the version the caller computed
from and the ledger entries the change depends on (and their owners), and only then writes
everything at once (no WATCH loops). A caller whose version is stale reloads and computes again.
Usage and ledger change in the same step, so usage is always what the ledger explains.

Four global keys live outside the node slots, each written by single-key commands:
`<prefix>:allocation:nodes` (name -> time added), `<prefix>:allocation:workloads` (workload id ->
`<node>/<tag>`, the tag of the commit that placed it; `<node>` alone for an entry repaired from the
ledgers), `<prefix>:allocation:intents` (multi-node allocations in progress) and
`<prefix>:allocation:leases` (node -> its lease's end, ms: where the sweeper looks for lapsed
ones). They are written so that a crash between steps can only leave an index entry without a
record, which readers skip. A release removes an index entry only while it is the one the release
read: the same id placed again meanwhile, by anyone, has an entry of its own, which stays.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from redis.asyncio import Redis

from bus import cas, replicas, scripts
from bus.codec import decoder, encode
from bus.outcome import deciding
from bus.redis import Pipelined
from services.allocation.records import (
    UP,
    AlreadyApplied,
    Change,
    Intent,
    Lease,
    LeaseExpired,
    Ledger,
    LedgerConflict,
    Located,
    NodeRecord,
    StaleVersion,
)

PLUGIN_FIELD = "p:"
TOMBSTONE_SECONDS = 7 * 24 * 3600

# The commit is a `bus.cas` compare-and-set: version field `v`, tombstone field `gone`, the ledger
# entries it depends on as guards. The record and its ledger are read together by
# read_with_ledger.lua beside this module.

_LEDGER_CONFLICTS = {
    "hadd": "ledger_exists", "hnotexists": "ledger_exists", "hexists": "ledger_missing", "hempty": "not_empty",
    "hequals": "owner_changed", "lapsed": "lease_live", "live": "lease_lapsed",
}


_decode_intent = decoder(Intent)


def _decode_owners(fields: list[bytes]) -> dict[str, str]:
    """An owners hash as HGETALL answers it."""
    return {wid.decode(): owner.decode() for wid, owner in zip(fields[::2], fields[1::2])}


def _node_of(entry: bytes) -> str:
    return entry.decode().partition("/")[0]


def _pairs(mapping: dict[str, Any]) -> list[Any]:
    return [item for pair in mapping.items() for item in pair]


_decode_map = decoder(dict[str, Any])


class NodeStore:
    """The only module of allocation that talks to Redis: it reads records, ledgers, leases and
    intents, and writes every change with one version-checked commit script (see the module)."""

    def __init__(self, redis: Redis, prefix: str = "berth") -> None:
        self.redis = redis
        self.prefix = prefix
        self.base = f"{prefix}:allocation"  # every key of the service starts so (one ACL pattern)
        self.nodes_key = f"{self.base}:nodes"
        self.workloads_key = f"{self.base}:workloads"
        self.intents_key = f"{self.base}:intents"
        self.workers_key = f"{self.base}:workers"  # the live allocation workers (shards.py)
        self.pending_key = f"{self.base}:outboxes"  # nodes whose outbox may hold events (bus/outbox.py)
        self.leases_key = f"{self.base}:leases"  # node -> its lease's end (ms): the sweeper's list
        self.batch = Pipelined.of(redis)
        self._records = cas.VersionedHash(redis, version_field="v", tombstone_field="gone", batch=self.batch)
        self._read_with_ledger = scripts.register(redis, "services.allocation", "read_with_ledger")
        self._renew_lease = scripts.register(redis, "services.allocation", "renew_lease")
        self._forget_lease = scripts.register(redis, "services.allocation", "forget_lease")
        self._unindex = scripts.register(redis, "services.allocation", "unindex")

    # -- what other modules would otherwise read themselves ------------------------------------

    async def renew_worker(self, worker: str, membership_ms: int) -> list[str]:
        """Renew `worker`'s membership of the allocation workers (shards.py) for `membership_ms`,
        on the Redis server's clock, drop lapsed ones; the live workers."""
        seconds, micros = await self.redis.time()
        now = seconds * 1000 + micros // 1000
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.workers_key, {worker: now + membership_ms})
            pipe.zremrangebyscore(self.workers_key, "-inf", now)
            pipe.zrange(self.workers_key, 0, -1)
            *_, members = await pipe.execute()
        return sorted(member.decode() for member in members)

    async def leave_workers(self, worker: str) -> None:
        await self.redis.zrem(self.workers_key, worker)

    async def plugin_states(
        self, nodes: list[str], plugins: list[str]
    ) -> list[tuple[int, list[bytes | None]] | None]:
        """Each node's version and the stored states of `plugins` (None for a node without a record),
        without labels or anything else, in the shared pipeline."""
        fields = ["v", "gone"] + [PLUGIN_FIELD + name for name in plugins]
        reads = (self.batch.execute_command("HMGET", self.record_key(n), *fields) for n in nodes)
        found = await asyncio.gather(*reads)
        return [None if version is None or gone is not None else (int(version), states)
                for version, gone, *states in found]

    async def workload_count(self) -> int:
        return await self.redis.hlen(self.workloads_key)

    def record_key(self, node: str) -> str:
        return f"{self.base}:{{node:{node}}}:node"

    def ledger_key(self, node: str) -> str:
        return f"{self.base}:{{node:{node}}}:ledger"

    def owners_key(self, node: str) -> str:
        return f"{self.base}:{{node:{node}}}:owners"

    def lease_key(self, node: str) -> str:
        """The node's lease, renewed by its agent (see the module docstring)."""
        return f"{self.base}:{{node:{node}}}:lease"

    def outbox_key(self, node: str) -> str:
        """The events of the node's changes not yet acknowledged by the stream (bus/outbox.py)."""
        return f"{self.base}:{{node:{node}}}:outbox"

    def applied_key(self, node: str, marker: str) -> str:
        """Where a request applied to the node keeps its answer (see `Change.once`)."""
        return f"{self.base}:{{node:{node}}}:applied:{marker}"

    # -- reading ---------------------------------------------------------------------------

    @staticmethod
    def _parse(name: str, fields: dict[bytes, bytes]) -> NodeRecord | None:
        """The record, or None for a node that does not exist (no hash, or a tombstone)."""
        if not fields or b"gone" in fields:
            return None
        raw = {key[len(PLUGIN_FIELD):].decode(): value for key, value in fields.items() if key.startswith(b"p:")}
        labels = _decode_map(fields[b"labels"]) if b"labels" in fields else {}
        status = fields.get(b"status", b"up").decode()
        return NodeRecord(name, int(fields.get(b"v", b"0")), labels, raw, fields.get(b"tag", b"").decode(), status)

    async def load(self, node: str) -> NodeRecord | None:
        return self._parse(node, await self.batch.execute_command("HGETALL", self.record_key(node)))

    async def load_many(self, nodes: list[str]) -> dict[str, NodeRecord | None]:
        """Many records at once (in the shared batch: a few stale nodes read beside other requests'
        commands cost no round trip of their own)."""
        loads = [self.batch.execute_command("HGETALL", self.record_key(node)) for node in nodes]
        results = await asyncio.gather(*loads)
        return {node: self._parse(node, fields) for node, fields in zip(nodes, results)}

    async def versions(self, nodes: list[str]) -> list[int]:
        """Each node's version (0 for a missing node): a cheap way to see which records changed. In
        the shared batch: redis-py's own pipeline packs and parses each command in Python, which made
        the periodic sweep over 2,000 nodes most of an idle worker's CPU."""
        found = await asyncio.gather(
            *(self.batch.execute_command("HGET", self.record_key(node), "v") for node in nodes)
        )
        return [int(v) if v else 0 for v in found]

    async def directory_entries(self, nodes: list[str]) -> list[tuple[int, dict[str, str], str] | None]:
        """Each node's (version, labels, status), None for a node without a record."""
        found: list[tuple[int, dict[str, str], str] | None] = []
        for start in range(0, len(nodes), 1000):
            read = await asyncio.gather(*(
                self.batch.execute_command("HMGET", self.record_key(node), "v", "labels", "gone", "status")
                for node in nodes[start:start + 1000]
            ))
            for version, labels, gone, status in read:
                if version is None or gone is not None:
                    found.append(None)
                else:
                    found.append((int(version), _decode_map(labels) if labels else {}, (status or b"up").decode()))
        return found

    async def load_with_ledger(
        self, node: str, workload_ids: list[str] | None = None
    ) -> tuple[NodeRecord | None, Ledger]:
        """The record, its ledger and the ledger's owners (all, or those of the given ids) read in
        one script, so they agree."""
        keys = [self.record_key(node), self.ledger_key(node), self.owners_key(node)]
        fields, held, owners = await self.batch.script(self._read_with_ledger, keys, workload_ids or [])
        record = self._parse(node, dict(zip(fields[::2], fields[1::2])))
        if workload_ids is None:
            resources = {k.decode(): _decode_map(v) for k, v in sorted(zip(held[::2], held[1::2]))}
            return record, Ledger(resources, _decode_owners(owners))
        resources = {wid: _decode_map(v) for wid, v in zip(workload_ids, held) if v}
        return record, Ledger(resources, {wid: o.decode() for wid, o in zip(workload_ids, owners) if o})

    async def held_owners(self, by_node: dict[str, list[str]]) -> dict[str, str | None]:
        """Each of the ids (by the node the index places them on) that its node holds -> its owner."""
        read = await asyncio.gather(*(self.load_with_ledger(n, ids) for n, ids in by_node.items()))
        return {wid: ledger.owner(wid) for _, ledger in read for wid in ledger.resources}

    async def applied(self, nodes: list[str], marker: str) -> dict[str, AlreadyApplied]:
        """The answers kept for the request `marker` on those of `nodes` it was applied to."""
        found = await asyncio.gather(
            *(self.batch.execute_command("HMGET", self.applied_key(node, marker), "r", "v") for node in nodes)
        )
        return {node: AlreadyApplied(answer, int(version)) for node, (answer, version) in zip(nodes, found) if answer}

    async def node_names(self) -> list[str]:
        return sorted(name.decode() for name in await self.redis.zrange(self.nodes_key, 0, -1))

    async def locate(self, workload_ids: list[str]) -> dict[str, str]:
        """workload id -> node, for the ids the index knows."""
        return {wid: _node_of(entry) for wid, entry in (await self._index_entries(workload_ids)).items()}

    async def located(self, workload_ids: list[str]) -> Located:
        """The nodes of the ids the index knows, and their entries (for `unindex`)."""
        entries = await self._index_entries(workload_ids)
        nodes: dict[str, list[str]] = {}
        for wid, entry in entries.items():
            nodes.setdefault(_node_of(entry), []).append(wid)
        return Located(nodes, entries)

    async def _index_entries(self, workload_ids: list[str]) -> dict[str, bytes]:
        if not workload_ids:
            return {}
        entries = await self.batch.execute_command("HMGET", self.workloads_key, *workload_ids)
        return {wid: entry for wid, entry in zip(workload_ids, entries) if entry is not None}

    @staticmethod
    def index_entry(node: str, tag: str) -> str:
        """The index entry of a workload that the commit with `tag` placed on `node`."""
        return f"{node}/{tag}"

    # -- writing ---------------------------------------------------------------------------

    async def commit(self, node: str, version: int, change: Change, tag: str = "") -> int:
        """Write `change` if the record is still at `version` (0: must not exist) and `tag` (the
        read record's). Returns the new version; the new tag is `change.tag`."""
        record, ledger, owners = self.record_key(node), self.ledger_key(node), self.owners_key(node)
        # Guards in the order of their reports: additions, removals, replacements; writes: additions,
        # replacements, removals. An entry removed or replaced must still have the owner it was
        # computed for: the caller was allowed to act on that owner's workload, no other's.
        held = [*change.ledger_remove, *change.ledger_replace]
        relied = [cas.hexists(ledger, wid) for wid in held]
        relied += [cas.hequals(owners, wid, change.owners.get(wid, "")) for wid in held]
        if change.delete:
            steps = [cas.hnotexists(ledger, wid) for wid in change.ledger_add] + relied
            if change.delete == "delete_if_empty":
                steps.append(cas.hempty(ledger))
            steps += [cas.delete(ledger), cas.delete(owners), cas.delete(self.lease_key(node))]
            fields: list[Any] = []
            mode, ttl = cas.TOMBSTONE, TOMBSTONE_SECONDS
        else:
            steps = [cas.hadd(ledger, wid, encode(res)) for wid, res in change.ledger_add.items()]
            steps += relied
            steps += [cas.hset(owners, w, who) for w, who in change.owners.items() if w in change.ledger_add]
            steps += [cas.hset(ledger, wid, encode(res)) for wid, res in change.ledger_replace.items()]
            steps += [cas.hdel(ledger, wid) for wid in change.ledger_remove]
            steps += [cas.hdel(owners, wid) for wid in change.ledger_remove if wid in change.owners]
            fields = [x for name, state in change.plugins.items() for x in (PLUGIN_FIELD + name, state)]
            if change.labels is not None:
                fields += ["labels", encode(change.labels)]
            if change.status is not None:
                fields += ["status", change.status]
            if change.lease is not None:
                steps.append((cas.lapsed if change.lease == "lapsed" else cas.live)(self.lease_key(node), "ends"))
            mode, ttl = cas.UPDATE, 0
        if change.once is not None:
            marker, answer, seconds = change.once  # kept as long as the request's answer
            steps.insert(0, cas.once(self.applied_key(node, marker), answer, seconds))
        if change.fence:
            steps.insert(0, cas.before(record, change.fence))
        if change.journal is not None:
            steps.append(cas.journal(self.outbox_key(node), change.journal))
        unset = [PLUGIN_FIELD + name for name in change.remove_plugins]
        # The index entries go first, in the same batch: a crash between the two leaves index
        # entries without ledger entries, which readers skip.
        change.tag = secrets.token_hex(6)
        before = []
        if change.index:
            entry = self.index_entry(node, change.tag)
            pairs = [item for wid in change.index for item in (wid, entry)]
            before.append(self.batch.execute_command("HSET", self.workloads_key, *pairs))
        if change.journal is not None:  # the pointer first: a crash in between leaves a pointer, not lost events
            before.append(self.batch.execute_command("ZADD", self.pending_key, time.time(), node))
        sent = self._records.send(record, version, steps, fields=fields, unset=unset, mode=mode, ttl=ttl,
                                  tags=(tag, change.tag))
        answer = (await asyncio.gather(*before, sent))[-1]
        self.wrote(node)  # applied or refused: waiting on a refused one too costs only a redundant WAIT
        try:
            return self._records.outcome(answer)
        except cas.Conflict as conflict:
            if conflict.reason == "version":
                raise StaleVersion(node) from None
            if conflict.reason == "before":
                raise LeaseExpired(node) from None
            if conflict.reason == "once":
                kept, version = await self.batch.execute_command(
                    "HMGET", self.applied_key(node, change.once[0]), "r", "v"
                )
                raise AlreadyApplied(kept, int(version)) from None
            raise LedgerConflict(_LEDGER_CONFLICTS[conflict.reason], conflict.subject) from None

    def wrote(self, node: str) -> None:
        """Note a commit to `node` for the request being served: with --wait-replicas its answer
        waits until the commit is on replicas (bus.replicas)."""
        replicas.wrote(self.redis, self.record_key(node))

    # -- leases: each agent's heartbeat keeps its node's lease ------------------------------------

    async def renew_lease(self, node: str, ttl_ms: int, agent: bytes) -> tuple[str, int] | None:
        """Renew the node's lease for `ttl_ms`: (the node's status, the lease's new end in ms of the
        server's clock), or None for a node that does not exist."""
        keys = [self.record_key(node), self.lease_key(node)]
        found = await deciding(self.batch.script(self._renew_lease, keys, [ttl_ms, agent]))
        if not found[0]:
            return None
        status, ends = found[1].decode() or UP, int(found[2])
        await self.batch.execute_command("ZADD", self.leases_key, ends, node)
        return status, ends

    async def lapsed_leases(self, limit: int = 500) -> dict[str, int]:
        """Nodes whose lease ended by the server's clock (node -> the end it had), at most `limit`."""
        seconds, micros = await self.redis.time()
        now = seconds * 1000 + micros // 1000
        found = await self.redis.zrangebyscore(self.leases_key, "-inf", now, start=0, num=limit, withscores=True)
        return {node.decode(): int(ends) for node, ends in found}

    async def forget_lease(self, node: str, ends: int) -> None:
        """Take the node off the sweeper's list, unless its lease was renewed past `ends` since."""
        await self._forget_lease(keys=[self.leases_key], args=[node, ends])

    async def leases(self, nodes: list[str]) -> dict[str, Lease]:
        """The leases of those of `nodes` that have one (an agent ever beat for them)."""
        found = await asyncio.gather(*(self.batch.execute_command("HGETALL", self.lease_key(n)) for n in nodes))
        leases = {}
        for node, fields in zip(nodes, found):
            if b"ends" in fields:
                leases[node] = Lease(int(fields[b"ends"]), int(fields[b"beat"]), int(fields[b"ttl"]),
                                     fields.get(b"agent", b""))
        return leases

    # -- intents: multi-node allocations a crashed worker may have left half done ------------------

    async def begin_intent(self, intent_id: str, intent: Intent) -> None:
        await self.redis.hset(self.intents_key, intent_id, encode(intent))

    async def take_intent(self, intent_id: str) -> bool:
        """Remove an intent; True for exactly one caller (its owner finishing, or a reaper)."""
        taken = bool(await self.redis.hdel(self.intents_key, intent_id))
        replicas.wrote(self.redis, self.intents_key)  # an intent back after a failover would reap an answer
        return taken

    async def expired_intents(self, now: float) -> dict[str, Intent]:
        held = await self.redis.hgetall(self.intents_key)
        intents = {intent_id.decode(): _decode_intent(value) for intent_id, value in held.items()}
        return {intent_id: intent for intent_id, intent in intents.items() if intent.deadline < now}

    async def add_to_index(self, node: str) -> None:
        await self.redis.zadd(self.nodes_key, {node: time.time()}, nx=True)

    async def remove_from_index(self, node: str) -> None:
        await self.redis.zrem(self.nodes_key, node)

    async def repair_index(self, nodes: list[str], workload_ids: list[str] | None = None) -> int:
        """Index the workloads the ledgers of `nodes` hold (all, or those of `workload_ids`) that the
        workload index lacks. The index lives in another slot than the ledgers: a Redis failover can
        lose its last write while a ledger's stays. Returns how many entries were missing."""
        missing: dict[str, str] = {}
        for start in range(0, len(nodes), 500):
            part = nodes[start:start + 500]
            if workload_ids is None:
                held = await asyncio.gather(*(self.batch.execute_command("HKEYS", self.ledger_key(n)) for n in part))
            else:
                found = await asyncio.gather(
                    *(self.batch.execute_command("HMGET", self.ledger_key(n), *workload_ids) for n in part)
                )
                held = [[wid.encode() for wid, value in zip(workload_ids, values) if value] for values in found]
            ids = [(wid.decode(), node) for node, wids in zip(part, held) for wid in wids]
            if ids:
                indexed = await self.batch.execute_command("HMGET", self.workloads_key, *(wid for wid, _ in ids))
                missing.update((wid, node) for (wid, node), at in zip(ids, indexed) if at is None)
        if missing:
            await self.batch.execute_command("HSET", self.workloads_key, *_pairs(missing))
        return len(missing)

    async def unindex(self, entries: dict[str, bytes | str]) -> None:
        """Remove these index entries (workload id -> entry), each only while it is still the one
        given: a placement of the same id since has an entry of its own, which stays."""
        if entries:
            await self.batch.script(self._unindex, [self.workloads_key], _pairs(entries))
