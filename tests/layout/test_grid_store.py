"""Stores with a column grid (design 011 D10 step 3): published, read whole, fast-forwarded,
staged and swapped, bit for bit, with every check of SPEC §7 on the grid's chunks.

Grid stores are made by a publisher given explicit specs (``Publisher._explicit_specs``, an
internal test hook: the public policy, ``column_slices``, is step 4). Chunk digests are checked
against an oracle written here by torch slicing (``W[r0:r1, c0:c1].contiguous()``), never
through deltastore.layout.grid.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import (
    CorruptObjectError,
    IntegrityError,
    PollPolicy,
    Publisher,
    Subscriber,
    TargetModifiedError,
    UnsupportedSchemaError,
)
from deltastore._util import kernels
from deltastore.format.keys import object_key, sha256_hex
from deltastore.format.models import Layout
from deltastore.format.objects import decode_object, encode_object
from deltastore.layout.select import Selection
from deltastore.layout.tensors import TensorSpec
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, AsyncPolicy, LayoutPolicy, WriterPolicy
from testkit.hypo import examples

#: The design's golden-store shapes (011 D7): ragged both ways (5 × 5 chunks of a 70 × 100
#: bf16), a grid over trailing dims (12 × 10 × 3, 4 columns), and a plain tensor.
SPECS = {
    "w": TensorSpec("w", "bfloat16", (70, 100), 16, (), 24),
    "x": TensorSpec("x", "float32", (12, 10, 3), 5, (), 4),
}


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(70, 100, generator=g).to(torch.bfloat16),
        "x": torch.randn(12, 10, 3, generator=g),
        "p": torch.randn(33, generator=g),
    }


def _next(prev: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A sparse change inside a few blocks, NaN payloads and -0.0 included; every third step dense."""
    s = {n: t.clone() for n, t in prev.items()}
    if step % 3 == 2:
        s["w"] += torch.tensor(0.5, dtype=torch.bfloat16)
        return s
    s["w"][3 + step:20 + step, 5 * step:5 * step + 30] += 1
    s["x"][step % 12, 7:] = -0.0
    s["x"].view(torch.int32)[(step + 3) % 12, 2, 1] = 0x7FC00001 + step  # a NaN payload
    return s


def _publish(url: str, states: list[dict[str, torch.Tensor]], specs=SPECS, **kw) -> None:
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=False), **kw) as pub:
        pub._explicit_specs = specs
        for s in states:
            pub.publish(s)


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    out = [_state(seed)]
    for k in range(1, n):
        out.append(_next(out[-1], k))
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)), n


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, torch.Tensor]]]:
    url = f"file://{tmp_path_factory.mktemp('grid')}"
    states = _states(5)
    _publish(url, states)
    return url, states


# --- the format -----------------------------------------------------------------------------


def _oracle_blocks(shape: tuple[int, ...], rows: int, cols: int) -> list[tuple[slice, slice]]:
    """Chunk index → (rows, columns) by SPEC §2's numbering, i·ceil(C/k) + j."""
    nr, nc = math.ceil(shape[0] / rows), math.ceil(shape[1] / cols)
    return [(slice(i * rows, min((i + 1) * rows, shape[0])), slice(j * cols, min((j + 1) * cols, shape[1])))
            for i in range(nr) for j in range(nc)]


def test_every_chunk_digest_is_the_hash_of_its_block(store) -> None:
    url, states = store
    with Subscriber(url) as sub:
        for v, state in enumerate(states, 1):
            key, m = sub._reader.resolve(v)
            assert m.chunk_cols("w") == 24 and m.chunk_cols("x") == 4 and m.chunk_cols("p") == 0
            listed = 0
            for t in m.tensors:
                if t.name == "p":
                    continue
                spec = SPECS[t.name]
                blocks = _oracle_blocks(spec.shape, spec.chunk_rows, spec.chunk_cols)
                if m.kind == "anchor":
                    assert len(t.chunks) == len(blocks)
                for c in t.chunks:
                    rs, cs = blocks[c.index]
                    block = state[t.name][rs, cs].contiguous()
                    want = xxhash.xxh3_128_hexdigest(block.view(torch.uint8).numpy().tobytes())
                    assert c.digest == want, (v, t.name, c.index)
                    listed += 1
            assert listed
    assert len(_oracle_blocks((70, 100), 16, 24)) == 25  # 5 × 5, ragged both ways


