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
import re
from typing import Any

import zstandard

from deltastore.format.keys import manifest_key, object_key, sha256_hex
from deltastore.format.manifest import parse_manifest
from deltastore.format.models import Layout, dump
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
