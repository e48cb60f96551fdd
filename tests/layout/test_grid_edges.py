"""Edges of the column grid (design 011) that the
grid tests do not reach. One column block (``chunk_cols == shape[1]``, legal though the writer
writes 0), empty grid tensors (no rows; a zero trailing dimension), a 3-D tensor whose columns
the grid does not divide, partial pulls that fail mid-apply (the aligned live view and the
edge-keeping SliceTarget roll back bit-exactly), the worker cache and ``verify`` over a grid
store.

Expectations come from torch slicing of the states as published (testkit.partial's
``expected_rows``), never from deltastore.layout.grid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import CachePolicy, IntegrityError, PollPolicy, Publisher, Subscriber
from deltastore.layout.select import Selection
from deltastore.layout.tensors import TensorSpec
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, AsyncPolicy, LayoutPolicy, WriterPolicy
from testkit.hypo import examples
from testkit.partial import expected_rows
from testkit.tensors import assert_bits_equal, snapshot


def _spec(name: str, shape: tuple[int, ...], rows: int, cols: int, dtype: str = "bfloat16") -> TensorSpec:
    return TensorSpec(name, dtype, shape, rows, (), cols)


def _publish(url: str, specs: dict[str, TensorSpec], states: list[dict[str, torch.Tensor]], **kw) -> None:
    kw.setdefault("writer_policy", WriterPolicy(threads=2))
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=False), **kw) as pub:
        pub._explicit_specs = specs
        for s in states:
            pub.publish(s)


def _edit(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A sparse change of every non-empty tensor (a few elements, row and column varying)."""
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        if t.numel():
            flat = t.view(-1)
            for k in range(3):
                flat[(step * 37 + k * 101) % flat.numel()] += 1
    return out


def _chain(first: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    out = [first]
    for k in range(1, n):
        out.append(_edit(out[-1], k))
    return out


# --- one column block: chunk_cols == shape[1] ---------------------------------------------------

#: ``w`` has one column block (a grid the writer would write as 0, but a reader must read);
#: ``t`` is 3-D with 5 columns cut by 3 (ragged last column block) over 2 trailing elements.
ONE_BLOCK = {"w": _spec("w", (20, 6), 4, 6), "t": _spec("t", (9, 5, 2), 2, 3, "float32")}


def _one_block_states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return _chain({"w": torch.randn(20, 6, generator=g).bfloat16(), "t": torch.randn(9, 5, 2, generator=g)}, n)


def test_one_column_block_and_ragged_3d_grids_read_whole_and_sliced(tmp_path: Path) -> None:
    """Whole pulls, pull_into, stage/swap, and partial pulls cut by rows and by columns (the
    one-block grid is an aligned live view for a row cut: its chunks span the whole row)."""
    url = f"file://{tmp_path}"
    states = _one_block_states(4)
    _publish(url, ONE_BLOCK, states, anchor_policy=AnchorPolicy(every=10))
    with Subscriber(url) as sub:
        target = sub.pull(1)
        assert {n: s.chunk_cols for n, s in sub.units().items()} == {"w": 6, "t": 3}
        assert_bits_equal(target, states[0])
        sub.pull_into(target, 2)
        assert_bits_equal(target, states[1])
        sub.swap(sub.stage(target, 4), target)
        assert_bits_equal(target, states[3])
    for dim, world in ((0, 2), (0, 3), (1, 2), (1, 3)):
        for rank in range(world):
            sel = Selection(shard=(dim, rank, world), shard_names=("w", "t"))
            with Subscriber(url, select=sel) as sub:
                mine = sub.pull(1)
                assert_bits_equal(mine, expected_rows(states[0], sel), f"dim {dim} rank {rank}/{world} v1")
                for v in range(2, len(states) + 1):
                    sub.pull_into(mine, v)
                    assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"dim {dim} rank {rank}/{world} v{v}")


def test_a_row_cut_on_row_blocks_of_a_one_block_grid_is_a_live_view(tmp_path: Path) -> None:
    """Rows 0-10 of a 20-row tensor in blocks of 5, one column block: every chunk read is a
    whole row band inside the slice (011 D5's aligned path), applied in place, nothing kept."""
    url = f"file://{tmp_path}"
    g = torch.Generator().manual_seed(3)
    states = _chain({"w": torch.randn(20, 6, generator=g).bfloat16()}, 3)
    _publish(url, {"w": _spec("w", (20, 6), 5, 6)}, states, anchor_policy=AnchorPolicy(every=10))
    sel = Selection(shard=(0, 1, 2))
    with Subscriber(url, select=sel) as sub:
        mine = sub.pull(1)
        assert sub._reader.partial.resolved(sub.units()).views == {"w"}
        for v in (2, 3):
            sub.pull_into(mine, v)
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"v{v}")
        assert not sub._reader.partial.spare


