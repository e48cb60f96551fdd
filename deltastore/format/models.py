"""The format's objects as pydantic models (docs/SPEC.md §2–4, §11–12, §14): HEAD, manifests
and their chunk tables in memory, layouts, the history index, squash manifests, and the
geometry of chunks.

The models are frozen; :func:`dump` is their canonical JSON (sorted keys, no whitespace), the
bytes HEAD is stored as and the form a manifest's signature covers. Reading them from stored
bytes, with every check, is :mod:`deltastore.format.parse` (HEAD),
:mod:`deltastore.format.manifest` and :mod:`deltastore.format.objects`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from deltastore._util import kernels
from deltastore.format.keys import LINEAGE_PATTERN, StoreKey

#: The schema of the objects writers write (SPEC §13): schema 3, or 4 (:data:`GROUPS_SCHEMA`,
#: :data:`BASE_SCHEMA`) for a layout with group rows, a manifest that uses one, and a based version.
SCHEMA_VERSION = 3
#: Schemas readers accept (SPEC §13); any other is refused with UnsupportedSchemaError.
READABLE_SCHEMAS = (3, 4, 5)
#: The schema of a grouped layout and of the manifests that use it (design 007 D3).
GROUPS_SCHEMA = 4
#: The schema that may carry a manifest's ``base`` (design 009 D3).
BASE_SCHEMA = 4
#: The schema of a manifest that names serving streams (``streams``/``stream``, SPEC §15); its
#: layout is of schema 3 or 4 (layouts did not change).
STREAMS_SCHEMA = 5
#: A serving format's name (SPEC §15): lower-case letters, digits, ``.`` and ``-``.
FORMAT_NAME_PATTERN = r"^[a-z0-9][a-z0-9.-]{0,63}$"
#: The HEAD schema (design 007 D3: schema 4 left HEAD as schema 3 wrote it).
HEAD_SCHEMA = 3
#: Default attempt deadline (design 005 D3): a writer abandons a commit attempt older than this.
DEFAULT_MAX_ATTEMPT_S = 6 * 3600
STATE_DIGEST = "xxh3-128"

#: The dtypes deltastore publishes and reads (PyTorch names), with their element width in
#: bytes: dense types of 1, 2, 4 or 8 bytes whose bits a state digest can cover.
DTYPE_WIDTHS: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
}  # fmt: skip


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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


class CompressionRef(_Model):
    """How a compressed based version was made (schema 4, optional; SPEC §14.1): its state is the
    base plus a lossy approximation of the site's change (the ``density`` fraction of each
    tensor's elements with the largest change, their values quantized to ``bits`` bits), not the
    site's trained state. Its segments are ordinary: every byte a reader applies is exact to what
    the site published; the field tells readers it is not the lossless result."""

    method: str = Field(pattern=FORMAT_NAME_PATTERN)
    density: float = Field(gt=0, le=1)
    bits: int = Field(ge=1, le=16)
    error_feedback: bool

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


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


class StreamRef(_Model):
    """One serving stream's version (SPEC §15): the manifest of format ``format`` at the same
    version, under ``streams/<format>/``, by key and SHA-256; ``bytes``: the pack bytes it wrote."""

    format: str = Field(pattern=FORMAT_NAME_PATTERN)
    key: StoreKey
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


def check_streams(schema: int, stream: str | None, streams: Sequence[StreamRef]) -> None:
    """SPEC §15's rules for a manifest's ``stream`` and ``streams``: schema 5 only, sorted by
    format, each format once, the version's own format not among them (ValueError)."""
    if (streams or stream is not None) and schema < STREAMS_SCHEMA:
        raise ValueError(f"schema {schema} has no streams (a schema-{STREAMS_SCHEMA} field)")
    names = [s.format for s in streams]
    if names != sorted(set(names)):
        raise ValueError(f"streams must be sorted by format, each format once: {names}")
    if stream is not None and stream in names:
        raise ValueError(f"format {stream!r} is this version's own state and also a stream")


def stream_formats(stream: str | None, streams: Sequence[StreamRef]) -> tuple[str, ...]:
    """The serving formats of a version (SPEC §15): its own (``stream``), then its streams'."""
    return (() if stream is None else (stream,)) + tuple(s.format for s in streams)


