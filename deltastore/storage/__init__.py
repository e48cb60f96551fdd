"""Object storage backends, chosen by URL.

==========================  ==============  ==========================================
URL                         Backend         Conditional writes
==========================  ==============  ==========================================
``/path``, ``file:///path``  LocalStore      atomic across processes on one host
``memory://name``           MemoryStore     atomic (one process; for tests)
``s3://bucket/prefix``      S3Store         atomic (S3 If-None-Match / If-Match)
any other fsspec URL        FsspecStore     check-then-write: NOT safe for concurrent writers
==========================  ==============  ==========================================
"""

from __future__ import annotations

import logging
from typing import Any

from typing import TYPE_CHECKING

from deltastore.errors import UnsupportedURLError
from deltastore.storage._local import LocalStore
from deltastore.storage._memory import MemoryStore
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store
from deltastore.storage.probe import ProbeResult, probe_conditional_writes, require_atomic_writes

if TYPE_CHECKING:
    from deltastore.storage._fsspec import FsspecStore
    from deltastore.storage._s3 import S3Store

logger = logging.getLogger(__name__)

#: Backends whose modules import heavy SDKs (boto3 ~0.15 s, fsspec): loaded on first use, so
#: that ``import deltastore`` and ``deltastore --help`` stay fast.
_LAZY = {"S3Store": "deltastore.storage._s3", "FsspecStore": "deltastore.storage._fsspec"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(url: str, *, storage_options: dict[str, Any] | None = None) -> Store:
    """Open the store a URL names.

    Args:
        url: a local path or ``file://`` URL (the directory is created if missing: a local
            store needs no setup), ``memory://name``, ``s3://bucket/prefix``, or any other
            URL fsspec can open (``gs://``, ``az://``, ...; not safe for concurrent writers).
        storage_options: backend options; for ``s3://`` see :class:`S3Store`, for fsspec URLs
            they are passed to the filesystem. Not accepted for local and memory stores.

    Returns:
        The store. Use it as a context manager or call ``close()`` when done.

    Raises:
        UnsupportedURLError: unknown scheme, a missing fsspec backend package, or options the
            backend does not take.

    Example::

        with open_store("s3://weights/run1") as store:
            store.put("HEAD", b"{}", mode="create")
    """
    if not isinstance(url, str) or not url:
        raise UnsupportedURLError(f"store URL must be a non-empty string, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    scheme = scheme.lower()
    if scheme in ("file", "memory") and storage_options:
        raise UnsupportedURLError(f"{url} takes no storage_options (got {sorted(storage_options)})")
    if scheme == "file":
        if not rest:
            raise UnsupportedURLError(f"{url!r} names no directory")
        return LocalStore(rest)
    if scheme == "memory":
        if not rest:
            raise UnsupportedURLError(f"{url!r} names no in-memory store; use memory://name")
        return MemoryStore(url)
    if scheme == "s3":
        from deltastore.storage._s3 import S3Store

        return S3Store(url, storage_options=storage_options)
    from deltastore.storage._fsspec import FsspecStore

    return FsspecStore.from_url(url, storage_options=storage_options)


__all__ = [
    "FsspecStore",
    "GetResult",
    "IfMatch",
    "LocalStore",
    "MemoryStore",
    "ObjectMeta",
    "ProbeResult",
    "PutMode",
    "S3Store",
    "Store",
    "open_store",
    "probe_conditional_writes",
    "require_atomic_writes",
]
