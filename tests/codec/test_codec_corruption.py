"""deltastore.codec against bad bytes: every failure is typed, bounded in memory, and leaves the
target of apply_delta untouched. The generic properties (truncation, trailing bytes, header
flips, target untouched) run over segments of every codec id and a few widths, once on the
native decoder and once on the numpy path (``kernels.apply_segment`` set to None, as
``DELTASTORE_NATIVE=0`` does); where the native kernels are not built, both runs take the numpy path."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard

from deltastore._util import kernels
from deltastore.codec.apply import apply_delta
from deltastore.codec.compose import compose_deltas
from deltastore.codec.container import (
    CODEC_ADD_DENSE,
    CODEC_ADD_SPARSE,
    CODEC_FULL2,
    FULL_CODECS,
    peek_header,
)
from deltastore.codec.delta import encode_delta
from deltastore.codec.full import decode_full, encode_full
from deltastore.errors import CorruptObjectError, FormatError, IntegrityError, UnknownCodecError

HEADER = struct.Struct("<4sBBBBIIIIB")  # the layout documented in docs/codec-format.md
ENTRY = struct.Struct("<BI")
NAMES = ("magic", "cid", "cver", "width", "param", "count", "n_changed", "n_gap_esc", "n_esc", "n_sections")
TYPED = (CorruptObjectError, UnknownCodecError)


@pytest.fixture(autouse=True, params=["native", "numpy"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both decoders."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "apply_segment", None)
    return request.param


def _old(n: int = 300, width: int = 2) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, 2 ** (8 * width) - 1, size=n, dtype=np.dtype(f"u{width}"), endpoint=True)


def segments():
    """(name, data, codec, dtype, count, base) for one segment of each codec and a few widths.
    base is the target a delta applies to (None for full)."""
    out = []
    for width in (1, 2, 8):
        old = _old(300, width)
        dt = old.dtype
        for fb in (False, True):
            seg = encode_full(old, float_bits=fb)
            assert seg.codec == CODEC_FULL2
            out.append((f"full2-w{width}-float{int(fb)}", seg.data, CODEC_FULL2, dt, 300, None))
        new = old.copy()
        new[[0, 5, 77, 299]] += dt.type(3)
        new[6:7] += dt.type(128)  # an escaped value (zigzag 255 or 256)
        seg = encode_delta(old, new)
        assert seg.codec == CODEC_ADD_SPARSE and peek_header(seg.data).n_escaped == 1
        assert peek_header(seg.data).n_gap_escaped == 0
        out.append((f"add-sparse-w{width}", seg.data, seg.codec, dt, 300, old))
        new = old + dt.type(1)
        new[7:8] += dt.type(127)  # 128 in all: escaped (array arithmetic wraps silently)
        seg = encode_delta(old, new)
        assert seg.codec == CODEC_ADD_DENSE and peek_header(seg.data).n_escaped == 1
        out.append((f"add-dense-w{width}", seg.data, seg.codec, dt, 300, old))
    old = np.zeros(5000, np.uint16)  # zstd-compressed planes, escaped gaps
    new = old.copy()
    new[::7] = 1
    new[3500:3900] = 0  # one gap >= 255
    new[[4000, 4999]] = 0x8000
    seg = encode_delta(old, new)
    h = peek_header(seg.data)
    assert "zstd" in {s.kind for s in h.sections} and h.n_gap_escaped == 1 and h.n_escaped == 2
    out.append(("add-sparse-zstd", seg.data, seg.codec, old.dtype, 5000, old))
    x = np.arange(5000, dtype=np.uint16)
    out.append(("full2-zstd", encode_full(x, float_bits=True).data, CODEC_FULL2, x.dtype, 5000, None))
    for n in (5001, 5002):  # paired exponents (transform 2), odd and even counts, with escapes
        x = _bf16_weights(n)
        seg = encode_full(x, float_bits=True)
        h = peek_header(seg.data)
        assert h.transform == 2 and h.n_escaped > 0
        out.append((f"full2-pairs-{n}", seg.data, CODEC_FULL2, x.dtype, n, None))
    return out


def _bf16_weights(n: int) -> np.ndarray:
    """bf16 bits with a skewed exponent distribution (where pairing pays even on few elements)."""
    rng = np.random.default_rng(n)
    e = 120 + rng.choice(3, size=n, p=[0.85, 0.1, 0.05])
    x = (rng.integers(0, 2, n) << 15) | (e << 7) | rng.integers(0, 128, n)
    x = x.astype(np.uint16)
    x[:3] = [0, 0x7F80, 0x0001]  # zero, inf, subnormal: exponents outside the window
    return x


SEGMENTS = segments()
IDS = [s[0] for s in SEGMENTS]


def decode(data, codec, dtype, count, base, inverse=False):
    """Decode as the puller would; returns the resulting array. base is never modified."""
    if codec in FULL_CODECS:
        return decode_full(data, codec=codec, dtype=dtype, count=count)
    target = base.copy()
    before = target.copy()
    try:
        apply_delta(target, data, codec=codec, inverse=inverse)
    except Exception:
        assert np.array_equal(target, before), "a failed apply_delta modified its target"
        raise
    return target


def patch_header(data: bytes, **fields) -> bytes:
    vals = dict(zip(NAMES, HEADER.unpack_from(data)))
    vals.update(fields)
    return HEADER.pack(*(vals[n] for n in NAMES)) + data[HEADER.size:]


def patch_entry(data: bytes, i: int, **fields) -> bytes:
    off = HEADER.size + i * ENTRY.size
    vals = dict(zip(("kind", "stored"), ENTRY.unpack_from(data, off)))
    vals.update(fields)
    return data[:off] + ENTRY.pack(vals["kind"], vals["stored"]) + data[off + ENTRY.size:]


def test_error_types_fit_the_tree():
    assert issubclass(CorruptObjectError, IntegrityError) and issubclass(UnknownCodecError, FormatError)
    assert issubclass(CorruptObjectError, ValueError) and issubclass(UnknownCodecError, ValueError)


@pytest.mark.parametrize("name,data,codec,dtype,count,base", SEGMENTS, ids=IDS)
def test_segments_decode(name, data, codec, dtype, count, base):
    out = decode(data, codec, dtype, count, base)
    assert out.size == count


@pytest.mark.parametrize("name,data,codec,dtype,count,base", SEGMENTS, ids=IDS)
def test_every_truncation_is_corrupt(name, data, codec, dtype, count, base):
    for n in range(len(data)):
        for inverse in (False, True) if base is not None else (False,):
            with pytest.raises(CorruptObjectError):
                decode(data[:n], codec, dtype, count, base, inverse)


@pytest.mark.parametrize("name,data,codec,dtype,count,base", SEGMENTS, ids=IDS)
def test_inverse_undoes(name, data, codec, dtype, count, base):
    if base is None:
        return
    new = decode(data, codec, dtype, count, base)
    assert np.array_equal(decode(data, codec, dtype, count, new, inverse=True), base)


@pytest.mark.parametrize("name,data,codec,dtype,count,base", SEGMENTS, ids=IDS)
def test_trailing_bytes_are_corrupt(name, data, codec, dtype, count, base):
    with pytest.raises(CorruptObjectError, match="trailing"):
        decode(data + b"\x00", codec, dtype, count, base)


@pytest.mark.parametrize("name,data,codec,dtype,count,base", SEGMENTS, ids=IDS)
def test_every_header_byte_flip_is_caught_or_harmless(name, data, codec, dtype, count, base):
    """Any change to the header or section table raises a typed error, or (rarely: e.g. a
    one-byte RAW section relabelled CONST) decodes to exactly the same values."""
    good = decode(data, codec, dtype, count, base)
    header_size = peek_header(data).header_size
    caught = 0
    # full/2's transform byte (7) is a valid choice either way for width > 1, and so is the
    # exponent window (byte 16) of transform 2: flipping them changes the values, which only the
    # manifest's chunk digest can notice (segments carry no checksum)
    skip = {7, 16} if codec == CODEC_FULL2 and np.dtype(dtype).itemsize > 1 else set()
    for i in sorted(set(range(header_size)) - skip):
        for mask in (0x01, 0x02, 0x10, 0x80, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            try:
                out = decode(bytes(bad), codec, dtype, count, base)
            except TYPED:
                caught += 1
                continue
            assert np.array_equal(out, good), f"byte {i} ^ {mask:#x} decoded to different values"
    assert caught >= header_size * 5 * 0.9


def _zstd_frame_claiming(content_size: int) -> bytes:
    """A zstd frame header claiming content_size bytes (8-byte FCS, single segment), then one
    RLE block. Decompressing it naively would allocate content_size bytes up front."""
    fhd = 0b1110_0000  # FCS field 8 bytes, single-segment, no checksum, no dict id
    block = (1 << 0) | (1 << 1) | (1000 << 3)  # last block, type RLE, 1000 repeats
    return struct.pack("<IBQ", 0xFD2FB528, fhd, content_size) + block.to_bytes(3, "little") + b"\x00"


def _full_segment_with_plane(plane_stored: bytes, count: int) -> bytes:
    """A full/2 segment of ``count`` bytes (width 1) whose one section is ``plane_stored`` (zstd)."""
    return HEADER.pack(b"DSG2", 1, 2, 1, 0, count, count, 0, 0, 1) + ENTRY.pack(1, len(plane_stored)) + plane_stored


def test_zstd_frame_lying_about_its_size_is_rejected_without_allocating():
    assert zstandard.frame_content_size(_zstd_frame_claiming(1 << 45)) == 1 << 45
    data = _full_segment_with_plane(_zstd_frame_claiming(1 << 45), 1000)  # 32 TiB
    with pytest.raises(CorruptObjectError, match="claims"):
        decode_full(data, codec=CODEC_FULL2, dtype=np.uint8, count=1000)
    ok = _full_segment_with_plane(_zstd_frame_claiming(1000), 1000)  # the crafted frame is valid
    assert np.array_equal(decode_full(ok, codec=CODEC_FULL2, dtype=np.uint8, count=1000), np.zeros(1000, np.uint8))
    # a huge count is refused by the caller's expectation before any section is read
    bomb = HEADER.pack(b"DSG2", 1, 2, 1, 0, 2**32 - 1, 2**32 - 1, 0, 0, 1) + data[HEADER.size:]
    with pytest.raises(CorruptObjectError, match="elements"):
        decode_full(bomb, codec=CODEC_FULL2, dtype=np.uint8, count=1000)


def test_zstd_frame_without_size_that_expands_too_far_is_rejected():
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    chunk = bytes(1 << 20)
    frame = b"".join(cobj.compress(chunk) for _ in range(64)) + cobj.flush()  # 64 MiB of zeros
    assert zstandard.frame_content_size(frame) == -1
    data = _full_segment_with_plane(frame, 1000)
    with pytest.raises(CorruptObjectError, match="zstd"):
        decode_full(data, codec=CODEC_FULL2, dtype=np.uint8, count=1000)


def test_garbage_zstd_payload_is_corrupt_not_zstderror():
    x = np.arange(5000, dtype=np.uint16)
    data = bytearray(encode_full(x).data)
    h = peek_header(bytes(data))
    assert h.sections[0].kind == "zstd"
    data[h.header_size : h.header_size + 4] = b"\x00\x01\x02\x03"  # destroy frame magic
    with pytest.raises(CorruptObjectError, match="zstd"):
        decode_full(bytes(data), codec=CODEC_FULL2, dtype=np.uint16, count=5000)
    data = bytearray(encode_full(x).data)
    data[h.header_size + 20] ^= 0xFF  # inside the compressed stream
    try:
        out = decode_full(bytes(data), codec=CODEC_FULL2, dtype=np.uint16, count=5000)
    except CorruptObjectError:
        pass
    else:  # no checksum inside segments (the manifest's digest catches this); but typed or sized
        assert out.size == 5000


def test_position_beyond_count_leaves_target_unchanged():
    """Changes at 5 (valid) and 150 (beyond a 100-element target): nothing may be applied."""
    old = np.zeros(200, np.uint16)
    new = old.copy()
    new[[5, 150]] = 9
    seg = encode_delta(old, new)
    bad = patch_header(seg.data, count=100)
    target = np.zeros(100, np.uint16)
    with pytest.raises(CorruptObjectError, match="position 150"):
        apply_delta(target, bad, codec=seg.codec)
    assert not target.any()


def test_wrong_codec_argument():
    old = _old(300, 2)
    new = old.copy()
    new[3] += np.uint16(1)
    sparse = encode_delta(old, new)
    full = encode_full(old)
    t = old.copy()
    with pytest.raises(CorruptObjectError, match="manifest says"):
        apply_delta(t, sparse.data, codec=CODEC_ADD_DENSE)
    with pytest.raises(UnknownCodecError):
        apply_delta(t, sparse.data, codec="add-sparse/2")
    with pytest.raises(UnknownCodecError):
        apply_delta(t, sparse.data, codec="lz4")
    with pytest.raises(ValueError, match="decode_full"):
        apply_delta(t, full.data, codec=CODEC_FULL2)
    with pytest.raises(CorruptObjectError, match="manifest says"):
        apply_delta(t, full.data, codec=CODEC_ADD_SPARSE)
    assert np.array_equal(t, old)
    with pytest.raises(ValueError):
        decode_full(sparse.data, codec=CODEC_ADD_SPARSE, dtype=np.uint16, count=300)
    with pytest.raises(CorruptObjectError, match="manifest says"):
        decode_full(sparse.data, codec=CODEC_FULL2, dtype=np.uint16, count=300)
    with pytest.raises(CorruptObjectError, match="width"):
        decode_full(full.data, codec=CODEC_FULL2, dtype=np.uint32, count=300)
    with pytest.raises(CorruptObjectError, match="elements"):
        decode_full(full.data, codec=CODEC_FULL2, dtype=np.uint16, count=301)
    with pytest.raises(CorruptObjectError, match="width"):
        apply_delta(old.astype(np.uint32), sparse.data, codec=sparse.codec)


@pytest.mark.parametrize("recorded", ["full/1", "xor-sparse/1", "xor-dense/1"])
def test_codecs_of_an_earlier_format_are_refused(recorded):
    """A manifest recording a codec of an earlier format (full/1, xor-*/1) gets UnknownCodecError
    naming that codec; the target is untouched."""
    old = _old(300, 2)
    new = old.copy()
    new[3] += np.uint16(1)
    seg = encode_delta(old, new)
    t = old.copy()
    with pytest.raises(UnknownCodecError, match=recorded):
        apply_delta(t, seg.data, codec=recorded)
    with pytest.raises(UnknownCodecError, match=recorded):
        decode_full(encode_full(old).data, codec=recorded, dtype=np.uint16, count=300)
    assert np.array_equal(t, old)


def _dsg1_full_segment(values: np.ndarray) -> bytes:
    """A ``DSG1`` segment as earlier formats wrote it: full/1 of one-byte ``values``, one RAW
    section (28-byte header, 12-byte table entries)."""
    head = struct.pack("<4sBBBBQQB3s", b"DSG1", 1, 1, 1, 0, values.size, values.size, 1, bytes(3))
    return head + struct.pack("<B3sII", 0, bytes(3), values.size, values.size) + values.tobytes()


def test_a_dsg1_segment_is_refused():
    """The container of an earlier format is not read: UnknownCodecError naming its magic,
    whatever codec the caller expects, before anything is written."""
    x = np.arange(100, dtype=np.uint8)
    data = _dsg1_full_segment(x)
    with pytest.raises(UnknownCodecError, match="DSG1"):
        peek_header(data)
    with pytest.raises(UnknownCodecError, match="DSG1"):
        decode_full(data, codec=CODEC_FULL2, dtype=np.uint8, count=100)
    t = x.copy()
    with pytest.raises(UnknownCodecError, match="DSG1"):
        apply_delta(t, data, codec=CODEC_ADD_DENSE)
    assert np.array_equal(t, x)


def test_compose_validates_both_inputs():
    old = _old(300, 2)
    new = old.copy()
    new[3] += np.uint16(1)
    seg = encode_delta(old, new)
    with pytest.raises(CorruptObjectError):
        compose_deltas(seg.data, seg.data[:-1], codec_a=seg.codec, codec_b=seg.codec, dtype=np.uint16, count=300)
    with pytest.raises(CorruptObjectError):
        compose_deltas(seg.data, seg.data, codec_a=seg.codec, codec_b=seg.codec, dtype=np.uint16, count=299)
    with pytest.raises(UnknownCodecError):
        compose_deltas(seg.data, seg.data, codec_a=seg.codec, codec_b="nope/1", dtype=np.uint16, count=300)
    # a then its inverse cancels
    neg = encode_delta(new, old)
    assert compose_deltas(seg.data, neg.data, codec_a=seg.codec, codec_b=neg.codec, dtype=np.uint16, count=300) is None


def _sparse():
    old = _old(300, 2)
    new = old.copy()
    new[[0, 5, 77, 299]] += np.uint16(3)
    new[6] += np.uint16(200)
    return old, encode_delta(old, new)


@pytest.mark.parametrize(
    "fields,error,match",
    [
        ({"magic": b"DSG3"}, UnknownCodecError, "magic"),
        ({"cid": 9}, UnknownCodecError, "codec id 9"),
        ({"magic": b"DSG1"}, UnknownCodecError, "magic"),  # the container of an earlier format
        ({"cver": 1}, UnknownCodecError, "version 1"),  # full/1: a codec of an earlier format
        ({"cid": 2}, UnknownCodecError, "codec id 2"),  # xor-sparse/1: likewise
        ({"width": 3}, CorruptObjectError, "width"),
        ({"width": 4}, CorruptObjectError, "width|sections"),
        ({"param": 3}, CorruptObjectError, "transform"),
        ({"width": 1, "param": 1}, CorruptObjectError, "transform|width"),
        ({"count": 299}, CorruptObjectError, "count 299|299 elements"),
        ({"n_changed": 299}, CorruptObjectError, "n_changed"),
        ({"n_esc": 1}, CorruptObjectError, "escapes"),
        ({"n_gap_esc": 1}, CorruptObjectError, "escapes"),
        ({"n_sections": 3}, CorruptObjectError, "sections"),
    ],
)
def test_flipped_header_fields_full(fields, error, match):
    data = patch_header(encode_full(_old(300, 2), float_bits=True).data, **fields)
    with pytest.raises(error, match=match):
        decode_full(data, codec=CODEC_FULL2, dtype=np.uint16, count=300)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"n_changed": 4}, "stores|truncated|trailing|symbols|escape"),
        ({"n_changed": 6}, "stores|truncated|trailing|symbols|escape"),
        ({"n_changed": 0}, "no changed"),
        ({"n_esc": 0}, "sections"),
        ({"n_esc": 2}, "truncated|trailing|escape"),
        ({"n_gap_esc": 1}, "sections"),
        ({"param": 4}, "gap width"),
        ({"param": 3}, "gap width"),
        ({"cid": 5}, "manifest says|add-dense"),  # now claims to be add-dense
        ({"count": 301}, "elements"),
        ({"count": 2**32 - 1}, "elements"),
    ],
)
def test_flipped_header_fields_add_sparse_leave_target_alone(fields, match):
    old, seg = _sparse()
    for inverse in (False, True):
        target = old.copy()
        with pytest.raises(CorruptObjectError, match=match):
            apply_delta(target, patch_header(seg.data, **fields), codec=seg.codec, inverse=inverse)
        assert np.array_equal(target, old)


def test_add_dense_n_changed_is_checked_against_the_payload():
    old = _old(300, 2)
    seg = encode_delta(old, old + np.uint16(1))
    assert seg.codec == CODEC_ADD_DENSE
    target = old.copy()
    with pytest.raises(CorruptObjectError, match="holds 300"):
        apply_delta(target, patch_header(seg.data, n_changed=299), codec=seg.codec)
    assert np.array_equal(target, old)


def _raw_add_sparse(gap_syms, val_codes, esc_vals=(), gap_esc=(), count=100, pad=0) -> bytes:
    """An add-sparse/1 bf16 segment with RAW sections, built by hand."""
    n = len(gap_syms)
    secs = [bytes(gap_syms)]
    if gap_esc:
        secs.append(bytes(gap_esc))  # gap width 1
    codes = list(val_codes) + ([pad] if len(val_codes) % 2 else [])
    secs.append(bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)))
    if esc_vals:
        v = np.array(esc_vals, dtype="<u2").view(np.uint8).reshape(-1, 2)
        secs += [v[:, 0].tobytes(), v[:, 1].tobytes()]
    head = HEADER.pack(b"DSG2", 4, 1, 2, 1, count, n, len(gap_esc), len(esc_vals), len(secs))
    return head + b"".join(ENTRY.pack(0, len(s)) for s in secs) + b"".join(secs)


def test_hand_built_add_sparse_decodes():
    # positions 5, 6 and 6 + 1 + (255 + 3) = 265
    t = np.zeros(300, np.uint16)
    apply_delta(t, _raw_add_sparse([5, 0, 255], [2, 1, 15], esc_vals=[600], gap_esc=[3], count=300),
                codec=CODEC_ADD_SPARSE)
    expected = np.zeros(300, np.uint16)
    expected[[5, 6, 265]] = [1, 0xFFFF, 300]  # unzigzag: 2 -> 1, 1 -> -1, 600 -> 300
    assert np.array_equal(t, expected)


@pytest.mark.parametrize(
    "seg,match",
    [
        (_raw_add_sparse([5, 0, 0], [2, 0, 4]), "zero difference"),
        (_raw_add_sparse([5, 0, 0], [2, 15, 4], esc_vals=[14]), "below 15"),
        (_raw_add_sparse([5, 0, 0], [2, 15, 4]), "escaped values"),
        (_raw_add_sparse([5, 0, 0], [2, 3, 4], pad=1), "padding"),
        (_raw_add_sparse([5, 0, 0], [2, 3, 4], esc_vals=[300]), "escaped values"),
        (_raw_add_sparse([5, 0, 255], [2, 3, 4]), "escaped gaps"),
        (_raw_add_sparse([5, 0, 7], [2, 3, 4], gap_esc=[1]), "escaped gaps"),
        (_raw_add_sparse([5, 0, 93], [2, 3, 4]), "position 100"),
        (_raw_add_sparse([5, 0, 255], [2, 3, 4], gap_esc=[200]), "position 200 or beyond"),
    ],
)
def test_bad_add_sparse_payload_leaves_target_alone(seg, match):
    for inverse in (False, True):
        target = np.arange(100, dtype=np.uint16)
        with pytest.raises(CorruptObjectError, match=match):
            apply_delta(target, seg, codec=CODEC_ADD_SPARSE, inverse=inverse)
        assert np.array_equal(target, np.arange(100, dtype=np.uint16))


@pytest.mark.parametrize("entry,match", [({"kind": 7}, "unknown kind"), ({"stored": 10}, "stores|truncated|trailing"),
                                         ({"kind": 2}, "const")])
def test_flipped_section_entries(entry, match):
    data = patch_entry(encode_full(_old(300, 2)).data, 1, **entry)
    with pytest.raises(CorruptObjectError, match=match):
        decode_full(data, codec=CODEC_FULL2, dtype=np.uint16, count=300)


def test_paired_exponent_fields_are_checked():
    x = _bf16_weights(5001)
    seg = encode_full(x, float_bits=True)
    h = peek_header(seg.data)
    for fields, match in [({"n_gap_esc": 242}, "window"), ({"n_gap_esc": 0}, "escapes an exponent"),
                          ({"n_esc": h.n_escaped + 1}, "stores|truncated|trailing|escaped"),
                          ({"param": 1}, "escapes")]:
        with pytest.raises(CorruptObjectError, match=match):
            decode_full(patch_header(seg.data, **fields), codec=CODEC_FULL2, dtype=np.uint16, count=5001)
