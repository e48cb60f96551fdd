"""encode._PackWriter: the pack digest taken incrementally per segment (never by re-reading the
pack) and the segment digests the encode threads take must name the bytes actually stored."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltastore import encode
from deltastore.codec import Segment
from deltastore.storage import open_store


@pytest.mark.parametrize("given_digest", [True, False])
def test_pack_and_segment_digests_name_the_stored_bytes(tmp_path, monkeypatch, given_digest):
    monkeypatch.setattr(encode, "PACK_TARGET_BYTES", 1000)  # several packs, flushed mid-stream
    store = open_store(str(tmp_path / "store"))
    segs = [Segment("add-sparse/1", bytes([i % 251]) * (100 + 37 * i), i) for i in range(40)]
    with ThreadPoolExecutor(4) as up:
        w = encode._PackWriter(store, up, attempt="a" * 32, role="d")
        refs = [w.add(s, hashlib.sha256(s.data).hexdigest() if given_digest else None) for s in segs]
        w.finish()
    assert len(w.blobs) > 3
    packs = [store.get(b.key) for b in w.blobs]
    for b, data in zip(w.blobs, packs):
        assert b.sha256 == hashlib.sha256(data).hexdigest() and b.size == len(data)
        assert b.key == f"objects/{'a' * 32}/{b.sha256}.pack"
    assert w.bytes_written == sum(len(s.data) for s in segs)
    for s, r in zip(segs, refs):
        stored = packs[r.blob][r.offset : r.offset + r.length]
        assert stored == s.data and r.sha256 == hashlib.sha256(stored).hexdigest()
