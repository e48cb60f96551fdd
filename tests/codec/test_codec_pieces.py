"""Segments decoded a piece at a time (SPEC §7 step 8): a reader's memory does not grow with a chunk.

``decode_full_into`` builds a full segment in the caller's array: the native kernel a step at a
time from each section's next piece (large zstd sections streamed), the numpy path whole up to
``full.WHOLE_MAX_BYTES`` and in pieces beyond. A delta segment above ``apply.WHOLE_MAX_BYTES``
is read through once to check it, then again to apply it, a piece at a time. Every way must
give the same bits, digests and change records as the whole decoders, refuse the same segments
with the same words, and never write a delta's target before the whole segment passed.

The thresholds are lowered here (monkeypatch) so that small segments take every path, with
pieces of a few elements to cross section and nibble boundaries often.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import codec
from deltastore._util import kernels
from deltastore.codec import apply, delta, full, planes
from deltastore.codec.container import CODEC_FULL2, KIND_RAW, KIND_ZSTD, TRANSFORM_PAIRS, pack, peek_header
from deltastore.errors import CorruptObjectError

native = pytest.mark.skipif(kernels.decode_full is None or kernels.zstd_decompress is None,
                            reason="native decoder or libzstd not loaded")

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FULL_MODES = ("native", "native-streamed", "numpy-whole", "numpy-pieces")
DELTA_MODES = ("native", "numpy", "native-pieces", "numpy-pieces")


def weights(n: int, width: int, seed: int) -> np.ndarray:
    """Float-like bits: a skewed exponent, random mantissa, a few exponents out of the window."""
    rng = np.random.default_rng(seed)
    dt = UINT[width]
    if width == 1:
        return rng.integers(0, 256, n).astype(dt)
    bits = 8 * width
    e = (120 + rng.choice(3, size=n, p=[0.85, 0.1, 0.05])).astype(np.uint64)
    x = ((rng.integers(0, 2, n).astype(np.uint64) << np.uint64(bits - 1)) | (e << np.uint64(bits - 9))
         | rng.integers(0, 1 << min(bits - 9, 62), n, dtype=np.uint64))
    x = x.astype(dt)
    x[: min(3, n)] = np.array([0, 0x7F << (bits - 8), 1], dtype=dt)[: min(3, n)]  # out of the window
    return x


def full_mode(mode: str, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    if mode == "native-streamed":  # every zstd section streamed, steps of 14 elements
        monkeypatch.setattr(planes, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(full, "KERNEL_PIECE_BYTES", 14 * width)
    elif mode.startswith("numpy"):
        monkeypatch.setattr(kernels, "decode_full", None)
        if mode == "numpy-pieces":
            monkeypatch.setattr(full, "WHOLE_MAX_BYTES", 0)
            monkeypatch.setattr(full, "PIECE_BYTES", 10 * width)
            monkeypatch.setattr(planes, "STREAM_MIN_BYTES", 0)


def decode_in(mode: str, data: bytes, cid: str, dtype, n: int) -> tuple[str, object]:
    with pytest.MonkeyPatch.context() as m:
        full_mode(mode, m, np.dtype(dtype).itemsize)
        out = np.zeros(n, dtype)
        try:
            d = codec.decode_full_into(data, out, codec=cid, digest=True)
        except CorruptObjectError as e:
            return "refused", str(e)
        return d, out.tobytes()


@native
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 29, 4096, 5001])
@pytest.mark.parametrize("form", ["full/2", "full/2-float", "const"])
def test_every_way_decodes_the_same_bits(width: int, n: int, form: str) -> None:
    x = weights(n, width, seed=n * width)
    if form == "const":
        x = np.full(n, 7, UINT[width])
    seg = codec.encode_full(x, float_bits=form != "full/2")
    want = xxhash.xxh3_128_hexdigest(x.tobytes())
    for mode in FULL_MODES:
        assert decode_in(mode, seg.data, seg.codec, x.dtype, n) == (want, x.tobytes()), mode
    assert np.array_equal(codec.decode_full(seg.data, codec=seg.codec, dtype=x.dtype, count=n), x)


@given(n=st.integers(1, 3000), width=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16),
       piece=st.integers(1, 40))
@settings(deadline=None)
def test_numpy_pieces_of_any_size_give_the_bits(n: int, width: int, seed: int, piece: int) -> None:
    x = weights(n, width, seed)
    seg = codec.encode_full(x, float_bits=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "decode_full", None)
        m.setattr(full, "WHOLE_MAX_BYTES", 0)
        m.setattr(full, "PIECE_BYTES", 2 * piece * width)
        m.setattr(planes, "STREAM_MIN_BYTES", 0)
        out = np.empty_like(x)
        assert codec.decode_full_into(seg.data, out, codec=seg.codec, digest=True) == xxhash.xxh3_128_hexdigest(x.tobytes())
    assert np.array_equal(out, x)


def paired_segment(x: np.ndarray, *, zstd: bool, tweak=None, pad: int = 0) -> bytes:
    """A full/2 transform-2 segment of ``x`` (bf16 bits) built from its planes, so that a test
    can change a code or an escape (``tweak(codes, esc)``) or the padding code (``pad``, an odd
    count) and keep the segment well formed."""
    rot = (x << np.uint16(1)) | (x >> np.uint16(15))
    low_plane, top = (rot & np.uint16(255)).astype(np.uint8), (rot >> np.uint16(8)).astype(np.uint8)
    lo = 120
    codes = top - np.uint8(lo)
    out = codes >= 15
    esc = top[out].copy()
    codes[out] = 15
    if tweak is not None:
        codes, esc = tweak(codes, esc)
    packed = planes.pack_nibbles(codes)
    packed[-1] |= np.uint8(pad << 4)
    sections = [low_plane.tobytes(), packed.tobytes()] + ([esc.tobytes()] if esc.size else [])
    c = zstandard.ZstdCompressor(compression_params=planes.ZSTD_PLANE_PARAMS)
    return pack(CODEC_FULL2, width=2, count=x.size, n_changed=x.size, param=TRANSFORM_PAIRS, aux=lo,
                n_escaped=int(esc.size),
                sections=[(KIND_ZSTD, c.compress(s), len(s)) if zstd else (KIND_RAW, s, len(s)) for s in sections])


def _extra_escape_code(codes, esc):
    codes = codes.copy()
    codes[np.flatnonzero(codes != 15)[-1]] = 15  # one code 15 more than escapes stored
    return codes, esc


def _escape_inside_window(codes, esc):
    esc = esc.copy()
    esc[-1] = 121  # an exponent the window codes
    return codes, esc


@native
@pytest.mark.parametrize("zstd", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("tweak,pad,match", [
    (_extra_escape_code, 0, "declares 3 escaped exponents, its codes hold 4"),
    (_escape_inside_window, 0, "escapes an exponent inside its window"),
    (None, 3, "padding code is not 0"),  # 5001 codes: the last byte's high nibble pads
])
def test_every_way_refuses_a_bad_paired_exponent_plane_in_the_same_words(zstd: bool, tweak, pad: int, match: str) -> None:
    x = weights(5001, 2, seed=7)
    data = paired_segment(x, zstd=zstd, tweak=tweak, pad=pad)
    assert decode_in("native", paired_segment(x, zstd=zstd), CODEC_FULL2, np.uint16, x.size)[1] == x.tobytes()
    got = {mode: decode_in(mode, data, CODEC_FULL2, np.uint16, x.size) for mode in FULL_MODES}
    assert all(g[0] == "refused" and match in g[1] for g in got.values()), got


def frame_with_window(plane: bytes, window_log: int) -> bytes:
    """A frame that declares a window of 2**window_log bytes (no content size: a streaming
    compressor does not know the size, so it keeps the window)."""
    z = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(window_log=window_log)).compressobj()
    frame = z.compress(plane) + z.flush()
    assert zstandard.get_frame_parameters(frame).window_size == 1 << window_log
    return frame


@native
def test_a_streamed_section_with_a_wide_window_is_refused_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame that declares a window above 2**MAX_WINDOW_LOG is decoded whole when its section is
    small (as before), and refused before decoding when it would be streamed."""
    x = np.arange(3000, dtype=np.uint8)
    wide = frame_with_window(x.tobytes(), planes.MAX_WINDOW_LOG + 1)
    data = pack("full/2", width=1, count=x.size, n_changed=x.size, sections=[(KIND_ZSTD, wide, x.size)])
    for mode in ("native", "numpy-whole"):
        assert decode_in(mode, data, "full/2", np.uint8, x.size)[1] == x.tobytes()
    for mode in ("native-streamed", "numpy-pieces"):
        got = decode_in(mode, data, "full/2", np.uint8, x.size)
        assert got[0] == "refused" and f"window, more than the {1 << planes.MAX_WINDOW_LOG} bytes" in got[1], (mode, got)


