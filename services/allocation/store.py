"""Node records and ledgers in Redis.

Per node, two keys share the hash tag `{node:<name>}` (so each per-node script is Redis-Cluster
safe):
- `<prefix>:{node:<name>}:node`, a hash: `v` (version), `labels`, and `p:<plugin>` with that
  plugin's `{capacity, usage}`;
- `<prefix>:{node:<name>}:ledger`, a hash: workload id -> `{plugin: workload resource}`.

Every change goes through one Lua script, `commit`: it re-checks the version the caller computed
from and the ledger entries the change depends on, and only then writes everything at once (no
WATCH loops). A caller whose version is stale reloads and computes again. Usage and ledger change
in the same step, so usage is always what the ledger explains.

Two global indexes live outside the node slot: `<prefix>:nodes` (name -> time added) and
`<prefix>:workloads` (workload id -> node). They are written so that a crash between steps can
only leave an index entry without a record, which readers skip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

Raw = dict[str, Any]

PLUGIN_FIELD = "p:"

_COMMIT = """
local version = redis.call('HGET', KEYS[1], 'v') or '0'
if version ~= ARGV[1] then return {'version', version} end
local i = 2
local function take()
  local n = tonumber(ARGV[i]); local first = i + 1; i = first + n
  return first, i - 1
end
local set_first, set_last = take()
local del_first, del_last = take()
local add_first, add_last = take()
local rm_first, rm_last = take()
local put_first, put_last = take()
local mode = ARGV[i]
for j = add_first, add_last, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[j]) == 1 then return {'ledger_exists', ARGV[j]} end
end
for j = rm_first, rm_last do
  if redis.call('HEXISTS', KEYS[2], ARGV[j]) == 0 then return {'ledger_missing', ARGV[j]} end
end
for j = put_first, put_last, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[j]) == 0 then return {'ledger_missing', ARGV[j]} end
end
if mode == 'delete_if_empty' or mode == 'delete' then
  local held = redis.call('HLEN', KEYS[2])
  if mode == 'delete_if_empty' and held > 0 then return {'not_empty', tostring(held)} end
  redis.call('DEL', KEYS[1], KEYS[2])
  return {'ok', '0'}
