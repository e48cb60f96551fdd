"""End to end on every backend: publish a training run, read every version back bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore import InvalidStateDictError, Publisher, Subscriber, VersionInfo, VersionNotFoundError
from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore, check_invariants
from testkit.tensors import (
    SMALL_CHUNK_BYTES,
    TinyMLP,
    TinyTrainer,
    assert_bits_equal,
    raw,
    small_state,
    snapshot,
    sparse_edit,
)

#: Versions per end-to-end run: anchors at 1, 4, 7, so a fast-forward from 1 crosses two.
N_VERSIONS = 8
ANCHOR_EVERY = 3


def _is_pack(key: str) -> bool:
    """A pack's key: ``objects/<attempt>/<sha>.pack``."""
    return key.endswith(".pack")


def _open(target, cls, **kw):
    if cls is Publisher:
        kw.setdefault("writer_policy", WriterPolicy(threads=2))
    else:
        kw.setdefault("threads", 2)
    return cls(target.url, storage_options=target.storage_options, **kw)


def test_training_run_roundtrips_on_every_backend(any_store_target) -> None:
    trainer = TinyTrainer(seed=1)
    published: list[dict[str, torch.Tensor]] = []
    infos: list[VersionInfo] = []
    follower = _open(any_store_target, Subscriber)
    followed: dict[str, torch.Tensor] | None = None
    with _open(any_store_target, Publisher, anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
               layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        assert follower.latest() is None
        state = trainer.export()
        for i in range(N_VERSIONS):
            info = pub.publish(state, step=100 + i, metadata={"i": i, "lr": 1e-5, "tags": ["a", "b"]})
            published.append(snapshot(state))
            infos.append(info)
            assert pub.version == i + 1
            # a subscriber that follows every version in place
            if followed is None:
                followed = follower.pull()
            else:
                got = follower.pull_into(followed)
                assert got is not None and got.version == i + 1
            assert_bits_equal(followed, published[-1], f"follower at version {i + 1}")
            assert follower.pull_into(followed) is None
            state = trainer.step()

    # VersionInfo: version 1 first, parents, anchors every ANCHOR_EVERY, step and metadata.
    for i, info in enumerate(infos):
        v = i + 1
        assert info.version == v
        assert info.parent == (None if v == 1 else v - 1)
        expected_anchor = ((v - 1) // ANCHOR_EVERY) * ANCHOR_EVERY + 1
        assert info.kind == ("anchor" if v == expected_anchor else "delta"), v
        assert info.anchor == expected_anchor
        assert info.step == 100 + i
        assert info.metadata == {"i": i, "lr": 1e-5, "tags": ["a", "b"]}
        assert info.writer == infos[0].writer
        assert info.manifest.startswith(f"manifests/{v:012d}-")
        assert info.bytes_stored > 0
    # Deltas store what changed (~1% of bf16 elements), not the whole model.
    assert max(i.bytes_stored for i in infos if i.kind == "delta") < infos[0].bytes_stored / 4
    assert all(0 < i.elements_changed < infos[0].elements_changed / 10 for i in infos if i.kind == "delta")

    with _open(any_store_target, Subscriber) as sub:
        latest = sub.latest()
        assert latest == infos[-1] and latest.metadata == infos[-1].metadata
        assert sub.log() == infos
        for v in range(1, N_VERSIONS + 1):
            assert sub.info(v) == infos[v - 1]
    # Every version, pulled by a fresh subscriber, is bit-identical to what was published; from
    # there, pull_into fast-forwards it to the latest bit-exactly, in place, then has nothing to do.
    for v in range(1, N_VERSIONS + 1):
        with _open(any_store_target, Subscriber) as sub:
            target = sub.pull(v)
            assert_bits_equal(target, published[v - 1], f"pull({v})")
            assert sub.version == v
            if v == N_VERSIONS:
                assert sub.pull_into(target) is None
                continue
            ptrs = {n: t.data_ptr() for n, t in target.items()}
            got = sub.pull_into(target)
            assert got == infos[-1]
            assert_bits_equal(target, published[-1], f"pull_into from {v}")
            assert {n: t.data_ptr() for n, t in target.items()} == ptrs, "pull_into must update in place"
            assert sub.pull_into(target) is None
            assert sub.version == N_VERSIONS
    follower.close()
    with any_store_target.open() as store:
        assert check_invariants(store) == list(range(1, N_VERSIONS + 1))


def test_latest_is_one_conditional_get_when_nothing_changed(any_store_target) -> None:
    with _open(any_store_target, Publisher) as pub:
        pub.publish(small_state(0), step=1)
        store = WrappedStore(any_store_target.open())
        with Subscriber(any_store_target.url, store=store, threads=2) as sub:
            first = sub.latest()
            assert first is not None and first.version == 1
            store.calls.clear()
            for _ in range(3):
                assert sub.latest() == first
            # HEAD unchanged: one conditional GET each, and the manifest comes from the cache.
            assert store.calls == [("get_if_changed", HEAD_KEY)] * 3
            info = pub.publish(small_state(1), step=2)
            assert sub.latest() == info


def test_pull_into_module_updates_parameters_in_place() -> None:
    trainer = TinyTrainer(seed=2)
    url = "memory://e2e-module"
    module = TinyMLP().to(torch.bfloat16)
    ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
    params = dict(module.named_parameters())
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub, Subscriber(url, threads=2) as sub:
        # the parameter names of the trained model; extras live elsewhere
        names = set(module.state_dict())
        for i in range(4):
            state = {n: t for n, t in (trainer.export() if i == 0 else trainer.step()).items() if n in names}
            pub.publish(state)
            assert sub.pull_into(module).version == i + 1
            assert_bits_equal(module.state_dict(), state, f"module at version {i + 1}")
            assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs
            assert all(p is params[n] for n, p in module.named_parameters())
        assert sub.pull_into(module) is None


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_stay_tied_and_exact() -> None:
    url = "memory://e2e-tied"
    src = _Tied().to(torch.bfloat16)
    dst = _Tied().to(torch.bfloat16)
    assert src.state_dict()["head.weight"].data_ptr() == src.state_dict()["embed.weight"].data_ptr()
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub, Subscriber(url, threads=2) as sub:
        for v in range(1, 5):
            with torch.no_grad():
                src.embed.weight.view(-1)[v * 7 : v * 7 + 3] += 1.0
            pub.publish(src.state_dict())
            assert sub.pull_into(dst).version == v
            assert dst.head.weight is dst.embed.weight
            assert raw(dst.embed.weight) == raw(src.embed.weight)
        # A plain dict whose two names alias one storage is handled the same way.
        alias = sub.pull(1)
        alias["head.weight"] = alias["embed.weight"]
        with Subscriber(url, threads=2) as sub2:
            sub2.pull(1)
            sub2.pull_into(alias)
        assert raw(alias["embed.weight"]) == raw(src.embed.weight)


def test_subscriber_one_version_behind_skips_the_snapshot_of_an_anchor() -> None:
    """An anchor with a parent carries deltas, so a follower does not download the full model."""
    url = "memory://e2e-anchor-deltas"
    state = small_state(3, n=6, rows=256)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=1)) as pub:
        pub.publish(state)
        store = WrappedStore(open_store(url))
        sub = Subscriber(url, store=store, threads=2)
        target = sub.pull()
        state = {n: t.clone() for n, t in state.items()}
        state["t0"][3, 3] += 1
        info = pub.publish(state)
        assert info.kind == "anchor"
        store.reads.clear()
        assert sub.pull_into(target).version == 2
        assert_bits_equal(target, state)
        pack_bytes = sum(n for k, n in store.reads if _is_pack(k))
        assert 0 < pack_bytes < info.bytes_stored / 10, (pack_bytes, info.bytes_stored)
        sub.close()


