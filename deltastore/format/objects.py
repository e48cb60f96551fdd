"""The history index, layout and squash-manifest objects as stored (docs/SPEC.md §3.2, §11,
§12): one zstd frame of canonical JSON each, named ``objects/<attempt>/<sha256><suffix>``.
"""

from __future__ import annotations

from typing import Any

from deltastore.format.checks import check_layout
from deltastore.format.models import Index, Layout, SquashManifest, dump
from deltastore.format.parse import MAX_MANIFEST_BYTES, check_digest, load_document, validate, zstd_frame

#: What each kind of object is called in errors, by model class.
_OBJECT_WHAT = {Index: "history index", Layout: "layout", SquashManifest: "squash manifest"}


def encode_object(model: Index | Layout | SquashManifest) -> bytes:
    """The stored bytes of an index, layout or squash manifest (its key is
    ``object_key(attempt, sha256_hex(bytes), suffix)``): one zstd frame of canonical JSON."""
    return zstd_frame(dump(model))


def decode_object(cls: type[Any], data: bytes, key: str, expected_sha256: str | None = None) -> Any:
    """Verify ``data`` against the digest ``key`` promises (and ``expected_sha256``), then parse
    it as ``cls`` (Index, Layout or SquashManifest).

    Raises:
        IntegrityError: the bytes do not hash to the key's digest.
        CorruptObjectError: not a well-formed object of that kind.
        UnsupportedSchemaError: a schema this deltastore does not read, or a sharded layout.
    """
    what = _OBJECT_WHAT[cls]
    check_digest(data, key, expected_sha256, what)
    doc = load_document(data, what, key, MAX_MANIFEST_BYTES)
    obj = validate(cls, doc, what, key)
    if isinstance(obj, Layout):
        check_layout(obj, what, key)
    return obj
