"""HEAD and manifest documents (docs/SPEC.md §3–4): pydantic models at the JSON boundary.

Parsing is strict: unknown schema versions, missing fields and inconsistent values raise the
package's typed errors naming the object, never a bare pydantic ``ValidationError``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

import zstandard
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from deltastore._util import kernels
from deltastore.errors import CorruptObjectError, IntegrityError, UnsupportedSchemaError
from deltastore._util.identity import IdentityCache
from deltastore.storage._keys import check_key

#: The schema of the objects writers write (SPEC §13): schema 3, or 4 (:data:`GROUPS_SCHEMA`,
#: :data:`BASE_SCHEMA`) for a layout with group rows, a manifest that uses one, and a based version.
SCHEMA_VERSION = 3
#: Schemas readers accept (SPEC §13); any other is refused with UnsupportedSchemaError.
READABLE_SCHEMAS = (3, 4)
#: The schema of a grouped layout and of the manifests that use it (design 007 D3).
GROUPS_SCHEMA = 4
#: Schemas of the objects, by kind: layouts and manifests gained groups in schema 4; the
#: history index and squash manifests did not change (design 007 D3).
_ZST_SCHEMAS = {"manifest": (3, 4), "layout": (3, 4), "part manifest": (3, 4)}
#: Immutable objects live under ``objects/<attempt>/`` (design 005 D1).
OBJECT_PREFIX = "objects/"
#: Default attempt deadline (design 005 D3): a writer abandons a commit attempt older than this.
DEFAULT_MAX_ATTEMPT_S = 6 * 3600
#: ``lineage``: 32 lowercase hex digits (128 random bits), docs/SPEC.md §5.
LINEAGE_PATTERN = r"^[0-9a-f]{32}$"
HEAD_KEY = "HEAD"
#: The HEAD schema (design 007 D3: schema 4 left HEAD as schema 3 wrote it).
HEAD_SCHEMA = 3
MANIFEST_PREFIX = "manifests/"
STATE_DIGEST = "xxh3-128"


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data`` (the content address of every immutable object)."""
    return hashlib.sha256(data).hexdigest()


#: Suffix of a manifest: one zstd frame of canonical JSON.
MANIFEST_SUFFIX = ".json.zst"


def manifest_key(version: int, digest: str) -> str:
    """``manifests/<version:012d>-<digest>.json.zst``: sortable by version, unique by content."""
    return f"{MANIFEST_PREFIX}{version:012d}-{digest}{MANIFEST_SUFFIX}"


def digest_from_key(key: str) -> str:
    """The SHA-256 a content-addressed key promises (the last path part, before any suffix)."""
    name = key.rsplit("/", 1)[-1]
    name = name.split(".", 1)[0]  # .json, .json.zst, .pack, .layout.json.zst, ...
    return name.rsplit("-", 1)[-1]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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

    key: StoreKey
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class BaseRef(_Model):
    """The base of a based version (schema 4, design 009): a version of *another* store, named
    by its manifest key and that manifest's SHA-256, version and lineage (SPEC §14)."""

    version: int = Field(ge=1)
    manifest: StoreKey
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    lineage: str = Field(pattern=LINEAGE_PATTERN)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


#: The schema that may carry ``base`` (design 009 D3: the one new schema of this release).
BASE_SCHEMA = 4


class SquashRef(_Model):
    """Where a squash manifest ``from → to`` is (SPEC §12); a hint: readers tolerate it missing."""

    from_: int = Field(ge=1, alias="from")
    to: int = Field(ge=2)
    key: StoreKey
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class PartRef(_Model):
    """One part of a sharded version (SPEC §8): its part manifest, by key and SHA-256."""

    part: int = Field(ge=0)
    key: StoreKey
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    writer: str
    bytes: int = Field(ge=0)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def new_lineage() -> str:
    """A fresh random lineage id (one per history, SPEC §5)."""
    import secrets

    return secrets.token_hex(16)


class Signature(_Model):
    """An Ed25519 signature of a manifest (SPEC §3.1); see :mod:`deltastore.format.signing`."""

    alg: Literal["ed25519"]
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    value: str = Field(pattern=r"^[A-Za-z0-9+/]{86}==$")  # base64 of 64 bytes


class BlobRef(_Model):
    key: StoreKey
    size: int = Field(ge=0)
    sha256: str
    #: ``"f"`` (full segments only) or ``"d"`` (delta segments only).
    role: Literal["f", "d"]


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
    #: bytes of role-d / role-f segments this version wrote, and the role-d bytes of versions
    #: (chain_start, version] (design 005 D6: a reader prices the chain h → t as cum(t) − cum(h)).
    delta_bytes: int | None = None
    full_bytes: int | None = None
    cum_delta_bytes: int | None = None


class Manifest(_Model):
    """One committed version (immutable)."""

    format: Literal["deltastore.manifest"] = "deltastore.manifest"
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    version: int = Field(ge=1)
    parent: int | None
    parent_manifest: StoreKey | None
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
    #: the parts of a sharded version (SPEC §8). In memory a sharded version also has its parts'
    #: packs (in part order) as ``blobs`` and their chunks as ``tensors``.
    parts: tuple[PartRef, ...] = ()
    lineage: str = Field(pattern=LINEAGE_PATTERN)
    signature: Signature | None = None
    #: the anchor's manifest key (None for an anchor)
    anchor_manifest: StoreKey | None = None
    #: manifest keys of versions v−2, v−4, …, v−2^j ≥ 1 (skip pointers, hints)
    back: tuple[StoreKey, ...] = ()
    #: the latest version ≤ this one whose delta_base is null
    chain_start: int | None = None
    #: this version's layout object
    layout: ObjectRef | None = None
    #: the writer's attempt deadline, seconds (GC's grace must exceed it)
    max_attempt_s: int | None = None
    #: squash manifests with ``to`` = this version (hints)
    squashes: tuple[SquashRef, ...] = ()
    #: schema 4, optional (design 009): the version of another store this version's delta
    #: segments apply to; absent (not null) from every document without it
    base: BaseRef | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    #: schema 4: group row name → members, from the layout (design 007 D4). Not a field: the
    #: layout object holds it and ``layout`` (a field, signed) names that object by SHA-256.
    _groups: dict[str, tuple[GroupMember, ...]] = PrivateAttr(default_factory=dict)
    #: tensor name → its ``chunk_cols`` where > 0 (a column grid, design 011 D1), from the
    #: layout, for the same reason as ``_groups``; empty for every layout without a grid.
    _grid: dict[str, int] = PrivateAttr(default_factory=dict)

    def members(self, name: str) -> tuple[GroupMember, ...]:
        """The members of group row ``name`` (empty for a tensor)."""
        return self._groups.get(name, ())

    def chunk_cols(self, name: str) -> int:
        """Tensor ``name``'s ``chunk_cols`` in the layout (0: whole rows, no grid)."""
        return self._grid.get(name, 0)

    def with_layout(self, layout: Layout | None) -> Manifest:
        """Attach ``layout``'s groups and column grids (in place; returns self)."""
        if layout is None:
            self._groups, self._grid = {}, {}
        else:
            self._groups, self._grid = layout.members(), layout.grid()
        return self

    @model_validator(mode="after")
    def _schema_fields(self) -> Manifest:
        if self.base is not None and self.schema_ < BASE_SCHEMA:
            raise ValueError(f"schema {self.schema_} has no base (a schema-{BASE_SCHEMA} field)")
        return self

    def references(self) -> list[str]:
        """Keys of the objects this manifest needs to be materialized or applied: its packs
        and its layout (not its parent, anchor, skip pointers or squashes)."""
        keys = [b.key for b in self.blobs]
        if self.layout is not None:
            keys.append(self.layout.key)
        keys.extend(p.key for p in self.parts)  # a sharded version's chunk table lives there
        return keys


class Head(_Model):
    """The commit point: which manifest is current, and who may write next."""

    format: Literal["deltastore.head"] = "deltastore.head"
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    version: int = Field(ge=0)
    manifest: StoreKey | None
    manifest_sha256: str | None
    commit_id: str
    writer: str
    epoch: int = Field(ge=0)
    updated: str
    lineage: str = Field(pattern=LINEAGE_PATTERN)
    #: the current history index (SPEC §11), or None (floor 1, no pins, no squashes)
    index: ObjectRef | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class Pin(_Model):
    """A version kept below the floor, with everything needed to materialize it (SPEC §11)."""

    version: int = Field(ge=1)
    manifest: StoreKey
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


