"""Incremental derivation of serving streams (deltastore/write/requant.py, _native/requant.c): the
same codes, scales, delta planes and stream segments as quantizing in full."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore import Publisher
from deltastore._util import kernels
from deltastore.format.history import History
from deltastore.serving.quantize import quantize_fp8_block128, quantize_mxfp8
from deltastore.storage import open_store
from deltastore.storage.prefixed import PrefixedStore
from deltastore.write import requant
from deltastore.write.policy import LayoutPolicy

pytestmark = pytest.mark.skipif(kernels.requant_classify is None, reason="needs the native kernels")

QUANTIZE = {0: quantize_fp8_block128, 1: quantize_mxfp8}
BF16_NAN, BF16_INF = 0x7FC0, 0x7F80


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint16).numpy().reshape(-1)


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w[:16, :64] = 0  # an all-zero block (fp8: below the floor)
    w[16:32, :64] *= 1e-4  # blocks whose max is under the floor
    return w


def _changed(w: torch.Tensor, seed: int) -> torch.Tensor:
    """Small steps almost everywhere, a few elements raised past their block's max, the max of a
    few blocks lowered, a NaN and an infinity added, a non-finite block made finite again."""
    g = torch.Generator().manual_seed(seed)
    b = _bits(w).astype(np.int32)
    rng = np.random.default_rng(seed)
    at = rng.random(b.size) < 0.05
    b[at] += rng.integers(-2, 3, at.sum())
    flat = w.float().reshape(-1)
    for i in rng.choice(b.size, 6, replace=False):
        b[i] = int(torch.tensor(float(flat[i]) * 4 + 0.05).to(torch.bfloat16).view(torch.int16)) & 0xFFFF
    top = int(flat.abs().argmax())
    b[top] = 0
    b[rng.integers(b.size)] = BF16_NAN
    b[rng.integers(b.size)] = BF16_INF
    del g
    return torch.from_numpy((b & 0xFFFF).astype(np.uint16)).view(torch.bfloat16).reshape(w.shape)


def _small_steps(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights, and the same with small steps only (every seventh element three ulps up)."""
    w0 = _weights(rows, cols, 5)
    b = _bits(w0).astype(np.int32)
    b[::7] += 3
    return w0, torch.from_numpy((b & 0xFFFF).astype(np.uint16)).view(torch.bfloat16).reshape(rows, cols)


