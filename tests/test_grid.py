"""Column grids, design 011 D10 steps 1-2: the geometry of a grid tensor (TensorSpec, the
manifest helpers, the layout plumbing) against a naive reference written here (explicit
loops over row and column blocks), never against the functions under test. Readers still refuse grids;
writers never write one."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import CorruptObjectError
from deltastore.manifest import (
    BlobRef,
    ChunkEntry,
    Layout,
    Manifest,
    SegmentRef,
    TensorEntry,
    blob_key,
    chunk_count,
    chunk_elements,
    layout_of,
    manifest_key,
)
from deltastore.plan import check_entries, layout
from deltastore.tensors import TensorSpec


def _naive_blocks(shape: tuple[int, ...], chunk_rows: int, chunk_cols: int) -> list[tuple[slice, slice]]:
    """The chunks of SPEC §2 *Pieces and grid* in index order i·nc + j, as (row, column)
    slices of dimensions 0 and 1, enumerated by two nested loops (no closed form)."""
    S, C = shape[0], shape[1]
    chunk_cols = chunk_cols or max(1, C)  # no grid: whole rows
    row_starts = list(range(0, S, chunk_rows)) or [0]
    col_starts = list(range(0, C, chunk_cols)) or [0]
    return [(slice(r, min(r + chunk_rows, S)), slice(c, min(c + chunk_cols, C))) for r in row_starts for c in col_starts]


@st.composite
def grid_specs(draw: st.DrawFn, min_dims: int = 2, max_dims: int = 4, allow_empty: bool = False) -> TensorSpec:
    """A random grid tensor: 2-4 dimensions, ragged row and column blocks, trailing dims."""
    lo = 0 if allow_empty else 1
    ndim = draw(st.integers(min_dims, max_dims))
    S = draw(st.integers(lo, 23))
    C = draw(st.integers(lo, 19))
    trailing = tuple(draw(st.integers(lo, 3)) for _ in range(ndim - 2))
    chunk_rows = draw(st.integers(1, max(1, S) + 2))
    chunk_cols = draw(st.integers(1, max(1, C) + 2))
    return TensorSpec("w", draw(st.sampled_from(["bfloat16", "float32", "uint8", "float64"])),
                      (S, C, *trailing), chunk_rows, (), chunk_cols)


# ---------------------------------------------------------------- step 1: geometry


@settings(max_examples=300, deadline=None)
@given(grid_specs(allow_empty=True))
def test_grid_spans_tile_the_tensor_in_index_order(spec: TensorSpec) -> None:
    C = spec.shape[1]
    inner = math.prod(spec.shape[2:])
    blocks = _naive_blocks(spec.shape, spec.chunk_rows, spec.chunk_cols)
    assert spec.n_chunks == len(blocks) == chunk_count(spec.shape, spec.chunk_rows, spec.chunk_cols)
    assert spec.n_colblocks == max(1, math.ceil(C / spec.chunk_cols))
    pos = 0
    for i, (rs, cs) in enumerate(blocks):
        a, b = spec.chunk_span(i)
        assert a == pos, f"chunk {i} starts at {a}, not right after chunk {i - 1} ({pos})"
        size = (rs.stop - rs.start) * (cs.stop - cs.start) * inner
        assert b - a == size == chunk_elements(spec.shape, spec.chunk_rows, i, spec.chunk_cols)
        assert spec.chunk_bytes(i) == size * spec.width
        assert spec.chunk_block(i) == (rs.start, rs.stop, cs.start * inner, cs.stop * inner)
        if size:
            assert spec.chunk_at(a) == i
            for p in (a, (a + b) // 2, b - 1):  # the way into a range starting inside a chunk
                assert spec.chunk_containing(p) == i
        pos = b
    assert pos == spec.numel


def _todays_span(spec: TensorSpec, index: int) -> tuple[int, int]:
    """Chunk spans as they were before grids (commit c25b33b), copied here."""
    if not spec.shape:
        return (0, 1)
    r0 = index * spec.chunk_rows
    r1 = min(r0 + spec.chunk_rows, spec.shape[0])
    return (r0 * spec.row_elems, r1 * spec.row_elems)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=4), st.integers(1, 12))
def test_chunk_cols_zero_gives_todays_spans(shape: list[int], chunk_rows: int) -> None:
    spec = TensorSpec("w", "float32", tuple(shape), chunk_rows)
    assert spec.chunk_cols == 0 and spec.n_colblocks == 1
    n = (max(1, -(-shape[0] // chunk_rows)) if shape else 1)
    assert spec.n_chunks == n == chunk_count(spec.shape, chunk_rows) == chunk_count(spec.shape, chunk_rows, 0)
    row = math.prod(shape[1:]) if shape else 1
    for i in range(n):
        assert spec.chunk_span(i) == _todays_span(spec, i)
        a, b = spec.chunk_span(i)
        assert chunk_elements(spec.shape, chunk_rows, i) == chunk_elements(spec.shape, chunk_rows, i, 0) == b - a
        r0, r1, e0, e1 = spec.chunk_block(i)
        assert (e0, e1) == (0, row) and (r0 * row, r1 * row) == (a, b) if shape else spec.chunk_block(i) == (0, 1, 0, 1)
        if b > a:
            assert spec.chunk_at(a) == i


def test_grid_edge_cases() -> None:
    # the golden store-grid's shapes (011 D7): ragged both ways, 5 x 5 chunks
    s = TensorSpec("w", "bfloat16", (70, 100), 16, (), 24)
    assert (s.n_chunks, s.n_colblocks) == (25, 5)
    assert s.chunk_span(0) == (0, 16 * 24)
    assert s.chunk_span(4) == (16 * 96, 16 * 100)  # last, narrow column block of the first band
    assert s.chunk_block(4) == (0, 16, 96, 100)
    assert s.chunk_span(5) == (1600, 1600 + 16 * 24)  # the second row band starts after a whole band
    assert s.chunk_block(24) == (64, 70, 96, 100)  # short rows x narrow columns
    assert s.chunk_span(24) == (64 * 100 + 6 * 96, 7000)
    # trailing dimensions: element columns count columns x inner
    t = TensorSpec("w", "float32", (12, 10, 3), 5, (), 4)
    assert (t.n_chunks, t.n_colblocks) == (9, 3)
    assert t.chunk_block(2) == (0, 5, 24, 30)
    assert t.chunk_span(2) == (5 * 24, 5 * 30)
    assert t.chunk_span(8) == (10 * 30 + 2 * 24, 12 * 30)
    # the 2-D minimum, and one-element chunks (unit order equals natural order then)
    assert TensorSpec("w", "float32", (1, 1), 1, (), 1).chunk_span(0) == (0, 1)
    u = TensorSpec("w", "float32", (2, 3), 1, (), 1)
    assert [u.chunk_span(i) for i in range(u.n_chunks)] == [(i, i + 1) for i in range(6)]
    # chunk_cols = shape[1] and beyond: one column block, spans as without a grid
    for k in (10, 11, 99):
        g, plain = TensorSpec("w", "float32", (12, 10, 3), 5, (), k), TensorSpec("w", "float32", (12, 10, 3), 5)
        assert [g.chunk_span(i) for i in range(g.n_chunks)] == [plain.chunk_span(i) for i in range(plain.n_chunks)]
    # chunk_cols is part of a spec's identity (pull._relaid compares specs)
    assert TensorSpec("w", "float32", (12, 10), 5, (), 5) != TensorSpec("w", "float32", (12, 10), 5)


def test_grid_specs_refuse_impossible_grids() -> None:
    # an impossible grid raises when its geometry is asked (the layout check refuses it first)
    for shape in ((), (7,)):
        with pytest.raises(ValueError, match="two or more"):
            _ = TensorSpec("w", "float32", shape, 1, (), 2).n_colblocks
    for what in ("chunk_block", "chunk_span"):
        with pytest.raises(ValueError, match="two or more"):
            getattr(TensorSpec("w", "float32", (7,), 1, (), 2), what)(0)
    with pytest.raises(ValueError, match="chunk_cols -1"):
        TensorSpec("w", "float32", (4, 4), 1, (), -1).chunk_span(0)
    s = TensorSpec("w", "float32", (70, 100), 16, (), 24)
    for start in (1, 383, 385, 7000, -384, 10**9):
        with pytest.raises(ValueError, match="no chunk"):
            s.chunk_at(start)
    with pytest.raises(ValueError, match="no chunk"):
        TensorSpec("w", "float32", (70, 100), 16).chunk_at(1)
    # a grid on fewer than 2 dimensions is ignored by the counters (the layout check refuses it)
    assert chunk_count((7,), 2, 3) == chunk_count((7,), 2) == 4
    assert chunk_elements((7,), 2, 3, 3) == 1


def _grid_manifest(chunk_rows: int = 2, chunk_cols: int = 1) -> tuple[str, Manifest, Layout]:
    """An anchor manifest of one (4, 2) tensor "w" with every chunk of a grid, plus its layout
    (built by hand: no writer writes a grid)."""
    spec = TensorSpec("w", "float32", (4, 2), chunk_rows, (), chunk_cols)
    seg = SegmentRef(blob=0, offset=0, length=1, sha256="0" * 64, codec="full/2", n_changed=0)
    chunks = tuple(ChunkEntry(index=i, digest=f"d{i}", full=seg) for i in range(spec.n_chunks))
    h = "1" * 64
    m = Manifest(version=1, parent=None, parent_manifest=None, delta_base=None, kind="anchor", anchor=1, created="t", writer="w", epoch=0, commit_id="c",
                 lineage="0" * 32, blobs=(BlobRef(key=blob_key(h), size=1, sha256=h),),
                 tensors=(TensorEntry(name="w", dtype="float32", shape=(4, 2), chunk_rows=chunk_rows, chunks=chunks),))
    lay = Layout(name=("w",), dtype=("float32",), shape=((4, 2),), chunk_rows=(chunk_rows,),
                 chunk_cols=(chunk_cols,), pieces=(None,), piece_parts=(None,))
    return manifest_key(1, h), m, lay


def test_manifest_carries_the_layouts_grid_to_the_plan() -> None:
    key, m, lay = _grid_manifest()
    assert lay.grid() == {"w": 1}
    assert m.chunk_cols("w") == 0  # nothing attached yet
    assert m.with_layout(lay) is m and m.chunk_cols("w") == 1
    specs = layout(m)
    assert specs["w"] == TensorSpec("w", "float32", (4, 2), 2, (), 1) and specs["w"].n_chunks == 4
    check_entries(key, m, specs, 1)  # the layout it came from
    plain = {"w": TensorSpec("w", "float32", (4, 2), 2)}
    with pytest.raises(CorruptObjectError, match="does not match the layout"):
        check_entries(key, m, plain, 1)  # the same tensor without the grid is another layout
    m.with_layout(None)
    assert m.chunk_cols("w") == 0 and layout(m) == plain
    check_entries(key, m, plain, 1)
    with pytest.raises(CorruptObjectError, match="does not match the layout"):
        check_entries(key, m, specs, 1)
    # a layout without a grid attaches none; the old name stays for callers not yet moved
    _, m2, _ = _grid_manifest()
    lay0 = lay.model_copy(update={"chunk_cols": (0,)})
    lay0.model_post_init(None)
    assert lay0.grid() == {} and m2.with_groups(lay0).chunk_cols("w") == 0


def test_writers_write_no_grid() -> None:
    with pytest.raises(ValueError, match="writes no column grid"):
        layout_of({"w": TensorSpec("w", "float32", (4, 2), 2, (), 1)})
    assert layout_of({"w": TensorSpec("w", "float32", (4, 2), 2)}).chunk_cols == (0,)
