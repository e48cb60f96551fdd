"""Thread sizing and job grouping shared by the encode (publish) and decode (pull) paths.

Both sides cut a model into chunks and hand them to a thread pool. Tiny chunks (LayerNorm
weights, biases) are grouped into one job of about :data:`JOB_BYTES`, so the threads compute
instead of queueing for the GIL between jobs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar

_T = TypeVar("_T")

#: Chunks smaller than this are handled together as one thread job: a job per tiny tensor makes
#: the threads queue for the GIL more than they compute (MiniLM, 64 of 103 tensors < 10k elements).
JOB_BYTES = 1024 * 1024


def default_threads() -> int:
    """Encode/decode threads: every core this process may run on (zstd, hashing and numpy
    release the GIL)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def grouped(items: Iterable[_T], nbytes: Callable[[_T], int], limit: int = JOB_BYTES) -> list[list[_T]]:
    """Consecutive ``items`` in groups that each close once they hold ``limit`` bytes or more.

    Example::

        >>> grouped([1, 2, 3, 4], nbytes=lambda n: n, limit=3)
        [[1, 2], [3], [4]]
    """
    groups: list[list[_T]] = [[]]
    size = 0
    for item in items:
        if size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes(item)
    return groups if groups[0] else []
