"""The compactor (design 005 D5): squashes composed from stored deltas, verified before they are
written, never across a chain break, registered in the history index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltastore import Publisher, Subscriber, codec
from deltastore.cli import main
from deltastore.errors import IntegrityError
from deltastore.format.history import History
from deltastore.format.models import Index, SquashManifest, SquashRef
from deltastore.format.objects import decode_object
from deltastore.layout.tensors import bits, state_digest
from deltastore.lifecycle.compact import compact, merge_squashes
from deltastore.lifecycle.index import read_index
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.lifecycle import publish_run, set_index
from testkit.stores import keys
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, snapshot

HEAD_VERSION = 22


@pytest.fixture(scope="module")
def run22(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    """A tiny AdamW fine-tune: version 1 an anchor, 2..22 deltas."""
    url = str(tmp_path_factory.mktemp("compact") / "store")
    return url, publish_run(url, HEAD_VERSION)


def apply_squash(url: str, key: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply a squash's segments to ``state`` directly with the codec (not through a reader)."""
    store = open_store(url)
    sq = decode_object(SquashManifest, store.get(key), key)
    packs = [store.get(b.key) for b in sq.blobs]
    assert all(b.role == "d" and b.key.startswith(f"objects/{sq.commit_id}/") for b in sq.blobs)
    out = snapshot(state)
    for t in sq.tensors:
        flat = bits(out[t.name]).reshape(-1)
        row = int(np.prod(t.shape[1:])) if t.shape else 1
        for c in t.chunks:
            a, b = (c.index * t.chunk_rows * row, min((c.index + 1) * t.chunk_rows, t.shape[0]) * row) if t.shape else (0, 1)
            seg = packs[c.delta.blob][c.delta.offset : c.delta.offset + c.delta.length]
            chunk = flat[a:b]
            codec.apply_delta(chunk, seg, codec=c.delta.codec)
            assert state_digest(chunk) == c.digest
    return out


@pytest.mark.parametrize("k", [2, 8, 20])
def test_a_squash_of_k_versions_applies_bit_exactly(run22: Any, k: int) -> None:
    url, states = run22
    h = HEAD_VERSION - k
    report = compact(url, bases=[h], register=False)
    (sq,) = report.squashes
    assert (sq.from_, sq.to, report.to) == (h, HEAD_VERSION, HEAD_VERSION) and not report.registered
    from testkit.tensors import assert_bits_equal

    assert_bits_equal(apply_squash(url, sq.key, states[h]), states[HEAD_VERSION], f"S({h}, {HEAD_VERSION})")
    assert 0 < sq.bytes < sq.chain_bytes, (sq.bytes, sq.chain_bytes)
    print(f"k={k}: chain {sq.chain_bytes} B, squash {sq.bytes} B, ratio {sq.chain_bytes / sq.bytes:.2f}")


