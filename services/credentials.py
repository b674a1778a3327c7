"""Credentials of a berth deployment: a NATS user per service with subject permissions, a client
user that may ask but not serve, and a Redis ACL user per service limited to its own keys.

`berth up` calls `prepare(<state>/credentials, prefix)`, which keeps random passwords in
`credentials.json` (made once, reused on every start, so URLs handed out stay valid) and renders,
from the passwords and the prefix, on every start:

    nats-server.conf     `authorization { users = [...] }`, for nats-server -c
    redis.conf           `aclfile`, plus `masteruser`/`masterauth` for replicas, for redis-server
    users.acl            the Redis users (SHA-256 password hashes)
    <user>.nats          `user=...` / `password=...` for a worker's `--nats-creds`

Every file is readable by its owner only (the folder too).

What each NATS user may do (P = the prefix, S = the service):

- a service subscribes to its own command subjects (P.resource.>, P.broker.>, P.metrics.>), to
  `$SRV.PING|INFO|STATS` and `$SRV.*.P-S[.*]` (micro discovery) and to its own inbox root
  `_INBOX_P-S.>` (the runner sets that inbox prefix, so replies to its own requests are private);
  allocation also to P.events.resource.> (its change watch);
- a service publishes its events (P.events.resource.>, P.events.broker.>, P.events.metrics.>),
  replies to clients (`_INBOX.>`) and to the services that call it (allocation to
  `_INBOX_P-broker.>`), the JetStream API calls of `EventBus.ensure_stream` on its own stream only
  (`$JS.API.STREAM.INFO|CREATE|UPDATE.<stream>`), and to its own inbox (`_INBOX_P-S.>`); the broker
  also sends requests to allocation (P.resource.>);
- the client user publishes requests (P.resource.>, P.broker.>, P.metrics.>, `$SRV.>`) and
  read-only JetStream calls on the events streams (stream info, message get, consumers and their
  acks), subscribes to P.events.> and `_INBOX.>`; it may not subscribe to a command subject (serve)
  nor publish on P.events.> (fake an event) nor on `_INBOX.>` (forge a reply).

Replies are allowed by subject (`_INBOX...`), not with nats-server's `allow_responses`: a response
permission lets a service publish once on *any* reply subject a request names, which overrides
the service's own allow and deny lists, so a client could have a service publish its answer onto
another service's event subjects or onto the JetStream API (`$JS.API.STREAM.PURGE...`).

Redis: each service user gets `~P:S:*` and `~P:idem:P-S:*` and no pub/sub channel; every command
except the dangerous and admin ones, pub/sub, KEYS/SCAN/RANDOMKEY (key names of other services),
CLIENT subcommands other than ID/GETNAME/SETNAME (CLIENT TRACKING would report other keys' names),
and scripting: with Redis Functions (`prepare(..., redis_functions=True)`, which `berth up` asks
for on Redis >= 7.0, where it loads them) only FUNCTION LIST and FCALL of its own functions
(services/redis_functions.py), else EVAL/EVALSHA/SCRIPT LOAD/SCRIPT EXISTS. Redis Cluster's read
commands (CLUSTER SLOTS/SHARDS/NODES, COMMAND, ASKING, READONLY) stay allowed. The `default` user is the
administrator, with its own password; replicas use it to reach their primary.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from services.redis_functions import fcall_rules

SERVICES = ("allocation", "broker", "metrics")
CLIENT = "client"
NATS_USERS = (*SERVICES, CLIENT)
REDIS_ADMIN = "default"
REDIS_USERS = (*SERVICES, REDIS_ADMIN)

# The first subject token (below the prefix) of each service's commands, and of its events.
COMMAND_TOKEN = {"allocation": "resource", "broker": "broker", "metrics": "metrics"}
EVENT_TOKEN = {"allocation": "resource", "broker": "broker", "metrics": "metrics"}
# The events stream each service keeps its events in (`StreamSpec.name` of its worker module).
STREAM = {"allocation": "events", "broker": "events", "metrics": "metrics"}
# The services each service sends requests to.
CALLS = {"allocation": (), "broker": ("allocation",), "metrics": ()}
# The service whose events each service watches.
WATCHES = {"allocation": ("allocation",), "broker": (), "metrics": ()}

REDIS_COMMANDS = (
    "+@all", "-@dangerous", "-@admin", "-@pubsub", "-@scripting",
    "-scan", "-randomkey",
    "-client", "+client|id", "+client|getname", "+client|setname",
)
# Without Redis Functions a worker runs its scripts with EVALSHA, and loads them itself.
REDIS_EVAL = ("+eval", "+evalsha", "+script|load", "+script|exists")


def inbox_prefix(prefix: str, service: str) -> str:
    """The inbox root of a service's own requests (nats-py `inbox_prefix`); not under `_INBOX.`,
    so the client user, who may subscribe to `_INBOX.>`, never sees what a service is answered."""
    return f"_INBOX_{prefix}-{service}"


def stream_names(prefix: str) -> list[str]:
    return sorted({f"{prefix}-{name}" for name in STREAM.values()})


# -- NATS --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()

    def config(self) -> dict:
        def side(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict:
            return {"allow": list(allow), **({"deny": list(deny)} if deny else {})}

        return {
            "publish": side(self.publish_allow, self.publish_deny),
            "subscribe": side(self.subscribe_allow, self.subscribe_deny),
        }


def service_permissions(prefix: str, service: str) -> Permissions:
    name = f"{prefix}-{service}"
    stream = f"{prefix}-{STREAM[service]}"
    own_inbox = f"{inbox_prefix(prefix, service)}.>"
    callers = [caller for caller in SERVICES if service in CALLS[caller]]
    publish = [
        f"{prefix}.events.{EVENT_TOKEN[service]}.>",
        "_INBOX.>",  # replies to clients
        *(f"{inbox_prefix(prefix, caller)}.>" for caller in callers),  # replies to calling services
        own_inbox,  # bus.connection.subscriptions_in_place probes its own inbox
        *(f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE")),
        *(f"{prefix}.{COMMAND_TOKEN[callee]}.>" for callee in CALLS[service]),
    ]
    subscribe = [
        f"{prefix}.{COMMAND_TOKEN[service]}.>",
        *(f"{prefix}.events.{EVENT_TOKEN[watched]}.>" for watched in WATCHES[service]),
        "$SRV.PING", "$SRV.INFO", "$SRV.STATS", f"$SRV.*.{name}", f"$SRV.*.{name}.*",
        own_inbox,
    ]
    return Permissions(tuple(publish), tuple(subscribe))


def client_permissions(prefix: str) -> Permissions:
    commands = [f"{prefix}.{token}.>" for token in dict.fromkeys(COMMAND_TOKEN.values())]
    jetstream = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST"]
    for stream in stream_names(prefix):
        jetstream += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.NAMES.{stream}",
            f"$JS.API.CONSUMER.LIST.{stream}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",
        ]
    return Permissions(
        publish_allow=(*commands, "$SRV.>", *jetstream),
        subscribe_allow=(f"{prefix}.events.>", "_INBOX.>"),
        publish_deny=(f"{prefix}.events.>", "_INBOX.>"),
        subscribe_deny=(*commands, "$SRV.>"),
    )


def nats_permissions(prefix: str, user: str) -> Permissions:
    return client_permissions(prefix) if user == CLIENT else service_permissions(prefix, user)


def nats_config(prefix: str, passwords: dict[str, str]) -> str:
    """A nats-server configuration holding the users (JSON is valid nats-server syntax)."""
    users = [
        {"user": user, "password": passwords[user], "permissions": nats_permissions(prefix, user).config()}
        for user in NATS_USERS
    ]
    body = json.dumps({"users": users}, indent=2)
    return f"# written by berth up for prefix {prefix!r}; rewritten on every start\nauthorization: {body}\n"


# -- Redis -------------------------------------------------------------------------------------


def redis_key_patterns(prefix: str, service: str) -> tuple[str, ...]:
    return (f"{prefix}:{service}:*", f"{prefix}:idem:{prefix}-{service}:*")


def redis_rules(prefix: str, user: str, *, functions: bool = False) -> list[str]:
    """The ACL rules of a user (after `user <name> on #<hash>`); `functions`: the deployment's
    scripts are Redis Functions the administrator loaded."""
    if user == REDIS_ADMIN:
        return ["~*", "&*", "+@all"]
    keys = [f"~{pattern}" for pattern in redis_key_patterns(prefix, user)]
    scripts = fcall_rules(user) if functions else REDIS_EVAL
    return ["resetkeys", *keys, "resetchannels", *REDIS_COMMANDS, *scripts]


def redis_acl(prefix: str, passwords: dict[str, str], *, functions: bool = False) -> str:
    lines = []
    for user in REDIS_USERS:
        digest = hashlib.sha256(passwords[user].encode()).hexdigest()
        lines.append(" ".join(["user", user, "on", f"#{digest}", *redis_rules(prefix, user, functions=functions)]))
    return "\n".join(lines) + "\n"


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


# -- creds files ---------------------------------------------------------------------------------


def read_creds_file(path: str | Path) -> tuple[str, str]:
    """(user, password) from a `--nats-creds` file: `user=...` and `password=...` lines."""
    values: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    if "user" not in values or "password" not in values:
        raise ValueError(f"{path}: expected user=... and password=... lines")
    return values["user"], values["password"]


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
    nats_passwords: dict[str, str]
    redis_passwords: dict[str, str]
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
        return self.directory / f"{user}.nats"

    def nats_url(self, user: str, url: str) -> str:
        return nats_url_with(url, user, self.nats_passwords[user])

    def redis_url(self, user: str, url: str) -> str:
        return redis_url_with(url, user, self.redis_passwords[user])

    def worker_launch(
        self, service: str, nats_url: str, redis_url: str, *, nats_auth: bool = True, redis_auth: bool = True
    ) -> tuple[list[str], dict[str, str]]:
        """A worker's arguments and extra environment: its NATS user as a creds file (a path on the
        command line), its Redis URL with credentials in the environment, as any URL that carries a
        password (a command line is visible to every local user). `nats_auth`/`redis_auth`: False
        for a server that is not ours (its URL is passed as given)."""
        argv = ["--prefix", self.prefix]
        env: dict[str, str] = {}
        if nats_auth:
            argv += ["--nats-creds", str(self.nats_creds(service))]
        if redis_auth:
            redis_url = self.redis_url(service, redis_url)
        for option, variable, url in (("--nats", "NATS_URL", nats_url), ("--redis", "REDIS_URL", redis_url)):
            if "@" in url:  # it carries a password
                env[variable] = url
            else:
                argv += [option, url]
        return argv, env

    def write(self) -> None:
        """Render every file from the passwords and the prefix."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        document = {"version": 1, "nats": self.nats_passwords, "redis": self.redis_passwords}
        write_private(self.directory / "credentials.json", json.dumps(document, indent=2) + "\n")
        write_private(self.nats_config, nats_config(self.prefix, self.nats_passwords))
        write_private(self.redis_acl, redis_acl(self.prefix, self.redis_passwords, functions=self.redis_functions))
        write_private(self.redis_config, redis_config(self.redis_acl, self.redis_passwords[REDIS_ADMIN]))
        for user in NATS_USERS:
            write_private(self.nats_creds(user), f"user={user}\npassword={self.nats_passwords[user]}\n")


def _password() -> str:
    return secrets.token_urlsafe(24)  # 192 bits; URL-safe, so it goes into URLs unescaped


def prepare(directory: Path, prefix: str, *, redis_functions: bool = False) -> Credentials:
    """The deployment's credentials: the passwords kept in `directory/credentials.json` (new ones
    for users it lacks), every file rendered again for `prefix` (and `redis_functions`, see
    `Credentials`)."""
    directory = Path(directory)
    stored: dict = {}
    path = directory / "credentials.json"
    if path.exists():
        stored = json.loads(path.read_text())
    nats = {user: stored.get("nats", {}).get(user) or _password() for user in NATS_USERS}
    redis = {user: stored.get("redis", {}).get(user) or _password() for user in REDIS_USERS}
    credentials = Credentials(directory, prefix, nats, redis, redis_functions)
    credentials.write()
    return credentials
