"""Every setting of berth, read from flags and the environment here and nowhere else.

Precedence, the same for every setting: a flag given on the command line wins over its
environment variable, which wins over the default. (Each flag's argparse default is its variable's
value, else the default; argparse then replaces it with the flag when one is given.) A setting with
no variable comes from its flag or its default; `BERTH_LOG_LEVEL` has no flag.

The configs are frozen, in the style of nats.micro's `ServiceConfig`: a worker gets its
`CommonConfig` (connections, prefix, request handling, Prometheus metrics, log level) and the
config of its own service (`AllocationServiceConfig`, `BrokerServiceConfig`, `MetricsServiceConfig`),
built once when the process starts (`parse_worker`). `DashboardConfig` is `berth dashboard`'s. The
`berth` command's connection options (`add_server_flags`, `add_client_flags`) and the rest of its
environment (`log_level`, `state_dir`, `redis_maxmemory`) are read here too.

`env` is any mapping of variables (tests pass a dict); by default the process's environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bus.errors import BerthError
from bus.subjects import NAME_CHARS, NAME_PATTERN
from services.broker.config import Timing

Env = Mapping[str, str]

MIN_INTERVAL = 1.0  # metrics: the shortest sampling interval, seconds


def _environ(env: Env | None) -> Env:
    return os.environ if env is None else env


def log_level(env: Env | None = None) -> str:
    """The logging level of every berth process (`BERTH_LOG_LEVEL`, default INFO)."""
    return _environ(env).get("BERTH_LOG_LEVEL", "INFO")


def state_dir(env: Env | None = None) -> str:
    """`berth up`'s state folder default (`BERTH_STATE`, default .berth)."""
    return _environ(env).get("BERTH_STATE", ".berth")


def redis_maxmemory(env: Env | None = None) -> str:
    """`berth up`'s Redis memory limit default (`BERTH_REDIS_MAXMEMORY`, default 1gb): a size as
    redis-server reads it (`512mb`, `2gb`; `0` is no limit)."""
    return _environ(env).get("BERTH_REDIS_MAXMEMORY", "1gb")


def up_tls(env: Env | None = None) -> bool:
    """Whether `berth up` starts its servers with TLS (`BERTH_TLS`, default on; `0`, `no`, `off` or
    `false`: off, as `--no-tls`)."""
    return _environ(env).get("BERTH_TLS", "1").strip().lower() not in ("0", "no", "off", "false")


def up_catalog(env: Env | None = None) -> str | None:
    """`berth up`'s catalog of images the broker may run (`BERTH_CATALOG`, default: the development
    catalog.toml of the repository berth runs from; none in an installed package)."""
    development = Path(__file__).resolve().parent.parent / "catalog.toml"
    return _environ(env).get("BERTH_CATALOG") or (str(development) if development.is_file() else None)


# -- argparse types ---------------------------------------------------------------------------------


def metrics_port(text: str) -> int | None:
    """A port number, or None (off) for an empty value or `off`."""
    if text.strip().lower() in ("", "off"):
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def seconds(minimum: float, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a number of seconds within [minimum, maximum]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not minimum <= value <= maximum:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text} s is not within [{minimum:g}, {maximum:g}] s")
        return value

    return parse


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer within [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is not within [{minimum}, {maximum}]")
        return value

    return parse


def node_name(text: str) -> str:
    if not NAME_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} must match [A-Za-z0-9_-]+ (it is a subject token)")
    return text


def default_node() -> str:
    """The host name's first label, with any character a subject token cannot hold made a '-'."""
    return re.sub(f"[^{NAME_CHARS}]", "-", socket.gethostname().split(".")[0]) or "node"


def provisioner_names() -> tuple[str, ...]:
    from services.metrics.provisioners import PROVISIONER_NAMES

    return PROVISIONER_NAMES


