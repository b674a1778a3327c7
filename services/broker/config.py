"""Broker worker configuration: intervals and timeouts, instance types, namespace."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.broker.messages import InstanceType


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
