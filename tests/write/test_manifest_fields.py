"""The publisher's schema-3 writes (design 005 D1, D3, D4, D6, D7, D10).

Every field a schema-3 manifest carries is checked against what it must be, computed here from
the manifests themselves: pack keys and roles, skip pointers, chain start, cumulative delta
bytes, the anchor's manifest, the layout object and its reuse, and the anchors the cost policy
writes. Also: HEAD keeps its history index across commits, a commit rebases over an
index-only HEAD change, and an attempt past its deadline is abandoned.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import deltastore.write.chain as chain_mod
from deltastore import CommitAbandonedError, ConflictError, Publisher, Subscriber
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, object_key, sha256_hex
from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S, Index, Layout, Manifest, ObjectRef, dump
from deltastore.format.objects import decode_object, encode_object
from deltastore.format.parse import parse_head
from deltastore.layout.tensors import bits
from deltastore.storage import open_store
from deltastore.storage.base import IfMatch, ObjectMeta, PutMode
from deltastore.write.commit import REBASE_ATTEMPTS, new_commit_id, now
from deltastore.write.policy import DEFAULT_ANCHOR_EVERY, AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import HeadPutHook, WrappedStore, check_invariants
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal, snapshot


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 16, generator=g),
        "b": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "i": torch.arange(256, dtype=torch.int64).reshape(32, 8),
    }


def _step(state: dict[str, torch.Tensor], rng: np.random.Generator, fraction: float = 0.05) -> dict[str, torch.Tensor]:
    """A training step: about ``fraction`` of the float elements get new bits."""
    out = {}
    for n, t in state.items():
        c = t.clone()
        if c.is_floating_point():
            b = bits(c)
            k = max(1, int(b.size * fraction))
            idx = rng.integers(0, b.size, size=k)
            b[idx] = rng.integers(0, np.iinfo(b.dtype).max, size=k, dtype=b.dtype, endpoint=True)
        out[n] = c
    return out


def _chain(store) -> dict[int, tuple[str, Manifest]]:
    """Every version on HEAD's chain: version → (manifest key, manifest)."""
    history = History(store)
    head, _ = history.read_head()
    out = {}
    key = head.manifest
    while key is not None:
        m = history.manifest(key)
        out[m.version] = (key, m)
        key = m.parent_manifest
    return out


def _layout(store, ref: ObjectRef) -> Layout:
    return decode_object(Layout, store.get(ref.key), ref.key, ref.sha256)


def _check_schema3_fields(store, *, ratio: float | None = None, layout_changes: frozenset[int] = frozenset(),
                          max_attempt_s: int = DEFAULT_MAX_ATTEMPT_S) -> dict[int, tuple[str, Manifest]]:
    """Assert every schema-3 field of every version; ``ratio``: the cost policy's β, to check
    where anchors are."""
    chain = _chain(store)
    key = {v: k for v, (k, _) in chain.items()}
    for v in sorted(chain):
        _, m = chain[v]
        where = f"version {v}"
        assert m.schema_ == 3, where
        # D1: packs under this attempt, one role each, delta packs first
        roles = "".join(b.role for b in m.blobs)
        assert roles == "d" * roles.count("d") + "f" * roles.count("f"), (where, roles)
        assert all(b.key == object_key(m.commit_id, b.sha256, ".pack") for b in m.blobs), where
        for t in m.tensors:
            for c in t.chunks:
                assert c.delta is None or m.blobs[c.delta.blob].role == "d", where
                assert c.full is None or m.blobs[c.full.blob].role == "f", where
        assert m.stats.delta_bytes == sum(b.size for b in m.blobs if b.role == "d"), where
        assert m.stats.full_bytes == sum(b.size for b in m.blobs if b.role == "f"), where
        assert (m.kind == "anchor") == (m.stats.full_bytes > 0), where
        # D6: skip pointers, exact
        assert m.back == tuple(key[v - 2**j] for j in range(1, 64) if v - 2**j >= 1), (where, m.back)
        # chain_start: the latest version ≤ v without a delta base
        starts = [u for u in range(1, v + 1) if chain[u][1].delta_base is None]
        assert m.chain_start == max(starts), where
        assert m.stats.cum_delta_bytes == sum(chain[u][1].stats.delta_bytes for u in range(m.chain_start + 1, v + 1)), where
        assert m.anchor_manifest == (None if m.kind == "anchor" else key[m.anchor]), where
        assert m.max_attempt_s == max_attempt_s, where
        # the layout object: the tensors of the version's anchor, reused until the layout changes
        a = chain[m.anchor][1]
        layout = _layout(store, m.layout)
        assert layout.name == tuple(t.name for t in a.tensors), where
        assert layout.shape == tuple(t.shape for t in a.tensors), where
        assert layout.chunk_rows == tuple(t.chunk_rows for t in a.tensors), where
        assert layout.dtype == tuple(t.dtype for t in a.tensors), where
        assert (layout.chunk_cols, layout.parts) == ((0,) * len(a.tensors), 0), where
        if v > 1:
            parent = chain[v - 1][1]
            assert (m.layout == parent.layout) == (v not in layout_changes), where
            assert m.layout.key.startswith(f"objects/{m.commit_id}/") == (v in layout_changes), where
        else:
            assert m.layout.key == object_key(m.commit_id, m.layout.sha256, ".layout.json.zst"), where
        # D7: under the cost policy, an anchor exactly when the deltas since the anchor reach β·F
        if ratio is not None and v > 1 and v not in layout_changes:
            p = chain[v - 1][1]
            pa = chain[p.anchor][1]
            since = p.stats.cum_delta_bytes - pa.stats.cum_delta_bytes
            assert (m.kind == "anchor") == (since > 0 and since >= ratio * pa.stats.full_bytes), (where, since, pa.stats.full_bytes)
    head = parse_head(store.get(HEAD_KEY))
    assert head.schema_ == 3 and head.manifest == key[max(chain)]
    return chain


