"""The allocation worker's own options (`berth worker allocation --help`); the common ones are in
bus/settings.py, which reads both the same way (flag > environment variable > default)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bus.settings import Env, integer, own_fields, seconds


@dataclass(frozen=True, kw_only=True)
class AllocationServiceConfig:
    share_base: int = 100  # BERTH_SHARE_BASE
    max_share: int = -1  # BERTH_MAX_SHARE
    max_deploy_count: int = 10000  # BERTH_MAX_DEPLOY_COUNT
    wait_replicas: int = 0  # BERTH_WAIT_REPLICAS; 0: answer without waiting (bus/replicas.py)
    wait_timeout_ms: int = 500  # BERTH_WAIT_TIMEOUT_MS
    lease_interval: float = 0.5  # seconds between looks for nodes whose agent's lease lapsed
    spread_sample: int = 64  # BERTH_SPREAD_SAMPLE

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        parser.add_argument("--lease-interval", type=seconds(0.05, 60), default=0.5, metavar="SECONDS",
                            help="how often to look for nodes whose agent's lease lapsed, and mark them down "
                            "(a node is down within its agent's TTL plus this)")
        parser.add_argument("--spread-sample", type=integer(1, 1_000_000), default=env.get("BERTH_SPREAD_SAMPLE", "64"),
                            metavar="S", help="spread over at most S nodes is exact (the least used after placement); "
                            "over more, each instance goes to the least used of S nodes drawn at random from the "
                            "selection (env BERTH_SPREAD_SAMPLE)")
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
        return cls(**own_fields(cls, args))
