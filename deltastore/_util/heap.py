"""Freed heap memory handed back to the operating system after whole-model work.

Encoding or decoding a whole model (an anchor: every chunk as a full segment) allocates and frees
chunk-sized buffers (byte planes, zstd frames) on the encode and read threads. glibc keeps what
a thread frees in that thread's arena for reuse, and raises its mmap threshold once such a
buffer is freed, so the next ones come from the arena too: after a 531 MB anchor the publisher's
two encode threads held ~120 MB of freed memory (0.08-0.15x the model in RSS) through every later
version, counted in its peak. ``malloc_trim(0)`` returns the free pages of every arena (~2 ms).
It is called after an anchor is committed and after a whole version is materialized, not per
delta (a delta's buffers are small and reused). Other C libraries (musl, macOS) have no
``malloc_trim``: there it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _find_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the C library the process runs on
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _find_trim()


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``); False where the C
    library has no such call. Never raises."""
    if _TRIM is None:
        return False
    try:
        _TRIM(0)
    except Exception as e:  # noqa: BLE001 - memory housekeeping must never fail the caller
        logger.debug("malloc_trim failed: %s", e)
        return False
    return True
