"""Partial pulls (SPEC §8 "Partial pulls", deltastore.layout.select).

- a rank's rows (and a name selection) pulled and fast-forwarded are bit-exact against the full
  pull's rows at every version, across anchors, with chunks straddling the slices' edges;
- a partial subscriber fetches no more than the chunks overlapping its selection (counted from
  the plan, against Subscriber.bytes_fetched);
- schema-4 groups selected by member name;
- selections that do not fit the layout, and targets that do not fit the selection, are typed
  errors (SelectionError); a modified slice is detected with nothing applied;
- a sharded version (parts) is still refused, by a partial subscriber too.
"""

from __future__ import annotations

import pytest
import torch

from deltastore import Subscriber
from deltastore.errors import (
    CorruptObjectError,
    LayoutMismatchError,
    SelectionError,
    TargetModifiedError,
)
from deltastore.layout.select import Selection
from deltastore.layout.tensors import bits
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from testkit.partial import expected_rows, needed_bytes
from testkit.stores import head_manifest, publish_edits, resign_manifest
from testkit.tensors import assert_bits_equal, snapshot

#: Chunks of 480 bytes: 10 rows of 24 bf16, so 16-row slices straddle chunk edges.
CHUNK = 480


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.attn.w": torch.randn(64, 24, generator=g).bfloat16(),
        "layers.0.mlp.w": torch.randn(128, 24, generator=g).bfloat16(),
        "layers.1.attn.w": torch.randn(64, 24, generator=g).bfloat16(),
        "layers.1.mlp.w": torch.randn(128, 24, generator=g).bfloat16(),
        "norm.f32": torch.randn(32, generator=g),
        "emb": torch.randn(96, 12, generator=g).half(),
    }