def test_version_lookups_fail_cleanly() -> None:
    url = "memory://e2e-lookups"
    with Subscriber(url) as sub:
        assert sub.latest() is None and sub.log() == []
        with pytest.raises(VersionNotFoundError):
            sub.pull()
        with pytest.raises(VersionNotFoundError):
            sub.pull_into(small_state(0))
    with Publisher(url) as pub:
        pub.publish(small_state(0))
        pub.publish(small_state(1))
    with Subscriber(url) as sub:
        for v in (0, -1, 3, 10**6):
            with pytest.raises(VersionNotFoundError):
                sub.pull(v)
            with pytest.raises(VersionNotFoundError):
                sub.info(v)
        target = sub.pull(2)
        with pytest.raises(VersionNotFoundError):  # pull_into cannot go back
            sub.pull_into(target, version=1)
        assert_bits_equal(target, small_state(1))


def test_pull_into_before_any_pull_overwrites_a_same_layout_target() -> None:
    url = "memory://e2e-first-pull-into"
    with Publisher(url) as pub:
        pub.publish(small_state(0))
        pub.publish(small_state(1))
    target = small_state(7)
    ptrs = {n: t.data_ptr() for n, t in target.items()}
    with Subscriber(url) as sub:
        assert sub.pull_into(target).version == 2
        assert sub.pull_into(target) is None
    assert_bits_equal(target, small_state(1))
    assert {n: t.data_ptr() for n, t in target.items()} == ptrs


