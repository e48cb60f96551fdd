"""Manifests as stored (docs/SPEC.md §3, design 005 D8): one zstd frame of a columnar document
whose chunk table names tensors by their position in the version's layout object.

:func:`parse_manifest` verifies a manifest's bytes and builds the in-memory
:class:`~deltastore.format.models.Manifest` (tensors and packs inline, as the model has them);
:func:`encode_manifest` writes it back, proving first that the bytes decode to it exactly. A
sharded version's chunks live in its part manifests (:mod:`deltastore.format.parts`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import CorruptObjectError, UnsupportedSchemaError
from deltastore.format.checks import check_layout, check_manifest
from deltastore.format.keys import EARLIER_MANIFEST_KEY, manifest_key_version
from deltastore.format.models import (
    GROUPS_SCHEMA,
    STREAMS_SCHEMA,
    ChunkEntry,
    Layout,
    Manifest,
    ObjectRef,
    PartRef,
    SegmentRef,
    StreamRef,
    TensorEntry,
    check_streams,
    dump,
    find_stream,
    stream_formats,
)
from deltastore.format.parse import MAX_MANIFEST_BYTES, check_digest, load_document, validate, zstd_frame
from deltastore.format.parts import merge_parts
from deltastore.format.tables import Row, Tables, row_entries, table_rows, tables_doc, unchecked_entry


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
    check_digest(data, key, expected_sha256, "manifest")
    key_version = manifest_key_version(key)
    if key_version is None:
        if EARLIER_MANIFEST_KEY.fullmatch(key):
            raise UnsupportedSchemaError(f"manifest {key!r} is a plain-JSON manifest of schema 1 or 2, an earlier format "
                                         "this deltastore does not read: publish the model to a new store")
        raise CorruptObjectError(f"{key!r} is not a manifest key (manifests/<version:012d>-<sha256>.json.zst)")
    doc = load_document(data, "manifest", key, max_bytes)
    if layout is None:
        raise ValueError(f"manifest {key!r}: parse_manifest needs its layout")
    if callable(layout):
        layout = layout(_layout_ref(doc, key))  # its key checked before it is looked up
    manifest = _manifest_from_doc(doc, layout, key, parts)
    check_manifest(manifest, key)
    if manifest.version != key_version:
        raise CorruptObjectError(f"manifest {key!r} holds version {manifest.version}, not the version its key names")
    return manifest


@dataclass(frozen=True)
class ServingHeader:
    """What a reader of a serving format needs of a manifest (SPEC §15): its version, its own
    format (``stream``) and its streams, read without its chunk table or layout."""

    version: int
    stream: str | None
    streams: tuple[StreamRef, ...]
    #: the parent's manifest key (None: the first version of its chain)
    parent_manifest: str | None = None

    def carries(self, fmt: str) -> bool:
        """The version can be read in format ``fmt`` (its own state's, or a stream's)."""
        return self.stream == fmt or self.stream_ref(fmt) is not None

    def formats(self) -> tuple[str, ...]:
        """The formats the version can be read in: its own, then its streams'."""
        return stream_formats(self.stream, self.streams)

    def stream_ref(self, fmt: str) -> StreamRef | None:
        return find_stream(self.streams, fmt)


