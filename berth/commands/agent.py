"""`berth agent`: run this host's agent, or (`--drain`, `--resume`) ask a running one.

    berth agent --nats URL --redis URL --node n1 --label city=sz ...   # run the agent; its options:
                            # python -m bus.runner services.agent.worker --help
    berth agent --node n1 --drain [--wait 600]    # no new placement on n1; wait until nothing runs there
                                                  # (exit 6: accepted, some still run after --wait;
                                                  # 3: no agent of n1 answered)
    berth agent --node n1 --resume                # take placements again
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from berth.commands.connection import Connection
from berth.commands.exits import (
    EXIT_FAILED,
    EXIT_NO_ANSWER,
    EXIT_NOT_DONE,
    EXIT_OK,
    EXIT_REFUSED,
    CommandError,
)
from berth.commands.running import add_command
from berth.supervisor import Supervisor, worker_argv
from bus.client import BusClient
from bus.settings import default_node
from schemas.errors import BusError, NoResponders, RequestTimeout

POLL_SECONDS = 0.5


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "agent", drain_command,
        help="run this host's agent; --drain / --resume: ask the running one",
        description="Without --drain or --resume: run the agent of this host (one process; every option "
        "not listed here goes to it: `python -m bus.runner services.agent.worker --help` lists them). With --drain: the node takes "
        "no new placement and this command waits until no instance runs on it; --resume undoes it.",
    )
    parser.add_argument("--node", default=None,
                        help="the node (default: the bundle's, else BERTH_NODE, else this host's name)")
    parser.add_argument("--bundle", metavar="FILE",
                        help="run as the node agent identity of this bundle (`berth user bundle NAME`): its servers, "
                        "identity, CA and node")
    parser.add_argument("--join", metavar="URL",
                        help="with --token: fetch this host's bundle from the deployment at URL (`berth user "
                        "join-token`), keep it as .berth/agent/<node>.bundle, and run as it")
    parser.add_argument("--token", help="a one-time join token, ID.SECRET")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--drain", action="store_true", help="stop placing on the node, wait for its instances to end")
    mode.add_argument("--resume", action="store_true", help="place on the node again")
    parser.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                        help="with --drain: how long to wait for the instances to end (0: do not wait); exit "
                        "status 6 when some still run then, 3 when no agent answers")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer")
    ask_agent = parser.get_default("run")

    def run(args: argparse.Namespace, extra: list[str]) -> int:
        if (args.bundle or args.join) and (args.drain or args.resume):
            parser.error("--bundle and --join run the agent; --drain/--resume ask one as an admin")
        if bool(args.join) != bool(args.token):
            parser.error("--join URL and --token ID.SECRET go together")
        if args.join:
            args.bundle = _joined(args)
        if not args.bundle:
            args.node = args.node or os.environ.get("BERTH_NODE") or default_node()
        if args.drain or args.resume:
            if extra:
                parser.error(f"unrecognized arguments with --drain/--resume: {' '.join(extra)}")
            return ask_agent(args, extra)
        return run_agent(args, extra)

    parser.set_defaults(run=run)


def run_agent(args: argparse.Namespace, extra: list[str]) -> int:
    """The agent worker in a process of its own, restarted if it crashes (as `berth worker`)."""
    if args.bundle:
        argv, env = _from_bundle(args)
    else:
        args.prefix = args.prefix or os.environ.get("BERTH_PREFIX") or "berth"
        argv = ["--node", args.node, "--prefix", args.prefix, *(["--nats", args.nats] if args.nats else []),
                *(["--nats-creds", args.nats_creds] if args.nats_creds else []),
                *(["--js-domain", args.js_domain] if args.js_domain else [])]
        env = {"BERTH_TLS_CA": args.tls_ca} if args.tls_ca else {}
    supervisor = Supervisor()
    node = argv[argv.index("--node") + 1]
    supervisor.add(f"agent {node}", worker_argv("services.agent.worker", [*argv, *extra]), {**os.environ, **env})
    return supervisor.run()


def _joined(args: argparse.Namespace) -> str:
    """Redeem the join token for this host's bundle (berth/join.py); its path, in `.berth/agent/`."""
    from berth import join

    prefix = args.prefix or os.environ.get("BERTH_PREFIX") or "berth"
    try:
        bundle = asyncio.run(join.fetch(args.join, prefix, args.token))
    except join.TokenRefused as error:
        raise SystemExit(f"berth agent --join: {error}") from None
    except Exception as error:  # no server there, no join service, a timeout
        raise SystemExit(f"berth agent --join {args.join}: {error!r}") from None
    if args.node and args.node != bundle["node"]:
        raise SystemExit(f"--token is node {bundle['node']}'s agent identity, not node {args.node}'s")
    folder = os.path.join(".berth", "agent")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"{bundle['node']}.bundle")
    join.write(Path(path), bundle)
    print(f"joined as node {bundle['node']}'s agent; its bundle is {path} (next time: --bundle {path})", flush=True)
    return path


def _from_bundle(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The bundle's servers, identity and node (berth/join.py); a --node that is not the
    bundle's is refused here, naming both (the worker would refuse it too)."""
    from berth import join

    try:
        argv, env = join.unpack(args.bundle)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    bound = argv[argv.index("--node") + 1]
    if args.node and args.node != bound:
        raise SystemExit(f"--bundle {args.bundle} is node {bound}'s agent identity, not node {args.node}'s")
    return argv, env


async def drain_command(args: argparse.Namespace) -> int:
    connection = Connection(args)
    async with connection as nc:
        client = BusClient(nc, prefix=args.prefix, timeout=args.timeout)

        async def ask(command: str, payload: dict) -> dict:
            subject = f"agent.{args.node}.{command}"
            try:
                return await connection.unless_refused(client.request(subject, payload, dict))
            except NoResponders as error:  # no agent serves the node (the message says so)
                raise CommandError(error.message, EXIT_NO_ANSWER) from None
            except RequestTimeout as error:
                raise CommandError(error.message, EXIT_NO_ANSWER) from None
            except BusError as error:
                status = EXIT_REFUSED if 400 <= error.status < 500 else EXIT_FAILED
                raise CommandError(f"{error.code} ({error.status}): {error.message}", status) from None

        info = await ask("drain", {"draining": args.drain})
        if args.resume:
            print(f"node {args.node}: taking placements again ({info['running']} instances run)", flush=True)
            return EXIT_OK
        deadline = time.monotonic() + args.wait
        while info["running"] and time.monotonic() < deadline:
            print(f"node {args.node}: draining, {info['running']} instances still run", flush=True)
            await asyncio.sleep(POLL_SECONDS)
            info = await ask("info", {})
        if info["running"]:  # the drain was accepted: not "no answer" (3), not done either
            raise CommandError(f"node {args.node} is draining (it takes no new placement) and still runs "
                               f"{info['running']} instances after {args.wait:g} s; it stays draining: run this "
                               "again to wait for them", EXIT_NOT_DONE)
        print(f"node {args.node}: drained, nothing runs there", flush=True)
        return EXIT_OK
