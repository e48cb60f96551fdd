"""The anchor encoder's judged planes (design 006, "Anchor encode"): big planes are judged from a
sample (byte_histogram kernel or numpy's bincount) before zstd, and big float chunks write the
paired exponent form without compressing the plain one too. The kernels and the numpy path
must write identical bytes, a sample must never make a plane CONST that is not, and each
shortcut must pick what the exact comparison would have picked on the data it is meant for.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore._util import kernels
from deltastore.codec import full as full_mod
from deltastore.codec import planes as planes_mod
from deltastore.codec.container import TRANSFORM_PAIRS, TRANSFORM_ROTL1, peek_header
from deltastore.codec.full import PAIRS_ONLY_COUNT, decode_full, encode_full
from deltastore.codec.planes import MIN_JUDGED_PLANE, SAMPLE_STRIDE, ZSTD_PLANE_PARAMS

native = pytest.mark.skipif(not kernels.NATIVE, reason="native extension not built")

KERNELS = ("encode_add", "xxh3_128_hex", "split_planes", "pair_codes", "byte_histogram")


def numpy_path(fn, *args, **kw):
    """Call ``fn`` with every kernel switched off (the loader's None)."""
    with pytest.MonkeyPatch.context() as m:
        for name in KERNELS:
            m.setattr(kernels, name, None)
        return fn(*args, **kw)


def bf16_weights(n: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """bf16 bit patterns of Gaussian weights (truncated from fp32)."""
    f = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def kinds(seg) -> list[str]:
    return [s.kind for s in peek_header(seg.data).sections]


def roundtrip(seg, v: np.ndarray) -> None:
    out = decode_full(seg.data, codec=seg.codec, dtype=v.dtype, count=v.size)
    assert np.array_equal(out, v)


# --- the histogram kernel ----------------------------------------------------------------------


@native
@given(data=st.binary(max_size=3000), stride=st.integers(1, 80))
@settings(deadline=None)
def test_byte_histogram_kernel_matches_bincount(data, stride):
    a = np.frombuffer(data, dtype=np.uint8)
    out = np.full(256, -1, dtype=np.int64)
    kernels.byte_histogram(a, stride, out)
    assert np.array_equal(out, np.bincount(a[::stride], minlength=256))


@native
def test_byte_histogram_kernel_rejects_bad_arguments():
    a = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="stride"):
        kernels.byte_histogram(a, 0, np.empty(256, np.int64))
    with pytest.raises(ValueError, match="256"):
        kernels.byte_histogram(a, 1, np.empty(255, np.int64))
    with pytest.raises(ValueError, match="writable"):
        ro = np.empty(256, np.int64)
        ro.flags.writeable = False
        kernels.byte_histogram(a, 1, ro)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.byte_histogram(np.arange(200, dtype=np.uint8)[::2], 1, np.empty(256, np.int64))


# --- identical bytes on judged (big) chunks ------------------------------------------------------


def _big_cases():
    n = PAIRS_ONLY_COUNT + 5  # odd: the paired form's padding code
    rng = np.random.default_rng(7)
    yield "bf16-weights", bf16_weights(n, 1), True
    yield "bf16-weights-plain-bits", bf16_weights(n, 2), False
    yield "random-u16-as-floats", rng.integers(0, 1 << 16, n, dtype=np.uint16), True  # escapes
    yield "fp32-weights", (rng.standard_normal(n // 2) * 0.02).astype(np.float32).view(np.uint32), True
    yield "fp64-weights", (rng.standard_normal(n // 4) * 0.02).view(np.uint64), True
    yield "u8-random", rng.integers(0, 256, 2 * n, dtype=np.uint8), False
    const = np.full(n, 0x3F80, dtype=np.uint16)
    yield "bf16-constant", const, True
    # constant on every sampled position, different elsewhere: the sample must not decide CONST
    trap = const.copy()
    trap[1::SAMPLE_STRIDE] = 0x3F81
    yield "bf16-constant-on-the-sample", trap, True
    yield "u16-constant-on-the-sample", trap.copy(), False
    tiny = bf16_weights(n, 3)
    tiny[: n // 2] = 0  # half zeros: a skewed low plane, zstd must still be tried
    yield "bf16-half-zero", tiny, True


BIG = list(_big_cases())


@native
@pytest.mark.parametrize("name, v, float_bits", BIG, ids=[c[0] for c in BIG])
@pytest.mark.parametrize("level", [None, 3])
def test_judged_chunks_same_bytes_as_numpy(name, v, float_bits, level):
    want = numpy_path(encode_full, v, float_bits=float_bits, level=level)
    got = encode_full(v, float_bits=float_bits, level=level)
    assert (got.codec, got.n_changed, bytes(got.data)) == (want.codec, want.n_changed, bytes(want.data))
    roundtrip(got, v)


@pytest.mark.parametrize("name, v, float_bits", BIG, ids=[c[0] for c in BIG])
def test_judged_chunks_roundtrip(name, v, float_bits):
    """Runs on whichever path is loaded (also under DELTASTORE_NATIVE=0)."""
    roundtrip(encode_full(v, float_bits=float_bits), v)


# --- what the shortcuts decide ------------------------------------------------------------------


def test_sampled_not_constant_plane_is_not_const():
    v = {c[0]: c[1] for c in BIG}["bf16-constant-on-the-sample"]
    seg = encode_full(v, float_bits=True)
    assert "const" not in kinds(seg)[:1]  # the low plane differs off the sample
    roundtrip(seg, v)
    even = np.full(PAIRS_ONLY_COUNT, 0x3F80, np.uint16)  # even: no padding code in the pairs
    assert kinds(encode_full(even, float_bits=True)) == ["const", "const"]


def test_near_uniform_big_plane_is_raw_and_zstd_would_not_have_gained():
    v = bf16_weights(PAIRS_ONLY_COUNT, 11)
    seg = encode_full(v, float_bits=True)
    h = peek_header(seg.data)
    assert h.transform == TRANSFORM_PAIRS
    assert h.sections[0].kind == "raw"  # mantissa + sign plane, judged incompressible
    low = full_mod._planes(v, rotate=True)[0]
    z = zstandard.ZstdCompressor(compression_params=ZSTD_PLANE_PARAMS).compress(low)
    assert len(z) >= low.size  # the exact path would have stored it RAW too


def test_skewed_big_plane_is_still_compressed():
    rng = np.random.default_rng(5)
    low = np.minimum(rng.geometric(0.05, MIN_JUDGED_PLANE), 255).astype(np.uint8)
    secs = planes_mod.SectionEncoder(None, judge=True)([low])
    assert secs[0][0] == planes_mod.KIND_ZSTD and len(secs[0][1]) < 0.9 * low.size


def test_judged_sections_equal_exact_ones_where_zstd_cannot_gain():
    """On planes the shortcut stores RAW, the exact encoder also stores RAW (same bytes)."""
    rng = np.random.default_rng(9)
    for p in (rng.integers(0, 256, MIN_JUDGED_PLANE, dtype=np.uint8),
              full_mod._planes(bf16_weights(MIN_JUDGED_PLANE, 4), rotate=True)[0]):
        judged = planes_mod.SectionEncoder(None, judge=True)([p])
        exact = planes_mod.SectionEncoder(None)([p])
        assert [(k, bytes(s), r) for k, s, r in judged] == [(k, bytes(s), r) for k, s, r in exact]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [0.02, 1.0, 1e-4])
def test_pairs_only_picks_the_smaller_form_on_weights(seed, scale):
    """Above PAIRS_ONLY_COUNT the plain form is not tried; on weight-like values it is indeed
    the larger one."""
    v = bf16_weights(PAIRS_ONLY_COUNT, seed, scale)
    seg = encode_full(v, float_bits=True)
    assert peek_header(seg.data).transform == TRANSFORM_PAIRS
    top = full_mod._planes(v, rotate=True)[-1]
    plain = planes_mod.SectionEncoder(None)([top])[0][1]
    _, packed, esc, _ = full_mod._pair_exponents(top)
    paired = sum(len(s) for _, s, _ in planes_mod.SectionEncoder(None)([packed, esc] if esc.size else [packed]))
    assert paired < len(plain)
    roundtrip(seg, v)


def test_many_escapes_fall_back_to_the_exact_comparison():
    """Random bits passed as floats escape the window often: the plain form is tried, and it
    wins."""
    v = np.random.default_rng(3).integers(0, 1 << 16, PAIRS_ONLY_COUNT, dtype=np.uint16)
    _, _, _, share = full_mod._pair_exponents(full_mod._planes(v, rotate=True)[-1])
    assert share > full_mod.PAIRS_ONLY_MAX_ESCAPED
    seg = encode_full(v, float_bits=True)
    assert peek_header(seg.data).transform == TRANSFORM_ROTL1
    roundtrip(seg, v)


def test_byte_counts_equals_bincount_on_any_array():
    """Strided or wider arrays take numpy's bincount (the kernel reads contiguous bytes only)."""
    a = np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)
    for plane in (a, a[::3], a.astype(np.uint16)):
        for stride in (1, 16, 64):
            want = np.bincount(plane[::stride], minlength=256)
            assert np.array_equal(planes_mod.byte_counts(plane, stride), want)
