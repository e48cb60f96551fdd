"""Round-trip properties of deltastore.codec: full, delta, compose, inverse; bit-exact for every
width and every codec id."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import codec
from deltastore.codec.apply import apply_delta
from deltastore.codec.compose import compose_deltas
from deltastore.codec.container import (
    CODEC_ADD_DENSE,
    CODEC_ADD_SPARSE,
    CODEC_FULL2,
    KNOWN_CODECS,
    Segment,
    peek_header,
)
from deltastore.codec.delta import encode_delta
from deltastore.codec.full import decode_full, encode_full

WIDTHS = (1, 2, 4, 8)
SIZES = (0, 1, 2, 7, 100, 1000, 5000)
EDITS = ("none", "one", "few", "pct1", "half", "all", "dense-random", "ulp")

FULL_ENCODERS = {
    "plain": lambda x, **kw: encode_full(x, **kw),
    "float": lambda x, **kw: encode_full(x, float_bits=True, **kw),
}

PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# bf16 bit patterns that a lossy or float-typed path would break
BF16_SPECIALS = np.array(
    [
        0x0000, 0x8000,  # +0.0, -0.0
        0x7F80, 0xFF80,  # +inf, -inf
        0x7FC0, 0xFFC0, 0x7FC1, 0x7FFF, 0xFFFF, 0x7F81, 0xFF81,  # quiet and signalling NaNs, payloads
        0x0001, 0x007F, 0x8001, 0x807F, 0x0040,  # subnormals
        0x0080, 0x7F7F, 0xFF7F,  # smallest normal, largest finite
    ],
    dtype=np.uint16,
)


def random_values(rng: np.random.Generator, width: int, n: int) -> np.ndarray:
    return rng.integers(0, 2 ** (8 * width) - 1, size=n, dtype=np.dtype(f"u{width}"), endpoint=True)


def bf16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """bf16 weights (~N(0, 0.02)) as uint16 bits, with special values sprinkled in."""
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    x = (torch.randn(n, generator=g) * 0.02).bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    if n:
        k = min(n, len(BF16_SPECIALS))
        x[rng.choice(n, size=k, replace=False)] = BF16_SPECIALS[:k]
    return x


def edit(rng: np.random.Generator, old: np.ndarray, kind: str) -> np.ndarray:
    """A new version of ``old`` with the edit pattern ``kind`` (every change is a real change)."""
    new = old.copy()
    n = old.size
    if n == 0 or kind == "none":
        return new
    if kind == "dense-random":
        return random_values(rng, old.itemsize, n)
    if kind == "ulp":  # the realistic case: +-1 in the last place, a few percent of elements
        idx = np.flatnonzero(rng.random(n) < 0.03)
        step = rng.choice(np.array([1, 2 ** (8 * old.itemsize) - 1], dtype=np.uint64), size=idx.size)
        new[idx] = (old[idx].astype(np.uint64) + step).astype(old.dtype)  # wraps mod 2**bits
        return new
    count = {"one": 1, "few": min(n, 5), "pct1": max(1, n // 100), "half": n // 2, "all": n}[kind]
    idx = rng.choice(n, size=count, replace=False)
    mask = random_values(rng, old.itemsize, count)
    mask[mask == 0] = 1
    new[idx] ^= mask
    return new


def check_delta(old: np.ndarray, new: np.ndarray) -> Segment | None:
    seg = encode_delta(old, new)
    identical = bool(np.array_equal(old, new))
    assert (seg is None) == identical
    if seg is None:
        return None
    assert seg.codec in (CODEC_ADD_SPARSE, CODEC_ADD_DENSE)
    assert seg.n_changed == int(np.count_nonzero(old != new))
    h = peek_header(seg.data)
    assert (h.codec, h.width, h.count, h.n_changed, h.total_size) == (
        seg.codec, old.itemsize, old.size, seg.n_changed, len(seg.data))
    target = old.copy()
    apply_delta(target, seg.data, codec=seg.codec)
    assert target.dtype == new.dtype
    assert np.array_equal(target, new)
    apply_delta(target, seg.data, codec=seg.codec, inverse=True)  # undo
    assert np.array_equal(target, old)
    return seg


@PROPS
@given(width=st.sampled_from(WIDTHS), size=st.sampled_from(SIZES), kind=st.sampled_from(EDITS),
       seed=st.integers(0, 2**32 - 1))
def test_delta_roundtrip(width, size, kind, seed):
    rng = np.random.default_rng(seed)
    old = random_values(rng, width, size)
    check_delta(old, edit(rng, old, kind))


@PROPS
@given(size=st.sampled_from(SIZES), kind=st.sampled_from(EDITS), seed=st.integers(0, 2**32 - 1))
def test_delta_roundtrip_bf16_bits(size, kind, seed):
    rng = np.random.default_rng(seed)
    old = bf16_bits(rng, size)
    check_delta(old, edit(rng, old, kind))


@PROPS
@given(width=st.sampled_from(WIDTHS), size=st.sampled_from(SIZES), seed=st.integers(0, 2**32 - 1),
       const=st.booleans(), enc=st.sampled_from(sorted(FULL_ENCODERS)))
def test_full_roundtrip(width, size, seed, const, enc):
    rng = np.random.default_rng(seed)
    x = random_values(rng, width, size)
    if const:  # every plane constant: CONST sections
        x[:] = x[0] if size else 0
    seg = FULL_ENCODERS[enc](x)
    assert seg.codec == CODEC_FULL2 and seg.n_changed == size
    y = decode_full(seg.data, codec=CODEC_FULL2, dtype=x.dtype, count=size)
    assert y.dtype == x.dtype and y.flags.writeable and y.flags.c_contiguous
    assert np.array_equal(x, y)


@PROPS
@given(size=st.sampled_from(SIZES), seed=st.integers(0, 2**32 - 1), enc=st.sampled_from(sorted(FULL_ENCODERS)))
def test_full_roundtrip_bf16_bits(size, seed, enc):
    x = bf16_bits(np.random.default_rng(seed), size)
    seg = FULL_ENCODERS[enc](x)
    assert np.array_equal(decode_full(seg.data, codec=seg.codec, dtype=np.uint16, count=size), x)


def test_float_rotation_puts_the_exponent_in_one_plane():
    """full/2 with float_bits: bf16 weights shrink well below the unrotated planes (the exponent
    byte compresses to ~its entropy) and the segment records the transform."""
    x = bf16_bits(np.random.default_rng(5), 200_000)
    rot, plain = encode_full(x, float_bits=True), encode_full(x)
    assert peek_header(rot.data).transform == 2 and peek_header(plain.data).transform == 0
    assert len(rot.data) < len(plain.data)


@PROPS
@given(width=st.sampled_from(WIDTHS), size=st.sampled_from(SIZES[1:]),
       kind_a=st.sampled_from(EDITS[1:]), kind_b=st.sampled_from(EDITS[1:] + ("undo", "undo-part")),
       seed=st.integers(0, 2**32 - 1))
def test_compose_equals_sequential_apply(width, size, kind_a, kind_b, seed):
    rng = np.random.default_rng(seed)
    x0 = random_values(rng, width, size)
    x1 = edit(rng, x0, kind_a)
    if kind_b == "undo":
        x2 = x0.copy()
    elif kind_b == "undo-part":  # b reverts some of a's changes and makes others
        x2 = edit(rng, x1, "few")
        back = rng.random(size) < 0.5
        x2[back] = x0[back]
    else:
        x2 = edit(rng, x1, kind_b)
    a, b = encode_delta(x0, x1), encode_delta(x1, x2)
    if a is None or b is None:
        return  # nothing to compose
    c = compose_deltas(a.data, b.data, codec_a=a.codec, codec_b=b.codec, dtype=x0.dtype, count=size)
    if np.array_equal(x0, x2):
        assert c is None
        return
    assert c is not None and c.n_changed == int(np.count_nonzero(x0 != x2))
    t = x0.copy()
    apply_delta(t, c.data, codec=c.codec)
    assert np.array_equal(t, x2)


@pytest.mark.parametrize("lr", [1e-6, 3e-6, 1e-5])
def test_realistic_bf16_step_is_sparse_and_small(lr):
    """An Adam-like step on fp32 master weights, exported to bf16: few elements change and the
    sparse segment must cost far less than TRL's 6 bytes per changed element."""
    g = torch.Generator().manual_seed(0)
    master = torch.randn(256 * 1024, generator=g) * 0.02
    before = master.bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    master += lr * torch.sign(torch.randn(master.shape, generator=g))
    after = master.bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    seg = check_delta(before, after)
    assert seg is not None and seg.codec == CODEC_ADD_SPARSE
    assert len(seg.data) < 3 * seg.n_changed