def test_a_delta_section_with_a_wide_window_is_refused_when_streamed() -> None:
    codes = bytes([0x11]) * 1500  # 3000 differences of -1
    frame = frame_with_window(codes, planes.MAX_WINDOW_LOG + 1)
    seg = codec.Segment("add-dense/1", pack("add-dense/1", width=1, count=3000, n_changed=3000,
                                            sections=[(KIND_ZSTD, frame, len(codes))]), 3000)
    base = np.full(3000, 5, np.uint8)
    for mode in DELTA_MODES:
        if mode.startswith("native") and kernels.apply_segment is None:
            continue
        got = outcomes(seg, base, mode)
        if mode.endswith("pieces"):
            assert got[0][0] == "refused" and "window, more than the" in got[0][1], (mode, got)
        else:
            assert got[0][1] == np.full(3000, 4, np.uint8).tobytes(), mode


@native
@pytest.mark.parametrize("damage,match", [
    (lambda f: f + b"\x00", "bytes after the frame"),
    (lambda f: f[:-3], "Src size is incorrect"),
])
def test_a_streamed_frame_is_checked_as_a_whole_one(damage, match: str) -> None:
    x = weights(5000, 1, seed=3)
    frame = damage(zstandard.ZstdCompressor().compress(x.tobytes()))
    data = pack("full/2", width=1, count=x.size, n_changed=x.size, sections=[(KIND_ZSTD, frame, x.size)])
    got = {mode: decode_in(mode, data, "full/2", np.uint8, x.size) for mode in FULL_MODES}
    assert all(g[0] == "refused" and match in g[1] for g in got.values()), got
    assert got["native-streamed"] == got["numpy-pieces"]


