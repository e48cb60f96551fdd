"""Object storage backends, chosen by URL.

==========================  ==============  ==========================================
URL                         Backend         Conditional writes
==========================  ==============  ==========================================
``/path``, ``file:///path``  LocalStore      atomic across processes on one host
``memory://name``           MemoryStore     atomic (one process; for tests)
``s3://bucket/prefix``      S3Store         atomic (S3 If-None-Match / If-Match)
``gs://bucket/prefix``      GCSStore        atomic (ifGenerationMatch; ``gcs`` extra)
``az://container/prefix``   AzureBlobStore  atomic (If-None-Match / If-Match; ``azure`` extra)
any other fsspec URL        FsspecStore     check-then-write: NOT safe for concurrent writers
==========================  ==============  ==========================================

Without its extra installed, ``gs://`` and ``az://`` fall back to fsspec (gcsfs, adlfs) where
those are installed: a store that checks, then writes, so :func:`require_atomic_writes` refuses
it for concurrent publishers (a single publisher passes ``allow_unsafe_store=True``). It is kept
for reading and for single-writer setups that already use it; nothing forks silently.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any

from deltastore.errors import UnsupportedURLError
from deltastore.storage._local import LocalStore
from deltastore.storage._memory import MemoryStore
from deltastore.storage.base import EndpointIdentity, GetResult, IfMatch, ObjectMeta, PutMode, Store, StreamedPut
from deltastore.storage.probe import (
    ProbeBinding,
    ProbeResult,
    probe_conditional_writes,
    require_atomic_writes,
)

if TYPE_CHECKING:
    from deltastore.storage._azure import AzureBlobStore
    from deltastore.storage._fsspec import FsspecStore
    from deltastore.storage._gcs import GCSStore
    from deltastore.storage._s3 import S3Store

logger = logging.getLogger(__name__)

#: Backends whose modules import heavy SDKs (boto3 ~0.15 s, fsspec): loaded on first use, so
#: that ``import deltastore`` and ``deltastore --help`` stay fast.
_LAZY = {
    "S3Store": "deltastore.storage._s3",
    "FsspecStore": "deltastore.storage._fsspec",
    "GCSStore": "deltastore.storage._gcs",
    "AzureBlobStore": "deltastore.storage._azure",
}
#: Native backends of optional extras: scheme → (module, class, the SDK module it needs, extra).
_NATIVE = {
    "gs": ("deltastore.storage._gcs", "GCSStore", "google.cloud.storage", "gcs"),
    "gcs": ("deltastore.storage._gcs", "GCSStore", "google.cloud.storage", "gcs"),
    "az": ("deltastore.storage._azure", "AzureBlobStore", "azure.storage.blob", "azure"),
}
#: The fsspec implementation each extra's scheme falls back to.
_FSSPEC_PACKAGE = {"gcs": "gcsfs", "azure": "adlfs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: A scheme as RFC 3986 spells it, at least two characters (``C:`` is a Windows drive).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+")
#: Schemes people type for stores; ``s3//bucket`` (colon lost) is a typo of one of them, not a
#: directory named ``s3``.
_STORE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "adl", "file", "memory", "http", "https", "hf", "r2")


def check_url(url: str) -> None:
    """Refuse a store URL that is malformed, or that looks like a URL but is not one.

    A mistyped URL (``s3:/bucket``, ``s3//bucket``, ``S3://bucket``) would otherwise be taken
    for a local directory and silently written to. Write ``./name`` for a local directory whose
    name looks like that. ``http(s)://`` names an endpoint, not a store.

    Raises:
        UnsupportedURLError: the URL is not usable, with the spelling that probably was meant.
    """
    if not isinstance(url, str) or not url:
        raise UnsupportedURLError(f"store URL must be a non-empty string, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if sep:
        if "::" in scheme:  # an fsspec chain (simplecache::s3://...): fsspec checks its parts
            return
        if not _SCHEME.fullmatch(scheme):
            raise UnsupportedURLError(f"{url!r} has no valid scheme before '://' (e.g. s3://bucket/prefix)")
        if scheme != scheme.lower():
            raise UnsupportedURLError(
                f"{url!r}: URL schemes are lower case here; did you mean {scheme.lower()}://{rest}?"
            )
        if scheme in ("http", "https"):
            raise UnsupportedURLError(
                f"{url!r} is an endpoint, not a store: name the store as s3://BUCKET/PREFIX and pass "
                f"the endpoint as endpoint_url={scheme}://{rest.split('/', 1)[0]}"
            )
        return
    head = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", url)
    first = url.split("/", 1)[0]
    if head or (first.lower() in _STORE_SCHEMES and url[len(first):].startswith("//")):
        name = (head.group(1) if head else first).lower()
        tail = url[len(name) + 1:].lstrip("/") if head else url[len(first):].lstrip("/")
        raise UnsupportedURLError(
            f"{url!r} looks like a URL but is not one; did you mean {name}://{tail}? "
            f"(for a local directory of that name write ./{url})"
        )


#: Storage options whose values are always strings (a numeric-looking secret or profile stays one).
STRING_OPTIONS = frozenset({
    "endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
    "profile", "addressing_style", "upload_checksum",
    "project", "token", "account_name", "account_key", "sas_token", "connection_string",
})


def parse_storage_option(text: str) -> tuple[str, Any]:
    """One ``KEY=VALUE`` storage option as a command line gives it: true/false → bool, JSON when
    it parses (``retries=2`` → 2, ``retries={"mode": "adaptive"}`` → a dict), else the string;
    the keys of :data:`STRING_OPTIONS` always keep the string.

    Raises:
        ValueError: no ``=``, or an empty key.
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expects KEY=VALUE, got {text!r} (e.g. --storage-option retries=2)")
    if key in STRING_OPTIONS:
        return key, value
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def open_store(url: str, *, storage_options: dict[str, Any] | None = None, create: bool = True) -> Store:
    """Open the store a URL names.

    Args:
        url: a local path or ``file://`` URL (the directory is created if missing and
            ``create``: a local store needs no setup), ``memory://name``, ``s3://bucket/prefix``,
            ``gs://bucket/prefix`` (with the ``gcs`` extra), ``az://container/prefix`` (with the
            ``azure`` extra), or any other URL fsspec can open (not safe for concurrent
            writers; also ``gs://`` and ``az://`` without their extra, see the module
            docstring). A string that looks like a mistyped URL (``s3:/x``, ``S3://x``) is refused
            (see :func:`check_url`), never taken for a directory.
        storage_options: backend options; for ``s3://`` see :class:`S3Store`, for ``gs://``
            :class:`GCSStore`, for ``az://`` :class:`AzureBlobStore`, for fsspec URLs
            they are passed to the filesystem. Not accepted for local and memory stores.
        create: create a missing local store directory (default True); readers pass False so
            that looking at a store never creates anything (a missing one raises
            BucketNotFoundError). Buckets are never created.

    Returns:
        The store. Use it as a context manager or call ``close()`` when done.

    Raises:
        UnsupportedURLError: unknown or mistyped scheme, a missing fsspec backend package, or
            options the backend does not take.
        AccessDeniedError: ``gs://`` or ``az://`` and no credentials could be found.
        BucketNotFoundError: ``create=False`` and the local directory does not exist.

    Example::

        with open_store("s3://weights/run1") as store:
            store.put("HEAD", b"{}", mode="create")
    """
    check_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    scheme = scheme.lower()
    if scheme in ("file", "memory") and storage_options:
        raise UnsupportedURLError(f"{url} takes no storage_options (got {sorted(storage_options)})")
    if scheme == "file":
        if not rest:
            raise UnsupportedURLError(f"{url!r} names no directory")
        return LocalStore(rest, create=create)
    if scheme == "memory":
        if not rest:
            raise UnsupportedURLError(f"{url!r} names no in-memory store; use memory://name")
        return MemoryStore(url)
    if scheme == "s3":
        from deltastore.storage._s3 import S3Store

        return S3Store(url, storage_options=storage_options)
    if scheme in _NATIVE:
        native = _open_native(url, scheme, storage_options)
        if native is not None:
            return native
    from deltastore.storage._fsspec import FsspecStore

    return FsspecStore.from_url(url, storage_options=storage_options)


def _open_native(url: str, scheme: str, storage_options: dict[str, Any] | None) -> Store | None:
    """The native store of a ``gs://`` / ``az://`` URL, or None when its SDK is not installed
    but fsspec's implementation is (the documented fallback, refused for concurrent publishers).

    Raises:
        UnsupportedURLError: neither the SDK nor an fsspec implementation is installed.
    """
    import importlib
    import importlib.util

    module, name, sdk, extra = _NATIVE[scheme]
    try:
        found = importlib.util.find_spec(sdk) is not None
    except ModuleNotFoundError:  # a parent package (google.cloud, azure) is missing
        found = False
    if found:
        return getattr(importlib.import_module(module), name)(url, storage_options=storage_options)
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        raise UnsupportedURLError(
            f"cannot open {url}: its backend needs {sdk.replace('.', '-')} (pip install 'deltastore-weights[{extra}]'); "
            f"the fsspec fallback, for one publisher only, needs {_FSSPEC_PACKAGE[extra]}"
        ) from None
    logger.warning(
        "%s: %s is not installed, using fsspec, which cannot do atomic conditional writes (one publisher "
        "only); pip install 'deltastore-weights[%s]' for compare-and-swap", url, sdk, extra
    )
    return None


__all__ = [
    "AzureBlobStore",
    "EndpointIdentity",
    "FsspecStore",
    "GCSStore",
    "GetResult",
    "IfMatch",
    "LocalStore",
    "MemoryStore",
    "ObjectMeta",
    "ProbeBinding",
    "ProbeResult",
    "PutMode",
    "S3Store",
    "Store",
    "STRING_OPTIONS",
    "StreamedPut",
    "check_url",
    "open_store",
    "parse_storage_option",
    "probe_conditional_writes",
    "require_atomic_writes",
]
