"""Damaged stores and modified targets (SPEC §7, §9): typed errors naming the object, and
``pull_into`` never leaves a target half-applied."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import deltastore.read.engine
import deltastore.read.fetch
from deltastore import (
    CorruptObjectError,
    DeltastoreError,
    FormatError,
    IntegrityError,
    LayoutMismatchError,
    NotFoundError,
    Publisher,
    Subscriber,
    UnknownCodecError,
    UnsupportedSchemaError,
)
from deltastore.cli import main
from deltastore.format.keys import HEAD_KEY, manifest_key, sha256_hex
from deltastore.format.models import SCHEMA_VERSION
from deltastore.layout.tensors import bits
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.manifest_docs import read_manifest_doc
from testkit.stores import (
    WrappedStore,
    anchor_with_deltas,
    corrupt_anchor_delta,
    head_manifest,
    keys,
    publish_history,
    pull_fresh,
    read_head,
    resign_manifest,
    resign_segment,
)
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal, small_state, snapshot, sparse_edit


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return str(tmp_path / "store")
    return f"memory://integrity-{uuid.uuid4().hex}"


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


# --- damaged objects, fresh readers ---------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip-first", "flip-middle", "flip-last", "truncate", "extend", "empty"])
def test_damaged_pack_is_an_integrity_error_naming_it(url: str, damage: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        key = doc["blobs"][0]["key"]
        data = store.get(key)
        bad = {
            "flip-first": lambda: _flip(data, 0),
            "flip-middle": lambda: _flip(data, len(data) // 2),
            "flip-last": lambda: _flip(data, len(data) - 1),
            "truncate": lambda: data[:-1],
            "extend": lambda: data + b"\0",
            "empty": lambda: b"",
        }[damage]()
        store.put(key, bad, mode="overwrite")
    with Subscriber(url) as sub:
        with pytest.raises(IntegrityError) as exc:
            sub.pull()
        assert key in str(exc.value)
        assert sub.version is None


class _SlowDamagedReads(WrappedStore):
    """Pack reads: the first pack's bytes come back damaged at once, every other pack's slowly;
    ``in_flight`` counts the reads not yet returned."""

    def __init__(self, inner, damaged: str) -> None:
        super().__init__(inner)
        self.damaged, self.in_flight = damaged, 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if not key.endswith(".pack"):
            return super().get(key, byte_range=byte_range)
        with self._lock:
            self.in_flight += 1
        try:
            data = super().get(key, byte_range=byte_range)
            if key == self.damaged:
                return _flip(data, len(data) // 2)
            time.sleep(0.2)
            return data
        finally:
            with self._lock:
                self.in_flight -= 1


def test_a_failed_pull_leaves_no_read_running(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    states = publish_history(url, n=4)
    with open_store(url) as store:
        packs = sorted(m.key for m in store.list() if m.key.endswith(".pack"))
    assert len(packs) > 1
    slow = _SlowDamagedReads(open_store(url), packs[0])
    with Subscriber(url, store=slow) as sub:
        with pytest.raises(IntegrityError, match=packs[0]):
            sub.pull()
        # the other packs' reads ended before the error reached the caller: none races its retry
        assert slow.in_flight == 0 and {k for k, _ in slow.reads} > {packs[0]}
        slow.damaged = ""
        assert_bits_equal(sub.pull(), states[-1])


def test_missing_pack_is_not_found_naming_it(url: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        key = doc["blobs"][0]["key"]
        store.delete(key)
    with Subscriber(url) as sub:
        with pytest.raises(NotFoundError) as exc:
            sub.pull()
        assert isinstance(exc.value, KeyError)
        assert key in str(exc.value)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_manifest_in_the_chain_is_named(url: str, damage: str) -> None:
    publish_history(url, n=3)
    with open_store(url) as store:
        key = next(k for k in keys(store, "manifests/") if k.startswith("manifests/000000000002-"))
        if damage == "delete":
            store.delete(key)
        else:
            data = store.get(key)
            store.put(key, _flip(data, 10) if damage == "flip" else data[: len(data) // 2], mode="overwrite")
    expected = NotFoundError if damage == "delete" else IntegrityError
    with Subscriber(url) as sub:
        assert sub.latest().version == 3  # the head manifest itself is fine
        # schema 3 reaches version 1 from 3 through a skip pointer, without reading version 2
        for call in (sub.pull, sub.log, *([lambda: sub.info(1)] if SCHEMA_VERSION < 3 else [])):
            with pytest.raises(expected) as exc:
                call()
            assert key in str(exc.value)


def test_head_manifest_digest_mismatch(url: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        h = read_head(store)
        h["manifest_sha256"] = "0" * 64
        store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
    with Subscriber(url) as sub, pytest.raises(IntegrityError, match=h["manifest"]):
        sub.pull()


@pytest.mark.parametrize(
    "head_bytes, error",
    [
        (b"", CorruptObjectError),
        (b"{not json", CorruptObjectError),
        (b"[1, 2]", CorruptObjectError),
        (b'{"format": "deltastore.head", "schema": 3}', CorruptObjectError),
        (b'{"format": "deltastore.head", "schema": 1}', UnsupportedSchemaError),
        (b"\xff\xfe", CorruptObjectError),
    ],
)
def test_garbled_head(url: str, head_bytes: bytes, error: type) -> None:
    publish_history(url, n=1)
    with open_store(url) as store:
        store.put(HEAD_KEY, head_bytes, mode="overwrite")
    with Subscriber(url) as sub:
        for call in (sub.pull, sub.latest, sub.log):
            with pytest.raises(error, match="HEAD"):
                call()
    with pytest.raises(error):
        Publisher(url)


def test_head_and_manifest_versions_disagree(url: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        h = read_head(store)
        h["version"] = 7
        store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
    with Subscriber(url) as sub, pytest.raises(CorruptObjectError):
        sub.pull()


# --- schemas and codecs from the future --------------------------------------------------------


def test_unknown_schema_in_head_is_refused_by_readers_and_writers(url: str) -> None:
    publish_history(url, n=1)
    with open_store(url) as store:
        h = read_head(store)
        h["schema"] = 4  # a schema this release does not read
        h["something_new"] = True
        future = json.dumps(h).encode()
        store.put(HEAD_KEY, future, mode="overwrite")
    with Subscriber(url) as sub:
        for call in (sub.pull, sub.latest, sub.log):
            with pytest.raises(UnsupportedSchemaError, match="schema"):
                call()
    # A publisher must not overwrite a store written by a newer deltastore.
    with pytest.raises(UnsupportedSchemaError):
        Publisher(url)
    with pytest.raises(UnsupportedSchemaError):
        Publisher(url, writer_policy=WriterPolicy(takeover=False))
    with open_store(url) as store:
        assert store.get(HEAD_KEY) == future


def test_unknown_schema_in_manifest(url: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        doc["schema"] = 6  # (4 is read since design 007, 5 since serving streams)
        key = resign_manifest(store, doc)
    with Subscriber(url) as sub:
        with pytest.raises(UnsupportedSchemaError) as exc:
            sub.pull()
        assert key in str(exc.value)


@pytest.mark.parametrize("which", ["full", "delta"])
def test_unknown_codec_in_manifest(url: str, which: str) -> None:
    states = publish_history(url, n=2)
    with open_store(url) as store:
        key, doc = head_manifest(store)
        if which == "full":  # version 1 is the anchor: point HEAD at a re-signed version 1
            key = next(k for k in keys(store, "manifests/") if k.startswith("manifests/000000000001-"))
            doc = read_manifest_doc(store, key)
        seg = doc["tensors"][-1]["chunks"][-1][which]
        seg["codec"] = "lz77-magic/9"
        resign_manifest(store, doc)
    with Subscriber(url) as sub:
        with pytest.raises((UnknownCodecError, CorruptObjectError)) as exc:
            if which == "full":
                sub.pull()
            else:
                target = sub.pull(1)
                before = snapshot(target)
                sub.pull_into(target)
        assert "lz77-magic/9" in str(exc.value) or isinstance(exc.value, CorruptObjectError)
        if which == "delta":
            assert_bits_equal(target, before)
            assert_bits_equal(target, states[0])


@pytest.mark.parametrize("byte_at, value", [(4, 9), (5, 7)])
def test_unknown_codec_inside_a_segment(url: str, byte_at: int, value: int) -> None:
    """A segment whose own header names an unknown codec id/version (hashes all correct)."""
    publish_history(url, n=1)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        t = doc["tensors"][0]
        resign_segment(store, doc, t["name"], 0, "full", lambda b: b[:byte_at] + bytes([value]) + b[byte_at + 1 :])
        resign_manifest(store, doc)
    with Subscriber(url) as sub, pytest.raises((UnknownCodecError, CorruptObjectError)):
        sub.pull()


# --- pull_into: all or nothing ---------------------------------------------------------------


class _CountApplies:
    """Counts successful delta applications (to know that a failure came after some)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.n = 0
        real = deltastore.read.engine.codec.apply_delta

        def counting(*a, **kw):
            out = real(*a, **kw)
            self.n += 1
            return out

        monkeypatch.setattr(deltastore.read.engine.codec, "apply_delta", counting)