def test_the_layout_records_the_grid_and_inspect_prints_it(store, capsys: pytest.CaptureFixture[str]) -> None:
    from deltastore.cli import main

    url, _ = store
    with Subscriber(url) as sub:
        sub.pull(1)
        assert sub.units()["w"] == SPECS["w"] and sub.layout()["x"].chunk_cols == 4
    main(["inspect", url, "--version", "1"])
    out = capsys.readouterr().out
    assert "[0] w  bfloat16 [70, 100]  chunk_rows 16  chunk_cols 24" in out
    assert "chunk_rows 5  chunk_cols 4" in out and "p  float32 [33]  chunk_rows 33  (" in out


def test_native_and_numpy_paths_write_identical_packs_and_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """D9: the gather is a numpy copy, so DELTASTORE_NATIVE=0 and =1 write the same bytes."""
    if not kernels.NATIVE:
        pytest.skip("native extension not built")
    states = _states(4, seed=3)

    def written(url: str) -> list[tuple]:
        out = []
        with Subscriber(url) as sub, open_store(url) as st:
            for v in range(1, len(states) + 1):
                _, m = sub._reader.resolve(v)
                packs = [bytes(st.get(b.key)) for b in m.blobs]
                tables = [(t.name, [(c.index, c.digest, None if c.full is None else c.full.model_dump(),
                                     None if c.delta is None else c.delta.model_dump()) for c in t.chunks])
                          for t in m.tensors]
                out.append((m.kind, [b.sha256 for b in m.blobs], packs, tables, m.stats.model_dump()))
        return out

    _publish(f"file://{tmp_path / 'native'}", states, writer_policy=WriterPolicy(threads=2))
    with monkeypatch.context() as mp:
        for name in ("encode_add", "xxh3_128_hex", "split_planes", "pair_codes", "byte_histogram", "apply_segment",
                     "gather_members", "scatter_members", "scan_tensors"):
            mp.setattr(kernels, name, None)
        _publish(f"file://{tmp_path / 'numpy'}", states, writer_policy=WriterPolicy(threads=2))
    assert written(f"file://{tmp_path / 'native'}") == written(f"file://{tmp_path / 'numpy'}")


# --- round trips ----------------------------------------------------------------------------


def test_pull_into_from_every_earlier_version(store) -> None:
    url, states = store
    for start in range(1, len(states)):
        with Subscriber(url) as sub:
            target = sub.pull(start)
            for v in range(start + 1, len(states) + 1):
                assert sub.pull_into(target, v).version == v
                _bits_equal(target, states[v - 1])


