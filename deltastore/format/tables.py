"""The columnar chunk table of a manifest or part manifest (docs/SPEC.md §3, design 005 D8):
``codecs``, ``packs``, ``chunks`` and ``segments`` as columns naming tensors by their position
in the layout, segments filling their packs back to back (offsets implicit).

:func:`tables_doc` writes the columns of a chunk table; :func:`table_rows` reads and checks
them into rows; :func:`row_entries` is the one walk from rows to chunk-table entries, which
readers build without validation (:func:`unchecked_entry`) after these checks.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from deltastore.errors import CorruptObjectError
from deltastore.format.keys import StoreKey
from deltastore.format.models import BlobRef, Layout, SegmentRef, TensorEntry
from deltastore.format.parse import INT_LIMIT

#: Hex digits per chunk row of ``chunks.digest`` (XXH3-128) and per segment row of
#: ``segments.sha256`` (SHA-256).
DIGEST_HEX = 32
SHA256_HEX = 64
_HEX = re.compile(r"[0-9a-f]*")

#: A chunk row: the tensor's position in the layout, then the fields of the row's ChunkEntry in
#: their order (index, digest, full, delta: the row's segment of each role, or None).
Row = tuple[int, int, str, "SegmentRef | None", "SegmentRef | None"]


def tables_doc(tensors: Sequence[TensorEntry], blobs: Sequence[BlobRef], layout: Layout, version: int) -> dict[str, Any]:
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


#: A segment's place in storage order (pack, offset), for sorting ``tables_doc``'s segments.
_storage_order = operator.itemgetter(0, 1)


class Pack(BaseModel):
    """One entry of ``packs``: a pack's key, size, SHA-256 and role."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    key: StoreKey
    size: int = Field(ge=1)  # writers never write an empty pack: segments fill packs unambiguously
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Literal["f", "d"]


class _ChunkTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    tensor: list[int]
    chunk: list[int]
    digest: str


class _SegmentTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    row: list[int]
    role: str
    codec: list[int]
    length: list[int]
    n_changed: list[int]
    sha256: str


class Tables(BaseModel):
    """The columns of a stored chunk table (in memory, ``blobs`` and ``tensors``), and a
    manifest's ``parts``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    codecs: list[str]
    packs: list[Pack]
    chunks: _ChunkTable
    segments: _SegmentTable
    parts: list[Any]


def _hex_column(text: str, n: int, width: int, name: str, bad: Callable[[str], CorruptObjectError]) -> list[str]:
    if len(text) != n * width or not _HEX.fullmatch(text):
        raise bad(f"{name} is not {n} × {width} lowercase hex digits")
    return [text[i * width:(i + 1) * width] for i in range(n)]


#: The fields of a TensorEntry but ``chunks``, in their order.
_TensorFields = tuple[str, str, tuple[int, ...], int]
#: A row's tensor position: the key its runs are grouped by.
_row_tensor = operator.itemgetter(0)


def row_entries(rows: Sequence[Row], layout: Layout) -> list[tuple[_TensorFields, list[Row]]]:
    """The entries chunk rows make: one TensorEntry per run of rows of one layout row, its
    fields ``(name, dtype, shape, chunk_rows)`` from ``layout``, and one ChunkEntry per row of
    the run, its fields the row's after the tensor position (:data:`Row`).

    The one walk from rows to entries: :func:`_manifest_from_doc` builds entries of these
    fields, :func:`_entries_differ` compares a writer's entries with them."""
    name, dtype, shape, chunk_rows = layout.name, layout.dtype, layout.shape, layout.chunk_rows
    return [((name[ti], dtype[ti], tuple(shape[ti]), chunk_rows[ti]), list(run))
            for ti, run in itertools.groupby(rows, _row_tensor)]


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
    it caches (docs/design/006-native-kernels.md). Sharing it is safe for these frozen models: pydantic
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
    for it (no pydantic per entry on the hot path). Two callers do: the reader, after
    the columnar checks of :func:`table_rows` and before :func:`check_manifest`; and the
    encoder, whose entries no reader sees unchecked: :func:`encode_manifest` proves them equal,
    field by field with their types, to what a reader decodes from the bytes, and checks that
    manifest as a reader does (a part manifest is checked so when it is joined)."""
    return _fast_construct(cls, values) if _FAST_CONSTRUCT else cls.model_construct(**values)


def table_rows(tables: Tables, layout: Layout, bad: Callable[[str], CorruptObjectError], *,
                first_pack: int = 0) -> tuple[list[Row], list[Pack]]:
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
        # Built without validation: every field was checked above (no pydantic per entry).
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


_FAST_CONSTRUCT = _construct_is_exact()