# --- D1/D6/D7: every field over a long run ------------------------------------------------------


def test_every_schema3_field_over_70_versions_with_a_restart_and_a_layout_change(monkeypatch) -> None:
    monkeypatch.setattr(chain_mod, "LINK_CACHE_ENTRIES", 3)  # older skip pointers are read back from the store
    url = "memory://writer-70"
    rng = np.random.default_rng(1)
    state = _state()
    expected = {}
    pub = Publisher(url, writer_policy=WriterPolicy(threads=2),
                    layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES))
    try:
        for v in range(1, 71):
            if v == 35:  # a restart: the next publisher derives everything from the store
                pub.close()
                pub = Publisher(url, writer_policy=WriterPolicy(threads=2),
                                layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES))
            if v == 50:  # a layout change: a new tensor
                state = {**state, "new": torch.ones(16, 4)}
            state = _step(state, rng)
            info = pub.publish(state, anchor=v == 50)
            assert info.version == v
            expected[v] = snapshot(state)
    finally:
        pub.close()
    store = open_store(url)
    chain = _check_schema3_fields(store, ratio=1.0, layout_changes=frozenset({50}))
    anchors = [v for v, (_, m) in chain.items() if m.kind == "anchor"]
    # the cost policy wrote anchors besides v1 and the layout change, and not at every version
    assert len(anchors) >= 4 and len(anchors) < 35, anchors
    with Subscriber(url, threads=2) as sub:
        for v in (1, 2, 34, 35, 36, 49, 50, 51, 70):
            assert_bits_equal(sub.pull(v), expected[v], f"version {v}")
    assert check_invariants(store) == list(range(1, 71))


def test_schema3_fields_on_every_backend(any_store_target) -> None:
    rng = np.random.default_rng(2)
    state = _state(3)
    with Publisher(any_store_target.url, storage_options=any_store_target.storage_options,
                   writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES),
                   anchor_policy=AnchorPolicy(cost_ratio=0.3)) as pub:
        for _ in range(9):
            state = _step(state, rng)
            pub.publish(state)
    with any_store_target.open() as store:
        chain = _check_schema3_fields(store, ratio=0.3)
    assert sum(m.kind == "anchor" for _, m in chain.values()) >= 2