def test_unchanged_publish_is_an_empty_delta() -> None:
    url = "memory://e2e-noop"
    state = small_state(0)
    with Publisher(url, writer_policy=WriterPolicy(skip_unchanged=False)) as pub, Subscriber(url) as sub:  # the empty delta on purpose
        pub.publish(state)
        target = sub.pull()
        info = pub.publish(state)
        assert (info.version, info.kind, info.tensors_changed, info.elements_changed) == (2, "delta", 0, 0)
        assert sub.pull_into(target).version == 2
        assert_bits_equal(target, state)


def test_publishing_a_module_updated_in_place_keeps_old_versions_intact() -> None:
    """The publisher must copy what it keeps: a trainer updates the same tensors every step."""
    url = "memory://e2e-in-place"
    model = TinyMLP().to(torch.bfloat16)
    published = []
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for i in range(4):
            with torch.no_grad():
                model.fc1.weight.view(-1)[i * 11] += 1.0
                model.fc2.bias.view(-1)[i] -= 2.0
            pub.publish(model)
            published.append(snapshot(model.state_dict()))
    with Subscriber(url, threads=2) as sub:
        for v, state in enumerate(published, start=1):
            assert_bits_equal(sub.pull(v), state, f"version {v}")


def _renamed(s):
    s = dict(s)
    s["t0.renamed"] = s.pop("t0")
    return s


def _reshaped(s):
    return {**s, "t1": s["t1"].reshape(16, 16)}


def _retyped(s):
    return {**s, "t2": s["t2"].to(torch.float64)}


def _added(s):
    return {**s, "t9": torch.zeros(3)}


def _removed(s):
    s = dict(s)
    del s["t3"]
    return s


LAYOUT_CHANGES = [(_renamed, "t0"), (_reshaped, "t1"), (_retyped, "t2"), (_added, "t9"), (_removed, "t3")]


@pytest.mark.parametrize("change, name", LAYOUT_CHANGES, ids=[c.__name__.strip("_") for c, _ in LAYOUT_CHANGES])
def test_layout_change_is_refused_without_anchor(change, name: str) -> None:
    from deltastore import LayoutMismatchError
    from testkit.stores import keys

    url = f"memory://e2e-layout-{name}-{change.__name__}"
    old = small_state(0)
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(old)
        before = keys(pub.store)
        with pytest.raises(LayoutMismatchError, match=name):
            pub.publish(change(small_state(1)))
        assert keys(pub.store) == before and pub.version == 1
        assert pub.publish(small_state(1)).kind == "delta"
    # a new publisher (reading the head version back) refuses it the same way
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        with pytest.raises(LayoutMismatchError, match=name):
            pub.publish(change(small_state(2)))
        assert pub.version == 2


@pytest.mark.parametrize("change, name", LAYOUT_CHANGES, ids=[c.__name__.strip("_") for c, _ in LAYOUT_CHANGES])
def test_layout_change_with_anchor(change, name: str) -> None:
    from deltastore import LayoutMismatchError

    url = f"memory://e2e-relayout-{name}-{change.__name__}"
    old, new = small_state(0), change(small_state(1))
    newer = {n: t.clone() for n, t in new.items()}
    bits_view = next(iter(newer.values()))
    bits_view.view(-1)[0] = bits_view.view(-1)[1]
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub, Subscriber(url, threads=2) as sub:
        pub.publish(old)
        target = sub.pull()
        before = snapshot(target)
        info = pub.publish(new, anchor=True)
        assert (info.version, info.kind, info.anchor) == (2, "anchor", 2)
        assert pub.publish(newer).kind == "delta"  # the new layout is now the base
        with pytest.raises(LayoutMismatchError):
            sub.pull_into(target)
        assert_bits_equal(target, before)
        assert sub.version == 1
        fresh = sub.pull()
        assert_bits_equal(fresh, newer)
        assert sub.pull_into(fresh) is None
        assert_bits_equal(sub.pull(2), new)
        assert_bits_equal(sub.pull(1), old)
        # pull_into from the new layout's anchor works
        t2 = sub.pull(2)
        assert sub.pull_into(t2).version == 3
        assert_bits_equal(t2, newer)


