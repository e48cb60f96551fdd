"""Serving streams (SPEC §15): a publisher's formats, each its own chain, committed by one HEAD
write; a subscriber of one format reads that stream alone, verified like any version."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import Publisher, Subscriber
from deltastore._util import kernels
from deltastore.errors import (
    CorruptObjectError,
    IntegrityError,
    StorageError,
    UnknownFormatError,
    VersionCollectedError,
    VersionNotFoundError,
)
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY
from deltastore.lifecycle.gc import collect
from deltastore.lifecycle.index import index_content, pin, update_index
from deltastore.serving.formats import derive, serving_format
from deltastore.storage import open_store
from deltastore.storage.prefixed import PrefixedStore
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from testkit.hypo import examples
from testkit.manifest_docs import read_manifest_doc
from testkit.publishing import publish_in_turn
from testkit.stores import HeadPutHook, WrappedStore, keys, read_head, resign_manifest
from testkit.tensors import assert_bits_equal

FORMATS = ["bf16", "fp8-block128", "mxfp8"]
LAYOUT = LayoutPolicy(chunk_bytes=16 * 1024)
#: The layouts the incremental derivation takes its two paths in: chunks across blocks, chunked
#: unlike in the stream and the store (two steps: ``requant_delta`` walks after the store's
#: encode), and every tensor one chunk (one step: ``requant_chunk`` on the store's encode threads).
WALKS = pytest.mark.parametrize(("layout", "walk"), [(LAYOUT, "requant_delta"), (LayoutPolicy(), "requant_chunk")],
                                ids=["two-steps", "one-step"])


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(96, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(160, 96, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(96, 288, generator=g) * 0.02).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
    }


def step(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-2) -> dict[str, torch.Tensor]:
    """An optimizer-like update: every weight moves a little (most bf16 values keep their bits)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {n: (t.float() - lr * torch.randn(t.shape, generator=g).sign() * t.float().abs()).to(t.dtype)
            for n, t in state.items()}


