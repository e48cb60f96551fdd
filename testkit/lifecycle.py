"""Published chains for the lifecycle tests (GC, compaction, the history index): publishing a
run, a store whose objects look old, what a version needs, and checks that versions survive."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from deltastore import Publisher, Subscriber
from deltastore.format.history import History
from deltastore.format.models import Index, SquashRef
from deltastore.lifecycle.index import add_squashes, update_index
from deltastore.storage.base import ObjectMeta, Store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, assert_bits_equal, snapshot


def set_index(store: Store, *, squashes: Iterable[SquashRef] = ()) -> Index:
    """Register ``squashes`` in the history index (the compactor's index-only HEAD write)."""
    return update_index(store, History(store), add_squashes(squashes), writer="test")[1]


def publish_run(url: str, versions: int, *, anchor_every: int = 1000, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``versions`` exports of a tiny AdamW fine-tune; their states by version."""
    trainer = TinyTrainer(seed)
    out = {}
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=anchor_every),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        state = trainer.export()
        for _ in range(versions):
            out[pub.publish(state).version] = snapshot(state)
            state = trainer.step()
    return out


DAY = 86400.0


class AgedStore(WrappedStore):
    """Reports the objects named in ``offsets`` as that many seconds older than they are."""

    def __init__(self, inner: Store):
        super().__init__(inner)
        self.offsets: dict[str, float] = {}

    def age_everything(self, seconds: float) -> None:
        for m in self.inner.list(""):
            self.offsets[m.key] = self.offsets.get(m.key, 0.0) + seconds

    def _aged(self, meta: ObjectMeta) -> ObjectMeta:
        off = self.offsets.get(meta.key)
        if not off or meta.last_modified is None:
            return meta
        return dataclasses.replace(meta, last_modified=meta.last_modified - timedelta(seconds=off))

    def head(self, key: str) -> ObjectMeta:
        return self._aged(super().head(key))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return iter([self._aged(m) for m in super().list(prefix)])

    def delete(self, key: str) -> None:
        super().delete(key)
        self.offsets.pop(key, None)


def publish(store: Store, n: int, *, anchor_every: int = 3, trainer: TinyTrainer | None = None,
            states: dict | None = None) -> dict[int, dict]:
    """Publish ``n`` versions; returns {version: state}. Anchors at 1, 1+k, 1+2k, ..."""
    trainer = trainer or TinyTrainer()
    states = {} if states is None else states
    with Publisher(store.url, store=store, anchor_policy=AnchorPolicy(every=anchor_every),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for _ in range(n):
            s = trainer.step()
            states[pub.publish(s).version] = s
    return states


def needs_of(store: Store, version: int) -> set[str]:
    """Every key materializing ``version`` needs (its anchor chain, their packs and layouts)."""
    h = History(store)
    key, m = h.find(version, h.read_head()[0])
    return chain_needs(h, key, m)


def pin_needs_of(store: Store, version: int) -> tuple[set[str], set[str]]:
    """SPEC §11 ``needs_materialize(version)``: the manifests anchor(v) … v with their layouts,
    the anchor's full packs (role ``f``) and every pack of the
    deltas after it. Also returns the anchor's delta packs (role ``d``): materializing v does
    not need them, so a pin alone does not keep them (design 005 D3)."""
    h = History(store)
    key, m = h.find(version, h.read_head()[0])
    needs, anchor_deltas = set(), set()
    for k, mm in h.anchor_chain(key, m):
        needs.add(k)
        if mm.layout is not None:
            needs.add(mm.layout.key)
        for b in mm.blobs:
            (anchor_deltas if mm.kind == "anchor" and b.role == "d" else needs).add(b.key)
    return needs, anchor_deltas - needs


def pull_from_manifest(store: Store, key: str) -> dict:
    """Materialize the version whose manifest is ``key`` (a pin below the floor is not on the
    chain from HEAD any more; the read side finds it through the index's pin record)."""
    with Subscriber(store.url, store=store) as sub:
        m = sub._reader.history.manifest(key)
        sub._reader.resolve = lambda version: (key, m)
        return sub.pull(m.version)


def assert_versions_intact(store: Store, states: dict, versions) -> None:
    with Subscriber(store.url, store=store) as sub:
        for v in versions:
            assert_bits_equal(sub.pull(v), states[v], f"version {v}")


def chain_needs(h: History, key: str, m) -> set[str]:
    out = set()
    for k, mm in h.anchor_chain(key, m):
        out.add(k)
        out.update(mm.references())
    return out
