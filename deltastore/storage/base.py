"""The storage interface: a handful of verbs every backend implements.

Keys are ``/``-separated strings relative to the store's root (the URL's path or prefix). Each
backend translates its own failures (botocore ``ClientError`` codes, ``OSError``) into the
package's error tree exactly once, inside that backend.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Union


@dataclass(frozen=True)
class IfMatch:
    """Put mode: replace the object only if its current ETag is ``etag`` (compare-and-swap)."""

    etag: str


PutMode = Union[Literal["create", "overwrite"], IfMatch]
"""How :meth:`Store.put` treats an existing object.

- ``"create"``: write only if the key does not exist, else :class:`AlreadyExistsError`.
- ``"overwrite"``: write unconditionally.
- ``IfMatch(etag)``: write only if the current ETag is ``etag``, else
  :class:`PreconditionFailedError` (also when the key does not exist).

With every mode, no reader ever observes a partially written object.
"""


@dataclass(frozen=True)
class ObjectMeta:
    """What a store knows about one object without reading it."""

    key: str
    size: int
    etag: str
    last_modified: datetime | None = None


@dataclass(frozen=True)
class GetResult:
    """An object's bytes together with the metadata of the version that was read."""

    data: bytes
    meta: ObjectMeta


@dataclass(frozen=True)
class EndpointIdentity:
    """Who answers a store's requests, as the client itself observes it.

    A store with a remote endpoint returns it from ``endpoint_identity()``; the conditional-write
    probe binds its verdict to it (docs/SPEC.md §1.1).

    Attributes:
        endpoint: the URL the client sends requests to (without credentials).
        server: the ``Server`` header of the latest successful response ("" before one, or
            when the server sends none).
    """

    endpoint: str
    server: str = ""


def check_range(byte_range: tuple[int, int] | None) -> tuple[int, int] | None:
    """Validate a half-open ``[start, stop)`` byte range (every store's ``byte_range``)."""
    if byte_range is None:
        return None
    start, stop = byte_range
    if start < 0 or stop < start:
        raise ValueError(
            f"invalid byte range {byte_range!r}: need 0 <= start <= stop (half-open [start, stop))"
        )
    return byte_range


def check_if_match(name: str, current: str | None, expected: str) -> None:
    """Raise PreconditionFailedError unless an object's ETag ``current`` is ``expected``.

    For backends that emulate If-Match (read the ETag, compare, then write); ``current`` is
    None when the object does not exist.
    """
    from deltastore.errors import PreconditionFailedError

    if current is None:
        raise PreconditionFailedError(f"{name} does not exist, so it cannot match ETag {expected!r}")
    if current != expected:
        raise PreconditionFailedError(f"{name} changed: ETag is {current!r}, expected {expected!r}; re-read it and retry")


class StreamedPut(abc.ABC):
    """A create-only write in progress (:meth:`Store.begin_put`): bytes in, then a name."""

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` (it may be reused once this returns)."""

    @abc.abstractmethod
    def commit(self, name: str) -> ObjectMeta:
        """Make the bytes written the object ``directory + name``, create-only, durably.

        Raises:
            AlreadyExistsError: that key exists (nothing was replaced; the write is dropped).
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the write (idempotent; after a commit it does nothing)."""


class Store(abc.ABC):
    """A flat key → bytes store with conditional writes.

    Capability flags say what a backend can guarantee; the commit protocol refuses to run on a
    store without ``atomic_conditional_writes`` unless the user opts in (see docs/SPEC.md).
    """

    #: The URL this store was opened from (credentials never appear in it).
    url: str
    #: True when "create" and IfMatch puts are atomic against concurrent writers.
    atomic_conditional_writes: bool = True
    #: True when that promise depends on a remote endpoint (S3-compatible servers differ), so
    #: it must be checked by :func:`deltastore.storage.probe.require_atomic_writes` before
    #: concurrent publishers rely on it; False where it holds by construction (local, memory).
    conditional_writes_need_probe: bool = False

    @abc.abstractmethod
    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        """Return the object's bytes, or the half-open ``[start, stop)`` range of them.

        A range returns exactly ``stop - start`` bytes, fewer only where the object ends first
        (like ``bytes[start:stop]``). A body cut short in transit is read again.

        Raises:
            NotFoundError: the key does not exist.
            IntegrityError: the bytes kept failing the checksum the server stored with them.
        """

    @abc.abstractmethod
    def get_with_meta(self, key: str) -> GetResult:
        """Return the whole object and the metadata (ETag) of exactly the version read."""

    @abc.abstractmethod
    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        """Conditional GET: ``None`` when the object's ETag is still ``etag`` (no body moved).

        With ``etag=None`` this is :meth:`get_with_meta`.

        Raises:
            NotFoundError: the key does not exist.
        """

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        """Write ``data`` under ``key`` atomically and return the new object's metadata.

        Raises:
            AlreadyExistsError: ``mode="create"`` and the key exists.
            PreconditionFailedError: ``mode=IfMatch(etag)`` and the ETag differs or the key
                does not exist. Never raised for anything but a real precondition answer.
            ConcurrentWriteError: another write to the key kept conflicting (S3's 409); the
                outcome is unknown, read the key back.
            UploadCorruptedError: the bytes kept arriving altered at the server.
        """

    @abc.abstractmethod
    def head(self, key: str) -> ObjectMeta:
        """Return the object's metadata. Raises NotFoundError when missing."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        """Yield every object whose key starts with ``prefix``, in lexicographic key order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; deleting a missing key is not an error."""

    def exists(self, key: str) -> bool:
        """True when the key exists."""
        from deltastore.errors import NotFoundError

        try:
            self.head(key)
        except NotFoundError:
            return False
        return True

    def _metas(self, keys: list[str]) -> Iterator[ObjectMeta]:
        """``head`` of each key, skipping keys deleted since they were listed."""
        from deltastore.errors import NotFoundError

        for key in keys:
            try:
                yield self.head(key)
            except NotFoundError:
                continue

    def begin_put(self, directory: str) -> StreamedPut | None:
        """Start a create-only write of an object under ``directory`` (a key prefix ending in
        ``/``) whose name is known only once its last byte is written (a content-addressed
        pack, named by the SHA-256 of its bytes), or None where the store takes whole objects
        only (the default; S3's multipart needs the key up front).

        The writer streams the bytes as they come, so that finishing the object costs the
        rest of it rather than all of it; nothing is visible under any key before
        :meth:`StreamedPut.commit`.
        """
        return None

    def close(self) -> None:
        """Release connections and other resources. The store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