def training(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` states: the model, then ``n - 1`` steps of it."""
    states = [model()]
    for i in range(1, n):
        states.append(step(states[-1], i))
    return states


def publish_run(url: str, n: int, **kw) -> list[dict[str, torch.Tensor]]:
    states = training(n)
    publish_in_turn(url, (FORMATS, states), layout_policy=LAYOUT, **kw)
    return states


def test_every_format_reads_back_bit_identical_to_its_reference_at_every_version(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = publish_run(url, 4)
    for name in ("fp8-block128", "mxfp8"):
        fmt = serving_format(name)
        with Subscriber(url, format=name) as sub:
            for v, s in enumerate(states, start=1):
                assert_bits_equal(sub.pull(v), derive(s, fmt), f"{name} v{v}")
            target = sub.pull(1)  # then fast-forward in place, version by version
            for v in range(2, len(states) + 1):
                assert sub.pull_into(target, version=v)
                assert_bits_equal(target, derive(states[v - 1], fmt), f"{name} pull_into v{v}")
    with Subscriber(url, format="bf16") as sub:  # a bf16 state is itself the bf16 format
        assert_bits_equal(sub.pull(), states[-1])
    store = open_store(url)
    key, doc = read_manifest_doc_head(store)
    assert doc["schema"] == 5 and doc["stream"] == "bf16"
    assert [s["format"] for s in doc["streams"]] == ["fp8-block128", "mxfp8"]
    for s in doc["streams"]:
        assert s["key"].startswith(f"streams/{s['format']}/manifests/{doc['version']:012d}-")


def read_manifest_doc_head(store):
    h = read_head(store)
    return h["manifest"], read_manifest_doc(store, h["manifest"])


def test_a_format_subscriber_reads_no_byte_of_another_format(tmp_path) -> None:
    url = str(tmp_path / "s")
    publish_run(url, 3)
    rec = WrappedStore(open_store(url))
    with Subscriber(url, store=rec, format="mxfp8") as sub:
        sub.pull(1)
        w = sub.pull(1)
        sub.pull_into(w, version=3)
    read = {k for k, _ in rec.reads} | {k for verb, k in rec.calls if verb.startswith("get")}
    others = [k for k in read if k.startswith(("streams/fp8-block128/", "objects/"))]  # the store's own packs, layouts
    assert not others, others
    assert any(k.startswith("streams/mxfp8/objects/") and k.endswith(".pack") for k in read)


def test_a_stream_delta_is_smaller_than_its_anchor(tmp_path) -> None:
    url = str(tmp_path / "s")
    publish_run(url, 3, anchor_policy=AnchorPolicy(every=100))
    store = open_store(url)
    _, doc = read_manifest_doc_head(store)
    with Subscriber(url, format="fp8-block128") as sub:
        log = sub.log()
    assert [i.kind for i in log] == ["anchor", "delta", "delta"]
    assert log[-1].bytes_stored < log[0].bytes_stored


def test_unknown_and_unpublished_formats_are_typed_errors_listing_what_exists(tmp_path) -> None:
    with pytest.raises(UnknownFormatError) as e:
        Publisher(str(tmp_path / "x"), formats=["fp7"])
    assert "fp8-block128" in str(e.value) and not (tmp_path / "x" / HEAD_KEY).exists()
    url = str(tmp_path / "s")
    publish_run(url, 1)
    with Subscriber(url, format="nvfp4") as sub, pytest.raises(UnknownFormatError) as e:
        sub.pull()
    assert e.value.available == ("bf16", "fp8-block128", "mxfp8")
    assert "nvfp4" in str(e.value) and "'mxfp8'" in str(e.value)
    with pytest.raises(ValueError):
        Subscriber(url, format="FP8 Block")


def test_a_corrupt_stream_pack_is_an_integrity_error_and_nothing_is_applied(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = publish_run(url, 2, anchor_policy=AnchorPolicy(every=100))
    store = open_store(url)
    with Subscriber(url, format="fp8-block128") as sub:
        target = sub.pull(1)
    before = {n: t.clone() for n, t in target.items()}
    packs = sorted(k for k in keys(store, "streams/fp8-block128/objects/") if k.endswith(".pack"))
    v2 = read_manifest_doc(PrefixedStore(store, "streams/fp8-block128/"), read_stream_key(store, "fp8-block128"))
    delta_packs = [b["key"] for b in v2["blobs"]]
    assert delta_packs and all(("streams/fp8-block128/" + k) in packs for k in delta_packs)
    victim = "streams/fp8-block128/" + delta_packs[0]
    data = bytearray(store.get(victim))
    data[len(data) // 2] ^= 0x40
    store.put(victim, bytes(data))
    with Subscriber(url, format="fp8-block128") as sub:
        sub.pull(1)
        with pytest.raises(IntegrityError, match=delta_packs[0].split("/")[-1][:16]):
            sub.pull_into(target, version=2)
    assert_bits_equal(target, before)
    del states


def test_a_corrupt_stream_manifest_or_layout_is_named_with_the_stream_it_is_in(tmp_path) -> None:
    """A stream's keys are relative to its tree (``manifests/...`` is the store's too): the
    error names the tree, ``URL#streams/<format>/``."""
    url = str(tmp_path / "s")
    publish_run(url, 2, anchor_policy=AnchorPolicy(every=100))
    store = open_store(url)
    stream = PrefixedStore(store, "streams/fp8-block128/")
    key = read_stream_key(store, "fp8-block128")
    layout = read_manifest_doc(stream, key)["layout"]["key"]
    for victim in (layout, key):
        data = bytearray(stream.get(victim))
        data[len(data) // 2] ^= 0x40
        stream.put(victim, bytes(data))
        with Subscriber(url, format="fp8-block128") as sub, pytest.raises(IntegrityError) as e:
            sub.pull()
        assert repr(victim) in str(e.value) and str(e.value).endswith(f"(in {store.url}#streams/fp8-block128/)")


def test_verify_with_streams_checks_every_stream_of_the_versions_it_checks(tmp_path) -> None:
    """``Subscriber.verify(streams=True)``: the store's chain and each serving stream of the
    version checked (with ``all_versions``, of every retained version, a format dropped since
    included), each from its own subscriber with the same trusted keys; a damaged stream fails
    the report while the store's chain is sound."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    url = str(tmp_path / "s")
    states = training(4)
    publish_in_turn(url, (FORMATS, states[:2]), (["bf16", "mxfp8"], states[2:]), layout_policy=LAYOUT,
                    signing_key=key)
    # the keys as a one-shot iterable: the stream subscribers get them too
    with Subscriber(url, trusted_keys=iter([key.public_key()])) as sub:
        everything = sub.verify(all_versions=True, streams=True)
        assert everything.ok and everything.versions == [1, 2, 3, 4]
        assert {f: r.versions for f, r in everything.streams.items()} == {"fp8-block128": [1, 2],
                                                                          "mxfp8": [1, 2, 3, 4]}
        assert set(sub.verify(streams=True).streams) == {"mxfp8"}  # the latest version's streams
        assert sub.verify(2, streams=True).streams["fp8-block128"].versions == [1, 2]
        assert sub.verify(all_versions=True).streams == {}  # only when asked
    with Subscriber(url, format="fp8-block128") as sub, pytest.raises(ValueError, match="format=None"):
        sub.verify(streams=True)
    store = open_store(url)
    pack = max((k for k in keys(store, "streams/fp8-block128/objects/") if k.endswith(".pack")),
               key=lambda k: store.head(k).size)
    data = bytearray(store.get(pack))
    data[len(data) // 2] ^= 0x40
    store.put(pack, bytes(data))
    with Subscriber(url, trusted_keys=[key.public_key()]) as sub:
        report = sub.verify(all_versions=True, streams=True)
    assert not report.ok and not report.problems and report.streams["mxfp8"].ok
    assert report.streams["fp8-block128"].problems


def read_stream_key(store, fmt: str) -> str:
    h = read_head(store)
    doc = read_manifest_doc(store, h["manifest"])
    ref = next(s for s in doc["streams"] if s["format"] == fmt)
    return ref["key"][len(f"streams/{fmt}/"):]


@WALKS
def test_a_failed_commit_shows_no_stream_and_the_next_publish_continues_every_chain(tmp_path, layout, walk) -> None:
    url = str(tmp_path / "s")
    states = [model(), step(model(), 1), step(step(model(), 1), 2)]
    fail = {"on": False}

    def hook(key, data, mode, put):
        if fail["on"]:
            raise StorageError("injected: HEAD write refused")
        return put()

    store = HeadPutHook(open_store(url), hook)
    with Publisher(url, store=store, formats=FORMATS, layout_policy=layout) as pub:
        pub.publish(states[0])
        fail["on"] = True
        with pytest.raises(StorageError):
            pub.publish(states[1])
        fail["on"] = False
        assert pub.publish(states[2]).version == 2
    for name in ("fp8-block128", "mxfp8"):
        with Subscriber(url, format=name) as sub:
            assert sub.latest().version == 2
            assert_bits_equal(sub.pull(2), derive(states[2], serving_format(name)))


def _every_version_bit_exact(url: str, committed: list[tuple[int, dict[str, torch.Tensor]]]):
    """Per quantized format, every ``(version, state)`` of ``committed`` read back bit-identical
    to ``derive`` of its state, by a subscriber reading each version whole and by one
    fast-forwarding from the first version with ``pull_into``; yields ``(format, its log)``."""
    for name in ("fp8-block128", "mxfp8"):
        with Subscriber(url, format=name) as whole, Subscriber(url, format=name) as follower:
            target = follower.pull(committed[0][0])
            for v, s in committed:
                want = derive(s, serving_format(name))
                assert_bits_equal(whole.pull(v), want)
                if v > committed[0][0]:
                    follower.pull_into(target, version=v)
                    assert_bits_equal(target, want)
            log = whole.log()
        yield name, log


class _PutFault(WrappedStore):
    """Fails the next put of a key ``which`` accepts once armed: refused, or ``landed``
    (written, then the response lost)."""

    def __init__(self, inner, which, *, landed: bool):
        super().__init__(inner)
        self.which, self.landed, self.armed, self.fired = which, landed, False, 0

    def put(self, key, data, *, mode="overwrite"):
        if self.armed and self.which(key):
            self.armed = False
            self.fired += 1
            if self.landed:
                super().put(key, data, mode=mode)
            raise StorageError(f"injected: put of {key} {'lost its response' if self.landed else 'refused'}")
        return super().put(key, data, mode=mode)


@WALKS
@pytest.mark.parametrize(("part", "landed"), [("/objects/", False), ("/objects/", True), ("/manifests/", False),
                                              ("/manifests/", True)])
def test_a_stream_write_that_fails_mid_version_commits_nothing_and_every_chain_goes_on_bit_exact(
        tmp_path, monkeypatch, part: str, landed: bool, layout: LayoutPolicy, walk: str) -> None:
    # the failing version is a delta whose quantized tensors are requantized incrementally (the
    # stream's reference advanced while it was encoded): the next one must not build on it
    walks = {"n": 0}
    if getattr(kernels, walk) is not None:
        def counted(*a, kernel=getattr(kernels, walk)):
            walks["n"] += 1
            return kernel(*a)

        monkeypatch.setattr(kernels, walk, counted)
    url = str(tmp_path / "s")
    states = training(5)
    store = _PutFault(open_store(url), lambda k: k.startswith("streams/fp8-block128/") and part in k, landed=landed)
    committed = []
    with Publisher(url, store=store, formats=FORMATS, layout_policy=layout,
                   anchor_policy=AnchorPolicy(every=100)) as pub:
        for s in states[:2]:
            committed.append((pub.publish(s).version, s))
        store.armed, walks["n"] = True, 0
        with pytest.raises(StorageError, match="injected"):
            pub.publish(states[2])
        assert store.fired == 1
        assert walks["n"] > 0 or getattr(kernels, walk) is None  # it was derived incrementally, on this path
        assert read_head(store)["version"] == 2  # nothing of the failed version is visible
        for s in states[2:]:
            info = pub.publish(s)
            committed.append((info.version, s))
    assert [v for v, _ in committed] == [1, 2, 3, 4, 5]
    for name, log in _every_version_bit_exact(url, committed):
        assert log[-1].kind == "delta", name  # the chain went on with deltas after the failure


@WALKS
def test_a_head_write_that_landed_without_a_response_commits_every_stream_once(tmp_path, layout, walk) -> None:
    url = str(tmp_path / "s")
    states = training(5)
    store = _PutFault(open_store(url), lambda k: k == HEAD_KEY, landed=True)
    with Publisher(url, store=store, formats=FORMATS, layout_policy=layout,
                   anchor_policy=AnchorPolicy(every=100)) as pub:
        for s in states[:2]:
            pub.publish(s)
        store.armed = True
        assert pub.publish(states[2]).version == 3  # resolved by reading HEAD: it is this commit
        assert store.fired == 1
        store.reads.clear()
        assert [pub.publish(s).version for s in states[3:]] == [4, 5]
    # every stream built on the version that landed, as it held it: none was read back
    assert not [k for k, _ in store.reads if k.startswith("streams/")]
    for name, log in _every_version_bit_exact(url, list(enumerate(states, start=1))):
        assert [(e.version, e.kind) for e in log] == [(1, "anchor")] + [(v, "delta") for v in range(2, 6)], name


def test_a_restarted_publisher_continues_each_stream_with_deltas(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = publish_run(url, 2, anchor_policy=AnchorPolicy(every=100))
    nxt = step(states[-1], 9)
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT, anchor_policy=AnchorPolicy(every=100)) as pub:
        assert pub.publish(nxt).kind == "delta"
    for name in ("fp8-block128", "mxfp8"):
        with Subscriber(url, format=name) as sub:
            assert sub.log()[-1].kind == "delta"
            assert_bits_equal(sub.pull(3), derive(nxt, serving_format(name)))


def test_gc_collects_old_stream_objects_and_keeps_retained_versions_materializable(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = publish_run(url, 6, anchor_policy=AnchorPolicy(every=3))
    store = open_store(url)
    before = keys(store, "streams/")
    report = collect(store, keep_last=2, grace_s=0, unsafe_grace_ok=True)
    after = keys(store, "streams/")
    assert report.floor_after == 4 and after < before
    assert any(k.startswith("streams/mxfp8/manifests/") for k in report.deleted["manifests"])
    for name in ("fp8-block128", "mxfp8"):
        with Subscriber(url, format=name) as sub:
            for v in (4, 5, 6):
                assert_bits_equal(sub.pull(v), derive(states[v - 1], serving_format(name)))
            # the store's floor applies to its streams: nothing below it is taken for damage
            assert [i.version for i in sub.log()] == [4, 5, 6]
            report = sub.verify(all_versions=True)
            assert report.ok and report.versions == [4, 5, 6]
            with pytest.raises(VersionCollectedError):
                sub.pull(2)


def test_a_format_worker_behind_the_retention_floor_catches_up_from_the_anchor(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = training(8)
    fmt = serving_format("fp8-block128")
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT, anchor_policy=AnchorPolicy(every=3)) as pub:
        pub.publish(states[0])
        pub.publish(states[1])
        with Subscriber(url, format="fp8-block128") as sub:
            target = sub.pull()
            for s in states[2:]:
                pub.publish(s)
            assert collect(open_store(url), keep_last=2, grace_s=0, unsafe_grace_ok=True).floor_after == 7
            assert sub.pull_into(target).version == 8  # version 2's chain is gone: from anchor 7
            assert_bits_equal(target, derive(states[7], fmt))


def test_a_format_worker_far_behind_catches_up_through_its_stream_not_the_stores_squashes(tmp_path) -> None:
    """Squashes are of the store's own state (SPEC §12): a format subscriber's index has none."""
    from deltastore.lifecycle.compact import compact

    url = str(tmp_path / "s")
    states = training(12)
    fmt = serving_format("mxfp8")
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT, anchor_policy=AnchorPolicy(every=100)) as pub:
        pub.publish(states[0])
        with Subscriber(url, format="mxfp8") as sub, Subscriber(url) as plain:
            target, own = sub.pull(), plain.pull()
            for s in states[1:]:
                pub.publish(s)
            assert compact(url, bases=[1], threads=1).squashes  # a squash 1 → 12 of the bf16 state
            store = WrappedStore(open_store(url))
            with Subscriber(url, store=store, format="mxfp8") as far:
                far.pull_into(far.pull(1))
            assert not [k for k, _ in store.reads if "squash" in k]
            assert sub.pull_into(target).version == 12
            assert_bits_equal(target, derive(states[11], fmt))
            assert plain.pull_into(own).version == 12
            assert_bits_equal(own, states[11])


def test_a_pinned_version_below_the_floor_stays_readable_in_each_format(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = publish_run(url, 6, anchor_policy=AnchorPolicy(every=3))
    pin(url, 2, note="eval")
    assert collect(open_store(url), keep_last=1, grace_s=0, unsafe_grace_ok=True).floor_after == 4
    for name in ("fp8-block128", "mxfp8"):
        with Subscriber(url, format=name) as sub:
            assert_bits_equal(sub.pull(2), derive(states[1], serving_format(name)))
            with pytest.raises(VersionCollectedError):
                sub.pull(3)


def test_fp32_masters_get_a_bf16_stream_of_their_own(tmp_path) -> None:
    url = str(tmp_path / "s")
    state = {n: t.float() for n, t in model().items()}
    with Publisher(url, formats=["bf16"], layout_policy=LAYOUT) as pub:
        pub.publish(state)
    with Subscriber(url, format="bf16") as sub:
        got = sub.pull()
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert_bits_equal(got, {n: t.to(torch.bfloat16) for n, t in state.items()})
    with Subscriber(url) as sub:
        assert_bits_equal(sub.pull(), state)
    assert np.all([t.dtype == torch.float32 for t in state.values()])


def test_a_format_declared_later_starts_its_stream_at_that_version(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = training(4)
    with Publisher(url, layout_policy=LAYOUT) as pub:
        pub.publish(states[0])
        pub.publish(states[1])
    with Publisher(url, layout_policy=LAYOUT, formats=["fp8-block128"]) as pub:
        assert pub.publish(states[2]).formats == ("fp8-block128",)
        assert pub.publish(states[3]).kind == "delta"
    fmt = serving_format("fp8-block128")
    with Subscriber(url, format="fp8-block128") as sub:
        assert [(i.version, i.kind) for i in sub.log()] == [(3, "anchor"), (4, "delta")]
        report = sub.verify(all_versions=True)  # the stream's chain, from its first version
        assert report.ok and report.versions == [3, 4]
        target = sub.pull(3)
        assert sub.pull_into(target, version=4)
        assert_bits_equal(target, derive(states[3], fmt))
    with Subscriber(url) as sub:
        assert [i.formats for i in sub.log()] == [(), (), ("fp8-block128",), ("fp8-block128",)]
        assert [i.streams for i in sub.log()] == [(), (), ("fp8-block128",), ("fp8-block128",)]


def test_a_format_no_longer_published_stays_readable_up_to_its_last_version(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = training(6)
    # the trainer drops two formats, and then every format
    publish_in_turn(url, (FORMATS, states[:3]), (["bf16"], states[3:4]), ((), states[4:5]), layout_policy=LAYOUT)
    store = WrappedStore(open_store(url))
    # an attempt that wrote its streams and lost the HEAD race leaves manifests nothing names
    store.put(f"streams/fp8-block128/manifests/{4:012d}-{'ab' * 32}.json.zst", b"uncommitted", mode="create")
    for name in ("fp8-block128", "mxfp8"):
        fmt = serving_format(name)
        with Subscriber(url, store=store, format=name) as sub:
            assert sub.latest().version == 3
            assert [i.version for i in sub.log()] == [1, 2, 3]
            report = sub.verify(all_versions=True)
            assert report.ok and report.versions == [1, 2, 3]
            for v in (1, 2, 3):
                assert_bits_equal(sub.pull(v), derive(states[v - 1], fmt))
            with pytest.raises(VersionNotFoundError):
                sub.pull(4)
    with Subscriber(url, store=store, format="bf16") as sub, pytest.raises(UnknownFormatError) as e:
        sub.latest()  # the store's own format up to version 4: its state is read without a format
    assert "read it without a format" in str(e.value)
    # A follower's next store version costs no read beyond that version's manifest.
    with Subscriber(url, store=store, format="fp8-block128") as sub:
        sub.latest()
        with Publisher(url, layout_policy=LAYOUT) as pub:
            pub.publish(states[5])
        store.reads.clear()
        assert sub.latest().version == 3
        assert [k for k, _ in store.reads if k.startswith("manifests/")] == [read_head(store)["manifest"]]
    store.reads.clear()
    with Subscriber(url, store=store, format="nvfp4") as sub, pytest.raises(UnknownFormatError) as e:
        sub.latest()  # never published: refused after one listing, without walking the chain
    assert e.value.available == ()
    assert [k for k, _ in store.reads if k.startswith("manifests/")] == [read_head(store)["manifest"]]


def test_a_format_dropped_long_ago_is_found_through_skip_pointers_not_version_by_version(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = training(3)
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT) as pub:
        for s in states[:2]:
            pub.publish(s)
    with Publisher(url, layout_policy=LAYOUT) as pub:
        for i in range(60):
            pub.publish(step(states[-1], 100 + i))
    store = WrappedStore(open_store(url))
    with Subscriber(url, store=store, format="mxfp8") as sub:
        assert sub.latest().version == 2
        assert_bits_equal(sub.pull(), derive(states[1], serving_format("mxfp8")))
    read = {k for k, _ in store.reads if k.startswith("manifests/")}
    assert len(read) <= 12, sorted(read)  # of 62 versions: HEAD's, and a few hops down to version 2


def test_a_worker_of_a_format_the_trainer_drops_keeps_its_last_version_and_warns(tmp_path, caplog) -> None:
    url = str(tmp_path / "s")
    states = training(4)
    fmt = serving_format("mxfp8")
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT) as pub:
        pub.publish(states[0])
    with Subscriber(url, format="mxfp8") as sub:
        target = sub.pull()
        with Publisher(url, formats=FORMATS, layout_policy=LAYOUT) as pub:
            pub.publish(states[1])
        assert sub.pull_into(target).version == 2
        with Publisher(url, formats=["bf16", "fp8-block128"], layout_policy=LAYOUT) as pub:
            for s in states[2:]:
                pub.publish(s)
                assert sub.pull_into(target) is None  # nothing newer in its format: it keeps serving version 2
        assert sub.version == 2
    assert_bits_equal(target, derive(states[1], fmt))
    warned = [r.getMessage() for r in caplog.records if "no serving format 'mxfp8'" in r.getMessage()]
    assert len(warned) == 1 and "at version 2" in warned[0]  # once, not at every poll


def test_a_worker_crosses_a_pause_in_its_format_to_the_stream_published_again(tmp_path) -> None:
    """A format dropped and declared again starts a new chain (an anchor): a worker holding its
    last version before the pause reaches the new one through that anchor."""
    url = str(tmp_path / "s")
    states = training(5)
    fmt = serving_format("fp8-block128")
    publish_in_turn(url, (FORMATS, states[:1]), layout_policy=LAYOUT)
    with Subscriber(url, format="fp8-block128") as sub:
        target = sub.pull()
        publish_in_turn(url, ((), states[1:3]), layout_policy=LAYOUT)  # the pause
        assert sub.pull_into(target) is None
        with Publisher(url, formats=FORMATS, layout_policy=LAYOUT) as pub:
            assert pub.publish(states[3]).kind == "delta"  # the store's own chain goes on
            pub.publish(states[4])
        assert sub.pull_into(target, version=4).version == 4
        assert_bits_equal(target, derive(states[3], fmt))
        assert sub.pull_into(target).version == 5
        assert_bits_equal(target, derive(states[4], fmt))


def test_versions_of_a_format_from_before_a_pause_stay_readable(tmp_path) -> None:
    """A format published again after a pause starts a new chain that names no parent; its
    retained versions from before the pause are still listed, pulled and verified, through the
    store's manifests, which name them. The versions in the pause are refused by name."""
    url = str(tmp_path / "s")
    states = training(6)
    fmt = serving_format("fp8-block128")
    publish_in_turn(url, (FORMATS, states[:2]), ((), states[2:4]), (FORMATS, states[4:]), layout_policy=LAYOUT)
    with Subscriber(url, format="fp8-block128") as sub:
        assert [v.version for v in sub.log()] == [1, 2, 5, 6]
        assert [v.version for v in sub.log(since=3)] == [5, 6]
        assert [v.kind for v in sub.log()] == ["anchor", "delta", "anchor", "delta"]
        for v, state in ((1, states[0]), (2, states[1]), (5, states[4]), (6, states[5])):
            assert_bits_equal(sub.pull(v), derive(state, fmt))
            assert sub.info(v).version == v
        for v in (3, 4):
            with pytest.raises(VersionNotFoundError, match="version 2 is followed by a chain that starts at version 5"):
                sub.pull(v)
        report = sub.verify(all_versions=True)
        assert report.ok and report.versions == [1, 2, 5, 6]
    collect(open_store(url), keep_last=6, grace_s=0, unsafe_grace_ok=True)  # every version retained
    with Subscriber(url, format="fp8-block128") as sub:
        assert sub.verify(all_versions=True).ok
        assert_bits_equal(sub.pull(1), derive(states[0], fmt))
    # the retention floor bounds it: a collected version is refused as collected, not searched for
    store = open_store(url)
    update_index(store, History(store), lambda head, index: index_content(index, head, floor=2), writer="gc")
    with Subscriber(url, format="fp8-block128") as sub:
        assert [v.version for v in sub.log()] == [2, 5, 6]
        assert_bits_equal(sub.pull(2), derive(states[1], fmt))
        with pytest.raises(VersionCollectedError):
            sub.pull(1)
    update_index(store, History(store), lambda head, index: index_content(index, head, floor=3), writer="gc")
    with Subscriber(url, format="fp8-block128") as sub:
        assert [v.version for v in sub.log()] == [5, 6]
        assert sub.verify(all_versions=True).versions == [5, 6]
        with pytest.raises(VersionCollectedError):
            sub.pull(2)


_CHURN_STATES = training(7)


@settings(max_examples=examples(0.2), deadline=None)
@given(declared=st.lists(st.booleans(), min_size=2, max_size=7), floor=st.integers(1, 7))
def test_a_format_declared_and_dropped_at_will_reads_exactly_the_versions_published_in_it(
        declared: list[bool], floor: int) -> None:
    """Whatever versions a format was published in (dropped, declared again, any number of
    times) and wherever the retention floor is (an anchor of the store, as GC leaves it): its
    readers list exactly those versions at or above the floor, read each bit-identical to
    ``derive``, verify them all, and refuse every other version by the right error; the latest
    is the newest of them. A format no retained version has is refused by name."""
    fmt = serving_format("fp8-block128")
    floor = min(floor, len(declared))
    with tempfile.TemporaryDirectory() as d:
        url = f"{d}/s"
        for v, on in enumerate(declared, 1):
            with Publisher(url, formats=FORMATS if on else ["bf16", "mxfp8"], layout_policy=LAYOUT) as pub:
                assert pub.publish(_CHURN_STATES[v - 1], anchor=v == floor).version == v
        if floor > 1:
            store = open_store(url)
            update_index(store, History(store), lambda head, index: index_content(index, head, floor=floor), writer="gc")
        readable = [v for v, on in enumerate(declared, 1) if on and v >= floor]
        with Subscriber(url, format="fp8-block128") as sub:
            if not readable:
                for read in (sub.latest, sub.log, lambda: sub.pull(len(declared))):
                    with pytest.raises(UnknownFormatError):
                        read()
                return
            assert [i.version for i in sub.log()] == readable
            assert sub.latest().version == readable[-1]
            report = sub.verify(all_versions=True)
            assert report.ok and report.versions == readable
            for v in range(1, len(declared) + 1):
                if v in readable:
                    assert_bits_equal(sub.pull(v), derive(_CHURN_STATES[v - 1], fmt))
                else:
                    with pytest.raises(VersionCollectedError if v < floor else VersionNotFoundError):
                        sub.pull(v)


@settings(max_examples=examples(0.1), deadline=None)
@given(versions=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=7),
       keep_last=st.integers(1, 7))
def test_gc_keeps_every_retained_version_of_a_format_declared_and_dropped_at_will(
        versions: list[tuple[bool, bool]], keep_last: int) -> None:
    """GC over a format published in any set of versions, with anchors anywhere: every version
    it retains that was published in the format reads back bit-identical and verifies, and no
    object it deleted is needed."""
    fmt = serving_format("fp8-block128")
    with tempfile.TemporaryDirectory() as d:
        url = f"{d}/s"
        for v, (on, anchor) in enumerate(versions, 1):
            with Publisher(url, formats=FORMATS if on else ["bf16", "mxfp8"], layout_policy=LAYOUT) as pub:
                pub.publish(_CHURN_STATES[v - 1], anchor=anchor)
        floor = collect(open_store(url), keep_last=keep_last, grace_s=0, unsafe_grace_ok=True).floor_after
        readable = [v for v, (on, _) in enumerate(versions, 1) if on and v >= floor]
        with Subscriber(url, format="fp8-block128") as sub:
            if not readable:
                with pytest.raises(UnknownFormatError):
                    sub.latest()
                return
            assert [i.version for i in sub.log()] == readable
            assert sub.verify(all_versions=True).ok
            for v in readable:
                assert_bits_equal(sub.pull(v), derive(_CHURN_STATES[v - 1], fmt))


def test_a_version_named_before_a_chain_must_be_older_than_its_start(tmp_path) -> None:
    """Hostile input: the manifest named as the version before a chain's first version is that
    chain's own newest; the reader refuses it instead of walking in a loop."""
    url = str(tmp_path / "s")
    states = training(3)
    with Publisher(url, layout_policy=LAYOUT) as pub:
        pub.publish(states[0])
    with Publisher(url, formats=FORMATS, layout_policy=LAYOUT) as pub:  # the stream starts at version 2
        pub.publish(states[1])
        pub.publish(states[2])
    stream = PrefixedStore(open_store(url), "streams/fp8-block128/")
    with Subscriber(url, format="fp8-block128") as sub:
        top = sub.latest()
        with pytest.raises(VersionNotFoundError, match="its first version is 2"):
            sub.pull(1)
    assert top is not None and top.version == 3
    history = History(stream, earlier=lambda version: (top.manifest, None))
    with pytest.raises(CorruptObjectError, match="was named as the version before the chain"):
        history.chains(top.manifest, history.manifest(top.manifest), down_to=1)


def test_a_dropped_format_is_read_down_to_the_retention_floor_and_refused_below_it(tmp_path) -> None:
    url = str(tmp_path / "s")
    states = training(5)
    publish_in_turn(url, (FORMATS, states[:2]), (["bf16", "mxfp8"], states[2:]), layout_policy=LAYOUT)
    with Subscriber(url, format="fp8-block128") as sub:
        assert sub.latest().version == 2
        # the floor rises above the format's last version (a collector's first step; its objects
        # are deleted only once their grace period is over)
        store = open_store(url)
        update_index(store, History(store), lambda head, index: index_content(index, head, floor=4), writer="gc")
        assert keys(store, "streams/fp8-block128/manifests/")
        with pytest.raises(UnknownFormatError) as e:
            sub.latest()
    assert e.value.available == ("bf16", "mxfp8")
    assert "nor does any earlier version it retains" in str(e.value)
    # a new reader does not look below the floor, where the store's manifests may be gone
    for k in keys(store, "manifests/"):
        if k < f"manifests/{4:012d}-":
            store.delete(k)
    with Subscriber(url, format="fp8-block128") as sub, pytest.raises(UnknownFormatError):
        sub.latest()
    collect(open_store(url), keep_last=2, grace_s=0, unsafe_grace_ok=True)
    with Subscriber(url, format="fp8-block128") as sub, pytest.raises(UnknownFormatError) as e:
        sub.latest()  # its objects collected: refused at once
    assert e.value.available == ("bf16", "mxfp8")


def test_a_parent_link_skipping_a_version_is_refused_when_looking_for_a_dropped_format(tmp_path) -> None:
    """Hostile bytes: a version without the format names an older version than its parent's
    as its parent; the reader refuses it instead of reading a stream the chain does not reach."""
    url = str(tmp_path / "s")
    states = training(4)
    publish_in_turn(url, (FORMATS, states[:2]), ((), states[2:]), layout_policy=LAYOUT)
    store = open_store(url)
    key2 = next(k for k in keys(store, "manifests/") if k.startswith(f"manifests/{2:012d}-"))
    doc = read_manifest_doc(store, read_head(store)["manifest"])
    doc["parent_manifest"] = key2
    bad = resign_manifest(store, doc)
    with Subscriber(url, format="fp8-block128") as sub, pytest.raises(CorruptObjectError, match=bad):
        sub.latest()


@pytest.mark.integration
def test_a_dropped_format_is_found_over_real_s3(moto_s3_url) -> None:
    """The search lists the stream's manifests and reads the store's through an S3 endpoint."""
    url, opts = moto_s3_url.url, moto_s3_url.storage_options
    states = training(5)
    publish_in_turn(url, (FORMATS, states[:2]), (["bf16", "mxfp8"], states[2:]), layout_policy=LAYOUT,
                    storage_options=opts)
    with Subscriber(url, format="fp8-block128", storage_options=opts) as sub:
        assert sub.latest().version == 2
        assert_bits_equal(sub.pull(), derive(states[1], serving_format("fp8-block128")))
        assert sub.verify(all_versions=True).versions == [1, 2]
    with Subscriber(url, format="mxfp8", storage_options=opts) as sub:
        assert sub.latest().version == 5
