"""Tests' view of stored manifests as JSON documents.

Tests that model a buggy or hostile writer read a manifest as a JSON document, change it, and
store it again under a correct content address. A manifest is a zstd frame of a columnar
document whose tensors live in a layout object (SPEC §3). These helpers let such tests work on
the in-memory shape (``tensors`` and ``blobs``, as Manifest models them):

- :func:`read_manifest_doc` gives the in-memory document (tensors rebuilt from the layout, as
  ``json.loads(dump(manifest))``);
- :func:`write_manifest_doc` stores a (possibly inconsistent) in-memory document back without
  validating it: the columnar zstd document, writing a new layout object when the document's
  tensors disagree with the layout it names.

Offsets are implicit (segments fill their packs back to back). A document whose
segments leave gaps in a pack (chunks dropped, a segment moved to another pack) is stored with
that pack rewritten to hold exactly its listed segments (a new pack object under the manifest's
attempt, or, for a pack that does not exist, just its size corrected), which is what a writer
of such a manifest would have had to store. Overlapping or out-of-range segments cannot be said
at all and raise :class:`NotExpressible`.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
from typing import Any

import zstandard

from deltastore.format.keys import manifest_key, object_key, sha256_hex
from deltastore.format.manifest import parse_manifest
from deltastore.format.models import (
    BlobRef,
    ChunkEntry,
    Layout,
    Manifest,
    ObjectRef,
    SegmentRef,
    Stats,
    TensorEntry,
    chunk_count,
    dump,
    layout_of,
)
from deltastore.format.objects import decode_object
from deltastore.storage.base import Store

_ATTEMPT = re.compile(r"[0-9a-f]{32}")
_LAYOUT_COLUMNS = ("name", "dtype", "shape", "chunk_rows", "chunk_cols", "pieces", "piece_parts")


class NotExpressible(ValueError):
    """The document says something the stored encoding has no way to say."""


def layout_fetcher(store: Store):
    """``parse_manifest(..., layout=layout_fetcher(store))``: fetch and verify a layout."""
    return lambda ref: decode_object(Layout, store.get(ref.key), ref.key, ref.sha256)


def read_manifest_doc(store: Store, key: str) -> dict[str, Any]:
    """The manifest stored under ``key`` as its in-memory JSON document."""
    return json.loads(dump(parse_manifest(store.get(key), key, layout=layout_fetcher(store))))


def _zstd_json(doc: Any) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def encode_manifest_doc(store: Store, doc: dict[str, Any]) -> tuple[bytes, str]:
    """The stored bytes and key of in-memory document ``doc`` (not validated): a columnar zstd
    document; a new layout object is written to ``store`` when ``doc``'s tensors differ from
    the layout it names."""
    version = doc.get("version") if isinstance(doc.get("version"), int) else 0
    if not isinstance(doc.get("layout"), dict):
        raise NotExpressible(f"layout {doc.get('layout')!r}: the chunk table is stored against a layout object")
    doc = copy.deepcopy(doc)
    ref = doc["layout"]
    layout = json.loads(zstandard.ZstdDecompressor().decompress(store.get(ref["key"])))
    cols = {c: list(layout[c]) for c in _LAYOUT_COLUMNS}
    tensors, blobs = doc.pop("tensors", []), doc.pop("blobs", [])
    index: dict[Any, int] = {}
    for i, name in enumerate(cols["name"]):
        index.setdefault(name, i)
    changed = False
    for t in tensors:
        i = index.get(t["name"])
        if i is None:
            i = index[t["name"]] = len(cols["name"])
            for c, default in (("name", t["name"]), ("chunk_cols", 0), ("pieces", None), ("piece_parts", None),
                               ("dtype", None), ("shape", None), ("chunk_rows", None)):
                cols[c].append(default)
            changed = True
        for c in ("dtype", "shape", "chunk_rows"):
            if cols[c][i] != t.get(c):
                cols[c][i], changed = t.get(c), True
    if changed:
        layout.update(cols)
        ldata = _zstd_json(layout)
        attempt = doc.get("commit_id") if _ATTEMPT.fullmatch(str(doc.get("commit_id"))) else "0" * 32
        lkey = object_key(attempt, sha256_hex(ldata), ".layout.json.zst")
        store.put(lkey, ldata, mode="overwrite")
        doc["layout"] = {"key": lkey, "sha256": sha256_hex(ldata)}
    rows: list[tuple[Any, Any, Any]] = []
    segs: list[tuple[Any, Any, int, str, dict[str, Any]]] = []
    for t in tensors:
        for c in t["chunks"]:
            r = len(rows)
            rows.append((index[t["name"]], c.get("index"), c.get("digest")))
            for role, which in (("d", "delta"), ("f", "full")):
                s = c.get(which)
                if s is not None:
                    segs.append((s.get("blob"), s.get("offset"), r, role, s))
    try:
        segs.sort(key=lambda s: (s[0], s[1]))
    except TypeError:
        pass  # hostile numbers: keep the document's order
    _repack(store, doc, blobs, segs)
    # offsets and pack indices are implicit: refuse a document that states others
    pack, offset = 0, 0
    for blob, off, _, _, s in segs:
        if (blob, off) != (pack, offset):
            raise NotExpressible(f"segment at pack {blob} offset {off}: the fill rule places it at pack {pack} offset {offset}")
        offset += s.get("length") if isinstance(s.get("length"), int) else 0
        if pack < len(blobs) and isinstance(blobs[pack].get("size"), int) and offset >= blobs[pack]["size"]:
            pack, offset = pack + 1, 0
    codecs = sorted({s[4].get("codec") for s in segs}, key=str)
    doc.update(
        parts=doc.get("parts", []),
        codecs=codecs,
        packs=[{"key": b.get("key"), "size": b.get("size"), "sha256": b.get("sha256"), "role": b.get("role")} for b in blobs],
        chunks={"tensor": [r[0] for r in rows], "chunk": [r[1] for r in rows], "digest": "".join(str(r[2]) for r in rows)},
        segments={
            "row": [s[2] for s in segs],
            "role": "".join(s[3] for s in segs),
            "codec": [codecs.index(s[4].get("codec")) for s in segs],
            "length": [s[4].get("length") for s in segs],
            "n_changed": [s[4].get("n_changed") for s in segs],
            "sha256": "".join(str(s[4].get("sha256")) for s in segs),
        },
    )
    data = _zstd_json(doc)
    return data, manifest_key(version, sha256_hex(data))


def _repack(store: Store, doc: dict[str, Any], blobs: list[dict[str, Any]], segs: list) -> None:
    """Rewrite packs whose listed segments leave gaps so that they fill them back to back."""
    by_pack: dict[int, list] = {}
    for seg in segs:
        blob, off, length = seg[0], seg[1], seg[4].get("length")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (blob, off, length)):
            return
        if not 0 <= blob < len(blobs):
            return
        by_pack.setdefault(blob, []).append(seg)
    attempt = doc.get("commit_id") if _ATTEMPT.fullmatch(str(doc.get("commit_id"))) else "0" * 32
    for i, group in by_pack.items():
        b = blobs[i]
        spans = [(s[1], s[4]["length"]) for s in group]
        if [o for o, _ in spans] == list(itertools.accumulate([0] + [n for _, n in spans[:-1]])) and sum(n for _, n in spans) == b.get("size"):
            continue  # already back to back
        ends = [o + n for o, n in spans]
        if any(spans[k][0] < ends[k - 1] for k in range(1, len(spans))) or spans[0][0] < 0:
            raise NotExpressible(f"segments of pack {i} overlap")
        try:
            data = store.get(b["key"])
        except KeyError:
            data = None  # a missing pack: only its size changes
        if data is not None:
            if ends[-1] > len(data):
                raise NotExpressible(f"a segment runs past the end of pack {i}")
            new = b"".join(data[o:o + n] for o, n in spans)
            sha = sha256_hex(new)
            b.update(key=object_key(attempt, sha, ".pack"), sha256=sha)
            store.put(b["key"], new, mode="overwrite")
        b["size"] = sum(n for _, n in spans)
        offset = 0
        for s in group:
            s[4]["offset"] = offset
            offset += s[4]["length"]
    segs[:] = sorted(((s[0], s[4]["offset"], *s[2:]) for s in segs), key=lambda s: (s[0], s[1]))


def write_manifest_doc(store: Store, doc: dict[str, Any]) -> str:
    """Store ``doc`` (see :func:`encode_manifest_doc`) under its content address; its key."""
    data, key = encode_manifest_doc(store, doc)
    store.put(key, data, mode="overwrite")
    return key


def make_layout(rng: random.Random, n_tensors: int, names: list[str] | None = None) -> Layout:
    tensors = []
    for i in range(n_tensors):
        shape = rng.choice([(), (0,), (rng.randint(1, 40),), (rng.randint(1, 40), rng.randint(1, 8))])
        tensors.append(TensorEntry(name=names[i] if names else f"t{i}.w", dtype=rng.choice(DTYPES), shape=shape,
                                   chunk_rows=rng.randint(1, 16), chunks=()))
    return layout_of(tensors)


def make_manifest(rng: random.Random, layout: Layout, *, kind: str, version: int = 40, changed: float = 0.3,
                  with_delta: bool = False, max_pack_segments: int = 5, attempt: str | None = None) -> Manifest:
    """A schema-3 Manifest satisfying every SPEC §3 rule, in the canonical form a writer produces."""
    attempt = attempt or random_hex(rng, 32)
    entries: list[tuple[int, int, bool, bool]] = []  # (tensor, chunk, has delta, has full)
    for ti in range(len(layout.name)):
        for ci in range(chunk_count(layout.shape[ti], layout.chunk_rows[ti])):
            if kind == "anchor":
                entries.append((ti, ci, with_delta and rng.random() < changed, True))
            elif rng.random() < changed:
                entries.append((ti, ci, True, False))
    # segments in storage order: delta packs first, then full packs, each filled back to back
    blobs: list[BlobRef] = []
    refs: dict[tuple[int, str], SegmentRef] = {}
    for role in ("d", "f"):
        todo = [e for e, x in enumerate(entries) if x[2 if role == "d" else 3]]
        while todo:
            take = rng.randint(1, max_pack_segments)
            batch, todo = todo[:take], todo[take:]
            offset = 0
            for e in batch:
                length = rng.randint(1, 5000)
                refs[(e, role)] = SegmentRef(blob=len(blobs), offset=offset, length=length, sha256=random_hex(rng, 64),
                                             codec=rng.choice(CODECS_D if role == "d" else CODECS_F),
                                             n_changed=0)
                offset += length
            sha = random_hex(rng, 64)
            blobs.append(BlobRef(key=object_key(attempt, sha, ".pack"), size=offset, sha256=sha, role=role))
    by_tensor: dict[int, list[ChunkEntry]] = {}
    for e, (ti, ci, _, _) in enumerate(entries):
        by_tensor.setdefault(ti, []).append(
            ChunkEntry(index=ci, digest=random_hex(rng, 32), full=refs.get((e, "f")), delta=refs.get((e, "d"))))
    tensors = tuple(
        TensorEntry(name=layout.name[ti], dtype=layout.dtype[ti], shape=layout.shape[ti],
                    chunk_rows=layout.chunk_rows[ti], chunks=tuple(cs))
        for ti, cs in sorted(by_tensor.items()))
    parent = version - 1 if version > 1 else None
    anchor = version if kind == "anchor" else max(1, version - rng.randint(1, version - 1))
    delta_base = parent if kind == "delta" or (with_delta and parent) else None
    back = tuple(random_manifest_key(rng, version - 2**j) for j in range(1, 63) if version - 2**j >= 1)
    return Manifest(
        schema=3, version=version, parent=parent, parent_manifest=random_manifest_key(rng, parent) if parent else None,
        kind=kind, anchor=anchor, delta_base=delta_base, step=rng.choice([None, version * 10]),
        created="2026-12-01T10:00:00.000Z", writer="w", epoch=1, commit_id=attempt,
        metadata={"lr": 0.1, "tags": ["a", "ü"]}, blobs=tuple(blobs), tensors=tensors,
        stats=Stats(bytes_stored=sum(b.size for b in blobs), tensors_changed=len(by_tensor), elements_changed=3,
                    tensors_total=len(layout.name), elements_total=99, delta_bytes=1, full_bytes=2, cum_delta_bytes=3),
        lineage=LINEAGE, anchor_manifest=None if kind == "anchor" else random_manifest_key(rng, anchor), back=back,
        chain_start=version if delta_base is None else max(1, anchor - 1),
        layout=ObjectRef(key=object_key(attempt, random_hex(rng, 64), ".layout.json.zst"), sha256=random_hex(rng, 64)),
        max_attempt_s=21600,
    )


DTYPES = ("bfloat16", "float32", "float16", "int64", "uint8", "bool")


CODECS_F = ("full/2",)


CODECS_D = ("add-sparse/1", "add-dense/1")


LINEAGE = "0123456789abcdef" * 2


def random_hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def random_manifest_key(rng: random.Random, v: int) -> str:
    return manifest_key(v, random_hex(rng, 64))


def json_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON document (keys and list indices), the root's ``()`` first: where a
    fuzzer may put a hostile value."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += json_paths(v, prefix + (i,))
    return out
