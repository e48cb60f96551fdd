"""Keys of the bucket's objects (docs/SPEC.md §1): their shapes, content addresses and ids.

Every immutable object is named by the SHA-256 of its bytes (:func:`sha256_hex`), under its
commit attempt (``objects/<attempt>/…``) or, for a manifest, under its version
(``manifests/<version:012d>-<sha256>.json.zst``). A key that the store's content names is a
:data:`StoreKey`: refused when the object is parsed if no store would accept it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from functools import lru_cache
from typing import Annotated

from pydantic import AfterValidator

from deltastore.storage._keys import check_key

HEAD_KEY = "HEAD"
MANIFEST_PREFIX = "manifests/"
#: Suffix of a manifest: one zstd frame of canonical JSON.
MANIFEST_SUFFIX = ".json.zst"
#: Immutable objects live under ``objects/<attempt>/`` (design 005 D1).
OBJECT_PREFIX = "objects/"
#: ``lineage``: 32 lowercase hex digits (128 random bits), docs/SPEC.md §5.
LINEAGE_PATTERN = r"^[0-9a-f]{32}$"

_MANIFEST_KEY = re.compile(r"manifests/([0-9]{12,19})-([0-9a-f]{64})\.json\.zst")
#: The key of a plain-JSON manifest of schema 1 or 2: recognised only to be refused as an
#: earlier format (UnsupportedSchemaError), not as a damaged key.
EARLIER_MANIFEST_KEY = re.compile(r"manifests/[0-9]{12,19}-[0-9a-f]{64}\.json")
#: A pack key: ``objects/<attempt>/<sha256>.pack``.
PACK_KEY = re.compile(r"objects/[0-9a-f]{32}/([0-9a-f]{64})\.pack")
#: A part manifest's key: ``objects/<attempt>/<part:05d>-<sha256>.part.json.zst``.
PART_KEY = re.compile(r"objects/([0-9a-f]{32})/([0-9]{5,19})-([0-9a-f]{64})\.part\.json\.zst")


#: The root of every serving stream's tree (SPEC §15): ``streams/<format>/``.
STREAMS_PREFIX = "streams/"


def stream_prefix(fmt: str) -> str:
    """The key prefix of serving format ``fmt``'s tree (SPEC §15): ``streams/<fmt>/``."""
    return f"{STREAMS_PREFIX}{fmt}/"


#: The key of an immutable, content-addressed object (SPEC §1): a manifest, or an object under an
#: attempt (a pack, a layout, a part manifest, a squash manifest, a history index), at the root
#: or inside a serving stream's tree (``streams/<format>/``, §15). Its groups: ``manifest`` or
#: ``object``, the SHA-256 the key promises; ``msuffix`` or ``osuffix``, the suffix after it.
CONTENT_KEY = re.compile(
    rf"(?:{STREAMS_PREFIX}[a-z0-9][a-z0-9.-]{{0,63}}/)?"
    r"(?:manifests/[0-9]{12,19}-(?P<manifest>[0-9a-f]{64})(?P<msuffix>\.json\.zst)"
    r"|objects/[0-9a-f]{32}/(?:[0-9]{5,19}-)?(?P<object>[0-9a-f]{64})"
    r"(?P<osuffix>\.pack|\.layout\.json\.zst|\.part\.json\.zst|\.squash\.json\.zst|\.index\.json\.zst))"
)


def is_content_key(key: str) -> bool:
    """True when ``key`` names an immutable, content-addressed object (:data:`CONTENT_KEY`): its
    bytes never change, and a read of it is a fetch; HEAD, heartbeats, a fleet target and GC
    records are mutable."""
    return CONTENT_KEY.fullmatch(key) is not None


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data`` (the content address of every immutable object)."""
    return hashlib.sha256(data).hexdigest()


def manifest_key(version: int, digest: str) -> str:
    """``manifests/<version:012d>-<digest>.json.zst``: sortable by version, unique by content."""
    return f"{MANIFEST_PREFIX}{version:012d}-{digest}{MANIFEST_SUFFIX}"


def manifest_key_version(key: str) -> int | None:
    """The version a manifest key names (``manifests/<version:012d>-<sha256>.json.zst``), or
    None when ``key`` is not a manifest key."""
    match = _MANIFEST_KEY.fullmatch(key)
    return None if match is None else int(match.group(1))


def digest_from_key(key: str) -> str:
    """The SHA-256 a content-addressed key promises (the last path part, before any suffix)."""
    name = key.rsplit("/", 1)[-1]
    name = name.split(".", 1)[0]  # .json.zst, .pack, .layout.json.zst, ...
    return name.rsplit("-", 1)[-1]


def object_key(attempt: str, digest: str, suffix: str) -> str:
    """``objects/<attempt>/<sha256><suffix>``: every immutable object an attempt writes is named
    under that attempt, so a retry never reuses an older attempt's orphan. ``suffix`` is
    ``.pack``, ``.layout.json.zst``, ``.squash.json.zst`` or ``.index.json.zst``."""
    return f"{OBJECT_PREFIX}{attempt}/{digest}{suffix}"


def part_key(attempt: str, part: int, digest: str) -> str:
    """``objects/<attempt>/<part:05d>-<sha256>.part.json.zst`` (SPEC §1)."""
    return f"{OBJECT_PREFIX}{attempt}/{part:05d}-{digest}.part.json.zst"


def new_attempt_id() -> str:
    """A fresh commit-attempt id (``commit_id``): 32 lowercase hex digits (design 005 D1)."""
    return secrets.token_hex(16)


def new_lineage() -> str:
    """A fresh random lineage id (one per history, SPEC §5)."""
    return secrets.token_hex(16)


#: Distinct keys whose check is remembered: a manifest names a few dozen objects (its packs,
#: layout, parent, skip pointers, squashes) and the next manifest names most of them again.
CHECKED_KEYS_MAX = 4096


@lru_cache(maxsize=CHECKED_KEYS_MAX)
def _store_key(key: str) -> str:
    """``key`` if a store would look it up (the rules of storage/_keys.check_key), else
    InvalidKeyError: a ValueError, so pydantic reports it as the field's error and a reader
    refuses the object that names the key (CorruptObjectError naming that object) before
    anything is read by it. Checked once per distinct key (a refusal is not remembered)."""
    return check_key(key)


#: A key that the store's content names (a ref's ``key``, a manifest link): refused at parse
#: time when no store would accept it ('../../etc', '', 'a//b'), not later by the store.
StoreKey = Annotated[str, AfterValidator(_store_key)]
