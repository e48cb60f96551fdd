"""The native decode-and-apply kernel (deltastore/_native/apply.c) against the numpy decoder,
and pull_into's one-pass verification (SPEC §7.5-6).

Kernel and numpy path must accept and refuse the same segments, with the same message, and
write bit-identical targets (every width, sparse and dense, inverse); the digests
the kernel takes in its pass must be the chunk's XXH3-128. The corruption suite itself runs on
the numpy path in tests/codec/test_codec_corruption.py.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import Publisher, Subscriber, TargetModifiedError
from deltastore._util import kernels
from deltastore.codec import apply, delta
from deltastore.codec.apply import apply_delta, apply_delta_digests, apply_delta_into
from deltastore.codec.container import CODEC_ADD_DENSE, CODEC_ADD_SPARSE, KIND_CONST, KIND_RAW, pack
from deltastore.codec.delta import encode_delta
from deltastore.codec.planes import encode_sections
from deltastore.errors import CorruptObjectError, DeltastoreError, IntegrityError
from deltastore.write.policy import LayoutPolicy, WriterPolicy

NATIVE = kernels.apply_segment is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="deltastore._native is not built (numpy path only)")
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@contextlib.contextmanager
def numpy_path():
    """Run the numpy decoder even where the kernel is loaded."""
    saved = kernels.apply_segment
    kernels.apply_segment = None
    try:
        yield
    finally:
        kernels.apply_segment = saved


def digest(a: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(a.tobytes())


def outcome(base: np.ndarray, data: bytes, codec: str, inverse: bool = False):
    """(target bytes after, digests or the error message) of one apply."""
    t = base.copy()
    try:
        d = apply_delta_digests(t, data, codec=codec, inverse=inverse, before=True, after=True)
    except (DeltastoreError, ValueError) as e:
        assert np.array_equal(t, base), "a refused segment wrote the target"
        return t.tobytes(), f"{type(e).__name__}: {e}"
    return t.tobytes(), d


def both(base: np.ndarray, data: bytes, codec: str, inverse: bool = False):
    native = outcome(base, data, codec, inverse)
    with numpy_path():
        fallback = outcome(base, data, codec, inverse)
    assert native == fallback
    return native


def dense_segment(old: np.ndarray, new: np.ndarray) -> tuple[str, bytes] | None:
    """The dense form ``(codec, data)``, whatever the encoder would choose."""
    dense = new - old
    n = int(np.count_nonzero(dense))
    if n == 0:
        return None
    v = delta.code_values(dense)
    return CODEC_ADD_DENSE, pack(CODEC_ADD_DENSE, width=old.itemsize, count=old.size, n_changed=n,
                                 n_escaped=v.n_escaped, sections=encode_sections(v.planes, None))


def all_forms(old: np.ndarray, new: np.ndarray) -> list[tuple[str, bytes]]:
    """The segment the encoder writes from old to new and the dense form (forced): empty when
    old == new."""
    out = [(s.codec, s.data) for s in (encode_delta(old, new),) if s is not None]
    return out + [d for d in (dense_segment(old, new),) if d is not None]


@st.composite
def chunk_pairs(draw):
    """(old, new): random bits, then a change set of any density; differences small (Adam-like,
    mostly codes), large (escapes) or arbitrary; NaN-ish and -0.0-ish patterns come for free."""
    width = draw(st.sampled_from([1, 2, 4, 8]))
    dt = UINT[width]
    n = draw(st.integers(1, 1500))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    if draw(st.booleans()):
        old[rng.random(n) < 0.5] = 0  # runs of equal bits: CONST planes
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0]))
    mask = rng.random(n) < density
    if draw(st.booleans()) and n > 600:
        mask[:] = False
        mask[rng.integers(0, n, 2)] = True  # long gaps: escaped gap symbols
    spread = draw(st.sampled_from([3, 20, 1 << 30]))
    d = rng.integers(-spread, spread, n).astype(np.int64).astype(dt)
    new = old.copy()
    new[mask] += d[mask]
    return old, new


@needs_native
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_pairs())
def test_kernel_and_numpy_write_identical_targets(pair):
    old, new = pair
    forms = all_forms(old, new)
    assert len(forms) == (0 if np.array_equal(old, new) else 2)
    for codec, data in forms:
        after, digests = both(old, data, codec)
        assert after == new.tobytes(), codec
        assert digests == (digest(old), digest(new))
        back, digests = both(new, data, codec, inverse=True)
        assert back == old.tobytes(), codec
        assert digests == (digest(new), digest(old))


def into_outcome(base: np.ndarray, data: bytes, codec: str):
    out = np.full_like(base, 0x5A)
    source = base.copy()
    try:
        b, a, ch = apply_delta_into(source, out, data, codec=codec, before=True, after=True)
    except (DeltastoreError, ValueError) as e:
        assert np.array_equal(out, np.full_like(base, 0x5A)), "a refused segment wrote out"
        return f"{type(e).__name__}: {e}"
    assert np.array_equal(source, base), "apply_delta_into wrote its source"
    if ch is None:
        return out.tobytes(), b, a, None
    assert ch.old.dtype == ch.new.dtype == base.dtype
    return out.tobytes(), b, a, (ch.positions.tolist(), ch.old.tolist(), ch.new.tolist())


@needs_native
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_pairs())
def test_apply_into_agrees_and_names_the_changed_positions(pair):
    old, new = pair
    for codec, data in all_forms(old, new):
        native = into_outcome(old, data, codec)
        with numpy_path():
            assert into_outcome(old, data, codec) == native
        out, b, a, pos = native
        assert out == new.tobytes() and (b, a) == (digest(old), digest(new))
        if codec == CODEC_ADD_SPARSE:
            where = np.flatnonzero(old != new)
            assert pos == (where.tolist(), old[where].tolist(), new[where].tolist())
        else:
            assert pos is None


@needs_native
def test_digests_span_many_blocks_and_partial_ones():
    # 32 KiB blocks: chunks smaller than, equal to and far beyond one block, odd tails
    rng = np.random.default_rng(7)
    for n in (1, 16383, 16384, 16385, 1_000_003):
        old = rng.integers(0, 65535, n, dtype=np.uint16)
        new = old.copy()
        idx = rng.choice(n, max(1, n // 100), replace=False)
        new[idx] += np.uint16(1)
        new[-1] += np.uint16(3)  # a change in the last (partial) block
        seg = encode_delta(old, new)
        for want in ((True, False), (False, True), (True, True), (False, False)):
            t = old.copy()
            got = apply_delta_digests(t, seg.data, codec=seg.codec, before=want[0], after=want[1])
            assert got == (digest(old) if want[0] else None, digest(new) if want[1] else None)
            assert np.array_equal(t, new)


@needs_native
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_steps_and_prefetch_edges_write_what_numpy_writes(width):
    """Each 32 KiB block is patched and hashed again in 4 KiB steps, with the same step of the
    next block prefetched (apply.c STEP_BYTES): chunks ending just before, at and after a step
    and a block edge, changes on both sides of every edge, every codec form, in place and
    into ``out`` with the changed positions, must equal the numpy path."""
    rng = np.random.default_rng(width)
    dt = UINT[width]
    step, block = 4096 // width, 32768 // width
    for n in (step - 1, step, step + 1, block - 1, block, block + step + 1, 3 * block + 5):
        old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
        new = old.copy()
        idx = rng.choice(n, max(1, n // 50), replace=False)
        edges = np.array([e + d for e in range(0, n + 1, step) for d in (-1, 0) if 0 <= e + d < n])
        idx = np.unique(np.concatenate([idx, edges]))
        new[idx] += dt(1 + idx.size % 5)
        for codec, data in all_forms(old, new):
            after, digests = both(old, data, codec)
            assert after == new.tobytes() and digests == (digest(old), digest(new)), (codec, n)
            back, digests = both(new, data, codec, inverse=True)
            assert back == old.tobytes() and digests == (digest(new), digest(old)), (codec, n)
            native = into_outcome(old, data, codec)
            with numpy_path():
                assert into_outcome(old, data, codec) == native, (codec, n)


@st.composite
def escapes_at_edges(draw):
    """(old, new) whose changes put escapes where the kernel's sparse decoder changes gear:
    apply.c decodes BATCH = 64 changes at a time, in groups of 8 (a group with an escaped gap
    or value takes the slow path), 2 codes per byte, and applies them per 4 KiB step of a
    32 KiB block. Escaped gaps (>= 255) and values (zigzag >= 15) land on the changes around
    those edges; some gaps are long enough to cross steps and blocks; ``uniform`` repeats one
    gap and one value (CONST gap-symbol and code sections)."""
    width = draw(st.sampled_from([1, 2, 4, 8]))
    dt = UINT[width]
    n_changes = draw(st.integers(1, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    edges = [k + d for k in (0, 8, 16, 56, 64, 72, 120, 128, 136, 192) for d in (-1, 0, 1)]
    edges = [e for e in edges if 0 <= e < n_changes]
    esc_gaps = draw(st.lists(st.sampled_from(edges), max_size=6)) if edges else []
    esc_vals = draw(st.lists(st.sampled_from(edges), max_size=6)) if edges else []
    gaps = rng.choice([0, 1, 3, 40, 254], n_changes).astype(np.int64)
    gaps[esc_gaps] = rng.choice([255, 256, 300, 5000, 20000], len(esc_gaps))
    vals = rng.choice([1, -1, 2, -2, 7, -7], n_changes).astype(np.int64)  # codes 1..14
    vals[esc_vals] = rng.choice([8, -8, 100, -(1 << (8 * width - 1))], len(esc_vals))  # zigzag >= 15
    if draw(st.booleans()):  # uniform: one gap symbol and one code everywhere
        gaps[:] = gaps[0]
        vals[:] = vals[0]
    positions = np.cumsum(gaps + 1) - 1
    count = int(positions[-1]) + 1 + draw(st.sampled_from([0, 1, 7, 3000]))
    old = rng.integers(0, np.iinfo(dt).max, count, dtype=dt, endpoint=True)
    new = old.copy()
    new[positions] += vals.astype(dt)  # wraps modulo 2**(8 * width), as the codec does
    keep = new[positions] != old[positions]  # a value that wrapped to 0 is not a change
    assert keep.all()
    return old, new


@needs_native
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(escapes_at_edges())
def test_escapes_at_batch_group_and_step_edges_write_what_numpy_writes(pair):
    old, new = pair
    # the encoder's choice (CONST sections where a plane is uniform), and the sparse form in RAW
    # sections whatever the encoder would choose
    forms = all_forms(old, new) + [(CODEC_ADD_SPARSE, _raw_segment(CODEC_ADD_SPARSE, old, new))]
    for codec, data in forms:
        after, digests = both(old, data, codec)
        assert after == new.tobytes() and digests == (digest(old), digest(new)), codec
        back, digests = both(new, data, codec, inverse=True)
        assert back == old.tobytes() and digests == (digest(new), digest(old)), codec
        native = into_outcome(old, data, codec)
        with numpy_path():
            assert into_outcome(old, data, codec) == native, codec
        for want in ((False, False), (False, True)):  # one block for the whole chunk / steps
            t = old.copy()
            got = apply_delta_digests(t, data, codec=codec, before=want[0], after=want[1])
            assert t.tobytes() == new.tobytes() and got == (None, digest(new) if want[1] else None)


@needs_native
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_many_batches_with_escapes_everywhere(width):
    """Thousands of changes (dozens of batches), every gap symbol and code value used, escapes
    in about one group of eight in three, over several blocks: kernel and numpy agree."""
    rng = np.random.default_rng(100 + width)
    dt = UINT[width]
    n_changes = 5000
    gaps = rng.choice(np.arange(0, 300), n_changes)
    vals = rng.integers(-9, 10, n_changes)
    vals[vals == 0] = 1
    positions = np.cumsum(gaps + 1) - 1
    old = rng.integers(0, np.iinfo(dt).max, int(positions[-1]) + 2, dtype=dt, endpoint=True)
    new = old.copy()
    new[positions] += vals.astype(dt)
    for codec, data in all_forms(old, new):
        after, digests = both(old, data, codec)
        assert after == new.tobytes() and digests == (digest(old), digest(new)), codec
        back, _ = both(new, data, codec, inverse=True)
        assert back == old.tobytes(), codec


# --- hostile segments: hand-built with RAW/CONST sections of the right sizes --------------


def _planes(values: np.ndarray, width: int) -> list[bytes]:
    u8 = values.astype(f"<u{width}").view(np.uint8).reshape(-1, width)
    return [u8[:, k].tobytes() for k in range(width)]


def _section(raw: bytes, const: bool):
    return (KIND_CONST, raw[:1], len(raw)) if const and raw and raw == raw[:1] * len(raw) else (KIND_RAW, raw, len(raw))


@st.composite
def hostile_segments(draw):
    """Real segment structures (positions, values, escapes coded by the encoders' own coders)
    stored in RAW/CONST sections, then damaged in their payload or declared counts: zero
    values, bad escapes and padding, positions past the end, wrong counts -- and intact ones.
    Sizes stay consistent with the header, so the payload checks are what is tested."""
    codec = draw(st.sampled_from([CODEC_ADD_SPARSE, CODEC_ADD_DENSE]))
    width = draw(st.sampled_from([1, 2, 4, 8]))
    count = draw(st.integers(1, 1200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(rng.integers(1, min(count, 80) + 1))
    pos = np.sort(rng.choice(count, n, replace=False)).astype(np.int64)
    spread = draw(st.sampled_from([2, 9, 1 << 20]))
    vals = rng.integers(1, spread, n).astype(UINT[width]) * UINT[width](draw(st.sampled_from([1, 255])))
    vals[vals == 0] = 1
    if codec == CODEC_ADD_SPARSE:
        p, v = delta.code_positions(pos), delta.code_values(vals)
        planes, param, aux, n_esc = p.planes + v.planes, p.param, p.n_escaped, v.n_escaped
    else:
        dense = np.zeros(count, UINT[width])
        dense[pos] = vals
        v = delta.code_values(dense)
        planes, param, aux, n_esc = v.planes, 0, 0, v.n_escaped
    const = draw(st.booleans())
    secs = [_section(np.ascontiguousarray(pl).tobytes(), const) for pl in planes]
    n_changed = n + draw(st.sampled_from([0, 0, 0, -1, 1]))  # a lie about the count (dense: checked)
    if codec == CODEC_ADD_SPARSE or not 0 <= n_changed <= count:
        n_changed = n
    data = bytearray(pack(codec, width=width, count=count, n_changed=n_changed, param=param, aux=aux,
                          n_escaped=n_esc, sections=secs))
    payload = len(data) - sum(len(sec[1]) for sec in secs)
    for _ in range(draw(st.sampled_from([0, 1, 1, 2]))):
        if len(data) > payload:
            at = draw(st.integers(payload, len(data) - 1))
            data[at] = draw(st.sampled_from([0, 1, 15, 16, 240, 255, int(rng.integers(0, 256))]))
    return codec, width, count, bytes(data), draw(st.booleans())


@needs_native
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_segments(), st.integers(0, 2**32 - 1))
def test_kernel_and_numpy_refuse_the_same_segments(seg, seed):
    codec, width, count, data, inverse = seg
    base = np.random.default_rng(seed).integers(0, 255, count * width, dtype=np.uint8).view(UINT[width])
    both(base, data, codec, inverse)  # same bytes written, or the same error and nothing written
    native = into_outcome(base, data, codec)
    with numpy_path():
        assert into_outcome(base, data, codec) == native


@needs_native
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_pairs(), st.data())
def test_flipped_bytes_of_real_segments_agree(pair, data):
    old, new = pair
    seg = encode_delta(old, new)
    if seg is None:
        return
    raw = bytearray(seg.data)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(raw)))
    both(old, bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw), seg.codec)


def _raw_segment(codec: str, old: np.ndarray, new: np.ndarray, damage=None) -> bytes:
    """``codec``'s segment from old to new in RAW sections; ``damage(planes)`` may edit them."""
    diff = new - old
    if codec == CODEC_ADD_SPARSE:
        pos = np.flatnonzero(diff)
        p, v = delta.code_positions(pos), delta.code_values(diff[pos])
        planes, param, aux, n = p.planes + v.planes, p.param, p.n_escaped, pos.size
    else:
        v = delta.code_values(diff)
        planes, param, aux, n = v.planes, 0, 0, int(np.count_nonzero(diff))
    planes = [bytearray(np.ascontiguousarray(pl).tobytes()) for pl in planes]
    if damage is not None:
        damage(planes)
    return pack(codec, width=old.itemsize, count=old.size, n_changed=n, param=param, aux=aux,
                n_escaped=v.n_escaped, sections=[(KIND_RAW, bytes(pl), len(pl)) for pl in planes])


@needs_native
@pytest.mark.parametrize("codec", [CODEC_ADD_SPARSE, CODEC_ADD_DENSE])
def test_validation_scans_cross_their_blocks(codec):
    # apply.c counts code nibbles and sums gap bytes in blocks of 2**20 bytes (32-bit counters,
    # so they vectorize): planes longer than several blocks, intact and damaged past the first
    # block, must be accepted and refused exactly as the numpy decoder does.
    rng = np.random.default_rng(11)
    n = (1 << 22) + 5
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    mask = rng.random(n) < 0.7
    mask[-3:] = False  # a short last gap: a larger gap puts the last position past the end
    new[mask] += rng.integers(1, 40, n).astype(np.uint8)[mask]  # codes and escapes
    after, digests = both(old, _raw_segment(codec, old, new), codec)
    assert after == new.tobytes() and digests == (digest(old), digest(new))

    def poke(plane: int, at: float, value: int):
        def edit(planes):
            pl = planes[plane]
            pl[int(len(pl) * at)] = value
        return edit

    refused = 0
    for damage in (poke(0, 0.9, 255), poke(0, 0.6, 0), poke(-1, 0.8, 0), poke(0, 0.999, 254)):
        data = _raw_segment(codec, old, new, damage)
        got = both(old, data, codec)
        refused += isinstance(got[1], str)
    assert refused >= 2  # the damage is seen past the first block (not only accepted bits)


@needs_native
@pytest.mark.parametrize("bad", [
    lambda t: t.astype(np.uint32),  # not the segment's width: a typed error before the kernel
])
def test_kernel_refuses_bad_targets(bad):
    old = np.arange(100, dtype=np.uint16)
    new = old.copy()
    new[3] += np.uint16(1)
    seg = encode_delta(old, new)
    with pytest.raises(CorruptObjectError, match="width"):
        apply_delta(bad(old.copy()), seg.data, codec=seg.codec)
    ro = old.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        apply_delta(ro, seg.data, codec=seg.codec)
    sparse = apply._KERNEL_KIND[CODEC_ADD_SPARSE]
    with pytest.raises(ValueError, match="sections"):  # the kernel checks sizes on its own too
        kernels.apply_segment(old.copy(), sparse, 2, 1, (b"\x00",), 1, 0, 0, False, 0)
    with pytest.raises(ValueError, match="section 1 has 2 bytes"):
        kernels.apply_segment(old.copy(), sparse, 2, 1, (b"\x03", b"\x01\x00"), 1, 0, 0, False, 0)
    with pytest.raises(ValueError, match="unknown kind"):  # the kinds are add-sparse and add-dense only
        kernels.apply_segment(old.copy(), max(apply._KERNEL_KIND.values()) + 1, 2, 1, (b"\x03", b"\x01"), 1, 0, 0, False, 0)


# --- pull_into with the one-pass verification, kernel on and off -------------------------


def _states(seed: int = 0):
    rng = np.random.default_rng(seed)
    a = {
        "w1": torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).to(torch.bfloat16),
        "w2": torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).to(torch.bfloat16),
        "w3": torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).to(torch.bfloat16),
    }
    b = {k: v.clone() for k, v in a.items()}
    for k in ("w1", "w2"):  # w3 unchanged: a kept chunk, hashed up front
        flat = b[k].view(-1)
        idx = torch.from_numpy(rng.choice(flat.numel(), 200, replace=False))
        flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)
    return a, b


