"""What each step of a resource's life writes into its record, and the decisions taken from a record
alone (crm reference §1). Pure: the callers load records and the store writes what these return,
so every function takes the time `t` it stamps.
"""

from __future__ import annotations

import msgspec

from schemas.broker import ResourceParam
from services.broker.model import DELETING, DEPLOYING, RELEASED, RUNNING, BrokerConfig, Resource, new_record

replace = msgspec.structs.replace


def created(user: str, resource_id: str, param: ResourceParam, t: float) -> Resource:
    """An `init`ed record: known, not launched."""
    return new_record(user, resource_id, param, created_at=t, updated_at=t)


def in_city(record: Resource, city: str | None) -> Resource:
    """`launch` may name another city than the one the param was initialized with."""
    return replace(record, param=replace(record.param, city=city)) if city else record


def launched(record: Resource, block: str, need: int, deadline: float) -> Resource:
    """A cold launch of `need` instances of `block`, to be deploying by `deadline`."""
    return replace(
        record,
        launched=True,
        resource_block_key=block,
        request_instance=need,
        no_ready_instance=need,
        deadline=deadline,
    )


def scaled(record: Resource, need: int, deadline: float) -> Resource:
    """A running record asked for `need` more instances: deploying again until they are up."""
    return replace(
        record,
        status=DEPLOYING,
        request_instance=record.request_instance + need,
        no_ready_instance=need,
        deadline=deadline,
        message="",
    )


def pool_resource(broker: BrokerConfig, resource_id: str, block: str, t: float, deadline: float) -> Resource:
    """A new resource of `broker`'s pool (crm's Broker.Launch), to be accepted by `deadline`."""
    return new_record(
        broker.user,
        resource_id,
        broker.param,
        broker_name=broker.name,
        created_at=t,
        updated_at=t,
        launched=True,
        resource_block_key=block,
        request_instance=broker.instance,
        no_ready_instance=broker.instance,
        deadline=deadline,
    )


def sold(caller: Resource, t: float) -> Resource:
    """The caller's record once a pool sells it a resource (the claim links the two)."""
    return replace(
        caller,
        status=RUNNING,
        launched=True,
        resource_block_key="",
        request_instance=0,
        no_ready_instance=0,
        deadline=0.0,
        message="",
        updated_at=t,
    )


def pending(record: Resource, t: float) -> Resource:
    """A launch or scale written, not handed to the operator yet (the `launch` timer's work)."""
    return replace(record, pending=True, updated_at=t)


def deploying(record: Resource, message: str, t: float) -> Resource:
    """The operator has the launch (`message`: why it failed, if it did)."""
    return replace(record, status=DEPLOYING, pending=False, message=message, updated_at=t)


def deleting(record: Resource, t: float) -> Resource:
    return replace(record, status=DELETING, updated_at=t)


def released(record: Resource, t: float) -> Resource:
    return replace(record, status=RELEASED, no_ready_instance=0, updated_at=t)


# -- decisions ---------------------------------------------------------------------------------


def launch_abandoned(record: Resource | None) -> bool:
    """Released (or being released) while launching: whatever the launch started must stop."""
    return record is None or record.status in (RELEASED, DELETING)


def traced(record: Resource) -> bool:
    """Whether the `trace` timer follows `record` (a pool's deploying resource is its pool loop's)."""
    return record.status == DEPLOYING and not record.in_pool


def operator_holds(record: Resource) -> bool:
    """Whether releasing `record` must release instances on the operator (a sold caller's record
    has none of its own: its broker resource does)."""
    return record.launched and not record.broker_resource_id


def release_retried(broker: BrokerConfig | None) -> bool:
    """crm's release pool retries a failed release; a broker's own resources only if the broker has
    `release_loop` (else they stay `deleting` until released by hand)."""
    return broker is None or broker.release_loop
