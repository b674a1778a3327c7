"""Failpoints: named places where a worker can be made to die or pause, to test what survives.

`BERTH_FAILPOINTS` lists `name` or `name:action` items, comma-separated; the action is `kill`
(the default: SIGKILL, as a crash) or `stop` (SIGSTOP, as a long GC or a VM pause: the process
runs on from there when it gets SIGCONT). Each fires once per process. The points:
- `before-commit`: a state change is computed and about to be committed;
- `after-commit`: it is committed, its answer neither kept nor sent.
Tests set the variable on a worker process they start; nothing else does. Unset (the default),
a failpoint costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_armed = {
    name: _SIGNALS[action or "kill"]
    for name, _, action in (item.partition(":") for item in os.environ.get("BERTH_FAILPOINTS", "").split(",") if item)
}


def failpoint(name: str) -> None:
    sig = _armed.pop(name, None)
    if sig is not None:
        os.kill(os.getpid(), sig)
