"""The native zstd decoder (deltastore/_native/zstd.c: a segment's frames in one call without
the GIL, through the system's libzstd) against python-zstandard's path in
``planes.decode_sections``: the same planes for every frame python-zstandard writes, and for
hostile frames either the same planes or a CorruptObjectError from both.

Skipped where the extension is not built or no libzstd loads (then only the python path runs,
which the rest of the suite tests).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore._util import kernels
from deltastore.codec import apply
from deltastore.codec.apply import apply_delta_digests
from deltastore.codec.container import ENTRY, HEADER, peek_header
from deltastore.codec.delta import encode_delta
from deltastore.codec.full import encode_full
from deltastore.codec.planes import ZSTD_PLANE_PARAMS, decode_sections, section_args
from deltastore.errors import CorruptObjectError

pytestmark = pytest.mark.skipif(kernels.zstd_decompress is None, reason="native zstd decoder not loaded")

PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _both(data: bytes):
    """decode_sections of ``data`` natively and through python-zstandard: (planes or the
    exception type) for each."""
    h = peek_header(data)
    out = []
    for native in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not native:
                mp.setattr(kernels, "zstd_decompress", None)
            try:
                planes = decode_sections(data, h)
            except CorruptObjectError as e:
                out.append(("error", str(e).split(":")[0]))
            else:
                out.append(("ok", [p if isinstance(p, int) else bytes(p) for p in planes]))
    return out


def _segment(planes: list[bytes]) -> bytes:
    """A full/2 segment of width len(planes) whose planes are ``planes`` (same length), coded
    by the encoder: zstd where it is smaller, else RAW or CONST."""
    n = len(planes[0])
    x = np.frombuffer(b"".join(planes), np.uint8).reshape(len(planes), n).T.copy()
    return encode_full(x.view(f"<u{len(planes)}").reshape(n)).data


def _with_frame(frame: bytes, raw_size: int) -> bytes:
    """A full/2 width-1 segment whose one section is ``frame`` (kind zstd), ``raw_size`` long."""
    return HEADER.pack(b"DSG2", 1, 2, 1, 0, raw_size, raw_size, 0, 0, 1) + ENTRY.pack(1, len(frame)) + frame


plane_bytes = st.one_of(
    st.binary(min_size=1, max_size=3000),
    st.builds(lambda n, k, seed: np.random.default_rng(seed).integers(0, k, n, dtype=np.uint8).tobytes(),
              st.integers(1, 200_000), st.integers(1, 256), st.integers(0, 2**32 - 1)),
)


@PROPS
@given(raw=plane_bytes, level=st.sampled_from([None, 1, 3, 9, 19]), size_flag=st.booleans(), checksum=st.booleans())
def test_same_planes_as_python_zstandard(raw, level, size_flag, checksum):
    if level is None:
        c = zstandard.ZstdCompressor(compression_params=ZSTD_PLANE_PARAMS)
    else:
        c = zstandard.ZstdCompressor(level=level, write_content_size=size_flag, write_checksum=checksum)
    native, python = _both(_with_frame(c.compress(raw), len(raw)))
    assert native == python == ("ok", [raw])


@PROPS
@given(raw=plane_bytes, edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.integers(-8, 8), extra=st.binary(max_size=16), size_delta=st.integers(-2, 2), checksum=st.booleans())
def test_hostile_frames(raw, edits, cut, extra, size_delta, checksum):
    """Flipped bytes, a frame cut short or with bytes after it, a table that says another raw
    size: each path decodes planes of the table's sizes or refuses with CorruptObjectError,
    nothing else. Which of the two is not the same for both: a damaged frame that still
    parses is not defined by the format (with or without a content checksum: a flipped flag
    in the frame header changes what is checked), and two libzstd versions may decode it to
    different bytes or refuse it at different places (1.5.4 and 1.5.7 do, seen here).
    deltastore never decodes a segment before its SHA-256 matched (SPEC §7.6) and checks every
    result against its chunk digest, so such bytes are refused either way."""
    c = zstandard.ZstdCompressor(level=3, write_checksum=checksum)
    frame = bytearray(c.compress(raw))
    for at, x in edits:
        frame[at % len(frame)] ^= x
    if cut < 0:
        frame = frame[:cut]
    frame = bytes(frame) + extra
    size = max(0, len(raw) + size_delta)
    for outcome in _both(_with_frame(frame, size)):
        assert outcome == ("error", "full/2 section 0") or [len(p) for p in outcome[1]] == [size]


def test_every_refusal_kind_names_the_section():
    raw = bytes(range(256)) * 40
    frame = zstandard.ZstdCompressor(level=3).compress(raw)
    two = frame + zstandard.ZstdCompressor(level=3).compress(raw)  # two frames: refused
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"abcd"
    no_size = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(raw)
    cases = {
        "not a zstd frame": _with_frame(b"\x00\x01\x02\x03" + frame[4:], len(raw)),
        "zstd frame claims": _with_frame(frame, len(raw) + 1),
        "bad zstd frame": _with_frame(two, len(raw)),
        "decompressed to": _with_frame(no_size, len(raw) + 7),
    }
    for words, data in cases.items():
        with pytest.raises(CorruptObjectError, match=f"section 0: {words}"):
            decode_sections(data, peek_header(data))
    for data in (_with_frame(skippable, len(raw)), _with_frame(frame + skippable, len(raw))):
        # a skippable frame alone, or after the frame: python-zstandard refuses both
        assert _both(data)[0] == _both(data)[1] == ("error", "full/2 section 0")


def test_a_bomb_is_refused_without_writing_past_the_table_size():
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    frame = b"".join(cobj.compress(bytes(1 << 20)) for _ in range(64)) + cobj.flush()  # 64 MiB of zeros
    data = _with_frame(frame, 1000)
    with pytest.raises(CorruptObjectError, match="bad zstd frame"):
        decode_sections(data, peek_header(data))


def test_the_kernel_checks_its_arguments():
    z = kernels.zstd_decompress
    assert z([], []) == []
    with pytest.raises(ValueError, match="differ"):
        z([b"x"], [])
    with pytest.raises(ValueError, match="non-negative"):
        z([b"x"], [-1])
    with pytest.raises(TypeError):
        z((b"x",), [1])
    with pytest.raises(ValueError, match="buffers"):
        z([object()], [1])


def test_threads_decode_with_their_own_contexts():
    rng = np.random.default_rng(5)
    segments = [_segment([rng.integers(0, k, 50_000, dtype=np.uint8).tobytes() for _ in range(2)]) for k in (3, 17, 200)]
    want = [[bytes(p) for p in decode_sections(s, peek_header(s))] for s in segments]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                for s, w in zip(segments, want):
                    assert [bytes(p) for p in decode_sections(s, peek_header(s))] == w
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --- the apply kernel decoding a segment's zstd frames itself (apply.c, planes.section_args) ---


def _delta_pair(n: int = 60_000, frac: float = 0.05, seed: int = 1):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    new = old.copy()
    pos = np.flatnonzero(rng.random(n) < frac)
    new[pos] += rng.choice(np.array([1, 2, 65535, 300], dtype=np.uint16), pos.size)
    return old, new


def _apply_both(data: bytes, codec: str, old: np.ndarray):
    """apply_delta_digests with the kernel decoding the frames, and with python-zstandard
    decoding them first: (result bits and digest, or the error's section) for each, and
    whether a refused target was left as it was."""
    out = []
    for native in (True, False):
        t = old.copy()
        with pytest.MonkeyPatch.context() as mp:
            if not native:
                mp.setattr(kernels, "zstd_decompress", None)
            try:
                _, after = apply_delta_digests(t, data, codec=codec, after=True)
            except CorruptObjectError as e:
                assert np.array_equal(t, old)  # nothing applied halfway
                out.append(("error", str(e).split(":")[0]))
            else:
                out.append(("ok", t.tobytes(), after))
    return out


def test_the_apply_kernel_decodes_frames_as_python_zstandard_does():
    old, new = _delta_pair()
    seg = encode_delta(old, new)
    assert "zstd" in {s.kind for s in peek_header(seg.data).sections}
    native, python = _apply_both(seg.data, seg.codec, old)
    assert native == python and native[0] == "ok" and native[1] == new.tobytes()


@PROPS
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_the_apply_kernel_refuses_damaged_frames_or_applies_them_whole(edits, seed):
    """Bytes flipped inside a real delta segment's zstd frames (no content checksum: see
    test_hostile_frames): the kernel that decodes them either refuses the segment with a
    CorruptObjectError and leaves the target as it was, or applies it whole, as the path
    through python-zstandard does."""
    old, new = _delta_pair(seed=seed % 7)
    seg = encode_delta(old, new)
    h = peek_header(seg.data)
    data = bytearray(seg.data)
    off, spans = h.header_size, []
    for s in h.sections:
        if s.kind == "zstd":
            spans.append((off, s.stored_size))
        off += s.stored_size
    for at, x in edits:
        start, size = spans[at % len(spans)]
        data[start + (at // len(spans)) % size] ^= x
    for outcome in _apply_both(bytes(data), seg.codec, old):  # asserts an untouched target on refusal
        assert outcome[0] in ("ok", "error")


def test_the_apply_kernel_takes_a_frame_only_as_a_one_tuple():
    old, new = _delta_pair()
    seg = encode_delta(old, new)
    h = peek_header(seg.data)
    secs = section_args(seg.data, h)
    bad = tuple((x[0], x[0]) if type(x) is tuple else x for x in secs)
    with pytest.raises(ValueError, match=r"\(frame,\)"):
        kernels.apply_segment(old.copy(), apply._KERNEL_KIND[seg.codec], h.width, h.gap_width, bad,
                               h.n_changed, h.n_gap_escaped, h.n_escaped, False, 2)