def _publish_chain(url: str, n: int = 6, **kw) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n (an anchor every 3), returned as published."""
    return publish_edits(url, _model(), n, seed=1, fraction=0.02, anchor_policy=AnchorPolicy(every=3),
                         layout_policy=LayoutPolicy(chunk_bytes=CHUNK), **kw)


@pytest.mark.parametrize("sel", [
    Selection(shard=(0, 1, 4)),
    Selection(shard=(0, 3, 8), shard_names=("layers.*",)),
    Selection(shard=(0, 2, 5)),
    Selection(names=("layers.1.*", "emb"), shard=(0, 0, 2)),
    Selection(names=("layers.0.mlp.w",)),
    Selection(shard=(1, 1, 4), shard_names=("layers.*", "emb")),
    Selection(shard=(1, 2, 5), shard_names=("layers.*",)),
    Selection(shard=(0, 1, 2), shard_names=("layers.*.attn.w",), shard_dims={"layers.*.mlp.w": 1}),
], ids=["rows-1of4", "rows-3of8-layers", "rows-2of5-uneven", "names+rows", "names", "cols-1of4",
        "cols-2of5-uneven", "tensor-parallel"])
def test_partial_pull_and_pull_into_match_the_full_rows(tmp_path, sel: Selection) -> None:
    url = str(tmp_path / "store")
    states = _publish_chain(url)
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        assert_bits_equal(mine, expected_rows(states[0], sel), "v1")
        for v in range(2, len(states) + 1):
            assert sub.pull_into(mine, v) is not None
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"v{v}")
            for name, spans in sub.last_changed.items():  # in the slice's own coordinates
                assert all(0 <= a < b <= mine[name].numel() for a, b in spans)
        assert sub.pull_into(mine) is None
    # a fresh partial subscriber fast-forwards a zeroed target from nothing (allocate)
    with Subscriber(url, threads=2, select=sel) as sub:
        fresh = sub.allocate()
        sub.pull_into(fresh, 4)
        assert_bits_equal(fresh, expected_rows(states[3], sel), "fresh v4")


def test_partial_pull_fetches_only_the_chunks_it_needs(tmp_path) -> None:
    url = str(tmp_path / "store")
    _publish_chain(url, n=3)  # 1 anchor, 2 deltas
    sel = Selection(shard=(0, 2, 8), shard_names=("layers.*",), names=("layers.*",))
    with Subscriber(url, threads=2) as full:
        full.pull(1)
        whole = full.bytes_fetched
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        first = sub.bytes_fetched
        assert 0 < first <= needed_bytes(url, sel, 1)
        assert first < whole / 4, (first, whole)
        sub.pull_into(mine, 3)
        assert sub.bytes_fetched - first <= needed_bytes(url, sel, 3, since=1)


def test_groups_are_selected_by_member_name(tmp_path) -> None:
    url = str(tmp_path / "store")
    g = torch.Generator().manual_seed(3)
    state = {f"blk.{i}.norm": torch.randn(40, generator=g).bfloat16() for i in range(12)}
    state["big"] = torch.randn(2048, 160, generator=g).bfloat16()  # > 256 KiB: not grouped
    states = publish_edits(url, state, 3, seed=2, fraction=0.05,
                           layout_policy=LayoutPolicy(chunk_bytes=64, group_small_tensors=True))
    sel = Selection(names=("blk.3.norm", "blk.[79].norm"))
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        assert any(s.members for s in sub.units().values())  # the layout really groups them
        assert set(mine) == {"blk.3.norm", "blk.7.norm", "blk.9.norm"}
        assert_bits_equal(mine, expected_rows(states[0], sel))
        for v in (2, 3):
            sub.pull_into(mine, v)
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"v{v}")
    cut_member = Selection(names=("blk.*",), shard=(0, 0, 2), shard_names=("blk.1.*",))
    with Subscriber(url, threads=2, select=cut_member) as sub, pytest.raises(SelectionError, match="group row"):
        sub.pull()


def test_selections_that_do_not_fit_the_layout_are_typed_errors(tmp_path) -> None:
    url = str(tmp_path / "store")
    _publish_chain(url, n=2)
    with pytest.raises(SelectionError, match="dim 2"):
        Selection(shard=(2, 0, 2))
    with pytest.raises(SelectionError, match="dim 3"):
        Selection(shard=(0, 0, 2), shard_dims={"emb": 3})
    with pytest.raises(SelectionError, match="shard_dims needs shard"):
        Selection(shard_dims={"emb": 1})
    with pytest.raises(SelectionError, match="rank"):
        Selection(shard=(0, 4, 4))
    for sel, match in [
        (Selection(shard=(0, 0, 40)), "fewer than 40 ranks"),
        (Selection(shard=(1, 0, 13), shard_names=("emb",)), "12 columns, fewer than 13 ranks"),
        (Selection(shard=(1, 0, 2)), "no dimension 1"),  # norm.f32 is 1-D
        (Selection(names=("layers.9.*",)), "matches no tensor"),
    ]:
        with Subscriber(url, threads=2, select=sel) as sub:
            with pytest.raises(SelectionError, match=match):
                sub.pull()
            with pytest.raises(LayoutMismatchError):  # SelectionError is one
                sub.allocate()
    sel = Selection(shard=(0, 1, 2))
    with Subscriber(url, threads=2, select=sel) as sub:
        whole = Subscriber(url, threads=2).pull(1)
        with pytest.raises(SelectionError, match="selection"):
            sub.pull_into(whole, 1)  # a whole target for a partial subscriber
        with pytest.raises(SelectionError, match="selection"):
            sub.stage(whole, 2)  # staged alike


def test_a_modified_slice_is_detected_and_nothing_is_applied(tmp_path) -> None:
    url = str(tmp_path / "store")
    states = _publish_chain(url, n=3)
    sel = Selection(shard=(0, 1, 4))
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        b = bits(mine["emb"])
        b[-1] ^= 1  # an element of an edge chunk, outside the others' slices
        before = snapshot(mine)
        with pytest.raises(TargetModifiedError):
            sub.pull_into(mine, 3)
        assert_bits_equal(mine, before, "nothing applied")
        b[-1] ^= 1
        sub.pull_into(mine, 3)
        assert_bits_equal(mine, expected_rows(states[2], sel))


def test_a_column_cut_reads_and_verifies_the_whole_tensor_and_holds_only_its_columns(tmp_path) -> None:
    """Chunks are whole rows (SPEC §2): a cut along dim 1 needs every chunk of the tensor, keeps
    the other columns beside the user's tensor (so later deltas verify against whole chunks),
    and detects a change to the user's columns or to the kept remainder with nothing applied."""
    url = str(tmp_path / "store")
    states = _publish_chain(url, n=4)
    sel = Selection(names=("layers.0.mlp.w",), shard=(1, 1, 3))
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        assert mine["layers.0.mlp.w"].shape == (128, 8)
        assert sub.bytes_fetched == needed_bytes(url, Selection(names=("layers.0.mlp.w",)), 1)
        assert_bits_equal(mine, expected_rows(states[0], sel))
        b = bits(mine["layers.0.mlp.w"])
        b[5] ^= 1  # the user's own columns
        before = snapshot(mine)
        with pytest.raises(TargetModifiedError):
            sub.pull_into(mine, 3)
        assert_bits_equal(mine, before, "nothing applied")
        b[5] ^= 1
        sub.pull_into(mine, 3)
        assert_bits_equal(mine, expected_rows(states[2], sel))
        kept = next(iter(sub._reader.partial.spare.values()))
        kept[0] ^= 1  # the kept remainder (another rank's columns)
        before = snapshot(mine)
        with pytest.raises(TargetModifiedError):
            sub.pull_into(mine, 4)
        assert_bits_equal(mine, before, "nothing applied")


