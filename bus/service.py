"""The service runtime: typed endpoints on top of `nats.micro`.

    service = Service("berth-allocation", prefix="berth")

    @service.endpoint("resource.cpumem.calculate-deploy", CalculateDeploy, DeployReply)
    async def calculate_deploy(req: CalculateDeploy) -> DeployReply: ...

    await service.start(nc)
    await service.serve_until_signalled()      # SIGTERM/SIGINT -> drain

What the runtime adds to `nats.micro`:
- each request runs in its own task under a bounded concurrency limit (a NATS subscription
  otherwise handles one message at a time, so one slow request would block the rest);
- typed decode: a payload that does not decode or validate becomes an `invalid_argument` reply
  naming the field; the endpoint keeps serving;
- domain errors (`BerthError`) become the error headers and body of DESIGN.md §2; a store that
  cannot be reached, or is out of memory, becomes `unavailable` (503: nothing applied) while the
  request has sent no decisive write, and `outcome_unknown` (504) once it may have (bus.outcome;
  with a request id, bus.idempotency first tries to learn the outcome); anything else becomes
  `internal` with the traceback logged;
- the caller's identity and role (`bus.callers`): a command above the caller's role is refused
  `permission_denied` before anything else; handlers read the caller from `current_caller`, and a
  `request_id` is the caller's own (two tenants' ids never meet);
- optional idempotency by `request_id` (see `bus.idempotency`); a request whose `dry_run` is true
  changes nothing, so its id is neither claimed nor its answer kept;
- optional durable answers: the Redis writes a request noted are on N replicas before it is
  answered, else it answers `unavailable` (see `bus.replicas`);
- drain: queued requests finish and their replies flush before the connection closes;
- optional broadcast: every instance receives the request (its own queue group) and the first
  reply wins, for commands that must reach every replica (a write into per-process state); a
  broadcast endpoint may be idempotent too, each instance then keeping its own answers;
- Prometheus request metrics per endpoint: count, errors by code, duration (`bus.telemetry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro import ServiceConfig
from nats.micro.service import DEFAULT_QUEUE_GROUP
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from redis import exceptions as redis_errors

from bus import outcome
from bus.callers import Caller, Role, caller_of, current_caller
from bus.codec import decode, encode
from bus.connection import subscriptions_in_place
from bus.idempotency import IdempotencyStore, Reply
from bus.micro import MicroService
from bus.replicas import ReplicaWait, collecting
from bus.tasks import cancel_and_wait
from bus.telemetry import EndpointMeter, error_code
from schemas.common import ErrorBody, ErrorInfo
from schemas.errors import BerthError, InvalidArgument, OutcomeUnknown, PermissionDenied, Unavailable

log = logging.getLogger("berth.service")

Handler = Callable[[Any], Awaitable[Any]]

# Redis answers that mean "not now" rather than "wrong": a server restarting, a primary failing
# over to its replica, a cluster that lost a slot for a moment. They answer `unavailable` (503).
STORE_UNREACHABLE = (
    redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ClusterError,
    redis_errors.ReadOnlyError, redis_errors.TryAgainError, redis_errors.SlotNotCoveredError,
)
# A Redis at its `maxmemory` (with `noeviction`, as `berth up` runs it) refuses writes until memory
# is freed: "not now" as well. Every commit is one script, and Redis refuses a script at its first
# write, so a refused commit wrote nothing; the answer is `unavailable` (503), not kept for a retry.
STORE_FULL = (redis_errors.OutOfMemoryError,)
REPLY_HEADROOM = 4096  # of the server's max payload, left for a reply's headers


class _PlainRequest:
    """A message of a scoped command's subscription, answered as a micro request is (headers too)."""

    def __init__(self, nc: Client, msg: Msg) -> None:
        self._nc, self._reply = nc, msg.reply
        self.subject, self.data, self.headers = msg.subject, msg.data, msg.headers

    async def respond(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        await self._nc.publish(self._reply, data, headers=headers)


@dataclass(frozen=True)
class EndpointSpec:
    """One command: its subject (below the prefix), request and response types, and handler."""

    name: str
    subject: str
    request: type
    response: type
    handler: Handler
    idempotent: bool
    broadcast: bool = False
    undo: Callable[[Any, bytes], Awaitable[None]] | None = None
    role: Role = Role.ADMIN
    keep: Callable[[Any, Any], bytes | None] | None = None
    recall: Callable[[Any, bytes], Awaitable[Any]] | None = None
    scope: str | None = None  # see `Command.scope`


@dataclass(frozen=True)
class Command:
    """A command declared as data, so that schemas can be exported without running the service.

    `handler` names the method of the object passed to `Service.bind` that serves it.
    """

    subject: str
    request: type
    response: type
    handler: str
    idempotent: bool = False
    broadcast: bool = False
    # The type the service decodes, when it differs from the documented `request`: a subclass that
    # keeps a large field as `msgspec.Raw` for the handler to decode lazily.
    wire: type | None = None
    # For an idempotent command, the method that gives back the effect of an answer (the request and
    # the encoded answer) that could not be kept because its run lost the claim to a retry.
    undo: str | None = None
    # The least role that may call it (bus.callers); None: readers for a command that changes
    # nothing, admins for one that does (a new command is closed until it says who may call it).
    role: Role | None = None
    # For an idempotent command whose answer the store can rebuild: the method that gives the few
    # bytes to keep instead of the answer (`keep(request, answer) -> bytes | None`; None: keep the
    # answer whole), and the one that rebuilds the answer from them (`recall(request, kept)`).
    keep: str | None = None
    recall: str | None = None
    # The request field that the subject's `*` token must equal: the subject names what the request
    # acts on (`resource.node.*.node-heartbeat`, field `nodename`), so that NATS permissions on
    # subjects bound an identity to its own (a node agent may publish only on its node's subjects).
    # Such a command is another subject of a command that has an endpoint of its own: it is served by
    # a queue subscription of the same group, not a micro endpoint (one endpoint per command, none
    # with a wildcard: `$SRV.INFO` lists every command's subject).
    scope: str | None = None

    @property
    def least_role(self) -> Role:
        if self.role is not None:
            return self.role
        return Role.ADMIN if self.idempotent else Role.READER


def store_failed(tracked: outcome.Outcome, reason: str) -> BerthError:
    """What a request answers when its store failed: nothing applied, or it may have been."""
    if tracked.may_have_changed:
        return OutcomeUnknown(f"{reason} after a change was sent, which may have been made: send the request "
                              "again with the same request_id for the real answer")
    return Unavailable(f"{reason}; nothing was changed: retry")


def error_reply(error: BerthError) -> Reply:
    """The wire form of a domain error: status and message headers plus the error body."""
    headers = {ERROR_CODE_HEADER: str(error.status), ERROR_HEADER: error.message}
    body = encode(ErrorBody(ErrorInfo(code=error.code, message=error.message, details=error.details)))
    return Reply(body=body, headers=headers)


class Service:
    """One berth service instance on NATS: its endpoints (declared with `endpoint`, `add_endpoint` or
    `bind`, served once `start` is called) and what each request goes through on its way to a
    handler and back (see the module: a task per request, typed decoding, the caller's role,
    idempotency, errors as DESIGN.md §2 answers, drain). Several processes with the same `name`
    form one service: NATS spreads requests over them as a queue group."""

    def __init__(
        self,
        name: str,
        *,
        prefix: str = "berth",
        version: str = "0.1.0",
        description: str = "",
        concurrency: int = 64,
        idempotency: IdempotencyStore | None = None,
        metadata: dict[str, str] | None = None,
        replicas: ReplicaWait | None = None,
    ) -> None:
        self.name = name
        self.prefix = prefix
        self.version = version
        self.description = description
        self.concurrency = concurrency
        self.idempotency = idempotency
        self.metadata = metadata or {}
        self.replicas = replicas
        self.specs: list[EndpointSpec] = []
        self._micro: MicroService | None = None
        self._nc: Client | None = None
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._meters: dict[str, EndpointMeter] = {}  # Prometheus request metrics (bus.telemetry)
        self._scoped: list[Subscription] = []  # the scoped commands' subscriptions (`Command.scope`)

    # -- declaring endpoints -------------------------------------------------------------

    def endpoint(
        self, subject: str, request: type, response: type, *, name: str | None = None, idempotent: bool = False
    ) -> Callable[[Handler], Handler]:
        """Declare a command on `<prefix>.<subject>`; `idempotent` replays answers by `request_id`."""

        def register(handler: Handler) -> Handler:
            self.add_endpoint(subject, request, response, handler, name=name, idempotent=idempotent)
            return handler

        return register

    def add_endpoint(
        self,
        subject: str,
        request: type,
        response: type,
        handler: Handler,
        *,
        name: str | None = None,
        idempotent: bool = False,
        broadcast: bool = False,
        undo: Callable[[Any, bytes], Awaitable[None]] | None = None,
        role: Role = Role.ADMIN,
        keep: Callable[[Any, Any], bytes | None] | None = None,
        recall: Callable[[Any, bytes], Awaitable[Any]] | None = None,
        scope: str | None = None,
    ) -> None:
        if idempotent and self.idempotency is None:
            raise ValueError(f"endpoint {subject} is idempotent but the service has no idempotency store")
        if (keep is None) != (recall is None):
            raise ValueError(f"endpoint {subject}: an answer kept as a recipe needs both keep and recall")
        endpoint_name = name or subject.replace(".", "-")
        self.specs.append(
            EndpointSpec(endpoint_name.replace("*", "node"), subject, request, response, handler, idempotent,
                         broadcast, undo, role, keep, recall, scope)
        )

    def bind(self, commands: list[Command], target: object) -> None:
        """Serve each command with the method of `target` that it names."""
        for command in commands:
            handler = getattr(target, command.handler)
            self.add_endpoint(
                command.subject, command.wire or command.request, command.response, handler,
                idempotent=command.idempotent, broadcast=command.broadcast,
                undo=getattr(target, command.undo) if command.undo else None, role=command.least_role,
                keep=getattr(target, command.keep) if command.keep else None,
                recall=getattr(target, command.recall) if command.recall else None, scope=command.scope,
            )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, nc: Client) -> None:
        self._nc = nc
        config = ServiceConfig(
            name=self.name, version=self.version, description=self.description, metadata=self.metadata
        )
        self._micro = await MicroService.start(nc, config)
        for spec in self.specs:
            subject = f"{self.prefix}.{spec.subject}"
            if spec.scope is not None:
                # nats.micro's queue group: one instance gets each request, as an endpoint's
                self._scoped.append(await nc.subscribe(subject, queue=DEFAULT_QUEUE_GROUP, cb=self._plain(spec)))
            else:
                await self._micro.add_endpoint(spec.name, subject, self._dispatcher(spec), spec.broadcast)
            self._meters[spec.name] = EndpointMeter(self.name, spec.subject)
        await subscriptions_in_place(nc)  # so that "started" means every endpoint answers
        log.info("%s serving %d endpoints under %s (id %s)", self.name, len(self.specs), self.prefix, self.id)

    @property
    def id(self) -> str:
        return self._micro.id if self._micro else ""

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let queued and running ones finish (within `timeout`; those still
        running then are cancelled, see `bus.tasks`), flush replies."""
        if self._micro is None or self._nc is None:
            return
        deadline = time.monotonic() + timeout
        await self._micro.drain(deadline)
        for subscription in self._scoped:
            await subscription.drain()
        self._scoped.clear()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=max(0.1, deadline - time.monotonic()))
            if pending:
                log.error("%d requests still running after %.1f s; cancelling them", len(pending), timeout)
                await cancel_and_wait(*pending, timeout=max(0.1, deadline - time.monotonic()))
        await self._nc.flush(timeout=max(1, int(deadline - time.monotonic())))
        self._micro.stopped()
        self._micro = None

    async def serve_until_signalled(self, drain_timeout: float = 10.0) -> None:
        """Serve until SIGTERM or SIGINT, then drain; the caller closes the connection."""
        await serve_until_signalled([self], drain_timeout)

    # -- serving one request ---------------------------------------------------------------

    def _dispatcher(self, spec: EndpointSpec) -> Callable[[Request], Awaitable[None]]:
        async def dispatch(request: Request) -> None:
            # Waiting for a slot here is the backpressure: the subscription queues what we cannot take.
            await self._slots.acquire()
            task = asyncio.create_task(self._serve(spec, request))
            self._tasks.add(task)
            task.add_done_callback(self._finished)

        return dispatch

    def _plain(self, spec: EndpointSpec) -> Callable[[Msg], Awaitable[None]]:
        """A scoped command's subscription callback: the message answered as a micro request is."""
        dispatch = self._dispatcher(spec)

        async def deliver(msg: Msg) -> None:
            await dispatch(_PlainRequest(self._nc, msg))

        return deliver

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _serve(self, spec: EndpointSpec, request: Request) -> None:
        started = time.perf_counter_ns()
        reply = await self._answer(spec, request.data, caller_of(request.headers), request.subject)
        try:
            await request.respond(reply.body, headers=reply.headers)
        except Exception as error:  # no reply subject, or the connection is closing
            log.warning("%s: could not reply: %r", spec.subject, error)
        self._account(spec, time.perf_counter_ns() - started, reply)

    async def _answer(self, spec: EndpointSpec, data: bytes, caller: Caller, subject: str = "") -> Reply:
        if not caller.may(spec.role):
            return error_reply(PermissionDenied(
                f"{spec.subject} needs the {spec.role.label} role; {caller} may not call it",
                details={"role": spec.role.label}))
        current_caller.set(caller)  # this task's own context: it ends with the request
        with outcome.tracking() as tracked:
            return await self._tracked(spec, data, caller, tracked, subject)

    async def _tracked(
        self, spec: EndpointSpec, data: bytes, caller: Caller, tracked: outcome.Outcome, subject: str
    ) -> Reply:
        try:
            req = decode(data, spec.request)
            if spec.scope is not None:
                self._in_scope(spec, req, subject)
            if spec.idempotent and getattr(req, "request_id", None) and not getattr(req, "dry_run", False):
                self.idempotency.check(req.request_id)
                req.request_id = caller.qualified(req.request_id)
                undo = (lambda reply: spec.undo(req, reply.body)) if spec.undo else None
                recall = (lambda kept: self._recalled(spec, req, kept)) if spec.recall else None
                return await self.idempotency.run(
                    self._idempotency_scope(spec), req.request_id, data, lambda: self._call(spec, req, keep=True),
                    undo, recall,
                )
            return await self._call(spec, req)
        except BerthError as error:
            return error_reply(error)
        except STORE_UNREACHABLE as error:  # a Redis restart, failover or partition: nothing to debug
            log.warning("%s: the store is unreachable: %r", spec.subject, error)
            return error_reply(store_failed(tracked, f"the store is unreachable ({type(error).__name__})"))
        except STORE_FULL as error:
            log.warning("%s: the store refused a write: %s", spec.subject, error)
            return error_reply(store_failed(tracked, "the store is out of memory (maxmemory)"))
        except Exception as error:
            log.error("%s: unexpected error\n%s", spec.subject, traceback.format_exc())
            return error_reply(BerthError(f"internal error: {type(error).__name__}: {error}", code="internal",
                                          details={"may_have_changed": tracked.may_have_changed}))

    def _in_scope(self, spec: EndpointSpec, req: Any, subject: str) -> None:
        """Refuse a request whose scope field names another than its subject does (`Command.scope`)."""
        pattern = f"{self.prefix}.{spec.subject}".split(".")
        named = subject.split(".")[pattern.index("*")]
        given = getattr(req, spec.scope)
        if given != named:
            raise PermissionDenied(
                f"{spec.scope}: {given!r}, but this request came on {named!r}'s subject: a request on "
                f"{subject} acts on {named!r} only", field=spec.scope, details={"subject": named})

    def _idempotency_scope(self, spec: EndpointSpec) -> str:
        """Where the answers to `spec`'s request ids are kept.

        A queue-group endpoint shares one scope among all its instances: whichever instance gets
        the retry replays the first answer. A broadcast request, though, reaches every instance and
        each must apply it to its own state: with a shared scope the first instance to claim the id
        would run it and the others would replay its answer without applying it. So each instance
        keeps its own answers (the scope names the instance): a retry again reaches every instance,
        each replays what it answered the first time, and the client takes the first reply as
        before. An instance started after the first request has no answer stored and runs the retry.
        """
        scope = f"{self.name}:{spec.subject}"
        return f"{scope}@{self.id}" if spec.broadcast else scope

    async def _call(self, spec: EndpointSpec, req: Any, *, keep: bool = False) -> Reply:
        # The keys a request writes are noted only when its answer waits for replicas to hold them.
        with collecting() if self.replicas is not None else contextlib.nullcontext() as writes:
            try:
                answer = await spec.handler(req)
                reply = Reply(body=encode(answer), recipe=spec.keep(req, answer) if keep and spec.keep else None)
            except BerthError as error:
                reply = error_reply(error)
        limit = self._nc.max_payload - REPLY_HEADROOM
        if len(reply.body) > limit:  # NATS would refuse to send it, and the caller would wait in vain
            log.error("%s: a reply of %d bytes, over the %d the server allows", spec.subject, len(reply.body),
                      limit)
            reply = error_reply(InvalidArgument(
                "request", f"the reply would take {len(reply.body)} bytes, over the {limit} the server's max "
                "payload allows: ask for less at once", reply_bytes=len(reply.body), limit=limit))
        # Before the answer is kept or sent: a refusal may have written too (a rolled-back placement).
        # Raising here leaves nothing kept, so a retry runs again and finds what this run left.
        if self.replicas is not None:
            await self.replicas.confirm(writes)
        return reply

    async def _recalled(self, spec: EndpointSpec, req: Any, kept: bytes) -> Reply:
        """The answer a retry gets, rebuilt from what was kept for the first run (`Command.recall`)."""
        try:
            return Reply(body=encode(await spec.recall(req, kept)))
        except BerthError as error:
            return error_reply(error)

    def _account(self, spec: EndpointSpec, elapsed_ns: int, reply: Reply) -> None:
        error = error_code(reply.body, reply.headers.get(ERROR_CODE_HEADER)) if reply.headers else None
        meter = self._meters.get(spec.name)
        if meter is not None:
            meter.record(elapsed_ns / 1e9, error)
        if self._micro is not None:  # `$SRV.STATS`: nats.micro's counts end when the handler returns
            # The status and the code, never the message: any caller reads `$SRV.STATS`, and a
            # message names what another caller asked for (its ids).
            self._micro.record(spec.name, elapsed_ns, error and f"{reply.headers[ERROR_CODE_HEADER]}:{error}")


async def serve_until_signalled(services: list[Service], drain_timeout: float = 10.0) -> None:
    """Serve until SIGTERM or SIGINT, then drain every service (one process may run several: a
    `berth agent` is its node's agent and metrics services); the caller closes the connection."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("%s draining", ", ".join(service.name for service in services))
        await asyncio.gather(*(service.drain(drain_timeout) for service in services))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