# --- empty grid tensors -------------------------------------------------------------------------

#: no rows (one row block of nothing, two column blocks), a zero trailing dimension (every
#: chunk empty), and a plain tensor beside them that changes. ``y`` (not in the specs) is a
#: zero trailing dimension without a grid.
EMPTY = {"e": _spec("e", (0, 8), 3, 4), "z": _spec("z", (4, 8, 0), 2, 3, "float32"), "w": _spec("w", (6, 8), 2, 4)}


def test_empty_grid_tensors_round_trip_whole_and_by_columns(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    g = torch.Generator().manual_seed(5)
    states = _chain({"e": torch.empty(0, 8).bfloat16(), "z": torch.empty(4, 8, 0), "y": torch.empty(4, 8, 0),
                     "w": torch.randn(6, 8, generator=g).bfloat16()}, 3)
    _publish(url, EMPTY, states, anchor_policy=AnchorPolicy(every=10))
    with Subscriber(url) as sub:
        target = sub.pull(1)
        assert {n: s.chunk_cols for n, s in sub.units().items()} == {"e": 4, "z": 3, "y": 0, "w": 4}
        assert_bits_equal(target, states[0])
        sub.pull_into(target, 2)
        assert_bits_equal(target, states[1])
        sub.swap(sub.stage(target, 3), target)
        assert_bits_equal(target, states[2])
    for rank in range(2):
        # a column cut of a zero trailing dimension: Window.rect divided by its 0-element rows
        sel = Selection(names=("e", "z", "y", "w"), shard=(1, rank, 2), shard_names=("z", "y", "w"))
        with Subscriber(url, select=sel) as sub:
            mine = sub.pull(1)
            assert_bits_equal(mine, expected_rows(states[0], sel), f"rank {rank}")
            sub.pull_into(mine, 3)
            assert_bits_equal(mine, expected_rows(states[2], sel), f"rank {rank}")


# --- partial pulls failing mid-apply ------------------------------------------------------------

#: ``o``'s grid is made for 4 ranks (aligned live views); ``d``'s 3-column blocks straddle a
#: cut by 4 of its 10 columns (edges kept as spare bits).
PARTIAL = {"o": _spec("o", (16, 32), 4, 8), "d": _spec("d", (12, 10), 4, 3)}


def _corrupt_delta(url: str, version: int, name: str, index: int | None = None) -> int:
    """Flip the last byte of the delta segment of chunk ``index`` (default: the last listed)
    of ``name`` in ``version``; returns the chunk's index."""
    with open_store(url) as st, Subscriber(url) as sub:
        _, m = sub._reader.resolve(version)
        t = next(t for t in m.tensors if t.name == name)
        c = next(c for c in t.chunks if c.index == index) if index is not None else t.chunks[-1]
        seg = c.delta
        pack = m.blobs[seg.blob]
        data = bytearray(st.get(pack.key))
        data[seg.offset + seg.length - 1] ^= 0xFF
        st.delete(pack.key)
        st.put(pack.key, bytes(data), mode="create")
        return c.index


@pytest.mark.parametrize("rank", [0, 3])
def test_a_partial_pull_into_failing_mid_apply_rolls_back_views_and_edges(tmp_path: Path, rank: int,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Every chunk of both tensors changes in version 3; the rank's last chunk of ``d`` has a
    corrupt segment. A column rank's pull_into fails after writing ``o``'s chunks in place
    (live views) and ``d``'s other chunks through SliceTarget, and leaves its slice and its
    spare bits as they were: a retry fails the same way (IntegrityError, not
    TargetModifiedError: the rollback left version 2's bits)."""
    url = f"file://{tmp_path}"
    g = torch.Generator().manual_seed(8)
    s1 = {"o": torch.randn(16, 32, generator=g).bfloat16(), "d": torch.randn(12, 10, generator=g).bfloat16()}
    s2 = _edit(s1, 1)
    s3 = {n: t + 1 for n, t in s2.items()}  # dense: every chunk's delta is applied
    _publish(url, PARTIAL, [s1, s2, s3], anchor_policy=AnchorPolicy(every=10))
    hi = (rank + 1) * 10 // 4  # the rank's columns end there
    _corrupt_delta(url, 3, "d", 2 * 4 + (hi - 1) // 3)  # last row block, the rank's last column block
    sel = Selection(shard=(1, rank, 4))
    with Subscriber(url, threads=1, select=sel) as sub:
        mine = sub.pull(2)
        res = sub._reader.partial.resolved(sub.units())
        assert res.views == {"o"} and any(n == "d" for n, _ in res.edges)
        spare = {k: v.copy() for k, v in sub._reader.partial.spare.items()}
        before = snapshot(mine)
        with pytest.raises(IntegrityError), caplog.at_level("ERROR", logger="deltastore.read.engine"):
            sub.pull_into(mine, 3)
        rolled = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
        assert rolled and int(rolled[0].split("rolled back ")[1].split()[0]) >= 3  # o's and d's chunks undone
        assert_bits_equal(mine, before, "rolled back")
        assert sub._reader.partial.spare.keys() == spare.keys()
        assert all(np.array_equal(sub._reader.partial.spare[k], v) for k, v in spare.items())
        assert sub.version == 2
        with pytest.raises(IntegrityError):  # still v2's bits: the same failure, not TargetModifiedError
            sub.pull_into(mine, 3)
        assert_bits_equal(mine, expected_rows(s2, sel))


# --- worker cache, gc, verify over a grid store --------------------------------------------------

CACHED = {"w": _spec("w", (12, 20), 4, 6), "t": _spec("t", (6, 7, 2), 4, 3, "float32")}


def _cached_states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    return _chain({"w": torch.randn(12, 20, generator=g).bfloat16(), "t": torch.randn(6, 7, 2, generator=g),
                   "p": torch.randn(9, generator=g)}, n)


def test_a_worker_cache_of_a_grid_store_is_adopted_checked_and_caught_up_after_gc(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The cache holds natural-order tensors; adoption hashes them through GridTarget (unit
    order): a clean cache is adopted without fetching, one element flipped inside one block of
    ``w`` is refused; after GC collected the cached version, only the chunks that differ from
    HEAD are fetched (from its anchor) and land in their blocks."""
    from deltastore.lifecycle.gc import collect
    from deltastore.read.cache import WorkerCache

    url = f"file://{tmp_path / 'store'}"
    states = _cached_states(5)
    _publish(url, CACHED, states[:2], anchor_policy=AnchorPolicy(every=3))
    cache = tmp_path / "cache"
    with Subscriber(url) as sub:
        target = sub.allocate()
        assert [r.info.version for r in sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1)] == [2]
    with Subscriber(url) as sub:
        target = sub.allocate()
        (rec,) = sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1)
        assert rec.info.version == 2 and rec.bytes_fetched == 0
        assert_bits_equal(target, states[1])

    held = WorkerCache(cache).load()
    bad = dict(held.tensors)
    bad["w"] = bad["w"].clone()
    bad["w"].view(torch.int16)[5, 13] ^= 1  # row block 1, column block 2: chunk 1·4 + 2
    WorkerCache(cache).save(bad, url=held.url, version=2, manifest=held.manifest, lineage=held.lineage)
    with Subscriber(url) as sub, caplog.at_level("WARNING", logger="deltastore.read"):
        target = sub.allocate()
        (rec,) = sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1)
        assert rec.full_load and rec.bytes_fetched > 0
        assert_bits_equal(target, states[1])
    assert "tensor 'w' chunk 6 does not match its digest" in caplog.text

    _publish(url, CACHED, states[2:], anchor_policy=AnchorPolicy(every=3))  # resumed: version 4 is an anchor
    report = collect(url, keep_last=1, grace_s=0.0, unsafe_grace_ok=True)
    assert report.floor_after == 4  # version 2 (cached) is collected
    with Subscriber(url) as fresh:
        fresh.pull()
        full = fresh.bytes_fetched
    with Subscriber(url) as sub, caplog.at_level("INFO", logger="deltastore.read"):
        target = sub.allocate()
        (rec,) = sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1)
        assert "version 2 was collected (floor 4)" in caplog.text
        assert rec.info.version == 5 and 0 < rec.bytes_fetched < full
        assert_bits_equal(target, states[4])
        assert sub.verify(all_versions=True).ok


def test_errors_name_the_block_of_a_grid_chunk_with_a_zero_trailing_dimension() -> None:
    """A digest mismatch of a grid chunk names its rows and columns (011 D4); for a tensor
    whose trailing dimension is 0 (every chunk empty, a mismatch only from a bad manifest) the
    words divided by its 0 trailing elements: a ZeroDivisionError instead of the typed error."""
    from deltastore.read.engine import _modified

    z = _spec("z", (4, 8, 0), 2, 3, "float32")
    assert "chunk 5 (rows 2-4, columns 6-8)" in str(_modified("z", 5, 1, z))
    w = _spec("w", (70, 100), 16, 24)
    assert "chunk 24 (rows 64-70, columns 96-100)" in str(_modified("w", 24, 1, w))
    t = _spec("t", (9, 5, 2), 2, 3, "float32")
    assert "chunk 3 (rows 2-4, columns 3-5)" in str(_modified("t", 3, 1, t))


# --- tied tensors -------------------------------------------------------------------------------


def test_tied_tensors_get_no_grid_and_a_tied_target_updates_through_either_owner(tmp_path: Path) -> None:
    """Publisher side: ``column_slices`` matching both halves of a tie (large enough for a
    grid) grids neither, and grids the untied tensor beside them. Reader side: a target tying a
    grid tensor to a row-chunked one (published as equal copies) is updated once, through
    whichever comes first in the target, with the same bits."""
    url = f"file://{tmp_path / 'tied'}"
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(128, 512, generator=g).bfloat16()
    s1 = {"embed.weight": emb, "lm_head.weight": emb, "o.weight": torch.randn(128, 512, generator=g).bfloat16()}
    with Publisher(url, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(group_small_tensors=False, slice_align=2, column_slices=["*.weight"])) as pub:
        pub.publish(s1)
        emb.view(-1)[::97] += 1
        s1["o.weight"].view(-1)[::89] += 1
        pub.publish(s1)
    with Subscriber(url) as sub:
        got = sub.pull(2)
        assert {n: s.chunk_cols for n, s in sub.units().items()} == {"embed.weight": 0, "lm_head.weight": 0,
                                                                      "o.weight": 256}
        assert_bits_equal(got, s1)

    url = f"file://{tmp_path / 'copies'}"
    a1 = torch.randn(16, 24, generator=g).bfloat16()
    a2 = a1.clone()
    a2[3:9, 5:20] += 1
    _publish(url, {"a": _spec("a", (16, 24), 4, 6)}, [{"a": a1, "b": a1.clone()}, {"a": a2, "b": a2.clone()}],
             anchor_policy=AnchorPolicy(every=10))
    for first in ("a", "b"):
        with Subscriber(url) as sub:
            held = sub.pull(1)
            shared = held[first]
            target = {first: shared, ("b" if first == "a" else "a"): shared}
            sub.pull_into(target, 2)
            assert_bits_equal({"a": shared}, {"a": a2}, f"through {first}")


# --- the numpy paths, and a handed-over snapshot -----------------------------------------------


def test_a_grid_store_reads_bit_exact_on_the_numpy_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DELTASTORE_NATIVE=0 on the reader: whole pull, pull_into, stage/swap and an aligned
    column rank keeping edge bits, with every native kernel off; the store written by
    ``publish_async(copy=False)`` (the handed-over dicts are the snapshots: a grid unit's
    reference is the gathered buffer, never the caller's tensor)."""
    from deltastore._util import kernels

    url = f"file://{tmp_path}"
    states = _cached_states(4)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=False),
                   anchor_policy=AnchorPolicy(every=10),
                   async_policy=AsyncPolicy(max_pending=2)) as pub:
        pub._explicit_specs = CACHED
        futures = [pub.publish_async(snapshot(s), copy=False) for s in states]
        assert [f.result().kind for f in futures] == ["anchor", "delta", "delta", "delta"]
    for name in ("encode_add", "xxh3_128_hex", "split_planes", "pair_codes", "byte_histogram", "apply_segment",
                 "gather_members", "scatter_members", "scan_tensors"):
        monkeypatch.setattr(kernels, name, None)
    with Subscriber(url) as sub:
        target = sub.pull(1)
        assert_bits_equal(target, states[0])
        sub.pull_into(target, 2)
        assert_bits_equal(target, states[1])
        sub.swap(sub.stage(target, 4), target)
        assert_bits_equal(target, states[3])
    sel = Selection(names=("w",), shard=(1, 1, 2))  # 20 columns by 2: blocks of 6 straddle column 10
    with Subscriber(url, select=sel) as sub:
        mine = sub.pull(1)
        sub.pull_into(mine, 4)
        assert_bits_equal(mine, expected_rows(states[3], sel))


def test_deltastore_verify_checks_a_grid_store_and_names_a_bad_grid_chunk(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``deltastore verify --all`` replays every grid chunk in unit order against its digest;
    a delta segment of one grid chunk corrupted is reported by its index."""
    from deltastore.cli import main

    url = f"file://{tmp_path}"
    states = _cached_states(3)
    _publish(url, CACHED, states, anchor_policy=AnchorPolicy(every=10))
    assert main(["verify", url, "--all"]) == 0
    assert capsys.readouterr().out.count("OK version") == 3
    index = _corrupt_delta(url, 3, "w")
    assert main(["verify", url, "--all"]) == 1
    captured = capsys.readouterr()
    assert f"chunk w[{index}] delta segment" in captured.out + captured.err


# --- random grids, partial pulls end to end -----------------------------------------------------


@st.composite
def _partial_cases(draw: st.DrawFn) -> tuple[TensorSpec, int, int, int]:
    rows = draw(st.integers(1, 13))
    cols = draw(st.integers(1, 11))
    trailing = draw(st.sampled_from([(), (2,), (1, 3)]))
    dtype = draw(st.sampled_from(["bfloat16", "float64", "uint8"]))
    spec = _spec("w", (rows, cols, *trailing), draw(st.integers(1, rows)), draw(st.integers(1, cols)), dtype)
    dim = draw(st.sampled_from([0, 1]))
    world = draw(st.integers(1, spec.shape[dim]))
    return spec, dim, world, draw(st.integers(0, world - 1))


# A fraction of the profile's budget: each example publishes and pulls a store.
@settings(max_examples=examples(0.2), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_partial_cases())
def test_random_grids_pull_and_fast_forward_a_slice_bit_exact(tmp_path_factory: pytest.TempPathFactory, case) -> None:
    """Any grid (ragged both ways, trailing dims, one column block; 1-, 2- and 8-byte elements),
    any cut: a rank's pull and pull_into (sparse, then dense) hold exactly the torch slice of
    each version; a whole subscriber stages, swaps and fast-forwards it."""
    spec, dim, world, rank = case
    url = f"file://{tmp_path_factory.mktemp('rand')}"
    g = torch.Generator().manual_seed(spec.numel)
    s1 = {"w": (torch.randn(*spec.shape, generator=g) * 50).to(getattr(torch, spec.dtype))}
    s2 = _edit(s1, 1)
    states = [s1, s2, {"w": s2["w"] + 1}]
    _publish(url, {"w": spec}, states, anchor_policy=AnchorPolicy(every=10))
    with Subscriber(url) as sub:  # whole: stage and swap writes blocks of every width
        target = sub.pull(1)
        sub.swap(sub.stage(target, 2), target)
        sub.pull_into(target, 3)
        assert_bits_equal(target, states[2], f"{case} whole")
    sel = Selection(shard=(dim, rank, world))
    with Subscriber(url, select=sel) as sub:
        mine = sub.pull(1)
        assert_bits_equal(mine, expected_rows(states[0], sel), f"{case} v1")
        for v in (2, 3):
            sub.pull_into(mine, v)
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"{case} v{v}")


def test_a_column_rank_crosses_relayouts_to_and_from_a_grid(tmp_path: Path) -> None:
    """A partial subscriber keeping edge bits (no grid: every chunk an edge) follows a relayout
    to a grid (an anchor of the new layout: the old spare bits are dropped, the grid's edges
    kept), a delta in it, and a relayout back."""
    url = f"file://{tmp_path}"
    states = _cached_states(5)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(group_small_tensors=False)) as pub:
        pub.publish(states[0])
    _publish(url, CACHED, states[1:3], writer_policy=WriterPolicy(resume=False))
    with Publisher(url, writer_policy=WriterPolicy(threads=2, resume=False),
                   layout_policy=LayoutPolicy(group_small_tensors=False)) as pub:
        for s in states[3:]:
            pub.publish(s)
    sel = Selection(names=("w", "t"), shard=(1, 1, 3))
    with Subscriber(url, select=sel) as sub:
        mine = sub.pull(1)
        assert sub.units()["w"].chunk_cols == 0 and sub._reader.partial.spare
        for v, cols in ((2, 6), (3, 6), (4, 0), (5, 0)):
            sub.pull_into(mine, v)
            assert sub.units()["w"].chunk_cols == cols
            assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"v{v}")
            assert all(k in sub._reader.partial.resolved(sub.units()).edges for k in sub._reader.partial.spare)
