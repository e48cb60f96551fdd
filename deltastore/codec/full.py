"""Full segments (``full/2``): the values of a whole chunk (an anchor).

The byte planes of the values; float bit patterns may first be rotated left by one bit so that
one plane holds the exponent, and that plane may be coded as pairs of 4-bit codes in a window of
15 exponents (transform 2).
"""

from __future__ import annotations

import numpy as np
import xxhash

from deltastore._util import kernels
from deltastore.codec import planes as _sections
from deltastore.codec.container import (
    CODEC_FULL2,
    EXP_WINDOW,
    FULL_CODECS,
    TRANSFORM_NONE,
    TRANSFORM_PAIRS,
    TRANSFORM_ROTL1,
    Segment,
    SegmentHeader,
    expect_codec,
    pack,
    packed_size,
    read_header,
)
from deltastore.codec.planes import (
    DEFAULT_LEVEL,
    SectionEncoder,
    SectionPieces,
    byte_counts,
    check_dtype,
    check_out,
    check_values,
    check_windows,
    decode_sections,
    join,
    join_into,
    nibbles,
    pack_nibbles,
    rotl1,
    rotr1_inplace,
    split,
    state_digest,
    stream_args,
    unpack_nibbles,
    zstd_error,
)
from deltastore.errors import CorruptObjectError

# Below this many elements the paired exponent form is not tried: its extra section entry and
# Huffman table outweigh any gain on tiny tensors (LayerNorm weights, biases).
MIN_PAIR_COUNT = 4096

# Stride of the sample of exponents from which the paired form's window is chosen.
PAIR_SAMPLE_STRIDE = 16

# Exponent codes of the paired form: 0..14 are exponents low..low+14, 15 escapes. Two codes per
# byte halve Huffman's per-symbol redundancy on the skewed exponent distribution of weights,
# where a few hundredths of a percent of exponents fall outside the window (design 003).
EXP_ESCAPE = 15
assert EXP_ESCAPE == EXP_WINDOW  # the window's codes are 0..14: code 15 escapes (pair_codes)

# From this many elements on, the paired form is written without also compressing the plain
# exponent plane to compare (a second zstd pass over the plane, a large share of an anchor's
# encode) when the sample says few exponents escape the window. Both forms then code the same
# information and pairs halve Huffman's per-symbol redundancy, so on large weight tensors the
# paired form wins (design 006, "Anchor encode"); at 4,096-8,192 elements the plain form often
# wins (its Huffman table is smaller), hence the exact comparison below this size.
PAIRS_ONLY_COUNT = 1 << 17

# Largest share of sampled exponents outside the window for which PAIRS_ONLY_COUNT applies: each
# escape costs a code in the paired stream plus its byte in the escape stream, so with many
# escapes (integers passed as float_bits, or exotic value ranges) the plain form can win. bf16
# weights escape 0.015 %.
PAIRS_ONLY_MAX_ESCAPED = 1 / 256