class GroupMember(NamedTuple):
    """One tensor inside a group (design 007): elements ``[offset, offset + numel)`` of the
    group's row hold this tensor, of the group's dtype, in C order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GroupRecord(_Model):
    """The members of one group row of a schema-4 layout (SPEC §3.2), as columns."""

    unit: int
    name: tuple[str, ...]
    shape: tuple[tuple[int, ...], ...]
    offset: tuple[int, ...]


class Layout(_Model):
    """A schema-3 layout object (SPEC §3): the tensors of a version, as columns.

    Manifests name tensors by their position here. ``pieces``, ``piece_parts`` and ``parts``
    describe sharded layouts (SPEC §8, issue 12); ``chunk_cols`` > 0 a column grid (SPEC §2,
    design 011), which the unsharded writer writes only for tensors it is asked to grid.
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
    #: schema 4 (design 007): the members of each group row; None in schema 3.
    groups: tuple[GroupRecord, ...] | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    #: group row name → members; derived from ``groups`` once, when the object is built (so
    #: equal layouts stay equal: pydantic compares private attributes too).
    _members: dict[str, tuple[GroupMember, ...]] = PrivateAttr(default_factory=dict)
    #: tensor name → ``chunk_cols`` where it is not 0 (design 011 D1); derived like ``_members``.
    _grid: dict[str, int] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        self._grid = {n: c for n, c in zip(self.name, self.chunk_cols) if c} if any(self.chunk_cols) else {}
        out: dict[str, tuple[GroupMember, ...]] = {}
        for g in self.groups or ():
            if not 0 <= g.unit < len(self.name) or not len(g.name) == len(g.shape) == len(g.offset):
                continue  # malformed: _check_layout refuses it before anyone asks for members
            dt = self.dtype[g.unit] if g.unit < len(self.dtype) else ""
            out[self.name[g.unit]] = tuple(GroupMember(n, dt, sh, off) for n, sh, off in zip(g.name, g.shape, g.offset))
        self._members = out
        if out and kernels.untrack is not None:
            # Out of the cyclic collector's sets from the start (as History does with chunk
            # tables, design 006 session 27): a layout of 20,000 members promoted as many
            # objects into the old generation at each Subscriber's first pull, and its cached
            # members were walked by every full pass; CPython never untracks a tuple subclass
            # itself. A member holds two strings, a tuple of ints and an int: no cycle.
            kernels.untrack([m for ms in out.values() for m in ms])

    def members(self) -> dict[str, tuple[GroupMember, ...]]:
        """Group row name → its members (empty for a schema-3 layout)."""
        return self._members

    def grid(self) -> dict[str, int]:
        """Tensor name → its ``chunk_cols`` for every tensor with a column grid (empty when
        none has one)."""
        return self._grid


class SquashManifest(_Model):
    """A squashed delta ``from → to`` (SPEC §12), in memory in the same shape as a Manifest:
    ``tensors`` lists only the chunks that changed in (from, to], each with one ``delta``
    segment (from its state at ``from`` to its state at ``to``) and its digest at ``to``."""

    format: Literal["deltastore.squash"] = "deltastore.squash"
    schema_: int = Field(3, alias="schema")
    from_: int = Field(ge=1, alias="from")
    to: int = Field(ge=2)
    from_manifest: StoreKey
    to_manifest: StoreKey
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
    """Canonical JSON bytes (sorted keys, no whitespace) so equal documents hash equally."""
    doc = model.model_dump(mode="json", by_alias=True)
    if "groups" in doc and doc["groups"] is None:  # a schema-3 layout has no groups field
        doc.pop("groups")
    if "base" in doc and doc["base"] is None:  # only based versions carry it (design 009)
        doc.pop("base")
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

_MANIFEST_KEY = re.compile(r"manifests/([0-9]{12,19})-([0-9a-f]{64})\.json\.zst")
#: The key of a plain-JSON manifest of schema 1 or 2: recognised only to be refused as an
#: earlier format (UnsupportedSchemaError), not as a damaged key.
_EARLIER_MANIFEST_KEY = re.compile(r"manifests/[0-9]{12,19}-[0-9a-f]{64}\.json")
#: A pack key: ``objects/<attempt>/<sha256>.pack``.
_PACK_KEY = re.compile(r"objects/[0-9a-f]{32}/([0-9a-f]{64})\.pack")


def manifest_key_version(key: str) -> int | None:
    """The version a manifest key names (``manifests/<version:012d>-<sha256>.json.zst``), or
    None when ``key`` is not a manifest key."""
    match = _MANIFEST_KEY.fullmatch(key)
    return None if match is None else int(match.group(1))


