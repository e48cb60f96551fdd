"""deltastore.read.plan: which segments a pull needs, from manifests alone (no store, no tensors)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from deltastore import CorruptObjectError
from deltastore.format.keys import manifest_key, object_key
from deltastore.format.models import BlobRef, ChunkEntry, Manifest, SegmentRef, TensorEntry
from deltastore.read.plan import ChunkPlan, check_entries, digests, layout, plan_forward, plan_from_anchor

SHAPE, ROWS = (4, 2), 2  # "w": float32, two chunks of 2 rows (4 elements each)


def _seg(blob: int, offset: int, length: int) -> SegmentRef:
    return SegmentRef(blob=blob, offset=offset, length=length, sha256="0" * 64, codec="full/2", n_changed=0)


def _manifest(version: int, kind: str, chunks: dict[int, tuple[int | None, int | None]], *, delta_base: int | None | str = "parent",
              anchor: int | None = None, shape: tuple[int, ...] = SHAPE) -> tuple[str, Manifest]:  # fmt: skip
    """A manifest of tensor "w" listing ``chunks``: index -> (full length, delta length); the
    digest of chunk i at version v is ``f"{v}-{i}"``."""
    parent = version - 1 if version > 1 else None
    entries, offset = [], 0
    for index, (full_len, delta_len) in sorted(chunks.items()):
        full = delta = None
        if full_len is not None:
            full, offset = _seg(0, offset, full_len), offset + full_len
        if delta_len is not None:
            delta, offset = _seg(0, offset, delta_len), offset + delta_len
        entries.append(ChunkEntry(index=index, digest=f"{version}-{index}", full=full, delta=delta))
    h = f"{version:064x}"
    m = Manifest(
        version=version, parent=parent, parent_manifest=manifest_key(parent, "0" * 64) if parent else None,
        kind=kind, anchor=anchor or version, delta_base=parent if delta_base == "parent" else delta_base,
        created="t", writer="w", epoch=0, commit_id="c", lineage="0" * 32,
        blobs=(BlobRef(key=object_key("0" * 32, h, ".pack"), size=offset, sha256=h, role="f"),),
        tensors=(TensorEntry(name="w", dtype="float32", shape=shape, chunk_rows=ROWS, chunks=tuple(entries)),),
    )  # fmt: skip
    return manifest_key(version, h), m


def _sizes(p: ChunkPlan) -> tuple:
    return (p.full.ref.length if p.full else None, tuple(s.ref.length for s in p.deltas))


def test_plan_from_anchor_replays_every_delta_that_lists_a_chunk() -> None:
    ms = [
        _manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None),
        _manifest(2, "delta", {0: (None, 5)}, anchor=1),
        _manifest(3, "delta", {0: (None, 6), 1: (None, 7)}, anchor=1),
    ]
    plans = {p.index: p for p in plan_from_anchor(ms, layout(ms[0][1]))}
    assert _sizes(plans[0]) == (100, (5, 6)) and plans[0].digest == "3-0"
    assert _sizes(plans[1]) == (101, (7,)) and plans[1].digest == "3-1"
    assert [s.mi for s in plans[0].steps()] == [0, 1, 2]
    assert plans[0].span == (0, 4) and plans[1].span == (4, 8)
    assert plans[0].cost == 111 and plans[0].fallbacks == ()
    assert digests(ms) == {("w", 0): "3-0", ("w", 1): "3-1"}


@pytest.mark.parametrize(
    "why, ms",
    [
        ("starts at a delta", [_manifest(2, "delta", {0: (None, 5)}, anchor=1)]),
        ("anchor lacks a chunk", [_manifest(1, "anchor", {0: (100, None)}, delta_base=None)]),
        ("delta lists a chunk the anchor lacks", [_manifest(1, "anchor", {0: (100, None)}, delta_base=None),
                                                  _manifest(2, "delta", {1: (None, 5)}, anchor=1)]),
        ("delta of another shape", [_manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None),
                                    _manifest(2, "delta", {0: (None, 5)}, anchor=1, shape=(6, 2))]),
    ],
)  # fmt: skip
def test_plan_from_anchor_refuses_inconsistent_chains(why: str, ms) -> None:
    with pytest.raises(CorruptObjectError):
        plan_from_anchor(ms, layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1]))


def test_plan_forward_takes_deltas_and_keeps_the_full_segment_as_fallback() -> None:
    specs = layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1])
    ms = [
        _manifest(5, "delta", {0: (None, 5)}, anchor=4),
        _manifest(6, "anchor", {0: (100, 6), 1: (101, None)}),  # an anchor with deltas: chunk 1 unchanged
        _manifest(7, "delta", {0: (None, 7)}, anchor=6),
    ]
    (p,) = plan_forward(ms, specs)
    assert (p.index, _sizes(p), p.digest) == (0, (None, (5, 6, 7)), "7-0")
    assert [_sizes(f) for f in p.fallbacks] == [(100, (7,))], "the anchor's full segment, then the later delta"
    assert p.fallbacks[0].digest == "7-0"


def test_plan_forward_prefers_the_cheaper_full_segment() -> None:
    specs = layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1])
    ms = [_manifest(5, "delta", {1: (None, 500)}, anchor=4), _manifest(6, "anchor", {0: (100, None), 1: (100, 500)})]
    (p,) = plan_forward(ms, specs)
    assert (p.index, _sizes(p), p.fallbacks) == (1, (100, ()), ())


def test_plan_forward_across_an_anchor_without_deltas_needs_its_full_segments() -> None:
    specs = layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1])
    ms = [_manifest(5, "delta", {0: (None, 5)}, anchor=4), _manifest(6, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None)]
    plans = {p.index: p for p in plan_forward(ms, specs)}
    assert _sizes(plans[0]) == (100, ()) and _sizes(plans[1]) == (101, ())


def test_plan_forward_refuses_what_it_cannot_plan() -> None:
    specs = layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1])
    with pytest.raises(CorruptObjectError, match="no way"):  # an anchor entry without any segment
        plan_forward([_manifest(6, "anchor", {0: (None, None)}, delta_base=None)], specs)
    with pytest.raises(CorruptObjectError, match="layout"):
        plan_forward([_manifest(5, "delta", {0: (None, 5)}, anchor=4, shape=(4, 3))], specs)
    with pytest.raises(CorruptObjectError, match="'w'"):
        check_entries("k", _manifest(5, "delta", {0: (None, 5)}, anchor=4)[1], {}, 4)


def test_plans_are_frozen_values() -> None:
    ms = [_manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None)]
    p = plan_from_anchor(ms, layout(ms[0][1]))[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.digest = "x"  # type: ignore[misc]
    assert p == plan_from_anchor(ms, layout(ms[0][1]))[0]


def test_plan_forward_does_not_trust_an_unchanged_claim_that_contradicts_the_digests(caplog) -> None:
    """An anchor with deltas lists chunk 1 without a delta ("unchanged") but with another digest
    than the version before: with the held digests, the planner takes the anchor's full segment
    (pull_into then reaches what pull() reads from that anchor) instead of keeping the chunk."""
    specs = layout(_manifest(1, "anchor", {0: (1, None), 1: (1, None)}, delta_base=None)[1])
    ms = [_manifest(5, "delta", {0: (None, 5)}, anchor=4), _manifest(6, "anchor", {0: (100, 6), 1: (101, None)})]
    held = {("w", 0): "4-0", ("w", 1): "4-1"}  # chunk 1 at 4 is "4-1"; the anchor says "6-1"
    assert [p.index for p in plan_forward(ms, specs)] == [0]  # without digests: the claim is trusted
    with caplog.at_level("WARNING", logger="deltastore.read.plan"):
        plans = {p.index: p for p in plan_forward(ms, specs, held)}
    assert _sizes(plans[1]) == (101, ()) and plans[1].digest == "6-1"
    assert "lists chunk w[1] as unchanged" in caplog.text
    consistent = {("w", 0): "4-0", ("w", 1): "6-1"}
    assert [p.index for p in plan_forward(ms, specs, consistent)] == [0]


# --- catch-up pricing and squashes (design 005 D6) ----------------------------------------------


def test_chain_price_uses_cumulative_bytes_only_within_one_chain() -> None:
    from deltastore.format.models import Stats
    from deltastore.read.plan import chain_price

    ms = [
        _manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None),
        _manifest(2, "delta", {0: (None, 5)}, anchor=1),
        _manifest(3, "delta", {0: (None, 6), 1: (None, 7)}, anchor=1),
        _manifest(4, "anchor", {0: (90, None), 1: (91, None)}, delta_base=None),
        _manifest(5, "delta", {1: (None, 8)}, anchor=4),
    ]
    reads = []

    def between(lo: int, hi: int) -> Any:
        reads.append((lo, hi))
        return [km for km in ms if lo < km[1].version <= hi]

    assert chain_price(ms[1][1], ms[2][1], lambda: between(2, 3)) == 13  # summed: no cum recorded
    assert chain_price(ms[0][1], ms[4][1], lambda: between(1, 5)) == 5 + 13 + 181 + 8  # the break at 4 by its full bytes
    with_cum = [(k, m.model_copy(update={"stats": Stats(cum_delta_bytes=c), "chain_start": s}))
                for (k, m), c, s in zip(ms, [0, 5, 18, 0, 8], [1, 1, 1, 4, 4])]  # fmt: skip
    reads.clear()
    assert chain_price(with_cum[1][1], with_cum[2][1], lambda: between(2, 3)) == 13 and reads == []
    assert chain_price(with_cum[1][1], with_cum[4][1], lambda: between(2, 5)) == 13 + 181 + 8 and reads == [(2, 5)]


def test_plan_changed_from_anchor_skips_chunks_already_at_their_target_digest() -> None:
    from deltastore.read.plan import plan_changed_from_anchor

    ms = [
        _manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None),
        _manifest(2, "delta", {0: (None, 5)}, anchor=1),
    ]
    held = {("w", 0): "old", ("w", 1): "1-1"}  # chunk 1 held at its digest at 2
    assert [(p.index, _sizes(p)) for p in plan_changed_from_anchor(ms, layout(ms[0][1]), held)] == [(0, (100, (5,)))]


def test_check_squash_refuses_chunks_outside_the_layout_or_their_packs() -> None:
    from deltastore.format.models import SquashManifest
    from deltastore.read.plan import check_squash

    _, a = _manifest(1, "anchor", {0: (100, None), 1: (101, None)}, delta_base=None)
    specs = layout(a)
    pack = BlobRef(key=f"objects/{'a' * 32}/{'b' * 64}.pack", size=10, sha256="b" * 64, role="d")

    def sq(index: int, length: int) -> SquashManifest:
        entry = ChunkEntry(index=index, digest="x", delta=_seg(0, 0, length))
        return SquashManifest(from_=1, to=3, from_manifest="m1", to_manifest="m3", commit_id="a" * 32, writer="c",
                              created="t", blobs=(pack,),
                              tensors=(TensorEntry(name="w", dtype="float32", shape=SHAPE, chunk_rows=ROWS, chunks=(entry,)),))  # fmt: skip

    check_squash("k", sq(1, 10), specs)
    with pytest.raises(CorruptObjectError, match="out of range"):
        check_squash("k", sq(2, 10), specs)
    with pytest.raises(CorruptObjectError, match="outside its packs"):
        check_squash("k", sq(0, 11), specs)
