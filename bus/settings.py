"""The settings every worker shares, read from flags and the environment (each service's own are
in its `config.py`, read the same way; the `berth` command's in berth/settings.py).

Precedence, the same for every setting: a flag given on the command line wins over its
environment variable, which wins over the default. (Each flag's argparse default is its variable's
value, else the default; argparse then replaces it with the flag when one is given.) A setting with
no variable comes from its flag or its default; `BERTH_LOG_LEVEL` has no flag.

The configs are frozen, in the style of nats.micro's `ServiceConfig`: a worker gets its
`CommonConfig` (connections, prefix, request handling, Prometheus metrics, log level) and the
config of its own service, which that service keeps in its `config.py` (`CONFIG` of its worker
module: `services/allocation/config.py` and so on), built once when the process starts
(`parse_worker`). The argparse types and `--nats`, `--prefix`, `--js-domain` are the `berth`
command's too.

`env` is any mapping of variables (tests pass a dict); by default the process's environment.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from bus.idempotency import DEFAULT_WINDOW
from schemas.subjects import NAME_CHARS, NAME_PATTERN

Env = Mapping[str, str]

MIN_INTERVAL = 1.0  # metrics: the shortest sampling interval, seconds
WEEK = 7 * 24 * 3600.0


def environ(env: Env | None) -> Env:
    return os.environ if env is None else env


def log_level(env: Env | None = None) -> str:
    """The logging level of every berth process (`BERTH_LOG_LEVEL`, default INFO)."""
    return environ(env).get("BERTH_LOG_LEVEL", "INFO")


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
    idempotency_window: float = DEFAULT_WINDOW  # BERTH_IDEMPOTENCY_WINDOW, seconds
    drain_timeout: float = 10.0
    memory_stream: bool = False
    metrics_port: int | None = None  # BERTH_METRICS_PORT; None: off
    metrics_addr: str = "0.0.0.0"  # BERTH_METRICS_ADDR
    metrics_refresh: float = 10.0  # BERTH_METRICS_REFRESH
    log_level: str = "INFO"  # BERTH_LOG_LEVEL

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None:
        add_nats_and_prefix(parser, env)
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
            "--concurrency", type=int, default=int(env.get("BERTH_CONCURRENCY", "64")),
            help="requests served at once per process",
        )
        parser.add_argument(
            "--idempotency-window", type=seconds(1, WEEK), metavar="SECONDS",
            default=env.get("BERTH_IDEMPOTENCY_WINDOW", str(int(DEFAULT_WINDOW))),
            help="how long the answer to a request_id is kept for its retries, and everything kept under it "
            f"(env BERTH_IDEMPOTENCY_WINDOW; default {DEFAULT_WINDOW:g}; docs/operations/sizing.md)",
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
        return cls(**own_fields(cls, args, skip={"log_level"}), log_level=log_level(env))


def own_fields(cls: type, args: argparse.Namespace, skip: set[str] = frozenset()) -> dict[str, Any]:
    """The parsed flags named as the config's fields (a flag --x-y is the field x_y)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip}


class ServiceConfig(Protocol):
    """A service's own frozen config (its `services/<service>/config.py`): its flags, and the
    config built from them."""

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Env) -> None: ...

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> Any: ...


def worker_parser(service: str, config: type[ServiceConfig] | None, env: Env | None = None) -> argparse.ArgumentParser:
    env = environ(env)
    parser = argparse.ArgumentParser(prog=f"berth worker {service}")
    CommonConfig.add_flags(parser, env)
    if config is not None:
        config.add_flags(parser, env)
    return parser


def parse_worker(
    service: str, config: type[ServiceConfig] | None, argv: list[str], env: Env | None = None
) -> tuple[CommonConfig, Any]:
    """A worker's configs from its command line and environment (flag > env > default): the common
    one, and its service's own (`config`; None for a service without options)."""
    env = environ(env)
    args = worker_parser(service, config, env).parse_args(argv)
    return CommonConfig.from_flags(args, env), config.from_flags(args) if config is not None else None


# -- the connection options every worker and command takes ------------------------------------------


def add_nats_and_prefix(
    parser: argparse.ArgumentParser, env: Env, nats_help: str = "NATS URL (env NATS_URL)"
) -> None:
    """`--nats` and `--prefix`, as every worker and command takes them (env NATS_URL, BERTH_PREFIX)."""
    parser.add_argument("--nats", default=env.get("NATS_URL"), help=nats_help)
    parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"),
                        help="subject and key prefix (env BERTH_PREFIX, default berth)")


def add_js_domain_flag(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    parser.add_argument(
        "--js-domain", default=environ(env).get("BERTH_JS_DOMAIN"), metavar="DOMAIN",
        help="reach the event streams' JetStream API at $JS.<DOMAIN>.API: with berth's accounts the streams live "
        "in an account of their own, reached there (berth up prints BERTH_JS_DOMAIN=<prefix>; env "
        "BERTH_JS_DOMAIN; default: the connection's own $JS.API)",
    )


