"""Column grids, design 011 D10 steps 1-2: the geometry of a grid tensor (TensorSpec, the
manifest helpers, the layout plumbing) and deltastore.layout.grid's conversions between natural and
unit order, each against a naive reference written here (explicit slicing of the tensor
``W[r0:r1, c0:c1, ...]``), never against the functions under test. Stores with a grid
(step 3) are tested in tests/layout/test_grid_store.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import CorruptObjectError
from deltastore.format.keys import manifest_key, object_key
from deltastore.format.models import (
    BlobRef,
    ChunkEntry,
    Layout,
    Manifest,
    SegmentRef,
    TensorEntry,
    chunk_count,
    chunk_elements,
    layout_of,
)
from deltastore.layout import grid
from deltastore.layout.grid import (
    GridTarget,
    block_view,
    gather,
    patch_put,
    patch_region,
    patch_take,
    scatter,
    to_unit_order,
)
from deltastore.layout.tensors import TensorSpec, bits
from deltastore.read.plan import check_entries, layout


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


@settings(deadline=None)
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
            for p in (a, (a + b) // 2, b - 1):  # GridTarget's way into a range starting inside a chunk
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


@settings(deadline=None)
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
                 lineage="0" * 32, blobs=(BlobRef(key=object_key("0" * 32, h, ".pack"), size=1, sha256=h, role="f"),),
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
    assert lay0.grid() == {} and m2.with_layout(lay0).chunk_cols("w") == 0


def test_layout_of_writes_the_specs_grid() -> None:
    # D10 step 3: a writer given grid specs records chunk_cols; without one it writes 0
    assert layout_of({"w": TensorSpec("w", "float32", (4, 2), 2, (), 1)}).chunk_cols == (1,)
    assert layout_of({"w": TensorSpec("w", "float32", (4, 2), 2)}).chunk_cols == (0,)


# ---------------------------------------------------------------- step 2: grid.py


def _natural(spec: TensorSpec, seed: int = 0) -> np.ndarray:
    """Natural-order bits: an arange (distinct unless uint8 wraps), or random bytes."""
    return np.arange(spec.numel, dtype=spec.uint_dtype()) if seed == 0 else \
        np.random.default_rng(seed).integers(0, 2**8, spec.numel).astype(spec.uint_dtype())


def _naive_chunk(raw: np.ndarray, spec: TensorSpec, index: int) -> np.ndarray:
    rs, cs = _naive_blocks(spec.shape, spec.chunk_rows, spec.chunk_cols)[index]
    return raw.reshape(spec.shape)[rs, cs].reshape(-1)


@settings(deadline=None)
@given(grid_specs(allow_empty=True))
def test_gather_matches_naive_slicing_and_scatter_inverts_it(spec: TensorSpec) -> None:
    raw = _natural(spec)
    rebuilt = np.zeros_like(raw)
    for i in range(spec.n_chunks):
        want = _naive_chunk(raw, spec, i)
        got = gather(raw, spec, i)
        np.testing.assert_array_equal(got, want)
        assert want.size == 0 or np.shares_memory(block_view(raw, spec, i), raw)  # a view, no copy
        scatter(rebuilt, spec, i, got)
        # gather into a slot of a larger buffer (the publisher's reference, 011 D3)
        slot = np.full(got.size + 2, 7, dtype=raw.dtype)
        gather(raw, spec, i, slot[1:-1])
        np.testing.assert_array_equal(slot[1:-1], want)
        assert slot[0] == slot[-1] == 7
    np.testing.assert_array_equal(rebuilt, raw)  # the chunks cover the tensor, each once


@settings(deadline=None)
@given(grid_specs(allow_empty=True), st.integers(1, 2**31))
def test_scatter_then_gather_is_the_identity_and_touches_only_the_block(spec: TensorSpec, seed: int) -> None:
    raw = _natural(spec)
    before = raw.copy()
    rng = np.random.default_rng(seed)
    i = int(rng.integers(0, spec.n_chunks))
    a, b = spec.chunk_span(i)
    new = ~_naive_chunk(before, spec, i)  # every element differs from the old one
    assert new.size == b - a
    scatter(raw, spec, i, new)
    np.testing.assert_array_equal(gather(raw, spec, i), new)
    expect = before.reshape(spec.shape).copy()
    rs, cs = _naive_blocks(spec.shape, spec.chunk_rows, spec.chunk_cols)[i]
    expect[rs, cs] = new.reshape(expect[rs, cs].shape)
    np.testing.assert_array_equal(raw, expect.reshape(-1))


def _natural_order(unit: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The natural-order bits of a tensor held in unit order: each chunk scattered to its block."""
    out = np.empty_like(unit)
    for i in range(spec.n_chunks):
        a, b = spec.chunk_span(i)
        scatter(out, spec, i, unit[a:b])
    return out