def _mark(code: int, src: np.ndarray, rows: int, cols: int, chunks: list, scales: np.ndarray, amax: np.ndarray,
          dirty: np.ndarray, *, order: slice = slice(None)) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Classify each changed chunk ``(start, positions, old values, new values)`` (in ``order``, as
    encode threads may), then rescale the dirty blocks: the number of dirty blocks and the changed
    codes outside them, in position order."""
    dirty[:] = 0
    got = {c[0]: kernels.requant_classify(code, rows, cols, *c, scales, amax, dirty) for c in chunks[order]}
    n_dirty = kernels.requant_rescale(code, src, rows, cols, scales, amax, dirty)
    parts = [got[start] for start in sorted(got)]
    return (n_dirty, np.frombuffer(b"".join(p[0] for p in parts), np.int64),
            np.frombuffer(b"".join(p[1] for p in parts), np.uint8),
            np.frombuffer(b"".join(p[2] for p in parts), np.uint8))


def _step(code: int, rows: int, cols: int, w0: torch.Tensor, w1: torch.Tensor, chunk_rows: int, *,
          order: slice = slice(None)):
    """Requantize w1 incrementally from w0's quantization; the chunks' results, the codes and the
    scales."""
    q0, s0 = QUANTIZE[code](w0, amax=(amax := np.empty(_n_scales(code, rows, cols), np.uint16)))
    old = _bits(w0).copy()
    chunks = []
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        got = kernels.encode_add(old[r0 * cols:r1 * cols], _bits(w1)[r0 * cols:r1 * cols], 2, True, 1, True)
        if got[0]:
            chunks.append((r0 * cols, *got[7:]))
    scales = s0.numpy().reshape(-1).copy()
    dirty = np.empty(amax.size, np.uint8)
    _, pos, oc, nc = _mark(code, _bits(w1), rows, cols, chunks, scales, amax, dirty, order=order)
    codes = q0.view(torch.uint8).numpy().reshape(-1).copy()
    before = codes.copy()
    results = []
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        lo, hi = np.searchsorted(pos, (r0 * cols, r1 * cols))
        results.append(kernels.requant_delta(code, _bits(w1), rows, cols, r0, r1, pos[lo:hi], oc[lo:hi], nc[lo:hi],
                                             dirty, scales, codes[r0 * cols:r1 * cols], 1))
    return before, codes, scales, amax, results


def _n_scales(code: int, rows: int, cols: int) -> int:
    return -(-rows // 128) * -(-cols // 128) if code == 0 else rows * cols // 32


@pytest.mark.parametrize("code", [0, 1], ids=["fp8-block128", "mxfp8"])
@pytest.mark.parametrize(("seed", "order"),
                         [(1, slice(None)), (2, slice(None)), (3, slice(None)), (1, slice(None, None, -1))],
                         ids=["seed1", "seed2", "seed3", "seed1-chunks-classified-last-first"])
def test_incremental_requantization_equals_a_full_one_byte_for_byte(code: int, seed: int, order: slice) -> None:
    rows, cols, chunk_rows = 300, 416, 70  # ragged blocks, chunks across block rows
    w0 = _weights(rows, cols, seed)
    w1 = _changed(w0, seed)
    before, codes, scales, amax, results = _step(code, rows, cols, w0, w1, chunk_rows, order=order)
    want_q, want_s = QUANTIZE[code](w1, amax=(want_amax := np.empty(amax.size, np.uint16)))
    want = want_q.view(torch.uint8).numpy().reshape(-1)
    assert np.array_equal(codes, want)
    assert np.array_equal(scales.view(np.uint8), want_s.numpy().reshape(-1).view(np.uint8))
    assert np.array_equal(amax, want_amax)
    for i, r0 in enumerate(range(0, rows, chunk_rows)):  # each chunk's delta is encode_add's
        r1 = min(rows, r0 + chunk_rows)
        ref = kernels.encode_add(before[r0 * cols:r1 * cols].copy(), want[r0 * cols:r1 * cols], 1, True, 1)
        assert results[i] == ref, f"chunk rows [{r0}, {r1})"


@pytest.mark.parametrize("code", [0, 1], ids=["fp8-block128", "mxfp8"])
@pytest.mark.parametrize("chunk_rows", [300, 128], ids=["one-chunk", "chunks-of-block-rows"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_chunk_of_whole_blocks_requantized_in_one_step_equals_the_three(code: int, chunk_rows: int,
                                                                          seed: int) -> None:
    rows, cols = 300, 416
    w0 = _weights(rows, cols, seed)
    w1 = _changed(w0, seed)
    before, codes, scales, amax, results = _step(code, rows, cols, w0, w1, chunk_rows)
    q0, s0 = QUANTIZE[code](w0, amax=(amax1 := np.empty(amax.size, np.uint16)))
    codes1, scales1 = before.copy(), s0.numpy().reshape(-1).copy()
    dirty = np.full(amax.size, 7, np.uint8)  # each chunk sets its own blocks' flags
    old = _bits(w0).copy()
    spans = [(r0, min(rows, r0 + chunk_rows)) for r0 in range(0, rows, chunk_rows)]
    dirty_blocks = 0
    for i, (r0, r1) in reversed(list(enumerate(spans))):  # any order: no chunk reads another's blocks
        listed = kernels.encode_add(old[r0 * cols:r1 * cols], _bits(w1)[r0 * cols:r1 * cols], 2, True, 1, True)[7:]
        got = kernels.requant_chunk(code, rows, cols, r0 * cols, *listed, _bits(w1), scales1, amax1, dirty,
                                    codes1[r0 * cols:r1 * cols], 1)
        assert got[1:] == results[i], f"chunk rows [{r0}, {r1})"
        dirty_blocks += got[0]
    assert np.array_equal(codes1, codes)
    assert np.array_equal(scales1.view(np.uint8), scales.view(np.uint8))
    assert np.array_equal(amax1, amax)
    assert set(np.unique(dirty)) <= {0, 1} and dirty_blocks == int(dirty.sum()) > 0


def test_a_chunk_in_one_step_must_hold_whole_blocks_and_start_where_the_reference_is() -> None:
    rows, cols = 256, 256
    w0, w1 = _small_steps(rows, cols)  # some blocks stay clean
    q0, s0 = quantize_fp8_block128(w0, amax=(amax := np.empty(4, np.uint16)))
    codes, scales, dirty = q0.view(torch.uint8).numpy().reshape(-1).copy(), s0.numpy().reshape(-1).copy(), \
        np.empty(4, np.uint8)

    def one_step(r1: int, old_codes: np.ndarray, positions: bytes | None = None):
        listed = kernels.encode_add(_bits(w0)[:r1 * cols].copy(), _bits(w1)[:r1 * cols], 2, True, 1, True)[7:]
        if positions is not None:
            listed = (positions, b"\0\0", b"\1\0")
        return kernels.requant_chunk(0, rows, cols, 0, *listed, _bits(w1), scales.copy(), amax.copy(), dirty,
                                     old_codes, 1)

    with pytest.raises(ValueError, match="whole blocks"):  # 70 rows: half a block row
        one_step(70, codes[:70 * cols].copy())
    with pytest.raises(ValueError, match="inconsistent"):  # a position past the chunk
        one_step(128, codes[:128 * cols].copy(), np.array([128 * cols], np.uint32).tobytes())
    assert one_step(128, codes[:128 * cols].copy())[1] > 0
    assert not dirty.all()
    stale = codes[:128 * cols].copy()
    stale ^= 1  # the reference is not the version the changes start from
    with pytest.raises(ValueError, match="old code differs"):
        one_step(128, stale)


def test_a_reference_that_is_not_the_changes_start_is_refused() -> None:
    rows, cols = 128, 256
    w0, w1 = _small_steps(rows, cols)  # no block turns dirty
    q0, s0 = quantize_fp8_block128(w0, amax=(amax := np.empty(2, np.uint16)))
    old = _bits(w0).copy()
    listed = kernels.encode_add(old, _bits(w1), 2, True, 1, True)[7:]
    scales, dirty = s0.numpy().reshape(-1).copy(), np.empty(2, np.uint8)
    _, positions, oc, nc = _mark(0, _bits(w1), rows, cols, [(0, *listed)], scales, amax, dirty)
    clean = [p for p in positions if not dirty[(p // cols // 128) * 2 + (p % cols) // 128]]
    assert clean
    stale = q0.view(torch.uint8).numpy().reshape(-1).copy()
    first = clean[0]
    stale[first] ^= 1  # the reference is not the version the changes start from
    with pytest.raises(ValueError, match="old code differs"):
        kernels.requant_delta(0, _bits(w1), rows, cols, 0, rows, positions, oc, nc, dirty, scales, stale, 1)


def test_inconsistent_change_lists_are_refused() -> None:
    scales, amax, dirty = np.ones(1, np.float32), np.zeros(1, np.uint16), np.empty(1, np.uint8)

    def u32(*xs: int) -> bytes:
        return np.array(xs, np.uint32).tobytes()

    def classify(start, positions, old, new):
        return kernels.requant_classify(0, 128, 128, start, positions, old, new, scales, amax, dirty)

    with pytest.raises(ValueError, match="inconsistent"):  # a position past the tensor
        classify(128 * 127, u32(200), b"\0" * 2, b"\1\0")
    with pytest.raises(ValueError, match="inconsistent"):  # not increasing
        classify(0, u32(9, 3), b"\0" * 4, b"\1\0" * 2)
    with pytest.raises(ValueError, match="inconsistent"):  # values missing
        classify(0, u32(3), b"", b"")
    with pytest.raises(ValueError, match="first element"):  # a chunk that does not start a row
        classify(5, u32(3), b"\0" * 2, b"\1\0")


def test_scatter_changes_refuses_a_position_outside_the_chunk() -> None:
    dst = np.zeros(8, np.uint16)
    kernels.scatter_changes(dst, 2, np.array([1, 6], np.uint32).tobytes(), np.array([5, 7], np.uint16).tobytes())
    assert dst.tolist() == [0, 5, 0, 0, 0, 0, 7, 0]
    with pytest.raises(ValueError, match="outside"):
        kernels.scatter_changes(dst, 2, np.array([8], np.uint32).tobytes(), np.array([1], np.uint16).tobytes())


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(256, 192, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(320, 192, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(192, 576, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(192, dtype=torch.bfloat16),
    }


def _streams(url: str, fmt: str, *, kind: str | None = None) -> list[list[tuple]]:
    """Per version of format ``fmt``'s stream (of ``kind`` only, when given): each chunk's
    (tensor, index, digest, full and delta segments' SHA-256)."""
    store = open_store(url)
    history, streams = History(store), History(PrefixedStore(store, f"streams/{fmt}/"))
    head = history.read_head()
    assert head is not None
    out = []
    for v in range(1, head[0].version + 1):
        _, m = history.resolve(v, head[0])
        sm = streams.manifest(m.stream_ref(fmt).key[len(f"streams/{fmt}/"):])
        if kind is None or sm.kind == kind:
            out.append([(t.name, c.index, c.digest, c.full.sha256 if c.full else None,
                         c.delta.sha256 if c.delta else None) for t in sm.tensors for c in t.chunks])
    return out


@pytest.mark.parametrize(("chunk_bytes", "one_step"), [(32 * 1024, False), (None, True)],
                         ids=["chunks-across-blocks", "whole-blocks-one-step"])
def test_a_publisher_derives_the_same_streams_incrementally_as_in_full(tmp_path, monkeypatch, chunk_bytes,
                                                                      one_step) -> None:
    states = [_model(0)]
    for i in range(1, 4):
        states.append(_changed_state(states[-1], i))
    layout = LayoutPolicy(chunk_bytes=chunk_bytes) if chunk_bytes else LayoutPolicy()
    formats = ("bf16", "fp8-block128", "mxfp8")
    calls = {"requant_classify": 0, "requant_rescale": 0, "requant_chunk": 0}
    for name in calls:
        def counted(*a, kernel=getattr(kernels, name), name=name):
            calls[name] += 1
            return kernel(*a)

        monkeypatch.setattr(kernels, name, counted)
    scales_with_chunk = []  # each scale tensor encoded by the one-step sink, with its chunks
    encoded_scales = requant._encoded_scales

    def counted_scales(ref, scales, spec):
        got = encoded_scales(ref, scales, spec)
        scales_with_chunk.append(len(got))
        return got

    monkeypatch.setattr(requant, "_encoded_scales", counted_scales)
    with Publisher(str(tmp_path / "incr"), formats=formats, layout_policy=layout) as pub:
        for s in states:
            pub.publish(s)
    if one_step:  # every tensor one chunk, in the stream as in the store
        assert calls["requant_chunk"] == 2 * 2 * (len(states) - 1)  # two quantized tensors, two formats, every delta
        assert calls["requant_classify"] == calls["requant_rescale"] == 0
        # a block turned dirty changes the scale tensor: encoded with its one chunk, on the
        # store's encode thread (the streams below prove the bytes are the full derivation's)
        assert scales_with_chunk and all(n > 0 for n in scales_with_chunk)
    else:
        assert calls["requant_rescale"] == 2 * 2 * (len(states) - 1)
        assert calls["requant_classify"] > calls["requant_rescale"]  # the tensors span several chunks
        assert calls["requant_chunk"] == 0
        assert not scales_with_chunk
    monkeypatch.setattr(kernels, "requant_classify", None)  # the full derivation
    with Publisher(str(tmp_path / "full"), formats=formats, layout_policy=layout) as pub:
        for s in states:
            pub.publish(s)
    for fmt in formats[1:]:
        assert _streams(str(tmp_path / "incr"), fmt) == _streams(str(tmp_path / "full"), fmt), fmt


def test_a_tensor_done_in_one_step_in_part_only_is_derived_in_full(tmp_path) -> None:
    """Defensive: should the store list a changed chunk its sink did not see, the chunks the sink
    did advance leave the stream's reference at no version; the derivation says so (the stream
    then drops it and derives the version in full, without a base) rather than diff against it."""
    from deltastore.layout.tensors import TensorSpec
    from deltastore.serving.formats import serving_format
    from deltastore.write.encode import ChunkChange
    from deltastore.write.requant import Requantizer

    rows, cols = 256, 256
    W = "model.layers.0.mlp.down_proj.weight"  # a name the format quantizes
    w0 = _weights(rows, cols, 6)
    w1 = _changed(w0, 6)
    state0, state1 = {W: w0}, {W: w1}
    specs = {W: TensorSpec(W, "float8_e4m3fn", (rows, cols), 128)}
    store_specs = {W: TensorSpec(W, "bfloat16", (rows, cols), 128)}
    r = Requantizer(serving_format("fp8-block128"))
    reference = dict(r.derive(state0, pool=None).state)
    before = reference[W].clone()
    sinks = r.prepare(state1, reference, specs, store_specs)
    old = _bits(w0).copy()
    changes = []
    for index in (0, 1):
        a, b = index * 128 * cols, (index + 1) * 128 * cols
        listed = kernels.encode_add(old[a:b], _bits(w1)[a:b], 2, True, 1, True)[7:]
        assert len(listed[0])
        if index == 0:  # the sink sees the first chunk only
            sinks[W](index, a, *listed)
        changes.append(ChunkChange(index, a, b, None, "", "", *listed))  # type: ignore[arg-type]
    assert not torch.equal(reference[W].view(torch.uint8), before.view(torch.uint8))  # advanced in part
    got = r.derive(state1, pool=None, reference=reference, specs=specs, store_specs=store_specs,
                   changes={W: changes})
    assert got.stale and not got.state
    changes[1] = changes[0]  # every chunk it saw, listed: not stale (the lists are what it compares)
    r2 = Requantizer(serving_format("fp8-block128"))
    reference2 = dict(r2.derive(state0, pool=None).state)
    sinks2 = r2.prepare(state1, reference2, specs, store_specs)
    sinks2[W](0, 0, *kernels.encode_add(_bits(w0)[:128 * cols].copy(), _bits(w1)[:128 * cols], 2, True, 1,
                                           True)[7:])
    assert not r2.derive(state1, pool=None, reference=reference2, specs=specs, store_specs=store_specs,
                         changes={W: changes[:1]}).stale


def test_what_prepare_decides_of_a_tensor_follows_the_layouts(monkeypatch) -> None:
    """A tensor's chunks are done in one step while the store chunks it as the stream does, in
    two once the store's layout differs; its scale tensor is encoded with it only while it is one
    chunk. What prepare decided for the last layouts does not stand for new ones."""
    from deltastore.layout.tensors import TensorSpec
    from deltastore.serving.formats import serving_format
    from deltastore.write.requant import Requantizer

    rows, cols = 256, 256
    W, S = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"
    w0, w1 = _small_steps(rows, cols)
    r = Requantizer(serving_format("fp8-block128"))
    reference = dict(r.derive({W: w0}, pool=None).state)

    def sink(specs, store_specs, views=None):
        return r.prepare({W: w1}, reference, specs, store_specs, views)[W]

    one = {W: TensorSpec(W, "float8_e4m3fn", (rows, cols), rows), S: TensorSpec(S, "float32", (2, 2), 2)}
    views: dict[str, np.ndarray] = {}
    got = sink(one, {W: TensorSpec(W, "bfloat16", (rows, cols), rows)}, views)
    assert type(got).__name__ == "_OneStep" and got.scale_spec is one[S]
    assert set(views) == {W, S} and got.ref is views[W] and got.scale_ref is views[S]  # the caller's views
    two_chunks = {W: TensorSpec(W, "float8_e4m3fn", (rows, cols), 128), S: one[S]}
    got = sink(two_chunks, {W: TensorSpec(W, "bfloat16", (rows, cols), 128)})
    assert type(got).__name__ == "_OneStep" and got.scale_ref is None  # scales encoded in derive
    got = sink(two_chunks, {W: TensorSpec(W, "bfloat16", (rows, cols), 64)})  # chunked unlike the stream
    assert type(got).__name__ == "_Sink"
    alike = {W: TensorSpec(W, "bfloat16", (rows, cols), rows)}
    assert type(sink(one, alike)).__name__ == "_OneStep"
    monkeypatch.setattr(requant, "ONE_STEP", False)  # a switch read at every version, not kept
    assert type(sink(one, alike)).__name__ == "_Sink"


def _changed_state(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    return {n: _changed(t, seed) if t.dim() == 2 else t for n, t in state.items()}


def test_kept_tensors_share_the_stores_reference_and_a_version_without_it_reads_the_stream_back(
        tmp_path, monkeypatch) -> None:
    from deltastore import Subscriber
    from deltastore.serving.formats import derive, serving_format
    from deltastore.write import requant
    from testkit.tensors import assert_bits_equal

    states = [_model(0)]
    for i in range(1, 6):
        states.append(_changed_state(states[-1], i))
    url = str(tmp_path / "s")
    with Publisher(url, formats=("bf16", "fp8-block128"), layout_policy=LayoutPolicy(chunk_bytes=32 * 1024)) as pub:
        for s in states[:3]:
            pub.publish(s)
        stream = pub._streams["fp8-block128"]
        embed = "model.embed_tokens.weight"
        assert stream._reference[embed] is pub._reference[embed]  # one copy of a kept tensor
        # no store delta to reuse: the shared reference already holds the new bits, so the stream
        # drops its reference and reads its previous version back (resume) to diff against
        monkeypatch.setattr(requant, "ENABLED", False)
        assert pub.publish(states[3]).kind == "delta"
        assert stream._reference[embed] is not pub._reference[embed]
        monkeypatch.setattr(requant, "ENABLED", True)
        for s in states[4:]:
            pub.publish(s)
        assert stream._reference[embed] is pub._reference[embed]
    fmt = serving_format("fp8-block128")
    with Subscriber(url, format="fp8-block128") as sub:
        kinds = [v.kind for v in sub.log()]
        assert kinds == ["anchor"] + ["delta"] * 5
        target = sub.pull(1)
        for v in range(2, len(states) + 1):
            assert sub.pull_into(target, version=v)
            assert_bits_equal(target, derive(states[v - 1], fmt), f"v{v}")


@pytest.mark.parametrize("how", ["publish", "publish_async"])
def test_a_streams_first_version_keeps_no_copy_of_its_own_of_the_tensors_it_keeps(tmp_path, how) -> None:
    """A stream's first version (no base): once committed, the tensors it keeps as they are
    are the store's reference, one copy for the publisher, never the caller's tensors, which
    a trainer updates in place; every version reads back bit-identical."""
    from deltastore import Subscriber
    from deltastore.serving.formats import derive, serving_format
    from testkit.tensors import assert_bits_equal

    states = [_model(0)]
    for i in range(1, 5):
        states.append(_changed_state(states[-1], i))
    formats = ("fp8-block128", "mxfp8")
    live = {n: t.clone() for n, t in states[0].items()}  # the trainer's tensors, updated in place
    url = str(tmp_path / "s")
    with Publisher(url, formats=("bf16", *formats), layout_policy=LayoutPolicy(chunk_bytes=32 * 1024)) as pub:
        for i, s in enumerate(states):
            for n, t in live.items():
                t.copy_(s[n])
            if how == "publish":
                pub.publish(live)
            else:
                pub.publish_async(live)
                pub.flush()
            if i == 0:
                for fmt in formats:
                    reference = pub._streams[fmt]._reference
                    for n in ("model.embed_tokens.weight", "model.norm.weight"):
                        shared = reference[n] is pub._reference[n]
                        callers = reference[n].untyped_storage().data_ptr() == live[n].untyped_storage().data_ptr()
                        assert shared and not callers, (fmt, n)
    for fmt in formats:
        with Subscriber(url, format=fmt) as sub:
            target = sub.pull(1)
            assert_bits_equal(target, derive(states[0], serving_format(fmt)), f"{fmt} v1")
            for v in range(2, len(states) + 1):
                assert sub.pull_into(target, version=v)
                assert_bits_equal(target, derive(states[v - 1], serving_format(fmt)), f"{fmt} v{v}")


@pytest.mark.parametrize("off", ["ENABLED", "NATIVE"])
def test_a_stream_derived_in_full_keeps_its_own_copy_and_reads_nothing_back(tmp_path, monkeypatch, off) -> None:
    """Without change lists (incremental derivation off, or no native kernels) the store's
    deltas cannot stand for a stream's kept tensors: the stream's first version copies them,
    and no later version reads the stream back to find a base."""
    from deltastore import Subscriber
    from deltastore.serving.formats import derive, serving_format
    from deltastore.write import requant, streams
    from testkit.tensors import assert_bits_equal

    monkeypatch.setattr(requant if off == "ENABLED" else kernels, off, False)
    resumed: list[int] = []
    resume = streams.StreamWriter._resume

    def counted_resume(self, version, derived):
        resumed.append(version)
        return resume(self, version, derived)

    monkeypatch.setattr(streams.StreamWriter, "_resume", counted_resume)
    states = [_model(0)]
    for i in range(1, 4):
        states.append(_changed_state(states[-1], i))
    url = str(tmp_path / "s")
    embed = "model.embed_tokens.weight"
    with Publisher(url, formats=("bf16", "fp8-block128"), layout_policy=LayoutPolicy(chunk_bytes=32 * 1024)) as pub:
        for i, s in enumerate(states):
            assert pub.publish(s).kind == ("anchor" if i == 0 else "delta")
            reference = pub._streams["fp8-block128"]._reference
            shared = reference[embed] is pub._reference[embed]
            callers = reference[embed].untyped_storage().data_ptr() == s[embed].untyped_storage().data_ptr()
            assert not shared and not callers, f"version {i + 1}"
    assert resumed == []
    fmt = serving_format("fp8-block128")
    with Subscriber(url, format="fp8-block128") as sub:
        assert [v.kind for v in sub.log()] == ["anchor"] + ["delta"] * (len(states) - 1)
        target = sub.pull(1)
        for v in range(2, len(states) + 1):
            assert sub.pull_into(target, version=v)
            assert_bits_equal(target, derive(states[v - 1], fmt), f"v{v}")


def test_a_streams_anchor_takes_its_kept_tensors_chunks_from_the_stores_anchor(tmp_path, monkeypatch) -> None:
    from deltastore import Subscriber
    from deltastore.serving.formats import derive, serving_format
    from deltastore.write import streams
    from testkit.tensors import assert_bits_equal

    states = [_model(0)]
    for i in range(1, 7):
        states.append(_changed_state(states[-1], i))
    layout = LayoutPolicy(chunk_bytes=32 * 1024)
    anchors = {2, 5}  # after deltas: the stream shares its kept tensors' reference with the store
    taken: list[set[str]] = []
    resumed: list[int] = []
    spy, resume = streams.anchor_sources, streams.StreamWriter._resume

    def anchor_sources(*a, **k):
        got = spy(*a, **k)
        taken.append(set(got))
        return got

    def counted_resume(self, version, derived):
        resumed.append(version)
        return resume(self, version, derived)

    monkeypatch.setattr(streams, "anchor_sources", anchor_sources)
    monkeypatch.setattr(streams.StreamWriter, "_resume", counted_resume)
    urls = {"taken": str(tmp_path / "taken"), "encoded": str(tmp_path / "encoded")}
    with Publisher(urls["taken"], formats=("bf16", "fp8-block128"), layout_policy=layout) as pub:
        for i, s in enumerate(states):
            pub.publish(s, anchor=i in anchors)
    kept = {"model.embed_tokens.weight", "model.norm.weight"}
    # every anchor, the first (no base) included; no stream version read back
    assert taken == [kept] * (1 + len(anchors)) and resumed == []
    # the same publisher encoding its anchors' kept tensors itself: the same stream, bit for bit
    monkeypatch.setattr(streams, "anchor_sources", lambda *a, **k: {})
    with Publisher(urls["encoded"], formats=("bf16", "fp8-block128"), layout_policy=layout) as pub:
        for i, s in enumerate(states):
            pub.publish(s, anchor=i in anchors)
    assert resumed  # its anchors read the stream's version before back, for a base to diff against
    got = _streams(urls["taken"], "fp8-block128", kind="anchor")
    assert got == _streams(urls["encoded"], "fp8-block128", kind="anchor") and len(got) == 1 + len(anchors)
    assert _streams(urls["taken"], "fp8-block128") == _streams(urls["encoded"], "fp8-block128")
    assert any(c[4] is not None for c in got[1])  # the anchors after deltas carry deltas too
    fmt = serving_format("fp8-block128")
    with Subscriber(urls["taken"], format="fp8-block128") as sub:
        target = sub.pull(1)
        for v in range(2, len(states) + 1):
            assert sub.pull_into(target, version=v)
            assert_bits_equal(target, derive(states[v - 1], fmt), f"v{v}")
        for v in (a + 1 for a in anchors):  # each anchor read as a snapshot too
            assert_bits_equal(sub.pull(v), derive(states[v - 1], fmt), f"anchor v{v}")


def test_an_anchors_chunks_are_handed_over_and_a_source_of_the_other_kind_is_refused(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from deltastore.format.keys import sha256_hex
    from deltastore.write.encode import encode_version

    state = _model(0)
    specs = LayoutPolicy(chunk_bytes=32 * 1024).units(state)
    name = "model.embed_tokens.weight"
    store = open_store(str(tmp_path / "s"))
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(4) as uploader:
        def encode(kind, reference, **kw):
            return encode_version(state, specs, kind=kind, reference=reference, pool=pool, uploader=uploader,
                                  store=store, threads=2, attempt="0123456789abcdef", **kw)

        anchors = {name: []}
        encoded = encode("anchor", None, anchors=anchors)
        chunks = sorted(anchors[name], key=lambda c: c.index)
        entry = next(e for e in encoded.entries if e.name == name)
        assert [c.index for c in chunks] == [c.index for c in entry.chunks] and len(chunks) > 1
        for c, e in zip(chunks, entry.chunks):
            assert c.delta is None and c.digest == e.digest and c.full_sha256 == e.full.sha256
            assert sha256_hex(c.full.data) == c.full_sha256
        by_index = {c.index: c for c in chunks}
        reference = {n: t.clone() for n, t in state.items()}
        with pytest.raises(ValueError, match="an anchor's chunk, in a delta version"):
            encode("delta", reference, sources={name: lambda i, a, b, old: by_index[i]})
        with pytest.raises(ValueError, match="a delta's chunk, in an anchor"):
            encode("anchor", None, sources={name: lambda i, a, b, old: (by_index[i].full, by_index[i].digest, None)})
        with pytest.raises(ValueError, match="a delta segment, in an anchor without a reference"):
            encode("anchor", None, sources={name: lambda i, a, b, old: replace(by_index[i], delta=by_index[i].full)})