def _last_changed_chunk(doc: dict) -> tuple[str, int]:
    t = doc["tensors"][-1]
    return t["name"], t["chunks"][-1]["index"]


@pytest.mark.parametrize("batch_bytes", [None, 1], ids=["one-batch", "batch-per-chunk"])
@pytest.mark.parametrize("how", ["digest", "segment-bits", "segment-codec", "segment-sha"])
def test_pull_into_with_a_bad_delta_changes_nothing(url: str, how: str, batch_bytes, monkeypatch) -> None:
    if batch_bytes:  # fetch and apply chunk by chunk: the failure comes in a later batch
        monkeypatch.setattr(deltastore.read.fetch, "FETCH_BATCH_BYTES", batch_bytes)
    states = publish_history(url, n=4)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        name, idx = _last_changed_chunk(doc)
        chunk = next(c for t in doc["tensors"] if t["name"] == name for c in t["chunks"] if c["index"] == idx)
        if how == "digest":  # the later chunk decodes but does not match its state digest
            chunk["digest"] = "0" * 32
        elif how == "segment-bits":  # garbage that hashes correctly
            resign_segment(store, doc, name, idx, "delta", lambda b: b[:-4] + bytes(x ^ 0x5A for x in b[-4:]))
        elif how == "segment-codec":
            resign_segment(store, doc, name, idx, "delta", lambda b: b[:4] + b"\x09" + b[5:])
        else:  # the manifest's segment hash is wrong: caught before decoding
            chunk["delta"]["sha256"] = "f" * 64
        resign_manifest(store, doc)
    assert sum(len(t["chunks"]) for t in doc["tensors"]) > 2, "the bad chunk must not be the only one"
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(2)
        ptrs = {n: t.data_ptr() for n, t in target.items()}
        before = snapshot(target)
        applies = _CountApplies(monkeypatch)
        with pytest.raises((IntegrityError, FormatError)) as exc:
            sub.pull_into(target)
        assert isinstance(exc.value, DeltastoreError)
        assert_bits_equal(target, before, "target after a failed pull_into")
        assert_bits_equal(target, states[1])
        assert {n: t.data_ptr() for n, t in target.items()} == ptrs
        assert sub.version == 2
        if how in ("digest", "segment-bits"):
            assert applies.n > 1, "other chunks should have been applied (then rolled back)"
        # Nothing was half-done: with HEAD put back on the good version, the same subscriber
        # fast-forwards the same target.
        with open_store(url) as store:
            good = next(k for k in keys(store, "manifests/") if k.startswith("manifests/000000000004-") and k != sub.latest().manifest)
            h = read_head(store)
            from deltastore.format.keys import sha256_hex

            h.update(manifest=good, manifest_sha256=sha256_hex(store.get(good)))
            store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
        assert sub.pull_into(target).version == 4
        assert_bits_equal(target, states[3])


