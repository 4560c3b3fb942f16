"""Give a finished stage's memory back to the operating system.

The nightly runs its stages in one process. A stage's arrays and tensors are freed when it
returns, but the C allocator keeps freed pages in its arenas, so the process's resident set
stays at the stage's peak and the next stage's peak lands on top of it (measured at 30M
interactions: export peaked at 10.0 GiB after train and evaluate, 6.1 GiB on its own).
`release_memory` collects Python's cycles, then asks glibc to return every free page
(`malloc_trim(0)`); elsewhere (musl, macOS) only the collection runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None
_trim = getattr(_libc, "malloc_trim", None)


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is not available)."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def release_memory() -> int:
    """Collect garbage and return free heap pages to the OS; the bytes the resident set shrank."""
    before = resident_bytes()
    gc.collect()
    if _trim is not None:
        _trim(0)
    return max(before - resident_bytes(), 0)