def test_pull_into_far_behind_fetches_the_snapshot_when_deltas_cost_more() -> None:
    """SPEC §7.5: per chunk, the cheaper of the deltas since h and the latest anchor's snapshot."""
    url = "memory://e2e-cheaper-path"
    g = torch.Generator().manual_seed(0)
    n = 96 * 1024  # 384 KiB of incompressible float32: larger than the range-coalescing gap
    states = [{"dense": torch.randn(n, generator=g), "sparse": torch.zeros(1024, dtype=torch.bfloat16)}]
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=5)) as pub:
        infos = [pub.publish(states[0])]
        for i in range(1, 7):  # the dense tensor is rewritten every version; anchor at 6
            s = {"dense": torch.randn(n, generator=g), "sparse": states[-1]["sparse"].clone()}
            s["sparse"][i] = 1.0
            states.append(s)
            infos.append(pub.publish(s))
    assert [i.kind for i in infos] == ["anchor"] + ["delta"] * 4 + ["anchor", "delta"]
    store = WrappedStore(open_store(url))
    with Subscriber(url, store=store, threads=2) as sub:
        target = sub.pull(1)
        store.reads.clear()
        assert sub.pull_into(target).version == 7
        assert_bits_equal(target, states[-1])
    pack_bytes = sum(k for key, k in store.reads if _is_pack(key))
    # snapshot at 6 + delta at 7 is about 2 x 384 KiB; the 6 deltas since 1 would be about 6 x.
    assert pack_bytes < 3 * n * 4, pack_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_and_cuda_target() -> None:
    """Publishing GPU tensors and fast-forwarding a GPU module in place (and rolling back)."""
    import json

    from testkit.stores import head_manifest, resign_manifest

    url = "memory://e2e-cuda"
    trainer = TinyTrainer(seed=5)
    module = TinyMLP().to(torch.bfloat16).cuda()
    names = set(module.state_dict())
    ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
    published = []
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub, Subscriber(url, threads=2) as sub:
        for i in range(4):
            state = {n: t.cuda() for n, t in (trainer.export() if i == 0 else trainer.step()).items() if n in names}
            pub.publish(state)
            published.append(snapshot(state))
            assert sub.pull_into(module).version == i + 1
            assert_bits_equal(module.state_dict(), published[-1])
            assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs
        pub.publish({n: t.cuda() for n, t in trainer.step().items() if n in names})
        with open_store(url) as store:
            _, doc = head_manifest(store)
            doc["tensors"][-1]["chunks"][-1]["digest"] = "0" * 32
            resign_manifest(store, json.loads(json.dumps(doc)))
        from deltastore import IntegrityError

        with pytest.raises(IntegrityError):
            sub.pull_into(module)
        assert_bits_equal(module.state_dict(), published[-1], "GPU target after a failed pull_into")


def test_pull_into_across_a_restart_with_other_chunking(tmp_path) -> None:
    """A restarted publisher with another chunk size writes an anchor with other chunk_rows."""
    url = str(tmp_path / "store")
    states = [small_state(0, rows=64)]
    states.append(sparse_edit(states[-1], np.random.default_rng(1)))
    with Publisher(url, layout_policy=LayoutPolicy(chunk_bytes=1024)) as pub:
        pub.publish(states[0])
    sub = Subscriber(url)
    target = sub.pull()
    ptrs = {k: t.data_ptr() for k, t in target.items()}
    with Publisher(url, writer_policy=WriterPolicy(resume=False), layout_policy=LayoutPolicy(chunk_bytes=4096)) as pub:
        assert pub.publish(states[1]).kind == "anchor"
    assert sub.pull_into(target) is not None
    assert_bits_equal(target, states[1])
    assert all(t.data_ptr() == ptrs[k] for k, t in target.items())
    sub.close()


def test_metadata_must_be_strict_json(tmp_path) -> None:
    with Publisher(str(tmp_path / "s")) as pub:
        with pytest.raises(InvalidStateDictError, match="JSON"):
            pub.publish(small_state(0), metadata={"loss": float("nan")})
        assert pub.version == 0