def test_codec_choice_follows_density():
    rng = np.random.default_rng(1)
    old = bf16_bits(rng, 10_000)
    one = old.copy()
    one[1234] ^= 1
    assert check_delta(old, one).codec == CODEC_ADD_SPARSE
    # every element changed: the gap planes are pure overhead, so dense must win
    assert check_delta(old, old + np.uint16(1)).codec == CODEC_ADD_DENSE


def test_full_uses_byte_planes_on_bf16():
    """Byte planes beat zstd on the interleaved bytes of bf16 weights."""
    import zstandard

    x = bf16_bits(np.random.default_rng(2), 200_000)
    plain = len(zstandard.ZstdCompressor(level=3).compress(x.tobytes()))
    assert len(encode_full(x).data) < plain


def test_constant_planes_are_stored_as_one_byte():
    x = np.full(100_000, 0x3F80, dtype=np.uint16)
    seg = encode_full(x)
    h = peek_header(seg.data)
    assert [s.kind for s in h.sections] == ["const", "const"]
    assert len(seg.data) == h.header_size + 2


@settings(deadline=None)
@given(size=st.sampled_from([0, 1, 2, 31, 32, 33, 600, 4095, 4096, 4097, 9000]),
       shape=st.sampled_from(["const", "ends equal", "one differs", "few values", "uniform"]),
       seed=st.integers(0, 2**32 - 1))
