"""recsys.core.memory: freed heap pages go back to the OS between nightly stages."""

from __future__ import annotations

import platform
import sys

import pytest

from recsys.core.memory import release_memory, resident_bytes

CHUNK = 64 * 1024  # below glibc's mmap threshold: served from the heap, kept after free


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's; elsewhere release_memory only collects garbage",
)
def test_freed_heap_pages_are_returned_to_the_os() -> None:
    blocks = [bytearray(CHUNK) for _ in range(4096)]  # 256 MiB, every page touched
    last = blocks[-1]  # pins the heap's top, so free() alone cannot shrink it
    del blocks
    kept = resident_bytes()
    released = release_memory()
    assert released >= 128 * 2**20, f"released {released >> 20} MiB of {kept >> 20} MiB"
    assert resident_bytes() <= kept - 128 * 2**20
    assert len(last) == CHUNK


def test_resident_bytes_reads_this_process() -> None:
    assert resident_bytes() > 0 if sys.platform.startswith("linux") else resident_bytes() >= 0