def parse_serving_header(data: bytes, key: str, expected_sha256: str | None = None,
                         max_bytes: int = MAX_MANIFEST_BYTES) -> ServingHeader:
    """A manifest's :class:`ServingHeader`, its bytes verified as :func:`parse_manifest` does
    (digest, frame, schema), its chunk table not decoded.

    Raises:
        IntegrityError, CorruptObjectError, UnsupportedSchemaError: as :func:`parse_manifest`.
    """
    check_digest(data, key, expected_sha256, "manifest")
    key_version = manifest_key_version(key)
    doc = load_document(data, "manifest", key, max_bytes)
    if key_version is None or doc.get("version") != key_version:
        raise CorruptObjectError(f"manifest {key!r} holds version {doc.get('version')!r}, not the version its key names")
    streams, stream = doc.get("streams", []), doc.get("stream")
    if not isinstance(streams, list) or not all(isinstance(r, dict) for r in streams) or \
            not (stream is None or isinstance(stream, str)):
        raise CorruptObjectError(f"manifest {key!r}: streams must be objects {{format, key, sha256, bytes}} and "
                                 "stream a format name")
    refs = tuple(validate(StreamRef, r, "manifest", key, ("streams", i)) for i, r in enumerate(streams))
    try:
        check_streams(doc["schema"], stream, refs)
    except ValueError as e:
        raise CorruptObjectError(f"manifest {key!r}: {e}") from None
    parent = doc.get("parent_manifest")
    if parent is not None and (not isinstance(parent, str) or manifest_key_version(parent) != key_version - 1):
        raise CorruptObjectError(f"manifest {key!r}: its parent_manifest {parent!r} is not a manifest key of version "
                                 f"{key_version - 1}")
    return ServingHeader(version=key_version, stream=stream, streams=refs, parent_manifest=parent)


def _manifest_doc(m: Manifest, layout: Layout) -> dict[str, Any]:
    """The schema-3 JSON document of ``m`` (design 005 D8), before compression. A sharded
    version's document lists its ``parts`` and has empty tables (its parts hold them)."""
    doc = m.model_dump(mode="json", by_alias=True, exclude={"blobs", "tensors", "parts"})
    if doc.get("base") is None:  # only based versions carry it (design 009)
        doc.pop("base", None)
    if doc.get("compression") is None:  # only compressed based versions carry it (SPEC §14.1)
        doc.pop("compression", None)
    if not doc.get("streams") and doc.get("stream") is None:  # only schema 5 carries them (SPEC §15)
        doc.pop("streams", None)
        doc.pop("stream", None)
    if m.parts:
        doc.update(tables_doc((), (), layout, m.version))
        doc["parts"] = [p.model_dump(mode="json", by_alias=True) for p in m.parts]
        return doc
    doc.update(tables_doc(m.tensors, m.blobs, layout, m.version))
    doc["parts"] = []
    return doc


def _manifest_from_doc(doc: dict[str, Any], layout: Layout, key: str,
                       parts: Callable[[PartRef], bytes] | None = None) -> Manifest:
    """The in-memory Manifest of a schema-3 document: ``blobs`` are its packs, ``tensors`` its
    chunk table rebuilt from ``layout`` (layout order, only tensors with listed chunks, chunks
    in index order: the shape a schema-2 manifest of the same version has).

    A sharded version (non-empty ``parts``) is read with ``parts``, which returns a part
    manifest's bytes: its ``blobs`` are every part's packs in part order, its ``tensors`` the
    union of their chunk tables (SPEC §8)."""
    header, rows = _decode_tables(doc, layout, key, parts)
    # Entries are built without validation (validating each through pydantic would dominate a
    # pull of many tensors): the columnar checks of table_rows, the layout's and
    # check_manifest's (which every caller runs next) cover every field pydantic would check.
    tensors = tuple(
        unchecked_entry(TensorEntry, name=name, dtype=dtype, shape=shape, chunk_rows=chunk_rows,
                        chunks=tuple([unchecked_entry(ChunkEntry, index=index, digest=digest, full=full, delta=delta)
                                      for _, index, digest, full, delta in run]))
        for (name, dtype, shape, chunk_rows), run in row_entries(rows, layout)
    )
    return header.model_copy(update={"tensors": tensors}).with_layout(layout)


