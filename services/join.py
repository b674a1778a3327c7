"""Joining a host: one file that gives a new host's agent everything it needs.

On a machine of the control plane, `berth user bundle NAME` writes the bundle of node agent
identity NAME (made with `berth user add NAME --role agent --node NODE`): the running
deployment's server URLs (as `berth up --listen` wrote them in `up.env`), the identity's NATS user
and password and its Redis user in the Redis URL, the deployment's CA, the prefix and the node.
On the host, `berth agent --bundle FILE` unpacks it into a private folder beside it and runs the
agent of that node with it. The bundle holds secrets: it is written readable by its owner only,
and is to be moved as such (scp). `berth user remove NAME` revokes it at once: its NATS
connections are closed and its Redis user deleted, whoever holds the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.credentials import Credentials, write_private

VERSION = 1


def make(creds: Credentials, name: str, up: dict[str, str]) -> dict:
    """The bundle of agent identity `name`, for the deployment whose `up.env` values are `up`."""
    identity = creds.identities.get(name)
    if identity is None or not identity.is_agent:
        raise ValueError(f"{name!r} is not a node agent's identity (berth user add {name} --role agent --node NODE)")
    if not up.get("NATS_URL") or not up.get("REDIS_URL"):
        raise ValueError("the deployment is not running (no up.env with its URLs): start `berth up` first")
    ca = up.get("BERTH_TLS_CA")
    return {
        "version": VERSION, "prefix": creds.prefix, "node": identity.node, "user": name,
        "password": identity.password, "nats_url": up["NATS_URL"],
        "redis_url": creds.redis_url(name, up["REDIS_URL"]), "js_domain": creds.prefix,
        "tls_ca": Path(ca).read_text() if ca else None,
    }


def write(path: Path, bundle: dict) -> None:
    write_private(path, json.dumps(bundle, indent=1) + "\n")


def unpack(path: Path) -> tuple[list[str], dict[str, str]]:
    """The agent's arguments and environment from bundle `path`: its creds file and CA go into
    `<path>.d/`, readable by the owner only; the Redis URL (with its password) into the environment."""
    try:
        bundle = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--bundle {path}: {error}") from None
    if bundle.get("version") != VERSION:
        raise ValueError(f"--bundle {path}: not a berth bundle of version {VERSION}")
    folder = Path(f"{path}.d")
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    creds = folder / f"{bundle['user']}.nats"
    write_private(creds, f"user={bundle['user']}\npassword={bundle['password']}\nnode={bundle['node']}\n")
    env = {"REDIS_URL": bundle["redis_url"]}
    if bundle.get("tls_ca"):
        write_private(folder / "ca.pem", bundle["tls_ca"])
        env["BERTH_TLS_CA"] = str(folder / "ca.pem")
    argv = ["--node", bundle["node"], "--prefix", bundle["prefix"], "--nats", bundle["nats_url"],
            "--nats-creds", str(creds), "--js-domain", bundle["js_domain"]]
    return argv, env
