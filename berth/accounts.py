"""The NATS accounts of a berth deployment: who is who on the bus, and what each may reach.

`berth up` starts nats-server with the configuration `nats_config` renders (berth/credentials.py
writes it, `berth user add|remove` renders it again and reloads the server):

- `SERVICES` holds the workers' users (`allocation`, `broker`, `metrics`), each limited to what it
  serves, calls and publishes, and one user per node agent (an identity of role `agent`, bound to
  one node: `agent_permissions`): it serves only `P.agent.<node>.>` and `P.metrics.<node>.>`,
  publishes only its node's events, and calls allocation only on `P.resource.node.<node>.>`, where
  the subject names the node a request acts on. No service user may create, update or delete a
  stream (`berth up` sets them up with the administrator's user of `STREAMS`). It exports the
  command subjects (`P.resource.>`, `P.broker.>`, `P.metrics.>`, `P.agent.>`) and `$SRV.>`
  discovery as services, and `P.events.>` as a stream.
- `STREAMS` holds the JetStream streams (`P-events`, `P-metrics`) and nothing else. The services
  publish their events into it through a service import (so a publish is acknowledged by the
  stream), and call its stream API through imports under `$JS.P.API` (`js_api`).
- every identity (`berth user add NAME --role admin|tenant|reader`) is an account of its own,
  `<role>_<name>` (bus/callers.py reads the role and the name back from it), with one user of the
  same name. It imports the command subjects with `share: true`, so every request it sends carries
  a `Nats-Request-Info` header that the server writes: the services learn who asks from the
  server, never from the caller. Its inbox, its replies and its subscriptions are its own account's:
  nobody else sees them, and a reply subject it names is one of its own account's subjects (a
  request cannot make a service publish an event anywhere but back to its sender).
- an identity reads the event subjects its role may see (`visible_events`: a tenant sees node-level
  changes, the events of its own workloads (`resource.workload.<name>.>`, naming only its ids), its
  own broker events and the metrics; admins and readers see everything), and the
  streams through `CONSUMER_SLOTS` pull consumers per stream named `<name>-<k>`: it may create,
  read, acknowledge and delete those and no other consumer, and a tenant's consumers only filter
  what it may see (the filter travels in the API subject, which the export checks). A consumer's
  deliveries stay in `STREAMS`, where nothing listens, so a push consumer delivers nowhere.

P is the subject prefix. Workers send their own requests from `_INBOX_P-<service>` (`inbox_prefix`);
replies to an identity's requests go to `_R_.>` subjects, which the server maps back to the
identity's account.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bus.callers import NAME, Role, account_name
from bus.connection import inbox_prefix
from schemas.allocation import WORKLOAD_EVENTS

SERVICES = ("allocation", "broker", "metrics", "agent")
# The workers' own users; an agent runs as its node's identity instead (`agent_permissions`).
SERVICE_USERS = ("allocation", "broker", "metrics")
SERVICES_ACCOUNT = "SERVICES"
STREAMS_ACCOUNT = "STREAMS"
# The user of `STREAMS` that sets the streams up (`berth up`, before any worker starts).
STREAMS_ADMIN = "streams-admin"
# Joining hosts (berth/join.py): `berth up`'s join service answers `P.join.redeem` as this user of
# `SERVICES`; a host asks as the public user `join` of account `JOIN`, which may ask nothing else.
JOIN_SERVICE = "join-service"
JOIN_ACCOUNT = "JOIN"
# Pull consumers an identity may hold on each stream at once.
CONSUMER_SLOTS = 8

# The first subject token (below the prefix) of each service's commands, and of its events.
COMMAND_TOKEN = {"allocation": "resource", "broker": "broker", "metrics": "metrics", "agent": "agent"}
EVENT_TOKEN = {"allocation": "resource", "broker": "broker", "metrics": "metrics", "agent": "agent"}
# The events stream each service keeps its events in (`StreamSpec.name` of its worker module).
STREAM = {"allocation": "events", "broker": "events", "metrics": "metrics", "agent": "events"}
# The services each service sends requests to, and the commands it sends (below the prefix; an
# agent's `{node}` is its own node).
CALLS = {"allocation": (), "broker": ("allocation", "agent"), "metrics": (), "agent": ("allocation",)}
CALLED = {
    "broker": ("resource.allocate", "resource.release", "resource.list-nodes", "resource.get-nodes-deploy-capacity",
               "agent.*.start", "agent.*.stop", "agent.*.status"),
    "agent": ("resource.node.{node}.>",),
}
# The services whose events each service watches.
WATCHES = {"allocation": ("allocation",), "broker": ("allocation", "agent"), "metrics": (), "agent": ()}
# The other services a service's processes also run: a `berth agent` is its node's metrics agent too.
HOSTS = {"allocation": (), "broker": (), "metrics": (), "agent": ("metrics",)}
# Allocation events that describe a node, not anyone's workloads: what a tenant sees of them.
NODE_EVENT_KINDS = ("added", "removed", "capacity", "labels", "down", "up", "draining")
# Names an identity may not take: the workers' users, `resource`, which as a broker user would make
# `P.events.broker.resource.>` (every resource's status events) its own broker events, and the
# streams' administrator.
RESERVED_NAMES = frozenset((*SERVICES, "resource", STREAMS_ADMIN, JOIN_SERVICE, "join"))


def js_api(prefix: str) -> str:
    """Where services and identities reach the streams' JetStream API: nats-py `jetstream(domain=
    prefix)`, the nats CLI's `--js-domain <prefix>` (the plain `$JS.API` of an account without
    JetStream is answered by the server itself: "JetStream not enabled")."""
    return f"$JS.{prefix}.API"


def streams(prefix: str) -> dict[str, list[str]]:
    """Each stream and the event subjects it keeps."""
    kept: dict[str, list[str]] = {}
    for service in SERVICES:
        kept.setdefault(f"{prefix}-{STREAM[service]}", []).append(f"{prefix}.events.{EVENT_TOKEN[service]}.>")
    return kept


def served(service: str) -> tuple[str, ...]:
    """The services whose commands and events a service's processes serve and publish."""
    return (service, *HOSTS[service])


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise ValueError(f"{name!r}: an identity's name is 1 to 64 characters of letters, digits, '_' and '-'")
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved (taken by berth: {', '.join(sorted(RESERVED_NAMES))})")


@dataclass(frozen=True)
class Identity:
    """A caller of the bus: a NATS account and user of its own (see the module docstring)."""

    name: str
    role: Role
    password: str
    node: str | None = None  # an agent's node

    @property
    def account(self) -> str:
        return account_name(self.role, self.name)

    @property
    def is_agent(self) -> bool:
        return self.role == Role.AGENT


# -- what an identity sees ---------------------------------------------------------------------------


def visible_events(prefix: str, identity: Identity) -> list[str]:
    """The event subjects `identity` receives, by stream: its subscriptions, and what its consumers
    may filter."""
    return [subject for subjects in consumer_filters(prefix, identity).values() for subject in subjects]


def event_patterns(prefix: str, identity: Identity) -> list[str]:
    """The patterns `identity` may give `berth events` (below `<prefix>.events.`): what it receives,
    and what its consumers may filter (a replay of any other is refused)."""
    root = f"{prefix}.events."
    return [subject.removeprefix(root) for subject in visible_events(prefix, identity)]


def consumer_filters(prefix: str, identity: Identity) -> dict[str, list[str]]:
    """Per stream, the filter subjects `identity`'s consumers may take (each a pattern of subjects);
    a stream's whole subject list means any filter, the stream's default included."""
    events, metrics = f"{prefix}-events", f"{prefix}-metrics"
    kept = streams(prefix)
    if identity.role != Role.TENANT:
        return kept
    root, me = f"{prefix}.events", identity.name
    return {
        events: [*(f"{root}.resource.*.{kind}" for kind in NODE_EVENT_KINDS),
                 f"{root}.resource.{WORKLOAD_EVENTS}.{me}.>",
                 f"{root}.broker.{me}.>", f"{root}.broker.resource.{me}.>"],
        metrics: kept[metrics],
    }


# -- permissions of the users ---------------------------------------------------------------------


@dataclass(frozen=True)
class Permissions:
    publish_allow: tuple[str, ...]
    subscribe_allow: tuple[str, ...]

    def config(self) -> dict:
        return {"publish": {"allow": list(self.publish_allow)}, "subscribe": {"allow": list(self.subscribe_allow)}}


def service_permissions(prefix: str, service: str, node: str | None = None) -> Permissions:
    """What a service's user may publish and subscribe to; `node`: the agent of that node, whose
    commands, events and calls are its node's only."""
    scope = f".{node}" if node else ""
    own_inbox = f"{inbox_prefix(prefix, service, node)}.>"
    mine = served(service)
    callers = [caller for caller in SERVICES if set(mine) & set(CALLS[caller])]
    publish = [
        *(f"{prefix}.events.{EVENT_TOKEN[each]}{scope}.>" for each in mine),
        "_R_.>",  # replies to identities (the server maps them back to the identity's account)
        *(f"{inbox_prefix(prefix, caller)}.>" for caller in callers),  # replies to calling services
        own_inbox,  # bus.connection.subscriptions_in_place probes its own inbox
        *(f"{js_api(prefix)}.STREAM.INFO.{prefix}-{STREAM[each]}" for each in mine),
        *(f"{prefix}.{subject.format(node=node)}" for subject in CALLED.get(service, ())),
    ]
    subscribe = [
        *(f"{prefix}.{COMMAND_TOKEN[each]}{scope}.>" for each in mine),
        *(f"{prefix}.events.{EVENT_TOKEN[watched]}.>" for watched in WATCHES[service]),
        "$SRV.PING", "$SRV.INFO", "$SRV.STATS",
        *(f"$SRV.*.{prefix}-{each}{tail}" for each in mine for tail in ("", ".*")),
        own_inbox,
    ]
    return Permissions(tuple(dict.fromkeys(publish)), tuple(dict.fromkeys(subscribe)))


def agent_permissions(prefix: str, node: str) -> Permissions:
    """A node agent's: it serves, publishes and calls for `node` only (the module docstring)."""
    return service_permissions(prefix, "agent", node)


def identity_permissions(prefix: str) -> Permissions:
    """An identity asks (commands, discovery, its streams' API) and listens (its inbox, events).
    Everything it may publish leaves its account only through its imports, so these lists keep it
    from serving or faking subjects even inside its own account."""
    commands = [f"{prefix}.{token}.>" for token in dict.fromkeys(COMMAND_TOKEN.values())]
    return Permissions(
        publish_allow=(*commands, "$SRV.>", f"{js_api(prefix)}.>", "$JS.ACK.>"),
        subscribe_allow=("_INBOX.>", f"{prefix}.events.>"),
    )


# -- the configuration ----------------------------------------------------------------------------


class _Exports:
    """An account's exports and the matching imports, built up per subject."""

    def __init__(self, account: str) -> None:
        self.account = account
        self.exports: dict[tuple[str, str], dict] = {}
        self.imports: dict[str, list[dict]] = {}

    def service(self, subject: str, importer: str, *, local: str | None = None, stream_replies: bool = False) -> None:
        export = self.exports.setdefault(("service", subject), {"service": subject, "accounts": []})
        if stream_replies:
            export["response_type"] = "stream"
        export["accounts"].append(importer)
        entry: dict = {"service": {"account": self.account, "subject": subject}}
        if local and local != subject:
            entry["to"] = local
        self.imports.setdefault(importer, []).append(entry)

    def rendered(self) -> list[dict]:
        return list(self.exports.values())


def _slot_subjects(prefix: str, stream: str, slot: str, filters: list[str], any_filter: bool) -> list[tuple[str, bool]]:
    """The stream API subjects of one consumer slot (below `$JS.API.`), and whether each answers
    with several messages."""
    api = [(f"CONSUMER.INFO.{stream}.{slot}", False), (f"CONSUMER.DELETE.{stream}.{slot}", False),
           (f"CONSUMER.MSG.NEXT.{stream}.{slot}", True)]
    if any_filter:  # the filter in the body, or in the subject
        api += [(f"CONSUMER.CREATE.{stream}.{slot}", False), (f"CONSUMER.CREATE.{stream}.{slot}.>", False)]
    else:  # only the filters allowed, in the subject (the server refuses a body that differs)
        api += [(f"CONSUMER.CREATE.{stream}.{slot}.{subject}", False) for subject in filters]
    return api


def _stream_access(prefix: str, stream_exports: _Exports, identity: Identity) -> None:
    api = js_api(prefix)
    kept = streams(prefix)
    for stream, filters in consumer_filters(prefix, identity).items():
        any_filter = filters == kept[stream]
        if any_filter:  # the whole stream may be read: its state and any message too
            for subject in (f"STREAM.INFO.{stream}", f"STREAM.MSG.GET.{stream}", f"DIRECT.GET.{stream}",
                            f"DIRECT.GET.{stream}.>"):
                stream_exports.service(f"$JS.API.{subject}", identity.account, local=f"{api}.{subject}",
                                       stream_replies=subject.startswith("DIRECT"))
        for k in range(CONSUMER_SLOTS):
            slot = f"{identity.name}-{k}"
            for subject, several in _slot_subjects(prefix, stream, slot, filters, any_filter):
                stream_exports.service(f"$JS.API.{subject}", identity.account, local=f"{api}.{subject}",
                                       stream_replies=several)
            # acknowledgements name the consumer: `$JS.ACK.<stream>.<consumer>.<...>`
            stream_exports.service(f"$JS.ACK.{stream}.{slot}.>", identity.account)


def nats_config(prefix: str, service_passwords: dict[str, str], identities: list[Identity]) -> dict:
    """The nats-server `accounts` block (see the module docstring); `service_passwords` has the
    workers' users and `STREAMS_ADMIN`."""
    commands = [f"{prefix}.{token}.>" for token in dict.fromkeys(COMMAND_TOKEN.values())]
    stream_exports = _Exports(STREAMS_ACCOUNT)
    stream_exports.service(f"{prefix}.events.>", SERVICES_ACCOUNT)
    for stream in streams(prefix):
        subject = f"STREAM.INFO.{stream}"
        stream_exports.service(f"$JS.API.{subject}", SERVICES_ACCOUNT, local=f"{js_api(prefix)}.{subject}")
    identity_accounts = {}
    agents = sorted((i for i in identities if i.is_agent), key=lambda i: i.name)
    for identity in sorted((i for i in identities if not i.is_agent), key=lambda i: i.name):
        _stream_access(prefix, stream_exports, identity)
        imports = [
            *({"service": {"account": SERVICES_ACCOUNT, "subject": subject}, "share": True} for subject in commands),
            {"service": {"account": SERVICES_ACCOUNT, "subject": "$SRV.>"}},
            *({"stream": {"account": SERVICES_ACCOUNT, "subject": subject}}
              for subject in visible_events(prefix, identity)),
            *stream_exports.imports.get(identity.account, []),
        ]
        user = {"user": identity.name, "password": identity.password,
                "permissions": identity_permissions(prefix).config()}
        identity_accounts[identity.account] = {"users": [user], "imports": imports}
    services = {
        "users": [*({"user": service, "password": service_passwords[service],
                     "permissions": service_permissions(prefix, service).config()} for service in SERVICE_USERS),
                  *({"user": agent.name, "password": agent.password,
                     "permissions": agent_permissions(prefix, agent.node).config()} for agent in agents)],
        "exports": [*({"service": subject} for subject in commands),
                    {"service": "$SRV.>", "response_type": "stream"},
                    {"stream": f"{prefix}.events.>"}],
        "imports": stream_exports.imports[SERVICES_ACCOUNT],
    }
    streams_admin = {"user": STREAMS_ADMIN, "password": service_passwords[STREAMS_ADMIN]}
    redeem = f"{prefix}.join.redeem"
    services["users"].append({"user": JOIN_SERVICE, "password": service_passwords[JOIN_SERVICE],
                              "permissions": Permissions(("_R_.>",), (redeem,)).config()})
    services["exports"].append({"service": redeem, "accounts": [JOIN_ACCOUNT]})
    joining = {"users": [{"user": "join", "password": "join",  # public: it may only ask to redeem a token
                          "permissions": Permissions((redeem,), ("_INBOX.>",)).config()}],
               "imports": [{"service": {"account": SERVICES_ACCOUNT, "subject": redeem}}]}
    return {
        SERVICES_ACCOUNT: services,
        STREAMS_ACCOUNT: {"jetstream": "enabled", "users": [streams_admin], "exports": stream_exports.rendered()},
        JOIN_ACCOUNT: joining,
        **identity_accounts,
    }


def render(prefix: str, service_passwords: dict[str, str], identities: list[Identity]) -> str:
    """nats-server.conf's text (JSON is valid nats-server syntax)."""
    body = json.dumps(nats_config(prefix, service_passwords, identities), indent=1)
    return f"# written by berth for prefix {prefix!r}; rewritten on every start and by `berth user`\naccounts: {body}\n"
