"""What the native Google Cloud Storage and Azure Blob backends share: one conditional-write
algorithm over two providers' version tokens.

Both providers version each object natively (a GCS *generation*, an Azure *ETag*) and make a
write conditional on it (``ifGenerationMatch`` / ``If-Match``; ``ifGenerationMatch=0`` /
``If-None-Match: *`` for create-only). deltastore's ETag is the hex MD5 of an object's bytes, as on
S3 and every other backend (equal bytes share one ETag), so a compare-and-swap on our ETag is:
find the object's native version whose MD5 is that ETag (remembered from the read that produced
the ETag, else one metadata request), then write conditionally on that native version. The write
is atomic on the server; the lookup never widens it (a native version names exactly one content).

Each provider's module says how to talk to it (:class:`CloudStore`'s ``_native_*`` methods) and
what its errors mean (``_classify``); retries, lost responses, checksums and the error messages
are decided here, once.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TypeVar

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    UploadCorruptedError,
)
from deltastore.storage._keys import check_key, check_prefix
from deltastore.storage.base import EndpointIdentity, GetResult, IfMatch, ObjectMeta, PutMode, Store, check_range

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Attempts of one request answered with a transient failure (5xx, 408, a dropped or refused
#: connection, a body cut short). The providers' SDK retries are turned off: this layer must know
#: when a retry happened, because a conditional write retried after a lost response answers
#: "precondition failed" for its own earlier success (see :meth:`CloudStore.put`).
DEFAULT_MAX_ATTEMPTS = 5
#: First backoff after a transient failure; doubled per attempt with full jitter.
BACKOFF_BASE_S = 0.1
#: Cap on one such backoff.
BACKOFF_MAX_S = 4.0
#: First backoff after a 429 (throttled). GCS allows about one update per second to one object
#: and answers 429 above it; waiting less than that only earns another 429.
THROTTLE_BACKOFF_BASE_S = 1.0
#: Cap on one throttling backoff (GCS's guidance: exponential, up to 32 s; a commit has a deadline).
THROTTLE_BACKOFF_MAX_S = 8.0
#: Attempts of one upload whose bytes arrived altered (the server refused our MD5/CRC32C, or
#: stored an MD5 other than ours): rare and independent per attempt; a repeat is a broken path.
CORRUPT_UPLOAD_MAX_ATTEMPTS = 3
#: Attempts of one read whose body failed its checksum or size: a flipped bit in transit is read
#: again; bytes that keep failing are corrupt at rest.
READ_MAX_ATTEMPTS = 4
#: Reads of a changed object in one conditional GET: the version found by the metadata request is
#: read pinned to it; when it is replaced in between, the newer one is looked up again.
CHANGED_READ_ATTEMPTS = 4
#: Native versions remembered (keys last read or written by this store), so that a
#: compare-and-swap on an ETag this store produced costs one request. A publisher CASes one key
#: (HEAD); the bound keeps a long-lived reader's memory flat.
VERSION_CACHE_SIZE = 256


class Kind(Enum):
    """What a provider's error means, as far as this layer is concerned."""

    PRECONDITION = "precondition"  #: a conditional request was refused (412, Azure's 409 BlobAlreadyExists)
    NOT_MODIFIED = "not_modified"  #: 304
    NOT_FOUND = "not_found"  #: the object (or perhaps its bucket: asked once) is missing
    NO_BUCKET = "no_bucket"  #: the bucket / container is missing
    DENIED = "denied"  #: 401/403, no or bad credentials
    THROTTLED = "throttled"  #: 429 (and Azure's 503 ServerBusy)
    TRANSIENT = "transient"  #: 5xx, 408, connection dropped or refused, body cut short
    BAD_DIGEST = "bad_digest"  #: the server refused an upload's checksum
    CORRUPT_READ = "corrupt_read"  #: a downloaded body failed the stored checksum
    BAD_RANGE = "bad_range"  #: 416: a range starting at or past the end
    OTHER = "other"


@dataclass(frozen=True)
class Version:
    """One version of one object as its server describes it.

    Attributes:
        token: the native version a conditional request names (GCS generation, Azure ETag).
        md5: hex MD5 of the bytes as stored with the object, or None when the server keeps none
            (a GCS composite object, an Azure blob uploaded in blocks by another tool).
        size: bytes.
        last_modified: when it was written, where known.
    """

    token: str
    md5: str | None
    size: int
    last_modified: datetime | None = None

    @property
    def etag(self) -> str:
        """deltastore's ETag: the MD5 of the content, else the native version (unquoted)."""
        return self.md5 or self.token.strip('"')


