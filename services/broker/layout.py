"""The broker's Redis layout, pure (no I/O): key names, how a record is encoded in a hash, and
the index changes each step of a record's life writes with it (`Changes`).

Keys: every key starts with `<p>:broker:` (one ACL pattern, `~<p>:broker:*`, covers the service)
and carries the deployment's hash tag `{<p>}`, so every key of one deployment's broker lives in one
Redis Cluster hash slot. Base `<p>:broker:{<p>}`:
  res:<user>:<id>              hash   a resource record (released ones expire after the idempotency window)
  index                        zset   "<user>/<id>" -> created_at, for list-resources
  blocks                       hash   capacity block -> instances reserved but not ready yet
  timers                       zset   "<kind>|<user>|<id>" -> due time (durable timers)
  brokers                      zset   "<user>/<name>" -> order of creation
  broker-seq                   string the last order number given to a broker
  brokers-version              string bumped after every broker change (readers cache by it)
  broker:<user>:<name>         hash   config, cooling_until, next_recycle
  pool:<user>:<name>:warming   set    launched, not accepted yet
  pool:<user>:<name>:idle      zset   accepted, unsold: id -> ready since
  pool:<user>:<name>:sold      set    sold and not released
  pool:<user>:<name>:deleting  set    being released, or its release failed and waits for a retry
  pool:<user>:<name>:demand    zset   applies seen (hits and misses) -> time
  lease:<user>:<name>          string the replica that runs this broker's pool loop
  launching:<user>:<id>        string who hands this launch to the operator now (a lease)
  applied:<scope>:<request id> hash   a state change applied once: its answer, kept for the idempotency window
  outbox                       hash   events of committed changes not yet acknowledged by the
                                      stream (`bus.outbox.Journal`)
The operators keep their own keys beside these, under the same base and tag (`proc:<user>:<id>`,
`proc-slots`, `ports`: operators/process_store.py; `alloc:<user>:<id>`, `on-node:<node>`:
operators/allocation_store.py).

Why one tag for the whole deployment: the scripts and transactions need it. `commit` writes a
record together with the deployment-wide index, reservations (`blocks`, whose `fits` guard is a
global capacity check) and timers, and with a pool of any broker; the `apply` claim reads the
brokers' version, pops from several brokers' pools and rewrites the records it finds there (keys
it cannot name in advance: it builds them from the popped ids, which works on a Redis Cluster only
because they share the declared keys' slot); the process table changes a resource's processes and
the deployment's port and instance sets in one transaction. No finer tag keeps all of that in one
slot, and the broker's load is modest (launches, releases, applies, and a pool loop per broker).
Different deployments (prefixes) land in different slots. Idempotency keys (`bus.idempotency`,
`<p>:idem:<p>-broker:...`) are apart: one key per script, in any slot.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bus import cas
from bus.codec import decode_stored, encode
from schemas.broker import ResourceParam
from services.broker.model import RUNNING, Resource

# An index change or guard that goes with a record write: `bus.cas`'s steps sadd, srem, zadd, zrem,
# hcount (a counter that falls to zero or below is removed), and the guards fits (the counter plus
# `add` must not exceed `limit`) and exists.
Op = cas.Step


# -- record encoding ---------------------------------------------------------------------------


def _field_text(value: Any) -> bytes | str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, ResourceParam):
        return encode(value)
    return str(value)


def encode_fields(record: Resource, *, skip: tuple[str, ...] = ()) -> list[Any]:
    """The record as hash fields (all but `version`, which the scripts maintain)."""
    flat: list[Any] = []
    for name in record.__struct_fields__:
        if name != "version" and name not in skip:
            flat += [name, _field_text(getattr(record, name))]
    return flat


def decode_record(raw: dict[bytes, bytes]) -> Resource | None:
    if not raw:
        return None
    fields: dict[str, Any] = {k.decode(): v for k, v in raw.items()}
    param = decode_stored(fields.pop("param"), ResourceParam)
    text: dict[str, Any] = {k: v.decode() for k, v in fields.items()}
    # Hash fields are text; the lax mode turns "3" into 3 and "1" into True.
    return msgspec.convert({**text, "param": param}, Resource, strict=False)


def key_base(prefix: str) -> str:
    """The start of every broker key of a deployment: the service's name, then the hash tag that
    puts all of them in one Redis Cluster slot (see the module docstring)."""
    return f"{prefix}:broker:{{{prefix}}}"


class Keys:
    def __init__(self, prefix: str) -> None:
        self.base = key_base(prefix)
        self.index = f"{self.base}:index"
        self.blocks = f"{self.base}:blocks"
        self.timers = f"{self.base}:timers"
        self.brokers = f"{self.base}:brokers"
        self.broker_seq = f"{self.base}:broker-seq"
        self.brokers_version = f"{self.base}:brokers-version"
        self.outbox = f"{self.base}:outbox"

    def records(self, user: str) -> str:
        return f"{self.base}:res:{user}:"

    def record(self, user: str, resource_id: str) -> str:
        return self.records(user) + resource_id

    def broker(self, user: str, name: str) -> str:
        return f"{self.base}:broker:{user}:{name}"

    def pool(self, user: str, name: str, part: str) -> str:
        return f"{self.base}:pool:{user}:{name}:{part}"

    def lease(self, user: str, name: str) -> str:
        return f"{self.base}:lease:{user}:{name}"

    def launching(self, user: str, resource_id: str) -> str:
        """Held by the one caller that hands a resource's launch to the operator."""
        return f"{self.base}:launching:{user}:{resource_id}"

    def applied(self, marker: str) -> str:
        """The answer of a request applied here (`bus.cas.once`), for its retries."""
        return f"{self.base}:applied:{marker}"


