"""Part manifests of a sharded version (docs/SPEC.md §3.2, §8, design 010): each part's chunk
table, columnar as a manifest's, with a header a reader checks against the version; and the
join of a version's parts into one chunk table.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from deltastore.errors import CorruptObjectError
from deltastore.format.keys import PART_KEY
from deltastore.format.models import BlobRef, Layout, ObjectRef, PartRef, Stats, TensorEntry, piece_part
from deltastore.format.parse import MAX_MANIFEST_BYTES, check_digest, load_document, validate, zstd_frame
from deltastore.format.tables import Pack, Row, Tables, table_rows, tables_doc

#: The format of a part manifest (SPEC §3.2, §8).
PART_FORMAT = "deltastore.part"
#: The header fields of a part manifest besides its tables.
_PART_FIELDS = ("format", "schema", "version", "part", "commit_id", "lineage", "layout", "stats")


def merge_parts(header: dict[str, Any], tables: Tables, refs: list[PartRef], layout: Layout, key: str,
                 fetch: Callable[[PartRef], bytes] | None,
                 bad: Callable[[str], CorruptObjectError]) -> tuple[list[Row], list[Pack]]:
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
    rows: list[Row] = []
    packs: list[Pack] = []
    for ref in refs:
        match = PART_KEY.fullmatch(ref.key)
        if match is None or match.group(1) != commit_id or int(match.group(2)) != ref.part or match.group(3) != ref.sha256:
            raise bad(f"part {ref.part} has key {ref.key!r}: not objects/{commit_id}/{ref.part:05d}-{ref.sha256}.part.json.zst")
        data = fetch(ref)
        check_digest(data, ref.key, ref.sha256, "part manifest")
        doc = load_document(data, "part manifest", ref.key, MAX_MANIFEST_BYTES)

        def pbad(msg: str, ref: PartRef = ref) -> CorruptObjectError:
            return CorruptObjectError(f"part manifest {ref.key!r} of manifest {key!r}: {msg}")

        table_fields = ("codecs", "packs", "chunks", "segments")
        extra = set(doc) - set(table_fields) - set(_PART_FIELDS)
        missing = [f for f in (*table_fields, *_PART_FIELDS) if f not in doc]
        if missing or extra:
            raise pbad(f"fields missing {missing} or unknown {sorted(extra)[:8]}")
        if doc["format"] != PART_FORMAT:
            raise pbad(f"format {doc['format']!r} is not {PART_FORMAT!r}")
        validate(ObjectRef, doc["layout"], "part manifest", ref.key, ("layout",))  # a key it names, as every ref's
        for field, want in (("schema", header.get("schema")), ("version", header.get("version")), ("part", ref.part),
                            ("commit_id", commit_id), ("lineage", header.get("lineage")), ("layout", header.get("layout"))):
            if doc[field] != want:
                raise pbad(f"{field} is {str(doc[field])[:100]!r}, but the version says {str(want)[:100]!r}: "
                           "the part belongs to another version, attempt or layout")
        part_tables: Tables = validate(Tables, {**{f: doc[f] for f in table_fields}, "parts": []}, "part manifest", ref.key)
        # the part's pack indices follow the packs of the parts before it
        part_rows, part_packs = table_rows(part_tables, layout, pbad, first_pack=len(packs))
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
    doc = tables_doc(tensors, blobs, layout, version)
    doc.update(format=PART_FORMAT, schema=schema, version=version, part=part, commit_id=commit_id, lineage=lineage,
               layout=layout_ref.model_dump(mode="json"), stats=stats.model_dump(mode="json"))
    return zstd_frame(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