def find_stream(streams: Sequence[StreamRef], fmt: str) -> StreamRef | None:
    """The stream of format ``fmt`` among ``streams`` (None: none)."""
    return next((s for s in streams if s.format == fmt), None)


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
    #: schema 4, optional (SPEC §14.1): a based version whose state is a compressed change of
    #: the site's result; absent (not null) from every document without it
    compression: CompressionRef | None = None
    #: schema 5 (SPEC §15): the serving streams derived from this version, one per format,
    #: sorted by format; absent from every document without them
    streams: tuple[StreamRef, ...] = ()
    #: schema 5, optional: the serving format this version's own state is (e.g. ``"bf16"``)
    stream: str | None = Field(None, pattern=FORMAT_NAME_PATTERN)

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
        if self.compression is not None and self.base is None:
            raise ValueError("compression is a field of based versions only (SPEC §14.1), and this version has no base")
        check_streams(self.schema_, self.stream, self.streams)
        return self

    def formats(self) -> tuple[str, ...]:
        """The serving formats this version can be read in (SPEC §15): its own, then its streams."""
        return stream_formats(self.stream, self.streams)

    def stream_ref(self, fmt: str) -> StreamRef | None:
        """The stream of format ``fmt`` (None: not among :attr:`streams`)."""
        return find_stream(self.streams, fmt)

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
    """A layout object (SPEC §3.2): the tensors of a version, as columns.

    Manifests name tensors by their position here. ``pieces``, ``piece_parts`` and ``parts``
    describe sharded layouts (SPEC §8, design 010); ``chunk_cols`` > 0 a column grid (SPEC §2,
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
                continue  # malformed: checks.check_layout refuses it before anyone asks for members
            dt = self.dtype[g.unit] if g.unit < len(self.dtype) else ""
            out[self.name[g.unit]] = tuple(GroupMember(n, dt, sh, off) for n, sh, off in zip(g.name, g.shape, g.offset))
        self._members = out
        if out and kernels.untrack is not None:
            # Out of the cyclic collector's sets from the start, as History does with chunk
            # tables (docs/design/006-native-kernels.md): thousands of long-lived members would
            # otherwise be walked by every full collection, and CPython never untracks a tuple
            # subclass itself. A member holds two strings, a tuple of ints and an int: no cycle.
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


def untrack_entries(tensors: Iterable[TensorEntry]) -> None:
    """Take tensor entries, their chunk entries and segment refs out of the cyclic collector's
    sets (docs/design/006-native-kernels.md): a manifest's chunk table, ~3 objects per tensor
    and per listed chunk, that lives as long as its version is cached or is the writer's last,
    which the collector would otherwise promote into its old generation and walk in every full
    pass. The entries are frozen models whose fields are ints, strings, tuples of ints and other
    entries: a tree, never part of a cycle, which is what an untracked object must be (CPython
    untracks tuples and dicts of atomic values itself). Without the native extension they stay
    tracked."""
    untrack = kernels.untrack
    if untrack is None:
        return
    objs: list[Any] = []
    for t in tensors:
        for c in t.chunks:
            for s in (c.full, c.delta):
                if s is not None:
                    objs += (s.__dict__, s.__pydantic_fields_set__, s)
            objs += (c.__dict__, c.__pydantic_fields_set__, c)
        objs += (t.chunks, t.__dict__, t.__pydantic_fields_set__, t)
    untrack(objs)


def dump(model: BaseModel) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace) so equal documents hash equally."""
    doc = model.model_dump(mode="json", by_alias=True)
    if "groups" in doc and doc["groups"] is None:  # a schema-3 layout has no groups field
        doc.pop("groups")
    if "base" in doc and doc["base"] is None:  # only based versions carry it (design 009)
        doc.pop("base")
    if "compression" in doc and doc["compression"] is None:  # only compressed based versions (SPEC §14.1)
        doc.pop("compression")
    if doc.get("streams") == [] and doc.get("stream", 0) is None:  # only schema 5 carries them (SPEC §15)
        doc.pop("streams")
        doc.pop("stream")
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


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


def layout_of(tensors: Sequence[TensorEntry] | Mapping[str, Any], *, schema: int | None = 3) -> Layout:
    """The (unsharded) layout of ``tensors``, in their order: TensorEntry objects, or a mapping
    of name to anything with ``name``, ``dtype``, ``shape`` and ``chunk_rows`` (TensorSpec),
    and ``chunk_cols`` where it has a column grid (a TensorSpec, design 011; else 0).

    ``schema`` 4 writes the ``groups`` record of every item with ``members`` (a TensorSpec of
    a group row, design 007); schema 3 refuses such items (ValueError); None is 4 when an item
    has members, else 3 (what a writer of a new layout picks)."""
    items = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    n = len(items)
    groups = [
        GroupRecord(unit=i, name=tuple(m.name for m in t.members), shape=tuple(tuple(m.shape) for m in t.members),
                    offset=tuple(m.offset for m in t.members))
        for i, t in enumerate(items) if getattr(t, "members", ())
    ]
    if schema is None:
        schema = GROUPS_SCHEMA if groups else 3
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


def piece_part(layout: Layout, tensor: int, chunk: int) -> int:
    """The part that writes chunk ``chunk`` of layout row ``tensor`` (a sharded layout:
    pieces aligned to chunk rows, as the layout check requires: checks.check_layout). The chunk's first row is
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