def test_pull_into_through_a_compacted_squash(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A squash of grid deltas (compaction, SPEC §12) is planned with the held layout's grid:
    a subscriber catches up through it bit-exactly (it was refused as "does not match the
    layout" before, failing the pull_into)."""
    import logging

    from deltastore.lifecycle.compact import compact

    url = f"file://{tmp_path}"
    states = _states(4)
    _publish(url, states, anchor_policy=AnchorPolicy(every=10))
    assert [(s.from_, s.to) for s in compact(url, bases=[1], to=4).squashes] == [(1, 4)]
    with Subscriber(url) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        target = sub.pull(1)
        sub.pull_into(target, 4)
        _bits_equal(target, states[3])
    assert any("through squash 1→4" in r.getMessage() for r in caplog.records), caplog.text


def test_last_changed_reports_row_bands(store) -> None:
    url, states = store
    with Subscriber(url) as sub:
        target = sub.pull(1)
        sub.pull_into(target, 2)  # step 1 changes w rows 4..20, columns 5..35; x rows 1 and 4
        changed = sub.last_changed
        assert changed["w"] == [(0, 32 * 100)]  # row blocks 0 and 1, whole rows
        assert changed["x"] == [(0, 5 * 30)]  # row block 0 (rows 0-5)
        assert "p" not in changed
        from deltastore.read.changes import changed_rows

        rows = {n: r for n, r, _ in changed_rows(target, changed)}
        assert rows == {"w": [(0, 32)], "x": [(0, 5)]}
        staged = sub.stage(target, 3)
        bands = staged.changed["w"]  # step 2 is dense: all 25 chunks, each reported as its row band
        assert len(bands) == 25 and set(bands) == {(r * 1600, min(r * 1600 + 1600, 7000)) for r in range(5)}
        sub.swap(staged, target)
        _bits_equal(target, states[2])


def test_stage_and_swap_write_blocks_and_rebind_patches_copies(store) -> None:
    url, states = store
    with Subscriber(url) as sub:
        target = sub.pull(1)
        staged = sub.stage(target, 2)
        grid_patches = [p for p in staged.patches if p.name == "w"]
        assert grid_patches and all(p.block == SPECS["w"].chunk_block(p.index) for p in grid_patches)
        _bits_equal(target, states[0])  # staging writes nothing
        sub.swap(staged, target)
        _bits_equal(target, states[1])
        for rec in sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, max_versions=1, swap_mode="rebind"):
            assert rec.info.version == len(states)
        _bits_equal(target, states[-1])


def test_resume_keeps_the_grid_and_writes_deltas(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    states = _states(3, seed=5)
    _publish(url, states[:2])
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=False)) as pub:  # no hook: the store's layout continues
        info = pub.publish(states[2])
        assert info.kind == "delta"
        again = pub.publish(states[2])  # skip_unchanged compares in unit order
        assert again.version == info.version
        assert pub.publish(states[2], anchor=True).kind == "anchor"
    with Subscriber(url) as sub:
        _bits_equal(sub.pull(3), states[2])
        assert sub.units()["w"].chunk_cols == 24
        _bits_equal(sub.pull(), states[2])


def test_a_policy_anchor_of_an_unchanged_state_is_skipped(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    s = _state(6)
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=False),
                   anchor_policy=AnchorPolicy(every=1)) as pub:
        pub._explicit_specs = SPECS
        assert pub.publish(s).version == 1
        assert pub.publish(s).version == 1  # _identical, chunk by chunk against the unit-order reference
        s2 = {n: t.clone() for n, t in s.items()}
        s2["w"][69, 99] += 1  # the last element of the last (ragged) block
        assert pub.publish(s2).version == 2


def test_relayout_to_and_from_a_grid_is_bridged(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    states = _states(3, seed=7)
    _publish(url, states[:1])
    with Subscriber(url) as sub:
        target = sub.pull()
        with Publisher(url, writer_policy=WriterPolicy(resume=False),
                       layout_policy=LayoutPolicy(group_small_tensors=False)) as pub:  # another layout: no grid
            pub.publish(states[1])
        sub.pull_into(target)
        _bits_equal(target, states[1])
        assert sub.units()["w"].chunk_cols == 0
        _publish(url, states[2:], writer_policy=WriterPolicy(resume=False))  # the grid again
        sub.pull_into(target)
        _bits_equal(target, states[2])
        assert sub.units()["w"].chunk_cols == 24


@st.composite
def _grid_cases(draw):
    rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    trailing = draw(st.sampled_from([(), (2,), (1, 3)]))
    spec = TensorSpec("t", "int16", (rows, cols, *trailing), draw(st.integers(1, rows)), (), draw(st.integers(1, cols)))
    steps = draw(st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from(["sparse", "dense", "none"])),
                          min_size=1, max_size=3))
    return spec, draw(st.integers(0, 2**31)), steps


