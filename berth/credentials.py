"""Credentials of a berth deployment: a NATS user per service and per identity (an account of its
own, see berth/accounts.py), and a Redis ACL user per service limited to its own keys.

`berth up` calls `prepare(<state>/credentials, prefix)`, which keeps random passwords and the
identities in `credentials.json` (made once, reused on every start, so creds files handed out stay
valid) and renders, from them and the prefix, on every start and on every `berth user` change:

    nats-server.conf     the NATS accounts and users (berth/accounts.py), for nats-server -c
    redis.conf           `aclfile`, plus `masteruser`/`masterauth` for replicas, for redis-server
    users.acl            the Redis users (SHA-256 password hashes)
    <user>.nats          `user=...` / `password=...`: a worker's `--nats-creds`, an identity's creds file

A first start makes two identities: `admin` (the operator's, printed by `berth up`) and
`dashboard` (a reader, for the dashboard `berth up` starts). Every file is readable by its owner
only (the folder too).

Redis: each service user gets `~P:S:*` and `~P:idem:P-S:*` and no pub/sub channel; every command
except the dangerous and admin ones, pub/sub, KEYS/SCAN/RANDOMKEY (key names of other services),
CLIENT subcommands other than ID/GETNAME/SETNAME (CLIENT TRACKING would report other keys' names),
and scripting: with Redis Functions (`prepare(..., redis_functions=True)`, which `berth up` asks
for on Redis >= 7.0, where it loads them) only FUNCTION LIST and FCALL of its own functions
(berth/redis_functions.py), else EVAL/EVALSHA/SCRIPT LOAD/SCRIPT EXISTS. Redis Cluster's read
commands (CLUSTER SLOTS/SHARDS/NODES, COMMAND, ASKING, READONLY) stay allowed. The `default` user is
the administrator, with its own password; replicas use it to reach their primary.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from berth import accounts
from berth.accounts import JOIN_SERVICE, SERVICE_USERS, STREAMS_ADMIN, Identity
from berth.redis_functions import fcall_rules
from bus.callers import ROLES, Role
from bus.connection import inbox_prefix

REDIS_ADMIN = "default"
NODE_NAME = re.compile(r"[A-Za-z0-9_-]{1,253}")  # schemas.subjects.NodeName: a subject token
REDIS_USERS = (*SERVICE_USERS, REDIS_ADMIN)
# The NATS users berth keeps passwords for: the workers', the streams' administrator, the join service.
NATS_USERS = (*SERVICE_USERS, STREAMS_ADMIN, JOIN_SERVICE)
# The identities a first start makes: the operator's, and the reader `berth up`'s dashboard runs as.
FIRST_IDENTITIES = {"admin": Role.ADMIN, "dashboard": Role.READER}

REDIS_COMMANDS = (
    "+@all", "-@dangerous", "-@admin", "-@pubsub", "-@scripting",
    "-scan", "-randomkey",
    "-client", "+client|id", "+client|getname", "+client|setname",
)
# Without Redis Functions a worker runs its scripts with EVALSHA, and loads them itself.
REDIS_EVAL = ("+eval", "+evalsha", "+script|load", "+script|exists")


# -- Redis -------------------------------------------------------------------------------------


def redis_key_patterns(prefix: str, service: str, node: str | None = None) -> tuple[str, ...]:
    """The keys of a service's Redis user: its own, and those of the services its processes also
    run (a `berth agent` is its node's metrics agent too); `node`: a node agent's, which reaches its
    node's metrics keys and its node's kept answers only."""
    if node is not None:
        return (f"{prefix}:metrics:{{{node}}}:*",  # services/metrics/notifier_store.py `node_base`
                *(f"{prefix}:idem:{prefix}-{each}:{accounts.COMMAND_TOKEN[each]}.{node}.*"
                  for each in accounts.served(service)))
    return tuple(pattern for each in accounts.served(service)
                 for pattern in (f"{prefix}:{each}:*", f"{prefix}:idem:{prefix}-{each}:*"))


def redis_rules(prefix: str, user: str, *, functions: bool = False, node: str | None = None) -> list[str]:
    """The ACL rules of a user (after `user <name> on #<hash>`): a service's, or with `node` that
    node's agent's; `functions`: the deployment's scripts are Redis Functions the administrator
    loaded."""
    if user == REDIS_ADMIN:
        return ["~*", "&*", "+@all"]
    service = "agent" if node is not None else user
    keys = [f"~{pattern}" for pattern in redis_key_patterns(prefix, service, node)]
    scripts = fcall_rules(service) if functions else REDIS_EVAL
    return ["resetkeys", *keys, "resetchannels", *REDIS_COMMANDS, *scripts]


def redis_acl(prefix: str, passwords: dict[str, str], agents: list[Identity] = (), *, functions: bool = False) -> str:
    """The Redis users: the services', the administrator, and each node agent's (its identity's
    name and password)."""
    users = [(user, passwords[user], None) for user in REDIS_USERS]
    users += [(agent.name, agent.password, agent.node) for agent in agents]
    lines = [" ".join(["user", user, *redis_user(prefix, user, password, node, functions=functions)])
             for user, password, node in users]
    return "\n".join(lines) + "\n"


def redis_user(prefix: str, user: str, password: str, node: str | None = None, *, functions: bool = False
               ) -> list[str]:
    """A Redis user's ACL rules, its password's hash first (`ACL SETUSER <user> reset ...` takes them too)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return ["on", f"#{digest}", *redis_rules(prefix, user, functions=functions, node=node)]


def redis_config(acl_path: Path, admin_password: str) -> str:
    return (
        "# written by berth up; rewritten on every start\n"
        f"aclfile {json.dumps(str(acl_path))}\n"
        f"masteruser {REDIS_ADMIN}\n"
        f"masterauth {json.dumps(admin_password)}\n"
    )


# -- URLs ----------------------------------------------------------------------------------------


def nats_url_with(url: str, user: str, password: str) -> str:
    """`url` (one or several, comma-separated) with `user:password@` in each."""
    return ",".join(_with_userinfo(part.strip(), user, password) for part in url.split(","))


def redis_url_with(url: str, user: str, password: str) -> str:
    """A `redis[s]://` or `redis[s]+cluster://host:port,...` URL with `user:password@`."""
    scheme, _, rest = url.partition("://")
    if scheme.endswith("+cluster"):  # several hosts: not a URL urlsplit reads
        rest = rest.rsplit("@", 1)[-1]
        return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"
    return _with_userinfo(url, user, password)


def _with_userinfo(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by the owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# -- a deployment's credentials ---------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    directory: Path
    prefix: str
    nats_passwords: dict[str, str]  # the services' NATS users, and the streams' administrator
    redis_passwords: dict[str, str]
    identities: dict[str, Identity]
    redis_functions: bool = False  # service users may call berth's Redis Functions, and run no other Lua

    @property
    def nats_config(self) -> Path:
        return self.directory / "nats-server.conf"

    @property
    def redis_config(self) -> Path:
        return self.directory / "redis.conf"

    @property
    def redis_acl(self) -> Path:
        return self.directory / "users.acl"

    @property
    def redis_admin(self) -> tuple[str, str]:
        return REDIS_ADMIN, self.redis_passwords[REDIS_ADMIN]

    def nats_creds(self, user: str) -> Path:
        """The creds file of a service's or an identity's NATS user."""
        return self.directory / f"{user}.nats"

    def nats_password(self, user: str) -> str:
        return self.identities[user].password if user in self.identities else self.nats_passwords[user]

    def nats_url(self, user: str, url: str) -> str:
        return nats_url_with(url, user, self.nats_password(user))

    def redis_url(self, user: str, url: str) -> str:
        """`url` as Redis user `user`: a service's, or a node agent's identity's."""
        agent = self.identities.get(user)
        return redis_url_with(url, user, agent.password if agent is not None else self.redis_passwords[user])

    def worker_launch(
        self, user: str, nats_url: str, redis_url: str, *, nats_auth: bool = True, redis_auth: bool = True
    ) -> tuple[list[str], dict[str, str]]:
        """The arguments and extra environment of a worker that runs as `user` (a service's, or a
        node agent's identity): its NATS user as a creds file (a path on the command line), its
        Redis URL with credentials in the environment, as any URL that carries a password (a
        command line is visible to every local user), and where it reaches the streams.
        `nats_auth`/`redis_auth`: False for a server that is not ours (its URL is passed as given)."""
        argv = ["--prefix", self.prefix]
        env: dict[str, str] = {}
        if nats_auth:
            argv += ["--nats-creds", str(self.nats_creds(user)), "--js-domain", self.prefix]
        if redis_auth:
            redis_url = self.redis_url(user, redis_url)
        for option, variable, url in (("--nats", "NATS_URL", nats_url), ("--redis", "REDIS_URL", redis_url)):
            if "@" in url:  # it carries a password
                env[variable] = url
            else:
                argv += [option, url]
        return argv, env

    def with_identity(self, name: str, role: Role, node: str | None = None) -> Credentials:
        """These credentials with identity `name` added (a new password), or given `role`; an
        agent's is bound to `node` (default: its name)."""
        accounts.check_name(name)
        if role == Role.AGENT:
            node = node or name
            if not NODE_NAME.fullmatch(node):
                raise ValueError(f"--node {node!r}: a node name is letters, digits, '_' and '-' (a subject token)")
        elif node is not None:
            raise ValueError("--node: only an agent's identity is bound to a node")
        known = self.identities.get(name)
        if known and known.is_agent != (role == Role.AGENT):
            raise ValueError(f"{name!r} is a {known.role.label}'s identity: an agent's and a caller's are never the "
                             "same (remove it first)")
        identity = replace(known, role=role, node=node) if known else Identity(name, role, _password(), node)
        return replace(self, identities={**self.identities, name: identity})

    def redis_user_of(self, name: str) -> list[str] | None:
        """The ACL rules of identity `name`'s Redis user; None: it has none (only agents have one)."""
        identity = self.identities.get(name)
        if identity is None or not identity.is_agent:
            return None
        return redis_user(self.prefix, name, identity.password, identity.node, functions=self.redis_functions)

    def agent_of(self, node: str) -> Identity | None:
        """The identity of `node`'s agent, if there is one."""
        return next((i for i in self.identities.values() if i.is_agent and i.node == node), None)

    def without_identity(self, name: str) -> Credentials:
        if name not in self.identities:
            raise KeyError(name)
        return replace(self, identities={k: v for k, v in self.identities.items() if k != name})

    def write(self) -> None:
        """Render every file from the passwords, the identities and the prefix; a creds file of a
        user that is gone is removed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        identities = {i.name: {"role": i.role.label, "password": i.password, **({"node": i.node} if i.node else {})}
                      for i in self.identities.values()}
        document = {"version": 2, "prefix": self.prefix, "redis_functions": self.redis_functions,
                    "nats": self.nats_passwords, "redis": self.redis_passwords, "identities": identities}
        write_private(self.directory / "credentials.json", json.dumps(document, indent=2) + "\n")
        write_private(self.nats_config, accounts.render(self.prefix, self.nats_passwords, list(self.identities.values())))
        agents = [i for i in self.identities.values() if i.is_agent]
        write_private(self.redis_acl, redis_acl(self.prefix, self.redis_passwords, agents, functions=self.redis_functions))
        write_private(self.redis_config, redis_config(self.redis_acl, self.redis_passwords[REDIS_ADMIN]))
        users = {**{user: (self.nats_passwords[user], None) for user in NATS_USERS},
                 **{i.name: (i.password, i.node) for i in self.identities.values()}}
        for user, (password, node) in users.items():
            bound = f"node={node}\n" if node else ""  # what `berth agent` checks its --node against
            write_private(self.nats_creds(user), f"user={user}\npassword={password}\n{bound}")
        for stale in self.directory.glob("*.nats"):
            if stale.stem not in users:
                stale.unlink()

    def context(self, name: str) -> Path:
        """Identity `name`'s NATS context: a file the nats CLI reads (`nats --context <file>`)."""
        return self.directory / f"{name}.context.json"

    def write_contexts(self, nats_url: str, ca: str | None) -> None:
        """Every identity's NATS context (ADR-21's fields: url, user, password, ca, jetstream_domain,
        inbox_prefix) for the servers at `nats_url`: what a standard NATS client needs to connect as
        it, in a file of the standard shape (berth's own creds files are `user=`/`password=` lines)."""
        for identity in self.identities.values():
            context = {"description": f"berth {self.prefix}: {identity.role.label} {identity.name}", "url": nats_url,
                       "user": identity.name, "password": identity.password, "ca": ca or ""}
            if identity.is_agent:
                context["inbox_prefix"] = inbox_prefix(self.prefix, "agent", identity.node)
            else:
                context["jetstream_domain"] = self.prefix
            write_private(self.context(identity.name), json.dumps(context, indent=1) + "\n")
        for stale in self.directory.glob("*.context.json"):
            if stale.name.removesuffix(".context.json") not in self.identities:
                stale.unlink()


def _password() -> str:
    return secrets.token_urlsafe(24)  # 192 bits; URL-safe, so it goes into URLs unescaped


def load(directory: Path, prefix: str | None = None, redis_functions: bool | None = None) -> Credentials:
    """The credentials kept in `directory/credentials.json` (new passwords for users it lacks, and
    the first identities when it has none), without writing anything; `prefix` and
    `redis_functions` None: as they were last written (`berth user` keeps what `berth up` chose)."""
    directory = Path(directory)
    stored: dict = {}
    path = directory / "credentials.json"
    if path.exists():
        stored = json.loads(path.read_text())
    prefix = prefix or stored.get("prefix") or "berth"
    if redis_functions is None:
        redis_functions = bool(stored.get("redis_functions"))
    nats = {user: stored.get("nats", {}).get(user) or _password() for user in NATS_USERS}
    redis = {user: stored.get("redis", {}).get(user) or _password() for user in REDIS_USERS}
    kept = stored.get("identities")
    if kept is None:  # a first start (or credentials of a berth before identities)
        kept = {name: {"role": role.label, "password": _password()} for name, role in FIRST_IDENTITIES.items()}
    identities = {name: Identity(name, ROLES[entry["role"]], entry["password"], entry.get("node"))
                  for name, entry in kept.items()}
    return Credentials(directory, prefix, nats, redis, identities, redis_functions)


def prepare(directory: Path, prefix: str, *, redis_functions: bool = False) -> Credentials:
    """The deployment's credentials (`load`), every file rendered again for `prefix` and
    `redis_functions` (see `Credentials`)."""
    credentials = load(directory, prefix, redis_functions)
    credentials.write()
    return credentials
