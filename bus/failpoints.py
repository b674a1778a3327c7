"""Failpoints: named places where a worker can be made to die, pause or lose a reply, to test
what survives.

`BERTH_FAILPOINTS` lists `name` or `name:action` items, comma-separated; the action is `kill`
(the default: SIGKILL, as a crash), `stop` (SIGSTOP, as a long GC or a VM pause: the process
runs on from there when it gets SIGCONT) or `lose` (the store's reply to what was just written is
lost: `bus.redis.ReplyLost` is raised there, as when a link fails while the reply is in flight).
Each fires once per process. The points:
- `run-start`: a run of a request began, before it looks for what earlier runs placed;
- `recall`: a retry found its request's answer kept, and is about to rebuild it;
- `before-commit`: a state change is computed and about to be committed;
- `after-commit`: it is committed, its answer neither kept nor sent.
Tests set the variable on a worker process they start; nothing else does. Unset (the default),
a failpoint costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

from bus.redis import ReplyLost

_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "lose": None}
_armed = {
    name: action or "kill"
    for name, _, action in (item.partition(":") for item in os.environ.get("BERTH_FAILPOINTS", "").split(",") if item)
}
assert set(_armed.values()) <= set(_ACTIONS), f"BERTH_FAILPOINTS: actions are {', '.join(_ACTIONS)}"


def failpoint(name: str) -> None:
    action = _armed.pop(name, None)
    if action == "lose":
        raise ReplyLost(f"failpoint {name}: the reply of what was just written is lost")
    if action is not None:
        os.kill(os.getpid(), _ACTIONS[action])