# --- deltas ----------------------------------------------------------------------------------


def delta_mode(mode: str, m: pytest.MonkeyPatch) -> None:
    if mode.startswith("numpy"):
        m.setattr(kernels, "apply_segment", None)
    if mode.endswith("pieces"):
        m.setattr(apply, "WHOLE_MAX_BYTES", -1)
        m.setattr(apply, "PIECE_ELEMENTS", 6)
        m.setattr(planes, "STREAM_MIN_BYTES", 0)


def outcomes(seg, base: np.ndarray, mode: str) -> tuple:
    """What every read-path use of a delta makes of ``seg`` on ``base``, in ``mode``."""
    with pytest.MonkeyPatch.context() as m:
        delta_mode(mode, m)
        got = []
        for inverse in (False, True):
            t = base.copy()
            try:
                d = codec.apply_delta_digests(t, seg.data, codec=seg.codec, inverse=inverse, before=True, after=True)
                got.append((d, t.tobytes()))
            except CorruptObjectError as e:
                assert np.array_equal(t, base), f"{mode}: a refused delta wrote its target"
                got.append(("refused", str(e)))
        out = np.zeros_like(base)
        try:
            b, a, ch = codec.apply_delta_into(base, out, seg.data, codec=seg.codec, before=True, after=True)
            got.append((b, a, out.tobytes(), None if ch is None else (ch.positions.tolist(), ch.old.tolist(), ch.new.tolist())))
        except CorruptObjectError as e:
            got.append(("refused", str(e)))
        return tuple(got)


