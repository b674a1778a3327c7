"""Running an everyday command: its subparser, with the client's connection options and the exit
statuses in its help, and the run itself (the server resolved, then the command; a `CommandError`
told on standard error, its status returned)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Awaitable, Callable

from berth.commands.connection import asked, redact, resolve_server
from berth.commands.exits import EXIT_NO_ANSWER, EXIT_STATUSES, EXIT_UNREACHABLE, CommandError
from berth.settings import add_client_flags


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