@settings(deadline=None)
@given(grid_specs(allow_empty=True))
def test_unit_order_spans_are_the_gathered_chunks(spec: TensorSpec) -> None:
    raw = _natural(spec)
    unit = to_unit_order(raw, spec)
    assert unit.shape == raw.shape and not np.shares_memory(unit, raw)
    np.testing.assert_array_equal(np.sort(unit), np.sort(raw))  # a permutation
    for i in range(spec.n_chunks):
        a, b = spec.chunk_span(i)
        np.testing.assert_array_equal(unit[a:b], _naive_chunk(raw, spec, i))
    np.testing.assert_array_equal(_natural_order(unit, spec), raw)
    out = np.zeros_like(unit)
    assert to_unit_order(raw, spec, out) is out
    np.testing.assert_array_equal(out, unit)


def test_unit_order_without_a_grid_is_a_copy() -> None:
    spec = TensorSpec("w", "float32", (5, 3, 2), 2)
    raw = _natural(spec)
    unit = to_unit_order(raw, spec)
    np.testing.assert_array_equal(unit, raw)
    assert not np.shares_memory(unit, raw)
    np.testing.assert_array_equal(_natural_order(unit, spec), raw)
    np.testing.assert_array_equal(gather(raw, spec, 1), raw[12:24])


def test_gather_and_scatter_refuse_a_buffer_of_the_wrong_size() -> None:
    spec = TensorSpec("w", "float32", (70, 100), 16, (), 24)
    raw = _natural(spec)
    with pytest.raises(ValueError, match="chunk 4 has 64 elements"):
        gather(raw, spec, 4, np.empty(65, dtype=raw.dtype))
    with pytest.raises(ValueError, match="chunk 4 has 64 elements"):
        scatter(raw, spec, 4, np.empty(63, dtype=raw.dtype))


_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8, "float64": torch.float64}


def _tensor(spec: TensorSpec, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 250, spec.shape, generator=g).to(_TORCH[spec.dtype])
    return t.to(device)


def _target_roundtrip(spec: TensorSpec, seed: int, device: str, torch_path: bool = False) -> None:
    t = _tensor(spec, seed, device)
    natural = bits(t.cpu()).copy()
    target = GridTarget(spec, t)
    if torch_path:  # the device branch (torch block views, contiguous().cpu(), copy_) on a CPU tensor
        target._bits = None
    assert target.cpu is False and target.raw is None
    unit = to_unit_order(natural, spec)
    rng = np.random.default_rng(seed)
    for i in range(spec.n_chunks):  # whole chunks, as the read engine reads them
        a, b = spec.chunk_span(i)
        np.testing.assert_array_equal(target.read(a, b), unit[a:b])
    for _ in range(4):  # any unit-order range, across and inside chunks
        a, b = sorted(rng.integers(0, spec.numel + 1, 2).tolist())
        np.testing.assert_array_equal(target.read(a, b), unit[a:b])
        new = rng.integers(0, 2**8, b - a).astype(unit.dtype)
        target.write(a, b, new)
        unit[a:b] = new
        np.testing.assert_array_equal(bits(t.cpu()), _natural_order(unit, spec))