@dataclass(frozen=True)
class Failure:
    """A provider error classified: what it means and a one-line account of it."""

    kind: Kind
    detail: str


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def md5_b64(md5: bytes) -> str:
    return base64.b64encode(md5).decode("ascii")


def _backoff(attempt: int, base: float, cap: float) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    return random.uniform(0.0, min(cap, base * 2 ** (attempt - 1)))


class _Create:
    """The write condition "the key must not exist" (a sentinel, distinct from any token)."""

    def __repr__(self) -> str:
        return "CREATE"


#: The condition of a native write is CREATE, a native version token (str), or None (unconditional).
CREATE = _Create()


class CloudStore(Store):
    """A store on a provider with native conditional writes (see the module docstring).

    Subclasses set ``provider`` and implement the ``_native_*`` methods and ``_classify``;
    everything else, the :class:`Store` verbs included, is here.
    """

    atomic_conditional_writes = True
    # Emulators differ (gcp-storage-emulator ignores ifGenerationMatch): probe before trusting.
    conditional_writes_need_probe = True
    #: How messages name the service ("GCS", "Azure Blob").
    provider: str = ""
    #: What the URL calls its top level ("bucket", "container").
    bucket_word: str = "bucket"

    def __init__(self, url: str, bucket: str, prefix: str, *, attempts: int = DEFAULT_MAX_ATTEMPTS):
        if prefix:
            check_prefix(prefix)
        self.url = url
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.attempts = max(1, int(attempts))
        self._versions: OrderedDict[str, Version] = OrderedDict()
        self._versions_lock = threading.Lock()
        self._bucket_known_to_exist = False
        self._server_header = ""

    # --- what a provider module implements ---------------------------------------------------

    @abc.abstractmethod
    def _native_write(self, name: str, data: bytes, md5: bytes, condition: object) -> Version:
        """One conditional upload of ``data`` (MD5 ``md5`` sent for the server to check)."""

    @abc.abstractmethod
    def _native_stat(self, name: str) -> Version | None:
        """One metadata request; None when the object does not exist."""

    @abc.abstractmethod
    def _native_read(self, name: str, byte_range: tuple[int, int] | None, pin: str | None) -> tuple[bytes, Version]:
        """One download (of ``[start, stop)``, or whole), of exactly version ``pin`` when given
        (a PRECONDITION failure when it is no longer current). The Version is the one read; its
        ``size`` is the whole object's."""

    @abc.abstractmethod
    def _native_list(self, name_prefix: str) -> Iterator[tuple[str, Version]]:
        """Every object whose name starts with ``name_prefix``: (name, version)."""

    @abc.abstractmethod
    def _native_delete(self, name: str) -> None:
        """Delete the current version (NOT_FOUND when missing)."""

    @abc.abstractmethod
    def _native_bucket_exists(self) -> bool:
        """One request: does the bucket / container exist?"""

    @abc.abstractmethod
    def _classify(self, e: Exception) -> Failure | None:
        """What a provider error means; None for an exception that is not the provider's."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """The URL requests go to, without credentials."""

    # --- retries and error translation -----------------------------------------------------

    def _name(self, key: str | None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def note_server(self, status: int, server: str) -> None:
        """Keep the ``Server`` header of a successful response (for the probe's binding)."""
        if 200 <= status < 300 and server:
            self._server_header = one_line(server)

    def endpoint_identity(self) -> EndpointIdentity:
        """The endpoint this store's requests go to and the ``Server`` header of its latest
        successful response (see :class:`~deltastore.storage.base.EndpointIdentity`)."""
        return EndpointIdentity(endpoint=self.endpoint, server=self._server_header)

    def _retrying(self, op: str, key: str | None, fn: Callable[[], T], retried: list[bool] | None = None) -> T:
        """``fn()``, retried on transient failures and throttling; any other failure propagates
        unchanged. ``retried`` (when given) gets True appended once a retry happened."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                failure = self._classify(e)
                if failure is None or failure.kind not in (Kind.TRANSIENT, Kind.THROTTLED) or attempt >= self.attempts:
                    raise
                throttled = failure.kind is Kind.THROTTLED
                delay = _backoff(attempt, *(
                    (THROTTLE_BACKOFF_BASE_S, THROTTLE_BACKOFF_MAX_S) if throttled else (BACKOFF_BASE_S, BACKOFF_MAX_S)
                ))
                logger.info("%s %s %s: %s, retry %d/%d in %.2f s", self.provider, op, self._name(key),
                            failure.detail, attempt, self.attempts - 1, delay)
                if retried is not None:
                    retried.append(True)
                time.sleep(delay)

    def _translate(self, e: Exception, op: str, key: str | None, mode: PutMode | None = None) -> StorageError:
        """The package's error for a provider error that was not handled where it arose."""
        name = self._name(key)
        failure = self._classify(e) or Failure(Kind.OTHER, one_line(e) or type(e).__name__)
        kind = failure.kind
        if kind is Kind.PRECONDITION:
            if mode == "create":
                return AlreadyExistsError(f"{name} already exists; create-only writes never replace an object")
            return PreconditionFailedError(f"{name} changed since its ETag was read; re-read it and retry")
        if kind is Kind.NO_BUCKET:
            return self._no_bucket(name)
        if kind is Kind.NOT_FOUND:
            if not self._bucket_exists_cached():
                return self._no_bucket(name)
            if isinstance(mode, IfMatch):
                return PreconditionFailedError(f"{name} does not exist, so it cannot match ETag {mode.etag!r}")
            return NotFoundError(f"{name} does not exist")
        if kind is Kind.DENIED:
            return AccessDeniedError(
                f"access denied for {self.provider} {op} on {name} ({failure.detail}): check the credentials and "
                f"their permissions on {self.bucket_word} {self.bucket!r}"
            )
        if kind is Kind.BAD_DIGEST:
            return UploadCorruptedError(
                f"{self.provider} {op} on {name}: the server received other bytes than were sent "
                f"({failure.detail}) on every attempt; check the network path to {self.endpoint}"
            )
        if kind is Kind.CORRUPT_READ:
            return IntegrityError(
                f"{name} failed its checksum on each of {READ_MAX_ATTEMPTS} reads ({failure.detail}): the stored "
                f"object or the network path is corrupt"
            )
        if kind in (Kind.TRANSIENT, Kind.THROTTLED):
            return StorageError(
                f"{self.provider} {op} on {name} kept failing after {self.attempts} attempts ({failure.detail}); "
                f"is {self.endpoint} reachable and healthy?"
            )
        return StorageError(f"{self.provider} {op} on {name} failed: {failure.detail}")

    def _no_bucket(self, name: str) -> BucketNotFoundError:
        return BucketNotFoundError(
            f"{self.bucket_word} {self.bucket!r} of {name} does not exist at {self.endpoint}; create it or fix the URL"
        )

    def _bucket_exists_cached(self) -> bool:
        """A bare 404 may mean a missing object or a missing bucket: asked once per store, so
        that a typo in the bucket name is not reported as a missing object forever."""
        if self._bucket_known_to_exist:
            return True
        try:
            exists = self._retrying("bucket check", None, self._native_bucket_exists)
        except Exception:  # undecided: report the object as missing, as the server did
            return True
        self._bucket_known_to_exist = exists
        return exists

    # --- the version cache -----------------------------------------------------------------

    def _remember(self, key: str, version: Version) -> None:
        with self._versions_lock:
            self._versions[key] = version
            self._versions.move_to_end(key)
            while len(self._versions) > VERSION_CACHE_SIZE:
                self._versions.popitem(last=False)

    def _forget(self, key: str) -> None:
        with self._versions_lock:
            self._versions.pop(key, None)

    def _known(self, key: str, etag: str) -> Version | None:
        with self._versions_lock:
            version = self._versions.get(key)
        return version if version is not None and version.etag == etag else None

    def _meta(self, key: str, version: Version) -> ObjectMeta:
        return ObjectMeta(key=key, size=version.size, etag=version.etag, last_modified=version.last_modified)

    # --- Store -----------------------------------------------------------------------------

    def _stat(self, key: str) -> Version | None:
        full = self._full(key)
        try:
            version = self._retrying("HEAD", key, lambda: self._native_stat(full))
        except Exception as e:
            raise self._translate(e, "HEAD", key) from e
        if version is None:
            self._forget(key)
        else:
            self._remember(key, version)
        return version

    def head(self, key: str) -> ObjectMeta:
        version = self._stat(key)
        if version is None:
            if not self._bucket_exists_cached():
                raise self._no_bucket(self._name(key))
            raise NotFoundError(f"{self._name(key)} does not exist")
        return self._meta(key, version)

    def _read(self, key: str, byte_range: tuple[int, int] | None, pin: str | None) -> tuple[bytes, Version]:
        """A download checked end to end: a whole object against the MD5 stored with it, a range
        against its length; a body that fails is read again (READ_MAX_ATTEMPTS).

        Raises the provider's PRECONDITION failure untranslated (``pin`` is no longer current).
        """
        full = self._full(key)
        last = ""
        for attempt in range(1, READ_MAX_ATTEMPTS + 1):
            try:
                data, version = self._retrying("GET", key, lambda: self._native_read(full, byte_range, pin))
            except Exception as e:
                failure = self._classify(e)
                if failure is None or failure.kind is not Kind.CORRUPT_READ:
                    raise
                last = failure.detail
            else:
                if byte_range is None:
                    if len(data) != version.size:
                        last = f"{len(data)} bytes read of {version.size}"
                    elif version.md5 is not None and hashlib.md5(data, usedforsecurity=False).hexdigest() != version.md5:
                        last = "MD5 of the bytes read differs from the one stored with them"
                    else:
                        return data, version
                else:
                    start, stop = byte_range
                    want = max(0, min(stop, version.size) - start)
                    if len(data) == want:
                        return data, version
                    last = f"asked for bytes [{start}, {stop}) of {version.size}, got {len(data)}"
            logger.warning("%s GET %s attempt %d/%d: %s", self.provider, self._name(key), attempt, READ_MAX_ATTEMPTS, last)
        raise IntegrityError(
            f"{self._name(key)} failed its checksum or size on each of {READ_MAX_ATTEMPTS} reads ({last}): the "
            f"stored object or the network path is corrupt"
        )

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        check_key(key)
        check_range(byte_range)
        if byte_range is not None and byte_range[0] == byte_range[1]:
            self.head(key)  # still raise NotFoundError for a missing key
            return b""
        try:
            data, version = self._read(key, byte_range, None)
        except (StorageError, IntegrityError):
            raise
        except Exception as e:
            failure = self._classify(e)
            if byte_range is not None and failure is not None and failure.kind is Kind.BAD_RANGE:
                return b""  # start at or past the end: an empty slice, like bytes[start:stop]
            raise self._translate(e, "GET", key) from e
        if byte_range is None:
            self._remember(key, version)
        return data

    def get_with_meta(self, key: str) -> GetResult:
        check_key(key)
        try:
            data, version = self._read(key, None, None)
        except (StorageError, IntegrityError):
            raise
        except Exception as e:
            raise self._translate(e, "GET", key) from e
        self._remember(key, version)
        return GetResult(data=data, meta=self._meta(key, version))

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        """Conditional GET: one metadata request (no body) while the object's ETag is ``etag``;
        when it changed, the body of exactly the version that request found.

        Raises:
            NotFoundError: the key does not exist.
        """
        if etag is None:
            return self.get_with_meta(key)
        for _ in range(CHANGED_READ_ATTEMPTS):
            version = self._stat(key)
            if version is None:
                return self.get_with_meta(key)  # raises NotFoundError / BucketNotFoundError
            if version.etag == etag:
                return None
            try:
                data, read = self._read(key, None, version.token)
            except (StorageError, IntegrityError):
                raise
            except Exception as e:
                failure = self._classify(e)
                if failure is not None and failure.kind in (Kind.PRECONDITION, Kind.NOT_FOUND):
                    continue  # replaced or deleted since the metadata request: look again
                raise self._translate(e, "GET", key) from e
            self._remember(key, read)
            return GetResult(data=data, meta=self._meta(key, read))
        return self.get_with_meta(key)  # rewritten in a loop: settle for any consistent version

    def _landed(self, key: str, md5_hex: str, size: int) -> Version | None:
        """After a lost response: the object's current version when it holds our bytes."""
        try:
            version = self._stat(key)
        except StorageError:
            return None
        if version is not None and version.md5 == md5_hex and version.size == size:
            return version
        return None

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        """Write ``data`` under ``key`` (see :meth:`Store.put`), checked end to end.

        The upload carries the MD5 of the bytes for the server to check, and the MD5 the server
        stored is compared with ours; bytes stored altered are replaced (conditionally on exactly
        the damaged version) up to CORRUPT_UPLOAD_MAX_ATTEMPTS times.

        A request that failed transiently is retried. When a conditional write is refused after
        such a retry, the earlier attempt may have landed with its response lost: the object is
        read, and if it holds exactly our bytes the write succeeded (for every key deltastore
        CASes, equal bytes mean the same commit; for content-addressed keys, the same content).

        Raises:
            AlreadyExistsError, PreconditionFailedError: as :meth:`Store.put` (a refusal is
                never retried).
            UploadCorruptedError: the bytes arrived altered on every attempt.
            AccessDeniedError, BucketNotFoundError, StorageError: as their names say.
        """
        full = self._full(key)
        if not (mode in ("create", "overwrite") or isinstance(mode, IfMatch)):
            raise ValueError(f"unknown put mode {mode!r}")
        data = bytes(data) if not isinstance(data, bytes) else data
        md5 = hashlib.md5(data, usedforsecurity=False).digest()
        condition: object
        if mode == "create":
            condition = CREATE
        elif mode == "overwrite":
            condition = None
        else:
            assert isinstance(mode, IfMatch)
            known = self._known(key, mode.etag)
            if known is None:
                current = self._stat(key)
                if current is None:
                    raise PreconditionFailedError(f"{self._name(key)} does not exist, so it cannot match ETag {mode.etag!r}")
                if current.etag != mode.etag:
                    raise PreconditionFailedError(
                        f"{self._name(key)} changed: ETag is {current.etag!r}, expected {mode.etag!r}; re-read it and retry"
                    )
                known = current
            condition = known.token
        corrupt = 0
        while True:
            retried: list[bool] = []
            try:
                version = self._retrying("PUT", key, lambda: self._native_write(full, data, md5, condition), retried)
            except Exception as e:
                failure = self._classify(e)
                kind = failure.kind if failure is not None else Kind.OTHER
                if kind is Kind.PRECONDITION and retried:
                    landed = self._landed(key, md5.hex(), len(data))
                    if landed is not None:
                        logger.info("%s PUT %s: an earlier attempt landed (its response was lost)", self.provider,
                                    self._name(key))
                        return self._meta(key, landed)
                if kind is Kind.BAD_DIGEST:
                    corrupt += 1
                    if corrupt < CORRUPT_UPLOAD_MAX_ATTEMPTS:
                        logger.warning("%s PUT %s: server saw altered bytes (%s), retrying", self.provider,
                                       self._name(key), failure.detail if failure else "")
                        continue
                if kind is Kind.PRECONDITION and corrupt:
                    raise UploadCorruptedError.unreplaceable(self._name(key)) from e
                self._forget(key)
                raise self._translate(e, "PUT", key, mode) from e
            if version.md5 is None or version.md5 == md5.hex():
                version = Version(version.token, md5.hex(), len(data), version.last_modified)
                self._remember(key, version)
                return self._meta(key, version)
            corrupt += 1
            if corrupt >= CORRUPT_UPLOAD_MAX_ATTEMPTS:
                removed = mode == "create" and self._delete_version(key, version)
                raise UploadCorruptedError.stored_altered(
                    self._name(key), corrupt, f"stored MD5 {version.md5!r}, sent {md5.hex()!r}", removed)
            logger.warning("%s PUT %s: stored bytes differ from the data sent, rewriting", self.provider, self._name(key))
            condition = version.token  # replace exactly the damaged version we wrote, nothing newer

    def _delete_version(self, key: str, version: Version) -> bool:
        """Delete ``key`` if it is still ``version`` (our damaged create-only upload): left in
        place it would read as "already exists" to every later writer of that content-addressed
        key. Best effort; True when it was deleted."""
        try:
            current = self._stat(key)
            if current is None or current.token != version.token:
                return False
            self.delete(key)
        except StorageError:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        try:
            found = self._retrying("LIST", prefix or None, lambda: list(self._native_list(self.prefix + prefix)))
        except Exception as e:
            raise self._translate(e, "LIST", prefix or None) from e
        metas = [self._meta(name[len(self.prefix):], version) for name, version in found]
        metas.sort(key=lambda m: m.key)  # the store's order is UTF-8 byte order; say so once
        return iter(metas)

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._forget(key)
        try:
            self._retrying("DELETE", key, lambda: self._native_delete(full))
        except Exception as e:
            failure = self._classify(e)
            if failure is not None and failure.kind is Kind.NOT_FOUND:
                return
            raise self._translate(e, "DELETE", key) from e

    def check_endpoint(self) -> None:
        """Make sure the endpoint answers as the provider and the bucket exists (one request).

        Raises:
            BucketNotFoundError: the bucket / container does not exist.
            AccessDeniedError: the credentials were refused.
            StorageError: the endpoint cannot be reached or does not answer as the provider.
        """
        try:
            exists = self._retrying("bucket check", None, self._native_bucket_exists)
        except Exception as e:
            raise self._translate(e, "bucket check", None) from e
        if not exists:
            raise self._no_bucket(self.url)
        self._bucket_known_to_exist = True