def _decode_tables(doc: dict[str, Any], layout: Layout, key: str,
                   parts: Callable[[PartRef], bytes] | None) -> tuple[Manifest, list[Row]]:
    """What :func:`_manifest_from_doc` reads of a schema-3 document before it builds entries:
    the validated header as a Manifest (``blobs`` its packs, no ``tensors``) and the chunk rows
    (tensor position, chunk index, digest, segment refs by role) in (tensor, chunk) order, each
    segment placed in the packs by the fill rule. Every check of the columns is made here."""

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {key!r}: {msg}")

    check_layout(layout, "layout of manifest", key)
    table_fields = ("codecs", "packs", "chunks", "segments", "parts")
    missing = [f for f in table_fields if f not in doc]
    if missing:
        raise bad(f"a schema-3 manifest needs {', '.join(missing)}")
    tables: Tables = validate(Tables, {f: doc[f] for f in table_fields}, "manifest", key)
    inline = [f for f in ("blobs", "tensors") if f in doc]
    if inline:
        raise bad(f"a schema-3 manifest has no {', '.join(inline)} (its chunk table is columnar)")
    header = {k: v for k, v in doc.items() if k not in table_fields}
    # schema-4 manifests and layouts go together; a schema-5 manifest names a layout of either
    if header.get("schema") != STREAMS_SCHEMA and (header.get("schema") == GROUPS_SCHEMA) != (layout.schema_ == GROUPS_SCHEMA):
        raise bad(f"a schema-{header.get('schema')} manifest names a schema-{layout.schema_} layout "
                  f"(schema-{GROUPS_SCHEMA} manifests and layouts go together)")

    if tables.parts:
        refs = [validate(PartRef, p, "manifest", key, ("parts", i)) if isinstance(p, dict) else None
                for i, p in enumerate(tables.parts)]
        if any(r is None for r in refs):
            raise bad("parts must be objects {part, key, sha256, writer, bytes}")
        rows, packs = merge_parts(header, tables, [r for r in refs if r is not None], layout, key, parts, bad)
        header["parts"] = [r.model_dump(mode="json", by_alias=True) for r in refs if r is not None]
    else:
        if layout.parts:
            raise bad(f"its layout is sharded ({layout.parts} parts) but the manifest lists no parts")
        rows, packs = table_rows(tables, layout, bad)
    header["blobs"] = [p.model_dump() for p in packs]
    header["tensors"] = []
    m: Manifest = validate(Manifest, header, "manifest", key)
    return m, rows


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
    check_manifest(m, where)
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
    return zstd_frame(raw)


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
    invariants (:func:`check_manifest`) must hold for that manifest: it proves what a full
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
            check_manifest(header.model_copy(update={"tensors": m.tensors}).with_layout(layout), where)
    except CorruptObjectError as e:
        raise ValueError(f"manifest of version {m.version} cannot be encoded: {e}") from None
    if difference is not None:
        raise ValueError(
            f"manifest of version {m.version} is not in canonical form (tensors in layout order with at least "
            f"one chunk, chunks by index, segments filling packs back to back): decoding would not return it ({difference})"
        )
    return zstd_frame(raw)


def _entries_differ(tensors: Sequence[TensorEntry], rows: Sequence[Row], layout: Layout) -> str | None:
    """Where the entries :func:`_manifest_from_doc` builds from ``rows`` would differ from
    ``tensors`` (None: nowhere), compared field by field without building them: both walk the
    rows by :func:`row_entries`.

    Values are compared with their types (``True == 1`` but dumps as ``true``), so equal here
    means equal in canonical JSON too (:func:`dump`), which is what a full round trip would
    compare.
    """
    runs = iter(row_entries(rows, layout))
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


def _layout_ref(doc: dict[str, Any], key: str) -> ObjectRef:
    """The ``layout`` reference of schema-3 manifest document ``doc`` (read from ``key``),
    validated (its key too) before anyone fetches the layout through it."""
    ref = doc.get("layout")
    if not isinstance(ref, dict):
        raise CorruptObjectError(f"manifest {key!r}: a schema-3 manifest needs a layout {{key, sha256}}, not {str(ref)[:100]!r}")
    return validate(ObjectRef, ref, "manifest", key, ("layout",))