def _bits(sd) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in sd.items()}


@pytest.fixture(params=["native", "numpy"])
def path(request):
    if request.param == "native" and not NATIVE:
        pytest.skip("deltastore._native is not built")
    ctx = contextlib.nullcontext() if request.param == "native" else numpy_path()
    with ctx:
        yield request.param


def _store(tmp_path, chunk_bytes=8192):
    a, b = _states()
    url = str(tmp_path / "store")
    with Publisher(url, writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=chunk_bytes)) as pub:
        pub.publish(a)
        pub.publish(b)
    return url, a, b


def test_pull_into_reaches_the_head_bit_exact(tmp_path, path):
    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    sub.pull_into(target)
    assert _bits(target) == _bits(b)


@pytest.mark.parametrize("where", ["patched", "kept"])
def test_modified_target_is_refused_and_left_as_it_was(tmp_path, path, where, monkeypatch):
    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    # a local edit in a chunk the update patches (w2's last chunk, checked in the apply pass
    # after w1's chunks were written) or in one it keeps (w3, checked before any write)
    name = "w2" if where == "patched" else "w3"
    target[name].view(-1)[-1] += 1
    edited = _bits(target)
    import deltastore.read.engine as apply_mod

    hashed_up_front: list[tuple[str, int]] = []
    real = apply_mod.digest_mismatches

    def spy(pool, specs, expected, read):
        hashed_up_front.extend(expected)
        return real(pool, specs, expected, read)

    monkeypatch.setattr(apply_mod, "digest_mismatches", spy)
    with pytest.raises(TargetModifiedError, match=f"tensor '{name}'"):
        sub.pull_into(target)
    assert _bits(target) == edited  # every chunk written before the check was restored
    assert sub.version == 1
    last = (name, 3)  # 64 rows of 256 bf16 in 8 KiB chunks: 4 chunks
    assert (last in hashed_up_front) == (where == "kept")


