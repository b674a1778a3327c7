"""A metrics worker's own options (`berth worker metrics --help`); the common ones are in
bus/settings.py, which reads both the same way (flag > environment variable > default)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from bus.settings import MIN_INTERVAL, Env, default_node, integer, node_name, seconds


def provisioner_names() -> tuple[str, ...]:
    from services.metrics.provisioners import PROVISIONER_NAMES  # the kernel readers: only when asked

    return PROVISIONER_NAMES


def provisioner_interval(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    names = provisioner_names()
    if not sep or name not in names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SECONDS, NAME one of {', '.join(names)}")
    return name, seconds(MIN_INTERVAL)(value)


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