# A fraction of the profile's budget: each example publishes and pulls a store.
@settings(max_examples=examples(0.2), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_grid_cases())
def test_random_grids_round_trip(tmp_path_factory: pytest.TempPathFactory, case) -> None:
    """Random shapes, chunk_rows and chunk_cols; each version checked against a numpy model by
    pull, by pull_into from every earlier version, and by stage + swap."""
    spec, seed, steps = case
    rng = np.random.default_rng(seed)
    model = [rng.integers(-2**15, 2**15, spec.shape, dtype=np.int16)]
    for s, how in steps:
        r = np.random.default_rng(s)
        nxt = model[-1].copy()
        if how == "dense":
            nxt += 1
        elif how == "sparse":
            flat = nxt.reshape(-1)
            flat[r.integers(0, flat.size, max(1, flat.size // 10))] ^= 0x5A5A
        model.append(nxt)
    states = [{"t": torch.from_numpy(a.copy())} for a in model]
    url = f"file://{tmp_path_factory.mktemp('hyp')}"
    _publish(url, states, specs={"t": spec}, writer_policy=WriterPolicy(skip_unchanged=False))
    with Subscriber(url) as sub:
        for v in range(1, len(model) + 1):
            assert np.array_equal(sub.pull(v)["t"].numpy(), model[v - 1])
    for start, end in itertools.combinations(range(1, len(model) + 1), 2):
        with Subscriber(url) as sub:
            t = sub.pull(start)
            sub.pull_into(t, end)
            assert np.array_equal(t["t"].numpy(), model[end - 1])
        with Subscriber(url) as sub:
            t = sub.pull(start)
            staged = sub.stage(t, end)
            sub.swap(staged, t)
            assert np.array_equal(t["t"].numpy(), model[end - 1])


# --- faults ---------------------------------------------------------------------------------


def test_a_target_modified_inside_a_block_is_refused_and_left_as_it_was(store) -> None:
    url, states = store
    blocks = {(20, 30): "chunk 6 (rows 16-32, columns 24-48)", (69, 99): "chunk 24 (rows 64-70, columns 96-100)",
              (0, 0): "chunk 0 (rows 0-16, columns 0-24)"}  # block (1, 1), the last (ragged both ways), the first
    for where, words in blocks.items():
        with Subscriber(url) as sub:
            target = sub.pull(1)
            target["w"][where] += 1
            before = {n: t.clone() for n, t in target.items()}
            with pytest.raises(TargetModifiedError, match=rf"tensor 'w' {re.escape(words)}"):
                sub.pull_into(target, 3)
            _bits_equal(target, before)
            with pytest.raises(TargetModifiedError):
                sub.stage(target, 3)


def test_a_write_between_stage_and_swap_is_detected(store) -> None:
    url, _ = store
    with Subscriber(url) as sub:
        target = sub.pull(1)
        staged = sub.stage(target, 2)
        p = next(p for p in staged.patches if p.name == "w" and p.positions is not None)
        r0, _, e0, e1 = p.block
        pos = int(p.positions[-1])
        row, col = r0 + pos // (e1 - e0), e0 + pos % (e1 - e0)  # the patched (row, col)
        target["w"].view(torch.int16)[row, col] ^= 1
        before = {n: t.clone() for n, t in target.items()}
        with pytest.raises(TargetModifiedError, match=r"rows \d+-\d+, element columns"):
            sub.swap(staged, target)
        _bits_equal(target, before)


def test_a_corrupt_segment_mid_apply_rolls_back_bit_exactly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path}"
    states = _states(3, seed=9)
    states[2] = {n: t.clone() for n, t in states[1].items()}
    states[2]["w"] += torch.tensor(1.0, dtype=torch.bfloat16)  # every grid chunk changes
    _publish(url, states, anchor_policy=AnchorPolicy(every=100))
    with open_store(url) as st, Subscriber(url) as sub:
        _, m = sub._reader.resolve(3)
        w = next(t for t in m.tensors if t.name == "w")
        seg = w.chunks[len(w.chunks) // 2].delta  # a chunk in the middle of the apply
        pack = m.blobs[seg.blob]
        data = bytearray(st.get(pack.key))
        data[seg.offset + seg.length - 1] ^= 0xFF
        st.delete(pack.key)
        st.put(pack.key, bytes(data), mode="create")
    with Subscriber(url) as sub:
        target = sub.pull(2)
        before = {n: t.clone() for n, t in target.items()}
        with pytest.raises(IntegrityError), caplog.at_level("ERROR", logger="deltastore.read.engine"):
            sub.pull_into(target, 3)
        _bits_equal(target, before)
    rolled = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert rolled and int(rolled[0].split("rolled back ")[1].split()[0]) >= 2  # grid chunks were written, then undone


# --- hostile layouts and refusals ---------------------------------------------------------------


def _layout(store) -> tuple[Layout, str]:
    url, _ = store
    with Subscriber(url) as sub:
        _, m = sub._reader.resolve(1)
        data = open_store(url).get(m.layout.key)
        return decode_object(Layout, bytes(data), m.layout.key, m.layout.sha256), m.layout.key


@pytest.mark.parametrize("cols, match", [
    ((-1, 4, 0), "chunk_cols -1"),
    ((2**63, 4, 0), "chunk_cols"),
    ((101, 4, 0), "more than its 100 columns"),
    ((24, 4, 3), "a grid needs a second dimension"),
])
def test_hostile_grid_layouts_are_corrupt(store, cols, match) -> None:
    layout, _ = _layout(store)
    names = list(layout.name)
    order = [names.index(n) for n in ("w", "x", "p")]
    col = [0] * len(names)
    for i, c in zip(order, cols):
        col[i] = c
    bad = layout.model_copy(update={"chunk_cols": tuple(col)})
    data = encode_object(bad)
    key = object_key("0" * 32, sha256_hex(data), ".layout.json.zst")
    with pytest.raises(CorruptObjectError, match=match):
        decode_object(Layout, data, key)


def test_a_grid_on_a_group_row_or_an_empty_dimension_is_corrupt() -> None:
    from deltastore.format.models import GroupRecord

    base = dict(name=("g", "e"), dtype=("float32", "float32"), shape=((6,), (3, 0)), chunk_rows=(6, 1),
                pieces=(None, None), piece_parts=(None, None))
    cases = [
        (Layout(schema=4, chunk_cols=(1, 0), groups=(GroupRecord(unit=0, name=("a", "b"), shape=((3,), (3,)), offset=(0, 3)),),
                **base), "a grid needs a second dimension"),
        (Layout(chunk_cols=(0, 1), **base), "more than its 0 columns"),
    ]
    for layout, match in cases:
        data = encode_object(layout)
        with pytest.raises(CorruptObjectError, match=match):
            decode_object(Layout, data, object_key("0" * 32, sha256_hex(data), ".layout.json.zst"))


def test_a_grid_changes_the_layouts_digest() -> None:
    from deltastore.format.models import layout_of

    a = encode_object(layout_of({"w": SPECS["w"]}))
    b = encode_object(layout_of({"w": TensorSpec("w", "bfloat16", (70, 100), 16, (), 25)}))
    c = encode_object(layout_of({"w": TensorSpec("w", "bfloat16", (70, 100), 16)}))
    assert len({sha256_hex(a), sha256_hex(b), sha256_hex(c)}) == 3


def test_a_selection_touching_a_grid_tensor_reads_it(store) -> None:
    """Step 5 lifted step 3's refusal: a column cut of a grid tensor, and a grid tensor
    selected whole, read bit for bit (tests/read/test_partial_grid.py has the rest)."""
    url, states = store
    for sel, want in ((Selection(names=("w",), shard=(1, 1, 2)), lambda s: {"w": s["w"][:, 50:].contiguous()}),
                      (Selection(names=("x",)), lambda s: {"x": s["x"]})):
        with Subscriber(url, select=sel) as sub:
            mine = sub.pull(1)
            sub.pull_into(mine)
            _bits_equal(mine, want(states[-1]))


def test_a_grid_in_a_federated_base_is_refused(store) -> None:
    from deltastore.federated.based import specs_of

    layout, key = _layout(store)
    with pytest.raises(UnsupportedSchemaError, match="'w' has a column grid"):
        specs_of(layout, what=key)


# --- the writer's policy (D10 step 4) --------------------------------------------------------


def test_slice_chunk_cols() -> None:
    from deltastore.layout.tensors import slice_chunk_cols

    assert slice_chunk_cols(4096, 1, 2, 8) == 512  # a rank's share when N divides C
    assert slice_chunk_cols(28672, 1, 2, 8) == 3584
    assert slice_chunk_cols(12, 3, 4, 4) == 3  # trailing dims count in the block, not in the columns
    assert slice_chunk_cols(1001, 1, 2, 8) == 8  # ⌈⌊1001/8⌋/16⌉: edges of 1/16 of a share
    assert slice_chunk_cols(100, 1, 2, 8) == 1
    # a single row of the share wider than the target: the largest divisor of the share that fits
    assert slice_chunk_cols(64, 1024, 2, 8, chunk_bytes=8 * 1024) == 4
    assert slice_chunk_cols(24, 1024, 2, 8, chunk_bytes=5 * 1024) == 1  # 3 columns per share: only 1 fits


def test_grid_spec_for_llama_shapes_and_exclusions() -> None:
    from deltastore.layout.tensors import grid_spec_for

    def meta(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    o = grid_spec_for("o", meta(4096, 4096), 8)  # 8B o_proj: 8 chunks of 4096 × 512 (4 MiB)
    assert (o.chunk_rows, o.chunk_cols, o.n_chunks, o.chunk_bytes(0)) == (4096, 512, 8, 4 << 20)
    down = grid_spec_for("d", meta(4096, 14336), 8)  # 8B down_proj: 8 of 4096 × 1792 (14 MiB)
    assert (down.chunk_rows, down.chunk_cols, down.n_chunks) == (4096, 1792, 8)
    big = grid_spec_for("d", meta(8192, 28672), 8)  # 70B down_proj: 2340 × 3584, 32 chunks ≤ 16 MiB
    assert (big.chunk_rows, big.chunk_cols, big.n_chunks) == (2340, 3584, 32)
    assert max(big.chunk_bytes(i) for i in range(big.n_chunks)) <= 16 << 20
    assert grid_spec_for("v", meta(1 << 20), 8) is None  # one dimension
    assert grid_spec_for("n", meta(1 << 16, 4), 8) is None  # fewer columns than ranks
    assert grid_spec_for("s", meta(128, 128), 8) is None  # 32 KiB ≤ 8 × 32 KiB: read whole
    assert grid_spec_for("w", meta(4096, 4096), 1) is None  # one column block: whole rows


def test_column_slices_needs_slice_align_and_patterns(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="column_slices needs slice_align"):
        Publisher(f"file://{tmp_path}", layout_policy=LayoutPolicy(column_slices=("*.o_proj.weight",)))
    with pytest.raises(ValueError, match="sequence of fnmatch patterns"):
        Publisher(f"file://{tmp_path}", layout_policy=LayoutPolicy(slice_align=8, column_slices="*.o_proj.weight"))


def test_row_parallel_names_llama_row_parallel_weights() -> None:
    import fnmatch

    from deltastore.layout.select import ROW_PARALLEL

    def hit(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in ROW_PARALLEL)

    assert hit("model.layers.0.self_attn.o_proj.weight") and hit("model.layers.31.mlp.down_proj.weight")
    assert not any(map(hit, ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                             "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.bias"]))


def test_column_slices_grids_what_fits_and_logs_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(11)
    shared = torch.randn(64, 512, generator=g)
    state = {
        "l0.o_proj.weight": torch.randn(64, 512, generator=g),  # 128 KiB, 2 ranks: chunk_cols 256
        "l0.down_proj.weight": torch.randn(16, 300, 2, generator=g),  # 37.5 KiB ≤ 2 × 32 KiB: whole
        "l1.o_proj.weight": torch.randn(70, 1001, generator=g),  # ⌈500/16⌉ = 32 columns per block
        "l0.o_proj.bias": torch.randn(64, generator=g),  # 1-D
        "tied.o_proj.weight": shared, "tied_head.weight": shared,  # tied: no grid
        "l0.q_proj.weight": torch.randn(64, 512, generator=g),  # not matched
    }
    url = f"file://{tmp_path}"
    with caplog.at_level("INFO", logger="deltastore.write.policy"), \
            Publisher(url,
                      layout_policy=LayoutPolicy(slice_align=2, column_slices=ROW_PARALLEL_PATTERNS, group_small_tensors=True)) as pub:
        pub.publish(state)
        nxt = {n: t.clone() for n, t in state.items()}
        nxt["l0.o_proj.weight"][5, 300] += 1
        nxt["l1.o_proj.weight"][69, 1000] += 1
        assert pub.publish(nxt).kind == "delta"
    with Subscriber(url) as sub:
        _bits_equal(sub.pull(), nxt)
        units = sub.units()
    assert units["l0.o_proj.weight"].chunk_cols == 256 and units["l0.o_proj.weight"].n_chunks == 2
    assert units["l1.o_proj.weight"].chunk_cols == 32
    gridded = {n for n, s in units.items() if s.chunk_cols}
    assert gridded == {"l0.o_proj.weight", "l1.o_proj.weight"}  # and neither is in a group row
    assert not any(m.name in gridded for s in units.values() for m in s.members)
    assert any(s.members for s in units.values())  # the small ones were grouped
    line = next(r.getMessage() for r in caplog.records if "get no column grid" in r.getMessage())
    assert "3 of 5" in line and all(n in line for n in ("l0.down_proj.weight", "l0.o_proj.bias", "tied.o_proj.weight"))


ROW_PARALLEL_PATTERNS = ("*.o_proj.weight", "*.down_proj.weight", "*.o_proj.bias")


def test_a_resumed_publisher_keeps_the_grid_and_resume_false_relays_out(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    g = torch.Generator().manual_seed(12)
    s1 = {"a.o_proj.weight": torch.randn(64, 512, generator=g), "b": torch.randn(8, generator=g)}
    s2 = {n: t + 1 for n, t in s1.items()}
    s3 = {n: t + 2 for n, t in s1.items()}
    with Publisher(url, layout_policy=LayoutPolicy(slice_align=2, column_slices=("*.o_proj.weight",))) as pub:
        pub.publish(s1)
    with Subscriber(url) as sub:
        target = sub.pull()
        with Publisher(url) as pub:  # resumed: the store's layout, grid included, continues
            assert pub.publish(s2).kind == "delta"
        sub.pull_into(target)
        _bits_equal(target, s2)
        assert sub.units()["a.o_proj.weight"].chunk_cols == 256
        with Publisher(url, writer_policy=WriterPolicy(resume=False)) as pub:  # a new layout without the grid: an anchor
            assert pub.publish(s3).kind == "anchor"
        sub.pull_into(target)  # bridged: the relaid anchor replaces every chunk
        _bits_equal(target, s3)
        assert sub.units()["a.o_proj.weight"].chunk_cols == 0


def test_publish_async_snapshots_publish_grids_bit_exact(tmp_path: Path) -> None:
    """An owned snapshot's anchor adopts the gathered unit-order buffer; the deltas after it
    advance that buffer in place."""
    url = f"file://{tmp_path}"
    states = _states(4, seed=13)
    with Publisher(url, layout_policy=LayoutPolicy(group_small_tensors=False),
                   async_policy=AsyncPolicy(max_pending=2)) as pub:
        pub._explicit_specs = SPECS
        futures = [pub.publish_async(s) for s in states]
        kinds = [f.result().kind for f in futures]
    assert kinds == ["anchor", "delta", "delta", "delta"]
    with Subscriber(url) as sub:
        for v, s in enumerate(states, 1):
            _bits_equal(sub.pull(v), s)


def test_a_chunk_index_past_the_grid_is_corrupt_and_says_the_grid(store) -> None:
    """A manifest listing chunk nr·nc of a grid tensor (one past its last block) is refused
    before any planning; the message gives the grid's chunk count and block shape."""
    from deltastore.format.checks import check_manifest

    url, _ = store
    with Subscriber(url) as sub:
        key, m = sub._reader.resolve(1)
    spec = SPECS["w"]
    w = next(t for t in m.tensors if t.name == "w")
    last = w.chunks[-1]
    assert last.index == spec.n_chunks - 1 == 5 * 5 - 1  # 70 rows by 16 × 100 columns by 24
    bad_w = w.model_copy(update={"chunks": (*w.chunks[:-1], last.model_copy(update={"index": spec.n_chunks}))})
    bad = m.model_copy(update={"tensors": tuple(bad_w if t.name == "w" else t for t in m.tensors)})
    bad._grid = m._grid  # the layout's grid, as with_layout attaches it
    with pytest.raises(CorruptObjectError, match=r"w\[25\] is out of range: .* has 25 chunk\(s\) of 16 rows × 24 columns"):
        check_manifest(bad, key)