def test_bad_chunk_in_the_middle_restores_everything(tmp_path, path, monkeypatch):
    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    before = _bits(target)
    calls = itertools.count(1)
    real = apply_delta_digests

    def flaky(t, data, **kw):
        out = real(t, data, **kw)
        if next(calls) == 3:  # the third chunk applied: a wrong result digest
            return out[0], "0" * 32
        return out

    import deltastore.codec as codec_mod

    monkeypatch.setattr(codec_mod, "apply_delta_digests", flaky)
    with pytest.raises(IntegrityError, match="does not match its digest"):
        sub.pull_into(target)
    assert _bits(target) == before
    monkeypatch.undo()
    sub.pull_into(target)  # and the next try goes through
    assert _bits(target) == _bits(b)


def test_corrupt_delta_on_a_modified_chunk_is_a_modified_target(tmp_path, path, monkeypatch):
    # the delta fails before its pass could hash the base: the chunk is hashed before any
    # fallback, so a full segment never overwrites the local edit
    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    target["w1"].view(-1)[0] += 1
    edited = _bits(target)

    import deltastore.codec as codec_mod

    def broken(*args, **kw):
        raise CorruptObjectError("add-sparse/1 segment's padding code is not 0")

    monkeypatch.setattr(codec_mod, "apply_delta_digests", broken)
    with pytest.raises(TargetModifiedError):
        sub.pull_into(target)
    assert _bits(target) == edited


