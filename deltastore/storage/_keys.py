"""Key validation and small helpers shared by every backend.

Every backend validates keys the same way, so that a key accepted by the in-memory store used in
tests is also accepted by S3 and by the local filesystem, and no key can escape a store's root.
"""

from __future__ import annotations

import hashlib

from deltastore.errors import InvalidKeyError

#: Names starting with this are the local backend's temp files and lock directory; reserving them
#: in every backend keeps keys portable between backends.
RESERVED_PREFIX = ".deltastore-"


def check_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid relative key, else raise InvalidKeyError."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}: keys are non-empty strings")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(
            f"invalid key {key!r}: keys are relative, '/'-separated, without backslashes or NUL"
        )
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKeyError(
                f"invalid key {key!r}: empty, '.' and '..' segments are not allowed"
            )
        if segment.startswith(RESERVED_PREFIX):
            raise InvalidKeyError(
                f"invalid key {key!r}: names starting with {RESERVED_PREFIX!r} are reserved"
            )
    return key


def check_prefix(prefix: str) -> str:
    """Validate a list prefix: like a key, but may be empty or end with ``/``."""
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    if body == "":
        raise InvalidKeyError(f"invalid prefix {prefix!r}: prefixes are relative")
    check_key(body)
    return prefix


def content_etag(data: bytes | memoryview) -> str:
    """The ETag of an object written in one piece: hex MD5 of its bytes, as S3 computes it.

    MD5 here is an identifier for compare-and-swap, not a security measure.
    """
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def normalize_etag(etag: str) -> str:
    """Strip the quotes (and a weak ``W/`` marker) that HTTP servers put around ETags."""
    if etag.startswith("W/"):
        etag = etag[2:]
    return etag.strip('"')
