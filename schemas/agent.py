"""Requests, replies and events of the agent service (docs/agents.md).

Every command is `agent.<node>.<command>` below the prefix: each host's agent answers for its own
node only. An instance is one process the agent runs for a caller (the broker's operator): its id
is the caller's (the broker uses the allocation workload id), unique on the node; a `start` of an
id that exists answers what runs under it, so a retried start never runs a second process.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from schemas.common import Event, Request
from schemas.patterns import END, matching, printable
from schemas.subjects import ShortName

# Printable text of at most 256 characters: the broker's workload ids ("broker/<user>/<id>/<n>").
InstanceId = printable(min_length=1, max_length=256)
Protocol = Literal["tcp", "http"]
Cpu = Annotated[int, Meta(ge=0, le=65535)]
# A status reply of this many instances stays well under NATS's 1 MiB max payload (about 300 bytes each).
MAX_INSTANCES_PER_REQUEST = 1000
MAX_ENTRIES = 64  # env variables, ports, volumes of one instance
EnvName = matching(rf"^[A-Za-z_][A-Za-z0-9_]*{END}", "a letter or '_', then letters, digits or '_'",
                   max_length=128)
# starting: the process runs, a port does not answer yet; ready: every port answers (or it has none);
# unready: it was ready and a port stopped answering; exited: the process is gone.
InstanceStateName = Literal["starting", "ready", "unready", "exited"]
AgentStatus = Literal["up", "draining"]


class Volume(Struct):
    host_dir: str
    container_dir: str = ""


class InstanceParam(Struct):
    """What runs: `image` names an entry of the agent's catalog (`--catalog`), which says the
    command; `env` sets only the variables that entry takes; every port gets a free port on the
    host as `PORT_<NAME>`, every volume its host folder as `VOLUME_<NAME>`."""

    image: Annotated[str, Meta(max_length=128)]
    env: Annotated[dict[EnvName, str], Meta(max_length=MAX_ENTRIES)] = {}
    ports: Annotated[dict[ShortName, Protocol], Meta(max_length=MAX_ENTRIES)] = {}
    volumes: Annotated[dict[ShortName, Volume], Meta(max_length=MAX_ENTRIES)] = {}


class Owner(Struct, frozen=True):
    """Whose instance it is, as the broker names it: carried back in every event of the instance."""

    user: str = ""
    resource_id: str = ""
    index: int = 0


class StartInstance(Struct):
    """Start an instance unless one with this id exists (then its state is the answer).

    `cpus` and `mems` are the CPUs and NUMA nodes the allocation bound (empty: not bound): the
    process is confined to them (a cpuset cgroup where the host allows it, else its CPU affinity).
    `memory_limit` (bytes, 0: none) is its memory cgroup's limit. With `workload_id` the instance
    lives only as long as the node's allocation ledger holds that workload: an agent that finds it
    released (after the node was down, say) stops the instance.

    Not a `Request` by type: the agent keeps it in its state folder, read leniently at restart; the
    bus refuses an unknown key in a `start` all the same (`bus.codec.decode`)."""

    instance: InstanceId
    param: InstanceParam
    cpus: Annotated[list[Cpu], Meta(max_length=4096)] = []
    mems: Annotated[list[Cpu], Meta(max_length=1024)] = []
    memory_limit: Annotated[int, Meta(ge=0)] = 0
    workload_id: Annotated[str, Meta(max_length=256)] = ""
    owner: Owner = Owner()


class InstanceRequest(Request):
    instance: InstanceId


class InstancesRequest(Request):
    instances: Annotated[list[InstanceId], Meta(max_length=MAX_INSTANCES_PER_REQUEST)]


class ListInstances(Request):
    offset: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


class InstanceInfo(Struct):
    """One instance as the agent knows it. `address` is where its ports are reached (the agent's
    `--address`); `pinning` says how its CPUs are enforced: "cgroup", "affinity" or "none"."""

    instance: str
    state: InstanceStateName
    address: str
    ports: dict[str, int]
    pid: int
    image: str
    cpus: list[int] = []
    mems: list[int] = []
    memory_limit: int = 0
    workload_id: str = ""
    owner: Owner = Owner()
    pinning: str = "none"
    cgroup: str = ""  # the instance's cgroup path (relative to each hierarchy's root), "" for none
    started_at: float = 0.0  # unix seconds
    exit_code: int | None = None  # None while it runs, and for an adopted process (not our child)
    exited_at: float | None = None


class InstancesReply(Struct):
    instances: list[InstanceInfo]
    missing: list[str] = []  # ids the agent runs no instance under


class InstancePage(Struct):
    instances: list[InstanceInfo]
    total: int


class Stopped(Struct):
    """`stopped`: whether an instance was running or known under this id (a second stop: false)."""

    instance: str
    stopped: bool


class Drain(Request):
    """`draining: true` takes the node out of new placements until `draining: false`."""

    draining: bool = True


class AgentInfo(Struct):
    node: str
    status: AgentStatus
    address: str
    instances: int  # instances it runs (exited ones included until they are stopped)
    running: int  # of which still running
    pinning: str  # how it confines CPUs on this host: "cgroup", "affinity" or "none"
    started_at: float
    heartbeat_seconds: float
    ttl_seconds: float
    capacity: dict  # the `resource` map it registered, keyed by plugin


class InstanceEvent(Event, kw_only=True):
    """`<prefix>.events.agent.<node>.<started|ready|unready|exited|stopped>`."""

    node: str
    instance: str
    state: InstanceStateName
    workload_id: str = ""
    owner: Owner = Owner()
    pid: int = 0
    exit_code: int | None = None


class AgentEvent(Event, kw_only=True):
    """`<prefix>.events.agent.<node>.host.<registered|capacity|draining|resumed>`: the host's news."""

    node: str
    status: AgentStatus
    capacity: dict = {}
