"""Google Cloud Storage through ``google-cloud-storage`` (the ``gcs`` extra), with native
compare-and-swap.

``"create"`` is an upload with ``ifGenerationMatch=0``; ``IfMatch(etag)`` is an upload with
``ifGenerationMatch`` on the generation whose MD5 is ``etag`` (see :mod:`._cloud`). The client's
own retries are off: :class:`~deltastore.storage._cloud.CloudStore` retries transient failures
and 429s itself and settles a conditional write whose response was lost by reading the object.
Every upload carries the MD5 of its bytes in its metadata (GCS refuses a body that does not match
it) and the stored MD5 is compared with ours; every whole download is checked against the MD5 in
``X-Goog-Hash``.

Throttling: GCS sustains about one update per second to one object name. HEAD is the only object
deltastore rewrites, so one store commits at most about one version per second; faster publishers
are answered 429, back off (THROTTLE_BACKOFF_BASE_S, from one second) and retry within their
commit deadline, and a publisher with the ``latest`` queue policy coalesces snapshots meanwhile.
Packs and manifests are new names and are not limited this way.
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
import urllib.parse
from collections.abc import Iterator
from typing import Any

import google.api_core.exceptions as gexc
import google.auth
import google.auth.exceptions
import requests
import urllib3.exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage import exceptions as gcs_exceptions

from deltastore.errors import AccessDeniedError, StorageError, UnsupportedURLError
from deltastore.storage._cloud import (
    CREATE,
    DEFAULT_MAX_ATTEMPTS,
    CloudStore,
    Failure,
    Kind,
    Version,
    md5_b64,
    one_line,
)

logger = logging.getLogger(__name__)

#: Where requests go without an ``endpoint_url`` option or ``STORAGE_EMULATOR_HOST``.
GCS_ENDPOINT = "https://storage.googleapis.com"
#: Connections per client: publish and pull move blobs from thread pools wider than requests'
#: default of 10, and a starved pool serializes transfers.
DEFAULT_MAX_POOL_CONNECTIONS = 64
#: Seconds per request (connect and read); a stalled connection is a transient failure.
DEFAULT_TIMEOUT_S = 60.0

_KNOWN_OPTIONS = frozenset({"endpoint_url", "project", "token", "retries", "timeout", "max_pool_connections"})
_TRANSIENT_STATUS = {408, 500, 502, 503, 504}
_BROKEN_CONNECTION = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    http.client.IncompleteRead,
    ConnectionError,
    google.auth.exceptions.TransportError,
)


def _md5_hex(b64: str | None) -> str | None:
    if not b64:
        return None
    try:
        return base64.b64decode(b64).hex()
    except ValueError:
        return None


def _version(blob: storage.Blob, size: int | None = None) -> Version:
    return Version(
        token=str(blob.generation),
        md5=_md5_hex(blob.md5_hash),
        size=int(blob.size if size is None else size),
        last_modified=blob.updated,
    )


class GCSStore(CloudStore):
    """Objects under ``gs://bucket/prefix`` on Google Cloud Storage or an emulator that honours
    generation preconditions (fake-gcs-server does; gcp-storage-emulator does not, and the probe
    refuses it).

    Args:
        url: ``gs://bucket`` or ``gs://bucket/prefix`` (``gcs://`` too); keys are relative to the prefix.
        storage_options: ``endpoint_url`` (else ``STORAGE_EMULATOR_HOST``, else GCS), ``project``,
            ``token`` (a service-account JSON file, ``"anon"`` for no credentials, or
            ``"google_default"``, the default: Application Default Credentials; with an
            ``endpoint_url`` and no token, anonymous), ``retries`` (attempts per request),
            ``timeout`` (seconds per request), ``max_pool_connections``. Credentials are never
            logged and never appear in ``repr``.

    Raises:
        UnsupportedURLError: not a ``gs://`` URL, no bucket, or an unknown option.
        AccessDeniedError: no credentials found, or an unreadable service-account key.

    Example::

        store = GCSStore("gs://weights/run1")
        store.put("HEAD", b"{}", mode="create")
    """

    provider = "GCS"
    bucket_word = "bucket"

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None):
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("gs", "gcs"):
            raise UnsupportedURLError(f"{url!r} is not a gs:// URL")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UnsupportedURLError(f"{url!r} names no bucket; use gs://bucket/prefix")
        prefix = prefix.strip("/")
        options = dict(storage_options or {})
        unknown = set(options) - _KNOWN_OPTIONS
        display = f"gs://{bucket}/{prefix}".rstrip("/")
        if unknown:
            raise UnsupportedURLError(
                f"unknown storage option(s) {sorted(unknown)} for {display}; known: {sorted(_KNOWN_OPTIONS)}"
            )
        super().__init__(display, bucket, prefix, attempts=options.get("retries", DEFAULT_MAX_ATTEMPTS))
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        endpoint = options.get("endpoint_url") or emulator or GCS_ENDPOINT
        if "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        self._endpoint = endpoint.rstrip("/")
        self._timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
        token = options.get("token")
        if token is None and self._endpoint != GCS_ENDPOINT:
            token = "anon"  # emulators take no credentials
        credentials, project = self._credentials(token, options.get("project"))
        session = self._session(credentials, int(options.get("max_pool_connections", DEFAULT_MAX_POOL_CONNECTIONS)))
        self._http = session
        try:
            self._client = storage.Client(
                project=project or "deltastore",
                credentials=credentials,
                client_options={"api_endpoint": self._endpoint},
                _http=session,
            )
        except (google.auth.exceptions.GoogleAuthError, ValueError) as e:
            raise StorageError(f"cannot configure a GCS client for {self.url}: {one_line(e)}") from e
        self._bucket = self._client.bucket(bucket)
        logger.debug("opened %r", self)

    def _credentials(self, token: Any, project: str | None) -> tuple[Any, str | None]:
        if token == "anon":
            return AnonymousCredentials(), project
        try:
            if token in (None, "google_default"):
                credentials, found = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
                return credentials, project or found
            if isinstance(token, str):
                from google.oauth2 import service_account

                credentials = service_account.Credentials.from_service_account_file(
                    token, scopes=["https://www.googleapis.com/auth/devstorage.read_write"]
                )
                return credentials, project or credentials.project_id
        except google.auth.exceptions.DefaultCredentialsError as e:
            raise AccessDeniedError(
                f"no Google credentials for {self.url}: run `gcloud auth application-default login`, set "
                f"GOOGLE_APPLICATION_CREDENTIALS, or pass storage_options token=PATH"
            ) from e
        except (OSError, ValueError) as e:
            raise AccessDeniedError(f"cannot read the service-account key {token!r} for {self.url}: {one_line(e)}") from e
        return token, project  # a google.auth Credentials object

    def _session(self, credentials: Any, pool: int) -> requests.Session:
        """The HTTP session of the client: ours, so that the pool is wide enough and the
        ``Server`` header of each answer can be observed."""
        if isinstance(credentials, AnonymousCredentials):
            session = requests.Session()
        else:
            from google.auth.transport.requests import AuthorizedSession

            session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool, pool_maxsize=pool)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        session.hooks["response"].append(lambda r, *a, **k: self.note_server(r.status_code, r.headers.get("Server", "")))
        return session

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self._endpoint!r}" if self._endpoint != GCS_ENDPOINT else ""
        return f"GCSStore({self.url!r}{endpoint})"

    def close(self) -> None:
        self._client.close()  # closes our session too

    @property
    def endpoint(self) -> str:
        parts = urllib.parse.urlsplit(self._endpoint)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), "", ""))

    # --- the provider's verbs ----------------------------------------------------------------

    def _native_write(self, name: str, data: bytes, md5: bytes, condition: object) -> Version:
        blob = self._bucket.blob(name)
        blob.md5_hash = md5_b64(md5)  # in the upload's metadata: GCS refuses a body that differs
        generation = 0 if condition is CREATE else (int(condition) if condition is not None else None)  # type: ignore[arg-type]
        blob.upload_from_string(
            data,
            content_type="application/octet-stream",
            if_generation_match=generation,
            checksum=None,
            retry=None,
            timeout=self._timeout,
        )
        return _version(blob, len(data))

    def _native_stat(self, name: str) -> Version | None:
        blob = self._bucket.get_blob(name, retry=None, timeout=self._timeout)
        return None if blob is None else _version(blob)

    def _native_read(self, name: str, byte_range: tuple[int, int] | None, pin: str | None) -> tuple[bytes, Version]:
        blob = self._bucket.blob(name)
        start, end = (byte_range[0], byte_range[1] - 1) if byte_range is not None else (None, None)
        data = blob.download_as_bytes(
            start=start,
            end=end,
            raw_download=True,
            if_generation_match=int(pin) if pin is not None else None,
            checksum=None,  # checked against X-Goog-Hash's MD5 by CloudStore, once
            retry=None,
            timeout=self._timeout,
        )
        if byte_range is None:
            return data, _version(blob, len(data))
        # A range read says nothing of the object's size; learn it only when the answer is
        # shorter than asked (a range that runs past the end), from the generation read.
        size = byte_range[0] + len(data)
        if len(data) < byte_range[1] - byte_range[0]:
            current = self._bucket.get_blob(name, retry=None, timeout=self._timeout)
            if current is not None and str(current.generation) == str(blob.generation):
                size = int(current.size)
        return data, Version(token=str(blob.generation), md5=None, size=size)

    def _native_list(self, name_prefix: str) -> Iterator[tuple[str, Version]]:
        for blob in self._client.list_blobs(self._bucket, prefix=name_prefix, retry=None, timeout=self._timeout):
            yield blob.name, _version(blob)

    def _native_delete(self, name: str) -> None:
        self._bucket.blob(name).delete(retry=None, timeout=self._timeout)

    def _native_bucket_exists(self) -> bool:
        # A listing of at most one object under the prefix, not a bucket GET: it needs only
        # storage.objects.list, which every role has (infra/README.md), not storage.buckets.get.
        try:
            list(self._client.list_blobs(self._bucket, prefix=self.prefix, max_results=1, retry=None,
                                         timeout=self._timeout))
        except gexc.NotFound:
            return False
        return True

    def _classify(self, e: Exception) -> Failure | None:
        if isinstance(e, gexc.GoogleAPICallError):
            status = int(e.code or 0)
            return _by_status(status, one_line(getattr(e, "message", "") or e)[:300])
        if isinstance(e, gcs_exceptions.InvalidResponse):
            response = getattr(e, "response", None)
            status = int(getattr(response, "status_code", 0) or 0)
            return _by_status(status, one_line(e)[:300])
        if isinstance(e, gcs_exceptions.DataCorruption):
            return Failure(Kind.CORRUPT_READ, one_line(e)[:300])
        if isinstance(e, (google.auth.exceptions.RefreshError, google.auth.exceptions.DefaultCredentialsError)):
            return Failure(Kind.DENIED, one_line(e)[:200])
        if isinstance(e, _BROKEN_CONNECTION):
            return Failure(Kind.TRANSIENT, f"{type(e).__name__} talking to {self.endpoint}: {one_line(e)[:200]}")
        return None


def _by_status(status: int, message: str) -> Failure:
    detail = f"HTTP {status}: {message}" if message else f"HTTP {status}"
    if status == 412:
        return Failure(Kind.PRECONDITION, detail)
    if status == 304:
        return Failure(Kind.NOT_MODIFIED, detail)
    if status == 404:
        lowered = message.lower()
        if "bucket" in lowered and ("not exist" in lowered or "not found" in lowered):
            return Failure(Kind.NO_BUCKET, detail)
        return Failure(Kind.NOT_FOUND, detail)
    if status in (401, 403):
        return Failure(Kind.DENIED, detail)
    if status == 429:
        return Failure(Kind.THROTTLED, detail)
    if status in _TRANSIENT_STATUS:
        return Failure(Kind.TRANSIENT, detail)
    if status == 416:
        return Failure(Kind.BAD_RANGE, detail)
    if status == 400 and any(word in message.lower() for word in ("md5", "crc32c", "hash", "checksum")):
        return Failure(Kind.BAD_DIGEST, detail)
    return Failure(Kind.OTHER, detail)