def provisioner_interval(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    names = provisioner_names()
    if not sep or name not in names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SECONDS, NAME one of {', '.join(names)}")
    return name, seconds(MIN_INTERVAL)(value)


# -- what every worker shares -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CommonConfig:
    """A worker's connections, prefix, request handling and Prometheus metrics."""

    nats: str | None = None  # NATS_URL; comma-separated servers
    nats_user: str | None = None  # NATS_USER
    nats_password: str | None = None  # NATS_PASSWORD
    nats_creds: str | None = None  # BERTH_NATS_CREDS
    nats_inbox_prefix: str | None = None  # BERTH_NATS_INBOX_PREFIX
    js_domain: str | None = None  # BERTH_JS_DOMAIN
    redis: str | None = None  # REDIS_URL
    prefix: str = "berth"  # BERTH_PREFIX
    concurrency: int = 64  # BERTH_CONCURRENCY
    drain_timeout: float = 10.0
    memory_stream: bool = False
    metrics_port: int | None = None  # BERTH_METRICS_PORT; None: off
    metrics_addr: str = "0.0.0.0"  # BERTH_METRICS_ADDR
    metrics_refresh: float = 10.0  # BERTH_METRICS_REFRESH
    log_level: str = "INFO"  # BERTH_LOG_LEVEL

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        parser.add_argument("--nats", default=env.get("NATS_URL"), help="NATS URL (env NATS_URL)")
        parser.add_argument(
            "--nats-user", default=env.get("NATS_USER"), help="NATS user (env NATS_USER; or user:password@ in the URL)"
        )
        parser.add_argument(
            "--nats-password", default=env.get("NATS_PASSWORD"),
            help="NATS password (env NATS_PASSWORD, better than this option: a command line is visible to every "
            "local user)",
        )
        parser.add_argument(
            "--nats-creds", default=env.get("BERTH_NATS_CREDS"), metavar="FILE",
            help="file with user=... and password=... lines, as `berth up` writes (env BERTH_NATS_CREDS)",
        )
        parser.add_argument(
            "--nats-inbox-prefix", default=env.get("BERTH_NATS_INBOX_PREFIX"),
            help="inbox root of the worker's own requests (default _INBOX_<prefix>-<service>, which the "
            "permissions `berth up` writes expect; env BERTH_NATS_INBOX_PREFIX)",
        )
        add_js_domain_flag(parser, env)
        parser.add_argument(
            "--redis", default=env.get("REDIS_URL"),
            help="Redis URL, redis://[user:password@]host:port/db or redis+cluster://[user:password@]host:port,... "
            "(env REDIS_URL)",
        )
        parser.add_argument(
            "--prefix", default=env.get("BERTH_PREFIX", "berth"), help="subject and key prefix (env BERTH_PREFIX)"
        )
        parser.add_argument(
            "--concurrency", type=int, default=int(env.get("BERTH_CONCURRENCY", "64")),
            help="requests served at once per process",
        )
        parser.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish requests on SIGTERM")
        parser.add_argument("--memory-stream", action="store_true", help="keep the events stream in memory (tests)")
        parser.add_argument(
            "--metrics-port", type=metrics_port, default=env.get("BERTH_METRICS_PORT", ""),
            metavar="PORT", help="serve Prometheus metrics on this port at /metrics, 0 for a free one "
            "(env BERTH_METRICS_PORT; default: off)",
        )
        parser.add_argument(
            "--metrics-addr", default=env.get("BERTH_METRICS_ADDR", "0.0.0.0"),
            help="address the metrics server listens on (env BERTH_METRICS_ADDR)",
        )
        parser.add_argument(
            "--metrics-refresh", type=float, default=float(env.get("BERTH_METRICS_REFRESH", "10")),
            metavar="SECONDS", help="figures a scrape reads from Redis (node totals, pool sizes) are read at most "
            "this often (env BERTH_METRICS_REFRESH)",
        )

    @classmethod
    def from_flags(cls, args: argparse.Namespace, env: Env) -> CommonConfig:
        if not NAME_PATTERN.match(args.prefix):
            raise SystemExit(f"--prefix {args.prefix!r} must match [A-Za-z0-9_-]+")
        return cls(**_own_fields(cls, args, skip={"log_level"}), log_level=log_level(env))


def _own_fields(cls: type, args: argparse.Namespace, skip: set[str] = frozenset()) -> dict[str, Any]:
    """The parsed flags named as the config's fields (a flag --x-y is the field x_y)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip}


# -- each service's own ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AllocationServiceConfig:
    share_base: int = 100  # BERTH_SHARE_BASE
    max_share: int = -1  # BERTH_MAX_SHARE
    max_deploy_count: int = 10000  # BERTH_MAX_DEPLOY_COUNT
    wait_replicas: int = 0  # BERTH_WAIT_REPLICAS; 0: answer without waiting (bus/replicas.py)
    wait_timeout_ms: int = 500  # BERTH_WAIT_TIMEOUT_MS
    lease_interval: float = 0.5  # seconds between looks for nodes whose agent's lease lapsed

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        parser.add_argument("--lease-interval", type=seconds(0.05, 60), default=0.5, metavar="SECONDS",
                            help="how often to look for nodes whose agent's lease lapsed, and mark them down "
                            "(a node is down within its agent's TTL plus this)")
        parser.add_argument("--share-base", type=int, default=int(env.get("BERTH_SHARE_BASE", "100")),
                            help="pieces per CPU core (env BERTH_SHARE_BASE)")
        parser.add_argument("--max-share", type=int, default=int(env.get("BERTH_MAX_SHARE", "-1")),
                            help="most fragments per core, -1 for no limit (env BERTH_MAX_SHARE)")
        parser.add_argument("--max-deploy-count", type=int, default=int(env.get("BERTH_MAX_DEPLOY_COUNT", "10000")),
                            help="the most instances one calculate-deploy or allocate asks for (more: "
                            "invalid_argument), and the storage plugin's capacity for requests without volumes "
                            "(env BERTH_MAX_DEPLOY_COUNT)")
        parser.add_argument("--wait-replicas", type=integer(0, 64), default=env.get("BERTH_WAIT_REPLICAS", "0"),
                            metavar="N", help="before answering, wait until N replicas of each Redis primary that "
                            "took the request's commits hold them (WAIT), else answer unavailable "
                            "(env BERTH_WAIT_REPLICAS; default 0: do not wait)")
        parser.add_argument("--wait-timeout-ms", type=integer(1, 60_000),
                            default=env.get("BERTH_WAIT_TIMEOUT_MS", "500"), metavar="MS",
                            help="how long --wait-replicas waits, per answer (env BERTH_WAIT_TIMEOUT_MS)")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> AllocationServiceConfig:
        return cls(**_own_fields(cls, args))


@dataclass(frozen=True, kw_only=True)
class BrokerServiceConfig:
    operator: str = "process"  # BERTH_BROKER_OPERATOR
    max_instances: int = 64  # BERTH_BROKER_MAX_INSTANCES
    namespace: str = ""  # BERTH_BROKER_NAMESPACE
    cpu_per_instance: float = 1.0
    mem_per_instance: int = 1 << 30  # bytes; the flag takes 1G, 512M...
    instance_types: str = "[]"  # BERTH_BROKER_INSTANCE_TYPES
    stop_grace: float = 5.0
    probe_timeout: float = 0.5
    workdir: str | None = None
    catalog: str | None = None  # BERTH_CATALOG; None: no image may run
    city_label: str = "city"
    platform_label: str = "platform"
    bind_cpus: bool = True
    placement: str = "spread"
    allocation_timeout: float = 10.0
    timing: Timing = field(default_factory=Timing)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        parser.add_argument("--operator", choices=["process", "allocation"],
                            default=env.get("BERTH_BROKER_OPERATOR", "process"),
                            help="where instances run (env BERTH_BROKER_OPERATOR)")
        parser.add_argument("--max-instances", type=int, default=int(env.get("BERTH_BROKER_MAX_INSTANCES", "64")),
                            help="process operator: instances it runs at most")
        parser.add_argument("--namespace", default=env.get("BERTH_BROKER_NAMESPACE", ""),
                            help="answer of get-namespace (default: the user)")
        parser.add_argument("--cpu-per-instance", type=float, default=1.0, help="default instance type: CPUs")
        parser.add_argument("--mem-per-instance", default="1G",
                            help="default instance type: memory (bytes or 1G, 512M...)")
        parser.add_argument("--instance-types", default=env.get("BERTH_BROKER_INSTANCE_TYPES", "[]"),
                            help='JSON list of {"platform", "group", "cpu_per_instance", "mem_per_instance"}')
        parser.add_argument("--stop-grace", type=float, default=5.0,
                            help="seconds between SIGTERM and SIGKILL on release")
        parser.add_argument("--probe-timeout", type=float, default=0.5, help="TCP readiness probe timeout")
        parser.add_argument("--workdir", default=None, help="working directory of launched processes")
        parser.add_argument("--catalog", default=env.get("BERTH_CATALOG"), metavar="PATH",
                            help="TOML file of the images the process operator may run (env BERTH_CATALOG; "
                            "default: none, every image is refused)")
        parser.add_argument("--city-label", default="city", help="allocation operator: node label holding the city")
        parser.add_argument("--platform-label", default="platform",
                            help="allocation operator: node label holding the platform")
        parser.add_argument("--no-bind-cpus", dest="bind_cpus", action="store_false",
                            help="allocation operator: do not ask for bound CPUs (no pinning)")
        parser.add_argument("--placement", choices=["spread", "pack"], default="spread",
                            help="allocation operator: how instances are spread over nodes")
        parser.add_argument("--allocation-timeout", type=float, default=10.0,
                            help="allocation operator: request timeout")
        defaults = Timing()
        for timing in fields(Timing):
            parser.add_argument(f"--{timing.name.replace('_', '-')}", dest=timing.name, type=float,
                                default=getattr(defaults, timing.name), help="seconds (see services/broker/config.py)")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> BrokerServiceConfig:
        from services.allocation.quantity import parse_size

        timing = Timing(**_own_fields(Timing, args))
        memory = parse_size(args.mem_per_instance, "--mem-per-instance")
        return cls(**_own_fields(cls, args, skip={"timing", "mem_per_instance"}), mem_per_instance=memory,
                   timing=timing)


@dataclass(frozen=True, kw_only=True)
class MetricsServiceConfig:
    node: str  # BERTH_NODE, default: the host name
    interval: float = 5.0  # BERTH_METRICS_INTERVAL
    provisioner_intervals: dict[str, float] = field(default_factory=dict)  # name -> seconds, overrides `interval`
    cgroup_paths: list[str] = field(default_factory=list)  # cgroups to sample besides the discovered ones
    insurance_seconds: float = 0.0  # 0: no staleness check; else at least 60 (katalyst's rule)
    notifier_lease: float = 30.0  # seconds a notifier registration lives unless renewed
    max_notifiers: int = 1000  # BERTH_METRICS_MAX_NOTIFIERS: live notifier registrations per node
    root: str = "/"  # BERTH_HOST_ROOT: where the host's /proc and /sys are (a fake host's tree, in tests)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        parser.add_argument("--node", type=node_name, default=env.get("BERTH_NODE") or default_node(),
                            help="this node's name in subjects (env BERTH_NODE; default: the host name)")
        parser.add_argument("--interval", type=seconds(MIN_INTERVAL),
                            default=float(env.get("BERTH_METRICS_INTERVAL", "5")),
                            help="seconds between rounds of each provisioner, at least 1 (env BERTH_METRICS_INTERVAL)")
        parser.add_argument("--provisioner-interval", type=provisioner_interval, action="append", default=[],
                            metavar="NAME=SECONDS",
                            help=f"one provisioner's interval, repeatable ({', '.join(provisioner_names())})")
        parser.add_argument("--cgroup-path", action="append", default=[], metavar="PATH",
                            help="a cgroup to sample besides the discovered ones (relative to the hierarchy root), "
                            "repeatable")
        parser.add_argument("--insurance-seconds", type=seconds(0), default=0.0,
                            help="reads of values older than this answer metric_expired (0: off; else at least 60)")
        parser.add_argument("--notifier-lease", type=seconds(1, 3600), default=30.0,
                            help="seconds a notifier registration lives unless renewed, when it asks for no lease")
        parser.add_argument("--max-notifiers", type=integer(1, 1_000_000),
                            default=env.get("BERTH_METRICS_MAX_NOTIFIERS", "1000"), metavar="N",
                            help="live notifier registrations a node takes, more are invalid_argument "
                            "(env BERTH_METRICS_MAX_NOTIFIERS)")
        parser.add_argument("--root", default=env.get("BERTH_HOST_ROOT", "/"), metavar="DIR",
                            help="the host's tree: its proc, sys and sys/fs/cgroup are read under DIR (a fake "
                            "host's tree, for tests; env BERTH_HOST_ROOT, default /)")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> MetricsServiceConfig:
        return cls(node=args.node, interval=args.interval, provisioner_intervals=dict(args.provisioner_interval),
                   cgroup_paths=args.cgroup_path, insurance_seconds=args.insurance_seconds,
                   notifier_lease=args.notifier_lease, max_notifiers=args.max_notifiers, root=args.root)


@dataclass(frozen=True, kw_only=True)
class AgentServiceConfig:
    """`berth agent`: its node's metrics agent (`metrics`), and the host's registration, lease and
    instances (services/agent/)."""

    metrics: MetricsServiceConfig
    state: str  # BERTH_AGENT_STATE, default .berth/agent/<node>
    labels: dict[str, str] = field(default_factory=dict)
    reserve_cpu: float = 0.0  # cores kept out of the node's capacity for the system
    reserve_memory: int = 0  # bytes
    heartbeat: float = 2.0  # seconds between heartbeats (and host re-reads)
    ttl: float = 6.0  # seconds without a heartbeat after which the node is down
    catalog: str | None = None  # BERTH_CATALOG: the images this host may run
    stop_grace: float = 5.0
    probe_timeout: float = 0.5
    address: str = "127.0.0.1"  # BERTH_AGENT_ADDRESS: where this host's instances are reached
    cgroups: bool = True  # confine instances in cgroups where the host allows it (else CPU affinity)
    cgroup_parent: str = "berth"  # instances' cgroups are /<parent>/<node>/<instance> in each hierarchy
    reconcile_interval: float = 60.0  # seconds between comparisons of what runs with the node's ledger
    stop_on_exit: bool = False  # stop every instance when the agent stops (`berth up`'s own machine)

    @property
    def node(self) -> str:
        return self.metrics.node

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        MetricsServiceConfig.add_flags(parser, env)
        parser.add_argument("--state", default=env.get("BERTH_AGENT_STATE"), metavar="DIR",
                            help="the agent's own folder: what it runs, to adopt after a restart (env "
                            "BERTH_AGENT_STATE; default .berth/agent/<node>)")
        parser.add_argument("--label", action="append", default=[], metavar="K=V",
                            help="a label of the node (city, platform, pool...), repeatable")
        parser.add_argument("--labels-file", metavar="FILE", help="a JSON map of labels (--label adds to it)")
        parser.add_argument("--reserve-cpu", type=seconds(0), default=0.0, metavar="CORES",
                            help="cores kept out of the node's capacity for the system")
        parser.add_argument("--reserve-memory", default="0", metavar="SIZE",
                            help="memory kept out of the node's capacity (bytes or 1G, 512M...)")
        parser.add_argument("--heartbeat", type=seconds(0.1, 60), default=2.0, metavar="SECONDS",
                            help="seconds between heartbeats; the host is read again as often")
        parser.add_argument("--ttl", type=seconds(0.3, 600), metavar="SECONDS",
                            help="seconds without a heartbeat after which the node is down (default 3 heartbeats)")
        parser.add_argument("--catalog", default=env.get("BERTH_CATALOG"), metavar="PATH",
                            help="TOML file of the images this host may run (env BERTH_CATALOG; default: none)")
        parser.add_argument("--stop-grace", type=seconds(0, 600), default=5.0,
                            help="seconds between SIGTERM and SIGKILL")
        parser.add_argument("--probe-timeout", type=seconds(0.01, 60), default=0.5,
                            help="TCP readiness probe timeout")
        parser.add_argument("--address", default=env.get("BERTH_AGENT_ADDRESS", "127.0.0.1"), metavar="IP",
                            help="the address this host's instances are reached at, given to the broker's callers "
                            "(env BERTH_AGENT_ADDRESS; default 127.0.0.1: this machine only)")
        parser.add_argument("--no-cgroups", dest="cgroups", action="store_false",
                            help="never make cgroups: pin instances with CPU affinity only")
        parser.add_argument("--cgroup-parent", type=node_name, default="berth", metavar="NAME",
                            help="instances' cgroups are /NAME/<node>/<instance> in each hierarchy (default berth)")
        parser.add_argument("--reconcile-interval", type=seconds(1, 86400), default=60.0, metavar="SECONDS",
                            help="how often to stop instances whose workload the node's ledger no longer holds")
        parser.add_argument("--stop-on-exit", action="store_true",
                            help="stop every instance when the agent stops (default: leave them to the next agent)")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> AgentServiceConfig:
        from services.allocation.quantity import parse_size

        labels = json.loads(Path(args.labels_file).read_text()) if args.labels_file else {}
        for pair in args.label:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise SystemExit(f"--label {pair!r}: give key=value")
            labels[key] = value
        ttl = args.ttl or 3 * args.heartbeat
        if ttl <= args.heartbeat:
            raise SystemExit(f"--ttl {ttl:g} must be longer than --heartbeat {args.heartbeat:g}")
        try:
            reserve_memory = parse_size(args.reserve_memory, "--reserve-memory")
        except BerthError as error:
            raise SystemExit(str(error)) from None
        metrics = MetricsServiceConfig.from_flags(args)
        return cls(metrics=metrics, state=args.state or f".berth/agent/{metrics.node}", labels=labels,
                   reserve_cpu=args.reserve_cpu, reserve_memory=reserve_memory, heartbeat=args.heartbeat,
                   ttl=ttl, catalog=args.catalog, stop_grace=args.stop_grace, probe_timeout=args.probe_timeout,
                   address=args.address, cgroups=args.cgroups, cgroup_parent=args.cgroup_parent,
                   reconcile_interval=args.reconcile_interval,
                   stop_on_exit=args.stop_on_exit)


AnyServiceConfig = AllocationServiceConfig | BrokerServiceConfig | MetricsServiceConfig | AgentServiceConfig

# Service name (a worker module's NAME) -> its config. A service module not listed has no options.
SERVICE_CONFIGS: dict[str, type[AnyServiceConfig]] = {
    "allocation": AllocationServiceConfig,
    "broker": BrokerServiceConfig,
    "metrics": MetricsServiceConfig,
    "agent": AgentServiceConfig,
}


def worker_parser(service: str, env: Env | None = None) -> argparse.ArgumentParser:
    env = _environ(env)
    parser = argparse.ArgumentParser(prog=f"berth worker {service}")
    CommonConfig.add_flags(parser, env)
    if service in SERVICE_CONFIGS:
        SERVICE_CONFIGS[service].add_flags(parser, env)
    return parser


def parse_worker(
    service: str, argv: list[str], env: Env | None = None
) -> tuple[CommonConfig, AnyServiceConfig | None]:
    """A worker's configs from its command line and environment (flag > env > default)."""
    env = _environ(env)
    args = worker_parser(service, env).parse_args(argv)
    config = SERVICE_CONFIGS[service].from_flags(args) if service in SERVICE_CONFIGS else None
    return CommonConfig.from_flags(args, env), config


# -- the dashboard --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    nats: str | None = None  # NATS_URL, a reader identity's
    prefix: str = "berth"  # BERTH_PREFIX
    js_domain: str | None = None  # BERTH_JS_DOMAIN
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one, printed
    quiet: bool = False  # `berth up` prints the URL itself

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
        env = _environ(env)
        parser.add_argument("--nats", default=env.get("NATS_URL"), help="NATS URL, a reader's (env NATS_URL)")
        parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"))
        add_js_domain_flag(parser, env)
        parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
        parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one, printed)")
        parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # `berth up` prints the URL

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> DashboardConfig:
        return cls(**_own_fields(cls, args))


