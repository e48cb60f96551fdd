"""The unsharded writer's chunking (SPEC §2, deltastore.layout.tensors.slice_chunk_rows).

- chunk edges fall on the row boundaries of tensor-parallel degrees 1, 2, 4 and 8 when the
  rows divide, with chunks within the size target and above the floor;
- tiny tensors stay one chunk; rows that do not divide get chunks of 1/16 of a slice;
- with ``Publisher(slice_align=8)``, a worker holding rows r/8 of every tensor of a MiniLM-shaped
  model reads about its share of a version (≤ 15 %), first pull and per version;
- a publisher resuming a store written with another chunking (the schema-3 golden store, and a
  store chunked by the default rule) keeps the store's chunk rows: its next version is a delta
  every subscriber reads bit-exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from deltastore import Publisher, Subscriber
from deltastore.layout.select import Selection, resolve
from deltastore.layout.tensors import (
    CHUNK_TARGET_BYTES,
    SLICE_ALIGN,
    SLICE_CHUNK_MIN_BYTES,
    SLICE_EDGE_PARTS,
    chunk_rows_for,
    slice_chunk_rows,
    spec_for,
)
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.tensors import assert_bits_equal, snapshot, sparse_edit

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _read_rows(spec, rank: int, world: int) -> int:
    """Rows a partial pull of rank/world reads: the rows of every chunk overlapping the slice."""
    res = resolve(Selection(shard=(0, rank, world)), {spec.name: spec})
    return sum(min(spec.shape[0], (i + 1) * spec.chunk_rows) - i * spec.chunk_rows for _, i in res.chunks)


# --- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(384, 384), (1536, 384), (384, 1536), (512, 384), (4096, 4096),
                                   (11008, 4096), (4096, 11008), (128256, 4096), (151936, 3584), (32000, 4096)])
def test_common_matrices_are_cut_on_every_tp_slice(shape: tuple[int, int]) -> None:
    spec = spec_for("w", _meta(shape), slice_align=SLICE_ALIGN)
    chunk_bytes = spec.chunk_rows * spec.row_elems * 2
    assert SLICE_CHUNK_MIN_BYTES <= chunk_bytes <= CHUNK_TARGET_BYTES
    for world in (1, 2, 4, 8):
        for r in range(world + 1):
            assert (r * shape[0] // world) % spec.chunk_rows == 0, (world, r, spec.chunk_rows)
        for rank in range(world):
            assert _read_rows(spec, rank, world) == (rank + 1) * shape[0] // world - rank * shape[0] // world


@pytest.mark.parametrize("shape,dtype", [((384,), torch.bfloat16), ((1536,), torch.bfloat16), ((2, 384), torch.bfloat16),
                                         ((4096,), torch.float32), ((7,), torch.int64), ((), torch.float32),
                                         ((0, 16), torch.bfloat16), ((64, 24), torch.bfloat16)])
def test_tiny_tensors_stay_one_chunk(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert spec_for("t", _meta(shape, dtype), slice_align=SLICE_ALIGN).n_chunks == 1


def test_rows_that_do_not_divide_read_at_most_two_small_edge_chunks_beyond_the_slice() -> None:
    spec = spec_for("emb", _meta((30522, 384)), slice_align=SLICE_ALIGN)  # BERT's vocabulary: 30522 = 2 · 15261
    share = 30522 // SLICE_ALIGN
    assert spec.chunk_rows * spec.row_elems * 2 >= SLICE_CHUNK_MIN_BYTES
    assert spec.chunk_rows <= -(-share // SLICE_EDGE_PARTS)
    for rank in range(8):
        extra = _read_rows(spec, rank, 8) - ((rank + 1) * 30522 // 8 - rank * 30522 // 8)
        assert 0 <= extra <= 2 * spec.chunk_rows
    assert max(_read_rows(spec, r, 8) for r in range(8)) <= share * (1 + 2 / SLICE_EDGE_PARTS) + 1


def test_a_slice_without_a_fitting_divisor_is_not_cut_into_tiny_chunks() -> None:
    # 8 · 1009 rows (a prime share) of 8 KiB: an aligned chunk would be one row
    spec = spec_for("w", _meta((8 * 1009, 4096)), slice_align=SLICE_ALIGN)
    assert spec.chunk_rows * spec.row_elems * 2 <= CHUNK_TARGET_BYTES
    assert spec.n_chunks <= SLICE_ALIGN * SLICE_EDGE_PARTS


@given(rows=st.integers(0, 70_000), row_bytes=st.sampled_from([1, 2, 4, 8, 96, 768, 3072, 8192, 28672]),
       target=st.sampled_from([1, 100, 4096, 32 * 1024, 256 * 1024, CHUNK_TARGET_BYTES]))
@settings(deadline=None)
def test_the_rule_keeps_its_promises(rows: int, row_bytes: int, target: int) -> None:
    c = slice_chunk_rows(row_bytes, rows, target)
    plain = chunk_rows_for(row_bytes, rows, (), target)
    assert 1 <= c <= plain  # never above the size target (or one row), never more rows than there are
    if c < plain:  # cut below the target only to align or to bound the edges, never below the floor
        assert c * row_bytes >= SLICE_CHUNK_MIN_BYTES
    share = rows // SLICE_ALIGN
    if rows % SLICE_ALIGN == 0 and share and plain * row_bytes > SLICE_CHUNK_MIN_BYTES \
            and share * row_bytes >= SLICE_CHUNK_MIN_BYTES and share <= plain:
        assert c == share  # a share that fits the target is one chunk: every TP slice on chunk edges


def test_chunk_rows_for_is_the_sharded_writers_rule() -> None:
    from deltastore.write.sharded import planning

    assert planning.chunk_rows_for is chunk_rows_for
    assert chunk_rows_for(768, 30522, (15261,), CHUNK_TARGET_BYTES) == 15261
    assert chunk_rows_for(768, 30522, (7630, 15261), CHUNK_TARGET_BYTES) == 1


# --- end to end: a worker holding 1/8 with the publisher's defaults ----------------------------


def _minilm_shaped(seed: int = 0) -> dict[str, torch.Tensor]:
    """MiniLM's shapes (one encoder layer of six, a vocabulary that 8 does not divide)."""
    g = torch.Generator().manual_seed(seed)
    out = {"emb.word": torch.randn(30522, 384, generator=g), "emb.pos": torch.randn(512, 384, generator=g),
           "emb.type": torch.randn(2, 384, generator=g), "emb.norm": torch.randn(384, generator=g)}
    for w in ("q", "k", "v", "o"):
        out[f"layer.{w}.weight"] = torch.randn(384, 384, generator=g)
        out[f"layer.{w}.bias"] = torch.randn(384, generator=g)
    out["layer.up.weight"] = torch.randn(1536, 384, generator=g)
    out["layer.up.bias"] = torch.randn(1536, generator=g)
    out["layer.down.weight"] = torch.randn(384, 1536, generator=g)
    return {n: t.bfloat16() for n, t in out.items()}


