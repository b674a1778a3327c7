"""Who sent a request, as NATS authenticated it, and what that caller may do (DESIGN.md §8).

With berth's accounts (berth/credentials.py) every caller is a NATS account of its own, named
`<role>_<name>` (`tenant_alice`), and reaches the services only through service imports made with
`share: true`. For such a request the server adds a `Nats-Request-Info` header whose `acc` names the
caller's account; a header the caller sent under that name is replaced, so the caller cannot choose
who it is. A request without the header comes from inside the services' own account (one service
asking another, as the broker asks allocation) or from a deployment without accounts (`--no-auth`,
servers given by URL): it acts as an admin with no name, as every caller did before accounts.

Roles are ordered: a reader reads and subscribes; a tenant also places and releases its own work;
an admin also changes nodes, capacity and brokers, and acts on anyone's work.
"""

from __future__ import annotations

import contextvars
import enum
import re
from dataclasses import dataclass

import msgspec

REQUEST_INFO = "Nats-Request-Info"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Role(enum.IntEnum):
    # A node's agent is no caller of its own: it is a user of the services' account whose NATS
    # permissions let it publish only on its node's subjects (`resource.node.<node>.>`), where the
    # subject names the node a request acts on (see `bus.service.Command.scope`).
    AGENT = -1
    NONE = 0  # an account that is not one of berth's identities: may do nothing
    READER = 1
    TENANT = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


ROLES = {role.label: role for role in (Role.READER, Role.TENANT, Role.ADMIN, Role.AGENT)}


@dataclass(frozen=True, slots=True)
class Caller:
    """`name` is the identity that owns what it makes; None for a service or an account-less
    deployment, whose requests act as an admin."""

    name: str | None
    role: Role

    def may(self, role: Role) -> bool:
        return self.role >= role

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may read something `owner` made: readers and admins read everything."""
        return self.role != Role.TENANT or owner == self.name

    def owns(self, owner: str | None) -> bool:
        """Whether this caller may change or release something `owner` made."""
        return self.owns_everything or (self.role == Role.TENANT and owner == self.name)

    @property
    def owns_everything(self) -> bool:
        """Whether this caller may change or release anyone's work: then no owner needs reading."""
        return self.role == Role.ADMIN

    def holds(self, owner: str | None) -> bool:
        """Whether this caller may release or change a workload that `owner` placed: what it `owns`,
        but the services' own account (no identity: the broker, the one service that releases) only
        what the services placed, so that no service credential reaches a tenant's workloads.
        Without accounts nobody has an identity and no workload an owner: nothing changes there."""
        return owner is None if self.name is None else self.owns(owner)

    @property
    def holds_everything(self) -> bool:
        """Whether `holds` is true of every owner: then no owner needs reading."""
        return self.owns_everything and self.name is not None

    def qualified(self, request_id: str) -> str:
        """A request id in this caller's own space: two tenants using the same id are two requests
        (their answers are kept apart, and so are the workload ids derived from them)."""
        return f"{self.name}:{request_id}" if self.name and request_id else request_id

    def __str__(self) -> str:
        return f"{self.role.label} {self.name}" if self.name else "the services' own account"


INTERNAL = Caller(None, Role.ADMIN)
NOBODY = Caller(None, Role.NONE)


def account_name(role: Role, name: str) -> str:
    """The NATS account of identity `name` with `role`."""
    return f"{role.label}_{name}"


def from_account(account: str) -> Caller:
    """The caller an account name stands for; an account berth did not make may do nothing."""
    label, sep, name = account.partition("_")
    if not sep or label not in ROLES or not NAME.fullmatch(name):
        return NOBODY
    return Caller(name, ROLES[label])


class _RequestInfo(msgspec.Struct):
    acc: str = ""


_decode_info = msgspec.json.Decoder(_RequestInfo).decode


def caller_of(headers: dict[str, str] | None) -> Caller:
    """The caller of a request, from the header the server added (see the module docstring)."""
    info = headers.get(REQUEST_INFO) if headers else None
    if info is None:
        return INTERNAL
    try:
        return from_account(_decode_info(info).acc)
    except msgspec.DecodeError:
        return NOBODY


# The caller of the request the current task serves (set by bus.service for every request).
current_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar("berth_caller", default=INTERNAL)