def test_cost_ratio_sets_how_often_anchors_come_and_anchor_every_caps_it() -> None:
    def run(tag: str, **kw) -> list[str]:
        rng = np.random.default_rng(3)
        state = _state()
        url = f"memory://writer-ratio-{tag}"
        with Publisher(url, writer_policy=WriterPolicy(threads=1),
                       layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), **kw) as pub:
            kinds = []
            for _ in range(16):
                state = _step(state, rng)
                kinds.append(pub.publish(state).kind)
        policy = kw.get("anchor_policy", AnchorPolicy())
        _check_schema3_fields(open_store(url), ratio=policy.cost_ratio if policy.every is None else None)
        return kinds

    never = run("never", anchor_policy=AnchorPolicy(cost_ratio=1e9))
    assert never == ["anchor"] + ["delta"] * 15
    often = run("often", anchor_policy=AnchorPolicy(cost_ratio=0.05))
    assert often.count("anchor") > 4
    capped = run("capped", anchor_policy=AnchorPolicy("cost", cost_ratio=1e9, every=5))
    assert [i + 1 for i, k in enumerate(capped) if k == "anchor"] == [1, 6, 11, 16]
    every = run("every", anchor_policy=AnchorPolicy(every=4))  # ``every`` alone: the fixed cadence
    assert [i + 1 for i, k in enumerate(every) if k == "anchor"] == [1, 5, 9, 13]


