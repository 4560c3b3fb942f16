"""Named fault points for the crash tests (tests/test_faults.py); inert unless asked for.

`RECSYS_FAULT=<point>:<action>` makes the process, on reaching `fault_point("<point>")`,
either die at once (`kill`: SIGKILL, as the OOM killer or a node loss would) or fail as a full
disk would (`enospc`: OSError ENOSPC on the path given). Unset, a fault point is one dict
lookup. Points: see the calls of `fault_point` (grep); docs/OPERATIONS.md lists them.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

ENV = "RECSYS_FAULT"


def fault_point(name: str, path: Path | None = None) -> None:
    """Trigger the fault configured for `name`, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, action = spec.rpartition(":")
    if point != name:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)
    else:
        raise ValueError(f"{ENV}={spec!r}: unknown action {action!r} (kill or enospc)")