end
for j = set_first, set_last, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
for j = del_first, del_last do redis.call('HDEL', KEYS[1], ARGV[j]) end
for j = add_first, add_last, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
for j = put_first, put_last, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
for j = rm_first, rm_last do redis.call('HDEL', KEYS[2], ARGV[j]) end
return {'ok', tostring(redis.call('HINCRBY', KEYS[1], 'v', 1))}
"""


class PluginState(msgspec.Struct, array_like=True):
    capacity: Raw
    usage: Raw


@dataclass
class NodeRecord:
    """A node as stored. `raw` keeps each plugin's encoded state: equal bytes mean equal state,
    which lets callers memoise calculations across nodes without decoding them."""

    name: str
    version: int
    labels: dict[str, str]
    raw: dict[str, bytes]

    @cached_property
    def plugins(self) -> dict[str, PluginState]:
        return {name: _decode_state(value) for name, value in self.raw.items()}


@dataclass
class Change:
    """What one commit writes. Plugin states are encoded (`encode_state`); ledger values are
    `{plugin: workload resource}` maps; `index` entries (workload id -> node) are written to the
    global workload index just before the commit, in the same round trip."""

    plugins: dict[str, bytes] = field(default_factory=dict)
    remove_plugins: list[str] = field(default_factory=list)
    labels: dict[str, str] | None = None
    ledger_add: dict[str, Raw] = field(default_factory=dict)  # must not exist yet
    ledger_remove: list[str] = field(default_factory=list)  # must exist
    ledger_replace: dict[str, Raw] = field(default_factory=dict)  # must exist
    delete: str = ""  # "", "delete" or "delete_if_empty" (refused while the ledger holds workloads)
    index: dict[str, str] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.plugins or self.remove_plugins or self.labels is not None or self.ledger_add
            or self.ledger_remove or self.ledger_replace or self.delete
        )


class StaleVersion(Exception):
    """The record changed since it was read; reload and compute again."""


class LedgerConflict(Exception):
    def __init__(self, reason: str, subject: str) -> None:
        super().__init__(f"{reason}: {subject}")
        self.reason = reason
        self.subject = subject


_encode = msgspec.msgpack.Encoder().encode
_decode_state = msgspec.msgpack.Decoder(PluginState).decode


def encode_state(state: PluginState) -> bytes:
    return _encode(state)
_decode_map = msgspec.msgpack.Decoder(dict[str, Any]).decode


class NodeStore:
    def __init__(self, redis: Redis, prefix: str = "berth") -> None:
        self.redis = redis
        self.prefix = prefix
        self.nodes_key = f"{prefix}:nodes"
        self.workloads_key = f"{prefix}:workloads"
        self.intents_key = f"{prefix}:intents"
        self._commit = redis.register_script(_COMMIT)

    def record_key(self, node: str) -> str:
        return f"{self.prefix}:{{node:{node}}}:node"

    def ledger_key(self, node: str) -> str:
        return f"{self.prefix}:{{node:{node}}}:ledger"

    # -- reading ---------------------------------------------------------------------------

    @staticmethod
    def _parse(name: str, fields: dict[bytes, bytes]) -> NodeRecord | None:
        if not fields:
            return None
        raw = {key[len(PLUGIN_FIELD):].decode(): value for key, value in fields.items() if key.startswith(b"p:")}
        labels = _decode_map(fields[b"labels"]) if b"labels" in fields else {}
        return NodeRecord(name, int(fields.get(b"v", b"0")), labels, raw)

    async def load(self, node: str) -> NodeRecord | None:
        return self._parse(node, await self.redis.hgetall(self.record_key(node)))

    async def load_many(self, nodes: list[str]) -> dict[str, NodeRecord | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for node in nodes:
                pipe.hgetall(self.record_key(node))
            results = await pipe.execute()
        return {node: self._parse(node, fields) for node, fields in zip(nodes, results)}

    async def versions(self, nodes: list[str]) -> list[int]:
        """Each node's version (0 for a missing node): a cheap way to see which records changed."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for node in nodes:
                pipe.hget(self.record_key(node), "v")
            results = await pipe.execute()
        return [int(v) if v else 0 for v in results]

    async def load_with_ledger(
        self, node: str, workload_ids: list[str] | None = None
    ) -> tuple[NodeRecord | None, dict[str, Raw]]:
        """The record and its ledger (all of it, or the given ids) read in one MULTI, so they agree."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.record_key(node))
            if workload_ids is None:
                pipe.hgetall(self.ledger_key(node))
            else:
                pipe.hmget(self.ledger_key(node), workload_ids)
            fields, held = await pipe.execute()
        if workload_ids is None:
            ledger = {k.decode(): _decode_map(v) for k, v in sorted(held.items())}
        else:
            ledger = {wid: _decode_map(v) for wid, v in zip(workload_ids, held) if v is not None}
        return self._parse(node, fields), ledger

    async def node_names(self) -> list[str]:
        return sorted(name.decode() for name in await self.redis.zrange(self.nodes_key, 0, -1))

    async def locate(self, workload_ids: list[str]) -> dict[str, str]:
        """workload id -> node, for the ids the index knows."""
        nodes = await self.redis.hmget(self.workloads_key, workload_ids)
        return {wid: node.decode() for wid, node in zip(workload_ids, nodes) if node is not None}

    # -- writing ---------------------------------------------------------------------------

    async def commit(self, node: str, version: int, change: Change) -> int:
        """Write `change` if the record is still at `version` (0: must not exist). Returns the new version."""
        args: list[Any] = [str(version)]

        def section(items: list[Any]) -> None:
            args.append(len(items))
            args.extend(items)

        section([x for name, state in change.plugins.items() for x in (PLUGIN_FIELD + name, state)]
                + (["labels", _encode(change.labels)] if change.labels is not None else []))
        section([PLUGIN_FIELD + name for name in change.remove_plugins])
        section([x for wid, res in change.ledger_add.items() for x in (wid, _encode(res))])
        section(list(change.ledger_remove))
        section([x for wid, res in change.ledger_replace.items() for x in (wid, _encode(res))])
        args.append(change.delete or "write")
        keys = [self.record_key(node), self.ledger_key(node)]
        if change.index:
            status, detail = await self._commit_after_index(change.index, keys, args)
        else:
            status, detail = await self._commit(keys=keys, args=args)
        status, detail = status.decode(), detail.decode()
        if status == "ok":
            return int(detail)
        if status == "version":
            raise StaleVersion(node)
        raise LedgerConflict(status, detail)

    async def _commit_after_index(self, index: dict[str, str], keys: list[str], args: list[Any]) -> list[bytes]:
        """HSET the workload index, then the commit script, in one round trip.

        (redis-py's pipelined scripts ask SCRIPT EXISTS on every execute; EVALSHA alone is one
        command, and a Redis that lost its scripts answers NOSCRIPT, on which we load it again.)
        """
        for _ in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.workloads_key, mapping=index)
                pipe.evalsha(self._commit.sha, len(keys), *keys, *args)
                _, result = await pipe.execute(raise_on_error=False)
            if not isinstance(result, NoScriptError):
                if isinstance(result, Exception):
                    raise result
                return result
            self._commit.sha = await self.redis.script_load(_COMMIT)
        raise result

    # -- intents: multi-node allocations a crashed worker may have left half done ------------------

    async def begin_intent(self, intent_id: str, workload_ids: list[str], deadline: float) -> None:
        await self.redis.hset(self.intents_key, intent_id, _encode([deadline, workload_ids]))

    async def take_intent(self, intent_id: str) -> bool:
        """Remove an intent; True for exactly one caller (its owner finishing, or a reaper)."""
        return bool(await self.redis.hdel(self.intents_key, intent_id))

    async def expired_intents(self, now: float) -> dict[str, list[str]]:
        held = await self.redis.hgetall(self.intents_key)
        expired = {}
        for intent_id, value in held.items():
            deadline, workload_ids = msgspec.msgpack.decode(value)
            if deadline < now:
                expired[intent_id.decode()] = workload_ids
        return expired

    async def add_to_index(self, node: str) -> None:
        await self.redis.zadd(self.nodes_key, {node: time.time()}, nx=True)

    async def remove_from_index(self, node: str) -> None:
        await self.redis.zrem(self.nodes_key, node)

    async def index_workloads(self, node: str, workload_ids: list[str]) -> None:
        if workload_ids:
            await self.redis.hset(self.workloads_key, mapping={wid: node for wid in workload_ids})

    async def unindex_workloads(self, workload_ids: list[str]) -> None:
        if workload_ids:
            await self.redis.hdel(self.workloads_key, *workload_ids)