def encode_full(values: np.ndarray, *, level: int | None = DEFAULT_LEVEL,
                float_bits: bool = False) -> Segment:
    """Encode a whole chunk (an anchor) as a ``full/2`` segment.

    Args:
        values: 1-D contiguous array of dtype uint8/16/32/64 holding raw bit patterns.
        level: ``None`` for the tuned plane parameters
            (:data:`~deltastore.codec.planes.ZSTD_PLANE_PARAMS`), or a zstd level.
        float_bits: the bit patterns are IEEE-style floats (sign, exponent, mantissa: bf16, fp16,
            fp32, fp64). They are then stored rotated left by one bit, so that one byte plane
            holds (nearly) only exponent bits and compresses to their ~2.6-bit entropy, and for
            chunks of at least :data:`MIN_PAIR_COUNT` elements that plane is also tried as
            paired window codes; the smaller form is written and the segment records it, so
            :func:`decode_full` needs no flag (from :data:`PAIRS_ONLY_COUNT` elements, when few
            exponents escape the window, the paired form is written without trying the other). Wrong for integers only in size, never in
            correctness. Ignored for 1-byte elements.

    Returns:
        a :class:`Segment` with ``n_changed == values.size``.

    Raises:
        TypeError, ValueError: ``values`` is not a 1-D contiguous unsigned array (or too long).

    Example::

        >>> x = np.arange(5, dtype=np.uint32)
        >>> s = encode_full(x)
        >>> s.codec, decode_full(s.data, codec=s.codec, dtype=x.dtype, count=5).tolist()
        ('full/2', [0, 1, 2, 3, 4])
    """
    v = check_values(values, "values")
    w, n = v.itemsize, int(v.size)

    def segment(transform: int, sections, exp_low: int = 0, n_escaped: int = 0) -> bytes:
        return pack(CODEC_FULL2, width=w, count=n, n_changed=n, sections=sections,
                    param=transform, aux=exp_low, n_escaped=n_escaped)

    encode = SectionEncoder(level, judge=True)
    if not float_bits or w == 1:
        return Segment(CODEC_FULL2, segment(TRANSFORM_NONE, encode(_planes(v, rotate=False))), n)
    planes = _planes(v, rotate=True)
    if n < MIN_PAIR_COUNT:
        return Segment(CODEC_FULL2, segment(TRANSFORM_ROTL1, encode(planes)), n)
    low, packed, esc, escaped_share = _pair_exponents(planes[-1])
    paired = encode(planes[:-1] + ([packed, esc] if esc.size else [packed]))
    if n >= PAIRS_ONLY_COUNT and escaped_share <= PAIRS_ONLY_MAX_ESCAPED:
        return Segment(CODEC_FULL2, segment(TRANSFORM_PAIRS, paired, low, int(esc.size)), n)
    plain = paired[: w - 1] + encode(planes[-1:])
    # compare the two forms' sizes before packing only the smaller (packing copies the whole
    # segment, mantissa planes included)
    if _size(paired) < _size(plain):
        return Segment(CODEC_FULL2, segment(TRANSFORM_PAIRS, paired, low, int(esc.size)), n)
    return Segment(CODEC_FULL2, segment(TRANSFORM_ROTL1, plain), n)


def _size(sections) -> int:
    return packed_size(len(sections), sum(len(stored) for _, stored, _ in sections))


def _planes(v: np.ndarray, *, rotate: bool) -> list[np.ndarray]:
    """The byte planes of ``v`` (rotated left by one bit first when ``rotate``): one pass in the
    native kernel, else numpy's rotate and strided copies."""
    if kernels.split_planes is None or v.itemsize == 1:
        return split(rotl1(v) if rotate else v)
    out = np.empty((v.itemsize, v.size), dtype=np.uint8)
    kernels.split_planes(v, out, v.itemsize, rotate)
    return list(out)


#: The numpy decoder decodes a chunk of up to this many bytes whole (its planes, and one
#: temporary of the chunk's size for the rotation); a larger one a piece of
#: :data:`PIECE_BYTES` at a time. Whole is what the numpy path has always done for this
#: release's chunks (16 MiB at most by default), bounded by this size (SPEC §7 step 8).
WHOLE_MAX_BYTES = 16 << 20

#: Bytes of the chunk the numpy decoder builds per piece: large enough that the per-piece numpy
#: calls cost nothing next to the work, small enough that a piece's planes stay in cache.
PIECE_BYTES = 4 << 20

#: Bytes of the chunk the native kernel builds per step: a step's planes and output (and the
#: streams' pieces) stay in L2 while they are joined and hashed.
KERNEL_PIECE_BYTES = 128 << 10


def decode_full(data: bytes, *, codec: str, dtype: np.dtype, count: int) -> np.ndarray:
    """Decode a ``full/2`` segment into a new array (:func:`decode_full_into`).

    Args:
        data: the segment bytes.
        codec: the codec the manifest recorded for it (``full/2``).
        dtype: the unsigned dtype expected (its itemsize must match the segment's width).
        count: the element count expected.

    Returns:
        a new writable 1-D array of ``count`` elements of ``dtype``.

    Raises:
        UnknownCodecError: ``codec`` (or the segment's own codec) is unknown.
        CorruptObjectError: the segment is truncated, inconsistent, or disagrees with
            ``codec``/``dtype``/``count``.
        TypeError: ``dtype`` is not an unsigned integer dtype.
    """
    expect_codec(codec, FULL_CODECS, "decode_full")
    dt = check_dtype(dtype)
    h = read_header(data, codec, dt.itemsize, int(count))  # before allocating
    out = np.empty(h.count, dtype=dt)
    _decode_into(data, h, out, False)
    return out


