"""Seams into the native cloud backends (``deltastore.storage._cloud.CloudStore``) for tests:
count the provider requests a store makes, and lose responses of writes that landed.

Both wrap the store's ``_native_*`` methods, the documented seam between the shared
conditional-write logic and each provider's SDK calls, on one store instance only.

Example::

    with lose_first_response(store) as lost:
        store.put("HEAD", b"v1", mode="create")   # lands, its answer is lost, settled by a read
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["NativeCalls", "lose_first_response", "native_calls"]


@dataclass
class NativeCalls:
    """Provider requests a store made: uploads, downloads (bodies) and metadata requests."""

    writes: int = 0
    reads: int = 0
    stats: int = 0


@contextlib.contextmanager
def native_calls(store: Any) -> Iterator[NativeCalls]:
    """Count ``store``'s uploads, downloads and metadata requests while the block runs."""
    seen = NativeCalls()
    lock = threading.Lock()
    originals = {name: getattr(store, name) for name in ("_native_write", "_native_read", "_native_stat")}
    fields = {"_native_write": "writes", "_native_read": "reads", "_native_stat": "stats"}

    def counting(name: str):
        real = originals[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                setattr(seen, fields[name], getattr(seen, fields[name]) + 1)
            return real(*args, **kwargs)

        return call

    for name in originals:
        setattr(store, name, counting(name))
    try:
        yield seen
    finally:
        for name in originals:
            delattr(store, name)  # the class's method again


@contextlib.contextmanager
def lose_first_response(store: Any) -> Iterator[list[str]]:
    """Every put's first upload lands on the server and then fails as if its response was lost
    (a ConnectionError, which the store retries); yields the names whose response was lost."""
    lost: list[str] = []
    real = store._native_write
    armed = [True]

    def write(name: str, data: bytes, md5: bytes, condition: object) -> Any:
        if not armed[0]:  # the retry: answered as the server answers it; the next put loses again
            armed[0] = True
            return real(name, data, md5, condition)
        real(name, data, md5, condition)
        armed[0] = False
        lost.append(name.rsplit("/", 1)[-1])
        raise ConnectionError("connection reset after the request was applied (injected)")

    store._native_write = write
    try:
        yield lost
    finally:
        del store._native_write
