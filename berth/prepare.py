"""`berth prepare`: a deployment's files for servers that `berth up` does not start (compose.yaml).

Into a state folder it writes what `berth up` would: the credentials (NATS accounts and users,
Redis ACL users, creds files; berth/credentials.py), one node agent identity per agent
(`node-1` ... `node-N`), the TLS CA and a server certificate naming the servers' hosts
(berth/tls.py), the nats-server configuration (`nats/nats.conf`, which includes the accounts),
and an environment file per process (`env/<name>.env`, `export NAME='value'` lines a shell
sources): its server URLs, its creds file, its Redis URL with its own Redis user, the CA, the
prefix and, for an agent, its node. Paths are the folder's own: run it where the servers and
workers will read the folder (compose runs it in a container with the folder at `/state`). It is
idempotent: passwords, the CA and identities are made once and kept.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from urllib.parse import urlsplit

from berth import tls
from berth.accounts import STREAMS_ADMIN
from berth.credentials import Credentials, prepare as prepare_credentials, write_private
from berth.servers import nats_config_file
from bus.callers import Role

# The processes compose runs, each with an environment file of its own, and the user each runs as.
PROCESSES = {"allocation": "allocation", "broker": "broker", "metrics": "metrics", STREAMS_ADMIN: STREAMS_ADMIN,
             "admin": "admin"}


def agent_nodes(agents: int) -> list[str]:
    return [f"node-{k}" for k in range(1, agents + 1)]


def prepare(state: Path, prefix: str, *, agents: int, nats_url: str, redis_url: str) -> Credentials:
    state = Path(state).resolve()
    creds = prepare_credentials(state / "credentials", prefix)
    for node in agent_nodes(agents):
        if creds.agent_of(node) is None:
            creds = creds.with_identity(node, Role.AGENT, node)
    creds.write()
    hosts = tuple(dict.fromkeys(server_hosts(nats_url) + server_hosts(redis_url)))
    files = tls.prepare(state / "tls", hosts)
    nats_config_file(state / "nats" / "nats.conf", creds.nats_config, files, cluster=False)
    users = {**PROCESSES, **{f"agent-{k}": node for k, node in enumerate(agent_nodes(agents), 1)}}
    for process, user in users.items():
        env = {"NATS_URL": nats_url, "BERTH_NATS_CREDS": str(creds.nats_creds(user)), "BERTH_JS_DOMAIN": prefix,
               "BERTH_PREFIX": prefix, "BERTH_TLS_CA": str(files.ca)}
        if user in creds.redis_passwords or (user in creds.identities and creds.identities[user].is_agent):
            env["REDIS_URL"] = creds.redis_url(user, redis_url)
        if user in creds.identities and creds.identities[user].is_agent:
            env["BERTH_NODE"] = creds.identities[user].node
        write_env(state / "env" / f"{process}.env", env)
    return creds


def server_hosts(url: str) -> list[str]:
    """The hosts of a URL that lists one or several servers (`tls://a:4222,tls://b:4222`,
    `rediss+cluster://a:6379,b:6379`): what the TLS certificate must name."""
    scheme, _, rest = url.partition("://")
    return [urlsplit(f"{scheme}://{part.split('://')[-1]}").hostname for part in rest.split(",")]


def write_env(path: Path, values: dict[str, str]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, "".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items()))


def read_env(path: Path) -> dict[str, str]:
    """The values of an environment file `write_env` wrote."""
    values = {}
    for line in Path(path).read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = shlex.split(value)[0] if value else ""
    return values