def decode_full_into(data: bytes, out: np.ndarray, *, codec: str, digest: bool = False) -> str | None:
    """Decode a ``full/2`` segment into ``out``, holding at most a bounded amount
    of memory besides it, whatever the chunk's size (SPEC §7 step 8).

    The native kernel builds ``out`` :data:`KERNEL_PIECE_BYTES` at a time from each section's
    next piece (large zstd sections streamed, :data:`~deltastore.codec.planes.STREAM_MIN_BYTES`)
    and hashes each piece as it is written; the numpy path decodes chunks up to
    :data:`WHOLE_MAX_BYTES` whole and larger ones :data:`PIECE_BYTES` at a time. Both write
    the same bits and raise the same errors.

    Args:
        data: the segment bytes.
        out: a writable 1-D contiguous unsigned array of the chunk's element count and width.
        codec: the codec the manifest recorded (``full/2``).
        digest: also return the XXH3-128 hex of the result (SPEC §2's state digest), taken in
            the pass that writes it.

    Returns:
        the digest, or None when not asked.

    Raises:
        UnknownCodecError, CorruptObjectError: as :func:`decode_full`; ``out`` then holds
            unspecified bits.
        TypeError, ValueError: ``out`` is not a writable 1-D contiguous unsigned array.

    Example::

        >>> x = np.arange(5, dtype=np.uint32); out = np.empty_like(x)
        >>> d = decode_full_into(encode_full(x).data, out, codec="full/2", digest=True)
        >>> out.tolist(), d == xxhash.xxh3_128_hexdigest(x.tobytes())
        ([0, 1, 2, 3, 4], True)
    """
    expect_codec(codec, FULL_CODECS, "decode_full")
    o = check_out(out)
    return _decode_into(data, read_header(data, codec, o.itemsize, o.size), o, digest)


