"""Exit statuses of the everyday commands, and the error that carries one (berth/commands/running.py
runs a command and turns that error into its status)."""

from __future__ import annotations

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
