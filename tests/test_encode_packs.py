"""encode._PackWriter: the pack digest taken incrementally per segment (never by re-reading the
pack) and the segment digests the encode threads take must name the bytes actually stored; a
manifest is written only after every pack it names is stored."""

from __future__ import annotations

import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from deltastore import Publisher, StorageError, Subscriber, encode
from deltastore.codec import Segment
from deltastore.storage import open_store
from tests._helpers import WrappedStore, assert_bits_equal, small_state, sparse_edit
from tests._manifest_docs import read_manifest_doc


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


class _SlowPacks(WrappedStore):
    """Pack uploads take ``delay`` seconds (and fail when ``fail``); records when each pack put
    ended and when each manifest put began."""

    def __init__(self, inner, delay: float):
        super().__init__(inner)
        self.delay = delay
        self.fail = False
        self.events: list[tuple[str, str, float]] = []

    def put(self, key, data, *, mode="overwrite"):
        if key.endswith(".pack"):
            time.sleep(self.delay)
            try:
                if self.fail:
                    raise StorageError(f"{key}: 503 (injected)")
                return super().put(key, data, mode=mode)
            finally:
                with self._lock:
                    self.events.append(("pack done", key, time.monotonic()))
        if key.startswith("manifests/"):
            with self._lock:
                self.events.append(("manifest start", key, time.monotonic()))
        return super().put(key, data, mode=mode)


def test_manifest_is_written_only_after_every_pack_it_names_is_stored():
    # A reader that finds a manifest must find its packs (SPEC §5), however slow their uploads.
    store = _SlowPacks(open_store(f"memory://packs-{uuid.uuid4().hex}"), delay=0.2)
    states = [small_state(0, rows=64)]
    states += [sparse_edit(states[-1], np.random.default_rng(i)) for i in range(1, 3)]
    with Publisher("unused", store=store, threads=2) as pub:
        for s in states:
            pub.publish(s)
    manifests = [(k, t) for what, k, t in store.events if what == "manifest start"]
    packs = [t for what, _, t in store.events if what == "pack done"]
    assert len(manifests) == len(states) and len(packs) >= len(states)
    for key, started in manifests:
        m = read_manifest_doc(store.inner, key)
        done = [t for what, k, t in store.events if what == "pack done" and k in {b["key"] for b in m["blobs"]}]
        assert len(done) == len(m["blobs"]) and max(done) <= started, key


def test_a_pack_upload_that_fails_after_the_scan_commits_nothing():
    store = _SlowPacks(open_store(f"memory://packs-{uuid.uuid4().hex}"), delay=0.05)
    s0 = small_state(0, rows=64)
    s1 = sparse_edit(s0, np.random.default_rng(1))
    with Publisher("unused", store=store, threads=2) as pub:
        pub.publish(s0)
        store.fail = True
        with pytest.raises(StorageError, match="injected"):
            pub.publish(s1)
        # nothing was left uploading, no manifest names the failed pack, HEAD did not move
        assert [e for e in store.events if e[0] == "manifest start"][1:] == []
        assert pub.version == 1
        store.fail = False
        assert pub.publish(s1).version == 2
    with Subscriber("unused", store=store.inner) as sub:
        assert_bits_equal(sub.pull(), s1)

