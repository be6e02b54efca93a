"""glibc's allocator, tuned for processes that stream models through MQTT.

paho builds every incoming packet in fresh memory and copies a 1 MiB chunk four or five times
before the SDK sees it (`bytes +=` per socket read, then a `struct.unpack` per header field).
Under glibc's default, dynamic thresholds that memory is handed back to the kernel after every
chunk (the trim threshold follows the largest block freed, ~2 MiB) and faulted back in for the
next one: a receiver took ~39,000 page faults per 40 MB model, ~13,000 tuned, and alone about
1.7x the CPU (docs/benchmarks/transport.md, `benchmarks/transport.py --parts processes`).
`tune_for_streams()` fixes both thresholds so that the chunks' scratch memory stays in the heap
between chunks.

It is process-wide, so a library object never calls it behind the app's back: the `edgefl`
commands that talk to a broker do (unless `broker.tune_malloc = false`), and a device app may.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache
from typing import Any

__all__ = [
    "M_ARENA_MAX",
    "M_MMAP_THRESHOLD",
    "M_TRIM_THRESHOLD",
    "glibc",
    "release_free_memory",
    "tune_for_streams",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


@cache
def glibc() -> Any | None:
    """The C library with `mallopt` and `malloc_trim` typed; None where it is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl, macOS, Windows
        return None
    return libc


def tune_for_streams(mmap_threshold: int = 4 * MiB, trim_threshold: int = 32 * MiB) -> bool:
    """Keep blocks under `mmap_threshold` in the heap, and up to `trim_threshold` bytes of free
    heap from going back to the kernel, for the rest of the process. Returns False (and changes
    nothing) where the C library is not glibc.

    The defaults hold the scratch memory of a few chunks in flight (4 MiB covers a 2 MiB
    payload limit and paho's copies); blocks above 4 MiB, such as a whole received model, are
    still mapped on their own and returned when freed. The cost: each malloc arena (at most 8 per
    core) may keep up to `trim_threshold` of free memory. Raises ValueError, changing nothing,
    unless both are between 0 and 2**31 - 1 (mallopt takes a C int).
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if not 0 <= value < 2**31:
            raise ValueError(f"{name}={value}: must be a byte count from 0 to 2**31 - 1")
    libc = glibc()
    if libc is None:
        return False
    for param, value in ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold)):
        if libc.mallopt(param, value) != 1:
            raise ValueError(f"glibc refused mallopt({param}, {value})")
    log.info("malloc: mmap threshold %d, trim threshold %d", mmap_threshold, trim_threshold)
    return True


def release_free_memory() -> bool:
    """Give the free pages of every malloc arena back to the kernel (`malloc_trim(0)`), e.g.
    after a large reassembly buffer expired; False where the C library is not glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
