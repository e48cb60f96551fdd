"""HEAD and manifest documents (docs/SPEC.md §3–4): pydantic models at the JSON boundary.

Parsing is strict: unknown schema versions, missing fields and inconsistent values raise the
package's typed errors naming the object, never a bare pydantic ``ValidationError``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltastore.errors import CorruptObjectError, IntegrityError, UnsupportedSchemaError

#: The schema writers write (2: ``lineage`` on HEAD and manifests, optional ``signature``).
SCHEMA_VERSION = 2
#: Schemas readers accept: every store written by an earlier release stays readable.
#: Schema 3 (design 005, issue 8): compact zstd manifests, layout objects, attempt-scoped keys,
#: skip pointers, the history index (retention), squashes, and `parts`.
#: (3 is added by the change that implements its encoding.)
READABLE_SCHEMAS = (1, 2, 3)
#: Fields that exist only in schema 3 (a schema-1/2 document is written without them).
SCHEMA3_MANIFEST_FIELDS = ("anchor_manifest", "back", "chain_start", "layout", "max_attempt_s", "squashes")
#: Immutable objects written by schema 3 live under ``objects/<attempt>/`` (design 005 D1).
OBJECT_PREFIX = "objects/"
#: Default attempt deadline (design 005 D3): a writer abandons a commit attempt older than this.
DEFAULT_MAX_ATTEMPT_S = 6 * 3600
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
    name = name.split(".", 1)[0]  # .json, .json.zst, .pack, .layout.json.zst, ...
    return name.rsplit("-", 1)[-1]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def new_attempt_id() -> str:
    """A fresh commit-attempt id (``commit_id``): 32 lowercase hex digits (design 005 D1)."""
    import secrets

    return secrets.token_hex(16)


def object_key(attempt: str, digest: str, suffix: str) -> str:
    """``objects/<attempt>/<sha256><suffix>`` (schema 3): every immutable object an attempt
    writes is named under that attempt, so a retry never reuses an older attempt's orphan.
    ``suffix`` is ``.pack``, ``.layout.json.zst``, ``.squash.json.zst`` or ``.index.json.zst``."""
    return f"{OBJECT_PREFIX}{attempt}/{digest}{suffix}"


class ObjectRef(_Model):
    """A reference to one immutable object by key and SHA-256 of its stored bytes."""

    key: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class SquashRef(_Model):
    """Where a squash manifest ``from → to`` is (SPEC §12); a hint: readers tolerate it missing."""

    from_: int = Field(ge=1, alias="from")
    to: int = Field(ge=2)
    key: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


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
    #: schema 3: ``"f"`` (full segments only) or ``"d"`` (delta segments only); None before.
    role: Literal["f", "d"] | None = None


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
    #: schema 3 (None before): bytes of role-d / role-f segments this version wrote, and the
    #: role-d bytes of versions (chain_start, version] (design 005 D6: a reader prices the
    #: chain h → t as cum(t) − cum(h)).
    delta_bytes: int | None = None
    full_bytes: int | None = None
    cum_delta_bytes: int | None = None


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
    # --- schema 3 (design 005); absent from schema-1/2 documents ---
    #: the anchor's manifest key (None for an anchor, and before schema 3)
    anchor_manifest: str | None = None
    #: manifest keys of versions v−2, v−4, …, v−2^j ≥ 1 (skip pointers, hints)
    back: tuple[str, ...] = ()
    #: the latest version ≤ this one whose delta_base is null
    chain_start: int | None = None
    #: this version's layout object
    layout: ObjectRef | None = None
    #: the writer's attempt deadline, seconds (GC's grace must exceed it)
    max_attempt_s: int | None = None
    #: squash manifests with ``to`` = this version (hints)
    squashes: tuple[SquashRef, ...] = ()

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_fields(self) -> Manifest:
        _check_schema_fields(self, self.schema_, self.lineage, ("lineage", "signature"))
        if self.schema_ < 3:
            present = [k for k in SCHEMA3_MANIFEST_FIELDS if k in self.model_fields_set]
            if present:
                raise ValueError(f"schema {self.schema_} has no {', '.join(present)} (schema 3 fields)")
        return self

    def references(self) -> list[str]:
        """Keys of the objects this manifest needs to be materialized or applied: its packs
        and its layout (not its parent, anchor, skip pointers or squashes)."""
        keys = [b.key for b in self.blobs]
        if self.layout is not None:
            keys.append(self.layout.key)
        return keys


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
    #: schema 3: the current history index (SPEC §11), or None (floor 1, no pins, no squashes)
    index: ObjectRef | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_fields(self) -> Head:
        _check_schema_fields(self, self.schema_, self.lineage, ("lineage",))
        if self.schema_ < 3 and "index" in self.model_fields_set:
            raise ValueError(f"schema {self.schema_} has no index (a schema 3 field)")
        return self


class Pin(_Model):
    """A version kept below the floor, with everything needed to materialize it (SPEC §11)."""

    version: int = Field(ge=1)
    manifest: str
    note: str = ""
    by: str = ""
    at: str = ""


class Index(_Model):
    """The history index HEAD points to (SPEC §11): retention floor, pins, registered squashes.

    Immutable, written create-only under the writer's attempt
    (``objects/<attempt>/<sha256>.index.json.zst``); a new one replaces it by a HEAD write that
    changes only ``index``.
    """

    format: Literal["deltastore.index"] = "deltastore.index"
    schema_: int = Field(3, alias="schema")
    lineage: str = Field(pattern=LINEAGE_PATTERN)
    generation: int = Field(ge=1)
    floor: int = Field(ge=1)
    pins: tuple[Pin, ...] = ()
    squashes: tuple[SquashRef, ...] = ()
    writer: str
    created: str
    previous: ObjectRef | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class Layout(_Model):
    """A schema-3 layout object (SPEC §3): the tensors of a version, as columns.

    Manifests name tensors by their position here. ``chunk_cols``, ``pieces``,
    ``piece_parts`` and ``parts`` describe sharded layouts (SPEC §8, issue 12); this release
    writes ``chunk_cols = 0``, ``pieces = piece_parts = None`` and ``parts = 0`` (unsharded).
    """

    format: Literal["deltastore.layout"] = "deltastore.layout"
    schema_: int = Field(3, alias="schema")
    name: tuple[str, ...]
    dtype: tuple[str, ...]
    shape: tuple[tuple[int, ...], ...]
    chunk_rows: tuple[int, ...]
    chunk_cols: tuple[int, ...]
    pieces: tuple[tuple[int, ...] | None, ...]
    piece_parts: tuple[tuple[int, ...] | None, ...]
    parts: int = 0

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class SquashManifest(_Model):
    """A squashed delta ``from → to`` (SPEC §12), in memory in the same shape as a Manifest:
    ``tensors`` lists only the chunks that changed in (from, to], each with one ``delta``
    segment (from its state at ``from`` to its state at ``to``) and its digest at ``to``."""

    format: Literal["deltastore.squash"] = "deltastore.squash"
    schema_: int = Field(3, alias="schema")
    from_: int = Field(ge=1, alias="from")
    to: int = Field(ge=2)
    from_manifest: str
    to_manifest: str
    commit_id: str
    lineage: str | None = Field(None, pattern=LINEAGE_PATTERN)
    layout: ObjectRef | None = None
    writer: str
    created: str
    blobs: tuple[BlobRef, ...] = ()
    tensors: tuple[TensorEntry, ...] = ()
    signature: Signature | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def references(self) -> list[str]:
        return [b.key for b in self.blobs]


def dump(model: BaseModel) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace) so equal documents hash equally.

    A schema-1 document is written without the schema-2 fields, byte for byte as schema 1
    wrote it.
    """
    doc = model.model_dump(mode="json", by_alias=True)
    schema = doc.get("schema")
    if schema == 1:
        for field in ("lineage", "signature"):
            if doc.get(field) is None:
                doc.pop(field, None)
    if isinstance(schema, int) and schema < 3:
        for field in (*SCHEMA3_MANIFEST_FIELDS, "index"):
            if field in doc and doc[field] in (None, [], ()):
                doc.pop(field)
        for blob in doc.get("blobs", ()):
            if blob.get("role") is None:
                blob.pop("role", None)
        stats = doc.get("stats")
        if isinstance(stats, dict):
            for field in ("delta_bytes", "full_bytes", "cum_delta_bytes"):
                if stats.get(field) is None:
                    stats.pop(field, None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


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
#: torch's limit on a tensor's number of dimensions.
MAX_NDIM = 64
#: The dtypes deltastore publishes and reads (PyTorch names), with their element width in
#: bytes: dense types of 1, 2, 4 or 8 bytes whose bits a state digest can cover.
DTYPE_WIDTHS: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
}  # fmt: skip

