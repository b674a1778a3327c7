"""The broker worker's own options (`berth worker broker --help`: the common ones are in
bus/settings.py, read the same way), its intervals and timeouts, and its instance types."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import msgspec

from bus.settings import Env, own_fields
from schemas.broker import InstanceType
from schemas.sizes import parse_size

OPERATOR_ENV = "BERTH_BROKER_OPERATOR"  # where instances run, unless --operator says


@dataclass(frozen=True)
class Timing:
    """Every period and timeout the broker keeps (crm's defaults); tests shorten them."""

    pool_interval: float = 1.0  # a broker's pool loop runs this often (crm: 1 s)
    lease_seconds: float = 5.0  # a pool-loop lease not renewed for this long moves to another replica
    sweep_interval: float = 1.0  # durable timers are looked at this often (also the deploy trace period)
    claim_seconds: float = 30.0  # a replica working on a timer owns it this long before others retry it
    trace_timeout: float = 180.0  # a deployment not finished by then is released (crm: 3 min)
    ready_timeout: float = 240.0  # a broker resource not accepted by then is released (crm: 4 min)
    cooling_seconds: float = 600.0  # a broker whose launch failed does not launch for this long (crm: 10 min)
    recycle_seconds: float = 60.0  # idle recycling releases at most one resource per broker this often
    release_retry_seconds: float = 60.0  # a failed release is retried this often (crm: 60 s)


class InstanceTypeRule(msgspec.Struct, forbid_unknown_fields=True):
    """An instance type for one platform and group (city); sizes <= 0 keep the defaults."""

    platform: str
    group: str
    cpu_per_instance: float = 0.0
    mem_per_instance: int = 0


class InstanceTypes:
    """crm's GetInstanceType: the defaults, overridden by the first rule for (platform, group)."""

    def __init__(self, cpu: float, mem: int, rules: list[InstanceTypeRule] | None = None) -> None:
        self.default = InstanceType(cpu_per_instance=cpu, mem_per_instance=mem)
        self.rules = rules or []

    @classmethod
    def parse(cls, cpu: float, mem: int, rules_json: str) -> InstanceTypes:
        """`rules_json`: a JSON list of {platform, group, cpu_per_instance?, mem_per_instance?}."""
        try:
            rules = msgspec.json.decode(rules_json or "[]", type=list[InstanceTypeRule])
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError
            raise SystemExit(f"--instance-types: {error}") from None
        return cls(cpu, mem, rules)

    def get(self, platform: str, group: str) -> InstanceType:
        for rule in self.rules:
            if (rule.platform, rule.group) == (platform, group):
                return InstanceType(
                    cpu_per_instance=rule.cpu_per_instance
                    if rule.cpu_per_instance > 0
                    else self.default.cpu_per_instance,
                    mem_per_instance=rule.mem_per_instance
                    if rule.mem_per_instance > 0
                    else self.default.mem_per_instance,
                )
        return self.default


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
                            default=env.get(OPERATOR_ENV, "process"),
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
        timing = Timing(**own_fields(Timing, args))
        memory = parse_size(args.mem_per_instance, "--mem-per-instance")
        return cls(**own_fields(cls, args, skip={"timing", "mem_per_instance"}), mem_per_instance=memory,
                   timing=timing)
