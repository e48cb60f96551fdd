"""The native kernels (deltastore._native) against the numpy path: identical segment
bytes and digests for every width and edit pattern, the reference advance, bad buffers, the
loader's fallback, and the GIL released while a kernel runs.

Kernel tests skip when the extension is not built (``python setup.py build_ext --inplace``);
the loader and fallback tests run either way. ``DELTASTORE_NATIVE=0`` runs the whole suite on
the numpy path (test_codec_suites_without_kernels does that for the codec tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore._util import kernels
from deltastore.codec.apply import apply_delta
from deltastore.codec.delta import ESCAPE, NIBBLE_ESCAPE, encode_delta, encode_delta_advance
from deltastore.codec.full import MIN_PAIR_COUNT, decode_full, encode_full

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1, 2, 4, 8)
PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

native = pytest.mark.skipif(not kernels.NATIVE, reason="native extension not built")

# bf16 / fp32 bit patterns a float-typed path would break: ±0, ±inf, NaN payloads, subnormals
SPECIALS = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01],
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FC1, 0x7FFF, 0xFFFF, 0x7F81, 0x0001, 0x807F],
    4: [0x0, 0x80000000, 0x7F800000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000001],
    8: [0x0, 1 << 63, 0x7FF0000000000000, 0x7FF8000000000001, 2**64 - 1, 0x7FF0000000000001, 1],
}


def _uint(width: int) -> np.dtype:
    return np.dtype(f"<u{width}")


def make_pair(width: int, size: int, frac: float, gaps: str, diffs: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An (old, new) pair: ``frac`` of the elements changed (``gaps``: where), by ``diffs``."""
    rng = np.random.default_rng(seed)
    dt = _uint(width)
    old = rng.integers(0, 2 ** (8 * width) - 1, size=size, dtype=dt, endpoint=True)
    if size:
        sp = np.array(SPECIALS[width], dtype=dt)
        old[rng.integers(0, size, min(size, sp.size))] = sp[: min(size, sp.size)]
    new = old.copy()
    if size == 0 or frac == 0:
        return old, new
    if gaps == "escaping":  # gaps around the 255 escape and far beyond it
        steps = rng.choice(np.array([ESCAPE - 1, ESCAPE, ESCAPE + 1, 1000, 70000, 1]), size=size)
        pos = np.cumsum(steps)
        pos = pos[pos < size]
    elif gaps == "ends":
        pos = np.array(sorted({0, size - 1}))
    else:
        pos = np.flatnonzero(rng.random(size) < frac)
    if pos.size == 0:
        pos = np.array([size - 1])
    if diffs == "ulp":  # ±1, ±2: Adam steps in the last place (no value escapes)
        d = rng.choice(np.array([1, 2, 2 ** (8 * width) - 1, 2 ** (8 * width) - 2], dtype=np.uint64), size=pos.size)
        new[pos] = (old[pos].astype(np.uint64) + d).astype(dt)
    elif diffs == "escaping":  # zigzag values around NIBBLE_ESCAPE (7/8 and -7/-8) and huge ones
        cand = np.array([7, 8, 2 ** (8 * width) - 7, 2 ** (8 * width) - 8, 2 ** (8 * width - 1), 3], dtype=np.uint64)
        d = rng.choice(cand, size=pos.size)
        new[pos] = (old[pos].astype(np.uint64) + d).astype(dt)
    elif diffs == "specials":  # swap in ±0, NaN payloads, infinities
        new[pos] = np.array(SPECIALS[width], dtype=dt)[rng.integers(0, len(SPECIALS[width]), pos.size)]
    else:  # random bits
        new[pos] = rng.integers(0, 2 ** (8 * width) - 1, size=pos.size, dtype=dt, endpoint=True)
    return old, new


pairs = st.builds(
    make_pair,
    width=st.sampled_from(WIDTHS),
    size=st.one_of(st.integers(0, 70), st.integers(0, 5000), st.sampled_from([63, 64, 65, 8191, 8192, 8193, 70001])),
    frac=st.sampled_from([0.0, 0.001, 0.02, 0.3, 0.45, 0.9, 1.0]),
    gaps=st.sampled_from(["random", "escaping", "ends"]),
    diffs=st.sampled_from(["ulp", "escaping", "specials", "random"]),
    seed=st.integers(0, 2**32 - 1),
)


def _isas() -> list[str]:
    """The scan variants of encode_add this machine runs (deltastore._native.scan_isa)."""
    if not kernels.NATIVE:
        return ["baseline"]
    out = []
    for name in ("baseline", "avx2", "avx512bw", "avx512vbmi2"):
        try:
            kernels._native.scan_isa(name)
        except ValueError:
            continue
        out.append(name)
    kernels._native.scan_isa("auto")
    return out


