"""What deltastore needs of botocore besides the S3 calls: one shared service-model loader,
credentials kept out of the SDK's logs, and the shapes of its errors (used by _s3.py only)."""

from __future__ import annotations

import logging
import random
import re
import threading

import botocore.exceptions
import botocore.loaders
import botocore.session
import urllib3.exceptions

from deltastore.storage._keys import normalize_etag

_LOADER: botocore.loaders.Loader | None = None
_LOADER_LOCK = threading.Lock()


#: botocore logs every request's headers and canonical request at DEBUG, session token
#: (``X-Amz-Security-Token``) included; this matches the token in a header, canonical-request
#: line or query string so that it can be replaced.
_TOKEN_IN_LOG = re.compile(r"(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,&}]+", re.IGNORECASE)
_REDACTED = "<redacted>"


class RedactCredentials(logging.Filter):
    """Rewrites SDK log records that carry a session token or a known secret (never drops one).

    Attached to botocore's and urllib3's loggers, it runs only for records that are emitted
    (DEBUG is off by default), so it costs nothing in normal operation.
    """

    def __init__(self) -> None:
        super().__init__("deltastore-redact")
        self._secrets: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def add(self, *secrets: str | None) -> None:
        with self._lock:
            self._secrets = self._secrets | {s for s in secrets if s}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's business, not ours
            return True
        redacted = _TOKEN_IN_LOG.sub(lambda m: m.group(1) + _REDACTED, message)
        for secret in self._secrets:
            redacted = redacted.replace(secret, _REDACTED)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACT = RedactCredentials()


def redact_sdk_logs(*secrets: str | None) -> None:
    """Make sure no SDK logger can emit ``secrets`` or a session token (see RedactCredentials).

    A filter applies only to records created on its own logger, so it goes on every botocore,
    boto3 and urllib3 logger that exists; they are all created when their modules are imported,
    which has happened once a client exists.
    """
    _REDACT.add(*secrets)
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] in ("botocore", "boto3", "urllib3")]
    for name in ("botocore", "boto3", "urllib3", *names):
        log = logging.getLogger(name)
        if _REDACT not in log.filters:
            log.addFilter(_REDACT)


def botocore_session() -> botocore.session.Session:
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


def quote(etag: str) -> str:
    return f'"{normalize_etag(etag)}"'


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def backoff(attempt: int, base: float, cap: float) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    return random.uniform(0.0, min(cap, base * 2 ** (attempt - 1)))


def connect_failure(e: botocore.exceptions.EndpointConnectionError) -> str:
    """Why a connection failed, in the socket's words ("Connection refused", "Name or service
    not known"), else "timed out" or botocore's message."""
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [e.kwargs.get("error"), e]
    while todo:
        cause = todo.pop(0)
        if cause is not None and all(cause is not c for c in chain):
            chain.append(cause)
            todo += [cause.__cause__, cause.__context__]
    # urllib3's NewConnectionError subclasses its timeout error: look for the socket's own first.
    for cause in chain:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    if any(isinstance(c, (TimeoutError, urllib3.exceptions.TimeoutError)) for c in chain):
        return "timed out"
    return one_line(e)


def error_code(e: botocore.exceptions.ClientError) -> tuple[str, str]:
    """The (code, HTTP status) of a ClientError, both as strings."""
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code, status