@pytest.mark.parametrize("batch_bytes", [None, 1], ids=["one-batch", "batch-per-chunk"])
def test_pull_into_rolls_back_chunks_replaced_from_a_snapshot(url: str, batch_bytes, monkeypatch) -> None:
    """Across a restart anchor (no deltas), chunks are replaced from full segments; a later bad
    chunk must restore them from the saved copies."""
    if batch_bytes:
        monkeypatch.setattr(deltastore.read.fetch, "FETCH_BATCH_BYTES", batch_bytes)
    states = publish_history(url, n=2)
    more = [sparse_edit(states[-1], np.random.default_rng(10 + i), 0.02) for i in range(2)]
    with Publisher(url, writer_policy=WriterPolicy(resume=False, threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:  # a restart, no read-back
        assert pub.publish(more[0]).kind == "anchor"
        assert pub.publish(more[1]).kind == "delta"
    with open_store(url) as store:
        _, doc = head_manifest(store)
        name, idx = _last_changed_chunk(doc)
        next(c for t in doc["tensors"] if t["name"] == name for c in t["chunks"] if c["index"] == idx)["digest"] = "0" * 32
        resign_manifest(store, doc)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(2)
        before = snapshot(target)
        with pytest.raises(IntegrityError):
            sub.pull_into(target)
        assert_bits_equal(target, before)
        assert sub.pull_into(target, version=3).version == 3
        assert_bits_equal(target, more[0])


def test_pull_into_a_modified_target_is_refused(url: str) -> None:
    states = publish_history(url, n=3)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        # Modify an element of a chunk that the update will touch.
        with open_store(url) as store:
            _, doc = head_manifest(store)
        name, idx = doc["tensors"][0]["name"], doc["tensors"][0]["chunks"][0]["index"]
        rows = doc["tensors"][0]["chunk_rows"]
        bits(target[name].view(target[name].shape[0], -1)[idx * rows])[0] ^= 1
        before = snapshot(target)
        with pytest.raises(IntegrityError) as exc:
            sub.pull_into(target)
        assert name in str(exc.value)
        assert_bits_equal(target, before)
        assert sub.version == 1
    # A fresh pull is the way out.
    assert_bits_equal(pull_fresh(url), states[2])


def test_pull_into_a_target_modified_where_nothing_changes_is_refused(url: str) -> None:
    """SPEC §7.5: the target's chunks are checked against their digests at the held version, so
    a local edit in a tensor the update does not touch is not silently kept."""
    states = [small_state(0, n=4, rows=64)]
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        pub.publish(states[0])
        nxt = snapshot(states[0])
        nxt["t0"][0, 0] += 1  # only t0 changes
        pub.publish(nxt)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        bits(target["t3"])[5] ^= 1  # t3 is not in the delta
        before = snapshot(target)
        with pytest.raises(IntegrityError) as exc:
            sub.pull_into(target)
        assert "t3" in str(exc.value)
        assert_bits_equal(target, before)


def test_pull_into_a_wrong_layout_target(url: str) -> None:
    publish_history(url, n=2)
    with Subscriber(url) as sub:
        target = sub.pull(1)
        bad = dict(target)
        bad["t1"] = torch.zeros(63, 8, dtype=target["t1"].dtype)
        with pytest.raises(LayoutMismatchError, match="t1"):
            sub.pull_into(bad)
        bad = dict(target)
        bad["t1"] = target["t1"].to(torch.float64)
        with pytest.raises(LayoutMismatchError, match="t1"):
            sub.pull_into(bad)
        bad = dict(target)
        del bad["t2"]
        with pytest.raises(LayoutMismatchError, match="t2"):
            sub.pull_into(bad)
        assert sub.pull_into(target).version == 2


# --- hostile manifests through the read paths (docs/reliability.md: D8, D10, D11, D12) --------------------


def _manifest_doc(store, version: int) -> tuple[str, dict]:
    key = next(k for k in keys(store, "manifests/") if k.startswith(f"manifests/{version:012d}-"))
    return key, read_manifest_doc(store, key)


def test_anchor_with_out_of_range_chunk_indices_is_corrupt(url: str) -> None:
    """D8: an anchor listing chunks 0 and 2 of a 2-chunk tensor; pull() used to hand out the
    unwritten rows of chunk 1 and verify passed."""
    states = publish_history(url, n=2)
    with open_store(url) as store:
        _, doc = _manifest_doc(store, 1)
        t = next(t for t in doc["tensors"] if len(t["chunks"]) == 2)
        t["chunks"][1]["index"] = 2
        key = resign_manifest(store, doc)
    with Subscriber(url, threads=2) as sub:
        with pytest.raises(CorruptObjectError) as exc:
            sub.pull()
        assert key in str(exc.value) and t["name"] in str(exc.value)
        target = snapshot(states[0])
        with pytest.raises(CorruptObjectError):
            sub.pull_into(target)
        assert_bits_equal(target, states[0])
    assert main(["verify", url]) == 1


@pytest.mark.parametrize("dtype", ["__class__", "Tensor", "qint8"])
def test_manifest_with_a_foreign_dtype_is_corrupt(url: str, dtype: str) -> None:
    """A dtype name that is an attribute of torch but not a dtype we store is a corrupt manifest,
    not InvalidStateDictError (which means: the caller's state dict is wrong)."""
    publish_history(url, n=1)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        doc["tensors"][0]["dtype"] = dtype
        resign_manifest(store, doc)
    with Subscriber(url) as sub, pytest.raises(CorruptObjectError, match=dtype):
        sub.pull()


def _huge_anchor(store, numel: int) -> str:
    """Re-sign version 1 so that one tensor declares ``numel`` uint8 elements in one chunk,
    reusing a real (small) full segment: a few KB of packs declaring a huge model."""
    _, doc = _manifest_doc(store, 1)
    t = doc["tensors"][0]
    t.update(dtype="uint8", shape=[numel], chunk_rows=numel, chunks=t["chunks"][:1])
    return resign_manifest(store, doc)


def test_declared_model_size_is_capped_before_allocating(url: str) -> None:
    """D11: 3 KB of packs must not become gigabytes resident; the cap is configurable."""
    publish_history(url, n=1)
    with open_store(url) as store:
        _huge_anchor(store, 2**50)  # a petabyte: more than any machine's memory
    with Subscriber(url) as sub, pytest.raises(CorruptObjectError, match="max_model_bytes") as exc:
        sub.pull()
    assert url.rstrip("/").split("/")[-1] in str(exc.value)
    # A legitimate store over a configured cap: refused, naming the option.
    url2 = url + "-small"
    publish_history(url2, n=1)
    with Subscriber(url2, max_model_bytes=1024) as sub, pytest.raises(CorruptObjectError, match="max_model_bytes"):
        sub.pull()
    with Subscriber(url2, max_model_bytes=10**6) as sub:
        assert sub.pull()


def test_manifest_size_cap_is_checked_before_parsing(url: str) -> None:
    publish_history(url, n=2)
    with open_store(url) as store:
        size = len(store.get(read_head(store)["manifest"]))
    with Subscriber(url, max_manifest_bytes=size - 1) as sub, pytest.raises(CorruptObjectError, match="limit"):
        sub.pull()
    with Subscriber(url, max_manifest_bytes=size + 10_000) as sub:
        assert sub.pull()


def test_head_over_the_cap_is_refused_before_reading_it(url: str) -> None:
    from deltastore.format.parse import MAX_HEAD_BYTES
    from testkit.stores import WrappedStore

    publish_history(url, n=1)
    with open_store(url) as store:
        h = read_head(store)
        h["writer"] = "x" * (MAX_HEAD_BYTES + 1)
        store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
    wrapped = WrappedStore(open_store(url))
    with Subscriber(url, store=wrapped) as sub, pytest.raises(CorruptObjectError, match="HEAD"):
        sub.latest()
    assert wrapped.calls == [("head", HEAD_KEY)], "the body of an oversized HEAD was read"
    wrapped.close()


def _deep(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


@pytest.mark.parametrize(
    "damage",
    ["deep-head", "long-int-head", "deep-metadata", "huge-model", "negative-shape"],
)
@pytest.mark.parametrize("command", ["pull", "log", "verify"])
def test_cli_on_hostile_metadata_prints_one_line(url: str, tmp_path: Path, capsys, damage: str, command: str) -> None:
    """D11: crafted metadata never reaches the user as a traceback or a bare Python error."""
    publish_history(url, n=2)
    with open_store(url) as store:
        if damage == "deep-head":
            store.put(HEAD_KEY, _deep(100_000).encode(), mode="overwrite")
        elif damage == "long-int-head":
            store.put(HEAD_KEY, store.get(HEAD_KEY).replace(b'"epoch":', b'"epoch":' + b"9" * 5000 + b","  b'"x":'), mode="overwrite")
        elif damage == "deep-metadata":
            _, doc = head_manifest(store)
            doc["metadata"] = {"a": 1}
            data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
            data = data.replace(b'"metadata":{"a":1}', b'"metadata":' + _deep(3_000).encode())
            digest = sha256_hex(data)
            store.put(manifest_key(doc["version"], digest), data, mode="overwrite")
            h = read_head(store)
            h.update(manifest=manifest_key(doc["version"], digest), manifest_sha256=digest)
            store.put(HEAD_KEY, json.dumps(h).encode(), mode="overwrite")
        elif damage == "huge-model":
            _huge_anchor(store, 2**50)
        else:
            _, doc = _manifest_doc(store, 1)
            doc["tensors"][0]["shape"][0] = -doc["tensors"][0]["shape"][0]
            resign_manifest(store, doc)
    capsys.readouterr()
    argv = {"pull": ["pull", url, str(tmp_path / "o.safetensors")], "log": ["log", url], "verify": ["verify", url, "--all"]}[command]
    rc = main(argv)
    err = capsys.readouterr().err
    if command == "log" and damage == "huge-model":  # a big model is no reason to refuse listing it
        assert rc == 0 and not err, err
        return
    assert rc == 1, err
    assert err.count("\n") == 1 and err.startswith("deltastore: error: "), err
    assert "CorruptObjectError" in err, err


def test_chain_that_skips_a_version_is_corrupt(url: str) -> None:
    """D12: version 3 names version 1's manifest as its parent: log and verify used to pass."""
    publish_history(url, n=4)
    with open_store(url) as store:
        k1, _ = _manifest_doc(store, 1)
        _, d3 = _manifest_doc(store, 3)
        d3["parent_manifest"] = k1
        k3 = resign_manifest(store, d3, point_head=False)
        _, d4 = _manifest_doc(store, 4)
        d4["parent_manifest"] = k3
        resign_manifest(store, d4)
    with Subscriber(url) as sub:
        # schema 3 reaches version 1 from 4 through a skip pointer (4 → 2 → 1), past version 3
        for call in (sub.log, sub.pull, *([lambda: sub.info(1)] if SCHEMA_VERSION < 3 else [])):
            with pytest.raises(CorruptObjectError, match="000000000003-"):
                call()
    assert main(["verify", url, "--all"]) == 1
    assert main(["log", url]) == 1


def test_parent_link_to_a_manifest_filed_under_another_version(url: str) -> None:
    """D12: the parent link names a key with version 2's prefix whose content is version 1."""
    publish_history(url, n=3)
    with open_store(url) as store:
        k1, _ = _manifest_doc(store, 1)
        data = store.get(k1)
        fake = f"manifests/{2:012d}-{k1.rsplit('-', 1)[1]}"
        store.put(fake, data, mode="overwrite")
        _, d3 = _manifest_doc(store, 3)
        d3["parent_manifest"] = fake
        resign_manifest(store, d3)
    with Subscriber(url) as sub:
        for call in (sub.log, sub.pull):
            with pytest.raises(CorruptObjectError, match=fake):
                call()


def test_delta_whose_anchor_is_not_an_anchor(url: str) -> None:
    publish_history(url, n=4)
    with open_store(url) as store:
        _, d4 = _manifest_doc(store, 4)
        d4["anchor"] = 2  # a delta
        key = resign_manifest(store, d4)
    with Subscriber(url) as sub:
        for call in (sub.pull, sub.log):
            with pytest.raises(CorruptObjectError, match=key):
                call()


@pytest.mark.parametrize("how", ["garbage", "sha", "missing"])
def test_verify_all_checks_the_delta_segments_of_anchors(url: str, how: str, capsys) -> None:
    """D10: verify used to materialize each version from its anchor's full segments only."""
    anchor_with_deltas(url)
    assert main(["verify", url, "--all"]) == 0
    name, index = corrupt_anchor_delta(url, how)
    capsys.readouterr()
    assert main(["verify", url, "--all"]) == 1
    out, err = capsys.readouterr()
    assert f"{name}[{index}]" in out and "delta" in out, out
    assert err.count("\n") == 1, err
    with Subscriber(url) as sub:
        report = sub.verify(all_versions=True)
        assert not report.ok and report.versions == [1, 2, 3, 4]
        assert len(report.problems) == 1 and f"{name}[{index}]" in report.problems[0].message
        assert report.problems[0].version == 4 and report.segments > 0


@pytest.mark.parametrize("how", ["garbage", "sha", "missing"])
def test_pull_into_falls_back_to_the_anchor_full_segment(url: str, how: str, caplog) -> None:
    """D10: a worker one version behind an anchor whose delta segment is bad takes the full
    segment of that chunk instead of failing forever."""
    states = anchor_with_deltas(url)
    name, index = corrupt_anchor_delta(url, how)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(3)
        with caplog.at_level("WARNING", logger="deltastore.read.engine"):
            assert sub.pull_into(target).version == 4
        assert_bits_equal(target, states[3])
        assert any(f"{name}[{index}]" in r.getMessage() for r in caplog.records), caplog.text


def test_pull_into_without_a_clean_path_changes_nothing(url: str) -> None:
    """Both the delta and the full segment of a chunk are bad: raise, nothing applied."""
    states = anchor_with_deltas(url)
    name, index = corrupt_anchor_delta(url, "sha")
    with open_store(url) as store:
        _, d4 = head_manifest(store)
        c = next(c for t in d4["tensors"] if t["name"] == name for c in t["chunks"] if c["index"] == index)
        c["full"]["sha256"] = "d" * 64
        resign_manifest(store, d4)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(3)
        with pytest.raises(IntegrityError):
            sub.pull_into(target)
        assert_bits_equal(target, states[2])
        assert sub.version == 3


def test_verify_reports_every_bad_segment(url: str) -> None:
    """One run names every bad object (here: a segment of version 2's pack and an anchor's
    delta segment), not only the first; the latest version alone is checked by default."""
    anchor_with_deltas(url)
    name, index = corrupt_anchor_delta(url, "sha")
    with open_store(url) as store:
        _, d2 = _manifest_doc(store, 2)
        pack = d2["blobs"][0]["key"]
        store.put(pack, _flip(store.get(pack), 0), mode="overwrite")
    with Subscriber(url) as sub:
        report = sub.verify(all_versions=True)
        assert {p.version for p in report.problems} == {2, 4}, report.problems
        assert any(pack in p.message for p in report.problems)
        latest = sub.verify()
        assert latest.versions == [4] and [p.version for p in latest.problems] == [4]
        assert f"{name}[{index}]" in latest.problems[0].message