def test_a_corrupted_composition_is_refused_and_nothing_is_written(run22: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = run22
    real = codec.compose_deltas

    def flip(a: bytes, b: bytes, **kw: Any) -> codec.Segment | None:
        good = real(a, b, **kw)
        zeros = np.zeros(kw["count"], kw["dtype"])
        bumped = zeros.copy()
        bumped[0] = 1
        off = codec.encode_delta(zeros, bumped)  # element 0 one off
        if good is None:
            return off
        return real(good.data, off.data, codec_a=good.codec, codec_b=off.codec, dtype=kw["dtype"], count=kw["count"])

    monkeypatch.setattr("deltastore.lifecycle.compact.compose_deltas", flip)
    store = open_store(url)
    before = keys(store)
    with pytest.raises(IntegrityError, match=rf"squash 14→{HEAD_VERSION}: chunk \S+\[\d+\].*nothing was written"):
        compact(url, bases=[14], register=False)
    assert keys(store) == before


def test_a_squash_never_spans_a_chain_break(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = TinyTrainer(1)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for _ in range(4):
            pub.publish(trainer.step())
    with Publisher(url, writer_policy=WriterPolicy(threads=2, resume=False),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:  # no reference: v5 restarts the chain
        for _ in range(3):
            pub.publish(trainer.step())
    store = open_store(url)
    before = keys(store)
    report = compact(url, bases=[2, 5], register=False)
    assert [s.from_ for s in report.squashes] == [5]
    assert report.skipped == ((2, "version 5 starts a new chain (delta_base null): a squash never spans it"),)
    assert len(keys(store) - before) == 2  # S(5, 7): one pack and its manifest, nothing for base 2


def test_bases_below_two_versions_are_skipped_and_default_bases_come_from_the_ledger(run22: Any) -> None:
    url, _ = run22
    from deltastore.fleet.ledger import HeartbeatWriter

    store = open_store(url)
    lineage = History(store).read_head()[0].lineage
    HeartbeatWriter(store, "w-behind").beat(17, lineage=lineage)
    HeartbeatWriter(store, "w-current").beat(HEAD_VERSION - 1, lineage=lineage)
    HeartbeatWriter(store, "w-other-run").beat(10, lineage="f" * 32)
    report = compact(url, register=False)
    # 17 (live, two or more behind) and the anchor 1; not 21 (one behind) nor 10 (another lineage)
    assert [s.from_ for s in report.squashes] == [1, 17]
    for w in ("w-behind", "w-current", "w-other-run"):
        store.delete(f"workers/{w}.json")
    assert compact(url, bases=[HEAD_VERSION - 1], register=False).skipped[0][0] == HEAD_VERSION - 1


def test_squashes_are_registered_in_the_index(run22: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration is one deltastore.lifecycle.index.update_index call (the real one, watched)."""
    import deltastore.lifecycle.index

    url, states = run22
    calls = []
    real = deltastore.lifecycle.index.update_index

    def update_index(store: Any, history: History, mutate: Any, *, writer: str, **kw: Any) -> Any:
        calls.append(writer)
        return real(store, history, mutate, writer=writer, **kw)

    monkeypatch.setattr(deltastore.lifecycle.index, "update_index", update_index)
    report = compact(url, bases=[HEAD_VERSION - 8], writer="c1")
    assert report.registered and calls == ["c1"]
    store = open_store(url)
    history = History(store)
    index = read_index(history, history.read_head()[0])
    assert index is not None and [s.key for s in index.squashes] == [report.squashes[0].key]
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(HEAD_VERSION - 8)
        before = sub.bytes_fetched
        sub.pull_into(target)
        assert sub.bytes_fetched - before == report.squashes[0].bytes
        from testkit.tensors import assert_bits_equal

        assert_bits_equal(target, states[HEAD_VERSION])


def test_merge_keeps_one_squash_per_base_and_drops_those_below_the_floor(run22: Any) -> None:
    url, _ = run22
    head = History(open_store(url)).read_head()[0]
    idx = Index(lineage=head.lineage, generation=1, floor=3, writer="gc", created="t",
                squashes=(SquashRef(from_=4, to=9, key="objects/a/x.squash.json.zst", sha256="0" * 64, bytes=1),))
    refs = [SquashRef(from_=f, to=20, key=f"objects/b/{f}.squash.json.zst", sha256="1" * 64, bytes=2) for f in (2, 4)]
    new = merge_squashes(head, idx, refs, "me")
    assert [(s.from_, s.to) for s in new.squashes] == [(4, 20)] and new.floor == 3 and new.generation == 2


def test_cli_compact_json(run22: Any, capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = run22
    assert main(["compact", url, "--base", "12", "--base", "15", "--no-register", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["from"], s["to"]) for s in doc["squashes"]] == [(12, HEAD_VERSION), (15, HEAD_VERSION)]
    assert doc["bytes"] < doc["chain_bytes"] and doc["registered"] is False


def test_compact_and_catch_up_over_s3(moto_s3_url: Any) -> None:
    """Create-only writes of packs and the squash manifest through a real S3 endpoint (moto)."""
    from testkit.tensors import assert_bits_equal

    t = moto_s3_url
    trainer = TinyTrainer(3)
    states = {}
    with Publisher(t.url, storage_options=t.storage_options, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        state = trainer.export()
        for _ in range(6):
            states[pub.publish(state).version] = snapshot(state)
            state = trainer.step()
    (sq,) = compact(t.url, bases=[2], storage_options=t.storage_options, register=False).squashes
    with t.open() as store:
        set_index(store, squashes=[sq.ref()])
    with Subscriber(t.url, storage_options=t.storage_options, threads=2) as sub:
        target = sub.pull(2)
        before = sub.bytes_fetched
        sub.pull_into(target)
        assert sub.bytes_fetched - before == sq.bytes
        assert_bits_equal(target, states[6])


def test_a_squash_spilled_to_disk_and_split_into_packs_applies_bit_exactly(run22: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from testkit.tensors import assert_bits_equal

    url, states = run22
    monkeypatch.setattr("deltastore.lifecycle.compact.SPILL_MEMORY_BYTES", 1)  # every composed segment on local disk
    monkeypatch.setattr("deltastore.lifecycle.compact.PACK_TARGET_BYTES", 300)  # several packs
    (sq,) = compact(url, bases=[HEAD_VERSION - 8], register=False).squashes
    doc = decode_object(SquashManifest, open_store(url).get(sq.key), sq.key)
    assert len(doc.blobs) > 1
    assert sum(b.size for b in doc.blobs) == sq.bytes
    assert_bits_equal(apply_squash(url, sq.key, states[HEAD_VERSION - 8]), states[HEAD_VERSION])


def test_one_run_composes_every_base_in_one_pass(run22: Any) -> None:
    """Several bases, across chunks that change at different versions: each squash of the one
    pass applies bit-exactly, and equals the squash written for that base alone."""
    from testkit.tensors import assert_bits_equal

    url, states = run22
    bases = [1, 2, 9, 15, 20]
    report = compact(url, bases=bases, register=False)
    assert [s.from_ for s in report.squashes] == bases
    store = open_store(url)
    for s in report.squashes:
        assert_bits_equal(apply_squash(url, s.key, states[s.from_]), states[HEAD_VERSION], f"S({s.from_}, {HEAD_VERSION})")
        (alone,) = compact(url, bases=[s.from_], register=False).squashes
        assert (alone.bytes, alone.chain_bytes, alone.chunks) == (s.bytes, s.chain_bytes, s.chunks)
        a = decode_object(SquashManifest, store.get(alone.key), alone.key)
        b = decode_object(SquashManifest, store.get(s.key), s.key)
        assert a.tensors == b.tensors