def test_a_hostile_parts_entry_is_refused_by_a_partial_subscriber(tmp_path) -> None:
    url = str(tmp_path / "store")
    _publish_chain(url, n=1)
    store = open_store(url)
    _key, doc = head_manifest(store)
    doc["parts"] = [{"part": 0}]
    resign_manifest(store, doc)
    sel = Selection(shard=(0, 0, 2))
    with Subscriber(url, threads=2, select=sel) as sub, pytest.raises(CorruptObjectError):
        sub.pull()


@pytest.mark.parametrize("sel", [Selection(names=("a",)), Selection(shard=(0, 1, 2)), Selection(shard=(0, 2, 3)),
                                 Selection(shard=(1, 1, 2), shard_names=("a", "c"))])
def test_a_sharded_version_is_read_partially(tmp_path, sel: Selection) -> None:
    """A version written by three ranks (golden store, design 010) read through a selection:
    the same rows as the full pull, and pull_into fast-forwards the slice."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file

    golden = Path(__file__).resolve().parents[1] / "golden"
    shutil.copytree(golden / "store-sharded", tmp_path / "store")
    url = f"file://{tmp_path / 'store'}"
    want = {v: load_file(str(golden / "store-sharded-expected" / f"v{v}.safetensors")) for v in (1, 4)}
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        assert_bits_equal(mine, expected_rows(want[1], sel))
        sub.pull_into(mine, 4)
        assert_bits_equal(mine, expected_rows(want[4], sel))


def test_partial_pull_over_real_s3(moto_s3_url) -> None:
    url, opts = moto_s3_url.url, moto_s3_url.storage_options
    states = _publish_chain(url, n=4, storage_options=opts)
    sel = Selection(names=("layers.*",), shard=(0, 1, 2))
    with Subscriber(url, threads=2, select=sel, storage_options=opts) as sub:
        mine = sub.pull(2)
        sub.pull_into(mine)
        assert_bits_equal(mine, expected_rows(states[-1], sel))


def test_range_part_bytes_reads_a_pack_as_several_ranges(tmp_path) -> None:
    from deltastore.storage import open_store as _open
    from testkit.stores import WrappedStore

    class Ranges(WrappedStore):
        def __init__(self, inner):
            super().__init__(inner)
            self.reads: list[tuple[str, tuple[int, int] | None]] = []

        def get(self, key, *, byte_range=None):
            if key.endswith(".pack"):
                self.reads.append((key, byte_range))
            return self.inner.get(key, byte_range=byte_range)

    url = str(tmp_path / "store")
    states = _publish_chain(url, n=2)
    got = {}
    for part in (None, 64):
        store = Ranges(_open(url))
        with Subscriber(url, threads=2, store=store, range_part_bytes=part) as sub:
            held = sub.pull(1)
            store.reads.clear()
            sub.pull_into(held, 2)
            assert_bits_equal(held, states[1])
            got[part] = list(store.reads)
    assert len(got[64]) > len(got[None])
