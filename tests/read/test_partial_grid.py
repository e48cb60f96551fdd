"""Partial pulls of column-grid tensors (design 011 D5, SPEC §8): the block arithmetic of
deltastore.layout.select with TensorSpecs that have ``chunk_cols`` (no store), then end to end over a
small grid store (the ranks of several degrees, the aligned fast path, last_changed).

Every expectation is computed here independently of select.py: the chunks a selection reads
and its edges by a loop over every chunk of the grid (``chunk_block``, checked against explicit
slicing in tests/layout/test_grid.py) or by the closed-form prediction of 011 D5; the bits a target holds by
torch slicing of the natural tensor (``W[:, lo:hi]``, ``W[r0:r1, c0:c1]``). Without a grid the
chunks, edges and changed spans must be exactly what the pre-grid code computed (kept here as
the oracle ``_pre_grid``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import Publisher, Subscriber
from deltastore.errors import TargetModifiedError
from deltastore.format.models import GroupMember
from deltastore.layout.select import Selection, SliceTarget, SliceView, resolve, slice_targets
from deltastore.layout.tensors import TensorSpec, bits
from deltastore.read.changes import changed_rows, merge_spans
from deltastore.read.partial import changed_spans
from deltastore.read.plan import ChunkPlan
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.partial import expected_rows, needed_bytes
from testkit.tensors import assert_bits_equal, snapshot, sparse_edit


def _spec(shape: tuple[int, ...], chunk_rows: int, chunk_cols: int, name: str = "w") -> TensorSpec:
    return TensorSpec(name, "bfloat16", shape, chunk_rows, (), chunk_cols)


def _cut(spec: TensorSpec, dim: int, rank: int, world: int) -> tuple[int, int, int, int]:
    """Rows × element columns ``(r0, r1, e0, e1)`` rank ``rank`` of ``world`` holds (SPEC §8)."""
    S, C = spec.shape[0], spec.shape[1]
    inner = math.prod(spec.shape[2:])
    if dim == 0:
        return (rank * S // world, (rank + 1) * S // world, 0, C * inner)
    return (0, S, rank * C // world * inner, (rank + 1) * C // world * inner)


def _naive(spec: TensorSpec, rect: tuple[int, int, int, int]) -> tuple[set[int], set[int]]:
    """The chunks overlapping ``rect`` and those of them not inside it, by a loop over every chunk."""
    R0, R1, E0, E1 = rect
    read, edges = set(), set()
    for i in range(spec.n_chunks):
        r0, r1, e0, e1 = spec.chunk_block(i)
        if max(r0, R0) < min(r1, R1) and max(e0, E0) < min(e1, E1):
            read.add(i)
            if not (R0 <= r0 and r1 <= R1 and E0 <= e0 and e1 <= E1):
                edges.add(i)
    return read, edges


def _natural(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, spec.shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


def _block(t: torch.Tensor, spec: TensorSpec, i: int) -> np.ndarray:
    """Chunk ``i``'s bits by torch slicing of the natural tensor (its C order)."""
    r0, r1, e0, e1 = spec.chunk_block(i)
    return bits(t.reshape(spec.shape[0], -1)[r0:r1, e0:e1].contiguous())


# ------------------------------------------------------------ 011 D5: which chunks a cut reads

#: A grid made for TP=8: 40 rows in row blocks of 16 (ragged: 3 blocks), 64 columns in blocks
#: of 8 (C/8), and a 3-D one with trailing elements (48 columns of 3, blocks of 6).
GRIDS = [_spec((40, 64), 16, 8), _spec((24, 48, 3), 10, 6)]


