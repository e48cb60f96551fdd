"""Strict reading of stored bytes (docs/SPEC.md §9): size, zstd frame, JSON, depth and schema
checked before any model is built, every failure a typed error naming the object; and HEAD.

Every object but HEAD is one zstd frame of canonical JSON (:func:`zstd_frame`); HEAD is plain
JSON. :func:`load_document` and :func:`parse_head` are the two ways in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import zstandard
from pydantic import BaseModel, ValidationError

from deltastore.errors import CorruptObjectError, IntegrityError, UnsupportedSchemaError
from deltastore.format.keys import HEAD_KEY, digest_from_key, manifest_key_version, sha256_hex
from deltastore.format.models import HEAD_SCHEMA, READABLE_SCHEMAS, Head

#: Schemas of the objects, by kind: layouts and manifests gained groups in schema 4, manifests
#: serving streams in schema 5 (SPEC §15); the
#: history index and squash manifests did not change (design 007 D3).
_ZST_SCHEMAS = {"manifest": (3, 4, 5), "layout": (3, 4), "part manifest": (3, 4)}

#: HEAD is a few hundred bytes: anything near this size is not a HEAD, and is refused before
#: it is parsed.
MAX_HEAD_BYTES = 64 * 1024
#: Default cap on one manifest's bytes, checked before parsing (parsing JSON costs several times
#: its size in memory): an anchor of a 1T-parameter model at 16 MiB chunks is ~20 MiB of JSON.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
#: User metadata nested deeper than this is refused: json and pydantic recurse, and Python
#: raises RecursionError near 1000 levels (less on a worker thread's stack).
MAX_JSON_DEPTH = 100
#: Every version, epoch, count, size, offset and dimension is below this: numpy and torch index
#: with int64, so a larger number cannot describe a real object.
INT_LIMIT = 2**63
#: zstd level of every object but HEAD: level 19 saves ~3 % more and costs seconds for an
#: anchor of 10⁵ chunks (design 005 D8).
ZSTD_LEVEL = 3


def _load_json(data: bytes, what: str, key: str, max_bytes: int) -> dict[str, Any]:
    """A plain-JSON object's document (HEAD), size, schema and depth checked."""
    if len(data) > max_bytes:
        raise CorruptObjectError(
            f"{what} {key!r} is {len(data)} bytes, over the {max_bytes}-byte limit: not a deltastore {what}"
        )
    doc = _json_document(data, what, key)
    check_depth(doc, what, key)
    return doc