def test_bytes_fetched_counts_what_a_pull_into_reads(tmp_path) -> None:
    url = str(tmp_path / "store")
    states = [small_state(0, rows=64)]
    states.append(sparse_edit(states[-1], np.random.default_rng(3)))
    with Publisher(url) as pub:
        first = pub.publish(states[0])
        second = pub.publish(states[1])
    with Subscriber(url) as sub:
        sub.pull(1)
        assert sub.bytes_fetched == first.bytes_stored  # the whole anchor, nothing else
        sub.pull_into(sub.pull(1))
        after_anchor = sub.bytes_fetched
        assert after_anchor - 2 * first.bytes_stored == second.bytes_stored  # only the delta


def test_cached_chunk_tables_are_out_of_the_collectors_sight(tmp_path):
    """A parsed manifest's chunk-table entries (kept in History's cache) are untracked by the
    cyclic collector when the native extension is there (design 006), read the
    same as a fresh parse, and still go away with the cache entry that held them."""
    import gc
    import weakref

    from deltastore._util import kernels
    from deltastore.format.history import History
    from deltastore.format.manifest import parse_manifest

    url = str(tmp_path / "untracked")
    state = small_state(0, n=2, rows=16)
    with Publisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(state)
        state = {k: v.clone() for k, v in state.items()}
        next(iter(state.values()))[3, 0] += 1
        pub.publish(state)
    store = open_store(url)
    history = History(store, cache_entries=1)
    head = history.read_head()[0]
    m = history.manifest(head.manifest)
    fresh = parse_manifest(store.get(head.manifest), head.manifest, None, layout=history.layout)
    assert m == fresh and m.tensors == fresh.tensors
    entries = [t for t in m.tensors] + [c for t in m.tensors for c in t.chunks]
    segments = [s for t in m.tensors for c in t.chunks for s in (c.full, c.delta) if s is not None]
    assert entries and segments
    tracked = [gc.is_tracked(o) for o in [*entries, *segments]]
    if kernels.untrack is None:
        assert all(tracked)
    else:
        assert not any(tracked)
        assert not any(gc.is_tracked(t.__dict__) or gc.is_tracked(t.chunks) for t in m.tensors)
    gone = weakref.ref(m.tensors[0].chunks[0])
    del m, entries, segments
    history.manifest(fresh.parent_manifest)  # evicts the head's manifest (one entry kept)
    gc.collect()
    assert gone() is None


def test_chunk_table_entries_can_hold_nothing_that_could_close_a_cycle():
    """History untracks chunk-table entries on the premise that they form a tree: their fields
    hold ints, strings, tuples of those, None and other entries, never a mutable container. A
    field of another kind added to these models must revisit models.untrack_entries."""
    import types
    import typing

    from deltastore.format.models import ChunkEntry, SegmentRef, TensorEntry

    entries = (TensorEntry, ChunkEntry, SegmentRef)

    def leaves(tp):
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (tuple, typing.Union, types.UnionType):
            return [leaf for a in args if a is not Ellipsis for leaf in leaves(a)]
        return [tp]

    for cls in entries:
        for name, field in cls.model_fields.items():
            for leaf in leaves(field.annotation):
                assert leaf in (int, str, type(None), *entries), f"{cls.__name__}.{name}: {leaf!r}"


def test_a_long_follower_keeps_a_bounded_number_of_parsed_manifests(tmp_path):
    """A Subscriber that follows many versions keeps at most History.cache_entries parsed
    manifests (plus the held chain it needs), and every pull stays bit-exact."""
    url = str(tmp_path / "long")
    state = small_state(0, n=2, rows=16)
    states = []
    with Publisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=5)) as pub:
        for i in range(30):
            state = {k: v.clone() for k, v in state.items()}
            next(iter(state.values()))[i % 16, 0] += 1
            pub.publish(state)
            states.append(snapshot(state))
    with Subscriber(url, threads=1) as sub:
        history = sub._reader.history
        history.cache_entries = 4
        target = sub.pull(1)
        for v in range(2, 31):
            assert sub.pull_into(target, v).version == v
            assert len(history._manifests) <= 4
        assert_bits_equal(target, states[-1])
        assert [i.version for i in sub.log()] == list(range(1, 31))
        assert len(history._manifests) <= 4