@pytest.mark.parametrize("world", [1, 2, 4, 8, 3, 16])
@pytest.mark.parametrize("spec", GRIDS, ids=["2d", "3d"])
def test_a_column_cut_reads_the_predicted_blocks(spec: TensorSpec, world: int) -> None:
    """011 D5: a column cut reads its row blocks × the column blocks overlapping its columns;
    at most two of them per row block straddle it, none when the degree divides the grid's 8,
    and at 8 the unit is read through a live view (the aligned fast path)."""
    nr, nc, k, C = -(-spec.shape[0] // spec.chunk_rows), spec.n_colblocks, spec.chunk_cols, spec.shape[1]
    for rank in range(world):
        res = resolve(Selection(shard=(1, rank, world)), {"w": spec})
        lo, hi = rank * C // world, (rank + 1) * C // world
        blocks = range(lo // k, -(-hi // k))  # the column blocks holding columns lo .. hi-1
        straddling = [j for j in blocks if j * k < lo or min((j + 1) * k, C) > hi]
        assert res.chunks == {("w", i * nc + j) for i in range(nr) for j in blocks}
        assert res.edges == {("w", i * nc + j) for i in range(nr) for j in straddling}
        read, edges = _naive(spec, _cut(spec, 1, rank, world))
        assert (res.chunks, res.edges) == ({("w", i) for i in read}, {("w", i) for i in edges})
        assert len(res.edges) <= 2 * nr
        if 8 % world == 0:
            assert not res.edges and len(res.chunks) == nr * (8 // world)
        # a chunk is a span of the slice only when its columns are the slice's
        assert res.views == ({"w"} if world == 8 else frozenset())
        if world == 16:  # one block of twice the share, kept whole
            assert len(res.chunks) == nr and res.edges == res.chunks


def test_a_row_cut_of_a_grid_tensor_reads_its_row_blocks_whole() -> None:
    spec = GRIDS[0]
    nc = spec.n_colblocks
    for rank, world in [(0, 2), (1, 3), (2, 5)]:
        res = resolve(Selection(shard=(0, rank, world)), {"w": spec})
        lo, hi = rank * 40 // world, (rank + 1) * 40 // world
        bands = range(lo // 16, -(-hi // 16))
        assert res.chunks == {("w", i * nc + j) for i in bands for j in range(nc)}
        assert res.edges == {("w", i * nc + j) for i in bands if i * 16 < lo or min(i * 16 + 16, 40) > hi
                             for j in range(nc)}
        assert not res.views  # a row band of several column blocks is not a span of the slice


def test_a_huge_grid_is_resolved_without_visiting_every_chunk(monkeypatch) -> None:
    """011 D7: ``nr·nc`` may be huge; a selection enumerates only the chunks it overlaps."""
    spec = _spec((2**20, 2**24), 2**14, 2**8)  # 64 row blocks × 2^16 column blocks
    monkeypatch.setattr(TensorSpec, "n_chunks", property(lambda s: pytest.fail("visited every chunk")))
    res = resolve(Selection(shard=(1, 3, 2**16)), {"w": spec})  # 256 columns per rank: one block
    assert res.chunks == {("w", i * 2**16 + 3) for i in range(64)} and not res.edges and res.views == {"w"}
    res = resolve(Selection(shard=(1, 1, 2**15 * 3)), {"w": spec})  # columns 170-341: two blocks, both cut
    assert len(res.chunks) == 64 * 2 and res.edges == res.chunks


@st.composite
def _cases(draw: st.DrawFn, grid: bool = True) -> tuple[TensorSpec, Selection | None]:
    ndim = draw(st.integers(2, 3))
    S, C = draw(st.integers(1, 30)), draw(st.integers(1, 24))
    shape = (S, C, *[draw(st.integers(1, 3)) for _ in range(ndim - 2)])
    cols = draw(st.integers(1, C)) if grid else 0
    spec = _spec(shape, draw(st.integers(1, S + 2)), cols)
    dim = draw(st.sampled_from([None, 0, 1]))
    if dim is None:
        return spec, None
    world = draw(st.integers(1, shape[dim]))
    return spec, Selection(shard=(dim, draw(st.integers(0, world - 1)), world))


@settings(deadline=None)
@given(_cases())
def test_resolve_matches_a_loop_over_every_chunk(case) -> None:
    spec, sel = case
    res = resolve(sel or Selection(), {"w": spec})
    rect = _cut(spec, *sel.shard) if sel else (0, spec.shape[0], 0, spec.row_elems)
    read, edges = _naive(spec, rect)
    assert res.chunks == {("w", i) for i in read}
    assert res.edges == {("w", i) for i in edges}
    if sel is not None and sel.shard[0] == 1:  # at most two straddling column blocks per row block
        bands = [i // spec.n_colblocks for i in edges]
        assert all(bands.count(b) <= 2 for b in bands)


# The pre-grid code: element spans of natural order (Window.held and Window.user_span, and
# pull._slice_spans over them), before windows and chunks were rectangles.


def _held(w, a: int, b: int) -> int:
    x, y = max(a, w.start), min(b, w.stop)
    if x >= y:
        return 0
    if w.cols is None:
        return y - x
    return (y - x) // w.row * (w.cols[1] - w.cols[0])


def _user_span(w, a: int, b: int) -> tuple[int, int] | None:
    x, y = max(a, w.start), min(b, w.stop)
    if x >= y:
        return None
    if w.cols is None:
        return (w.offset + x - w.start, w.offset + y - w.start)
    width = w.cols[1] - w.cols[0]
    return (w.offset + (x - w.start) // w.row * width, w.offset + (y - w.start) // w.row * width)


def _pre_grid_spans(plans: list[ChunkPlan], res) -> dict[str, list[tuple[int, int]]]:
    """``last_changed`` of a partial target as pull.py computed it before grids."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in plans:
        for w in res.windows.get(p.name, ()):
            span = _user_span(w, *p.span)
            if span is not None:
                spans.setdefault(w.name, []).append(span)
    return {n: merge_spans(s) for n, s in spans.items()}


def _pre_grid(spec: TensorSpec, res) -> tuple[set, set]:
    """The chunks and edges as select.py computed them before grids: every chunk's span
    against every window."""
    chunks, edges = set(), set()
    for uname, ws in res.windows.items():
        for i in range(spec.n_chunks):
            a, b = spec.chunk_span(i)
            inside = sum(_held(w, a, b) for w in ws)
            if inside:
                chunks.add((uname, i))
                if inside < b - a:
                    edges.add((uname, i))
    return chunks, edges


@settings(deadline=None)
@given(_cases(grid=False))
def test_without_a_grid_the_chunks_edges_and_changed_spans_are_todays(case) -> None:
    spec, sel = case
    res = resolve(sel or Selection(), {"w": spec})
    assert (res.chunks, res.edges) == _pre_grid(spec, res)
    assert not res.views
    plans = [ChunkPlan("w", i, spec.chunk_span(i), "") for _, i in sorted(res.chunks)]
    assert changed_spans(plans, res) == _pre_grid_spans(plans, res)


@settings(deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(1, 20), st.data())
def test_group_members_read_as_before_grids(sizes: list[int], chunk_rows: int, data) -> None:
    """A group row (design 007) is a 1-D unit whose windows are members: the chunks, edges,
    changed spans and the bits a target holds are what they were before grids."""
    offsets = np.cumsum([0, *sizes])
    members = tuple(GroupMember(f"m{k}", "bfloat16", () if n == 1 and k % 2 else (n,), int(offsets[k]))
                    for k, n in enumerate(sizes))  # 0-d members too
    row = TensorSpec("#group/0", "bfloat16", (int(offsets[-1]),), chunk_rows, members)
    picked = data.draw(st.lists(st.sampled_from([m.name for m in members]), min_size=1, unique=True))
    res = resolve(Selection(names=tuple(picked)), {row.name: row})
    assert (res.chunks, res.edges) == _pre_grid(row, res) and not res.views
    plans = [ChunkPlan(row.name, i, row.chunk_span(i), "") for _, i in sorted(res.chunks)]
    assert changed_spans(plans, res) == _pre_grid_spans(plans, res)
    whole = np.arange(row.numel, dtype=np.uint16)
    mine = {m.name: torch.zeros(m.shape, dtype=torch.bfloat16) for m in members if m.name in picked}
    spare: dict = {}
    tgt = slice_targets({row.name: row}, res, mine, spare)[row.name]
    for _, i in sorted(res.chunks):
        a, b = row.chunk_span(i)
        tgt.write(a, b, whole[a:b].copy())
    for m in members:
        if m.name in picked:
            assert np.array_equal(bits(mine[m.name]), whole[m.offset:m.offset + m.numel]), m.name
    assert set(spare) == res.edges
    for _, i in sorted(res.chunks):
        assert np.array_equal(tgt.read(*row.chunk_span(i)), whole[slice(*row.chunk_span(i))])


# ------------------------------------------------------------ the targets: bits in, bits out


def _expected(t: torch.Tensor, sel: Selection | None) -> torch.Tensor:
    if sel is None:
        return t
    dim, rank, world = sel.shard
    n = t.shape[dim]
    return t.narrow(dim, rank * n // world, (rank + 1) * n // world - rank * n // world).contiguous()


def _check_targets(spec: TensorSpec, sel: Selection | None, seed: int) -> None:
    """Writing every chunk read (bits cut from the natural tensor) into a zeroed target gives
    the user exactly their slice, spare bits for exactly the edges, and reading a chunk back
    gives its bits; an aligned unit is a live view that keeps nothing."""
    res = resolve(sel or Selection(), {"w": spec})
    t = _natural(spec, seed)
    want = _expected(t, sel)
    mine = {"w": torch.zeros_like(want)}
    spare: dict = {}
    tgt = slice_targets({"w": spec}, res, mine, spare)["w"]
    assert isinstance(tgt, SliceView if "w" in res.views else SliceTarget)
    for _, i in sorted(res.chunks):
        tgt.write(*spec.chunk_span(i), _block(t, spec, i).copy())
    assert torch.equal(mine["w"].view(torch.int16), want.view(torch.int16))
    assert set(spare) == res.edges
    user = bits(mine["w"])
    for _, i in sorted(res.chunks):
        got = tgt.read(*spec.chunk_span(i))
        np.testing.assert_array_equal(got, _block(t, spec, i))
        assert np.shares_memory(got, user) == ("w" in res.views)


@settings(deadline=None)
@given(st.one_of(_cases(), _cases(grid=False)), st.integers(0, 2**16))
def test_slice_targets_hold_the_users_slice_and_the_edges(case, seed: int) -> None:
    _check_targets(*case, seed)
    spec, sel = case
    res = resolve(sel or Selection(), {"w": spec})
    tgt = slice_targets({"w": spec}, res, {"w": torch.zeros(res.shapes["w"][1], dtype=torch.bfloat16)}, {})["w"]
    a, b = spec.chunk_span(min(i for _, i in res.chunks))
    with pytest.raises(ValueError, match="not (the|a) span"):  # the engine only ever asks for whole chunks
        tgt.read(a, b + 1)


@settings(deadline=None)
@given(st.one_of(_cases(), _cases(grid=False)), st.integers(0, 2**16), st.floats(0.0, 1.0))
def test_a_chunks_patch_carried_into_the_slice_and_the_spare_bits(case, seed: int, fraction: float) -> None:
    """A staged update of a partial target (deltastore.read.partial.Partial.user_patches): each
    chunk's patch, made against the whole chunk, carried into the user's slice, gives the new
    version's slice, and the spare bits after it are the new version's edge chunks, the old
    ones untouched; a dense patch (most of a chunk changed) alike."""
    from deltastore.layout.grid import patch_put, patch_region, patch_take
    from deltastore.read.partial import Partial
    from deltastore.read.stage import make_patch

    spec, sel = case
    res = resolve(sel or Selection(), {"w": spec})
    old = _natural(spec, seed)
    new = old.clone()
    rng = np.random.default_rng(seed)
    flat = bits(new)
    at = rng.random(flat.size) < fraction
    flat[at] = rng.integers(0, 2**16, int(at.sum()), dtype=np.uint16)
    mine = {"w": _expected(old, sel).clone()}
    spare = {("w", i): _block(old, spec, i) for _, i in res.chunks if ("w", i) in res.edges}
    kept = {k: v.copy() for k, v in spare.items()}
    patches = [p for _, i in sorted(res.chunks)
               if (p := make_patch("w", i, spec.chunk_span(i), _block(old, spec, i), _block(new, spec, i))) is not None]
    user, after = Partial.user_patches(patches, res, spare)
    for p in user:
        region = patch_region(mine[p.name], p.span, p.block)
        np.testing.assert_array_equal(patch_take(region, p.positions), p.expected_old)
        patch_put(region, p.positions, p.values)
        assert 0 <= p.span[0] < p.span[1] <= mine[p.name].numel()
    assert torch.equal(mine["w"].view(torch.int16), _expected(new, sel).view(torch.int16))
    assert set(after) == res.edges
    for k in res.edges:
        np.testing.assert_array_equal(after[k], _block(new, spec, k[1]))
        np.testing.assert_array_equal(spare[k], kept[k])


@pytest.mark.parametrize("world", [1, 2, 4, 8, 3, 16])
def test_targets_of_a_grid_made_for_8(world: int) -> None:
    for spec in GRIDS:
        for rank in range(world):
            _check_targets(spec, Selection(shard=(1, rank, world)), rank)


def test_a_live_view_refuses_a_chunk_that_is_not_a_span_of_the_slice() -> None:
    spec = GRIDS[0]
    res = resolve(Selection(shard=(1, 1, 8)), {"w": spec})
    view = slice_targets({"w": spec}, res, {"w": torch.zeros(40, 8, dtype=torch.bfloat16)}, {})["w"]
    assert isinstance(view, SliceView)
    with pytest.raises(ValueError, match="not a span of the slice"):
        view.read(*spec.chunk_span(0))  # column block 0 is rank 0's


def test_changed_spans_of_a_grid_are_row_bands_of_the_slice() -> None:
    """011 D4: a changed grid chunk is reported as its row band, in the slice's coordinates."""
    spec = GRIDS[0]  # row blocks [0,16) [16,32) [32,40); column blocks of 8
    nc = spec.n_colblocks

    def plan(i: int, j: int) -> ChunkPlan:
        return ChunkPlan("w", i * nc + j, spec.chunk_span(i * nc + j), "")

    res = resolve(Selection(shard=(1, 1, 4)), {"w": spec})  # columns 16-32: blocks 2 and 3, width 16
    assert changed_spans([plan(1, 2)], res) == {"w": [(16 * 16, 32 * 16)]}
    assert changed_spans([plan(0, 3), plan(2, 2)], res) == {"w": [(0, 16 * 16), (32 * 16, 40 * 16)]}
    res = resolve(Selection(shard=(0, 1, 2)), {"w": spec})  # rows 20-40, whole rows of 64
    assert changed_spans([plan(1, 5)], res) == {"w": [(0, 12 * 64)]}
    assert changed_spans([plan(0, 0)], res) == {}


# ------------------------------------------------------------ end to end, over a grid store (D9)

#: The grid tensors of the store below, laid out for TP=8 through the writer's test hook
#: (``Publisher._explicit_specs``, D10 step 3): ``o`` (40, 64) in row blocks of 16 × column
#: blocks of 8; ``d`` (24, 48, 3) in row blocks of 10 × column blocks of 6 (trailing elements).
#: ``q`` (cut by rows) and ``n`` (replicated) have no grid.
STORE_GRIDS = {"o": _spec((40, 64), 16, 8, "o"), "d": _spec((24, 48, 3), 10, 6, "d")}


def _publish_grid(url: str, n: int = 5) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n (an anchor every 3; v3 changes every element of ``o``; v5 only row 35 of
    ``o``, all its columns), as published."""
    g = torch.Generator().manual_seed(0)
    state = {"o": torch.randn(40, 64, generator=g).bfloat16(), "d": torch.randn(24, 48, 3, generator=g).bfloat16(),
             "q": torch.randn(64, 24, generator=g).bfloat16(), "n": torch.randn(32, generator=g)}
    rng = np.random.default_rng(5)
    out = []
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=3),
                   layout_policy=LayoutPolicy(chunk_bytes=480)) as pub:
        pub._explicit_specs = STORE_GRIDS
        for v in range(1, n + 1):
            pub.publish(state)
            out.append(snapshot(state))
            state = sparse_edit(state, rng, 0.02) if v != 4 else snapshot(state)
            if v == 2:
                state["o"] = state["o"] + 1  # a dense delta of every chunk of o
            if v == 4:
                state["o"][35] += 1  # every column block of row block 2 (rows 32-40), nothing else
    return out


def _tp(rank: int, world: int, dim: int = 1) -> Selection:
    """Rank ``rank`` of ``world``: ``q`` cut by rows, the grid tensors along ``dim``, ``n`` whole."""
    return Selection(shard=(0, rank, world), shard_names=("q",), shard_dims={"o": dim, "d": dim})


def _rows_of(t: torch.Tensor) -> np.ndarray:
    """``t``'s bits as rows along dim 0 (a 1-D tensor: one element per row)."""
    return bits(t.contiguous()).reshape(t.shape[0], -1)


@pytest.mark.parametrize(("dim", "world"), [(1, 8), (1, 3), (1, 16), (0, 3)])
def test_ranks_of_a_grid_store_together_hold_the_whole_pull(tmp_path, dim: int, world: int) -> None:
    """Every rank pulls and fast-forwards its slice bit-exactly (the grid tensors cut by columns,
    or by rows: whole row blocks), fetching no more than its chunks' segments; the ranks' slices
    together are the whole pull; an aligned rank keeps no spare bits of the grid tensors; rows
    outside ``last_changed`` did not change, and a changed grid chunk is its row band."""
    url = str(tmp_path / "store")
    states = _publish_grid(url)
    last = len(states)
    slices: dict[int, list[dict[str, torch.Tensor]]] = {1: [], last: []}
    for rank in range(world):
        sel = _tp(rank, world, dim)
        with Subscriber(url, threads=2, select=sel) as sub:
            mine = sub.pull(1)
            assert_bits_equal(mine, expected_rows(states[0], sel), f"rank {rank} v1")
            assert sub.bytes_fetched <= needed_bytes(url, sel, 1)
            slices[1].append(snapshot(mine))
            for v in range(2, last + 1):
                before, fetched = snapshot(mine), sub.bytes_fetched
                sub.pull_into(mine, v)
                assert sub.bytes_fetched - fetched <= needed_bytes(url, sel, v, since=v - 1)
                assert_bits_equal(mine, expected_rows(states[v - 1], sel), f"rank {rank} v{v}")
                # rows outside changed_rows did not change (grid chunks are reported as row bands)
                changed = {name: rows for name, rows, _ in changed_rows(mine, sub.last_changed)}
                for name, t in mine.items():
                    keep = np.ones(t.shape[0], dtype=bool)
                    for a, b in changed.get(name, []):
                        keep[a:b] = False
                    assert np.array_equal(_rows_of(t)[keep], _rows_of(before[name])[keep]), (rank, v, name)
                if v == 5:  # only row 35 of o changed: its chunks' row band 32-40, as the slice holds it
                    lo, hi = (rank * 40 // world, (rank + 1) * 40 // world) if dim == 0 else (0, 40)
                    x0, x1, width = max(32, lo), min(40, hi), mine["o"].shape[1]
                    assert sub.last_changed == ({"o": [((x0 - lo) * width, (x1 - lo) * width)]} if x0 < x1 else {})
            if (dim, world) == (1, 8):  # the aligned fast path: nothing kept beside the grid tensors' slices
                assert not [k for k in sub._reader.partial.spare if k[0] in STORE_GRIDS]
            slices[last].append(mine)
    with Subscriber(url, threads=2) as whole:
        for v, parts in slices.items():
            full = whole.pull(v)
            for name, axis in (("o", dim), ("d", dim), ("q", 0)):
                assert_bits_equal({name: torch.cat([p[name] for p in parts], dim=axis)}, {name: full[name]}, f"v{v}")
            for p in parts:
                assert_bits_equal({"n": p["n"]}, {"n": full["n"]}, f"v{v}")


def test_an_aligned_rank_reads_one_column_block_per_row_block(tmp_path) -> None:
    """A TP=8 rank of the grid tensors reads exactly its column block of each row block, about
    an eighth of their bytes, through live views (no spare), and fast-forwards in place."""
    url = str(tmp_path / "store")
    states = _publish_grid(url, n=3)
    sel = Selection(names=("o", "d"), shard=(1, 2, 8))
    with Subscriber(url, threads=2) as whole_sub:
        whole_sub.pull(1)
        whole = whole_sub.bytes_fetched
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        res = sub._reader.partial.resolved(sub.units())
        assert res.views == {"o", "d"} and not res.edges
        assert res.chunks == {(n, i * s.n_colblocks + 2) for n, s in STORE_GRIDS.items()
                              for i in range(-(-s.shape[0] // s.chunk_rows))}
        assert sub.bytes_fetched <= needed_bytes(url, sel, 1) and sub.bytes_fetched < whole / 6
        sub.pull_into(mine, 2)
        assert not sub._reader.partial.spare
        assert_bits_equal(mine, expected_rows(states[1], sel))
        bits(mine["o"])[-1] ^= 1  # a modified slice is detected, with nothing applied
        before = snapshot(mine)
        with pytest.raises(TargetModifiedError):
            sub.pull_into(mine, 3)
        assert_bits_equal(mine, before, "nothing applied")
        bits(mine["o"])[-1] ^= 1
        sub.pull_into(mine, 3)
        assert_bits_equal(mine, expected_rows(states[2], sel))
    with Subscriber(url, threads=2, select=sel) as sub:  # a zeroed target fast-forwarded from nothing
        fresh = sub.allocate()
        sub.pull_into(fresh, 2)
        assert_bits_equal(fresh, expected_rows(states[1], sel))


# ------------------------------------------------ over real S3, the public option (D9, D10 step 6)


def test_eight_tp_ranks_of_a_column_sliced_store_over_s3(moto_s3_url) -> None:
    """A store written with the public policy (``slice_align=8, column_slices=ROW_PARALLEL``)
    on a moto server over HTTP: 8 tensor-parallel subscribers (the row-parallel weights cut by
    columns, the rest by rows or whole) each pull and fast-forward to head bit-exactly, read
    only their column blocks (no spare bits of a gridded tensor), and together hold the whole
    pull."""
    from deltastore.layout.select import ROW_PARALLEL

    url, opts = moto_s3_url.url, moto_s3_url.storage_options
    g = torch.Generator().manual_seed(21)
    # bf16, > 8 × 32 KiB each so that the policy grids them; 16 KiB chunks: several row blocks
    state = {"l0.self_attn.o_proj.weight": torch.randn(64, 2304, generator=g).bfloat16(),
             "l0.mlp.down_proj.weight": torch.randn(70, 2000, generator=g).bfloat16(),  # 250 columns a rank
             "l0.self_attn.q_proj.weight": torch.randn(64, 96, generator=g).bfloat16(),
             "l0.norm.weight": torch.randn(96, generator=g)}
    rng = np.random.default_rng(21)
    states = []
    with Publisher(url, storage_options=opts, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=16 * 1024, slice_align=8, column_slices=ROW_PARALLEL)) as pub:
        for _ in range(2):
            pub.publish(state)
            states.append(snapshot(state))
            state = sparse_edit(state, rng, 0.02)
    world, mine = 8, []
    for rank in range(world):
        sel = Selection(shard=(0, rank, world), shard_names=("*.q_proj.weight",), shard_dims=dict.fromkeys(ROW_PARALLEL, 1))
        with Subscriber(url, storage_options=opts, threads=2, select=sel) as sub:
            held = sub.pull(1)
            sub.pull_into(held)
            assert sub.version == 2
            assert_bits_equal(held, expected_rows(states[-1], sel), f"rank {rank}")
            units = sub.units()
            assert {n for n, s in units.items() if s.chunk_cols} == {"l0.self_attn.o_proj.weight", "l0.mlp.down_proj.weight"}
            assert units["l0.self_attn.o_proj.weight"].chunk_cols == 2304 // 8
            assert units["l0.self_attn.o_proj.weight"].n_chunks > 8  # several row blocks × 8 column blocks
            assert not [k for k in sub._reader.partial.spare if units[k[0]].chunk_cols]
            mine.append(held)
    with Subscriber(url, storage_options=opts, threads=2) as whole_sub:
        whole = whole_sub.pull()
    assert_bits_equal(whole, states[-1], "whole pull")
    for name, t in whole.items():
        if name.endswith("norm.weight"):
            assert all(torch.equal(p[name].view(torch.int32), t.view(torch.int32)) for p in mine)
            continue
        axis = 1 if "o_proj" in name or "down_proj" in name else 0
        assert_bits_equal({name: torch.cat([p[name] for p in mine], dim=axis)}, {name: t}, name)