def test_a_worker_holding_rows_r_of_8_reads_its_share_with_slice_aligned_chunking(tmp_path) -> None:
    url = str(tmp_path / "store")
    rng = np.random.default_rng(3)
    state = _minilm_shaped()
    states = []
    with Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=1000),
                   layout_policy=LayoutPolicy(slice_align=SLICE_ALIGN)) as pub:  # 16 MiB target
        for _ in range(3):
            pub.publish(state)
            states.append(snapshot(state))
            state = sparse_edit(state, rng, 0.02)
    tall = tuple(n for n, t in states[0].items() if t.dim() and t.shape[0] >= 8)
    sel = Selection(shard=(0, 3, 8), shard_names=tall)
    with Subscriber(url, threads=2) as whole:
        whole.pull(1)
        w_first = whole.bytes_fetched
        whole.pull(3)  # a whole subscriber fast-forwarding to the last version
        w_per = whole.bytes_fetched - w_first
    with Subscriber(url, threads=2, select=sel) as sub:
        mine = sub.pull(1)
        first = sub.bytes_fetched
        sub.pull_into(mine, 3)
        per = sub.bytes_fetched - first
    want = {n: (t[3 * t.shape[0] // 8: 4 * t.shape[0] // 8] if n in tall else t).contiguous() for n, t in states[2].items()}
    assert_bits_equal(mine, want, "rows 3 of 8 at v3")
    assert first <= 0.15 * w_first, (first, w_first)
    assert per <= 0.15 * w_per, (per, w_per)


# --- resuming a store written with another chunking --------------------------------------------


def _resume_and_continue(url: str, state: dict[str, torch.Tensor], old_rows: dict[str, int]) -> None:
    """A slice-aligned publisher resumes ``url`` and commits ``state``: a delta, in the store's chunk
    rows, that a new subscriber and one holding the old head both read bit-exact."""
    with Subscriber(url) as follower:
        held = follower.pull()
        v = follower.version
        with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(slice_align=SLICE_ALIGN)) as pub:  # would chunk a new layout otherwise
            info = pub.publish(state)
        assert info.version == v + 1 and info.kind == "delta", "resuming must continue the chain, not anchor"
        assert follower.pull_into(held) is not None
        assert_bits_equal(held, state, "fast-forwarded")
    with Subscriber(url) as sub:
        assert_bits_equal(sub.pull(info.version), state, f"v{info.version}")
        assert {n: s.chunk_rows for n, s in sub.units().items()} == old_rows


def test_a_publisher_resuming_the_schema3_golden_store_keeps_its_chunk_rows(tmp_path) -> None:
    shutil.copytree(GOLDEN / "store-schema3", tmp_path / "store")
    url = str(tmp_path / "store")
    with Subscriber(url) as sub:
        sub.pull()
        old_rows = {n: s.chunk_rows for n, s in sub.units().items()}
    state = load_file(str(GOLDEN / "store-schema3-expected" / "v12.safetensors"))
    # the golden store was chunked at 1 KiB: today's default would pick other rows for it
    assert any(spec_for(n, t, slice_align=SLICE_ALIGN).chunk_rows != old_rows[n] for n, t in state.items())
    state = sparse_edit(state, np.random.default_rng(5), 0.05)
    _resume_and_continue(url, state, old_rows)


def test_a_publisher_resuming_a_store_of_the_default_chunking_keeps_it(tmp_path) -> None:
    url = str(tmp_path / "store")
    state = _minilm_shaped(1)
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:  # the default chunking: about 16 MiB per chunk
        pub.publish(state)
    with Subscriber(url) as sub:
        sub.pull()
        old_rows = {n: s.chunk_rows for n, s in sub.units().items()}
    assert old_rows["layer.q.weight"] == 384 and old_rows["emb.word"] == 21845
    assert spec_for("layer.q.weight", state["layer.q.weight"], slice_align=SLICE_ALIGN).chunk_rows == 48
    _resume_and_continue(url, sparse_edit(state, np.random.default_rng(6), 0.02), old_rows)
