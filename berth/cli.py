"""The `berth` command: `up`, `worker`, `dashboard`, `schema`, `redis-functions`, and `call`, `events`,
`nodes`, `status` (berth/commands/). Flags and environment are read by berth/settings.py
(and bus/settings.py, what every worker shares)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from berth import commands
from berth.commands.connection import UP_ENV, UP_PID, remove_up_env, write_up_env
from berth.registry import SERVICES, available
from berth.servers import LOOPBACK
from berth.settings import (
    DashboardConfig,
    add_metrics_port_flag,
    add_redis_admin_flags,
    add_server_flags,
    redis_maxmemory,
    state_dir,
    up_catalog,
    up_tls,
)
from berth.supervisor import Supervisor, worker_argv
from berth.up_ready import announce, berth_command, next_steps
from bus.runner import configure_logging
from bus.settings import log_level
from services.processes.procfs import DEPLOYMENT

log = logging.getLogger("berth")

# The labels of `berth up`'s own node: the capacity block ("linux/local") its broker's pools draw
# from when they launch through the local agent (docs/broker.md's walk asks for it).
LOCAL_LABELS = {"city": "local", "platform": "linux"}


def _url_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str] | None]:
    """Worker arguments and environment for the URLs: on the command line, unless a URL carries a
    password; that one goes in the environment (a command line is visible to every local user)."""
    argv, env = ["--prefix", args.prefix], {}
    for option, variable, url in (("--nats", "NATS_URL", args.nats), ("--redis", "REDIS_URL", args.redis)):
        if "@" in url:
            env[variable] = url
        else:
            argv += [option, url]
    return argv, ({**os.environ, **env} if env else None)


def _metrics_args(port: int | None, index: int, addr: str | None = None) -> list[str]:
    """Worker options for Prometheus metrics: worker `index` serves on `port + index` (0: each on a
    free port, which its "ready" line names); none when `port` is None (off)."""
    if port is None:
        return []
    return ["--metrics-port", str(port + index if port else 0)] + (["--metrics-addr", addr] if addr else [])


def _durable_args(args: argparse.Namespace, service: str, own_redis: bool) -> list[str]:
    """On the Redis Cluster `berth up --cluster` starts (a replica per primary), allocation answers
    only what one replica holds: a failover then loses no acknowledged allocation (bus/replicas.py)."""
    return ["--wait-replicas", "1"] if args.cluster and own_redis and service == "allocation" else []


def _catalog_args(args: argparse.Namespace, service: str) -> list[str]:
    """The broker (and the agent, on its host) runs only the images of a catalog: the one given,
    else the development one."""
    runs = service in ("broker", "agent") and args.catalog
    return ["--catalog", str(Path(args.catalog).resolve())] if runs else []


def _agent_args(state: Path, service: str) -> list[str]:
    """The local machine's agent keeps what it runs in the state folder, labels its node as the
    capacity block of this machine (`LOCAL_LABELS`), and stops what it runs when `berth up` stops
    (through its own stop, which also removes the instances' cgroups)."""
    if service != "agent":
        return []
    labels = [arg for key, value in LOCAL_LABELS.items() for arg in ("--label", f"{key}={value}")]
    return ["--state", str(state / "agent"), "--node", _local_node(), *labels, "--stop-on-exit"]


def _operator_args(service: str, services: dict[str, str]) -> list[str]:
    """Where `berth up` runs the local agent and allocation, its broker launches through them: a pool
    server is a placement on this machine's node, pinned, run by its agent, as on any host of a
    fleet. The broker's own setting (env BERTH_BROKER_OPERATOR) decides when it is given."""
    if service != "broker" or not {"agent", "allocation"} <= services.keys():
        return []
    from services.broker.config import OPERATOR_ENV  # the broker is installed

    return [] if os.environ.get(OPERATOR_ENV) else ["--operator", "allocation"]


def _local_node() -> str:
    """The local machine's node (`berth agent`'s default)."""
    from bus.settings import default_node

    return os.environ.get("BERTH_NODE") or default_node()


def _with_local_agent(creds):
    """The credentials with an identity for the local machine's agent, named after its node (made
    once, kept: the agent of `berth up` runs as a node agent like any other host's)."""
    from bus.callers import Role

    node = _local_node()
    known = creds.agent_of(node)
    if known is not None:
        return creds
    try:
        creds = creds.with_identity(node, Role.AGENT, node)
    except ValueError as error:
        raise SystemExit(f"berth up: the local agent's identity: {error}; start it with BERTH_NODE=<another name>")
    creds.write()
    return creds


def _services_to_start() -> dict[str, str]:
    """Every installed service, but the metrics worker where an agent runs its node's metrics."""
    installed = available()
    return {name: module for name, module in installed.items() if not (name == "metrics" and "agent" in installed)}


def cmd_up(args: argparse.Namespace, extra: list[str]) -> int:
    """One `berth up` per state folder, holding its lock while it runs (berth/up_lock.py)."""
    from berth.up_lock import FolderInUse, hold

    state = Path(args.state).resolve()
    try:
        with hold(state) as lock:
            return _up(args, state, lock)
    except FolderInUse as error:
        raise SystemExit(f"berth up: {error}") from None


def _up(args: argparse.Namespace, state: Path, lock) -> int:
    from berth.credentials import REDIS_ADMIN, prepare
    from berth.redis_functions import FIRST_VERSION
    from berth.servers import (
        memory_limit,
        redis_version,
        start_nats,
        start_nats_cluster,
        start_redis,
        start_redis_cluster,
    )

    # Credentials (unless --no-auth): users and permissions for the servers we start, a user per
    # worker, see berth/credentials.py. A server given by URL is used as it is. On a Redis that
    # has Functions, berth's scripts are loaded as such, and the workers' users may only call them.
    own_nats, own_redis = not args.nats, not args.redis
    functions = own_redis and redis_version() >= FIRST_VERSION
    creds = (prepare(state / "credentials", args.prefix, redis_functions=functions)
             if not args.no_auth and (own_nats or own_redis) else None)
    if creds is not None and "agent" in _services_to_start():
        creds = _with_local_agent(creds)
    nats_config = creds.nats_config if creds else None
    redis_config, redis_admin = (creds.redis_config, creds.redis_admin) if creds else (None, None)
    # TLS (unless --no-tls) with a CA of the deployment's own, made once (berth/tls.py).
    tls = _prepare_tls(state, args.listen) if args.tls and (own_nats or own_redis) else None
    tls_env = {"BERTH_TLS_CA": str(tls.ca)} if tls else {}
    _warn_if_open(args, creds, tls)
    host = args.listen
    servers = []
    up_env: Path | None = None
    stopping = threading.Event()
    try:
        if not args.nats:
            servers.append(start_nats_cluster(state / "nats-cluster", config=nats_config, tls=tls, host=host)
                           if args.cluster
                           else start_nats(state / "nats", args.nats_port, config=nats_config, tls=tls, host=host))
            args.nats = servers[-1].url
            lock.note_servers(servers[-1])
        if not args.redis:
            limit = memory_limit(args.redis_maxmemory)
            servers.append(
                start_redis_cluster(state / "redis-cluster", config=redis_config, auth=redis_admin, extra=limit, tls=tls,
                                    host=host)
                if args.cluster
                else start_redis(state / "redis", args.redis_port, config=redis_config, extra=limit, tls=tls, host=host)
            )
            args.redis = servers[-1].url
            lock.note_servers(servers[-1])
            if functions:  # before any worker looks for them
                _load_functions(creds.redis_url(REDIS_ADMIN, args.redis) if creds else args.redis, tls)
        if creds and own_nats:  # no worker's user may set a stream up (berth/streams.py)
            _set_up_streams(args, creds, tls)
        # The dashboard reads as an identity of its own, a reader (berth/credentials.py).
        dashboard_url = creds.nats_url("dashboard", args.nats) if creds and own_nats else args.nats
        js_env = {"BERTH_JS_DOMAIN": args.prefix} if creds and own_nats else {}
        up_env = _print_connection(args, state, creds if own_nats else None, tls)
        if creds and own_nats:  # each identity's NATS context, for standard NATS clients
            creds.write_contexts(args.nats, str(tls.ca) if tls else None)
        supervisor = Supervisor()
        scraped: list[str] = []  # the workers serving Prometheus metrics, in start order
        services = _services_to_start()
        for name, module in services.items():
            if creds is None:
                argv, env = _url_args(args)
            else:  # its own NATS user (a creds file) and Redis user (REDIS_URL in its environment)
                user = creds.agent_of(_local_node()).name if name == "agent" else name
                argv, env = creds.worker_launch(user, args.nats, args.redis, nats_auth=own_nats, redis_auth=own_redis)
            # The processes the broker launches inherit the marker: stopped with the deployment.
            env = {**os.environ, **(env or {}), **tls_env, DEPLOYMENT: str(state)}
            metrics = [] if args.no_metrics else _metrics_args(args.metrics_base_port or 0, len(scraped), args.metrics_addr)
            scraped += [name] if metrics else []
            own = (_durable_args(args, name, own_redis) + _catalog_args(args, name) + _agent_args(state, name)
                   + _operator_args(name, services))
            supervisor.add(name, worker_argv(module, argv + metrics + own), env)
        if not supervisor.children:
            print("no service is installed yet; serving NATS and Redis only", flush=True)
        if creds and own_nats:  # hosts that join with a one-time token (berth/join.py)
            join_env = {**os.environ, **tls_env, "NATS_URL": args.nats, DEPLOYMENT: str(state)}
            supervisor.add("join", [sys.executable, "-m", "berth.cli", "join-service", "--state", str(state)],
                           join_env, client=True)
        if not args.no_dashboard:  # the live dashboard (berth/dashboard/), a bus client as the client user
            from berth.servers import free_port

            port = args.dashboard_port or free_port()
            dashboard = [sys.executable, "-m", "berth.cli", "dashboard", "--prefix", args.prefix,
                         "--port", str(port), "--quiet"]
            # no password on a command line
            env = {**os.environ, **tls_env, **js_env, "NATS_URL": dashboard_url, DEPLOYMENT: str(state)}
            supervisor.add("dashboard", dashboard, env, client=True)  # stopped before the services it asks
            print(f"dashboard: http://127.0.0.1:{port}/", flush=True)
        print("berth is starting (it says when it is ready); Ctrl-C stops everything", flush=True)
        if scraped:  # Prometheus metrics of every worker (bus/telemetry.py)
            host = args.metrics_addr
            where = (", ".join(f"{name} http://{host}:{args.metrics_base_port + i}/metrics" for i, name in enumerate(scraped))
                     if args.metrics_base_port else f"each worker on a free port of {host}, named in its ready line")
            print(f"metrics: {where}", flush=True)
        if started := list(services):  # once they answer: what to do next
            node = _local_node() if "agent" in started and "allocation" in started else None
            lines = next_steps(berth=berth_command(), where=_where_commands_find_it(state, up_env), node=node,
                               dashboard=None if args.no_dashboard else f"http://127.0.0.1:{port}/")
            announce(dashboard_url, str(tls.ca) if tls else None, args.prefix, started, node, lines, stopping)
        return supervisor.run()
    finally:
        stopping.set()
        if up_env is not None:
            remove_up_env(up_env, os.getpid())
        _stop_launched(state)
        for server in reversed(servers):
            server.stop()
        print("berth stopped", flush=True)


def _where_commands_find_it(state: Path, up_env: Path | None) -> str:
    """From where `berth status/call/...` find this deployment: the folder of its state, or a
    BERTH_STATE set, or (no up.env) the variables printed."""
    if up_env is None:
        return "with the variables above set"
    return "in this folder" if state == Path(state_dir()).resolve() else f"with BERTH_STATE={state} set"


def _set_up_streams(args: argparse.Namespace, creds, tls) -> None:
    from berth.accounts import STREAMS_ADMIN
    from berth.streams import set_up

    asyncio.run(set_up(args.nats, args.prefix, user=STREAMS_ADMIN, password=creds.nats_password(STREAMS_ADMIN),
                       tls_ca=str(tls.ca) if tls else None))


def _load_functions(admin_url: str, tls) -> None:
    from berth.redis_functions import load

    asyncio.run(load(admin_url, tls_ca=str(tls.ca) if tls else None))


def _prepare_tls(state: Path, listen: str):
    from berth.tls import prepare

    return prepare(state / "tls", (listen,))


def _warn_if_open(args: argparse.Namespace, creds, tls) -> None:
    """Servers other hosts reach run with identities and TLS: say so when they do not."""
    if args.listen == LOOPBACK or (creds and tls):
        return
    missing = " and ".join(what for what, on in (("identities", creds), ("TLS", tls)) if not on)
    print(f"warning: listening on {args.listen} without {missing}: anyone who reaches it acts as an admin "
          "or reads the traffic; for development only", file=sys.stderr, flush=True)


def _print_connection(args: argparse.Namespace, state: Path, creds, tls) -> Path | None:
    """What a client needs, as variables `berth call/status/events` read: the URLs, the admin
    identity's creds file, where the streams are, and the CA; never a password (stdout ends up in
    terminals and logs). The same go to `<state>/up.env`, which those commands read when neither
    --nats nor NATS_URL is given (berth/commands/connection.py); its path is returned, None when
    a URL carries a password (a file is no place for one either)."""
    values = {"NATS_URL": args.nats, "REDIS_URL": args.redis}
    if creds:
        values |= {"BERTH_NATS_CREDS": str(creds.nats_creds("admin")), "BERTH_JS_DOMAIN": args.prefix}
    if tls:
        values["BERTH_TLS_CA"] = str(tls.ca)
    lines = [f"{name}={value}" for name, value in values.items()]
    up_env = None
    if "@" not in args.nats and "@" not in args.redis:
        up_env = state / UP_ENV
        write_up_env(up_env, {**values, "BERTH_PREFIX": args.prefix, UP_PID: str(os.getpid())})
    lines.append(f"state: {state}")
    if creds:
        lines.append(f"credentials: {creds.directory} (BERTH_NATS_CREDS is the admin identity's; `berth user add "
                     "NAME --role tenant|reader|admin` makes more; the services' users, and Redis's administrator "
                     "'default', are in credentials.json)")
    if up_env:
        lines.append(f"{up_env}: these variables, which `berth status/call/nodes/events` run "
                     f"{_where_commands_find_it(state, up_env)} read when given no --nats and no NATS_URL")
    print("\n".join(lines), flush=True)
    return up_env


def _stop_launched(state: Path) -> None:
    """Stop what was launched for this deployment and still runs once its workers have stopped: the
    `process` operator's processes (in sessions of their own, to outlive a broker restart), and any
    instance the local agent could not stop itself (it was killed past the grace)."""
    from services.broker.operators.process import stop_deployment

    if stopped := asyncio.run(stop_deployment(str(state))):
        print(f"stopped {stopped} launched process groups", flush=True)


def cmd_user(args: argparse.Namespace, extra: list[str]) -> int:
    """`berth user add|list|remove`: the identities of a `berth up` state folder; a change is
    written into its NATS configuration and the running servers read it again."""
    from berth.credentials import load
    from berth.servers import reload_nats
    from bus.callers import ROLES

    state = Path(args.state).resolve()
    directory = state / "credentials"
    if not (directory / "credentials.json").exists():
        raise SystemExit(f"berth user: {state} has no credentials yet: start `berth up --state {args.state}` once")
    creds = load(directory)
    if args.action == "bundle":
        return _write_bundle(args, state, creds)
    if args.action == "join-token":
        return _join_token(args, state, creds)
    if args.action == "list":
        rows = [(i.name, i.role.label, str(creds.nats_creds(i.name))) for i in sorted(creds.identities.values(),
                                                                                      key=lambda i: i.name)]
        width = max(len(name) for name, _, _ in rows) if rows else 4
        print("\n".join([f"{'name':<{width}}  role    creds file"] +
                        [f"{name:<{width}}  {role:<6}  {path}" for name, role, path in rows]))
        return 0
    try:
        if args.action == "add":
            creds = creds.with_identity(args.name, ROLES[args.role], args.node)
        else:
            creds = creds.without_identity(args.name)
    except ValueError as error:
        raise SystemExit(f"berth user: {error}") from None
    except KeyError:
        raise SystemExit(f"berth user: no identity named {args.name!r}") from None
    running = _written(state, creds, args.name)
    if args.action == "add":
        identity = creds.identities[args.name]
        bound = f" of node {identity.node}" if identity.node else ""
        print(f"{identity.name}: role {identity.role.label}{bound}, creds file {creds.nats_creds(identity.name)}{running}")
        if creds.context(identity.name).exists():
            print(f"NATS context (nats CLI and other standard clients): {creds.context(identity.name)}")
        print(f"BERTH_NATS_CREDS={creds.nats_creds(identity.name)}")
    else:
        print(f"{args.name}: removed (what it owns stays; an admin may release it){running}")
    return 0


def _written(state: Path, creds, name: str) -> str:
    """Write the credentials after a change of identity `name`, and tell the running servers."""
    from berth.credentials import load
    from berth.servers import reload_nats

    from berth.commands.connection import read_up_env

    was_agent = (before := load(creds.directory).identities.get(name)) is not None and before.is_agent
    creds.write()
    up = read_up_env(state / UP_ENV) or {}
    if up.get("NATS_URL"):
        creds.write_contexts(up["NATS_URL"], up.get("BERTH_TLS_CA"))
    told = reload_nats(state)
    running = f"; {told} running nats-server(s) reloaded" if told else "; no nats-server of it runs now"
    if told and (was_agent or creds.redis_user_of(name)):
        running += _tell_redis(state, creds, name)
    return running


def _join_token(args: argparse.Namespace, state: Path, creds) -> int:
    """A one-time token for agent identity NAME (made, bound to --node or NAME, if it is new)."""
    from berth import join
    from berth.commands.connection import read_up_env
    from bus.callers import Role

    up = read_up_env(state / UP_ENV) or {}
    if not up.get("NATS_URL"):
        raise SystemExit("berth user join-token: the deployment is not running (no up.env): start `berth up` first")
    if args.name not in creds.identities:
        try:
            creds = creds.with_identity(args.name, Role.AGENT, args.node)
        except ValueError as error:
            raise SystemExit(f"berth user join-token: {error}") from None
        print(f"{args.name}: a new agent identity of node {creds.identities[args.name].node}"
              f"{_written(state, creds, args.name)}")
    try:
        token = join.issue(creds, args.name, args.ttl)
    except ValueError as error:
        raise SystemExit(f"berth user join-token: {error}") from None
    print(f"valid once, for {args.ttl:g} s; on the host:\n"
          f"berth agent --join {up['NATS_URL']} --token {token} --prefix {creds.prefix}")
    return 0


def _write_bundle(args: argparse.Namespace, state: Path, creds) -> int:
    from berth import join
    from berth.commands.connection import read_up_env

    try:
        bundle = join.make(creds, args.name, read_up_env(state / UP_ENV) or {})
    except ValueError as error:
        raise SystemExit(f"berth user bundle: {error}") from None
    path = Path(args.output or f"{args.name}.bundle")
    join.write(path, bundle)
    print(f"{path}: node {bundle['node']}'s agent, servers {bundle['nats_url']}; on the host: "
          f"berth agent --bundle {path.name} (it holds secrets: move it as a private file)")
    return 0


def _tell_redis(state: Path, creds, name: str) -> str:
    """A node agent's identity is a Redis user too: the running Redis servers learn it (or lose it)."""
    from berth.commands.connection import read_up_env
    from berth.credentials import REDIS_ADMIN
    from berth.servers import set_redis_users

    up = read_up_env(state / UP_ENV) or {}
    if not up.get("REDIS_URL"):
        return ""
    admin = (REDIS_ADMIN, creds.redis_passwords[REDIS_ADMIN])
    told = set_redis_users(up["REDIS_URL"], admin, {name: creds.redis_user_of(name)}, up.get("BERTH_TLS_CA"))
    return f", {told} Redis server(s) told"


def cmd_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from berth.prepare import prepare

    state = Path(args.state).resolve()
    prepare(state, args.prefix, agents=args.agents, nats_url=args.nats_url, redis_url=args.redis_url)
    print(f"{state}: credentials, TLS, nats/nats.conf and env/<process>.env for {args.agents} agent(s)")
    return 0


def cmd_join_service(args: argparse.Namespace, extra: list[str]) -> int:
    """`berth up`'s join service: as user `join-service`, until stopped."""
    from berth import join
    from berth.accounts import JOIN_SERVICE
    from berth.credentials import load
    from bus.connection import connect

    state = Path(args.state).resolve()
    creds = load(state / "credentials")

    async def serve() -> None:
        nc = await connect(os.environ["NATS_URL"], name=f"{creds.prefix}-join", user=JOIN_SERVICE,
                           password=creds.nats_password(JOIN_SERVICE))
        await join.serve(nc, creds.directory, state, creds.prefix)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await nc.drain()

    asyncio.run(serve())
    return 0


def cmd_setup_streams(args: argparse.Namespace, extra: list[str]) -> int:
    from berth.streams import set_up
    from bus.connection import read_creds_file

    try:
        user, password = read_creds_file(os.environ["BERTH_NATS_CREDS"])
        url, prefix = os.environ["NATS_URL"], os.environ.get("BERTH_PREFIX", "berth")
    except (KeyError, OSError, ValueError) as error:
        raise SystemExit(f"berth setup-streams: {error!r}: give NATS_URL and BERTH_NATS_CREDS") from None
    asyncio.run(set_up(url, prefix, user=user, password=password, tls_ca=os.environ.get("BERTH_TLS_CA")))
    print(f"streams of {prefix} set up", flush=True)
    return 0


def cmd_worker(args: argparse.Namespace, extra: list[str]) -> int:
    modules = available()
    if args.service not in modules:
        raise SystemExit(f"service {args.service!r} is not installed (have: {', '.join(modules) or 'none'})")
    if not args.nats or not args.redis:
        raise SystemExit("give --nats and --redis (or set NATS_URL and REDIS_URL)")
    supervisor = Supervisor()
    argv, env = _url_args(args)
    for i in range(args.workers):
        metrics = _metrics_args(args.metrics_port, i)
        supervisor.add(f"{args.service}[{i}]", worker_argv(modules[args.service], argv + metrics + extra), env)
    return supervisor.run()


def cmd_dashboard(args: argparse.Namespace, extra: list[str]) -> int:
    from berth.dashboard.app import run

    return run(DashboardConfig.from_flags(args))


def cmd_schema(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from berth.registry import contracts
    from schemas import asyncapi, export

    tables = contracts()
    if args.asyncapi:
        doc = asyncapi.document(tables, args.prefix, servers=args.server or asyncapi.DEFAULT_SERVERS)
    else:
        doc = export.document(tables, args.prefix)
    text = json.dumps(doc, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_redis_functions(args: argparse.Namespace, extra: list[str]) -> int:
    from berth.credentials import redis_rules
    from berth.redis_functions import PACKAGES, load
    from bus.redis import redis_url

    for library in asyncio.run(load(redis_url(args.redis), tls_ca=args.tls_ca)):
        print(f"loaded {library.name}: {len(library.functions)} functions", flush=True)
    for service in PACKAGES:
        print(f"user {service} on >PASSWORD {' '.join(redis_rules(args.prefix, service, functions=True))}")
    return 0


def parser() -> argparse.ArgumentParser:
    berth = argparse.ArgumentParser(prog="berth", description="berth: allocation, broker and metrics over NATS")
    sub = berth.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start embedded nats-server and redis-server and every service")
    add_server_flags(up)
    up.set_defaults(nats=None, redis=None)  # `up` embeds servers unless told otherwise, whatever the env says
    up.add_argument("--state", default=state_dir(), help="state folder")
    up.add_argument("--nats-port", type=int, help="port for the embedded nats-server (default: a free one)")
    up.add_argument("--redis-port", type=int, help="port for the embedded redis-server (default: a free one)")
    up.add_argument("--redis-maxmemory", default=redis_maxmemory(), metavar="SIZE",
                    help="memory limit of the embedded redis-server(s), e.g. 512mb; at the limit writes are "
                    "refused and answered `unavailable` (env BERTH_REDIS_MAXMEMORY, default 1gb; 0: none)")
    up.add_argument("--no-auth", action="store_true",
                    help="start the servers without users and permissions (default: a user per service, "
                    "docs/security.md)")
    up.add_argument("--no-tls", dest="tls", action="store_false", default=up_tls(),
                    help="start the servers without TLS, for development (env BERTH_TLS=0; default: TLS with a "
                    "CA of the state folder's own, docs/security.md)")
    up.add_argument("--listen", default=os.environ.get("BERTH_LISTEN") or LOOPBACK, metavar="ADDRESS",
                    help="address the servers listen on, for other hosts' agents and workers (env BERTH_LISTEN; "
                    "default 127.0.0.1); Redis listens on loopback too; the TLS certificate names it")
    up.add_argument("--cluster", action="store_true",
                    help="a 3-server NATS cluster and a 3-primary, 3-replica Redis Cluster instead of one of each")
    up.add_argument("--no-metrics", action="store_true", help="workers serve no Prometheus metrics")
    up.add_argument("--metrics-base-port", type=int, metavar="PORT",
                    help="worker k (in start order) serves Prometheus metrics on PORT+k (default: free ports)")
    up.add_argument("--metrics-addr", default="127.0.0.1", help="address the workers' metrics servers listen on")
    up.add_argument("--dashboard-port", type=int, metavar="PORT", help="port of the live dashboard (default: a free one)")
    up.add_argument("--no-dashboard", action="store_true", help="do not start the live dashboard")
    up.add_argument("--catalog", default=up_catalog(), metavar="PATH",
                    help="images the broker may run (env BERTH_CATALOG; default: the repository's catalog.toml)")
    up.set_defaults(run=cmd_up)

    user = sub.add_parser("user", help="identities of a `berth up` deployment: add, list, remove")
    user.add_argument("--state", default=state_dir(), help="the state folder of `berth up`")
    actions = user.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="a new identity (or a new role for one), with a creds file of its own")
    add.add_argument("name", help="letters, digits, '_' and '-', at most 64")
    add.add_argument("--role", required=True, choices=["admin", "tenant", "reader", "agent"],
                     help="admin: everything; tenant: places, releases and reads its own work; reader: reads; "
                          "agent: a host's `berth agent`, for its own node only")
    add.add_argument("--node", help="an agent's node (default: its name)")
    actions.add_parser("list", help="every identity, its role and creds file")
    remove = actions.add_parser("remove", help="take an identity away (its connections are closed)")
    remove.add_argument("name")
    token = actions.add_parser("join-token", help="a one-time token with which a host joins as agent NAME "
                               "(the identity is made if it is new)")
    token.add_argument("name")
    token.add_argument("--node", help="a new identity's node (default: its name)")
    token.add_argument("--ttl", type=float, default=600.0, metavar="SECONDS", help="how long it is valid (default 600)")
    bundle = actions.add_parser("bundle", help="a node agent identity's bundle: what its host needs to join")
    bundle.add_argument("name")
    bundle.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: NAME.bundle)")
    user.set_defaults(run=cmd_user)

    prep = sub.add_parser("prepare", help="write a deployment's credentials, TLS and server and worker "
                          "configuration into a state folder, for servers berth up does not start (compose.yaml)")
    prep.add_argument("--state", default=state_dir(), help="the folder to write (default: BERTH_STATE or .berth)")
    prep.add_argument("--prefix", default=os.environ.get("BERTH_PREFIX") or "berth", help="subject and key prefix")
    prep.add_argument("--agents", type=int, default=1, metavar="N", help="node agent identities node-1 ... node-N")
    prep.add_argument("--nats-url", default="tls://nats:4222", help="where the workers reach NATS")
    prep.add_argument("--redis-url", default="rediss://redis:6379/0", help="where the workers reach Redis")
    prep.set_defaults(run=cmd_prepare)

    joining = sub.add_parser("join-service", help="(run by `berth up`) answer the hosts that join with a token")
    joining.add_argument("--state", default=state_dir(), help="the state folder of `berth up`")
    joining.set_defaults(run=cmd_join_service)

    streams = sub.add_parser("setup-streams", help="create the events streams (or add missing subjects) as the "
                             "streams' administrator: NATS_URL, BERTH_NATS_CREDS (streams-admin's), BERTH_PREFIX")
    streams.set_defaults(run=cmd_setup_streams)

    worker = sub.add_parser("worker", help="run N processes of one service")
    worker.add_argument("service", choices=sorted(SERVICES))
    worker.add_argument("--workers", type=int, default=1)
    add_metrics_port_flag(worker)
    add_server_flags(worker)
    worker.set_defaults(run=cmd_worker)

    functions = sub.add_parser(
        "redis-functions", help="load berth's Lua scripts into a Redis >= 7.0 as Functions, as its administrator, "
        "and print the ACL rules of service users that may call them and run no other Lua")
    add_redis_admin_flags(functions)
    functions.set_defaults(run=cmd_redis_functions)

    commands.add_parsers(sub)  # call, events, nodes, status: berth/commands/

    dashboard = sub.add_parser("dashboard", help="live web dashboard of a berth deployment (a client of the bus)")
    DashboardConfig.add_flags(dashboard)
    dashboard.set_defaults(run=cmd_dashboard)

    schema = sub.add_parser("schema", help="JSON Schema of every message, by subject")
    schema.add_argument("--prefix", default="berth")
    schema.add_argument("-o", "--output")
    schema.add_argument("--asyncapi", action="store_true",
                        help="an AsyncAPI 3.0.0 document (JSON) of every subject: requests, replies, events")
    schema.add_argument("--server", action="append", metavar="URL",
                        help="with --asyncapi: a NATS server to list (repeatable; default 127.0.0.1:4222)")
    schema.set_defaults(run=cmd_schema)
    return berth


def main(argv: list[str] | None = None) -> None:
    """For `worker` and `agent`, options berth does not know are passed on to the service processes."""
    configure_logging(log_level())
    berth = parser()
    args, extra = berth.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and args.command not in ("worker", "agent"):
        berth.error(f"unrecognized arguments: {' '.join(extra)}")
    sys.exit(args.run(args, extra))


if __name__ == "__main__":
    main()