def _json_document(data: bytes, what: str, key: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object of a readable schema, or a typed error naming ``key``."""
    try:
        doc = json.loads(data)
    # ValueError covers JSONDecodeError, undecodable bytes and integers over Python's digit
    # limit; RecursionError, nesting deeper than the parser's stack.
    except (ValueError, RecursionError) as e:
        msg = " ".join(str(e).split())[:200]
        raise CorruptObjectError(f"{what} {key!r} is not valid JSON ({msg}); the object is corrupt or truncated") from None
    if not isinstance(doc, dict):
        raise CorruptObjectError(f"{what} {key!r} is not a JSON object")
    schema = doc.get("schema")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        raise unsupported_schema(what, key, schema, READABLE_SCHEMAS)
    return doc


def unsupported_schema(what: str, key: str, schema: Any, readable: Sequence[int]) -> UnsupportedSchemaError:
    """The refusal of an object of a schema this deltastore does not read (SPEC §13): a newer
    one needs a newer deltastore; an older one (schemas 1 and 2) is an earlier format that this
    format's readers do not read."""
    reads = ", ".join(map(str, readable))
    if type(schema) is int and schema < min(readable):
        return UnsupportedSchemaError(f"{what} {key!r} has schema {schema}, an earlier format this deltastore does not "
                                      f"read (it reads schema {reads}): publish the model to a new store")
    if type(schema) is not int:
        return UnsupportedSchemaError(f"{what} {key!r} has schema {schema!r}, not a schema number (this deltastore "
                                      f"reads schema {reads}): the object is corrupt or was not written by deltastore")
    return UnsupportedSchemaError(f"{what} {key!r} has schema {schema!r}; this deltastore reads schema {reads}: "
                                  "upgrade deltastore")


def check_depth(doc: Any, what: str, key: str) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH (iteratively: no recursion to exhaust)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise CorruptObjectError(f"{what} {key!r} is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def validate(cls: type[BaseModel], doc: dict[str, Any], what: str, key: str, at: tuple[str | int, ...] = ()) -> Any:
    """``doc`` as ``cls``, or CorruptObjectError naming the object (``what`` ``key``) and the
    field (``at``: where ``doc`` lies in that object, for a part of it)."""
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in (*at, *first["loc"]))
        raise CorruptObjectError(f"{what} {key!r} is malformed at {where}: {first['msg']}") from None
    except (ValueError, RecursionError) as e:  # a validator that is not pydantic's own
        raise CorruptObjectError(f"{what} {key!r} is malformed: {type(e).__name__}") from None


def check_int(value: int | None, field: str, what: str, key: str, *, low: int = 0) -> None:
    """``value`` (field ``field`` of ``what`` ``key``) is None or in ``[low, 2**63)``."""
    if value is not None and not low <= value < INT_LIMIT:
        raise CorruptObjectError(f"{what} {key!r}: {field} = {value} is outside [{low}, 2**63)")


def zstd_frame(doc: bytes) -> bytes:
    """One zstd frame of ``doc`` with its content size in the frame header."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(doc)


def _unzstd(data: bytes, what: str, key: str, max_bytes: int) -> bytes:
    """The content of the single zstd frame ``data``, refused unless its header declares a
    content size ≤ ``max_bytes`` (decompression is bounded by that size, never open-ended)."""
    if len(data) > max_bytes:
        raise CorruptObjectError(f"{what} {key!r} is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise CorruptObjectError(f"{what} {key!r} is not a zstd frame; the object is corrupt or truncated") from None
    if size < 0:
        raise CorruptObjectError(f"{what} {key!r}: its zstd frame does not declare its content size")
    if size > max_bytes:
        raise CorruptObjectError(f"{what} {key!r} decompresses to {size} bytes, over the {max_bytes}-byte limit")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what} {key!r} does not decompress ({e}); the object is corrupt or truncated") from None
    if len(out) != size:
        raise CorruptObjectError(f"{what} {key!r} decompresses to {len(out)} bytes, not the {size} its frame declares")
    return out


def load_document(data: bytes, what: str, key: str, max_bytes: int) -> dict[str, Any]:
    """An object's JSON document (decompressed, parsed, schema and depth checked)."""
    doc = _json_document(_unzstd(data, what, key, max_bytes), what, key)
    allowed = _ZST_SCHEMAS.get(what, (3,))
    if doc["schema"] not in allowed:
        raise unsupported_schema(what, key, doc["schema"], allowed)
    check_depth(doc, what, key)
    return doc


def check_digest(data: bytes, key: str, expected_sha256: str | None, what: str) -> None:
    """``data`` hashes to the digest ``key`` promises (and to ``expected_sha256``), else
    IntegrityError naming the object."""
    actual = sha256_hex(data)
    if actual != digest_from_key(key) or (expected_sha256 is not None and actual != expected_sha256):
        raise IntegrityError(f"{what} {key!r} has SHA-256 {actual}, not the digest its key promises: the object is corrupt")


def parse_head(data: bytes, key: str = HEAD_KEY) -> Head:
    """Parse HEAD bytes. Raises CorruptObjectError / UnsupportedSchemaError."""
    doc = _load_json(data, "HEAD", key, MAX_HEAD_BYTES)
    if doc["schema"] != HEAD_SCHEMA:  # schema 4 changed layouts and manifests, not HEAD
        raise unsupported_schema("HEAD", key, doc["schema"], (HEAD_SCHEMA,))
    head: Head = validate(Head, doc, "HEAD", key)
    check_int(head.version, "version", "HEAD", key)
    check_int(head.epoch, "epoch", "HEAD", key)
    # HEAD names its manifest by key and digest: both must be what a writer produces, so that a
    # hostile HEAD cannot make a reader fetch an arbitrary key (or the empty one).
    if head.manifest is None:
        if head.version != 0 or head.manifest_sha256 is not None:
            raise CorruptObjectError(f"HEAD {key!r} names no manifest but says version {head.version}")
    elif manifest_key_version(head.manifest) != head.version or head.manifest_sha256 != digest_from_key(head.manifest):
        raise CorruptObjectError(
            f"HEAD {key!r}: {head.manifest!r} is not the manifest key of version {head.version} "
            f"with SHA-256 {head.manifest_sha256!r}"
        )
    return head
