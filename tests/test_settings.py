"""bus/settings.py (a worker's) and berth/settings.py (the berth command's): flag > environment variable >
default, for every config; frozen configs.

Pure: no server, no process environment (every test passes its own `env`).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from berth.settings import DashboardConfig, add_client_flags, add_metrics_port_flag, add_server_flags, state_dir
from bus.settings import CommonConfig, default_node, log_level, parse_worker
from services.allocation.config import AllocationServiceConfig
from services.broker.config import BrokerServiceConfig, Timing
from services.metrics.config import MetricsServiceConfig


def test_common_defaults_without_flags_or_environment():
    common, config = parse_worker("allocation", AllocationServiceConfig, [], env={})
    assert common == CommonConfig()
    assert (common.prefix, common.concurrency, common.metrics_port, common.metrics_refresh) == (
        "berth",
        64,
        None,
        10.0,
    )
    assert config == AllocationServiceConfig()


COMMON = [  # (flag, value, variable, its value, field, expected from the variable, expected from the flag)
    (
        "--nats",
        "nats://flag:4222",
        "NATS_URL",
        "nats://env:4222",
        "nats",
        "nats://env:4222",
        "nats://flag:4222",
    ),
    ("--nats-user", "fu", "NATS_USER", "eu", "nats_user", "eu", "fu"),
    ("--nats-password", "fp", "NATS_PASSWORD", "ep", "nats_password", "ep", "fp"),
    ("--nats-creds", "/f.nats", "BERTH_NATS_CREDS", "/e.nats", "nats_creds", "/e.nats", "/f.nats"),
    ("--nats-inbox-prefix", "_F", "BERTH_NATS_INBOX_PREFIX", "_E", "nats_inbox_prefix", "_E", "_F"),
    ("--redis", "redis://flag/0", "REDIS_URL", "redis://env/0", "redis", "redis://env/0", "redis://flag/0"),
    ("--prefix", "fromflag", "BERTH_PREFIX", "fromenv", "prefix", "fromenv", "fromflag"),
    ("--concurrency", "8", "BERTH_CONCURRENCY", "16", "concurrency", 16, 8),
    ("--idempotency-window", "60", "BERTH_IDEMPOTENCY_WINDOW", "90", "idempotency_window", 90.0, 60.0),
    ("--metrics-port", "9100", "BERTH_METRICS_PORT", "0", "metrics_port", 0, 9100),
    (
        "--metrics-addr",
        "127.0.0.2",
        "BERTH_METRICS_ADDR",
        "127.0.0.3",
        "metrics_addr",
        "127.0.0.3",
        "127.0.0.2",
    ),
    ("--metrics-refresh", "2.5", "BERTH_METRICS_REFRESH", "7", "metrics_refresh", 7.0, 2.5),
]


@pytest.mark.parametrize("flag, value, variable, env_value, name, from_env, from_flag", COMMON)
def test_common_flag_wins_over_environment_which_wins_over_default(
    flag, value, variable, env_value, name, from_env, from_flag
):
    default = getattr(CommonConfig(), name)
    assert getattr(parse_worker("broker", BrokerServiceConfig, [], env={})[0], name) == default
    assert getattr(parse_worker("broker", BrokerServiceConfig, [], env={variable: env_value})[0], name) == from_env
    assert getattr(parse_worker("broker", BrokerServiceConfig, [flag, value], env={variable: env_value})[0], name) == from_flag
    assert getattr(parse_worker("broker", BrokerServiceConfig, [flag, value], env={})[0], name) == from_flag


def test_common_flags_without_variable_and_the_log_level():
    common, _ = parse_worker("metrics", MetricsServiceConfig, ["--node", "n1", "--drain-timeout", "3", "--memory-stream"], env={})
    assert (common.drain_timeout, common.memory_stream, common.log_level) == (3.0, True, "INFO")
    assert parse_worker("metrics", MetricsServiceConfig, ["--node", "n1"], env={"BERTH_LOG_LEVEL": "DEBUG"})[0].log_level == "DEBUG"
    assert log_level({}) == "INFO" and log_level({"BERTH_LOG_LEVEL": "WARNING"}) == "WARNING"
    assert state_dir({}) == ".berth" and state_dir({"BERTH_STATE": "/s"}) == "/s"


def test_the_idempotency_window_defaults_to_two_minutes_and_refuses_what_is_not_a_duration():
    assert parse_worker("allocation", AllocationServiceConfig, [], env={})[0].idempotency_window == 120.0
    for bad in ("0", "-5", "nan", "soon", str(8 * 24 * 3600)):
        with pytest.raises(SystemExit):
            parse_worker("allocation", AllocationServiceConfig, ["--idempotency-window", bad], env={})


def test_metrics_port_off_values_and_a_bad_port():
    assert (
        parse_worker("allocation", AllocationServiceConfig, ["--metrics-port", "off"], env={"BERTH_METRICS_PORT": "9100"})[
            0
        ].metrics_port
        is None
    )
    assert parse_worker("allocation", AllocationServiceConfig, [], env={"BERTH_METRICS_PORT": ""})[0].metrics_port is None
    with pytest.raises(SystemExit):
        parse_worker("allocation", AllocationServiceConfig, ["--metrics-port", "70000"], env={})


def test_a_bad_prefix_is_refused_from_a_flag_or_the_environment():
    with pytest.raises(SystemExit, match="must match"):
        parse_worker("allocation", AllocationServiceConfig, ["--prefix", "a.b"], env={})
    with pytest.raises(SystemExit, match="must match"):
        parse_worker("allocation", AllocationServiceConfig, [], env={"BERTH_PREFIX": "a b"})


@pytest.mark.parametrize(
    "flag, variable, name, default",
    [
        ("--share-base", "BERTH_SHARE_BASE", "share_base", 100),
        ("--max-share", "BERTH_MAX_SHARE", "max_share", -1),
        ("--max-deploy-count", "BERTH_MAX_DEPLOY_COUNT", "max_deploy_count", 10000),
        ("--wait-replicas", "BERTH_WAIT_REPLICAS", "wait_replicas", 0),
        ("--wait-timeout-ms", "BERTH_WAIT_TIMEOUT_MS", "wait_timeout_ms", 500),
    ],
)
def test_allocation_precedence(flag, variable, name, default):
    assert getattr(parse_worker("allocation", AllocationServiceConfig, [], env={})[1], name) == default
    assert getattr(parse_worker("allocation", AllocationServiceConfig, [], env={variable: "7"})[1], name) == 7
    assert getattr(parse_worker("allocation", AllocationServiceConfig, [flag, "9"], env={variable: "7"})[1], name) == 9


@pytest.mark.parametrize("argv, env", [
    (["--wait-replicas", "-1"], {}), ([], {"BERTH_WAIT_REPLICAS": "one"}), (["--wait-timeout-ms", "0"], {}),
])
def test_a_negative_replica_count_or_a_timeout_of_zero_is_refused(argv, env):
    # WAIT with timeout 0 would block forever: never a worker's answer.
    with pytest.raises(SystemExit):
        parse_worker("allocation", AllocationServiceConfig, argv, env=env)


def test_broker_precedence_and_its_own_flags():
    _, config = parse_worker("broker", BrokerServiceConfig, [], env={})
    assert config == BrokerServiceConfig() and config.mem_per_instance == 1 << 30 and config.timing == Timing()
    env = {
        "BERTH_BROKER_OPERATOR": "allocation",
        "BERTH_BROKER_MAX_INSTANCES": "5",
        "BERTH_BROKER_NAMESPACE": "ns-env",
        "BERTH_BROKER_INSTANCE_TYPES": '[{"platform": "p"}]',
    }
    _, config = parse_worker("broker", BrokerServiceConfig, [], env=env)
    assert (config.operator, config.max_instances, config.namespace, config.instance_types) == (
        "allocation",
        5,
        "ns-env",
        '[{"platform": "p"}]',
    )
    _, config = parse_worker(
        "broker", BrokerServiceConfig,
        [
            "--operator",
            "process",
            "--max-instances",
            "6",
            "--namespace",
            "ns-flag",
            "--instance-types",
            "[]",
            "--mem-per-instance",
            "512M",
            "--no-bind-cpus",
            "--placement",
            "pack",
            "--pool-interval",
            "0.25",
        ],
        env=env,
    )
    assert (config.operator, config.max_instances, config.namespace, config.instance_types) == (
        "process",
        6,
        "ns-flag",
        "[]",
    )
    assert (config.mem_per_instance, config.bind_cpus, config.placement) == (512 << 20, False, "pack")
    assert config.timing == dataclasses.replace(Timing(), pool_interval=0.25)


def test_metrics_precedence_and_validation():
    _, config = parse_worker("metrics", MetricsServiceConfig, [], env={"BERTH_NODE": "env-node", "BERTH_METRICS_INTERVAL": "3"})
    assert (config.node, config.interval) == ("env-node", 3.0)
    _, config = parse_worker(
        "metrics", MetricsServiceConfig,
        [
            "--node",
            "flag-node",
            "--interval",
            "2",
            "--provisioner-interval",
            "cpu=4",
            "--cgroup-path",
            "/a",
            "--insurance-seconds",
            "60",
            "--notifier-lease",
            "10",
        ],
        env={"BERTH_NODE": "env-node", "BERTH_METRICS_INTERVAL": "3"},
    )
    assert config == MetricsServiceConfig(
        node="flag-node",
        interval=2.0,
        provisioner_intervals={"cpu": 4.0},
        cgroup_paths=["/a"],
        insurance_seconds=60.0,
        notifier_lease=10.0,
    )
    _, config = parse_worker("metrics", MetricsServiceConfig, [], env={})
    assert (config.node, config.interval, config.notifier_lease) == (default_node(), 5.0, 30.0)
    assert config.max_notifiers == 1000
    assert parse_worker("metrics", MetricsServiceConfig, [], env={"BERTH_METRICS_MAX_NOTIFIERS": "7"})[1].max_notifiers == 7
    assert parse_worker("metrics", MetricsServiceConfig, ["--max-notifiers", "5"], env={})[1].max_notifiers == 5
    for bad in (
        ["--node", "a.b"],
        ["--interval", "0.5"],
        ["--provisioner-interval", "nope=2"],
        ["--notifier-lease", "4000"],
    ):
        with pytest.raises(SystemExit):
            parse_worker("metrics", MetricsServiceConfig, bad, env={})


def test_a_service_settings_does_not_know_gets_the_common_flags_only():
    common, config = parse_worker("echo", None, ["--prefix", "p1"], env={"BERTH_SHARE_BASE": "7"})
    assert (common.prefix, config) == ("p1", None)
    with pytest.raises(SystemExit):
        parse_worker("echo", None, ["--share-base", "3"], env={})


def test_configs_are_frozen():
    common, config = parse_worker("allocation", AllocationServiceConfig, [], env={})
    for frozen, name in (
        (common, "prefix"),
        (config, "share_base"),
        (DashboardConfig(), "port"),
        (BrokerServiceConfig(), "operator"),
        (MetricsServiceConfig(node="n"), "interval"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, name, None)


def _parse(add, argv, env):
    parser = argparse.ArgumentParser()
    add(parser, env)
    return parser.parse_args(argv)


def test_dashboard_precedence():
    def config(argv, env):
        return DashboardConfig.from_flags(_parse(DashboardConfig.add_flags, argv, env))

    assert config([], {}) == DashboardConfig()
    env = {"NATS_URL": "nats://env:4222", "BERTH_PREFIX": "penv"}
    assert (config([], env).nats, config([], env).prefix) == ("nats://env:4222", "penv")
    flagged = config(["--nats", "nats://flag:4222", "--prefix", "pflag", "--port", "8080", "--quiet"], env)
    assert flagged == DashboardConfig(nats="nats://flag:4222", prefix="pflag", port=8080, quiet=True)


@pytest.mark.parametrize("add", [add_server_flags, add_client_flags])
def test_cli_connection_flags_precedence(add):
    assert _parse(add, [], {}).prefix == "berth" and _parse(add, [], {}).nats is None
    env = {
        "NATS_URL": "nats://env:4222",
        "REDIS_URL": "redis://env/0",
        "BERTH_PREFIX": "penv",
        "BERTH_NATS_CREDS": "/e.nats",
    }
    from_env = _parse(add, [], env)
    assert (from_env.nats, from_env.prefix) == ("nats://env:4222", "penv")
    from_flags = _parse(add, ["--nats", "nats://flag:4222", "--prefix", "pflag"], env)
    assert (from_flags.nats, from_flags.prefix) == ("nats://flag:4222", "pflag")
    if add is add_server_flags:
        assert (
            from_env.redis == "redis://env/0"
            and _parse(add, ["--redis", "redis://f/1"], env).redis == "redis://f/1"
        )
    else:
        assert (
            from_env.nats_creds == "/e.nats" and _parse(add, ["--nats-creds", "/f"], env).nats_creds == "/f"
        )


def test_berth_worker_metrics_port_precedence():
    assert _parse(add_metrics_port_flag, [], {}).metrics_port is None
    assert _parse(add_metrics_port_flag, [], {"BERTH_METRICS_PORT": "9200"}).metrics_port == 9200
    assert (
        _parse(add_metrics_port_flag, ["--metrics-port", "0"], {"BERTH_METRICS_PORT": "9200"}).metrics_port
        == 0
    )