def timer_member(kind: str, user: str, resource_id: str) -> str:
    return f"{kind}|{user}|{resource_id}"


def index_member(user: str, resource_id: str) -> str:
    return f"{user}/{resource_id}"


class Changes:
    """The index changes that go with each step of a record's life, as ops for `BrokerStore.commit`.

    Pure (it only names keys): the steps of `BrokerStore` commit them with the record.
    """

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def _timer(self, kind: str, record: Resource) -> str:
        return timer_member(kind, record.user, record.resource_id)

    def _pool(self, record: Resource, part: str) -> str:
        return self.keys.pool(record.user, record.broker_name, part)

    def indexed(self, record: Resource) -> list[Op]:
        """A new record enters the index (list-resources), at its creation time."""
        return [cas.zadd(self.keys.index, record.created_at, index_member(record.user, record.resource_id))]

    def launch(self, record: Resource, need: int, free: int, due: float) -> list[Op]:
        """Reserve `need` instances of the record's block (refused beyond `free` reserved in all),
        and set the `launch` timer at `due`."""
        block = record.resource_block_key
        return [
            cas.fits(self.keys.blocks, block, need, free),
            cas.hcount(self.keys.blocks, block, need),
            cas.zadd(self.keys.timers, due, self._timer("launch", record)),
        ]

    def pool_entry(self, record: Resource) -> list[Op]:
        """A broker's new resource: the broker must still exist; the resource warms in its pool."""
        return [
            cas.exists(self.keys.broker(record.user, record.broker_name)),
            cas.sadd(self._pool(record, "warming"), record.resource_id),
            *self.indexed(record),
        ]

    def deploying(self, record: Resource, trace_at: float) -> list[Op]:
        """The operator has the launch: the `launch` timer goes, and a `trace` timer follows the
        deployment from `trace_at` (a pool resource is followed by its broker's pool loop instead)."""
        ops = [cas.zrem(self.keys.timers, self._timer("launch", record))]
        if not record.in_pool:
            ops.append(cas.zadd(self.keys.timers, trace_at, self._timer("trace", record)))
        return ops

    def observed(self, before: Resource, after: Resource) -> list[Op]:
        """Instances that became ready return their reservation; a running record needs no trace."""
        ops: list[Op] = []
        ready = before.no_ready_instance - after.no_ready_instance
        if ready:
            ops.append(cas.hcount(self.keys.blocks, before.resource_block_key, -ready))
        if after.status == RUNNING:
            ops.append(cas.zrem(self.keys.timers, self._timer("trace", before)))
        return ops

    def release_begun(self, record: Resource, due: float) -> list[Op]:
        """A `release` timer at `due` (in case we die), and a pool resource moves to `deleting`."""
        ops = [cas.zadd(self.keys.timers, due, self._timer("release", record))]
        if record.in_pool:
            ops += self._pool_exit(record)
            ops.append(cas.sadd(self._pool(record, "deleting"), record.resource_id))
        return ops

    def released(self, record: Resource, forget_at: float) -> list[Op]:
        """Everything that still refers to `record` goes: its timers, its reservation, its pool; a
        `forget` timer at `forget_at`, when the released record has expired, takes its index entry."""
        ops = [cas.zrem(self.keys.timers, self._timer(kind, record)) for kind in ("launch", "trace", "release")]
        ops.append(cas.zadd(self.keys.timers, forget_at, self._timer("forget", record)))
        if record.no_ready_instance:
            ops.append(cas.hcount(self.keys.blocks, record.resource_block_key, -record.no_ready_instance))
        if record.broker_name:
            ops += self._pool_exit(record)
            ops += [cas.srem(self._pool(record, part), record.resource_id) for part in ("sold", "deleting")]
        return ops

    def accepted(self, record: Resource, since: float) -> list[Op]:
        """A warming pool resource passed the readiness gate: it is idle (ready) since `since`."""
        return [
            cas.srem(self._pool(record, "warming"), record.resource_id),
            cas.zadd(self._pool(record, "idle"), since, record.resource_id),
        ]

    def _pool_exit(self, record: Resource) -> list[Op]:
        return [
            cas.srem(self._pool(record, "warming"), record.resource_id),
            cas.zrem(self._pool(record, "idle"), record.resource_id),
        ]
