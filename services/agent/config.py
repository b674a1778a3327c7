"""A node agent's own options (`berth agent --help`): its metrics agent's, and the host's
registration, lease and instances; the common ones are in bus/settings.py."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from bus.settings import Env, node_name, seconds
from schemas.errors import BerthError
from schemas.sizes import parse_size
from services.metrics.config import MetricsServiceConfig


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