def test_stage_refuses_a_modified_patched_chunk(tmp_path, path):
    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    target["w1"].view(-1)[5] += 1
    edited = _bits(target)
    with pytest.raises(TargetModifiedError):
        sub.stage(target)
    assert _bits(target) == edited


def test_fetched_bytes_are_sha256_checked_once(tmp_path, monkeypatch):
    # A delta version's pack is read whole and its segments tile it (SPEC §3): every byte is
    # checked by its segment's SHA-256, and the pack's own hash would only hash it again.
    import deltastore.read.fetch as apply_mod

    url, a, b = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    hashed = []
    real = apply_mod.sha256_hex

    def spy(data):
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(apply_mod, "sha256_hex", spy)
    before = sub.bytes_fetched
    sub.pull_into(target)
    assert _bits(target) == _bits(b)
    assert hashed and sum(hashed) == sub.bytes_fetched - before


def test_a_corrupt_byte_of_a_whole_pack_is_still_found(tmp_path):
    url, a, _ = _store(tmp_path)
    sub = Subscriber(url)
    target = sub.pull(version=1)
    newest = max((tmp_path / "store").rglob("*.pack"), key=lambda f: f.stat().st_mtime_ns)  # version 2's
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="SHA-256"):
        sub.pull_into(target)
    assert _bits(target) == _bits(a)


def test_a_refused_zstd_frame_does_not_spoil_the_threads_decompressor(path):
    # decode_sections reuses one ZstdDecompressor per thread: after a frame it refused, the
    # next segment on that thread must decode exactly as on a fresh one.
    rng = np.random.default_rng(5)
    old = rng.integers(0, 65535, 200_000, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, 20_000, replace=False)
    new[idx] += rng.integers(1, 3, idx.size).astype(np.uint16)
    seg = encode_delta(old, new)
    refused = 0
    for at in range(40, len(seg.data), max(1, len(seg.data) // 60)):
        bad = bytearray(seg.data)
        bad[at : at + 8] = b"\xff" * 8
        t = old.copy()
        try:
            apply_delta(t, bytes(bad), codec=seg.codec)
        except CorruptObjectError as e:
            refused += "zstd frame" in str(e)
            assert np.array_equal(t, old)
        t = old.copy()
        assert apply_delta_digests(t, seg.data, codec=seg.codec, after=True) == (None, digest(new))
        assert np.array_equal(t, new)
    assert refused  # zstd itself refused some of them