def test_anchor_and_writer_policies_are_checked() -> None:
    for bad in ({"max_attempt_s": DEFAULT_MAX_ATTEMPT_S + 1}, {"max_attempt_s": 0}, {"threads": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WriterPolicy(**bad)
    for bad in ({"cost_ratio": 0}, {"cost_ratio": float("nan")}, {"rule": "sometimes"}, {"every": 0}):
        with pytest.raises(ValueError, match="anchor"):
            AnchorPolicy(**bad)
    with pytest.raises(TypeError, match=r"anchor_policy must be AnchorPolicy\(...\), got 'every'"):
        Publisher("memory://writer-args", anchor_policy="every")  # the keyword of old, refused before any IO
    with Publisher("memory://writer-args-ok", anchor_policy=AnchorPolicy(every=7)) as pub:
        assert (pub.anchor_policy.rule, pub.anchor_policy.every) == ("every", 7)
    with Publisher("memory://writer-args-ok2") as pub:
        assert (pub.anchor_policy.rule, pub.anchor_policy.every) == ("cost", None)
    assert AnchorPolicy("every").every == DEFAULT_ANCHOR_EVERY
    assert AnchorPolicy("cost", every=5) == AnchorPolicy(rule="cost", every=5)  # a cap on the cost rule


# --- HEAD's index: kept across commits, rebased over ---------------------------------------------


def _index_only_write(store, *, generation: int) -> ObjectRef:
    """What GC or ``pin`` does (design 005 D4): a new index object, and HEAD rewritten with
    only ``index`` (and ``updated``) changed, by CAS."""
    res = store.get_with_meta(HEAD_KEY)
    head = parse_head(res.data)
    attempt = new_commit_id()
    index = Index(lineage=head.lineage, generation=generation, floor=1, writer="gc-test", created=now())
    data = encode_object(index)
    ref = ObjectRef(key=object_key(attempt, sha256_hex(data), ".index.json.zst"), sha256=sha256_hex(data))
    store.put(ref.key, data, mode="create")
    store.put(HEAD_KEY, dump(head.model_copy(update={"index": ref, "updated": now()})), mode=IfMatch(res.meta.etag))
    return ref


def test_head_keeps_the_index_across_commits(any_store_target) -> None:
    rng = np.random.default_rng(4)
    state = _state()
    with Publisher(any_store_target.url, storage_options=any_store_target.storage_options,
                   writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
        with any_store_target.open() as store:
            ref = _index_only_write(store, generation=1)
            for v in (2, 3):
                state = _step(state, rng)
                info = pub.publish(state)  # its base HEAD's ETag changed: the commit rebases once
                assert info.version == v
                head = parse_head(store.get(HEAD_KEY))
                assert (head.version, head.index, head.schema_) == (v, ref, 3)


def test_commit_rebases_over_an_index_only_head_change() -> None:
    """GC writes HEAD (index only) between the publisher's read of HEAD and its CAS: the
    commit retries on the new ETag with the new index instead of failing as a conflict."""
    url = "memory://writer-rebase"
    inner = open_store(url)
    written: list[ObjectRef] = []
    raced: set[int] = set()

    def race(key: str, data: bytes, mode: PutMode, real_put) -> ObjectMeta:
        version = parse_head(data).version
        if isinstance(mode, IfMatch) and version >= 2 and version not in raced:  # once per version
            raced.add(version)
            written.append(_index_only_write(inner, generation=len(written) + 1))  # lands first
        return real_put()

    store = HeadPutHook(inner, race)
    state = _state()
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
        state = _step(state, np.random.default_rng(5))
        info = pub.publish(state)
        assert info.version == 2
        assert len(written) == 1
        head = parse_head(inner.get(HEAD_KEY))
        assert (head.version, head.manifest, head.index) == (2, info.manifest, written[0])
        state = _step(state, np.random.default_rng(6))
        assert pub.publish(state).version == 3  # a second race, a second rebase
        assert parse_head(inner.get(HEAD_KEY)).index == written[1]
    assert_bits_equal(Subscriber(url).pull(3), state)


def test_commit_gives_up_when_the_index_keeps_changing() -> None:
    url = "memory://writer-rebase-loop"
    inner = open_store(url)
    races = []

    def race(key: str, data: bytes, mode: PutMode, real_put) -> ObjectMeta:
        if isinstance(mode, IfMatch) and parse_head(data).version >= 2:
            races.append(_index_only_write(inner, generation=len(races) + 1))
        return real_put()

    state = _state()
    with Publisher(url, store=HeadPutHook(inner, race), writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state)
        with pytest.raises(ConflictError, match="index"):
            pub.publish(_step(state, np.random.default_rng(7)))
    assert len(races) == REBASE_ATTEMPTS + 1
    head = parse_head(inner.get(HEAD_KEY))
    assert (head.version, head.index) == (1, races[-1])  # nothing committed, the index is GC's


# --- D3: the attempt deadline -----------------------------------------------------------------


class _SlowPacks(WrappedStore):
    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if key.endswith(".pack"):
            time.sleep(self.delay_s)
        return super().put(key, data, mode=mode)


def test_an_attempt_past_its_deadline_is_abandoned_and_the_next_publish_is_a_new_attempt() -> None:
    url = "memory://writer-deadline"
    store = _SlowPacks(open_store(url), delay_s=0.0)
    state = _state()
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=1, max_attempt_s=0.5)) as pub:
        pub.publish(state)
        head_before = parse_head(store.get(HEAD_KEY))
        store.delay_s = 0.6  # the uploads outlast the deadline
        newer = _step(state, np.random.default_rng(8))
        with pytest.raises(CommitAbandonedError) as info:
            pub.publish(newer)
        assert isinstance(info.value, TimeoutError) and info.value.version == 2
        assert parse_head(store.get(HEAD_KEY)) == head_before  # HEAD was never written
        abandoned = info.value.commit_id
        store.delay_s = 0.0
        done = pub.publish(newer)
        assert done.version == 2
    chain = _chain(store)
    m = chain[2][1]
    assert m.commit_id != abandoned and m.max_attempt_s == 1
    assert all(b.key.startswith(f"objects/{m.commit_id}/") for b in m.blobs)
    assert_bits_equal(Subscriber(url).pull(2), newer)


def test_collected_old_manifests_shorten_back_but_never_stop_a_publish(monkeypatch) -> None:
    """Skip pointers are hints: once GC deleted the manifests below its floor (an anchor), a
    publisher that would have to read one to derive ``back`` writes a prefix and commits."""
    monkeypatch.setattr(chain_mod, "LINK_CACHE_ENTRIES", 2)
    url = "memory://writer-collected"
    rng = np.random.default_rng(10)
    state = _state()
    with Publisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(cost_ratio=1e9)) as pub:
        for v in range(1, 12):
            state = _step(state, rng)
            pub.publish(state, anchor=v == 9)
    store = open_store(url)
    chain = _chain(store)
    for v in range(1, 9):  # what GC deletes below a floor of 9
        store.delete(chain[v][0])
    with Publisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(cost_ratio=1e9)) as pub:  # a restart: nothing cached
        state = _step(state, rng)
        assert pub.publish(state).version == 12
    m12 = History(store).manifest(parse_head(store.get(HEAD_KEY)).manifest)
    # key(8) comes from version 10's back; key(4) would be back[1] of version 8, which is gone
    assert m12.back == (chain[10][0], chain[8][0]), m12.back
    assert_bits_equal(Subscriber(url).pull(12), state)
