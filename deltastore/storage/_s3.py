"""Amazon S3 and S3-compatible stores (moto, SeaweedFS, MinIO, R2, ...) through boto3.

Conditional writes map one to one onto S3's: ``"create"`` is ``PutObject`` with
``If-None-Match: *`` and ``IfMatch(etag)`` is ``PutObject`` with ``If-Match``. botocore's
``ClientError`` codes are translated into deltastore's error tree here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
import botocore.loaders
import botocore.session
from botocore.config import Config

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    UnsupportedURLError,
)
from deltastore.storage._keys import check_key, check_prefix, check_range, normalize_etag
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store

logger = logging.getLogger(__name__)

#: Connections per client: publish and pull move blobs from thread pools wider than botocore's
#: default of 10, and a starved pool serializes transfers.
DEFAULT_MAX_POOL_CONNECTIONS = 64
#: botocore "standard" retry attempts (5xx, throttling, connection errors). A retried
#: conditional PUT whose first attempt landed answers a false 412; the commit protocol, not this
#: layer, resolves that (it reads HEAD back and looks for its own commit id).
DEFAULT_MAX_ATTEMPTS = 5

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
_NOT_MODIFIED = {"304", "NotModified"}
_INVALID_RANGE = {"InvalidRange", "416"}


_LOADER: botocore.loaders.Loader | None = None
_LOADER_LOCK = threading.Lock()


def _botocore_session() -> botocore.session.Session:
    """A fresh botocore session (credentials are per store) sharing one model loader: parsing
    the S3 service model takes ~0.5 s, which every store would otherwise pay again."""
    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
        loader = _LOADER
    session = botocore.session.Session()
    session.register_component("data_loader", loader)
    return session


def _quote(etag: str) -> str:
    return f'"{normalize_etag(etag)}"'


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


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
            ``connect_timeout``, ``read_timeout``. Credentials otherwise come from the standard
            AWS chain; they are never logged and never appear in ``repr``.

    Example::

        store = S3Store("s3://weights/run1", storage_options={"endpoint_url": "http://127.0.0.1:9000"})
        store.put("HEAD", b"{}", mode="create")
    """

    atomic_conditional_writes = True

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
        for name in ("connect_timeout", "read_timeout"):
            if name in options:
                config_kwargs[name] = options[name]
        try:
            session = boto3.session.Session(
                botocore_session=_botocore_session(),
                aws_access_key_id=options.get("aws_access_key_id"),
                aws_secret_access_key=options.get("aws_secret_access_key"),
                aws_session_token=options.get("aws_session_token"),
                region_name=options.get("region_name"),
                profile_name=options.get("profile"),
            )
            self._client = session.client(
                "s3", endpoint_url=options.get("endpoint_url"), config=Config(**config_kwargs)
            )
        except botocore.exceptions.ProfileNotFound as e:
            raise AccessDeniedError(
                f"AWS profile {options.get('profile')!r} for {self.url} not found in ~/.aws/config"
            ) from e
        except botocore.exceptions.BotoCoreError as e:
            raise StorageError(f"cannot configure an S3 client for {self.url}: {_one_line(e)}") from e
        self._bucket_known_to_exist = False
        self._bucket_check_lock = threading.Lock()
        logger.debug("opened %r (addressing=%s)", self, addressing)

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Store({self.url!r}{endpoint})"

    def close(self) -> None:
        self._client.close()

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
            return StorageError(f"cannot reach the S3 endpoint for {name}: {_one_line(e)}; check endpoint_url")
        if not isinstance(e, botocore.exceptions.ClientError):
            return StorageError(f"S3 {op} on {name} failed: {_one_line(e)}")
        error = e.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        message = _one_line(error.get("Message", "")) or code
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
        if code in _PRECONDITION or status == "412":
            if mode == "create":
                return AlreadyExistsError(f"{name} already exists; create-only writes never replace an object")
            return PreconditionFailedError(f"{name} changed since its ETag was read; re-read it and retry")
        if code in _CONFLICT or status == "409":
            return PreconditionFailedError(
                f"{name} was written concurrently ({code}); re-read it and retry"
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
        return ObjectMeta(
            key=key,
            size=int(response[size_field]),
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

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        full = self._key(key)
        check_range(byte_range)
        kwargs: dict[str, Any] = {}
        if byte_range is not None:
            start, stop = byte_range
            if start == stop:
                self.head(key)  # still raise NotFoundError for a missing key
                return b""
            kwargs["Range"] = f"bytes={start}-{stop - 1}"
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full, **kwargs)
            return response["Body"].read()
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if byte_range is not None and code in _INVALID_RANGE:
                return b""  # start at or past the end: an empty slice, like bytes[start:stop]
            raise self._translate(e, "GetObject", key) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "GetObject", key) from e

    def get_with_meta(self, key: str) -> GetResult:
        result = self.get_if_changed(key, None)
        assert result is not None
        return result

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        full = self._key(key)
        kwargs: dict[str, Any] = {}
        if etag is not None:
            kwargs["IfNoneMatch"] = _quote(etag)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full, **kwargs)
            data = response["Body"].read()
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if etag is not None and (code in _NOT_MODIFIED or status == 304):
                return None
            raise self._translate(e, "GetObject", key) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._translate(e, "GetObject", key) from e
        return GetResult(data=data, meta=self._meta(key, response))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        full = self._key(key)
        kwargs: dict[str, Any] = {}
        if mode == "create":
            kwargs["IfNoneMatch"] = "*"
        elif isinstance(mode, IfMatch):
            kwargs["IfMatch"] = _quote(mode.etag)
        elif mode != "overwrite":
            raise ValueError(f"unknown put mode {mode!r}")
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)  # botocore takes bytes, bytearray or a file; copy only other buffers
        try:
            response = self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **kwargs)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._translate(e, "PutObject", key, mode) from e
        return ObjectMeta(key=key, size=len(data), etag=normalize_etag(response["ETag"]))

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
