"""The broker's pure pieces, without servers: the index changes that go with each record step
(`layout.Changes`), the record transitions and decisions (`transitions`), and the query views."""

from __future__ import annotations

from schemas.broker import (
    AddBroker,
    BlockDetail,
    ConstStrategy,
    ListResources,
    ResourceParam,
    ResourceView,
)
from services.broker import transitions, views
from services.broker.layout import Changes, Keys
from services.broker.model import (
    DELETING,
    DEPLOYING,
    INIT,
    RELEASED,
    RUNNING,
    BrokerConfig,
    Resource,
    broker_config,
    new_record,
)

KEYS = Keys("p")
CHANGES = Changes(KEYS)
BASE = "p:broker:{p}"


def record(**fields) -> Resource:
    return new_record("u", "r1", ResourceParam(image="img"), **{"resource_block_key": "local", **fields})


def broker(**fields) -> BrokerConfig:
    defaults = dict(
        user="u",
        name="web",
        strategy=ConstStrategy(num=1),
        param=ResourceParam(image="img", broker_name="web"),
        instance=2,
        fit_fields=["city"],
        release_loop=False,
        idle_keep_seconds=0.0,
    )
    return BrokerConfig(**{**defaults, **fields})


# -- Changes -----------------------------------------------------------------------------------


def test_a_new_record_enters_the_index_at_its_creation_time():
    assert CHANGES.indexed(record(created_at=5.0)) == [("zadd", f"{BASE}:index", "5.0", "u/r1")]


def test_a_launch_reserves_within_the_free_instances_and_sets_its_timer():
    assert CHANGES.launch(record(), 2, 7, 100.0) == [
        ("fits", f"{BASE}:blocks", "local", "2", "7"),
        ("hcount", f"{BASE}:blocks", "local", "2"),
        ("zadd", f"{BASE}:timers", "100.0", "launch|u|r1"),
    ]


def test_a_pool_resource_needs_its_broker_and_warms_in_its_pool():
    pooled = record(broker_name="web", created_at=3.0)
    assert CHANGES.pool_entry(pooled) == [
        ("exists", f"{BASE}:broker:u:web"),
        ("sadd", f"{BASE}:pool:u:web:warming", "r1"),
        ("zadd", f"{BASE}:index", "3.0", "u/r1"),
    ]


def test_deploying_drops_the_launch_timer_and_traces_unless_in_a_pool():
    drop = ("zrem", f"{BASE}:timers", "launch|u|r1")
    assert CHANGES.deploying(record(), 9.0) == [drop, ("zadd", f"{BASE}:timers", "9.0", "trace|u|r1")]
    assert CHANGES.deploying(record(broker_name="web"), 9.0) == [drop]
    sold = record(broker_name="web", broker_sold=True)
    assert CHANGES.deploying(sold, 9.0)[1:] == [("zadd", f"{BASE}:timers", "9.0", "trace|u|r1")]


def test_observing_returns_ready_reservations_and_ends_the_trace_once_running():
    before = record(status=DEPLOYING, no_ready_instance=3)
    assert CHANGES.observed(before, record(status=DEPLOYING, no_ready_instance=1)) == [
        ("hcount", f"{BASE}:blocks", "local", "-2")
    ]
    assert CHANGES.observed(before, record(status=RUNNING, no_ready_instance=0)) == [
        ("hcount", f"{BASE}:blocks", "local", "-3"),
        ("zrem", f"{BASE}:timers", "trace|u|r1"),
    ]
    assert CHANGES.observed(before, before) == []


def test_a_release_begun_moves_a_pool_resource_to_deleting():
    timer = ("zadd", f"{BASE}:timers", "4.0", "release|u|r1")
    assert CHANGES.release_begun(record(), 4.0) == [timer]
    assert CHANGES.release_begun(record(broker_name="web"), 4.0) == [
        timer,
        ("srem", f"{BASE}:pool:u:web:warming", "r1"),
        ("zrem", f"{BASE}:pool:u:web:idle", "r1"),
        ("sadd", f"{BASE}:pool:u:web:deleting", "r1"),
    ]


def test_released_drops_timers_reservation_and_every_pool_membership_and_sets_the_forget_timer():
    timers = [("zrem", f"{BASE}:timers", f"{kind}|u|r1") for kind in ("launch", "trace", "release")]
    timers.append(("zadd", f"{BASE}:timers", "9.0", "forget|u|r1"))  # the index entry goes once it expired
    assert CHANGES.released(record(), 9.0) == timers
    assert CHANGES.released(record(broker_name="web", broker_sold=True, no_ready_instance=2), 9.0) == [
        *timers,
        ("hcount", f"{BASE}:blocks", "local", "-2"),
        ("srem", f"{BASE}:pool:u:web:warming", "r1"),
        ("zrem", f"{BASE}:pool:u:web:idle", "r1"),
        ("srem", f"{BASE}:pool:u:web:sold", "r1"),
        ("srem", f"{BASE}:pool:u:web:deleting", "r1"),
    ]


def test_an_accepted_resource_goes_from_warming_to_idle():
    assert CHANGES.accepted(record(broker_name="web"), 8.0) == [
        ("srem", f"{BASE}:pool:u:web:warming", "r1"),
        ("zadd", f"{BASE}:pool:u:web:idle", "8.0", "r1"),
    ]


# -- transitions -------------------------------------------------------------------------------


