"""Exit statuses of the everyday commands, the error that carries one, and running a command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Awaitable, Callable

from berth.settings import add_client_flags

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NO_ANSWER = 3
EXIT_FAILED = 4
EXIT_UNREACHABLE = 5
EXIT_NOT_DONE = 6

EXIT_STATUSES = """exit status: 0 done; 1 an error reply with a 4xx status (the request was refused);
2 usage; 3 no responders or no reply in time; 4 an error reply with a 5xx status (the service
failed); 5 NATS unreachable, refusing us (authorization, permissions) or lost, or JetStream
unable to replay; 6 accepted but not done within the wait (`agent --drain`: the node drains,
instances still run)."""


class CommandError(Exception):
    """What the user is told on standard error, with the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    command: Callable[[argparse.Namespace], Awaitable[int]],
    **texts: str,
) -> argparse.ArgumentParser:
    """A subparser for `command` (`texts`: its help and description), with the client's connection
    options and the exit statuses in its help; the command runs as `_runner` says."""
    parser = sub.add_parser(
        name, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_STATUSES, **texts
    )
    add_client_flags(parser)
    # no --prefix and no BERTH_PREFIX: the prefix of the `berth up` file, if that is what we use
    # (berth/commands/connection.py resolve_server), else berth
    parser.set_defaults(prefix=None, run=_runner(command))
    return parser


def _runner(command: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[..., int]:
    def run(args: argparse.Namespace, extra: list[str]) -> int:
        level = logging.ERROR if not args.verbose else logging.INFO if args.verbose == 1 else logging.DEBUG
        logging.getLogger().setLevel(level)
        for handler in logging.getLogger().handlers:  # whatever configured it, never standard output
            if getattr(handler, "stream", None) is sys.stdout:
                handler.setStream(sys.stderr)
        from berth.commands.connection import asked, redact, resolve_server

        resolve_server(args)
        try:
            return asyncio.run(command(args))
        except CommandError as error:
            # nothing answered, or NATS failed us: name the server asked (unless the message does)
            told = error.status in (EXIT_NO_ANSWER, EXIT_UNREACHABLE) and redact(args.nats) not in str(error)
            where = f"; asked {asked(args)}" if told else ""
            print(f"berth {args.command}: {error}{where}", file=sys.stderr, flush=True)
            return error.status
        except KeyboardInterrupt:
            return 130

    return run
