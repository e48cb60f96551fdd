"""Azure Blob Storage through ``azure-storage-blob`` (the ``azure`` extra), with native
compare-and-swap.

``"create"`` is Put Blob with ``If-None-Match: *`` (a refusal is 409 ``BlobAlreadyExists``);
``IfMatch(etag)`` is Put Blob with ``If-Match`` on the Azure ETag of the version whose
Content-MD5 is ``etag`` (see :mod:`._cloud`). The SDK's own retries are off
(``retry_total=0``): :class:`~deltastore.storage._cloud.CloudStore` retries transient failures
and throttling itself and settles a conditional write whose response was lost by reading the
blob. Every upload sends Content-MD5 (Azure refuses a body that does not match it,
``Md5Mismatch``) and stores it as the blob's Content-MD5; every whole download is checked
against it.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Iterator
from typing import Any

import azure.core.exceptions as aexc
from azure.core import MatchConditions
from azure.storage.blob import BlobServiceClient, ContentSettings

from deltastore.errors import AccessDeniedError, UnsupportedURLError
from deltastore.storage._cloud import CREATE, DEFAULT_MAX_ATTEMPTS, CloudStore, Failure, Kind, Version, one_line

logger = logging.getLogger(__name__)

#: Seconds to connect and to wait for a response; a stalled connection is a transient failure.
DEFAULT_TIMEOUT_S = 60.0
#: Connections per client: publish and pull move blobs from thread pools wider than requests'
#: default of 10, and a starved pool serializes transfers.
DEFAULT_MAX_POOL_CONNECTIONS = 64
#: Largest upload sent as one Put Blob (whose answer carries the MD5 the server computed); larger
#: ones go in blocks, each checked by its own Content-MD5, committed with the same condition.
MAX_SINGLE_PUT_SIZE = 64 * 1024 * 1024

_KNOWN_OPTIONS = frozenset(
    {"endpoint_url", "account_name", "account_key", "sas_token", "connection_string", "anon", "retries", "timeout",
     "max_pool_connections"}
)
_TRANSIENT_STATUS = {408, 500, 502, 503, 504}
_BROKEN_CONNECTION = (
    aexc.ServiceRequestError,
    aexc.ServiceResponseError,
    aexc.IncompleteReadError,
    ConnectionError,
)
_BAD_DIGEST_CODES = {"Md5Mismatch", "InvalidMd5", "Crc64Mismatch"}


def _code(e: aexc.HttpResponseError) -> str:
    code = e.error_code
    return str(getattr(code, "value", code) or "")


def _md5_hex(value: Any) -> str | None:
    return bytes(value).hex() if value else None


class AzureBlobStore(CloudStore):
    """Objects under ``az://container/prefix`` on Azure Blob Storage or Azurite.

    Args:
        url: ``az://container`` or ``az://container/prefix``; keys are relative to the prefix.
        storage_options: ``connection_string`` (else ``AZURE_STORAGE_CONNECTION_STRING``), or
            ``account_name`` (else ``AZURE_STORAGE_ACCOUNT_NAME``) with ``account_key`` (else
            ``AZURE_STORAGE_ACCOUNT_KEY``) or ``sas_token`` (else ``AZURE_STORAGE_SAS_TOKEN``), or
            neither, for Entra ID credentials through ``azure-identity`` when it is installed;
            ``anon=True`` for a public container; ``endpoint_url`` (the account URL, default
            ``https://ACCOUNT.blob.core.windows.net``); ``retries`` (attempts per request),
            ``timeout`` (seconds), ``max_pool_connections``. Keys and tokens are never logged
            and never appear in ``repr``.

    Raises:
        UnsupportedURLError: not an ``az://`` URL, no container, an unknown option, or a malformed
            connection string or key.
        AccessDeniedError: no account or credentials given or found.

    Example::

        store = AzureBlobStore("az://weights/run1", storage_options={"account_name": "myaccount"})
        store.put("HEAD", b"{}", mode="create")
    """

    provider = "Azure Blob"
    bucket_word = "container"

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None):
        scheme, sep, rest = url.partition("://")
        if not sep or scheme != "az":
            raise UnsupportedURLError(f"{url!r} is not an az:// URL")
        container, _, prefix = rest.partition("/")
        if not container:
            raise UnsupportedURLError(f"{url!r} names no container; use az://container/prefix")
        prefix = prefix.strip("/")
        options = dict(storage_options or {})
        display = f"az://{container}/{prefix}".rstrip("/")
        unknown = set(options) - _KNOWN_OPTIONS
        if unknown:
            raise UnsupportedURLError(
                f"unknown storage option(s) {sorted(unknown)} for {display}; known: {sorted(_KNOWN_OPTIONS)}"
            )
        super().__init__(display, container, prefix, attempts=options.get("retries", DEFAULT_MAX_ATTEMPTS))
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
        client_kwargs: dict[str, Any] = {
            "retry_total": 0,  # CloudStore retries, knowing which writes may have landed
            "transport": self._transport(int(options.get("max_pool_connections", DEFAULT_MAX_POOL_CONNECTIONS)),
                                         timeout),
            "max_single_put_size": MAX_SINGLE_PUT_SIZE,
            "raw_response_hook": self._on_response,
        }
        connection_string = options.get("connection_string") or (
            None if options.get("account_name") or options.get("anon") else os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        )
        try:
            if connection_string:
                self._service = BlobServiceClient.from_connection_string(connection_string, **client_kwargs)
            else:
                account = options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
                endpoint = options.get("endpoint_url")
                if not endpoint and not account:
                    raise AccessDeniedError(
                        f"no Azure account for {display}: pass storage_options account_name= (and account_key= or "
                        f"sas_token=) or connection_string=, or set AZURE_STORAGE_CONNECTION_STRING"
                    )
                endpoint = endpoint or f"https://{account}.blob.core.windows.net"
                credential = self._credential(display, options, account)
                self._service = BlobServiceClient(endpoint, credential=credential, **client_kwargs)
        except ValueError as e:  # a malformed connection string, key or URL
            raise UnsupportedURLError(f"cannot configure an Azure Blob client for {display}: {one_line(e)}") from e
        self._container = self._service.get_container_client(container)
        logger.debug("opened %r", self)

    @staticmethod
    def _transport(pool: int, timeout: float) -> Any:
        """An HTTP transport whose connection pool is as wide as the thread pools that use it
        (requests' default of 10 makes wider pools reconnect for every request)."""
        import requests
        from azure.core.pipeline.transport import RequestsTransport

        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool, pool_maxsize=pool)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return RequestsTransport(session=session, session_owner=True, connection_timeout=timeout, read_timeout=timeout)

    @staticmethod
    def _credential(display: str, options: dict[str, Any], account: str | None) -> Any:
        if options.get("anon"):
            return None
        key = options.get("account_key") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        if key:
            if not account:
                raise AccessDeniedError(f"an account_key for {display} needs account_name too")
            return {"account_name": account, "account_key": key}
        sas = options.get("sas_token") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        if sas:
            return sas
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise AccessDeniedError(
                f"no Azure credentials for {display}: pass account_key=, sas_token= or connection_string=, or "
                f"install azure-identity for Entra ID sign-in"
            ) from None
        return DefaultAzureCredential()

    def _on_response(self, response: Any) -> None:
        http = response.http_response
        self.note_server(http.status_code, http.headers.get("Server", ""))

    def __repr__(self) -> str:
        return f"AzureBlobStore({self.url!r}, endpoint_url={self.endpoint!r})"

    def close(self) -> None:
        self._service.close()

    @property
    def endpoint(self) -> str:
        parts = urllib.parse.urlsplit(self._service.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), "", ""))

    # --- the provider's verbs ----------------------------------------------------------------

    def _native_write(self, name: str, data: bytes, md5: bytes, condition: object) -> Version:
        kwargs: dict[str, Any] = {}
        if condition is not None and condition is not CREATE:
            kwargs = {"etag": condition, "match_condition": MatchConditions.IfNotModified}
        response = self._container.get_blob_client(name).upload_blob(
            data,
            length=len(data),
            overwrite=condition is not CREATE,  # False sends If-None-Match: *
            content_settings=ContentSettings(content_type="application/octet-stream", content_md5=bytearray(md5)),
            validate_content=True,  # Content-MD5 on each request: Azure refuses altered bytes
            **kwargs,
        )
        # One Put Blob answers the MD5 Azure computed of what it stored; a block list's answer
        # carries the MD5 of the list, so blocks rely on their own Content-MD5 checks.
        stored = _md5_hex(response.get("content_md5")) if len(data) <= MAX_SINGLE_PUT_SIZE else None
        return Version(token=response["etag"], md5=stored, size=len(data), last_modified=response.get("last_modified"))

    def _native_stat(self, name: str) -> Version | None:
        try:
            props = self._container.get_blob_client(name).get_blob_properties()
        except aexc.ResourceNotFoundError:
            return None
        return Version(props.etag, _md5_hex(props.content_settings.content_md5), int(props.size), props.last_modified)

    def _native_read(self, name: str, byte_range: tuple[int, int] | None, pin: str | None) -> tuple[bytes, Version]:
        kwargs: dict[str, Any] = {}
        if pin is not None:
            kwargs = {"etag": pin, "match_condition": MatchConditions.IfNotModified}
        if byte_range is not None:
            kwargs.update(offset=byte_range[0], length=byte_range[1] - byte_range[0])
        downloader = self._container.get_blob_client(name).download_blob(max_concurrency=1, **kwargs)
        data = downloader.readall()
        props = downloader.properties
        md5 = _md5_hex(props.content_settings.content_md5) if byte_range is None else None
        # ``size`` is what was downloaded; the whole object's is Content-Range's total.
        total = str(props.content_range or "").rpartition("/")[2]
        size = int(total) if total.isdigit() else int(props.size)
        return data, Version(props.etag, md5, size, props.last_modified)

    def _native_list(self, name_prefix: str) -> Iterator[tuple[str, Version]]:
        for props in self._container.list_blobs(name_starts_with=name_prefix or None):
            md5 = _md5_hex(props.content_settings.content_md5)
            yield props.name, Version(props.etag, md5, int(props.size), props.last_modified)

    def _native_delete(self, name: str) -> None:
        self._container.get_blob_client(name).delete_blob()

    def _native_bucket_exists(self) -> bool:
        # A listing of at most one blob under the prefix: it needs only the list permission every
        # role has (infra/README.md), and works with a SAS scoped to the container.
        try:
            next(iter(self._container.list_blobs(name_starts_with=self.prefix or None, results_per_page=1).by_page()), None)
        except aexc.ResourceNotFoundError:
            return False
        return True

    def _classify(self, e: Exception) -> Failure | None:
        if isinstance(e, aexc.ClientAuthenticationError) and not e.status_code:  # no token (azure-identity)
            return Failure(Kind.DENIED, one_line(e)[:200])
        if isinstance(e, aexc.HttpResponseError):
            status = int(e.status_code or 0)
            code = _code(e)
            detail = f"HTTP {status} {code}".strip()
            if status == 304:
                return Failure(Kind.NOT_MODIFIED, detail)
            if status == 412 or (status == 409 and code == "BlobAlreadyExists"):
                return Failure(Kind.PRECONDITION, detail)
            if status == 404:
                return Failure(Kind.NO_BUCKET if code == "ContainerNotFound" else Kind.NOT_FOUND, detail)
            if status in (401, 403):
                return Failure(Kind.DENIED, detail)
            if status == 429 or (status == 503 and code == "ServerBusy"):
                return Failure(Kind.THROTTLED, detail)
            if status in _TRANSIENT_STATUS:
                return Failure(Kind.TRANSIENT, detail)
            if status == 416:
                return Failure(Kind.BAD_RANGE, detail)
            # Azure answers Md5Mismatch; Azurite 400 InvalidOperation "Provided contentMD5 doesn't match."
            if code in _BAD_DIGEST_CODES or (status == 400 and "md5" in one_line(e.message or "").lower()):
                return Failure(Kind.BAD_DIGEST, detail)
            return Failure(Kind.OTHER, f"{detail}: {one_line(e.reason or '')}")
        if isinstance(e, _BROKEN_CONNECTION):
            return Failure(Kind.TRANSIENT, f"{type(e).__name__} talking to {self.endpoint}: {one_line(e)[:200]}")
        return None