def test_created_and_launched():
    new = transitions.created("u", "r1", ResourceParam(city="a"), 2.0)
    assert (new.status, new.created_at, new.updated_at, new.launched) == (INIT, 2.0, 2.0, False)
    assert transitions.in_city(new, None) is new
    assert transitions.in_city(new, "b").param.city == "b"
    launched = transitions.launched(new, "blk", 3, 50.0)
    assert (launched.launched, launched.resource_block_key, launched.request_instance) == (True, "blk", 3)
    assert (launched.no_ready_instance, launched.deadline, launched.status) == (3, 50.0, INIT)


def test_scaled_adds_to_the_request_and_deploys_again():
    scaled = transitions.scaled(record(status=RUNNING, request_instance=2, message="old"), 3, 9.0)
    assert (scaled.status, scaled.request_instance, scaled.no_ready_instance) == (DEPLOYING, 5, 3)
    assert (scaled.deadline, scaled.message) == (9.0, "")


def test_a_pool_resource_carries_its_broker():
    made = transitions.pool_resource(broker(), "bweb-1", "blk", 1.0, 5.0)
    assert (made.user, made.broker_name, made.broker_sold, made.in_pool) == ("u", "web", False, True)
    assert (made.request_instance, made.no_ready_instance, made.deadline) == (2, 2, 5.0)
    assert made.param.broker_name == "web" and made.launched and made.created_at == 1.0


def test_sold_is_running_with_nothing_of_its_own():
    sold = transitions.sold(record(request_instance=2, no_ready_instance=2, message="x", deadline=3.0), 7.0)
    assert (sold.status, sold.launched, sold.resource_block_key, sold.request_instance) == (
        RUNNING,
        True,
        "",
        0,
    )
    assert (sold.no_ready_instance, sold.deadline, sold.message, sold.updated_at) == (0, 0.0, "", 7.0)


def test_the_release_steps():
    assert transitions.deleting(record(), 1.0).status == DELETING
    released = transitions.released(record(no_ready_instance=2), 1.0)
    assert (released.status, released.no_ready_instance, released.updated_at) == (RELEASED, 0, 1.0)
    deploying = transitions.deploying(transitions.pending(record(), 1.0), "boom", 2.0)
    assert (deploying.status, deploying.pending, deploying.message) == (DEPLOYING, False, "boom")


def test_decisions():
    assert transitions.launch_abandoned(None)
    assert transitions.launch_abandoned(record(status=DELETING))
    assert not transitions.launch_abandoned(record(status=DEPLOYING))
    assert transitions.traced(record(status=DEPLOYING))
    assert not transitions.traced(record(status=DEPLOYING, broker_name="web"))
    assert transitions.traced(record(status=DEPLOYING, broker_name="web", broker_sold=True))
    assert not transitions.traced(record(status=RUNNING))
    assert transitions.operator_holds(record(launched=True))
    assert not transitions.operator_holds(record(launched=True, broker_resource_id="b1"))
    assert not transitions.operator_holds(record())
    assert transitions.release_retried(None)
    assert transitions.release_retried(broker(release_loop=True))
    assert not transitions.release_retried(broker())


# -- views -------------------------------------------------------------------------------------


def test_list_filters_match_when_absent_or_equal():
    assert views.matches(ListResources(), record())
    assert views.matches(ListResources(user="u", status="init", broker_sold=False), record())
    assert not views.matches(ListResources(status="running"), record())
    assert not views.matches(ListResources(broker_name="web"), record())


def test_block_details_take_reservations_off_and_keep_blocks_only_reserved():
    capacity = views.unreserved("a", 10, 4, 6, cpu_total=8.0, mem_used=5)
    assert capacity == BlockDetail("a", 10, 4, 6, 6, 0, cpu_total=8.0, mem_used=5)
    assert views.block_details([capacity], {"a": 2, "gone": 1}) == [
        BlockDetail("a", 10, 4, 6, 4, 2, cpu_total=8.0, mem_used=5),
        BlockDetail("gone", 0, 0, 0, -1, 1),
    ]


def test_resource_detail():
    detail = views.resource_detail(record(no_ready_instance=2, created_at=4.0))
    assert (detail.block, detail.image, detail.not_ready_instance) == ("local", "img", 2)
    assert detail.created_at == 4.0


def test_a_record_is_its_view_plus_what_the_broker_recovers_with():
    made = record(status=RUNNING, request_instance=2, created_at=4.0, launched=True, version=3)
    view = made.view()
    assert type(view) is ResourceView and set(view.__struct_fields__) < set(made.__struct_fields__)
    assert (view.status, view.request_instance, view.resource_block_key) == (RUNNING, 2, "local")
    fresh = new_record("u", "r2", ResourceParam())
    assert (fresh.status, fresh.launched, fresh.version, fresh.broker_sold) == (INIT, False, 0, False)


def test_a_broker_config_is_the_request_without_its_id_and_names_its_resources():
    req = AddBroker(
        user="u",
        name="web",
        strategy=ConstStrategy(num=2),
        param=ResourceParam(image="img"),
        fit_fields=["city", "image", "city"],
        request_id="x",
    )
    config = broker_config(req)
    assert type(config) is BrokerConfig and "request_id" not in config.__struct_fields__
    assert (config.user, config.name, config.instance) == ("u", "web", 1)
    assert config.strategy == ConstStrategy(num=2)
    assert config.param == ResourceParam(image="img", broker_name="web")
    assert config.fit_fields == ["city", "image"]
