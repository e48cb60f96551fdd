"""HEAD and manifest documents (docs/SPEC.md §3–4): pydantic models at the JSON boundary.

Parsing is strict: unknown schema versions, missing fields and inconsistent values raise the
package's typed errors naming the object, never a bare pydantic ``ValidationError``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltastore.errors import CorruptObjectError, IntegrityError, UnsupportedSchemaError

#: The schema writers write (2: ``lineage`` on HEAD and manifests, optional ``signature``).
SCHEMA_VERSION = 2
#: Schemas readers accept: every store written by an earlier release stays readable.
READABLE_SCHEMAS = (1, 2)
#: ``lineage``: 32 lowercase hex digits (128 random bits), docs/SPEC.md §5.
LINEAGE_PATTERN = r"^[0-9a-f]{32}$"
HEAD_KEY = "HEAD"
MANIFEST_PREFIX = "manifests/"
BLOB_PREFIX = "blobs/"
STATE_DIGEST = "xxh3-128"


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data`` (the content address of every immutable object)."""
    return hashlib.sha256(data).hexdigest()


def blob_key(digest: str) -> str:
    """``blobs/<first two hex digits>/<digest>``: the fan-out keeps directory listings small."""
    return f"{BLOB_PREFIX}{digest[:2]}/{digest}"


def manifest_key(version: int, digest: str) -> str:
    """``manifests/<version:012d>-<digest>.json``: sortable by version, unique by content."""
    return f"{MANIFEST_PREFIX}{version:012d}-{digest}.json"


def digest_from_key(key: str) -> str:
    """The SHA-256 a content-addressed key promises (the last path part, before any suffix)."""
    name = key.rsplit("/", 1)[-1]
    name = name.removesuffix(".json")
    return name.rsplit("-", 1)[-1]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def new_lineage() -> str:
    """A fresh random lineage id (one per history, SPEC §5)."""
    import secrets

    return secrets.token_hex(16)


class Signature(_Model):
    """An Ed25519 signature of a manifest (SPEC §3.1); see :mod:`deltastore.signing`."""

    alg: Literal["ed25519"]
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    value: str = Field(pattern=r"^[A-Za-z0-9+/]{86}==$")  # base64 of 64 bytes


def _check_schema_fields(model: BaseModel, schema: int, lineage: str | None, new_fields: tuple[str, ...]) -> None:
    """Schema 1 has no ``lineage``/``signature`` (not even null); schema 2 requires ``lineage``."""
    if schema == 1:
        present = [k for k in new_fields if k in model.model_fields_set]
        if present:
            raise ValueError(f"schema 1 has no {', '.join(present)} (those are schema 2 fields)")
    elif lineage is None:
        raise ValueError(f"schema {schema} requires lineage")


class BlobRef(_Model):
    key: str
    size: int = Field(ge=0)
    sha256: str


class SegmentRef(_Model):
    blob: int = Field(ge=0)
    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    sha256: str
    codec: str
    n_changed: int = Field(ge=0)


class ChunkEntry(_Model):
    index: int = Field(ge=0)
    digest: str
    full: SegmentRef | None = None
    delta: SegmentRef | None = None


class TensorEntry(_Model):
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_rows: int = Field(ge=1)
    chunks: tuple[ChunkEntry, ...]


class Stats(_Model):
    bytes_stored: int = 0
    tensors_changed: int = 0
    elements_changed: int = 0
    tensors_total: int = 0
    elements_total: int = 0


class Manifest(_Model):
    """One committed version (immutable)."""

    format: Literal["deltastore.manifest"] = "deltastore.manifest"
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    version: int = Field(ge=1)
    parent: int | None
    parent_manifest: str | None
    kind: Literal["anchor", "delta"]
    anchor: int = Field(ge=1)
    delta_base: int | None = None
    step: int | None = None
    created: str
    writer: str
    epoch: int = Field(ge=0)
    commit_id: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    state_digest: Literal["xxh3-128"] = STATE_DIGEST
    blobs: tuple[BlobRef, ...] = ()
    tensors: tuple[TensorEntry, ...] = ()
    stats: Stats = Stats()
    parts: tuple[()] = ()
    lineage: str | None = Field(None, pattern=LINEAGE_PATTERN)
    signature: Signature | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_fields(self) -> Manifest:
        _check_schema_fields(self, self.schema_, self.lineage, ("lineage", "signature"))
        return self