# -- the `berth` command's connection options -------------------------------------------------------


def add_server_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth up` and `berth worker`: the servers and the prefix."""
    env = _environ(env)
    parser.add_argument("--nats", default=env.get("NATS_URL"), help="NATS URL (env NATS_URL)")
    parser.add_argument("--redis", default=env.get("REDIS_URL"), help="Redis URL (env REDIS_URL)")
    parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"))


def add_js_domain_flag(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    parser.add_argument(
        "--js-domain", default=_environ(env).get("BERTH_JS_DOMAIN"), metavar="DOMAIN",
        help="reach the event streams' JetStream API at $JS.<DOMAIN>.API: with berth's accounts the streams live "
        "in an account of their own, reached there (berth up prints BERTH_JS_DOMAIN=<prefix>; env "
        "BERTH_JS_DOMAIN; default: the connection's own $JS.API)",
    )


def add_redis_admin_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth redis-functions`: the Redis administrator's connection, and the prefix of the ACL
    rules it prints."""
    env = _environ(env)
    parser.add_argument("--redis", default=env.get("REDIS_URL"),
                        help="the administrator's Redis URL, redis[s]://default:PASSWORD@host:port/0 or "
                        "redis[s]+cluster://default:PASSWORD@host:port,... (env REDIS_URL: a password on a "
                        "command line is visible to every local user)")
    _add_tls_ca_flag(parser, env, "rediss://")
    parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"),
                        help="key prefix the printed ACL rules name (env BERTH_PREFIX, default berth)")


def add_metrics_port_flag(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth worker --metrics-port`: process k serves on PORT+k."""
    parser.add_argument("--metrics-port", type=metrics_port, default=_environ(env).get("BERTH_METRICS_PORT", ""),
                        metavar="PORT", help="Prometheus metrics: process k serves on PORT+k (0: free ports; "
                        "env BERTH_METRICS_PORT; default: off)")


def add_client_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth call`, `events`, `nodes`, `status`: a short-lived client's connection and prefix."""
    env = _environ(env)
    parser.add_argument("--nats", default=env.get("NATS_URL"),
                        help="NATS URL(s), comma-separated; nats://user:password@host:port works (env NATS_URL)")
    parser.add_argument("--nats-creds", default=env.get("BERTH_NATS_CREDS"), metavar="FILE",
                        help="user=... and password=... lines, as .berth/credentials/admin.nats "
                        "(env BERTH_NATS_CREDS)")
    add_js_domain_flag(parser, env)
    _add_tls_ca_flag(parser, env, "tls://")
    parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"),
                        help="subject prefix (env BERTH_PREFIX, default berth)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to standard error (-vv: debug)")


def _add_tls_ca_flag(parser: argparse.ArgumentParser, env: Env, scheme: str) -> None:
    parser.add_argument("--tls-ca", default=env.get("BERTH_TLS_CA"), metavar="FILE",
                        help=f"CA that signed a {scheme} server's certificate, as .berth/tls/ca.pem "
                        "(env BERTH_TLS_CA; default: the system's CAs)")
