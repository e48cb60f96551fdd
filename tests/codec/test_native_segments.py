"""The native sparse segment builder (deltastore/_native/planes.c ``add_sparse_segment``: a
segment's planes compressed by the system's libzstd without the GIL) against the planes coded in
deltastore/codec/delta.py with python-zstandard: the same bytes, and used only where they are.

Skipped where the extension is not built or no libzstd can compress.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltastore._util import kernels
from deltastore.codec import delta, planes
from deltastore.codec.apply import apply_delta
from deltastore.codec.delta import DIGEST_NONE, add_segments_from_planes

pytestmark = pytest.mark.skipif(
    kernels.add_sparse_segment is None or kernels.zstd_plane_params is None or kernels.zstd_plane_params() is None,
    reason="native segment builder or a compressing libzstd not loaded")


def _chunk(width: int, size: int, frac: float, seed: int, *, gaps: str = "random", diffs: str = "small",
           const_codes: bool = False) -> tuple:
    """The raw planes ``encode_add`` gives for a changed chunk: (count, width, k, syms, rest,
    max_rest, codes, esc)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"<u{width}")
    old = rng.integers(0, 2 ** (8 * width) - 1, size=size, dtype=dt, endpoint=True)
    new = old.copy()
    if gaps == "long":  # gaps past the escape, up to two- and four-byte rests
        pos = np.cumsum(rng.choice(np.array([1, 254, 255, 256, 70_000, 300]), size=size // 300 + 1))
        pos = pos[pos < size]
    else:
        pos = np.flatnonzero(rng.random(size) < frac)
    if const_codes:  # every change +1: one code throughout
        d = np.ones(pos.size, dtype=np.uint64)
    elif diffs == "escaping":  # zigzag values past the nibble escape
        d = rng.choice(np.array([7, 8, 100, 2 ** (8 * width) - 9], dtype=np.uint64), size=pos.size)
    else:
        d = rng.choice(np.array([1, 2, 2 ** (8 * width) - 1], dtype=np.uint64), size=pos.size)
    new[pos] = (old[pos].astype(np.uint64) + d).astype(dt)
    k, syms, rest, max_rest, codes, esc = kernels.encode_add(old.copy(), new, width, True, DIGEST_NONE)[:6]
    return (size, width, k, syms, rest, max_rest, codes, esc), old, new


def _libzstd_writes_python_zstandards_frames() -> bool:
    """Whether the system's libzstd, called here through ctypes with the planes' parameters,
    writes python-zstandard's frames for a few planes: then the native builder must be used and
    must write this module's segments (a difference is the builder's, not libzstd's)."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
    except OSError:
        return False
    lib.ZSTD_createCCtx.restype = ctypes.c_void_p
    lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.ZSTD_compress2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                   ctypes.c_size_t]
    lib.ZSTD_compress2.restype = ctypes.c_size_t
    lib.ZSTD_freeCCtx.argtypes = [ctypes.c_void_p]
    cctx = lib.ZSTD_createCCtx()
    try:
        for param, value in zip(range(101, 108), kernels.zstd_plane_params()):
            lib.ZSTD_CCtx_setParameter(cctx, param, value)
        rng = np.random.default_rng(11)
        ours = planes._cctx(None)
        for n in (40, 3000, 70_000):
            plane = rng.geometric(0.2, n).clip(0, 255).astype(np.uint8).tobytes()
            out = ctypes.create_string_buffer(2 * n + 64)
            size = lib.ZSTD_compress2(cctx, out, len(out), plane, n)
            if ctypes.string_at(out, size) != ours.compress(plane):
                return False
    finally:
        lib.ZSTD_freeCCtx(cctx)
    return True


#: The native builder is expected here: this machine's libzstd writes python-zstandard's frames.
EXPECTED = _libzstd_writes_python_zstandards_frames()


CASES = [
    pytest.param(w, size, frac, gaps, diffs, const, id=f"w{w}-{size}-{frac}-{gaps}-{diffs}{'-const' if const else ''}")
    for w in (1, 2, 4, 8)
    for size, frac, gaps, diffs, const in [
        (40, 0.2, "random", "small", False),  # planes under the zstd threshold: stored raw
        (5000, 0.02, "random", "small", False),
        (70_001, 0.3, "random", "escaping", False),
        (100_000, 0.0, "long", "small", False),  # gap rests of one, two and four bytes
        (3000, 0.1, "random", "small", True),  # a CONST codes plane
    ]
]


@pytest.mark.parametrize(("width", "size", "frac", "gaps", "diffs", "const"), CASES)
def test_native_segments_are_the_ones_coded_here(width, size, frac, gaps, diffs, const) -> None:
    if not EXPECTED:
        pytest.skip("this machine's libzstd writes other frames than python-zstandard: not used")
    assert delta.native_segments()
    chunk, old, new = _chunk(width, size, frac, 7, gaps=gaps, diffs=diffs, const_codes=const)
    native = kernels.add_sparse_segment(*chunk)
    assert native == delta._segments_from_planes([chunk], None)[0].data
    target = old.copy()
    apply_delta(target, native, codec=delta.CODEC_ADD_SPARSE)
    assert np.array_equal(target, new)


def test_a_builder_whose_frames_differ_is_not_used(monkeypatch) -> None:
    chunk, _, _ = _chunk(2, 5000, 0.02, 3)
    calls = []
    real = kernels.add_sparse_segment

    def altered(*a):
        calls.append(1)
        data = real(*a)
        return data[:-1] + bytes([data[-1] ^ 1])

    monkeypatch.setattr(kernels, "add_sparse_segment", altered)
    monkeypatch.setattr(delta, "_NATIVE_SEGMENTS", None)
    assert not delta.native_segments()
    probed = len(calls)
    assert add_segments_from_planes([chunk])[0].data == delta._segments_from_planes([chunk], None)[0].data
    assert len(calls) == probed  # checked once, then never called
    # other compression parameters than the planes': not used either
    monkeypatch.setattr(kernels, "add_sparse_segment", real)
    params = kernels.zstd_plane_params()
    monkeypatch.setattr(kernels, "zstd_plane_params", lambda: (params[0] + 1, *params[1:]))
    monkeypatch.setattr(delta, "_NATIVE_SEGMENTS", None)
    assert not delta.native_segments()


def test_only_sparse_segments_at_the_planes_parameters_are_built_natively(monkeypatch) -> None:
    if not EXPECTED:
        pytest.skip("this machine's libzstd writes other frames than python-zstandard: not used")
    calls = []
    real = kernels.add_sparse_segment
    monkeypatch.setattr(kernels, "add_sparse_segment", lambda *a: calls.append(a[2]) or real(*a))
    sparse, _, _ = _chunk(2, 5000, 0.02, 4)
    dense, _, _ = _chunk(2, 5000, 0.6, 5)  # tried in the dense form too: coded here
    got = add_segments_from_planes([sparse, dense])
    assert calls == [sparse[2]]
    assert [s.data for s in got] == [s.data for s in delta._segments_from_planes([sparse, dense], None)]
    calls.clear()
    assert add_segments_from_planes([sparse], level=3)[0].data == delta._segments_from_planes([sparse], 3)[0].data
    assert not calls  # a plain zstd level: coded here


def test_planes_that_do_not_fit_their_counts_are_refused() -> None:
    (count, width, k, syms, rest, max_rest, codes, esc), _, _ = _chunk(2, 100_000, 0.0, 6, gaps="long")
    assert rest  # gaps past the escape
    with pytest.raises(ValueError, match="do not fit"):
        kernels.add_sparse_segment(count, width, k + 1, syms, rest, max_rest, codes, esc)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.add_sparse_segment(count, width, k, syms, rest[:-1], max_rest, codes, esc)
    with pytest.raises(ValueError, match="width"):
        kernels.add_sparse_segment(count, 3, k, syms, rest, max_rest, codes, esc)
