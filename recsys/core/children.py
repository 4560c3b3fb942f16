"""Child processes that die with their parent.

A helper process (saved_model_cli, the fresh-process reload check) must not outlive the
recsys process that started it: killed by the OOM killer or a scheduler, the parent cannot
clean up, so the kernel does it. On Linux the child asks for SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG, called between fork and exec); elsewhere this is a no-op. The
kernel ties the signal to the *thread* that forked: start and wait for a child in one thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Looked up before any fork: the child runs only the call, no import or lookup.
_prctl = (
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    if sys.platform.startswith("linux")
    else None
)


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess that makes the child get SIGKILL when this process dies."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return arm