def test_a_plane_is_stored_as_the_smallest_of_const_zstd_raw(size, shape, seed):
    """Every plane, small (looked at as bytes) or not (numpy reductions), gets the section the
    rule names: CONST when all bytes are equal, else ZSTD when at least MIN_ZSTD_INPUT bytes
    compress smaller, else RAW; the small-plane path and the path for planes held as bytes (the
    native delta encoder's) choose the same."""
    from deltastore.codec import planes
    from deltastore.codec.container import KIND_CONST, KIND_RAW, KIND_ZSTD

    rng = np.random.default_rng(seed)
    v = int(rng.integers(0, 256))
    plane = np.full(size, v, dtype=np.uint8)
    if shape == "ends equal" and size > 2:
        plane[rng.integers(1, size - 1)] ^= 1  # first == last: only a full look says not CONST
    elif shape == "one differs" and size:
        plane[rng.integers(0, size)] ^= 0x80
    elif shape == "few values":
        plane = rng.choice(np.array([v, 0, 7], dtype=np.uint8), size=size, p=[0.9, 0.05, 0.05])
    elif shape == "uniform":
        plane = rng.integers(0, 256, size=size, dtype=np.uint8)
    cctx = planes._cctx(None)
    kind, stored, raw = planes._encode_section(plane, cctx)
    if size and (plane == plane[0]).all():
        want = (KIND_CONST, bytes(plane[:1]))
    elif size >= planes.MIN_ZSTD_INPUT and len(z := cctx.compress(plane)) < size:
        want = (KIND_ZSTD, z)
    else:
        want = (KIND_RAW, plane.tobytes())
    assert (kind, bytes(stored), raw) == (*want, size)
    [(kind, stored, raw)] = planes.encode_byte_sections([plane.tobytes()], None)
    assert (kind, bytes(stored), raw) == (*want, size)