@settings(deadline=None)
@given(grid_specs(), st.integers(0, 2**31))
def test_grid_target_reads_and_writes_unit_order(spec: TensorSpec, seed: int) -> None:
    _target_roundtrip(spec, seed, "cpu")
    _target_roundtrip(spec, seed, "cpu", torch_path=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_grid_target_on_a_device() -> None:
    for shape, rows, cols in (((70, 100), 16, 24), ((12, 10, 3), 5, 4), ((9, 7), 2, 3)):
        for dtype in ("bfloat16", "float32", "uint8"):
            _target_roundtrip(TensorSpec("w", dtype, shape, rows, (), cols), 3, "cuda")


def test_grid_target_refuses_another_shape() -> None:
    with pytest.raises(ValueError, match=r"\[4, 2\]"):
        GridTarget(TensorSpec("w", "float32", (2, 4), 1, (), 2), torch.zeros(4, 2))


def _patch_case(spec: TensorSpec, t: torch.Tensor, region_of, seed: int) -> None:
    """Sparse and dense patches at chunk-relative positions land where naive slicing says."""
    rng = np.random.default_rng(seed)
    for i in range(spec.n_chunks):
        a, b = spec.chunk_span(i)
        if b == a:
            continue
        region = region_of(t, (a, b), spec.chunk_block(i) if spec.chunk_cols else None)
        natural = bits(t.cpu()).copy()
        chunk = _naive_chunk(natural, spec, i)
        np.testing.assert_array_equal(patch_take(region, None), chunk)
        pos = np.sort(rng.choice(b - a, size=max(1, (b - a) // 3), replace=False)).astype(np.int64)
        np.testing.assert_array_equal(patch_take(region, pos), chunk[pos])
        vals = (chunk[pos] + 1).astype(chunk.dtype)
        patch_put(region, pos, vals)
        chunk[pos] = vals
        expect = natural.reshape(spec.shape).copy()
        rs, cs = _naive_blocks(spec.shape, spec.chunk_rows, spec.chunk_cols)[i]
        expect[rs, cs] = chunk.reshape(expect[rs, cs].shape)
        np.testing.assert_array_equal(bits(t.cpu()), expect.reshape(-1))
        dense = (chunk + 3).astype(chunk.dtype)
        patch_put(region, None, dense)
        np.testing.assert_array_equal(patch_take(region, None), dense)
        expect[rs, cs] = dense.reshape(expect[rs, cs].shape)
        np.testing.assert_array_equal(bits(t.cpu()), expect.reshape(-1))


def _torch_region(t: torch.Tensor, span, block):
    """patch_region's device branch (torch views and indexing), run on a CPU tensor."""
    return grid._region(grid._torch_bits(t), t, span, block)


@settings(deadline=None)
@given(grid_specs(), st.integers(0, 2**31), st.booleans())
def test_patch_region_puts_and_takes_at_chunk_positions(spec: TensorSpec, seed: int, gridded: bool) -> None:
    if not gridded:
        spec = TensorSpec(spec.name, spec.dtype, spec.shape, spec.chunk_rows)
    _patch_case(spec, _tensor(spec, seed), patch_region, seed)
    _patch_case(spec, _tensor(spec, seed), _torch_region, seed)


def test_patch_region_without_a_block_is_the_flat_span() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    region = patch_region(t, (6, 18))
    assert region.ndim == 1 and np.shares_memory(region, bits(t))
    np.testing.assert_array_equal(region, bits(t)[6:18])
    with pytest.raises(ValueError, match="block"):
        patch_region(t, (0, 5), (0, 2, 0, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_patch_region_on_a_device() -> None:
    spec = TensorSpec("w", "bfloat16", (70, 100), 16, (), 24)
    _patch_case(spec, _tensor(spec, 5, "cuda"), patch_region, 5)