def chunk_count(shape: tuple[int, ...], chunk_rows: int, chunk_cols: int = 0) -> int:
    """Chunks of a tensor (SPEC §2): ``ceil(shape[0] / chunk_rows)``, at least one (0-d and
    empty tensors are one chunk); with a column grid (``chunk_cols`` > 0, design 011 D1) that
    many row blocks times ``ceil(shape[1] / chunk_cols)`` column blocks (at least one). A grid
    needs a second dimension (the layout check refuses one without): here it is ignored."""
    if not shape:
        return 1
    rows = max(1, -(-shape[0] // chunk_rows))
    if chunk_cols and len(shape) >= 2:
        return rows * max(1, -(-shape[1] // chunk_cols))
    return rows


def chunk_elements(shape: tuple[int, ...], chunk_rows: int, index: int, chunk_cols: int = 0) -> int:
    """Elements in chunk ``index`` (the last chunk may be short); with a column grid, chunk
    ``index = i·nc + j`` holds row block i × column block j (the last of either may be short)."""
    if not shape:
        return 1
    if chunk_cols and len(shape) >= 2:
        nc = max(1, -(-shape[1] // chunk_cols))
        index, j = divmod(index, nc)
        inner = 1
        for d in shape[2:]:
            inner *= d
        row_elems = max(0, min(chunk_cols, shape[1] - j * chunk_cols)) * inner
    else:
        row_elems = 1
        for d in shape[1:]:
            row_elems *= d
    rows = max(0, min(chunk_rows, shape[0] - index * chunk_rows))
    return rows * row_elems


def _load(data: bytes, what: str, key: str, max_bytes: int) -> dict[str, Any]:
    """A plain-JSON object's document (HEAD), size, schema and depth checked."""
    if len(data) > max_bytes:
        raise CorruptObjectError(
            f"{what} {key!r} is {len(data)} bytes, over the {max_bytes}-byte limit: not a deltastore {what}"
        )
    doc = _json_document(data, what, key)
    _check_depth(doc, what, key)
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
    return UnsupportedSchemaError(f"{what} {key!r} has schema {schema!r}; this deltastore reads schema {reads}: "
                                  "upgrade deltastore")


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


def _validate(cls: type[BaseModel], doc: dict[str, Any], what: str, key: str, at: tuple[str | int, ...] = ()) -> Any:
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


def _check_int(value: int | None, field: str, what: str, key: str, *, low: int = 0) -> None:
    if value is not None and not low <= value < INT_LIMIT:
        raise CorruptObjectError(f"{what} {key!r}: {field} = {value} is outside [{low}, 2**63)")


def parse_head(data: bytes, key: str = HEAD_KEY) -> Head:
    """Parse HEAD bytes. Raises CorruptObjectError / UnsupportedSchemaError."""
    doc = _load(data, "HEAD", key, MAX_HEAD_BYTES)
    if doc["schema"] != HEAD_SCHEMA:  # schema 4 changed layouts and manifests, not HEAD
        raise unsupported_schema("HEAD", key, doc["schema"], (HEAD_SCHEMA,))
    head: Head = _validate(Head, doc, "HEAD", key)
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


def parse_manifest(
    data: bytes,
    key: str,
    expected_sha256: str | None = None,
    *,
    layout: Layout | Callable[[ObjectRef], Layout] | None = None,
    max_bytes: int = MAX_MANIFEST_BYTES,
    parts: Callable[[PartRef], bytes] | None = None,
) -> Manifest:
    """Verify a manifest's bytes against its content address (and HEAD's record), then parse it.

    Args:
        data: the manifest's bytes.
        key: the key it was read from (``manifests/<version:012d>-<sha256>.json.zst``).
        expected_sha256: the digest HEAD recorded for it, if read through HEAD.
        layout: the manifest's layout object, or a function that fetches it given the
            manifest's ``layout`` reference (the caller verifies the layout's bytes against
            that reference). The returned Manifest has its tensors rebuilt from it.
        max_bytes: refuse a larger object (stored or decompressed) before parsing it.
        parts: a sharded version only (required there): returns a part manifest's bytes,
            which are verified here against the version's reference (SPEC §8).

    Raises:
        IntegrityError: the bytes do not hash to the key's digest or to ``expected_sha256``.
        CorruptObjectError: not a well-formed manifest, inconsistent with itself (SPEC §3), or
            filed under another version's key.
        UnsupportedSchemaError: a schema this deltastore does not read (a newer one, or the
            plain-JSON manifests of schemas 1 and 2), or a sharded layout it does not read
            (pieces off chunk boundaries).
        ValueError: no ``layout`` (a sharded version without ``parts``).
    """
    _check_digest(data, key, expected_sha256, "manifest")
    key_version = manifest_key_version(key)
    if key_version is None:
        if _EARLIER_MANIFEST_KEY.fullmatch(key):
            raise UnsupportedSchemaError(f"manifest {key!r} is a plain-JSON manifest of schema 1 or 2, an earlier format "
                                         "this deltastore does not read: publish the model to a new store")
        raise CorruptObjectError(f"{key!r} is not a manifest key (manifests/<version:012d>-<sha256>.json.zst)")
    doc = _load3(data, "manifest", key, max_bytes)
    if layout is None:
        raise ValueError(f"manifest {key!r}: parse_manifest needs its layout")
    if callable(layout):
        layout = layout(_layout_ref(doc, key))  # its key checked before it is looked up
    manifest = _manifest_from_doc(doc, layout, key, parts)
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
    if m.parent_manifest is not None and m.parent is not None:
        _check_link(m.parent_manifest, m.parent, "parent_manifest", key, bad)
    if m.kind == "anchor" and m.anchor != m.version:
        raise bad("an anchor's 'anchor' must be its own version")
    if m.base is not None:
        _check_based(m, bad)
    elif m.kind == "delta" and (m.parent is None or m.anchor >= m.version or m.delta_base != m.parent):
        raise bad("a delta needs a parent, an earlier anchor, and delta_base equal to its parent")
    if m.delta_base is not None and m.delta_base != m.parent:
        raise bad("delta_base must be the parent version or null")
    for i, b in enumerate(m.blobs):
        _check_int(b.size, f"blobs[{i}].size", "manifest", key)
        match = _PACK_KEY.fullmatch(b.key)
        if match is None or match.group(1) != b.sha256 or b.role not in ("f", "d"):
            raise bad(f"pack {i} has key {b.key!r} and role {b.role!r}: not objects/<attempt>/{b.sha256}.pack with a role")
    _check_links(m, key, bad)
    names: set[str] = set()
    anchor, is_delta = m.kind == "anchor", m.kind == "delta"
    no_delta_base = m.delta_base is None and m.base is None
    blob_roles = [b.role for b in m.blobs]
    blob_sizes = [b.size for b in m.blobs]
    grid = m._grid  # column grids (design 011 D1): empty unless the layout has one
    for t in m.tensors:
        if t.name in names:
            raise bad(f"tensor {t.name!r} is listed twice")
        names.add(t.name)
        if t.dtype not in DTYPE_WIDTHS:
            raise bad(f"tensor {t.name!r} has dtype {t.dtype!r}, which deltastore does not store")
        shape = t.shape
        if len(shape) > MAX_NDIM or (shape and (min(shape) < 0 or max(shape) >= INT_LIMIT)):
            raise bad(f"tensor {t.name!r} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
        rows = shape[0] if shape else 1
        row_elems = 1
        for d in shape[1:]:
            row_elems *= d
        if rows * row_elems * DTYPE_WIDTHS[t.dtype] >= INT_LIMIT:
            raise bad(f"tensor {t.name!r} of shape {list(shape)} has more than 2**63 bytes")
        chunk_rows = t.chunk_rows
        if chunk_rows is not None and not 1 <= chunk_rows < INT_LIMIT:
            _check_int(chunk_rows, f"tensor {t.name!r} chunk_rows", "manifest", key, low=1)
        cols = grid.get(t.name, 0) if grid else 0
        n_chunks = chunk_count(shape, chunk_rows, cols)
        seen: set[int] = set()
        for c in t.chunks:
            # (messages are formatted only on failure: this loop runs per chunk of every parse)
            index, full, delta = c.index, c.full, c.delta
            if not 0 <= index < n_chunks:
                raise bad(f"chunk {t.name}[{index}] is out of range: tensor {t.name!r} {list(shape)} has {n_chunks} chunk(s) "
                          f"of {chunk_rows} rows" + (f" × {cols} columns" if cols else ""))
            if index in seen:
                raise bad(f"chunk {t.name}[{index}] is listed twice")
            seen.add(index)
            if anchor and full is None:
                raise bad(f"anchor chunk {t.name}[{index}] has no full segment")
            if delta is None:
                if is_delta:
                    raise bad(f"delta chunk {t.name}[{index}] has no delta segment")
            elif no_delta_base:
                raise bad(f"chunk {t.name}[{index}] has a delta segment but the manifest has no delta_base")
            if cols or not shape:
                elements = chunk_elements(shape, chunk_rows, index, cols)
            else:  # chunk_elements without a grid, inline
                elements = rows - index * chunk_rows
                elements = (chunk_rows if elements > chunk_rows else elements if elements > 0 else 0) * row_elems
            if full is not None:
                _check_segment(m, full, "full", t.name, index, elements, blob_roles, blob_sizes, bad)
            if delta is not None:
                _check_segment(m, delta, "delta", t.name, index, elements, blob_roles, blob_sizes, bad)
        if m.kind == "anchor" and len(seen) != n_chunks:
            raise bad(f"anchor lists {len(seen)} of the {n_chunks} chunks of tensor {t.name!r}")


def _check_segment(m: Manifest, seg: SegmentRef, which: str, name: str, index: int, elements: int,
                   blob_roles: list[str | None], blob_sizes: list[int], bad: Callable[[str], CorruptObjectError]) -> None:
    """The rules of SPEC §3 for one segment ref of chunk ``name[index]`` (``which``: full or delta)."""
    blob = seg.blob
    if blob >= len(blob_sizes):
        raise bad(f"chunk {name}[{index}] {which} names blob {blob} of {len(blob_sizes)}")
    role = blob_roles[blob]
    if role is not None and role != which[0]:
        raise bad(f"chunk {name}[{index}] {which} segment lies in pack {blob} of role {role!r}")
    if seg.offset + seg.length > blob_sizes[blob]:
        raise bad(f"chunk {name}[{index}] {which} runs past the end of {m.blobs[blob].key!r}")
    if seg.n_changed > elements:
        raise bad(f"chunk {name}[{index}] {which} changes {seg.n_changed} elements of {elements}")


def _check_based(m: Manifest, bad: Callable[[str], CorruptObjectError]) -> None:
    """A based version (SPEC §14): a delta of another store's version, starting its own chain.

    Its chunks' delta segments apply to the base's chunks, never to its parent's; so it is its
    own anchor and chain start, with no anchor manifest, no delta_base and no full segment."""
    b = m.base
    assert b is not None
    if m.kind != "delta" or m.delta_base is not None or m.anchor != m.version:
        raise bad("a based version is a delta with delta_base null and 'anchor' its own version")
    if m.anchor_manifest is not None or m.chain_start != m.version:
        raise bad("a based version has no anchor_manifest and starts its own chain (chain_start = version)")
    _check_int(b.version, "base.version", "manifest", "")
    if manifest_key_version(b.manifest) != b.version or not b.manifest.endswith(f"-{b.sha256}.json.zst"):
        raise bad(f"base.manifest {b.manifest!r} is not the schema-3/4 manifest key of version {b.version} "
                  f"with SHA-256 {b.sha256}")
    for t in m.tensors:
        for c in t.chunks:
            if c.full is not None or c.delta is None:
                raise bad(f"based chunk {t.name}[{c.index}] must have a delta segment and no full segment")


#: Skip pointers of one manifest: versions v−2, …, v−2^62 cover every version below 2**63.
MAX_BACK = 62


def _check_link(link: str, version: int, field: str, key: str, bad: Callable[[str], CorruptObjectError]) -> None:
    """``link`` (field ``field`` of manifest ``key``) is the manifest key of ``version``; the
    key of a plain-JSON manifest (schemas 1 and 2) is refused as an earlier format."""
    if manifest_key_version(link) == version:
        return
    if _EARLIER_MANIFEST_KEY.fullmatch(link):
        raise UnsupportedSchemaError(f"manifest {key!r}: {field} {link!r} names a plain-JSON manifest of schema 1 or 2, "
                                     "an earlier format this deltastore does not read: publish the model to a new store")
    raise bad(f"{field} {link!r} is not the manifest key of version {version}")


def _check_links(m: Manifest, key: str, bad: Callable[[str], CorruptObjectError]) -> None:
    """Header fields that name other versions say which version they name (SPEC §3)."""
    if m.layout is None:
        raise bad("a manifest needs a layout")
    if m.kind == "anchor" and m.anchor_manifest is not None:
        raise bad("an anchor has no anchor_manifest")
    if m.kind == "delta" and m.base is None:
        if m.anchor_manifest is None:
            raise bad(f"a delta needs anchor_manifest, the manifest key of version {m.anchor}")
        _check_link(m.anchor_manifest, m.anchor, "anchor_manifest", key, bad)
    if len(m.back) > MAX_BACK:
        raise bad(f"back lists {len(m.back)} keys, more than {MAX_BACK}")
    for j, k in enumerate(m.back, start=1):
        _check_link(k, m.version - 2**j, f"back[{j - 1}]", key, bad)
    if m.chain_start is not None and (
        not 1 <= m.chain_start <= m.version or (m.delta_base is None and m.chain_start != m.version)
    ):
        raise bad(f"chain_start {m.chain_start} is not the latest version ≤ {m.version} with a null delta_base")
    if m.max_attempt_s is not None and not 1 <= m.max_attempt_s < INT_LIMIT:
        raise bad(f"max_attempt_s = {m.max_attempt_s} is not a positive number of seconds")


# --- schema-3 objects: the seam the writer, GC and compactor use --------------------------------
# The bytes of a schema-3 object are produced and read only through these functions (design 005
# D8): one zstd frame, content size in its header, of canonical JSON; a manifest's chunk table is
# columnar and names tensors by their position in the layout object.

#: Formats of the schema-3 objects other than manifests, by model class.
_OBJECT_WHAT = {Index: "history index", Layout: "layout", SquashManifest: "squash manifest"}
#: zstd level of every schema-3 object: level 19 saves ~3 % more and costs 44 ms per 31 KB
#: (design 005 D8), seconds for an anchor of 10⁵ chunks.
ZSTD_LEVEL = 3
#: Hex digits per chunk row of ``chunks.digest`` (XXH3-128) and per segment row of
#: ``segments.sha256`` (SHA-256).
DIGEST_HEX = 32
SHA256_HEX = 64
_HEX = re.compile(r"[0-9a-f]*")
#: The message of every refusal of a sharded version (parts, pieces, chunk grid: issue 12).
SHARDED_UNSUPPORTED = "sharded versions are read from a later release"
SHARDED_UNALIGNED = "pieces that do not start on a chunk boundary are read from a later release"


def layout_of(tensors: Sequence[TensorEntry] | Mapping[str, Any], *, schema: int = 3) -> Layout:
    """The (unsharded) layout of ``tensors``, in their order: TensorEntry objects, or a mapping
    of name to anything with ``name``, ``dtype``, ``shape`` and ``chunk_rows`` (TensorSpec),
    and ``chunk_cols`` where it has a column grid (a TensorSpec, design 011; else 0).

    ``schema`` 4 writes the ``groups`` record of every item with ``members`` (a TensorSpec of
    a group row, design 007); schema 3 refuses such items (ValueError)."""
    items = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    n = len(items)
    groups = [
        GroupRecord(unit=i, name=tuple(m.name for m in t.members), shape=tuple(tuple(m.shape) for m in t.members),
                    offset=tuple(m.offset for m in t.members))
        for i, t in enumerate(items) if getattr(t, "members", ())
    ]
    if schema < GROUPS_SCHEMA and groups:
        raise ValueError(f"a schema-{schema} layout cannot hold groups (schema {GROUPS_SCHEMA} does)")
    return Layout(
        schema=schema,
        groups=tuple(groups) if schema >= GROUPS_SCHEMA else None,
        name=tuple(t.name for t in items),
        dtype=tuple(t.dtype for t in items),
        shape=tuple(tuple(t.shape) for t in items),
        chunk_rows=tuple(t.chunk_rows for t in items),
        chunk_cols=tuple(getattr(t, "chunk_cols", 0) for t in items),
        pieces=(None,) * n,
        piece_parts=(None,) * n,
        parts=0,
    )


def _zstd(doc: bytes) -> bytes:
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


def _load3(data: bytes, what: str, key: str, max_bytes: int) -> dict[str, Any]:
    """An object's JSON document (decompressed, parsed, schema and depth checked)."""
    doc = _json_document(_unzstd(data, what, key, max_bytes), what, key)
    allowed = _ZST_SCHEMAS.get(what, (3,))
    if doc["schema"] not in allowed:
        raise unsupported_schema(what, key, doc["schema"], allowed)
    _check_depth(doc, what, key)
    return doc


def _check_groups(layout: Layout, what: str, key: str) -> None:
    """Schema 4's group records (design 007 D6): each names one 1-D row, once; its members
    tile the row in order (no overlap, no gap, nothing past the end); every name is unique
    across rows and members. After this, gather and scatter stay in range."""
    if layout.schema_ not in (3, GROUPS_SCHEMA):
        raise CorruptObjectError(f"{what} {key!r} has schema {layout.schema_}: layouts are schema 3 or 4")
    if (layout.groups is None) != (layout.schema_ == 3):
        raise CorruptObjectError(f"{what} {key!r}: a schema-{layout.schema_} layout "
                                 f"{'has no' if layout.schema_ == 3 else 'needs a'} groups record")
    n = len(layout.name)
    names = set(layout.name)
    units: set[int] = set()
    for gi, g in enumerate(layout.groups or ()):
        def bad(msg: str, gi: int = gi, g: GroupRecord = g) -> CorruptObjectError:
            row = layout.name[g.unit] if 0 <= g.unit < n else g.unit
            return CorruptObjectError(f"{what} {key!r}: group record {gi} (row {row!r}) {msg}")

        if not 0 <= g.unit < n:
            raise bad(f"names row {g.unit}; the layout has {n}")
        if g.unit in units:
            raise bad("names a row another group record names")
        units.add(g.unit)
        k = len(g.name)
        if k == 0 or len(g.shape) != k or len(g.offset) != k:
            raise bad(f"has {k} names, {len(g.shape)} shapes and {len(g.offset)} offsets (non-empty, all equal)")
        row_shape = layout.shape[g.unit]
        if len(row_shape) != 1:
            raise bad(f"has shape {list(row_shape)[:MAX_NDIM + 1]}: a group row is 1-D")
        total, pos = row_shape[0], 0
        for i in range(k):
            shape, name = g.shape[i], g.name[i]
            if len(shape) > MAX_NDIM or any(not 0 <= d < INT_LIMIT for d in shape):
                raise bad(f"member {name!r} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
            count = 1
            for d in shape:
                count *= d
            if g.offset[i] != pos:
                raise bad(f"member {name!r} starts at element {g.offset[i]}, not {pos}: members tile the group "
                          "in order, without overlap or gap")
            pos += count
            if pos > total:
                raise bad(f"member {name!r} ends at element {pos}, past the group's {total}")
            if not name or name in names:
                raise bad(f"member name {name!r} is empty or also names another row or member")
            names.add(name)
        if pos != total:
            raise bad(f"members end at element {pos}, but the group has {total}")


#: Layout objects that passed :func:`_check_layout`, while they live (by identity; History
#: caches layouts, and every manifest of an anchor span is parsed against the same object):
#: re-checking 20,000 rows per manifest parse was ~0.2 s (design 007).
_CHECKED_LAYOUTS: IdentityCache[bool] = IdentityCache()


def _check_layout(layout: Layout, what: str, key: str) -> None:
    """A layout's columns agree, and describe tensors a reader can allocate; sharded layouts
    are refused (UnsupportedSchemaError); schema 4's groups are checked (design 007 D6)."""
    if _CHECKED_LAYOUTS.get(layout):  # the same (immutable) object passed before
        return
    _check_layout_once(layout, what, key)
    _CHECKED_LAYOUTS.put(layout, True)


def _check_layout_once(layout: Layout, what: str, key: str) -> None:
    n = len(layout.name)
    columns = (layout.dtype, layout.shape, layout.chunk_rows, layout.chunk_cols, layout.pieces, layout.piece_parts)
    if any(len(c) != n for c in columns):
        raise CorruptObjectError(f"{what} {key!r}: the layout's columns have different lengths")
    if len(set(layout.name)) != n:
        raise CorruptObjectError(f"{what} {key!r}: the layout lists a tensor name twice")
    for i in range(n):
        where = f"{what} {key!r}: tensor {layout.name[i]!r}"
        if layout.dtype[i] not in DTYPE_WIDTHS:
            raise CorruptObjectError(f"{where} has dtype {layout.dtype[i]!r}, which deltastore does not store")
        shape = layout.shape[i]
        if len(shape) > MAX_NDIM or any(not 0 <= d < INT_LIMIT for d in shape):
            raise CorruptObjectError(f"{where} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
        if not 1 <= layout.chunk_rows[i] < INT_LIMIT:
            raise CorruptObjectError(f"{where} has chunk_rows {layout.chunk_rows[i]}")
        if layout.chunk_cols[i]:
            _check_grid(layout, i, where)
    _check_pieces(layout, what, key)
    _check_groups(layout, what, key)


def _check_grid(layout: Layout, i: int, where: str) -> None:
    """Row ``i``'s column grid (SPEC §3.2, design 011 D7): ``chunk_cols`` in ``[1, shape[1]]``
    of a tensor with a second dimension, never a group row. Then every chunk index, count and
    block follows by arithmetic (chunk_count, chunk_elements, TensorSpec.chunk_block)."""
    k, shape = layout.chunk_cols[i], layout.shape[i]
    if type(k) is not int or not 0 < k < INT_LIMIT:
        raise CorruptObjectError(f"{where} has chunk_cols {k!r}")
    if len(shape) < 2 or any(g.unit == i for g in layout.groups or ()):
        raise CorruptObjectError(f"{where} {list(shape)[:MAX_NDIM + 1]} has chunk_cols {k}: a grid needs a second "
                                 "dimension (and a group row has none)")
    if k > shape[1]:
        raise CorruptObjectError(f"{where} {list(shape)} has chunk_cols {k}, more than its {shape[1]} columns")


def _check_pieces(layout: Layout, what: str, key: str) -> None:
    """Pieces of a sharded layout (SPEC §2 *Pieces*, §8): ``parts`` = 0 is unsharded (no pieces);
    otherwise every row has its inner boundaries (strictly increasing, inside the first
    dimension) and one part in ``[0, parts)`` per piece. This release reads boundaries that are
    multiples of the row's ``chunk_rows`` (chunking restarting at each piece is then the
    unsharded chunking) and refuses others (UnsupportedSchemaError)."""
    if not 0 <= layout.parts < INT_LIMIT:
        raise CorruptObjectError(f"{what} {key!r} has parts = {layout.parts}")
    if layout.parts == 0:
        if any(p is not None for p in (*layout.pieces, *layout.piece_parts)):
            raise CorruptObjectError(f"{what} {key!r}: an unsharded layout (parts 0) has pieces")
        return
    for i in range(len(layout.name)):
        where = f"{what} {key!r}: tensor {layout.name[i]!r}"
        bounds, owners = layout.pieces[i], layout.piece_parts[i]
        if bounds is None or owners is None or len(owners) != len(bounds) + 1:
            raise CorruptObjectError(f"{where} needs pieces and one part per piece in a sharded layout")
        shape, rows = layout.shape[i], layout.chunk_rows[i]
        previous = 0
        for b in bounds:
            if not shape or not previous < b < shape[0]:
                raise CorruptObjectError(f"{where} {list(shape)} has piece boundaries {list(bounds)[:8]}: not strictly "
                                         "increasing inside its first dimension")
            if b % rows:
                raise UnsupportedSchemaError(f"{where} has a piece boundary at row {b}, not a multiple of its "
                                             f"chunk_rows {rows}: {SHARDED_UNALIGNED}")
            previous = b
        if any(not 0 <= p < layout.parts for p in owners):
            raise CorruptObjectError(f"{where} names parts {list(owners)[:8]} of {layout.parts}")
        if layout.groups and any(g.unit == i for g in layout.groups) and bounds:
            raise CorruptObjectError(f"{where} is a group row split into pieces: a group row is one piece")


def piece_part(layout: Layout, tensor: int, chunk: int) -> int:
    """The part that writes chunk ``chunk`` of layout row ``tensor`` (a sharded layout:
    pieces aligned to chunk rows, as :func:`_check_pieces` requires). The chunk's first row is
    its row block's, ``(chunk // nc) · chunk_rows`` with ``nc`` column blocks (design 011 D11:
    every column block of a row block lies in the piece holding its rows)."""
    bounds, owners = layout.pieces[tensor] or (), layout.piece_parts[tensor] or (0,)
    return owners[bisect.bisect_right(bounds, row_block(layout, tensor, chunk) * layout.chunk_rows[tensor])]


def row_block(layout: Layout, tensor: int, chunk: int) -> int:
    """The row block of chunk ``chunk`` of layout row ``tensor``: ``chunk // nc`` with a column
    grid of ``nc`` column blocks (SPEC §2: chunk ``(i, j)`` has index ``i·nc + j``), else the
    chunk itself."""
    k, shape = layout.chunk_cols[tensor], layout.shape[tensor]
    if not k or len(shape) < 2:
        return chunk
    return chunk // max(1, -(-shape[1] // k))


def _manifest_doc(m: Manifest, layout: Layout) -> dict[str, Any]:
    """The schema-3 JSON document of ``m`` (design 005 D8), before compression. A sharded
    version's document lists its ``parts`` and has empty tables (its parts hold them)."""
    doc = m.model_dump(mode="json", by_alias=True, exclude={"blobs", "tensors", "parts"})
    if doc.get("base") is None:  # only based versions carry it (design 009)
        doc.pop("base", None)
    if m.parts:
        doc.update(_tables_doc((), (), layout, m.version))
        doc["parts"] = [p.model_dump(mode="json", by_alias=True) for p in m.parts]
        return doc
    doc.update(_tables_doc(m.tensors, m.blobs, layout, m.version))
    doc["parts"] = []
    return doc


def _tables_doc(tensors: Sequence[TensorEntry], blobs: Sequence[BlobRef], layout: Layout, version: int) -> dict[str, Any]:
    """The columnar ``codecs``, ``packs``, ``chunks`` and ``segments`` of ``tensors`` (a
    manifest's or a part's), naming tensors by their position in ``layout``."""
    index = {name: i for i, name in enumerate(layout.name)}
    tensor_col: list[int] = []
    chunk_col: list[int] = []
    digests: list[str] = []
    segs: list[tuple[int, int, int, str, SegmentRef]] = []
    l_dtype, l_shape, l_chunk_rows = layout.dtype, layout.shape, layout.chunk_rows
    for t in tensors:
        ti = index.get(t.name)
        if ti is None:
            raise ValueError(f"manifest of version {version}: tensor {t.name!r} is not in its layout")
        if l_dtype[ti] != t.dtype or l_shape[ti] != tuple(t.shape) or l_chunk_rows[ti] != t.chunk_rows:
            raise ValueError(f"manifest of version {version}: tensor {t.name!r} differs from its layout")
        for c in t.chunks:  # (this loop runs per chunk of every version written)
            row = len(digests)
            tensor_col.append(ti)
            chunk_col.append(c.index)
            digests.append(c.digest)
            delta, full = c.delta, c.full
            if delta is not None:
                segs.append((delta.blob, delta.offset, row, "d", delta))
            if full is not None:
                segs.append((full.blob, full.offset, row, "f", full))
    segs.sort(key=_storage_order)  # storage order: pack by pack, ascending offset
    refs = [s[4] for s in segs]
    codecs = sorted({r.codec for r in refs})
    codec_index = {c: i for i, c in enumerate(codecs)}
    return {
        "codecs": codecs,
        "packs": [{"key": b.key, "size": b.size, "sha256": b.sha256, "role": b.role} for b in blobs],
        "chunks": {"tensor": tensor_col, "chunk": chunk_col, "digest": "".join(digests)},
        "segments": {
            "row": [s[2] for s in segs],
            "role": "".join([s[3] for s in segs]),
            "codec": [codec_index[r.codec] for r in refs],
            "length": [r.length for r in refs],
            "n_changed": [r.n_changed for r in refs],
            "sha256": "".join([r.sha256 for r in refs]),
        },
    }


#: A segment's place in storage order (pack, offset), for sorting ``_tables_doc``'s segments.
_storage_order = operator.itemgetter(0, 1)


class _Pack(_Model):
    key: StoreKey
    size: int = Field(ge=1)  # writers never write an empty pack: segments fill packs unambiguously
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Literal["f", "d"]


class _ChunkTable(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    tensor: list[int]
    chunk: list[int]
    digest: str


class _SegmentTable(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    row: list[int]
    role: str
    codec: list[int]
    length: list[int]
    n_changed: list[int]
    sha256: str


class _Tables(_Model):
    """The schema-3 fields that replace ``blobs``, ``tensors`` and ``parts``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    codecs: list[str]
    packs: list[_Pack]
    chunks: _ChunkTable
    segments: _SegmentTable
    parts: list[Any]


def _hex_column(text: str, n: int, width: int, name: str, bad: Callable[[str], CorruptObjectError]) -> list[str]:
    if len(text) != n * width or not _HEX.fullmatch(text):
        raise bad(f"{name} is not {n} × {width} lowercase hex digits")
    return [text[i * width:(i + 1) * width] for i in range(n)]


#: The format of a part manifest (SPEC §3.2, §8).
PART_FORMAT = "deltastore.part"
#: A part manifest's key: ``objects/<attempt>/<part:05d>-<sha256>.part.json.zst``.
_PART_KEY = re.compile(r"objects/([0-9a-f]{32})/([0-9]{5,19})-([0-9a-f]{64})\.part\.json\.zst")
#: The header fields of a part manifest besides its tables.
_PART_FIELDS = ("format", "schema", "version", "part", "commit_id", "lineage", "layout", "stats")

#: A chunk row: the tensor's position in the layout, then the fields of the row's ChunkEntry in
#: their order (index, digest, full, delta: the row's segment of each role, or None).
_Row = tuple[int, int, str, "SegmentRef | None", "SegmentRef | None"]


def part_key(attempt: str, part: int, digest: str) -> str:
    """``objects/<attempt>/<part:05d>-<sha256>.part.json.zst`` (SPEC §1)."""
    return f"{OBJECT_PREFIX}{attempt}/{part:05d}-{digest}.part.json.zst"


def _manifest_from_doc(doc: dict[str, Any], layout: Layout, key: str,
                       parts: Callable[[PartRef], bytes] | None = None) -> Manifest:
    """The in-memory Manifest of a schema-3 document: ``blobs`` are its packs, ``tensors`` its
    chunk table rebuilt from ``layout`` (layout order, only tensors with listed chunks, chunks
    in index order: the shape a schema-2 manifest of the same version has).

    A sharded version (non-empty ``parts``) is read with ``parts``, which returns a part
    manifest's bytes: its ``blobs`` are every part's packs in part order, its ``tensors`` the
    union of their chunk tables (SPEC §8)."""
    header, rows = _decode_tables(doc, layout, key, parts)
    # Entries are built without validation (issue 9: parsing 20,000 entries through pydantic
    # dominated a pull): the columnar checks of _table_rows, the layout's and _check_manifest's
    # (which every caller runs next) cover every field pydantic would check.
    tensors = tuple(
        unchecked_entry(TensorEntry, name=name, dtype=dtype, shape=shape, chunk_rows=chunk_rows,
                        chunks=tuple([unchecked_entry(ChunkEntry, index=index, digest=digest, full=full, delta=delta)
                                      for _, index, digest, full, delta in run]))
        for (name, dtype, shape, chunk_rows), run in _row_entries(rows, layout)
    )
    return header.model_copy(update={"tensors": tensors}).with_layout(layout)


#: The fields of a TensorEntry but ``chunks``, in their order.
_TensorFields = tuple[str, str, tuple[int, ...], int]
#: A row's tensor position: the key its runs are grouped by.
_row_tensor = operator.itemgetter(0)


def _row_entries(rows: Sequence[_Row], layout: Layout) -> list[tuple[_TensorFields, list[_Row]]]:
    """The entries chunk rows make: one TensorEntry per run of rows of one layout row, its
    fields ``(name, dtype, shape, chunk_rows)`` from ``layout``, and one ChunkEntry per row of
    the run, its fields the row's after the tensor position (:data:`_Row`).

    The one walk from rows to entries: :func:`_manifest_from_doc` builds entries of these
    fields, :func:`_entries_differ` compares a writer's entries with them."""
    name, dtype, shape, chunk_rows = layout.name, layout.dtype, layout.shape, layout.chunk_rows
    return [((name[ti], dtype[ti], tuple(shape[ti]), chunk_rows[ti]), list(run))
            for ti, run in itertools.groupby(rows, _row_tensor)]


def _decode_tables(doc: dict[str, Any], layout: Layout, key: str,
                   parts: Callable[[PartRef], bytes] | None) -> tuple[Manifest, list[_Row]]:
    """What :func:`_manifest_from_doc` reads of a schema-3 document before it builds entries:
    the validated header as a Manifest (``blobs`` its packs, no ``tensors``) and the chunk rows
    (tensor position, chunk index, digest, segment refs by role) in (tensor, chunk) order, each
    segment placed in the packs by the fill rule. Every check of the columns is made here."""

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {key!r}: {msg}")

    _check_layout(layout, "layout of manifest", key)
    table_fields = ("codecs", "packs", "chunks", "segments", "parts")
    missing = [f for f in table_fields if f not in doc]
    if missing:
        raise bad(f"a schema-3 manifest needs {', '.join(missing)}")
    tables: _Tables = _validate(_Tables, {f: doc[f] for f in table_fields}, "manifest", key)
    inline = [f for f in ("blobs", "tensors") if f in doc]
    if inline:
        raise bad(f"a schema-3 manifest has no {', '.join(inline)} (its chunk table is columnar)")
    header = {k: v for k, v in doc.items() if k not in table_fields}
    if (header.get("schema") == GROUPS_SCHEMA) != (layout.schema_ == GROUPS_SCHEMA):
        raise bad(f"a schema-{header.get('schema')} manifest names a schema-{layout.schema_} layout "
                  f"(schema-{GROUPS_SCHEMA} manifests and layouts go together)")

    if tables.parts:
        refs = [_validate(PartRef, p, "manifest", key, ("parts", i)) if isinstance(p, dict) else None
                for i, p in enumerate(tables.parts)]
        if any(r is None for r in refs):
            raise bad("parts must be objects {part, key, sha256, writer, bytes}")
        rows, packs = _merge_parts(header, tables, [r for r in refs if r is not None], layout, key, parts, bad)
        header["parts"] = [r.model_dump(mode="json", by_alias=True) for r in refs if r is not None]
    else:
        if layout.parts:
            raise bad(f"its layout is sharded ({layout.parts} parts) but the manifest lists no parts")
        rows, packs = _table_rows(tables, layout, bad)
    header["blobs"] = [p.model_dump() for p in packs]
    header["tensors"] = []
    m: Manifest = _validate(Manifest, header, "manifest", key)
    return m, rows


def _merge_parts(header: dict[str, Any], tables: _Tables, refs: list[PartRef], layout: Layout, key: str,
                 fetch: Callable[[PartRef], bytes] | None,
                 bad: Callable[[str], CorruptObjectError]) -> tuple[list[_Row], list[_Pack]]:
    """The chunk rows and packs of a sharded version: every part manifest fetched, verified
    against its reference and checked against the version (SPEC §8), then their tables joined."""
    if tables.packs or tables.codecs or tables.chunks.tensor or tables.segments.row:
        raise bad("a sharded version's own tables must be empty (its parts hold the chunks)")
    if not layout.parts:
        raise bad("a sharded version needs a sharded layout (parts > 0)")
    if fetch is None:
        raise ValueError(f"manifest {key!r} is a sharded version: reading it needs its part manifests")
    if [r.part for r in refs] != list(range(len(refs))) or len(refs) != layout.parts:
        raise bad(f"parts are numbered {[r.part for r in refs][:8]}; a layout of {layout.parts} parts needs 0…{layout.parts - 1} in order")
    commit_id = header.get("commit_id")
    rows: list[_Row] = []
    packs: list[_Pack] = []
    for ref in refs:
        match = _PART_KEY.fullmatch(ref.key)
        if match is None or match.group(1) != commit_id or int(match.group(2)) != ref.part or match.group(3) != ref.sha256:
            raise bad(f"part {ref.part} has key {ref.key!r}: not objects/{commit_id}/{ref.part:05d}-{ref.sha256}.part.json.zst")
        data = fetch(ref)
        _check_digest(data, ref.key, ref.sha256, "part manifest")
        doc = _load3(data, "part manifest", ref.key, MAX_MANIFEST_BYTES)

        def pbad(msg: str, ref: PartRef = ref) -> CorruptObjectError:
            return CorruptObjectError(f"part manifest {ref.key!r} of manifest {key!r}: {msg}")

        table_fields = ("codecs", "packs", "chunks", "segments")
        extra = set(doc) - set(table_fields) - set(_PART_FIELDS)
        missing = [f for f in (*table_fields, *_PART_FIELDS) if f not in doc]
        if missing or extra:
            raise pbad(f"fields missing {missing} or unknown {sorted(extra)[:8]}")
        if doc["format"] != PART_FORMAT:
            raise pbad(f"format {doc['format']!r} is not {PART_FORMAT!r}")
        _validate(ObjectRef, doc["layout"], "part manifest", ref.key, ("layout",))  # a key it names, as every ref's
        for field, want in (("schema", header.get("schema")), ("version", header.get("version")), ("part", ref.part),
                            ("commit_id", commit_id), ("lineage", header.get("lineage")), ("layout", header.get("layout"))):
            if doc[field] != want:
                raise pbad(f"{field} is {str(doc[field])[:100]!r}, but the version says {str(want)[:100]!r}: "
                           "the part belongs to another version, attempt or layout")
        part_tables: _Tables = _validate(_Tables, {**{f: doc[f] for f in table_fields}, "parts": []}, "part manifest", ref.key)
        # the part's pack indices follow the packs of the parts before it
        part_rows, part_packs = _table_rows(part_tables, layout, pbad, first_pack=len(packs))
        for ti, ci, *_ in part_rows:
            owner = piece_part(layout, ti, ci)
            if owner != ref.part:
                raise pbad(f"lists chunk {layout.name[ti]}[{ci}], which lies in a piece of part {owner}")
        rows.extend(part_rows)
        packs.extend(part_packs)
    rows.sort(key=lambda r: (r[0], r[1]))
    for prev, row in itertools.pairwise(rows):
        if (prev[0], prev[1]) == (row[0], row[1]):
            raise bad(f"chunk {layout.name[row[0]]}[{row[1]}] is listed by two parts")
    return rows, packs


_M = TypeVar("_M", bound=BaseModel)

#: Per entry class, the set of all its field names: the fields-set of every entry that
#: :func:`_fast_construct` builds with all of them (never mutated: see there).
_ALL_FIELDS: dict[type[BaseModel], set[str]] = {}


def _fast_construct(cls: type[_M], values: dict[str, Any]) -> _M:
    """``cls.model_construct(**values)`` when ``values`` names every field, at a third of its cost
    (~10 → ~3 µs: no per-field default walk). A manifest's chunk table builds ~3 entries per
    chunk on the read path of every version and in the writer's self-check.

    Entries that name every field share one fields-set per class instead of a set each: a set
    is an object the cyclic collector tracks, and a worker keeps the entries of the manifests
    it caches (design 006, session 27). Sharing it is safe for these frozen models: pydantic
    adds to an instance's set only on assignment (refused when frozen), and ``model_copy``
    copies the set before it adds the updated names."""
    o = object.__new__(cls)
    object.__setattr__(o, "__dict__", values)
    every = _ALL_FIELDS.get(cls)
    if every is None:
        every = _ALL_FIELDS[cls] = set(cls.model_fields)
    object.__setattr__(o, "__pydantic_fields_set__", every if values.keys() == every else set(values))
    object.__setattr__(o, "__pydantic_extra__", None)
    object.__setattr__(o, "__pydantic_private__", None)
    return o


def _construct_is_exact() -> bool:
    """Whether :func:`_fast_construct` builds what ``model_construct`` builds in this pydantic
    (checked once at import; pydantic's instance layout is internal, so another version may
    differ, and then the entries are built by ``model_construct``)."""
    values = {"blob": 0, "offset": 1, "length": 2, "sha256": "0" * 64, "codec": "add-sparse/1", "n_changed": 3}
    try:
        a, b = SegmentRef.model_construct(**values), _fast_construct(SegmentRef, dict(values))
        return (a == b and a.__dict__ == b.__dict__ and a.__pydantic_fields_set__ == b.__pydantic_fields_set__
                and getattr(a, "__pydantic_extra__", None) is None and getattr(a, "__pydantic_private__", None) is None
                and a.model_dump() == b.model_dump() and hash(a) == hash(b) and set(vars(a)) == set(SegmentRef.model_fields))
    except Exception:  # noqa: BLE001 - any difference means: do not use the shortcut
        return False


def _model_construct(cls: type[_M], values: dict[str, Any]) -> _M:
    return cls.model_construct(**values)


def unchecked_entry(cls: type[_M], **values: Any) -> _M:
    """An entry of a chunk table (SegmentRef, ChunkEntry, TensorEntry) built without
    validation: every field given, of its exact type (ints, strs, tuples), by code that vouches
    for it. Two callers do (issue 9: no pydantic per entry on the hot path): the reader, after
    the columnar checks of :func:`_table_rows` and before :func:`_check_manifest`; and the
    encoder, whose entries no reader sees unchecked: :func:`encode_manifest` proves them equal,
    field by field with their types, to what a reader decodes from the bytes, and checks that
    manifest as a reader does (a part manifest is checked so when it is joined)."""
    return _fast_construct(cls, values) if _FAST_CONSTRUCT else cls.model_construct(**values)


def _table_rows(tables: _Tables, layout: Layout, bad: Callable[[str], CorruptObjectError], *,
                first_pack: int = 0) -> tuple[list[_Row], list[_Pack]]:
    """The rows of one columnar chunk table (a manifest's or a part's), with each row's
    segments placed in the packs by the fill rule (SPEC §3), and the packs.

    ``first_pack``: the index the table's first pack has in the joined version (a part's packs
    follow the packs of the parts before it, SPEC §8); the segments name their packs by that
    index, so joining needs no copy of each segment (design 010 D9)."""
    ch, sg = tables.chunks, tables.segments
    n = len(ch.tensor)
    if len(ch.chunk) != n:
        raise bad("chunks.tensor and chunks.chunk have different lengths")
    digests = _hex_column(ch.digest, n, DIGEST_HEX, "chunks.digest", bad)
    n_tensors = len(layout.name)
    previous = (-1, -1)
    # (the loops below run per chunk and segment of every version read and written: columns are
    # walked by zip, not indexed, and messages formatted only on failure)
    for r, here in enumerate(zip(ch.tensor, ch.chunk)):
        ti, ci = here
        if not 0 <= ti < n_tensors:
            raise bad(f"chunk row {r} names tensor {ti}; the layout has {n_tensors}")
        if not 0 <= ci < INT_LIMIT:
            raise bad(f"chunk row {r} has chunk index {ci}")
        if here <= previous:
            raise bad(f"chunk rows are not sorted by (tensor, chunk) and unique at row {r}")
        previous = here

    k = len(sg.row)
    if any(len(c) != k for c in (sg.codec, sg.length, sg.n_changed, sg.role)):
        raise bad("the segment columns have different lengths")
    shas = _hex_column(sg.sha256, k, SHA256_HEX, "segments.sha256", bad)
    codecs = tables.codecs
    n_codecs = len(codecs)
    if len(set(codecs)) != n_codecs:
        raise bad("codecs lists a codec twice")
    # segments fill the packs back to back: offsets and pack indices are implicit
    packs = tables.packs
    n_packs = len(packs)
    sizes = [p.size for p in packs]
    pack_roles = [p.role for p in packs]
    of_role: dict[str, dict[int, SegmentRef]] = {"f": {}, "d": {}}  # role → chunk row → its segment
    construct = _fast_construct if _FAST_CONSTRUCT else _model_construct
    pack, offset = 0, 0
    size, pack_role = (sizes[0], pack_roles[0]) if packs else (0, None)
    for s, (row, role, codec, length, n_changed, sha) in enumerate(zip(sg.row, sg.role, sg.codec, sg.length, sg.n_changed, shas)):
        if not 0 <= row < n:
            raise bad(f"segment {s} names chunk row {row} of {n}")
        segs = of_role.get(role)
        if segs is None:
            raise bad(f"segment {s} has role {role!r}, not 'd' or 'f'")
        if not 0 <= codec < n_codecs:
            raise bad(f"segment {s} names codec {codec} of {n_codecs}")
        if not 0 <= length < INT_LIMIT or not 0 <= n_changed < INT_LIMIT:
            raise bad(f"segment {s} has length {length} and n_changed {n_changed}")
        if pack >= n_packs:
            raise bad(f"segment {s} lies past the last pack: the segment lengths overfill the packs")
        if offset + length > size:
            raise bad(f"segment {s} crosses the end of pack {pack} ({packs[pack].key!r}): the lengths do not fill it exactly")
        if role != pack_role:
            raise bad(f"segment {s} has role {role!r} but lies in pack {pack} of role {pack_role!r}")
        if row in segs:
            raise bad(f"chunk row {row} has two segments of role {role!r}")
        # Built without validation: every field was checked above (issue 9: no pydantic per entry).
        segs[row] = construct(SegmentRef, {"blob": first_pack + pack, "offset": offset, "length": length, "sha256": sha,
                                           "codec": codecs[codec], "n_changed": n_changed})
        offset += length
        if offset == size:
            pack, offset = pack + 1, 0
            if pack < n_packs:
                size, pack_role = sizes[pack], pack_roles[pack]
    if pack != n_packs or offset != 0:
        raise bad(f"the segment lengths do not fill the packs exactly (they end in pack {pack} at offset {offset})")
    full_of, delta_of = of_role["f"].get, of_role["d"].get
    rows = [(ti, ci, digest, full_of(r), delta_of(r))
            for r, (ti, ci, digest) in enumerate(zip(ch.tensor, ch.chunk, digests))]
    return rows, list(packs)


def encode_part(*, schema: int, version: int, part: int, commit_id: str, lineage: str | None, layout_ref: ObjectRef,
                layout: Layout, tensors: Sequence[TensorEntry], blobs: Sequence[BlobRef], stats: Stats) -> bytes:
    """The stored bytes of one part manifest of a sharded version (SPEC §3.2, §8): the
    part's chunk table, columnar as a manifest's, with the header a reader checks against the
    version (``version``, ``part``, ``commit_id``, ``lineage``, ``layout``). Its key is
    :func:`part_key` of the bytes' SHA-256.

    Raises:
        ValueError: a tensor not in ``layout`` or different from it, or a chunk outside the
            pieces of ``part``.
    """
    index = {name: i for i, name in enumerate(layout.name)}
    for t in tensors:
        ti = index.get(t.name)
        for c in t.chunks:
            if ti is not None and layout.parts and piece_part(layout, ti, c.index) != part:
                raise ValueError(f"part {part} of version {version}: chunk {t.name}[{c.index}] lies in another part's piece")
    doc = _tables_doc(tensors, blobs, layout, version)
    doc.update(format=PART_FORMAT, schema=schema, version=version, part=part, commit_id=commit_id, lineage=lineage,
               layout=layout_ref.model_dump(mode="json"), stats=stats.model_dump(mode="json"))
    return _zstd(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def join_parts(header: Manifest, layout: Layout, parts: Mapping[str, bytes]) -> Manifest:
    """The in-memory form of a sharded version (SPEC §8): ``header`` (a manifest with
    ``parts`` and neither ``blobs`` nor ``tensors``) with its parts' tables joined, checked as a
    reader checks them (every part names this version, attempt, lineage and layout; every chunk
    lies in its part's pieces, none twice; the table rules of §3). ``parts`` maps each part
    manifest's key to its bytes. This is the form a signature covers (§3.1).

    Raises:
        CorruptObjectError: a part does not belong to ``header`` or the parts do not form a
            valid chunk table.
        KeyError: a part's bytes are not in ``parts``.
    """
    where = f"<version {header.version} being joined>"
    m = _manifest_from_doc(_manifest_doc(header, layout), layout, where, lambda ref: parts[ref.key])
    _check_manifest(m, where)
    return m


def encode_joined(m: Manifest, layout: Layout, joined: Manifest) -> bytes:
    """The stored bytes of a sharded version that :func:`join_parts` built: ``joined`` as it
    returned it, and ``m`` that or that with a signature added (SPEC §3.1, §8).

    What :func:`encode_manifest` does for a sharded version without joining the parts again:
    its document is the header and part list, which ``join_parts`` decoded with these very
    parts. So the check here is that ``m`` is ``joined`` but for its signature and that the
    header survives JSON as it is (then decoding the bytes returns ``m`` exactly, and its
    signature verifies): O(header), not O(chunks) twice.

    Raises:
        ValueError: ``m`` is not sharded or differs from ``joined`` beyond its signature.
    """
    if not m.parts:
        raise ValueError(f"manifest of version {m.version}: encode_joined stores a sharded version (use encode_manifest)")
    doc = _manifest_doc(m, layout)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    base = doc if m is joined else _manifest_doc(joined, layout)
    same = {k: v for k, v in doc.items() if k != "signature"} == {k: v for k, v in base.items() if k != "signature"}
    if (not same or (m.tensors is not joined.tensors and m.tensors != joined.tensors)
            or (m.blobs is not joined.blobs and m.blobs != joined.blobs) or json.loads(raw) != doc):
        raise ValueError(f"manifest of version {m.version} is not the version join_parts returned (or does not survive "
                         "JSON as it is): decoding its bytes would not return it")
    return _zstd(raw)


def encode_manifest(m: Manifest, layout: Layout | None = None, parts: Mapping[str, bytes] | None = None) -> bytes:
    """The stored bytes of a manifest: one zstd frame of the columnar document of design 005 D8,
    whose chunk table names tensors by their position in ``layout`` (the object ``m.layout``
    refers to).

    A sharded version (``m.parts``; in memory, ``m`` holds the union of its parts' tables) is
    stored as its header and part list; ``parts`` maps each part manifest's key to its bytes,
    and the parts must rebuild exactly ``m``.

    Raises:
        ValueError: ``m`` cannot be stored as it is: a tensor not in ``layout`` or different
            from it, packs that its segments do not fill back to back, or an order that
            decoding would not reproduce (tensors in layout order, chunks by index, packs in
            storage order). Decoding returns ``m`` exactly, so its signature still verifies.

    The bytes are proven to decode to ``m`` before they are returned, without building the
    decoded manifest: the document is parsed back and read by the decoder's own steps up to
    its entries (:func:`_decode_tables`: every column checked as a reader checks it, each
    segment placed in the packs by the fill rule, the header validated); the decoded header
    must dump as ``m``'s, the entries the decoder would build from those rows must equal ``m``'s
    field by field, values with their types (:func:`_entries_differ`), and the reader's
    invariants (:func:`_check_manifest`) must hold for that manifest: it proves what a full
    round trip (build every entry, dump both manifests, compare) proves, at about half the cost
    (docs/design/006-native-kernels.md).
    """
    if layout is None:
        raise ValueError(f"manifest of version {m.version}: a manifest is encoded against its layout")
    doc = _manifest_doc(m, layout)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    where = f"<version {m.version} being encoded>"
    try:
        # The decoder's own steps up to its entries: every column and the header checked as a
        # reader checks them, the segments placed in the packs by the fill rule.
        fetch = None if parts is None else (lambda ref: parts[ref.key])
        header, rows = _decode_tables(json.loads(raw), layout, where, fetch)
        difference = _entries_differ(m.tensors, rows, layout)
        if difference is None and dump(header) != dump(m.model_copy(update={"tensors": ()})):
            difference = "its header does not survive JSON as it is"
        if difference is None:
            # the manifest a reader builds: the decoded header, entries identical to m's
            _check_manifest(header.model_copy(update={"tensors": m.tensors}).with_layout(layout), where)
    except CorruptObjectError as e:
        raise ValueError(f"manifest of version {m.version} cannot be encoded: {e}") from None
    if difference is not None:
        raise ValueError(
            f"manifest of version {m.version} is not in canonical form (tensors in layout order with at least "
            f"one chunk, chunks by index, segments filling packs back to back): decoding would not return it ({difference})"
        )
    return _zstd(raw)


def _entries_differ(tensors: Sequence[TensorEntry], rows: Sequence[_Row], layout: Layout) -> str | None:
    """Where the entries :func:`_manifest_from_doc` builds from ``rows`` would differ from
    ``tensors`` (None: nowhere), compared field by field without building them: both walk the
    rows by :func:`_row_entries`.

    Values are compared with their types (``True == 1`` but dumps as ``true``), so equal here
    means equal in canonical JSON too (:func:`dump`), the test the writer's round trip made
    before (design 006, session 18, task T).
    """
    runs = iter(_row_entries(rows, layout))
    for t in tensors:
        if type(t) is not TensorEntry:
            return f"an entry is a {type(t).__name__}, not a TensorEntry"
        run = next(runs, None)
        if run is None:
            return f"tensor {t.name!r} lists no chunk the table has"
        (name, dtype, shape, chunk_rows), chunks = run
        got_shape, got_chunk_rows = t.shape, t.chunk_rows
        # _exact inline here and below (these loops run per tensor and chunk of every version a
        # writer stores): equal, and of the same types element by element
        if not (t.name == name and t.dtype == dtype and type(got_chunk_rows) is type(chunk_rows)
                and got_chunk_rows == chunk_rows and len(got_shape) == len(shape) and tuple(got_shape) == shape
                and list(map(type, got_shape)) == list(map(type, shape))):
            return f"tensor {t.name!r} is not the table's next tensor, {name!r}"
        if len(t.chunks) != len(chunks):
            return f"tensor {t.name!r} lists {len(t.chunks)} chunks, the table's run of its rows {len(chunks)}"
        for c, (_, index, digest, want_full, want_delta) in zip(t.chunks, chunks):
            if type(c) is not ChunkEntry:
                return f"a chunk of tensor {t.name!r} is a {type(c).__name__}, not a ChunkEntry"
            got_index, got_digest, full, delta = c.index, c.digest, c.full, c.delta
            if not (type(got_index) is type(index) and got_index == index and type(got_digest) is type(digest)
                    and got_digest == digest):
                return f"chunk {t.name}[{got_index}] is not the table's chunk {t.name}[{index}]"
            # the segment is the one the decoder built, field by field with types: the decoder's
            # fields are exact ints and strs, and an int never equals a str
            if full is not None or want_full is not None:
                if (type(full) is not SegmentRef or want_full is None or full.__dict__ != want_full.__dict__
                        or not _INT_STR.issuperset(map(type, full.__dict__.values()))):
                    return f"the full segment of chunk {t.name}[{c.index}] is not where the packs place it"
            if delta is not None or want_delta is not None:
                if (type(delta) is not SegmentRef or want_delta is None or delta.__dict__ != want_delta.__dict__
                        or not _INT_STR.issuperset(map(type, delta.__dict__.values()))):
                    return f"the delta segment of chunk {t.name}[{c.index}] is not where the packs place it"
    return None if next(runs, None) is None else "the table has chunk rows no tensor lists"


_INT_STR = {int, str}


def _exact(a: Any, b: Any) -> bool:
    """Equal and of one type (JSON writes ``True`` and ``1``, ``1.0`` and ``1`` differently)."""
    return type(a) is type(b) and a == b


def manifest_layout_ref(data: bytes, key: str, *, max_bytes: int = MAX_MANIFEST_BYTES) -> ObjectRef:
    """The layout a manifest is read with (its ``layout`` field), read without the layout.

    Raises:
        IntegrityError / CorruptObjectError / UnsupportedSchemaError: as :func:`parse_manifest`.
    """
    _check_digest(data, key, None, "manifest")
    return _layout_ref(_load3(data, "manifest", key, max_bytes), key)


def _layout_ref(doc: dict[str, Any], key: str) -> ObjectRef:
    """The ``layout`` reference of schema-3 manifest document ``doc`` (read from ``key``),
    validated (its key too) before anyone fetches the layout through it."""
    ref = doc.get("layout")
    if not isinstance(ref, dict):
        raise CorruptObjectError(f"manifest {key!r}: a schema-3 manifest needs a layout {{key, sha256}}, not {str(ref)[:100]!r}")
    return _validate(ObjectRef, ref, "manifest", key, ("layout",))


def _check_digest(data: bytes, key: str, expected_sha256: str | None, what: str) -> None:
    actual = sha256_hex(data)
    if actual != digest_from_key(key) or (expected_sha256 is not None and actual != expected_sha256):
        raise IntegrityError(f"{what} {key!r} has SHA-256 {actual}, not the digest its key promises: the object is corrupt")


def encode_object(model: Index | Layout | SquashManifest) -> bytes:
    """The stored bytes of a schema-3 index, layout or squash manifest (its key is
    ``object_key(attempt, sha256_hex(bytes), suffix)``): one zstd frame of canonical JSON."""
    return _zstd(dump(model))


def decode_object(cls: type[Any], data: bytes, key: str, expected_sha256: str | None = None) -> Any:
    """Verify ``data`` against the digest ``key`` promises (and ``expected_sha256``), then parse
    it as ``cls`` (Index, Layout or SquashManifest).

    Raises:
        IntegrityError: the bytes do not hash to the key's digest.
        CorruptObjectError: not a well-formed object of that kind.
        UnsupportedSchemaError: a schema this deltastore does not read, or a sharded layout.
    """
    what = _OBJECT_WHAT[cls]
    _check_digest(data, key, expected_sha256, what)
    doc = _load3(data, what, key, MAX_MANIFEST_BYTES)
    obj = _validate(cls, doc, what, key)
    if isinstance(obj, Layout):
        _check_layout(obj, what, key)
    return obj


_FAST_CONSTRUCT = _construct_is_exact()
