"""The `berth` command's settings, read as bus/settings.py reads a worker's (flag > environment
variable > default): `berth up`'s environment (`state_dir`, `redis_maxmemory`, `up_tls`,
`up_catalog`), `berth dashboard`'s config (`DashboardConfig`), and the connection options of `berth
up` and `berth worker` (`add_server_flags`, `add_metrics_port_flag`), `berth redis-functions`
(`add_redis_admin_flags`) and the everyday commands (`add_client_flags`).

`env` is any mapping of variables (tests pass a dict); by default the process's environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bus.settings import Env, add_js_domain_flag, add_nats_and_prefix, environ, metrics_port, own_fields


def state_dir(env: Env | None = None) -> str:
    """`berth up`'s state folder default (`BERTH_STATE`, default .berth)."""
    return environ(env).get("BERTH_STATE", ".berth")


def redis_maxmemory(env: Env | None = None) -> str:
    """`berth up`'s Redis memory limit default (`BERTH_REDIS_MAXMEMORY`, default 1gb): a size as
    redis-server reads it (`512mb`, `2gb`; `0` is no limit)."""
    return environ(env).get("BERTH_REDIS_MAXMEMORY", "1gb")


def up_tls(env: Env | None = None) -> bool:
    """Whether `berth up` starts its servers with TLS (`BERTH_TLS`, default on; `0`, `no`, `off` or
    `false`: off, as `--no-tls`)."""
    return environ(env).get("BERTH_TLS", "1").strip().lower() not in ("0", "no", "off", "false")


def up_catalog(env: Env | None = None) -> str | None:
    """`berth up`'s catalog of images the broker may run (`BERTH_CATALOG`, default: the development
    catalog.toml of the repository berth runs from; none in an installed package)."""
    development = Path(__file__).resolve().parent.parent / "catalog.toml"
    return environ(env).get("BERTH_CATALOG") or (str(development) if development.is_file() else None)


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
        env = environ(env)
        add_nats_and_prefix(parser, env, nats_help="NATS URL, a reader's (env NATS_URL)")
        add_js_domain_flag(parser, env)
        parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
        parser.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one, printed)")
        parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # `berth up` prints the URL

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> DashboardConfig:
        return cls(**own_fields(cls, args))


# -- the `berth` command's connection options -------------------------------------------------------


def add_server_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth up` and `berth worker`: the servers and the prefix."""
    env = environ(env)
    add_nats_and_prefix(parser, env)
    parser.add_argument("--redis", default=env.get("REDIS_URL"), help="Redis URL (env REDIS_URL)")


def add_redis_admin_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth redis-functions`: the Redis administrator's connection, and the prefix of the ACL
    rules it prints."""
    env = environ(env)
    parser.add_argument("--redis", default=env.get("REDIS_URL"),
                        help="the administrator's Redis URL, redis[s]://default:PASSWORD@host:port/0 or "
                        "redis[s]+cluster://default:PASSWORD@host:port,... (env REDIS_URL: a password on a "
                        "command line is visible to every local user)")
    _add_tls_ca_flag(parser, env, "rediss://")
    parser.add_argument("--prefix", default=env.get("BERTH_PREFIX", "berth"),
                        help="key prefix the printed ACL rules name (env BERTH_PREFIX, default berth)")


def add_metrics_port_flag(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth worker --metrics-port`: process k serves on PORT+k."""
    parser.add_argument("--metrics-port", type=metrics_port, default=environ(env).get("BERTH_METRICS_PORT", ""),
                        metavar="PORT", help="Prometheus metrics: process k serves on PORT+k (0: free ports; "
                        "env BERTH_METRICS_PORT; default: off)")


def add_client_flags(parser: argparse.ArgumentParser, env: Env | None = None) -> None:
    """`berth call`, `events`, `nodes`, `status`: a short-lived client's connection and prefix."""
    env = environ(env)
    add_nats_and_prefix(
        parser, env, nats_help="NATS URL(s), comma-separated; nats://user:password@host:port works (env NATS_URL)"
    )
    parser.add_argument("--nats-creds", default=env.get("BERTH_NATS_CREDS"), metavar="FILE",
                        help="user=... and password=... lines, as .berth/credentials/admin.nats "
                        "(env BERTH_NATS_CREDS)")
    add_js_domain_flag(parser, env)
    _add_tls_ca_flag(parser, env, "tls://")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to standard error (-vv: debug)")


def _add_tls_ca_flag(parser: argparse.ArgumentParser, env: Env, scheme: str) -> None:
    parser.add_argument("--tls-ca", default=env.get("BERTH_TLS_CA"), metavar="FILE",
                        help=f"CA that signed a {scheme} server's certificate, as .berth/tls/ca.pem "
                        "(env BERTH_TLS_CA; default: the system's CAs)")
