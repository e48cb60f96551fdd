"""Amazon S3 and S3-compatible stores (moto, SeaweedFS, MinIO, R2, ...) through boto3.

Conditional writes map one to one onto S3's: ``"create"`` is ``PutObject`` with
``If-None-Match: *`` and ``IfMatch(etag)`` is ``PutObject`` with ``If-Match``. botocore's
``ClientError`` codes are translated into deltastore's error tree here and nowhere else.

What botocore's own retries do not cover is handled here too: a 409 (a concurrent write to the
same key) is retried, never read as "already exists"; every upload carries SHA-256 and MD5 of its
bytes and its ETag is checked, so bytes altered in transit never stay stored; a response body cut
short, or failing its checksum, is read again; a range GET returns exactly the bytes asked for.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
import botocore.parsers
import urllib3.exceptions
from botocore.config import Config

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ConcurrentWriteError,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    UnsupportedURLError,
    UploadCorruptedError,
)
from deltastore.storage._botocore import (
    backoff,
    botocore_session,
    connect_failure,
    error_code,
    one_line,
    quote,
    redact_sdk_logs,
)
from deltastore.storage._keys import check_key, check_prefix, normalize_etag
from deltastore.storage.base import EndpointIdentity, GetResult, IfMatch, ObjectMeta, PutMode, Store, check_range

logger = logging.getLogger(__name__)

#: Connections per client: publish and pull move blobs from thread pools wider than botocore's
#: default of 10, and a starved pool serializes transfers.
DEFAULT_MAX_POOL_CONNECTIONS = 64
#: botocore "standard" retry attempts (5xx, throttling, connection errors). A retried
#: conditional PUT whose first attempt landed answers a false 412; the commit protocol, not this
#: layer, resolves that (it reads HEAD back and looks for its own commit id).
DEFAULT_MAX_ATTEMPTS = 5
#: Attempts of one PutObject answered 409 (``ConditionalRequestConflict``: another conditional
#: write to the same key was in flight, e.g. an SDK retry overlapping a slow first attempt). AWS
#: asks the client to retry; botocore does not. A 409 says nothing about whether the key exists,
#: so it must never be read as "already exists" (that committed versions with missing packs).
CONFLICT_MAX_ATTEMPTS = 6
#: First backoff after a 409; doubled per attempt with full jitter, so racing retries spread out.
CONFLICT_BACKOFF_BASE_S = 0.1
#: Cap on one 409 backoff: the conflicting write is one request, it ends within seconds.
CONFLICT_BACKOFF_MAX_S = 2.0
#: Attempts of one upload whose bytes arrived altered (the server answered BadDigest, or stored
#: bytes whose MD5 ETag differs from ours). A flipped bit in transit is rare and independent per
#: attempt; one that repeats is a broken path (proxy, NIC) that retrying will not fix.
CORRUPT_UPLOAD_MAX_ATTEMPTS = 3
#: Attempts of one GET whose body was cut short, timed out mid-body or failed its checksum:
#: botocore retries a request only until its response headers arrive, never while the body streams.
READ_MAX_ATTEMPTS = 4
#: First backoff between read attempts (doubled per attempt, full jitter).
READ_BACKOFF_BASE_S = 0.05
#: Cap on one read backoff.
READ_BACKOFF_MAX_S = 1.0
#: Attempts to connect of the endpoint check (a listing before a command starts) unless
#: ``retries`` is set: one, so that an endpoint nothing answers at is reported at once instead of
#: after botocore's backoff; an endpoint that answers gets the store's retries.
ENDPOINT_CHECK_CONNECT_ATTEMPTS = 1

#: Values of the ``upload_checksum`` storage option. Some S3-compatible servers rejected the
#: flexible-checksum headers when botocore 1.36 started sending them by default; Content-MD5
#: is S3's oldest header and the ETag check needs MD5 anyway, so "md5" is the fallback.
UPLOAD_CHECKSUMS = ("sha256", "md5")

_KNOWN_OPTIONS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "profile",
        "max_pool_connections",
        "addressing_style",
        "retries",
        "connect_timeout",
        "read_timeout",
        "upload_checksum",
    }
)
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_ACCESS_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "403",
    "Forbidden",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_PRECONDITION = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
#: Codes of an upload whose body did not match the checksum sent with it. Measured: SeaweedFS
#: answers ``BadDigest`` to a wrong x-amz-checksum-sha256 and to a wrong Content-MD5; AWS uses
#: ``BadDigest``/``InvalidDigest`` (and ``XAmzContentSHA256Mismatch`` for a signed payload).
_BAD_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
#: Ways a response body can end early or stall while being read, after the headers arrived.
_TRUNCATED_BODY = (
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    http.client.IncompleteRead,
    ConnectionError,
)
_MD5_HEX = re.compile(r"[0-9a-f]{32}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_NOT_MODIFIED = {"304", "NotModified"}
_INVALID_RANGE = {"InvalidRange", "416"}


class _ShortRange(Exception):
    """A ranged GET answered other bytes than asked for (internal; retried, then translated)."""


class S3Store(Store):
    """Objects under ``s3://bucket/prefix`` on S3 or any S3-compatible server.

    Conditional writes are atomic on servers that implement S3's ``If-None-Match``/``If-Match``
    on PutObject (AWS since 2024, moto, SeaweedFS, MinIO; not rclone's ``serve s3``). ETags are
    returned without quotes. The boto3 client is shared by all threads using the store.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``; keys are relative to the prefix.
        storage_options: ``endpoint_url`` (else ``AWS_ENDPOINT_URL`` from the environment, which
            boto3 reads itself), ``region_name``, ``aws_access_key_id``,
            ``aws_secret_access_key``, ``aws_session_token``, ``profile``,
            ``max_pool_connections``, ``addressing_style`` (``"path"`` by default with a custom
            endpoint, else ``"auto"``), ``retries`` (max attempts, or a botocore retries dict),
            ``connect_timeout``, ``read_timeout``, ``upload_checksum`` (``"sha256"``, the
            default: every upload carries x-amz-checksum-sha256 and Content-MD5; ``"md5"``:
            Content-MD5 only, for servers that reject S3's flexible-checksum headers). Credentials
            otherwise come from the standard AWS chain; they are never logged and never appear
            in ``repr``.

    Example::

        store = S3Store("s3://weights/run1", storage_options={"endpoint_url": "http://127.0.0.1:9000"})
        store.put("HEAD", b"{}", mode="create")
    """

    atomic_conditional_writes = True
    # rclone's serve s3 ignores If-None-Match/If-Match; older MinIO honoured If-Match on
    # missing keys: the endpoint is probed before concurrent publishers trust it.
    conditional_writes_need_probe = True

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None):
        if not url.startswith("s3://"):
            raise UnsupportedURLError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise UnsupportedURLError(f"{url!r} names no bucket; use s3://bucket/prefix")
        prefix = prefix.strip("/")
        if prefix:
            check_prefix(prefix)
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        options = dict(storage_options or {})
        unknown = set(options) - _KNOWN_OPTIONS
        if unknown:
            raise UnsupportedURLError(
                f"unknown storage option(s) {sorted(unknown)} for {self.url}; known: {sorted(_KNOWN_OPTIONS)}"
            )
        self.endpoint_url = (
            options.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        addressing = options.get("addressing_style") or ("path" if self.endpoint_url else "auto")
        retries = options.get("retries", DEFAULT_MAX_ATTEMPTS)
        if isinstance(retries, int):
            retries = {"mode": "standard", "max_attempts": retries}
        config_kwargs: dict[str, Any] = {
            "s3": {"addressing_style": addressing},
            "max_pool_connections": options.get("max_pool_connections", DEFAULT_MAX_POOL_CONNECTIONS),
            "retries": retries,
        }
        self._upload_checksum = options.get("upload_checksum", "sha256")
        if self._upload_checksum not in UPLOAD_CHECKSUMS:
            raise UnsupportedURLError(
                f"upload_checksum={self._upload_checksum!r} for {self.url}; use one of {UPLOAD_CHECKSUMS}"
            )
        for name in ("connect_timeout", "read_timeout"):
            if name in options:
                config_kwargs[name] = options[name]
        self._retries_given = "retries" in options
        try:
            session = boto3.session.Session(
                botocore_session=botocore_session(),
                aws_access_key_id=options.get("aws_access_key_id"),
                aws_secret_access_key=options.get("aws_secret_access_key"),
                aws_session_token=options.get("aws_session_token"),
                region_name=options.get("region_name"),
                profile_name=options.get("profile"),
            )
            self._client = session.client(
                "s3", endpoint_url=options.get("endpoint_url"), config=Config(**config_kwargs)
            )
            self._session = session
            self._endpoint_option = options.get("endpoint_url")
        except botocore.exceptions.ProfileNotFound as e:
            profile = options.get("profile") or getattr(e, "kwargs", {}).get("profile")  # or AWS_PROFILE's
            raise AccessDeniedError(f"AWS profile {profile!r} for {self.url} not found in ~/.aws/config") from e
        except botocore.exceptions.BotoCoreError as e:
            raise StorageError(f"cannot configure an S3 client for {self.url}: {one_line(e)}") from e
        redact_sdk_logs(options.get("aws_secret_access_key"), options.get("aws_session_token"))
        self._bucket_known_to_exist = False
        self._etags_are_md5 = True  # until a read-back shows otherwise (see _stored_other_bytes)
        self._bucket_check_lock = threading.Lock()
        self._server_header = ""
        self._client.meta.events.register("after-call.s3", self._note_server)
        logger.debug("opened %r (addressing=%s)", self, addressing)

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Store({self.url!r}{endpoint})"

    def close(self) -> None:
        self._client.close()

    @property
    def _endpoint(self) -> str:
        """The URL requests go to (the configured endpoint, else the AWS one botocore resolved),
        without any credentials written into it."""
        parts = urllib.parse.urlsplit(self._client.meta.endpoint_url)
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), "", ""))

    def _note_server(self, http_response: Any, **_: Any) -> None:
        """Keep the ``Server`` header of successful responses (an ``after-call`` hook). Error
        responses are skipped: some servers name themselves differently there (moto adds
        ``amazon.com``)."""
        if 200 <= http_response.status_code < 300:
            self._server_header = one_line(http_response.headers.get("Server", ""))

    def endpoint_identity(self) -> EndpointIdentity:
        """The endpoint this store's requests go to and the ``Server`` header of its latest
        successful response (see :class:`~deltastore.storage.base.EndpointIdentity`)."""
        return EndpointIdentity(endpoint=self._endpoint, server=self._server_header)

    # --- error translation (the only place botocore errors are looked at) ------------------

    def _name(self, key: str | None) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _translate(self, e: Exception, op: str, key: str | None, mode: PutMode | None = None) -> StorageError:
        name = self._name(key)
        if isinstance(e, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
            return AccessDeniedError(
                f"no AWS credentials for {name}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, "
                f"or storage_options"
            )
        if isinstance(e, botocore.exceptions.EndpointConnectionError):
            return StorageError(
                f"cannot reach the S3 endpoint {self._endpoint} for {name} ({connect_failure(e)}); "
                f"check endpoint_url"
            )
        if not isinstance(e, botocore.exceptions.ClientError):
            return StorageError(f"S3 {op} on {name} failed: {one_line(e)}")
        error = e.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        message = one_line(error.get("Message", "")) or code
        if op == "GetObject" and status == "404" and not code:
            # S3 answers a GET with an XML error document (NoSuchKey, NoSuchBucket); a body
            # botocore cannot read as one is a web server or a SeaweedFS filer/master port. Read
            # as "missing", HEAD would look absent forever and a follower would wait forever.
            return StorageError(
                f"{self.endpoint_url or 'the endpoint'} is not an S3 endpoint: GET {name} answered HTTP 404 "
                f"without an S3 error document; check endpoint_url (the S3 port, not a filer, master or web port)"
            )
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {self.bucket!r} of {name} does not exist"
                f"{' at ' + self.endpoint_url if self.endpoint_url else ''}; create it or fix the URL"
            )
        if code in _ACCESS_DENIED or status == "403":
            return AccessDeniedError(
                f"access denied ({code}) for S3 {op} on {name}: check the credentials and their "
                f"permissions on bucket {self.bucket!r}"
            )
        # A 409 first: only a real 412 means "exists" / "changed"; a 409 means another write
        # was in flight and says nothing about the object's state.
        if status == "409" or code in _CONFLICT:
            return ConcurrentWriteError(
                f"S3 {op} on {name} kept failing with {code or 'HTTP 409'} (a concurrent write to "
                f"the same key); read the key back to see whether it was written"
            )
        if code in _PRECONDITION or status == "412":
            if mode == "create":
                return AlreadyExistsError(f"{name} already exists; create-only writes never replace an object")
            return PreconditionFailedError(f"{name} changed since its ETag was read; re-read it and retry")
        if code in _BAD_DIGEST:
            return UploadCorruptedError(
                f"S3 {op} on {name}: the server received other bytes than were sent ({code}) on "
                f"every attempt; check the network path (proxies, NICs) to {self.endpoint_url or 'S3'}"
            )
        if code in _NOT_FOUND or status == "404":
            if isinstance(mode, IfMatch):
                # AWS and moto answer If-Match on a missing key with 404 NoSuchKey.
                return PreconditionFailedError(
                    f"{name} does not exist, so it cannot match ETag {mode.etag!r}"
                )
            return NotFoundError(f"{name} does not exist")
        return StorageError(f"S3 {op} on {name} failed: {code} (HTTP {status}): {message}")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _meta(self, key: str, response: dict[str, Any], size_field: str = "ContentLength") -> ObjectMeta:
        if "ETag" not in response:  # every S3 object has one; a web server's 200 page has none
            raise StorageError(
                f"{self.endpoint_url or 'the endpoint'} is not an S3 endpoint: {self._name(key)} came back "
                f"without an ETag; check endpoint_url (the S3 port, not a filer, master or web port)"
            )
        size = response.get(size_field)
        if size is None:  # a response cut short (its headers truncated in transit) has no length
            raise StorageError(
                f"{self._name(key)} came back without its size ({size_field}): the response was cut short; "
                "nothing was read from it"
            )
        return ObjectMeta(
            key=key,
            size=int(size),
            etag=normalize_etag(response["ETag"]),
            last_modified=response.get("LastModified"),
        )

    def _not_found_or_no_bucket(self, key: str) -> StorageError:
        """HEAD answers a bare 404 for a missing key and a missing bucket alike; tell them apart
        once per store (a HEAD on the bucket), so that a typo in the bucket name is not
        reported as a missing object forever."""
        if not self._bucket_known_to_exist:
            with self._bucket_check_lock:
                try:
                    self._client.head_bucket(Bucket=self.bucket)
                    self._bucket_known_to_exist = True
                except botocore.exceptions.ClientError as e:
                    code = str(e.response.get("Error", {}).get("Code", ""))
                    if code in ("404", "NoSuchBucket", "NotFound"):
                        return BucketNotFoundError(
                            f"bucket {self.bucket!r} of {self._name(key)} does not exist"
                            f"{' at ' + self.endpoint_url if self.endpoint_url else ''}; create it or fix the URL"
                        )
                except botocore.exceptions.BotoCoreError:
                    pass
        return NotFoundError(f"{self._name(key)} does not exist")

    # --- Store -----------------------------------------------------------------------------

    def _read_object(
        self, key: str, op_kwargs: dict[str, Any], byte_range: tuple[int, int] | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """One GetObject and its whole body, retrying a body that ends early or fails its checksum.

        ClientErrors (404, 304, 416, ...) propagate untranslated for the caller to interpret.

        Raises:
            IntegrityError: the body failed botocore's checksum validation on every attempt.
            StorageError: the body was cut short on every attempt.
        """
        full = self._key(key)
        if byte_range is not None:
            op_kwargs = {**op_kwargs, "Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}
        last: Exception | None = None
        for attempt in range(1, READ_MAX_ATTEMPTS + 1):
            if attempt > 1:
                time.sleep(backoff(attempt - 1, READ_BACKOFF_BASE_S, READ_BACKOFF_MAX_S))
            response = self._client.get_object(Bucket=self.bucket, Key=full, **op_kwargs)
            body = response["Body"]
            try:
                data = body.read()
            except botocore.exceptions.FlexibleChecksumError as e:
                last = e
            except _TRUNCATED_BODY as e:
                last = e
            else:
                short = self._short_range(response, data, byte_range)
                if short is None:
                    return response, data
                last = _ShortRange(short)
            finally:
                body.close()
            logger.warning(
                "GetObject %s attempt %d/%d: %s", self._name(key), attempt, READ_MAX_ATTEMPTS, one_line(last)
            )
        if isinstance(last, botocore.exceptions.FlexibleChecksumError):
            raise IntegrityError(
                f"{self._name(key)} failed its checksum on each of {READ_MAX_ATTEMPTS} reads "
                f"({one_line(last)}): the stored object or the network path is corrupt"
            ) from last
        raise StorageError(
            f"reading {self._name(key)} was cut short on each of {READ_MAX_ATTEMPTS} attempts: {one_line(last)}"
        ) from last

    @staticmethod
    def _short_range(response: dict[str, Any], data: bytes, byte_range: tuple[int, int] | None) -> str | None:
        """Why a ranged body is not exactly the bytes asked for (None when it is).

        A range that runs past the end of the object legitimately returns fewer bytes (like
        ``bytes[start:stop]``); Content-Range's total says how many.
        """
        if byte_range is None:
            return None
        start, stop = byte_range
        match = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange", "")))
        if match is None:
            return f"no valid Content-Range in the answer to a range GET ({response.get('ContentRange')!r})"
        total = match.group(3)
        want = stop - start if total == "*" else min(stop, int(total)) - start
        if int(match.group(1)) != start or len(data) != want:
            return f"asked for bytes [{start}, {stop}), got {len(data)} bytes ({match.group(0)})"
        return None

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        check_key(key)
        check_range(byte_range)
        if byte_range is not None and byte_range[0] == byte_range[1]:
            self.head(key)  # still raise NotFoundError for a missing key
            return b""
        try:
            _, data = self._read_object(key, {}, byte_range)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if byte_range is not None and code in _INVALID_RANGE:
                return b""  # start at or past the end: an empty slice, like bytes[start:stop]
            raise self._translate(e, "GetObject", key) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "GetObject", key) from e
        return data

    def get_with_meta(self, key: str) -> GetResult:
        result = self.get_if_changed(key, None)
        assert result is not None
        return result

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        check_key(key)
        kwargs: dict[str, Any] = {}
        if etag is not None:
            kwargs["IfNoneMatch"] = quote(etag)
        try:
            response, data = self._read_object(key, kwargs)
        except botocore.exceptions.ClientError as e:
            code, status = error_code(e)
            if etag is not None and (code in _NOT_MODIFIED or status == "304"):
                return None
            raise self._translate(e, "GetObject", key) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "GetObject", key) from e
        return GetResult(data=data, meta=self._meta(key, response))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        """Write ``data`` under ``key`` (see :meth:`Store.put`), with an end-to-end checksum.

        Every put carries ``x-amz-checksum-sha256`` (unless ``upload_checksum="md5"``) and
        ``Content-MD5`` of the body, so a server that checks either refuses bytes altered in
        transit (measured: SeaweedFS checks both and answers ``BadDigest``; moto 5.2 checks
        neither). Because not every server checks, the
        returned ETag is also compared with the body's MD5 (a single-part ETag is that MD5); on a
        mismatch the object is read back, and if it really differs it is replaced, by If-Match on
        the damaged object's ETag, with the right bytes. botocore's own flexible checksums are
        independent of this: it is sent with ``request_checksum_calculation="when_required"`` too.

        A 409 (``ConditionalRequestConflict``) is retried with backoff in every mode; a retried
        create whose first attempt landed then answers 412, i.e. AlreadyExistsError, which is
        right for content-addressed keys.

        Raises:
            AlreadyExistsError, PreconditionFailedError: as :meth:`Store.put`.
            ConcurrentWriteError: 409s persisted for CONFLICT_MAX_ATTEMPTS attempts.
            UploadCorruptedError: the bytes arrived altered on CORRUPT_UPLOAD_MAX_ATTEMPTS attempts.
        """
        full = self._key(key)
        if not (mode in ("create", "overwrite") or isinstance(mode, IfMatch)):
            raise ValueError(f"unknown put mode {mode!r}")
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)  # botocore takes bytes, bytearray or a file; copy only other buffers
        md5 = hashlib.md5(data, usedforsecurity=False).digest()
        checksums = {"ContentMD5": base64.b64encode(md5).decode("ascii")}
        if self._upload_checksum == "sha256":
            sha256 = hashlib.sha256(data).digest()
            # ChecksumAlgorithm makes servers store the checksum (moto does only with it), so
            # later GETs return it and botocore validates the read end to end too.
            checksums["ChecksumAlgorithm"] = "SHA256"
            checksums["ChecksumSHA256"] = base64.b64encode(sha256).decode("ascii")
        current: PutMode = mode
        conflicts = corrupt = 0
        while True:
            condition: dict[str, str] = {}
            if current == "create":
                condition["IfNoneMatch"] = "*"
            elif isinstance(current, IfMatch):
                condition["IfMatch"] = quote(current.etag)
            try:
                response = self._client.put_object(
                    Bucket=self.bucket, Key=full, Body=data, **condition, **checksums
                )
            except botocore.exceptions.ClientError as e:
                code, status = error_code(e)
                if status == "409" or code in _CONFLICT:
                    conflicts += 1
                    if conflicts < CONFLICT_MAX_ATTEMPTS:
                        delay = backoff(conflicts, CONFLICT_BACKOFF_BASE_S, CONFLICT_BACKOFF_MAX_S)
                        logger.info("PutObject %s: %s, retrying in %.2f s", self._name(key), code or status, delay)
                        time.sleep(delay)
                        continue
                elif code in _BAD_DIGEST:
                    corrupt += 1
                    if corrupt < CORRUPT_UPLOAD_MAX_ATTEMPTS:
                        logger.warning("PutObject %s: server saw altered bytes (%s), retrying", self._name(key), code)
                        continue
                elif current is not mode:
                    # Replacing our own damaged upload was refused: its answer may have been lost
                    # after it landed (the SDK's retry then names an ETag that is gone), or someone
                    # changed the object meanwhile. The store says which.
                    held, damaged = self._replaced(key, data)
                    if held is not None:
                        return held
                    corrupt += 1
                    if damaged is not None and corrupt < CORRUPT_UPLOAD_MAX_ATTEMPTS:
                        # the replacement landed altered too (it fails its own checksum): replace that
                        logger.warning("PutObject %s: the replacement was stored altered, rewriting", self._name(key))
                        current = IfMatch(damaged)
                        continue
                    raise UploadCorruptedError.unreplaceable(self._name(key), f"{code or status}") from e
                raise self._translate(e, "PutObject", key, current) from e
            except botocore.exceptions.BotoCoreError as e:
                raise self._translate(e, "PutObject", key, current) from e
            etag = normalize_etag(response["ETag"])
            if not self._stored_other_bytes(key, etag, md5.hex(), data):
                return ObjectMeta(key=key, size=len(data), etag=etag)
            corrupt += 1
            if corrupt >= CORRUPT_UPLOAD_MAX_ATTEMPTS:
                removed = mode == "create" and self._delete_if_etag(key, etag)
                raise UploadCorruptedError.stored_altered(
                    self._name(key), corrupt, f"ETag {etag!r}, MD5 of the data {md5.hex()!r}", removed)
            logger.warning("PutObject %s: stored bytes differ from the data sent, rewriting", self._name(key))
            current = IfMatch(etag)  # replace exactly the damaged object we wrote, nothing newer

    def _replaced(self, key: str, data: bytes | bytearray) -> tuple[ObjectMeta | None, str | None]:
        """After a refused replacement of our damaged upload of ``key``, read back: the object's
        metadata when it holds exactly ``data``; else the ETag of the object when it fails its own
        stored checksum (damaged, as no writer meant it); else (other bytes, gone, unreadable)
        neither."""
        try:
            got = self.get_with_meta(key)
        except IntegrityError:
            try:
                return None, self.head(key).etag
            except StorageError:
                return None, None
        except StorageError:
            return None, None
        return (got.meta if got.data == data else None), None

    def _delete_if_etag(self, key: str, etag: str) -> bool:
        """Delete ``key`` if it still has ETag ``etag`` (our damaged create-only upload): left in
        place, it would read as "already exists" to every later writer of that content-addressed
        key. Best effort; True when it was deleted."""
        try:
            if self.head(key).etag != etag:
                return False
            self.delete(key)
        except StorageError:
            return False
        return True

    def _stored_other_bytes(self, key: str, etag: str, md5_hex: str, data: bytes | bytearray) -> bool:
        """True when the object just written under ``key`` (ETag ``etag``) is not our data.

        A single-part object's ETag is the MD5 of its bytes on S3, moto, SeaweedFS and MinIO,
        but not with SSE-KMS/SSE-C; a mismatch is therefore confirmed by reading the object back,
        and a store whose ETags turn out not to be MD5s stops being checked this way.
        """
        if not self._etags_are_md5 or etag == md5_hex or not _MD5_HEX.fullmatch(etag):
            return False
        try:
            _, stored = self._read_object(key, {"IfMatch": quote(etag)})
        except IntegrityError:
            return True  # the server's stored checksum (ours) disagrees with its stored bytes
        except botocore.exceptions.ClientError as e:
            code, status = error_code(e)
            if status == "412" or code in _PRECONDITION or code in _NOT_FOUND:
                return False  # already replaced or deleted by someone else: not ours to judge
            raise self._translate(e, "GetObject", key) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "GetObject", key) from e
        if stored != data:
            return True
        logger.info("%s: ETags are not MD5s of the content; not comparing them from now on", self.url)
        self._etags_are_md5 = False
        return False

    def head(self, key: str) -> ObjectMeta:
        full = self._key(key)
        try:
            response = self._client.head_object(Bucket=self.bucket, Key=full)
        except botocore.exceptions.ClientError as e:
            error = self._translate(e, "HeadObject", key)
            if isinstance(error, NotFoundError):
                error = self._not_found_or_no_bucket(key)
            raise error from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "HeadObject", key) from e
        return self._meta(key, response)

    def check_endpoint(self) -> None:
        """Make sure the endpoint speaks S3 (one ListObjectsV2 of at most one key).

        A web server, a SeaweedFS filer or master port answers every read with an HTML or JSON
        404 (or 200) that botocore reads as "no such key": the store would look empty forever.
        S3 errors carry an XML document with a code, and a listing names its bucket.

        An endpoint that cannot be connected to is reported after ENDPOINT_CHECK_CONNECT_ATTEMPTS
        attempts (the ``retries`` option's, when given); one that answers gets the store's retries.

        Raises:
            StorageError: the endpoint is not an S3 endpoint (the message says what it answered),
                or cannot be reached (the message names it).
            BucketNotFoundError, AccessDeniedError, StorageError: an S3 error from the listing.
        """
        where = self._endpoint
        try:
            response = self._first_listing()
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            if not code or code.isdigit():  # no S3 error document in the body
                raise StorageError(
                    f"{where} is not an S3 endpoint: listing {self.url} answered HTTP {status} without an "
                    f"S3 error document; check endpoint_url (the S3 port, not a filer, master or web port)"
                ) from e
            raise self._translate(e, "ListObjectsV2", None) from e
        except botocore.parsers.ResponseParserError as e:
            raise StorageError(
                f"{where} is not an S3 endpoint: its answer to a listing of {self.url} is not S3 XML; "
                f"check endpoint_url (the S3 port, not a filer, master or web port)"
            ) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "ListObjectsV2", None) from e
        if "Name" not in response and "KeyCount" not in response:
            raise StorageError(
                f"{where} is not an S3 endpoint: its answer to a listing of {self.url} is not an S3 listing; "
                f"check endpoint_url (the S3 port, not a filer, master or web port)"
            )
        self._bucket_known_to_exist = True

    def _first_listing(self) -> dict[str, Any]:
        """ListObjectsV2 of at most one key, first without retries on a client of its own: a
        connection that fails is final; any answer is asked again with the store's retries."""
        kwargs = {"Bucket": self.bucket, "Prefix": self.prefix, "MaxKeys": 1}
        if self._retries_given:
            return self._client.list_objects_v2(**kwargs)
        retries = {"mode": "standard", "total_max_attempts": ENDPOINT_CHECK_CONNECT_ATTEMPTS}
        quick = self._session.client(
            "s3", endpoint_url=self._endpoint_option, config=self._client.meta.config.merge(Config(retries=retries))
        )
        quick.meta.events.register("after-call.s3", self._note_server)
        try:
            return quick.list_objects_v2(**kwargs)
        except botocore.exceptions.EndpointConnectionError:
            raise
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError, botocore.parsers.ResponseParserError):
            pass  # an answer, perhaps a passing one (5xx, throttling): botocore's retries decide
        finally:
            quick.close()
        return self._client.list_objects_v2(**kwargs)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        metas: list[ObjectMeta] = []
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", ()):
                    metas.append(self._meta(obj["Key"][len(self.prefix) :], obj, size_field="Size"))
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._translate(e, "ListObjectsV2", prefix or None) from e
        # S3 lists in UTF-8 byte order (= code point order); not every compatible server does.
        metas.sort(key=lambda m: m.key)
        return iter(metas)

    def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except botocore.exceptions.ClientError as e:
            error = self._translate(e, "DeleteObject", key)
            if not isinstance(error, NotFoundError):
                raise error from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "DeleteObject", key) from e