def changed(old: np.ndarray, frac: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    new = old.copy()
    n = old.size
    k = max(1, int(frac * n))
    at = rng.choice(n, k, replace=False)
    new[at] += rng.integers(1, 40, k).astype(old.dtype)  # small and escaped differences
    new[at[: k // 8]] ^= old.dtype.type(1 << (8 * old.itemsize - 1))
    if n > 900:
        new[300:900] = old[300:900]  # a gap past the symbol escape
    return new


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 1001])
@pytest.mark.parametrize("frac", [0.01, 0.3, 1.0])
def test_deltas_in_pieces_give_what_whole_ones_give(width: int, n: int, frac: float) -> None:
    rng = np.random.default_rng(n * width)
    old = rng.integers(0, 1 << min(8 * width, 63), n, dtype=np.uint64).astype(UINT[width])
    new = changed(old, frac, seed=n)
    seg = codec.encode_delta(old, new)
    want = outcomes(seg, old, "numpy")
    assert want[0][1] == new.tobytes()
    for mode in DELTA_MODES:
        if mode.startswith("native") and kernels.apply_segment is None:
            continue
        assert outcomes(seg, old, mode) == want, mode


def sparse_add(old: np.ndarray, new: np.ndarray, *, tweak) -> codec.Segment:
    """An add-sparse/1 segment of ``old -> new`` with RAW sections, ``tweak(sym, codes)``
    applied to its gap symbols and value codes (the positions and differences, re-coded)."""
    pos = np.flatnonzero(old != new)
    zz = planes.zigzag(new[pos] - old[pos])
    gaps = np.diff(pos, prepend=-1) - 1
    assert gaps.max() < delta.ESCAPE and zz.max() < delta.NIBBLE_ESCAPE, "keep it free of escapes"
    sym, codes = gaps.astype(np.uint8), zz.astype(np.uint8)
    sym, codes = tweak(sym.copy(), codes.copy())
    sections = [sym.tobytes(), planes.pack_nibbles(codes).tobytes()]
    data = pack("add-sparse/1", width=old.itemsize, count=old.size, n_changed=pos.size, param=1,
                sections=[(KIND_RAW, s, len(s)) for s in sections])
    return codec.Segment("add-sparse/1", data, int(pos.size))


def _zero_last_code(sym, codes):
    codes[-1] = 0
    return sym, codes


def _last_position_beyond(sym, codes):
    sym[-1] = 200
    return sym, codes


@pytest.mark.parametrize("tweak,match", [
    (_zero_last_code, "holds a zero difference"),
    (_last_position_beyond, "beyond its 400 elements"),
])
def test_a_delta_refused_in_its_last_piece_writes_nothing(tweak, match: str) -> None:
    """The pieces are applied only once the whole segment was read and found good: a bad last
    piece leaves the target as it was (outcomes() checks it), in the same words on every way."""
    old = np.arange(400, dtype=np.uint16)
    new = old.copy()
    new[::3] += np.uint16(2)
    seg = sparse_add(old, new, tweak=tweak)
    got = {mode: outcomes(seg, old, mode) for mode in DELTA_MODES
           if not (mode.startswith("native") and kernels.apply_segment is None)}
    for mode, g in got.items():
        assert g[0][0] == "refused" and match in g[0][1], (mode, g)
    assert len({g[0][1] for g in got.values()}) == 1, got


def test_the_numpy_estimate_covers_steady_deltas_of_default_chunks() -> None:
    """A training step's delta of a 16 MiB chunk (2 % changed, 1 % of values escaped) is applied
    whole on both paths: the pieces are for chunks far beyond the default chunk size."""
    count = (16 << 20) // 2
    n = count // 50
    h = peek_header(pack("add-sparse/1", width=2, count=count, n_changed=n, param=1, n_escaped=n // 100,
                         sections=[(2, b"\x01", n), (2, b"\x11", (n + 1) // 2), (2, b"\x10", n // 100), (2, b"\x00", n // 100)]))
    assert apply._working_bytes(h, native=False) <= apply.WHOLE_MAX_BYTES
    assert apply._working_bytes(h, native=True) <= apply.WHOLE_MAX_BYTES