@pytest.mark.parametrize("backend", ["multi_compress_to_buffer", "one compress each"])
def test_planes_of_several_segments_encoded_together_are_the_same_sections(backend, monkeypatch):
    """encode_byte_sections_many gives every plane the section encode_byte_sections gives it,
    with python-zstandard's batch call and without it (its cffi backend has none)."""
    from deltastore.codec import planes

    rng = np.random.default_rng(7)
    segs = [[rng.choice(np.array([1, 2, 9], dtype=np.uint8), size=n).tobytes() for n in sizes]
            for sizes in ([0, 5, 40, 3000], [31, 32, 33], [], [70000, 1])]
    segs[1].append(bytes(500))  # CONST
    segs[3].append(rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())  # RAW: zstd cannot gain
    if backend != "multi_compress_to_buffer":
        class Single:
            def __init__(self, cctx):
                self.compress = cctx.compress
        cctx = planes._cctx(None)
        monkeypatch.setattr(planes, "_cctx", lambda level: Single(cctx))
    got = planes.encode_byte_sections_many(segs, None)
    monkeypatch.undo()
    assert got == [planes.encode_byte_sections(ps, None) for ps in segs]


def test_segments_of_several_chunks_encoded_together_are_each_chunks_own():
    """add_segments_from_planes is add_segment_from_planes chunk by chunk: sparse and dense
    chunks, escaped gaps and values, widths 1 and 2."""
    from deltastore._util import kernels
    from deltastore.codec.delta import add_segment_from_planes, add_segments_from_planes

    if kernels.encode_add is None:
        pytest.skip("needs the native kernels")
    rng = np.random.default_rng(3)
    chunks = []
    for width, n, frac in ((2, 5000, 0.01), (1, 3000, 0.6), (2, 70000, 0.001), (1, 800, 0.05)):
        dt = np.uint16 if width == 2 else np.uint8
        old = rng.integers(0, 1 << (8 * width), n, dtype=dt)
        new = old.copy()
        at = rng.random(n) < frac
        new[at] += rng.integers(1, 300, at.sum()).astype(dt)
        k, syms, rest, max_rest, codes, esc, _ = kernels.encode_add(old.copy(), new, width, False, 0)
        chunks.append((n, width, k, syms, rest, max_rest, codes, esc))
    together = add_segments_from_planes(chunks)
    alone = [add_segment_from_planes(*c) for c in chunks]
    assert [(s.codec, s.data, s.n_changed) for s in together] == [(s.codec, s.data, s.n_changed) for s in alone]


def test_non_native_byte_order_is_accepted():
    x = np.arange(1000, dtype=">u2")
    y = x.copy()
    y[[5, 500]] += 3
    seg = encode_delta(x, y)
    t = x.copy()
    apply_delta(t, seg.data, codec=seg.codec)
    assert np.array_equal(t, y)
    f = encode_full(x)
    assert f.data == encode_full(x.astype("<u2")).data  # the format is little-endian, always
    assert np.array_equal(decode_full(f.data, codec=f.codec, dtype=">u2", count=1000), x)
    seg = check_delta(x.astype("<u2"), y.astype("<u2"))
    t = x.copy()
    apply_delta(t, seg.data, codec=seg.codec)
    assert np.array_equal(t, y)
    apply_delta(t, seg.data, codec=seg.codec, inverse=True)
    assert np.array_equal(t, x)