class Head(_Model):
    """The commit point: which manifest is current, and who may write next."""

    format: Literal["deltastore.head"] = "deltastore.head"
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    version: int = Field(ge=0)
    manifest: str | None
    manifest_sha256: str | None
    commit_id: str
    writer: str
    epoch: int = Field(ge=0)
    updated: str
    lineage: str | None = Field(None, pattern=LINEAGE_PATTERN)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_fields(self) -> Head:
        _check_schema_fields(self, self.schema_, self.lineage, ("lineage",))
        return self


def dump(model: BaseModel) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace) so equal documents hash equally.

    A schema-1 document is written without the schema-2 fields, byte for byte as schema 1
    wrote it.
    """
    doc = model.model_dump(mode="json", by_alias=True)
    if doc.get("schema") == 1:
        for field in ("lineage", "signature"):
            if doc.get(field) is None:
                doc.pop(field, None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _load(data: bytes, what: str, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptObjectError(f"{what} {key!r} is not valid JSON ({e}); the object is corrupt or truncated") from None
    if not isinstance(doc, dict):
        raise CorruptObjectError(f"{what} {key!r} is not a JSON object")
    schema = doc.get("schema")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        raise UnsupportedSchemaError(
            f"{what} {key!r} has schema {schema!r}; this deltastore reads schemas {', '.join(map(str, READABLE_SCHEMAS))}: upgrade deltastore"
        )
    return doc


def _validate(cls: type[BaseModel], doc: dict[str, Any], what: str, key: str) -> Any:
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CorruptObjectError(f"{what} {key!r} is malformed at {where}: {first['msg']}") from None


def parse_head(data: bytes, key: str = HEAD_KEY) -> Head:
    """Parse HEAD bytes. Raises CorruptObjectError / UnsupportedSchemaError."""
    return _validate(Head, _load(data, "HEAD", key), "HEAD", key)


def parse_manifest(data: bytes, key: str, expected_sha256: str | None = None) -> Manifest:
    """Verify a manifest's bytes against its content address (and HEAD's record), then parse it.

    Raises:
        IntegrityError: the bytes do not hash to the key's digest or to ``expected_sha256``.
        CorruptObjectError: not a well-formed manifest, or inconsistent with itself.
        UnsupportedSchemaError: written by a newer schema.
    """
    actual = sha256_hex(data)
    if actual != digest_from_key(key) or (expected_sha256 is not None and actual != expected_sha256):
        raise IntegrityError(f"manifest {key!r} has SHA-256 {actual}, not the digest its key promises: the object is corrupt")
    manifest: Manifest = _validate(Manifest, _load(data, "manifest", key), "manifest", key)
    _check_manifest(manifest, key)
    return manifest


def _check_manifest(m: Manifest, key: str) -> None:
    """Cross-field invariants pydantic cannot express (SPEC §3)."""

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {key!r}: {msg}")

    if (m.parent is None) != (m.parent_manifest is None):
        raise bad("parent and parent_manifest must both be set or both be null")
    if m.parent is not None and m.parent != m.version - 1:
        raise bad(f"version {m.version} has parent {m.parent}; versions must be consecutive")
    if m.kind == "anchor" and m.anchor != m.version:
        raise bad("an anchor's 'anchor' must be its own version")
    if m.kind == "delta" and (m.parent is None or m.anchor > m.version or m.delta_base != m.parent):
        raise bad("a delta needs a parent, an earlier anchor, and delta_base equal to its parent")
    if m.delta_base is not None and m.delta_base != m.parent:
        raise bad("delta_base must be the parent version or null")
    for t in m.tensors:
        for c in t.chunks:
            if m.kind == "anchor" and c.full is None:
                raise bad(f"anchor chunk {t.name}[{c.index}] has no full segment")
            if m.kind == "delta" and c.delta is None:
                raise bad(f"delta chunk {t.name}[{c.index}] has no delta segment")
            if m.delta_base is None and c.delta is not None:
                raise bad(f"chunk {t.name}[{c.index}] has a delta segment but the manifest has no delta_base")
            for seg in (c.full, c.delta):
                if seg is None:
                    continue
                if seg.blob >= len(m.blobs):
                    raise bad(f"chunk {t.name}[{c.index}] names blob {seg.blob} of {len(m.blobs)}")
                if seg.offset + seg.length > m.blobs[seg.blob].size:
                    raise bad(f"chunk {t.name}[{c.index}] runs past the end of {m.blobs[seg.blob].key!r}")