ISAS = _isas()


class forced_isa:
    """Run encode_add's scan on one instruction set inside the block (then the CPU's best)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        assert kernels._native.scan_isa(self.name) == self.name

    def __exit__(self, *exc):
        kernels._native.scan_isa("auto")


def numpy_path(monkeypatch: pytest.MonkeyPatch, fn, *args, **kw):
    """Call ``fn`` with the kernels switched off (the loader's None)."""
    with monkeypatch.context() as m:
        for name in ("encode_add", "xxh3_128_hex", "split_planes", "pair_codes"):
            m.setattr(kernels, name, None)
        return fn(*args, **kw)


def seg_bytes(seg):
    return None if seg is None else (seg.codec, seg.n_changed, bytes(seg.data))


# --- identical bytes -------------------------------------------------------------------------


@native
@pytest.mark.parametrize("isa", ISAS)
@PROPS
@given(pair=pairs, always=st.booleans())
def test_encode_delta_advance_same_bytes_digest_and_advance(isa, pair, always):
    """Every scan variant (SSE2/scalar baseline, AVX2, AVX-512BW where the CPU has them)."""
    old, new = pair
    with pytest.MonkeyPatch.context() as mp:
        ref_old = old.copy()
        want_seg, want_digest = numpy_path(mp, encode_delta_advance, ref_old, new, always_digest=always)
    got_old = old.copy()
    with forced_isa(isa):
        got_seg, got_digest = encode_delta_advance(got_old, new, always_digest=always)
    assert seg_bytes(got_seg) == seg_bytes(want_seg)
    assert got_digest == want_digest
    if got_digest is not None:
        assert got_digest == xxhash.xxh3_128_hexdigest(new.tobytes())
    assert (got_digest is None) == (not always and want_seg is None)
    assert np.array_equal(got_old, new) and np.array_equal(ref_old, new)  # the reference advanced
    if got_seg is not None:  # and the segment takes old to new
        t = old.copy()
        apply_delta(t, got_seg.data, codec=got_seg.codec)
        assert np.array_equal(t, new)


@native
@PROPS
@given(pair=pairs)
def test_encode_delta_same_bytes_and_old_untouched(pair):
    old, new = pair
    old.flags.writeable = False  # encode_delta never writes old
    with pytest.MonkeyPatch.context() as mp:
        want = numpy_path(mp, encode_delta, old, new)
    assert seg_bytes(encode_delta(old, new)) == seg_bytes(want)


@native
def test_no_advance_leaves_old_and_big_endian_old_advances():
    old, new = make_pair(2, 10000, 0.02, "random", "ulp", 7)
    o = old.copy()
    seg, digest = encode_delta_advance(o, new, advance=False)
    assert np.array_equal(o, old) and seg is not None and digest is not None
    be_old, be_new = old.astype(">u2"), new.astype(">u2")  # byte-swapped arrays: copies inside
    seg2, digest2 = encode_delta_advance(be_old, be_new)
    assert seg_bytes(seg2) == seg_bytes(seg) and digest2 == digest
    assert np.array_equal(be_old, be_new)


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("where", ["first", "second", "middle", "last", "none"])
@pytest.mark.parametrize("always", [False, True])
def test_digest_hashed_behind_the_scan(width, isa, where, always, monkeypatch):
    """encode.c hashes each 16 KiB block of ``new`` while the next one is scanned, in slices, and
    a delta publish starts hashing at the first changed block (catching up on those before it):
    the digest is of every byte in order wherever the first change is, for chunk sizes that
    end inside a block and inside a slice."""
    block = 16 * 1024 // width  # encode.c HASH_BLOCK, in elements
    size = 5 * block + 1000 // width + 3
    old, _ = make_pair(width, size, 0.0, "random", "random", width)
    new = old.copy()
    at = {"first": [3], "second": [block + 5], "middle": [2 * block + block // 2, 3 * block],
          "last": [size - 1], "none": []}[where]
    new[at] ^= 1
    want = numpy_path(monkeypatch, encode_delta_advance, old.copy(), new, always_digest=always)
    with forced_isa(isa):
        got = encode_delta_advance(old, new, always_digest=always)
    assert got == want
    assert got[1] == (xxhash.xxh3_128_hexdigest(new.tobytes()) if at or always else None)


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", WIDTHS)
def test_large_chunk_same_bytes(width, isa, monkeypatch):
    """A chunk of several hash blocks, with every change pattern at once, on each scan variant."""
    old, new = make_pair(width, (1 << 21) // width + 3, 0.015, "random", "escaping", width)
    new[:100] = old[:100] + 1  # a run at the start
    new[-70:] = old[-70:] ^ 1  # and one over the last block edge and the tail
    want = numpy_path(monkeypatch, encode_delta_advance, old.copy(), new)
    with forced_isa(isa):
        assert encode_delta_advance(old, new) == (want[0], want[1])


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", WIDTHS)
def test_dense_blocks_same_bytes(width, isa, monkeypatch):
    """Blocks with every element changed, and every gap and value escaped: the worst case the
    scan reserves for, on each scan variant."""
    n = 3 * 8192 // width + 17
    old = np.zeros(n, dtype=_uint(width))
    new = old.copy()
    new[: n // 3] = 2 ** (8 * width - 1)  # every element changed, every value escaped
    new[n // 3 + 300 :: 300] = 1  # then gaps past the escape
    want = numpy_path(monkeypatch, encode_delta_advance, old.copy(), new)
    with forced_isa(isa):
        assert encode_delta_advance(old, new) == (want[0], want[1])


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", WIDTHS)
def test_change_list_is_every_changed_element_in_order(width, isa):
    """encode_add(..., values=True): positions, old and new values of exactly the changed
    elements (the serving streams derive from them), on each scan variant; the other outputs are
    those of the call without it."""
    old, new = make_pair(width, 3 * 8192 // width + 29, 0.03, "random", "escaping", width)
    new[:70] = old[:70] + 1  # whole vector blocks of changes
    with forced_isa(isa):
        plain = kernels.encode_add(old.copy(), new, width, True, 1)
        got = kernels.encode_add(old.copy(), new, width, True, 1, True)
    assert got[:7] == plain
    where = np.flatnonzero(old != new)
    assert np.array_equal(np.frombuffer(got[7], np.uint32), where)
    assert np.array_equal(np.frombuffer(got[8], old.dtype), old[where])
    assert np.array_equal(np.frombuffer(got[9], old.dtype), new[where])


@native
def test_scan_isa_rejects_unknown_names_and_auto_is_supported():
    from deltastore import _native

    with pytest.raises(ValueError, match="unknown instruction set"):
        _native.scan_isa("sse9")
    assert _native.scan_isa("auto") in ISAS
    assert _native.scan_isa() == _native.scan_isa("auto")


@native
def test_constants_match_the_codec():
    from deltastore import _native

    assert (_native.GAP_ESCAPE, _native.NIBBLE_ESCAPE) == (ESCAPE, NIBBLE_ESCAPE)


@native
@given(data=st.binary(max_size=5000))
@settings(deadline=None)
def test_state_digest_kernel(data):
    from deltastore.layout.tensors import state_digest

    assert kernels.xxh3_128_hex(data) == xxhash.xxh3_128_hexdigest(data)
    arr = np.frombuffer(data[: len(data) // 2 * 2], dtype=np.uint16)
    assert state_digest(arr) == xxhash.xxh3_128_hexdigest(arr.tobytes())


def make_full(width: int, size: int, kind: str, seed: int) -> np.ndarray:
    """Values for an anchor: float-like (a narrow exponent range, some outside the window),
    special patterns, or random bits."""
    rng = np.random.default_rng(seed)
    dt = _uint(width)
    if kind == "random" or width == 1:
        return rng.integers(0, 2 ** (8 * width) - 1, size=size, dtype=dt, endpoint=True)
    f = (rng.standard_normal(size) * 0.02).astype(np.float32)
    bits32 = f.view(np.uint32)
    if width == 2:
        v = (bits32 >> 16).astype(dt)
    elif width == 4:
        v = bits32.astype(dt)
    else:
        v = f.astype(np.float64).view(np.uint64)
    if size and kind == "floats+specials":
        sp = np.array(SPECIALS[width], dtype=dt)
        v[rng.integers(0, size, min(size, 50))] = sp[rng.integers(0, sp.size, min(size, 50))]
    return v


@native
@PROPS
@given(width=st.sampled_from(WIDTHS),
       size=st.one_of(st.integers(0, 40), st.sampled_from([MIN_PAIR_COUNT - 1, MIN_PAIR_COUNT, MIN_PAIR_COUNT + 1, 70001])),
       kind=st.sampled_from(["floats", "floats+specials", "random"]), float_bits=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_encode_full_same_bytes(width, size, kind, float_bits, seed):
    v = make_full(width, size, kind, seed)
    with pytest.MonkeyPatch.context() as mp:
        want = numpy_path(mp, encode_full, v, float_bits=float_bits)
    got = encode_full(v, float_bits=float_bits)
    assert seg_bytes(got) == seg_bytes(want)
    assert np.array_equal(decode_full(got.data, codec=got.codec, dtype=v.dtype, count=v.size), v)


@native
@pytest.mark.parametrize("width", (1, 2, 4, 8))
@pytest.mark.parametrize("rotate", (False, True))
def test_split_planes_kernel(width, rotate):
    from deltastore.codec.planes import rotl1, split

    v = make_full(width, 1001, "random", width)
    out = np.empty((width, v.size), dtype=np.uint8)
    kernels.split_planes(v, out, width, rotate)
    want = split(rotl1(v) if rotate else v)
    assert all(np.array_equal(a, b) for a, b in zip(out, want))


@native
@given(top=st.binary(max_size=600), low=st.integers(0, 241))
@settings(deadline=None)
def test_pair_codes_kernel(top, low):
    from deltastore.codec.planes import pack_nibbles

    t = np.frombuffer(top, dtype=np.uint8)
    out = np.empty((t.size + 1) // 2, dtype=np.uint8)
    esc = np.frombuffer(kernels.pair_codes(t, low, 15, out), dtype=np.uint8)
    codes = t - np.uint8(low)
    assert np.array_equal(esc, t[codes >= 15])
    assert np.array_equal(out, pack_nibbles(np.minimum(codes, 15)))


# --- bad input -------------------------------------------------------------------------------


@native
def test_kernel_rejects_bad_buffers():
    a = np.zeros(16, np.uint16)
    b = np.ones(16, np.uint16)
    with pytest.raises(ValueError, match="width"):
        kernels.encode_add(a, b, 3, False, 0)
    with pytest.raises(ValueError, match="length"):
        kernels.encode_add(a, b[:8], 2, False, 0)
    with pytest.raises(ValueError, match="multiple"):
        kernels.encode_add(a.view(np.uint8)[:31], b.view(np.uint8)[:31], 2, False, 0)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.encode_add(a[::2], b[::2], 2, False, 0)
    ro = a.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        kernels.encode_add(ro, b, 2, True, 0)
    with pytest.raises(ValueError, match="overlap"):
        buf = np.zeros(32, np.uint16)
        kernels.encode_add(buf[:16], buf[8:24], 2, True, 0)
    with pytest.raises(ValueError, match="digest"):
        kernels.encode_add(a, b, 2, False, 3)
    assert not ro.any() and not a.any()  # nothing written by a rejected call
    with pytest.raises(ValueError, match="contiguous"):
        kernels.xxh3_128_hex(np.zeros(8)[::2])
    with pytest.raises(ValueError, match="length"):
        kernels.split_planes(a, np.empty(8, np.uint16), 2, True)
    with pytest.raises(ValueError, match="overlap"):
        kernels.split_planes(a, a, 2, True)
    with pytest.raises(ValueError, match="writable"):
        kernels.split_planes(b, ro, 2, True)
    with pytest.raises(ValueError, match="hold"):
        kernels.pair_codes(np.zeros(9, np.uint8), 0, 15, np.empty(4, np.uint8))
    with pytest.raises(ValueError, match="low"):
        kernels.pair_codes(np.zeros(9, np.uint8), 256, 15, np.empty(5, np.uint8))
    assert not ro.any() and not a.any()
    # the codec's own checks come first, with the numpy path's messages
    with pytest.raises(ValueError, match="differ in layout"):
        encode_delta_advance(a, b[:8])
    with pytest.raises(TypeError, match="unsigned"):
        encode_delta_advance(a.view(np.int16), b.view(np.int16))


# --- the loader ------------------------------------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


PROBE = (
    "import logging; logging.basicConfig(level=logging.WARNING)\n"
    "{pre}\n"
    "import numpy as np\n"
    "import deltastore\n"
    "from deltastore._util import kernels\n"
    "from deltastore.codec import encode_delta\n"
    "import deltastore._util.kernels\n"
    "o = np.zeros(9, np.uint16); n = o.copy(); n[3] = 1\n"
    "print(kernels.NATIVE, kernels.encode_add is None, encode_delta(o, n).data.hex())\n"
)


def test_forced_fallback_is_silent_and_writes_the_same_bytes():
    forced = _python(PROBE.format(pre=""), DELTASTORE_NATIVE="0")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.split()[:2] == ["False", "True"]
    assert "WARNING" not in forced.stderr
    default = _python(PROBE.format(pre=""))
    assert default.returncode == 0, default.stderr
    assert default.stdout.split()[2] == forced.stdout.split()[2]


def test_failed_load_warns_once():
    # a module that cannot be imported: what a machine without a compiler (or a broken .so) sees
    r = _python(PROBE.format(pre="import sys; sys.modules['deltastore._native'] = None"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["False", "True"]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("WARNING:deltastore._util.kernels:"), r.stderr
    assert "numpy path" in lines[0]


def test_stale_build_is_refused():
    pre = (
        "import sys, types; m = types.ModuleType('deltastore._native'); m.ABI = -1\n"
        "sys.modules['deltastore._native'] = m"
    )
    r = _python(PROBE.format(pre=pre))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["False", "True"]
    assert r.stderr.count("stale build") == 1


@pytest.mark.slow
@native
def test_codec_suites_without_kernels():
    """The codec tests and fuzzers pass on the numpy path too (the suite runs them with the
    kernels; test_native compares the two byte for byte; the corruption suite runs both
    decoders in-process)."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/codec/test_codec.py"],
        cwd=ROOT, env={**os.environ, "DELTASTORE_NATIVE": "0"}, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# --- the GIL ---------------------------------------------------------------------------------


def _runs_python_meanwhile(kernel_call, at_least: float = 0.25) -> tuple[int, float]:
    """Run ``kernel_call`` on a thread, again and again for ``at_least`` seconds; count how
    often this thread ran Python meanwhile. Between two calls the worker runs Python, so it
    holds the GIL and keeps this thread out (the switch interval is long): only a kernel that
    releases the GIL lets this thread in. The window is long enough that a busy machine still
    schedules this thread many times in it. Returns (count, the window's duration)."""
    started = threading.Event()
    window: dict[str, float] = {}

    def worker():
        started.set()
        window["start"] = start = time.perf_counter()
        kernel_call()
        while time.perf_counter() - start < at_least:
            kernel_call()
        window["end"] = time.perf_counter()

    ticks: list[float] = []
    old_interval = sys.getswitchinterval()
    # a long switch interval: a kernel that held the GIL would keep this thread out for its
    # whole call (the worker never has to drop the GIL in time), one that releases it lets us in
    sys.setswitchinterval(5.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        started.wait()
        while t.is_alive():
            ticks.append(time.perf_counter())
            time.sleep(0)  # drop the GIL, so the worker can take it to start and to return
        t.join()
    finally:
        sys.setswitchinterval(old_interval)
    start, end = window["start"], window["end"]
    inside = [x for x in ticks if start < x < end]
    return len(inside), end - start


@native
@pytest.mark.parametrize("kernel", ["encode_add", "xxh3_128_hex"])
def test_kernels_release_the_gil(kernel):
    rng = np.random.default_rng(0)
    n = 1 << 23
    old = rng.integers(0, 2**32 - 1, n, dtype=np.uint32)
    new = old + np.uint32(1)  # every element changes: a long call (~30-500 ms)
    if kernel == "encode_add":
        call = lambda: kernels.encode_add(old, new, 4, False, 2)
    else:
        big = np.concatenate([old, new] * 2)  # 128 MiB: ~10-50 ms
        call = lambda: kernels.xxh3_128_hex(big)
    count, duration = _runs_python_meanwhile(call)
    assert count >= 3, f"Python ran {count} times during {duration * 1e3:.0f} ms of kernel calls"


@pytest.mark.parametrize("codec_id", ["full/2", "add-sparse/1", "add-dense/1"])
def test_packed_size_is_packs_length(codec_id):
    """encode_full compares its two forms by packed_size before packing one of them."""
    from deltastore.codec.container import KIND_RAW, KIND_ZSTD, pack, packed_size

    secs = [(KIND_RAW, b"abc", 3), (KIND_ZSTD, b"x" * 40, 90), (KIND_RAW, b"", 0)]
    for k in range(len(secs) + 1):
        data = pack(codec_id, width=2, count=90, n_changed=3, sections=secs[:k])
        assert packed_size(k, sum(len(s[1]) for s in secs[:k])) == len(data)


@native
def test_untrack_takes_containers_out_of_the_collector_and_ignores_the_rest():
    import gc
    import weakref

    class Box:
        pass

    box, inner = Box(), [2]
    box.items = (1, "a")
    assert gc.is_tracked(box) and gc.is_tracked(inner)
    kernels.untrack([box, 7, "s", None, box])  # atoms ignored, twice is once
    assert not gc.is_tracked(box) and gc.is_tracked(inner) and box.items == (1, "a")
    kernels.untrack([])
    with pytest.raises(TypeError, match="list"):
        kernels.untrack((inner,))
    assert gc.is_tracked(inner)
    gone = weakref.ref(box)
    del box
    assert gone() is None  # an untracked object still dies by its reference count
