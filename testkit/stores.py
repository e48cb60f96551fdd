"""Stores for tests: a wrapper that records or intercepts every verb, and helpers that read,
check or damage a store's objects (re-signed so that only semantic checks can catch them).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from deltastore import Publisher, Subscriber
from deltastore.format.keys import HEAD_KEY, sha256_hex
from deltastore.format.manifest import parse_manifest
from deltastore.format.parse import parse_head
from deltastore.storage import open_store
from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.tensors import SMALL_CHUNK_BYTES, small_state, snapshot, sparse_edit

# --- store wrappers ---------------------------------------------------------------------------


class WrappedStore(Store):
    """Delegates every verb to ``inner``; subclass or set hooks to inject faults or count calls."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.calls: list[tuple[str, str]] = []
        #: (key, bytes returned) of every get, for tests about what a read costs
        self.reads: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _note(self, verb: str, key: str) -> None:
        with self._lock:
            self.calls.append((verb, key))

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        self._note("get", key)
        data = self.inner.get(key, byte_range=byte_range)
        with self._lock:
            self.reads.append((key, len(data)))
        return data

    def get_with_meta(self, key: str) -> GetResult:
        self._note("get_with_meta", key)
        return self.inner.get_with_meta(key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        self._note("get_if_changed", key)
        return self.inner.get_if_changed(key, etag)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        self._note("put", key)
        return self.inner.put(key, data, mode=mode)

    def head(self, key: str) -> ObjectMeta:
        self._note("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        self._note("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._note("delete", key)
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


class HeadPutHook(WrappedStore):
    """Calls ``hook(key, data, mode, real_put)`` for HEAD writes instead of writing directly."""

    def __init__(self, inner: Store, hook: Callable[..., ObjectMeta]):
        super().__init__(inner)
        self.hook = hook

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if key == HEAD_KEY:
            self._note("put", key)
            return self.hook(key, data, mode, lambda: self.inner.put(key, data, mode=mode))
        return super().put(key, data, mode=mode)


# --- looking at and damaging a store -----------------------------------------------------------


def keys(store: Store, prefix: str = "") -> set[str]:
    return {m.key for m in store.list(prefix)}


def read_head(store: Store) -> dict[str, Any]:
    return json.loads(store.get(HEAD_KEY))


def head_manifest(store: Store) -> tuple[str, dict[str, Any]]:
    """(key, JSON document) of the manifest HEAD points to (its in-memory shape)."""
    from testkit.manifest_docs import read_manifest_doc

    h = read_head(store)
    return h["manifest"], read_manifest_doc(store, h["manifest"])


def resign_manifest(store: Store, doc: dict[str, Any], *, point_head: bool = True) -> str:
    """Write ``doc`` as a correctly content-addressed manifest and (optionally) point HEAD at it.

    This models a manifest written by a buggy or newer writer: every SHA-256 matches, so only
    the reader's semantic checks can catch what is wrong inside.
    """
    from testkit.manifest_docs import encode_manifest_doc  # columnar zstd, layout as needed

    data, key = encode_manifest_doc(store, doc)
    digest = sha256_hex(data)
    store.put(key, data, mode="overwrite")
    if point_head:
        h = read_head(store)
        h.update(manifest=key, manifest_sha256=digest, version=doc["version"])
        store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
    return key


def _layouts(store: Store):
    from testkit.manifest_docs import layout_fetcher

    return layout_fetcher(store)


def check_invariants(store: Store) -> list[int]:
    """SPEC §5 I1/I2: HEAD's chain exists, verifies, is consecutive, packs exist and verify.

    Returns the chain's versions, oldest first.
    """
    h = parse_head(store.get(HEAD_KEY))
    versions: list[int] = []
    key, expected = h.manifest, h.manifest_sha256
    while key is not None:
        m = parse_manifest(store.get(key), key, expected, layout=_layouts(store))
        versions.append(m.version)
        for b in m.blobs:
            data = store.get(b.key)
            assert sha256_hex(data) == b.sha256 and len(data) == b.size, f"pack {b.key} damaged"
        key, expected = m.parent_manifest, None
    versions.reverse()
    if h.manifest is not None:
        assert versions[-1] == h.version
    assert versions == list(range(1, len(versions) + 1)), f"chain not consecutive: {versions}"
    return versions


def pull_fresh(url: str, version: int | None = None, **kw: Any) -> dict[str, torch.Tensor]:
    with Subscriber(url, threads=2, **kw) as sub:
        return sub.pull(version)


def publisher(url: str, **kw: Any) -> Publisher:
    kw.setdefault("writer_policy", WriterPolicy(threads=2))
    return Publisher(url, **kw)


def resign_segment(store: Store, doc: dict[str, Any], name: str, index: int, which: str,
                   mutate: Callable[[bytes], bytes]) -> None:
    """Replace one segment's bytes (same length) in a copy of its pack, and fix every SHA-256.

    ``doc`` (a manifest document) is updated in place to reference the new pack; write it with
    :func:`resign_manifest`. Models a writer that encoded garbage but hashed it correctly.
    """
    entry = next(t for t in doc["tensors"] if t["name"] == name)
    chunk = next(c for c in entry["chunks"] if c["index"] == index)
    seg = chunk[which]
    blob = doc["blobs"][seg["blob"]]
    pack = bytearray(store.get(blob["key"]))
    a, b = seg["offset"], seg["offset"] + seg["length"]
    new = mutate(bytes(pack[a:b]))
    assert len(new) == b - a, "resign_segment keeps the segment's length"
    pack[a:b] = new
    digest = sha256_hex(bytes(pack))
    key = f"{blob['key'].rsplit('/', 1)[0]}/{digest}.pack"  # objects/<attempt>/<sha>.pack
    store.put(key, bytes(pack), mode="overwrite")
    blob.update(key=key, sha256=digest, size=len(pack))
    seg["sha256"] = sha256_hex(new)


def mutated(doc: Any, path: tuple, value: Any) -> Any:
    """A deep copy of JSON document ``doc`` with the value at ``path`` (keys and indices) set to ``value``."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def anchor_with_deltas(url: str) -> list[dict[str, torch.Tensor]]:
    """Versions 1 (anchor), 2, 3 (deltas), 4 (an anchor that also carries delta segments)."""
    states = publish_history(url, n=4, anchor_policy=AnchorPolicy(every=3))
    with open_store(url) as store:
        _, d4 = head_manifest(store)
    assert d4["kind"] == "anchor" and d4["delta_base"] == 3
    assert any(c.get("delta") for t in d4["tensors"] for c in t["chunks"])
    return states


def corrupt_anchor_delta(url: str, how: str) -> tuple[str, int]:
    with open_store(url) as store:
        _, d4 = head_manifest(store)
        t, c = next((t, c) for t in d4["tensors"] for c in t["chunks"] if c.get("delta"))
        if how == "garbage":  # hashes correctly, decodes to nonsense or not at all
            resign_segment(store, d4, t["name"], c["index"], "delta", lambda b: b[:-4] + bytes(x ^ 0x5A for x in b[-4:]))
        elif how == "sha":
            c["delta"]["sha256"] = "e" * 64
        else:  # the delta's bytes sit in a pack of their own, which is missing
            c["delta"]["blob"] = len(d4["blobs"])
            d4["blobs"].append({"key": f"objects/{d4['commit_id']}/{'0' * 64}.pack", "role": "d",
                                "size": c["delta"]["offset"] + c["delta"]["length"], "sha256": "0" * 64})
        resign_manifest(store, d4)
    return t["name"], c["index"]


def publish_edits(url: str, state: dict[str, torch.Tensor], n: int, *, seed: int, fraction: float,
                  **kw: Any) -> list[dict[str, torch.Tensor]]:
    """Publish ``state``, then ``n - 1`` sparse edits of it (``fraction`` of the elements each,
    one generator seeded with ``seed``), with two writer threads and the publisher options
    ``kw``; the versions as published."""
    rng = np.random.default_rng(seed)
    out = []
    kw.setdefault("writer_policy", WriterPolicy(threads=2))
    with Publisher(url, **kw) as pub:
        for _ in range(n):
            pub.publish(state)
            out.append(snapshot(state))
            state = sparse_edit(state, rng, fraction)
    return out


def publish_history(url: str, n: int = 4, **kw) -> list[dict[str, torch.Tensor]]:
    """Publish ``n`` versions of a multi-chunk state (anchor, then sparse deltas)."""
    states = [small_state(0, n=4, rows=64)]
    for i in range(1, n):
        states.append(sparse_edit(states[-1], np.random.default_rng(i), 0.02))
    kw.setdefault("layout_policy", LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES))
    with Publisher(url, writer_policy=WriterPolicy(threads=2), **kw) as pub:
        for s in states:
            pub.publish(s)
    return [snapshot(s) for s in states]