_MANIFEST_KEY = re.compile(r"manifests/([0-9]{12,19})-([0-9a-f]{64})\.json")


def manifest_key_version(key: str) -> int | None:
    """The version a manifest key names (``manifests/<version:012d>-<sha256>.json``), or None
    when ``key`` is not a manifest key."""
    match = _MANIFEST_KEY.fullmatch(key)
    return None if match is None else int(match.group(1))


def chunk_count(shape: tuple[int, ...], chunk_rows: int) -> int:
    """Chunks of a tensor (SPEC §2): ``ceil(shape[0] / chunk_rows)``, at least one (0-d and
    empty tensors are one chunk)."""
    if not shape:
        return 1
    return max(1, -(-shape[0] // chunk_rows))


def chunk_elements(shape: tuple[int, ...], chunk_rows: int, index: int) -> int:
    """Elements in chunk ``index`` (the last chunk may be short)."""
    if not shape:
        return 1
    rows = max(0, min(chunk_rows, shape[0] - index * chunk_rows))
    row_elems = 1
    for d in shape[1:]:
        row_elems *= d
    return rows * row_elems


def _load(data: bytes, what: str, key: str, max_bytes: int) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise CorruptObjectError(
            f"{what} {key!r} is {len(data)} bytes, over the {max_bytes}-byte limit: not a deltastore {what}"
        )
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
        raise UnsupportedSchemaError(
            f"{what} {key!r} has schema {schema!r}; this deltastore reads schemas {', '.join(map(str, READABLE_SCHEMAS))}: upgrade deltastore"
        )
    _check_depth(doc, what, key)
    return doc


def _check_depth(doc: Any, what: str, key: str) -> None:
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


def _validate(cls: type[BaseModel], doc: dict[str, Any], what: str, key: str) -> Any:
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CorruptObjectError(f"{what} {key!r} is malformed at {where}: {first['msg']}") from None
    except (ValueError, RecursionError) as e:  # a validator that is not pydantic's own
        raise CorruptObjectError(f"{what} {key!r} is malformed: {type(e).__name__}") from None


def _check_int(value: int | None, field: str, what: str, key: str, *, low: int = 0) -> None:
    if value is not None and not low <= value < INT_LIMIT:
        raise CorruptObjectError(f"{what} {key!r}: {field} = {value} is outside [{low}, 2**63)")


def parse_head(data: bytes, key: str = HEAD_KEY) -> Head:
    """Parse HEAD bytes. Raises CorruptObjectError / UnsupportedSchemaError."""
    head: Head = _validate(Head, _load(data, "HEAD", key, MAX_HEAD_BYTES), "HEAD", key)
    _check_int(head.version, "version", "HEAD", key)
    _check_int(head.epoch, "epoch", "HEAD", key)
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


def parse_manifest(data: bytes, key: str, expected_sha256: str | None = None, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Verify a manifest's bytes against its content address (and HEAD's record), then parse it.

    Args:
        data: the manifest's bytes.
        key: the key it was read from (``manifests/<version:012d>-<sha256>.json``).
        expected_sha256: the digest HEAD recorded for it, if read through HEAD.
        max_bytes: refuse a larger object before parsing it.

    Raises:
        IntegrityError: the bytes do not hash to the key's digest or to ``expected_sha256``.
        CorruptObjectError: not a well-formed manifest, inconsistent with itself (SPEC §3), or
            filed under another version's key.
        UnsupportedSchemaError: written by a newer schema.
    """
    actual = sha256_hex(data)
    if actual != digest_from_key(key) or (expected_sha256 is not None and actual != expected_sha256):
        raise IntegrityError(f"manifest {key!r} has SHA-256 {actual}, not the digest its key promises: the object is corrupt")
    key_version = manifest_key_version(key)
    if key_version is None:
        raise CorruptObjectError(f"{key!r} is not a manifest key (manifests/<version:012d>-<sha256>.json)")
    manifest: Manifest = _validate(Manifest, _load(data, "manifest", key, max_bytes), "manifest", key)
    _check_manifest(manifest, key)
    if manifest.version != key_version:
        raise CorruptObjectError(f"manifest {key!r} holds version {manifest.version}, not the version its key names")
    return manifest


def _check_manifest(m: Manifest, key: str) -> None:
    """Cross-field invariants pydantic cannot express (SPEC §3), checked before any planning:
    a reader may then index chunks, allocate tensors and slice packs by what the manifest says."""

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {key!r}: {msg}")

    for name in ("version", "parent", "anchor", "delta_base", "epoch"):
        _check_int(getattr(m, name), name, "manifest", key)
    _check_int(m.step, "step", "manifest", key, low=-INT_LIMIT)
    for name in type(m.stats).model_fields:
        _check_int(getattr(m.stats, name), f"stats.{name}", "manifest", key, low=-INT_LIMIT)
    _check_depth(m.metadata, "manifest", key)
    if (m.parent is None) != (m.parent_manifest is None):
        raise bad("parent and parent_manifest must both be set or both be null")
    if m.parent is not None and m.parent != m.version - 1:
        raise bad(f"version {m.version} has parent {m.parent}; versions must be consecutive")
    if m.parent_manifest is not None and manifest_key_version(m.parent_manifest) != m.parent:
        raise bad(f"parent_manifest {m.parent_manifest!r} is not the manifest key of version {m.parent}")
    if m.kind == "anchor" and m.anchor != m.version:
        raise bad("an anchor's 'anchor' must be its own version")
    if m.kind == "delta" and (m.parent is None or m.anchor >= m.version or m.delta_base != m.parent):
        raise bad("a delta needs a parent, an earlier anchor, and delta_base equal to its parent")
    if m.delta_base is not None and m.delta_base != m.parent:
        raise bad("delta_base must be the parent version or null")
    for i, b in enumerate(m.blobs):
        _check_int(b.size, f"blobs[{i}].size", "manifest", key)
        if b.key != blob_key(b.sha256) or len(b.sha256) != 64:
            raise bad(f"blob {i} has key {b.key!r}, not the content address of its sha256 {b.sha256!r}")
    names: set[str] = set()
    for t in m.tensors:
        where = f"tensor {t.name!r}"
        if t.name in names:
            raise bad(f"{where} is listed twice")
        names.add(t.name)
        if t.dtype not in DTYPE_WIDTHS:
            raise bad(f"{where} has dtype {t.dtype!r}, which deltastore does not store")
        if len(t.shape) > MAX_NDIM or any(not 0 <= d < INT_LIMIT for d in t.shape):
            raise bad(f"{where} has impossible shape {list(t.shape)[:MAX_NDIM + 1]}")
        numel = 1
        for d in t.shape:
            numel *= d
        if numel * DTYPE_WIDTHS[t.dtype] >= INT_LIMIT:
            raise bad(f"{where} of shape {list(t.shape)} has more than 2**63 bytes")
        _check_int(t.chunk_rows, f"{where} chunk_rows", "manifest", key, low=1)
        n_chunks = chunk_count(t.shape, t.chunk_rows)
        seen: set[int] = set()
        for c in t.chunks:
            here = f"chunk {t.name}[{c.index}]"
            if not 0 <= c.index < n_chunks:
                raise bad(f"{here} is out of range: tensor {t.name!r} {list(t.shape)} has {n_chunks} chunk(s) of {t.chunk_rows} rows")
            if c.index in seen:
                raise bad(f"{here} is listed twice")
            seen.add(c.index)
            if m.kind == "anchor" and c.full is None:
                raise bad(f"anchor {here} has no full segment")
            if m.kind == "delta" and c.delta is None:
                raise bad(f"delta {here} has no delta segment")
            if m.delta_base is None and c.delta is not None:
                raise bad(f"{here} has a delta segment but the manifest has no delta_base")
            elements = chunk_elements(t.shape, t.chunk_rows, c.index)
            for which, seg in (("full", c.full), ("delta", c.delta)):
                if seg is None:
                    continue
                if seg.blob >= len(m.blobs):
                    raise bad(f"{here} {which} names blob {seg.blob} of {len(m.blobs)}")
                if seg.offset + seg.length > m.blobs[seg.blob].size:
                    raise bad(f"{here} {which} runs past the end of {m.blobs[seg.blob].key!r}")
                if seg.n_changed > elements:
                    raise bad(f"{here} {which} changes {seg.n_changed} elements of {elements}")
        if m.kind == "anchor" and len(seen) != n_chunks:
            raise bad(f"anchor lists {len(seen)} of the {n_chunks} chunks of tensor {t.name!r}")


# --- schema-3 objects: the seam the writer, GC and compactor use --------------------------------
# The bytes of a schema-3 object are produced and read only through these two functions; the
# change that implements the compact encoding (design 005 D8: zstd canonical JSON, columnar chunk
# tables) replaces their bodies, not their callers.

#: Formats of the schema-3 objects other than manifests, by model class.
_OBJECT_WHAT = {Index: "history index", Layout: "layout", SquashManifest: "squash manifest"}


def encode_manifest(m: Manifest, layout: Layout | None = None) -> bytes:
    """The stored bytes of a manifest. Schema 1/2: canonical JSON (:func:`dump`). Schema 3: the
    compact encoding of design 005 D8, whose chunk table names tensors by their position in
    ``layout`` (the object ``m.layout`` refers to)."""
    return dump(m)


def encode_object(model: Index | Layout | SquashManifest) -> bytes:
    """The stored bytes of a schema-3 index, layout or squash manifest (its key is
    ``object_key(attempt, sha256_hex(bytes), suffix)``)."""
    return dump(model)


def decode_object(cls: type[Any], data: bytes, key: str, expected_sha256: str | None = None) -> Any:
    """Verify ``data`` against the digest ``key`` promises (and ``expected_sha256``), then parse
    it as ``cls`` (Index, Layout or SquashManifest).

    Raises:
        IntegrityError: the bytes do not hash to the key's digest.
        CorruptObjectError: not a well-formed object of that kind.
        UnsupportedSchemaError: a schema this deltastore does not read.
    """
    what = _OBJECT_WHAT[cls]
    actual = sha256_hex(data)
    if actual != digest_from_key(key) or (expected_sha256 is not None and actual != expected_sha256):
        raise IntegrityError(f"{what} {key!r} has SHA-256 {actual}, not the digest its key promises: the object is corrupt")
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptObjectError(f"{what} {key!r} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptObjectError(f"{what} {key!r} is not valid JSON; the object is corrupt or truncated") from None
    if not isinstance(doc, dict):
        raise CorruptObjectError(f"{what} {key!r} is not a JSON object")
    if doc.get("schema") != 3:
        raise UnsupportedSchemaError(f"{what} {key!r} has schema {doc.get('schema')!r}; this deltastore reads schema 3")
    _check_depth(doc, what, key)
    return _validate(cls, doc, what, key)