def _decode_into(data: bytes, h: SegmentHeader, o: np.ndarray, digest: bool) -> str | None:
    check_windows(data, h)
    if o.dtype.byteorder == ">":  # the codec works in little-endian: decode, then swap in place
        le = o.view(o.dtype.newbyteorder("<"))
        hexdigest = _decode_numpy(data, h, le, digest)
        le.byteswap(inplace=True)
        return hexdigest
    if kernels.decode_full is None or kernels.zstd_decompress is None:
        return _decode_numpy(data, h, o, digest)
    err, a, b, c, d = kernels.decode_full(
        o, h.width, h.transform, h.exp_low, h.n_escaped, stream_args(data, h), digest,
        _sections.STREAM_MIN_BYTES, max(2, KERNEL_PIECE_BYTES // h.width // 2 * 2), _sections.MAX_WINDOW_LOG,
    )
    if err == _ZSTD_FAILED:
        raise zstd_error(h, a, c, b, d)
    if err:
        raise _full_error(err, a, b, h.codec)
    return c


#: decode_full's error codes (deltastore/_native/full.c: F_*).
_PADDING, _ESC_COUNT, _ESC_WINDOW, _ZSTD_FAILED = 1, 2, 3, 9


def _full_error(err: int, declared: int, held: int, codec: str) -> CorruptObjectError:
    """The words of a failed paired-exponent check, on every path (the kernel's code ``err``)."""
    return CorruptObjectError({
        _PADDING: f"{codec} segment's padding code is not 0",
        _ESC_COUNT: f"{codec} segment declares {declared} escaped exponents, its codes hold {held}",
        _ESC_WINDOW: f"{codec} segment escapes an exponent inside its window",
    }[err])


def _decode_numpy(data: bytes, h: SegmentHeader, out: np.ndarray, digest: bool) -> str | None:
    """:func:`decode_full_into` on the numpy path (``out`` little-endian)."""
    if h.count * h.width <= WHOLE_MAX_BYTES:
        _decode_whole(data, h, out)
        return state_digest(out) if digest else None
    return _decode_pieces(data, h, out, digest)


def _decode_whole(data: bytes, h: SegmentHeader, out: np.ndarray) -> None:
    join_into(_whole_planes(data, h), out)
    # the planes are freed before the rotation's temporary is made: the two never coexist (and
    # the heap the read threads keep after a pull is smaller by about a chunk each)
    if h.transform in (TRANSFORM_ROTL1, TRANSFORM_PAIRS):
        rotr1_inplace(out)


def _whole_planes(data: bytes, h: SegmentHeader) -> list:
    secs = decode_sections(data, h)
    if h.transform == TRANSFORM_PAIRS:
        w = h.width
        packed = join(secs[w - 1 : w], (h.count + 1) // 2)
        esc = join(secs[w:], h.n_escaped) if h.n_escaped else None
        secs = secs[: w - 1] + [_unpair_exponents(packed, esc, h.exp_low, h.count, h.n_escaped)]
    return secs


def _decode_pieces(data: bytes, h: SegmentHeader, out: np.ndarray, digest: bool) -> str | None:
    """The numpy path a piece at a time, with the checks of the native kernel in its order:
    zstd failures at once; the padding, the escape count and escapes inside the window at the
    end (each counted over the whole chunk)."""
    w, n = h.width, h.count
    piece = max(2, PIECE_BYTES // w // 2 * 2)
    src = [SectionPieces(data, h, i, piece + 1) for i in range(len(h.sections))]
    pairs = h.transform == TRANSFORM_PAIRS
    n_planes = w - 1 if pairs else w
    hasher = xxhash.xxh3_128() if digest else None
    low = np.uint8(h.exp_low)
    padding = inside = False
    used = held = 0
    for at in range(0, n, piece):
        m = min(piece, n - at)
        secs: list = [s.take(m) for s in src[:n_planes]]
        if pairs:
            packed = src[n_planes].take((m + 1) // 2)
            codes = np.full(m + 1, packed, np.uint8) if isinstance(packed, int) else nibbles(packed)
            padding |= bool(m % 2 and codes[m] != 0)
            codes = codes[:m]
            where = np.flatnonzero(codes == EXP_ESCAPE)
            top = codes + low
            take = min(int(where.size), h.n_escaped - used)
            if take:
                esc = src[n_planes + 1].take(take)
                esc = np.full(take, esc, np.uint8) if isinstance(esc, int) else esc
                inside |= bool(np.any((esc - low) < EXP_WINDOW))
                top[where[:take]] = esc
            used += take
            held += int(where.size)
            secs.append(top)
        part = out[at : at + m]
        join_into(secs, part)
        if h.transform != TRANSFORM_NONE:
            rotr1_inplace(part)
        if hasher is not None:
            hasher.update(memoryview(part).cast("B"))
    for i, s in enumerate(src):
        if not (pairs and i == n_planes + 1 and used != h.n_escaped):
            s.end()
    if padding:
        raise _full_error(_PADDING, 0, 0, h.codec)
    if pairs and held != h.n_escaped:
        raise _full_error(_ESC_COUNT, h.n_escaped, held, h.codec)
    if inside:
        raise _full_error(_ESC_WINDOW, 0, 0, h.codec)
    return hasher.hexdigest() if hasher is not None else None


def _pair_exponents(top: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, float]:
    """The top byte plane as pairs of 4-bit window codes: (window low end, packed codes,
    escaped bytes, share of the sample outside the window). The window is the 15 consecutive
    values holding the most elements."""
    # the window only affects size, not correctness: choose it on a sample (a 1/16 sample picks
    # the same window on real weights)
    counts = byte_counts(top, PAIR_SAMPLE_STRIDE)
    csum = np.concatenate([[0], np.cumsum(counts)])
    in_window = csum[EXP_WINDOW:] - csum[:-EXP_WINDOW]
    low = int(np.argmax(in_window))
    escaped_share = 1.0 - int(in_window[low]) / max(int(csum[-1]), 1)
    if kernels.pair_codes is not None:
        packed = np.empty((top.size + 1) // 2, dtype=np.uint8)
        esc = kernels.pair_codes(top, low, EXP_ESCAPE, packed)
        return low, packed, np.frombuffer(esc, dtype=np.uint8), escaped_share
    codes = top - np.uint8(low)  # wraps: in the window iff < 15
    out = codes >= EXP_WINDOW
    esc = top[out]
    codes[out] = EXP_ESCAPE  # a masked store beats np.minimum 1.7x on weights (few escapes)
    return low, pack_nibbles(codes), esc, escaped_share


def _unpair_exponents(packed: np.ndarray, esc: np.ndarray | None, low: int, count: int,
                      n_escaped: int) -> np.ndarray:
    codes = unpack_nibbles(packed, count, "full/2")
    at = np.flatnonzero(codes == EXP_ESCAPE)
    if at.size != n_escaped:
        raise _full_error(_ESC_COUNT, n_escaped, int(at.size), CODEC_FULL2)
    top = codes + np.uint8(low)  # low <= 241: codes < 15 do not wrap
    if n_escaped:
        if np.any((esc - np.uint8(low)) < EXP_WINDOW):
            raise _full_error(_ESC_WINDOW, 0, 0, CODEC_FULL2)
        top[at] = esc
    return top