def test_input_validation():
    with pytest.raises(TypeError):
        encode_full(np.zeros(4, dtype=np.int16))
    with pytest.raises(TypeError):
        encode_full([1, 2, 3])
    with pytest.raises(ValueError):
        encode_full(np.zeros((2, 2), dtype=np.uint8))
    with pytest.raises(ValueError):
        encode_full(np.zeros(8, dtype=np.uint16)[::2])
    with pytest.raises(ValueError):
        encode_delta(np.zeros(4, np.uint16), np.zeros(5, np.uint16))
    with pytest.raises(ValueError):
        encode_delta(np.zeros(4, np.uint16), np.zeros(4, np.uint32))
    seg = encode_delta(np.zeros(4, np.uint8), np.ones(4, np.uint8))
    ro = np.zeros(4, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        apply_delta(ro, seg.data, codec=seg.codec)


def test_known_codecs():
    assert KNOWN_CODECS == {CODEC_FULL2, CODEC_ADD_SPARSE, CODEC_ADD_DENSE}


def test_escapes_round_trip():
    """Large differences and long gaps take the escape sections; both are exercised."""
    old = np.zeros(100_000, np.uint16)
    new = old.copy()
    new[[0, 1, 300, 70_000, 99_999]] = [1, 0x8000, 0xFFFF, 200, 7]
    seg = check_delta(old, new)
    h = peek_header(seg.data)
    assert h.n_escaped >= 2 and h.n_gap_escaped == 3


@pytest.mark.parametrize("level", [None, 1, 3, -5])
def test_every_level_decodes(level):
    rng = np.random.default_rng(3)
    old = bf16_bits(rng, 20_000)
    new = edit(rng, old, "ulp")
    seg = encode_delta(old, new, level=level)
    t = old.copy()
    apply_delta(t, seg.data, codec=seg.codec)
    assert np.array_equal(t, new)
    f = encode_full(old, level=level)
    assert np.array_equal(decode_full(f.data, codec=f.codec, dtype=np.uint16, count=old.size), old)


def test_segment_bytes_may_be_any_buffer():
    """Pullers slice segments out of a larger pack: memoryview and bytearray work like bytes."""
    rng = np.random.default_rng(4)
    old = bf16_bits(rng, 5000)
    new = edit(rng, old, "ulp")
    seg, full = encode_delta(old, new), encode_full(new)
    pack = b"xx" + seg.data + full.data + b"yy"
    view = memoryview(pack)[2 : 2 + len(seg.data)]
    t = old.copy()
    apply_delta(t, view, codec=seg.codec)
    assert np.array_equal(t, new)
    fview = memoryview(pack)[2 + len(seg.data) : -2]
    assert np.array_equal(decode_full(fview, codec=full.codec, dtype=np.uint16, count=5000), new)
    assert np.array_equal(decode_full(bytearray(full.data), codec=full.codec, dtype=np.uint16, count=5000), new)
    assert peek_header(view) == peek_header(seg.data)


@PROPS
@given(width=st.sampled_from(WIDTHS), size=st.sampled_from(SIZES), kind=st.sampled_from(EDITS),
       seed=st.integers(0, 2**32 - 1))
def test_decode_delta_returns_typed_changes(width, size, kind, seed):
    """decode_delta gives the change set itself: SparseDelta(positions of the changed elements,
    their difference) or DenseDelta(every element's difference)."""
    rng = np.random.default_rng(seed)
    old = random_values(rng, width, size)
    new = edit(rng, old, kind)
    seg = encode_delta(old, new)
    if seg is None:
        return
    d = codec.decode_delta(seg.data, codec=seg.codec, dtype=old.dtype, count=size)
    values = new - old
    if seg.codec == CODEC_ADD_SPARSE:
        assert isinstance(d, codec.SparseDelta)
        assert d.positions.dtype == np.int64
        assert np.array_equal(d.positions, np.flatnonzero(old != new))
        assert np.array_equal(d.values, values[d.positions])
    else:
        assert isinstance(d, codec.DenseDelta)
        assert np.array_equal(d.values, values)
