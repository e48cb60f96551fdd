"""Byte planes and their entropy coding: the sections every codec is made of.

A section is one byte plane (or a stream of one-byte codes) stored as RAW, ZSTD or CONST,
whichever is smallest. Also here: the element transforms the codecs share (zigzag, rotation
by one bit, 4-bit code pairs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Union

import numpy as np
import xxhash
import zstandard

from deltastore._util import kernels
from deltastore.codec.container import (
    KIND_CONST,
    KIND_RAW,
    KIND_ZSTD,
    MAX_COUNT,
    SectionInfo,
    SegmentHeader,
)
from deltastore.errors import CorruptObjectError

# Byte planes are memoryless sources (mantissa bytes, XOR low bytes, gap low bytes): the win is
# zstd's Huffman coding of literals, and LZ matches mostly cost more than they save. So by default
# (``level=None``) planes use zstd's fast strategy with the longest minimum match (7) and a tiny
# hash table, i.e. nearly literals-only. Measured on bf16 weights and Adam-step XORs (1M-4M
# elements): exponent plane 1.015x its order-0 entropy (level 3: 1.27x, level 19: 1.015x at
# 1 MB/s), XOR low-byte plane 1.12x (level 3: 1.25x), at 200+ MB/s per plane.
ZSTD_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    min_match=7,
    hash_log=6,
    search_log=1,
    window_log=17,  # one zstd block: matches farther back would not pay anyway
    target_length=0,  # > 0 with the fast strategy switches Huffman off (zstd's negative levels)
)

# ``level=None`` selects ZSTD_PLANE_PARAMS; an int selects that plain zstd level instead.
DEFAULT_LEVEL = None

# Smallest stored size worth handing to zstd: a frame costs ~10 bytes of header, so a plane this
# short is stored RAW (or CONST) without trying.
MIN_ZSTD_INPUT = 32

# Planes up to this size are looked at as bytes (:func:`_encode_section`): for a plane of a
# few hundred bytes numpy's min/max cost more (~3 µs each) than the copy does.
SMALL_PLANE = 4096

# Judged planes (anchors, ``SectionEncoder(judge=True)``): a plane of at least MIN_JUDGED_PLANE
# bytes is first looked at through the histogram of a 1/SAMPLE_STRIDE sample. The sample is big
# enough to judge (>= 2,048 bytes) and far cheaper than the passes it saves: a sample with two
# values proves the plane is not CONST (no full min/max pass), and a near-uniform one means zstd
# cannot gain, so the plane is stored RAW without compressing it (the mantissa plane of bf16
# weights, which zstd does not shrink: design 006, "Anchor encode").
# Below this size planes are always tried exactly (and the golden segments are all smaller).
MIN_JUDGED_PLANE = 1 << 17

# Stride of a judged plane's sample: one byte per 64-byte cache line.
SAMPLE_STRIDE = 64

# Sampled order-0 entropy (bits per byte) at or above which a judged plane is stored RAW untried.
# zstd (ZSTD_PLANE_PARAMS) gained nothing on 2 MiB mixtures of uniform and skewed bytes down to
# 7.88 bits and 2.4 % at 7.75; a small sample underestimates entropy, so errors fall on the side
# of trying zstd. Only with the tuned parameters (level None): a high level may find LZ matches.
RAW_ENTROPY_BITS = 7.9

UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

# A decoded section: a uint8 array, or the byte of a CONST section (expanded only when joined)
Plane = Union[np.ndarray, int]


def check_values(a: np.ndarray, what: str) -> np.ndarray:
    """Validate a caller array; return it as a little-endian view (a no-op on LE machines)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be 1-D and contiguous, got shape {a.shape}")
    if a.dtype.kind != "u":
        raise TypeError(
            f"{what} must have an unsigned integer dtype (raw bit view), got {a.dtype}; "
            "pass e.g. tensor.view(torch.int16).numpy().view(np.uint16) for bf16"
        )
    if a.size > MAX_COUNT:
        raise ValueError(f"{what} has {a.size} elements, more than {MAX_COUNT}; split it into chunks")
    return a.astype(UINT[a.itemsize], copy=False)


def check_dtype(dtype) -> np.dtype:
    """A caller's dtype argument: must be an unsigned integer dtype (a raw bit view)."""
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise TypeError(f"dtype must be an unsigned integer dtype, got {dt}")
    return dt


def check_out(out: np.ndarray) -> np.ndarray:
    """Validate a caller's output array: 1-D, contiguous, writable, of an unsigned dtype."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    if out.ndim != 1 or not out.flags.c_contiguous or out.dtype.kind != "u":
        raise ValueError(f"out must be a 1-D contiguous unsigned array, got {out.dtype} {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def state_digest(a: np.ndarray) -> str:
    """XXH3-128 hex of a contiguous array's bytes (SPEC §2's state digest); the native one
    releases the GIL."""
    buf = memoryview(a).cast("B")
    if kernels.xxh3_128_hex is not None:
        return kernels.xxh3_128_hex(buf)
    return xxhash.xxh3_128_hexdigest(buf)


# --- planes -------------------------------------------------------------------------------


def split(a: np.ndarray) -> list[np.ndarray]:
    """Split a 1-D little-endian array into its byte planes (plane k = byte k of each element)."""
    w = a.itemsize
    if w == 1:
        return [a.view(np.uint8)]
    # a truncating cast of each shifted element (vectorized) rather than strided byte copies:
    # 20 % faster on 8M uint16
    return [(a >> a.dtype.type(8 * k) if k else a).astype(np.uint8) for k in range(w)]


def join(planes: Sequence[Plane], n: int) -> np.ndarray:
    """Inverse of :func:`split`: a new writable little-endian uint array of n elements."""
    w = len(planes)
    if w == 1:
        p = planes[0]
        if isinstance(p, int):
            return np.full(n, p, dtype=np.uint8)
        return p.copy()
    out = np.empty(n, dtype=UINT[w])
    join_into(planes, out)
    return out


def join_into(planes: Sequence[Plane], out: np.ndarray) -> None:
    """:func:`join` into ``out`` (little-endian, of the planes' width and length)."""
    u8 = out.view(np.uint8).reshape(out.size, len(planes))
    for k, p in enumerate(planes):
        u8[:, k] = p


# --- sections -----------------------------------------------------------------------------


_local = threading.local()  # per thread: level -> ZstdCompressor, and one ZstdDecompressor


#: Frames up to this size are decoded by the thread's reused decompressor (its ~20 µs set-up
#: is what a small segment costs); bigger ones by a fresh one, whose set-up is noise next to
#: the frame, because a reused context that once decoded a multi-MiB frame kept the worker's
#: peak memory 0.07× the model higher (benchmarks.perf: 1.17 -> 1.24).
DCTX_REUSE_MAX_BYTES = 1 << 20


def _dctx() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: not thread-safe, and making one per segment cost ~20 µs
    (a context allocation; a reused one decompresses a small frame in ~1 µs). Each
    decompress() call reads one complete frame, so reuse does not change what it returns."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _cctx(level: int | None) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``: compressors are not thread-safe, and making one
    per segment costs ~14 µs (most of a small tensor's encode time). Each compress() call is
    a complete frame (the context is reset), so reuse does not change the bytes."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        if level is None:
            c = zstandard.ZstdCompressor(compression_params=ZSTD_PLANE_PARAMS)
        else:
            c = zstandard.ZstdCompressor(level=level)
        cache[level] = c
    return c


def byte_counts(plane: np.ndarray, stride: int) -> np.ndarray:
    """Counts of each byte value in ``plane[::stride]`` (256 int64): the native kernel, else
    numpy's bincount (which widens the sample to intp first)."""
    if kernels.byte_histogram is not None and plane.dtype == np.uint8 and plane.flags.c_contiguous:
        out = np.empty(256, dtype=np.int64)
        kernels.byte_histogram(plane, stride, out)
        return out
    return np.bincount(plane[::stride], minlength=256).astype(np.int64, copy=False)


def sample_entropy(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per byte of a histogram (0.0 for an empty one)."""
    c = counts[counts > 0]
    if c.size == 0:
        return 0.0
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def _encode_section(plane: np.ndarray, cctx: zstandard.ZstdCompressor, judge: bool = False,
                    raw_if_uniform: bool = False) -> tuple[int, bytes, int]:
    """Pick the smallest of CONST / ZSTD / RAW for one plane: (kind, stored bytes, raw size).

    ``judge``: a sample may prove a big plane is not CONST (see MIN_JUDGED_PLANE); with
    ``raw_if_uniform`` too, a near-uniform big plane is stored RAW without trying zstd."""
    n = plane.size
    if judge and n >= MIN_JUDGED_PLANE:
        counts = byte_counts(plane, SAMPLE_STRIDE)
        if np.count_nonzero(counts) > 1:  # two values: not CONST, no min/max pass needed
            if raw_if_uniform and sample_entropy(counts) >= RAW_ENTROPY_BITS:
                return KIND_RAW, memoryview(np.ascontiguousarray(plane)).cast("B"), n
            z = cctx.compress(plane)
            if len(z) < n:
                return KIND_ZSTD, z, n
            return KIND_RAW, memoryview(np.ascontiguousarray(plane)).cast("B"), n
    if n <= SMALL_PLANE and plane.itemsize == 1:
        # a small plane (a delta's planes in a small chunk, per changed chunk of every version)
        # as bytes: one copy of at most SMALL_PLANE bytes instead of numpy reductions, same choice
        return _byte_section(plane.tobytes(), cctx)
    # All equal? Two differing end elements say no at once: a delta's planes (gap symbols,
    # value codes) are rarely CONST, and the min/max reductions cost ~3 µs per plane, several
    # planes per changed chunk. Otherwise min == max (no n-byte temporary, unlike plane != plane[0]).
    if n and plane[0] == plane[n - 1] and plane.min() == plane.max():
        return KIND_CONST, bytes(plane[:1]), n
    if n >= MIN_ZSTD_INPUT:
        z = cctx.compress(plane)
        if len(z) < n:
            return KIND_ZSTD, z, n
    return KIND_RAW, memoryview(np.ascontiguousarray(plane)).cast("B"), n


def _short_section(raw: bytes) -> tuple[int, bytes, int] | None:
    """:func:`_encode_section`'s choice for a plane held as bytes, without numpy, when zstd is
    not tried: CONST when every byte is equal, RAW when it is too short; None: try zstd."""
    n = len(raw)
    if n and raw[0] == raw[n - 1] and raw.count(raw[0]) == n:  # differing ends: not CONST at once
        return KIND_CONST, raw[:1], n
    return (KIND_RAW, raw, n) if n < MIN_ZSTD_INPUT else None


def _zstd_section(raw: bytes, z: bytes) -> tuple[int, bytes, int]:
    """ZSTD when ``z`` (``raw`` compressed) is smaller, else RAW."""
    return (KIND_ZSTD, z, len(raw)) if len(z) < len(raw) else (KIND_RAW, raw, len(raw))


def _byte_section(raw: bytes, cctx: zstandard.ZstdCompressor) -> tuple[int, bytes, int]:
    """:func:`_encode_section`'s choice for a plane held as bytes, without numpy: CONST when
    every byte is equal, else ZSTD when it is smaller, else RAW."""
    got = _short_section(raw)
    return got if got is not None else _zstd_section(raw, cctx.compress(raw))


def encode_byte_sections(planes: Sequence[bytes], level: int | None) -> list[tuple[int, bytes, int]]:
    """:func:`encode_sections` of planes held as bytes (the native kernels' output): the same
    sections, at a few microseconds less per plane than numpy arrays cost (a delta publish
    encodes 2-7 planes per changed chunk, and a step changes hundreds of chunks)."""
    cctx = _cctx(level)
    return [_byte_section(p, cctx) for p in planes]


def encode_byte_sections_many(planes: Sequence[Sequence[bytes]],
                              level: int | None) -> list[list[tuple[int, bytes, int]]]:
    """:func:`encode_byte_sections` of several segments' planes (``planes[i]``: segment i's),
    the planes zstd is tried on compressed by one call (python-zstandard's
    ``multi_compress_to_buffer``: the same frames as one ``compress`` each, but the GIL given up
    once, not once per plane, which on busy encode threads is most of a small plane's cost)."""
    cctx = _cctx(level)
    out: list[list[tuple[int, bytes, int] | None]] = [[_short_section(p) for p in ps] for ps in planes]
    todo = [(i, j) for i, ps in enumerate(out) for j, got in enumerate(ps) if got is None]
    if todo:
        raws = [planes[i][j] for i, j in todo]
        try:
            got = cctx.multi_compress_to_buffer(raws)
            zs = [got[k].tobytes() for k in range(len(raws))]
        except (AttributeError, NotImplementedError):  # a backend without it (cffi)
            zs = [cctx.compress(r) for r in raws]
        for (i, j), raw, z in zip(todo, raws, zs):
            out[i][j] = _zstd_section(raw, z)
    return out  # type: ignore[return-value]  # every None was filled


class SectionEncoder:
    """Encodes planes into sections with this thread's zstd compressor for ``level`` (use it on
    the thread that made it). ``judge``: big planes are first judged from a sample
    (MIN_JUDGED_PLANE), which the anchor encoder uses; the delta codecs try every kind exactly."""

    def __init__(self, level: int | None, *, judge: bool = False):
        self._cctx = _cctx(level)
        self._judge = judge
        self._raw_if_uniform = judge and level is None  # see RAW_ENTROPY_BITS

    def __call__(self, planes: Sequence[np.ndarray]) -> list[tuple[int, bytes, int]]:
        return [_encode_section(p, self._cctx, self._judge, self._raw_if_uniform) for p in planes]


def encode_sections(planes: Sequence[np.ndarray], level: int | None) -> list[tuple[int, bytes, int]]:
    """Each plane as its smallest section: [(kind, stored bytes, raw size)]."""
    return SectionEncoder(level)(planes)


def _stored(data: bytes, h: SegmentHeader) -> Iterator[tuple[int, SectionInfo, memoryview]]:
    """Each section's index, table entry and stored bytes (a view of ``data``)."""
    mv = memoryview(data)
    off = h.header_size
    for i, s in enumerate(h.sections):
        yield i, s, mv[off : off + s.stored_size]
        off += s.stored_size


def decode_sections(data: bytes, h: SegmentHeader) -> list[Plane]:
    """Decode each section to a uint8 array (or an int for a CONST plane). Sizes are trusted
    only because :func:`~deltastore.codec.container.read_header` already checked them against
    the caller's expectations.

    The zstd sections are decoded by the native ``zstd_decompress`` (all of them in one call
    without the GIL, through the system's libzstd) when it is loaded, else one python-zstandard
    call each: the same bytes, and the same checks (:func:`_zstd_one`)."""
    out: list[Plane] = []
    zstd: list[tuple[int, memoryview]] = []  # (section index, stored frame), in order
    for i, s, buf in _stored(data, h):
        if s.kind == "const":
            out.append(buf[0])
        elif s.kind == "raw":
            out.append(np.frombuffer(buf, dtype=np.uint8))
        elif kernels.zstd_decompress is None:
            out.append(np.frombuffer(_zstd_one(buf, s.raw_size, h.codec, i), dtype=np.uint8))
        else:
            zstd.append((i, buf))
            out.append(None)  # type: ignore[arg-type]  # filled below
    if zstd:
        got = kernels.zstd_decompress([buf for _, buf in zstd], [h.sections[i].raw_size for i, _ in zstd])
        if type(got) is tuple:
            j, kind, value, message = got
            raise zstd_error(h, zstd[j][0], kind, value, message)
        for (i, _), raw in zip(zstd, got):
            out[i] = np.frombuffer(raw, dtype=np.uint8)
    return out


def section_args(data: bytes, h: SegmentHeader) -> tuple:
    """The sections as the native apply kernel takes them: a CONST plane's byte, a RAW plane's
    bytes, and, when the native zstd decoder is loaded, a zstd section's frame as ``(frame,)``,
    decoded by the kernel itself in the call that applies it (one release of the GIL per
    segment: deltastore/_native/zstd.c; it reports a bad frame as :func:`zstd_error` describes
    it). Without the decoder, the planes :func:`decode_sections` returns."""
    if kernels.zstd_decompress is None:
        return tuple(decode_sections(data, h))
    return tuple(buf[0] if s.kind == "const" else buf if s.kind == "raw" else (buf,) for _, s, buf in _stored(data, h))


#: zstd.c's failure kinds (DS_ZE_*), which _zstd_one reports in the same words.
_NOT_FRAME, _CLAIMS, _BAD_FRAME, _SIZE = 1, 2, 3, 4


def zstd_error(h: SegmentHeader, i: int, kind: int, value: int, message: str) -> CorruptObjectError:
    """What a failed zstd section ``i`` of a native decode is (zstd.c's failure kinds)."""
    return _zstd_failure(h.codec, i, h.sections[i].raw_size, kind, value, message)


def _zstd_failure(codec: str, i: int, raw: int, kind: int, value: int, message: str) -> CorruptObjectError:
    return CorruptObjectError({
        _NOT_FRAME: f"{codec} section {i}: not a zstd frame ({message or 'no frame header'})",
        _CLAIMS: f"{codec} section {i}: zstd frame claims {value} bytes, table says {raw}",
        _BAD_FRAME: f"{codec} section {i}: bad zstd frame ({message})",
    }.get(kind, f"{codec} section {i}: decompressed to {value} bytes, table says {raw}"))


def _zstd_one(buf: memoryview, raw_size: int, codec: str, i: int) -> bytes:
    """One zstd section through python-zstandard: the frame's declared content size checked
    before anything is allocated, exactly one frame, exactly ``raw_size`` bytes out."""
    try:
        declared = zstandard.frame_content_size(buf)
    except zstandard.ZstdError as e:
        raise _zstd_failure(codec, i, raw_size, _NOT_FRAME, 0, str(e)) from None
    # A frame header's content size is what zstd would allocate, whatever max_output_size
    # says: check it before decompressing (decompression-bomb guard).
    if declared not in (-1, raw_size):
        raise _zstd_failure(codec, i, raw_size, _CLAIMS, declared, "")
    try:
        dctx = _dctx() if raw_size <= DCTX_REUSE_MAX_BYTES else zstandard.ZstdDecompressor()
        raw = dctx.decompress(buf, max_output_size=raw_size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _zstd_failure(codec, i, raw_size, _BAD_FRAME, 0, str(e)) from None
    if len(raw) != raw_size:
        raise _zstd_failure(codec, i, raw_size, _SIZE, len(raw), "")
    return raw


# --- sections a piece at a time -------------------------------------------------------------

#: A zstd section of more bytes than this is decoded a piece at a time, through a streaming
#: context whose window is its memory, instead of in one call into a plane of its whole size:
#: what a decoder holds per section is then bounded whatever the chunk's size (SPEC §7 step 8).
#: Smaller sections are decoded in one call, which needs no window buffer.
STREAM_MIN_BYTES = 1 << 20

#: A streamed zstd frame's window is at most 2**MAX_WINDOW_LOG bytes (2 MiB): the window is what
#: a streaming decoder allocates, per section. Every release wrote within it: this one 128 KiB
#: (ZSTD_PLANE_PARAMS), earlier ones zstd level 3 (2 MiB at most). RFC 8878 leaves the limit to
#: the decoder (recommending that encoders stay within 8 MiB).
MAX_WINDOW_LOG = 21


def check_windows(data: bytes, h: SegmentHeader) -> None:
    """Refuse a zstd section that would be streamed (:data:`STREAM_MIN_BYTES`) with a window
    above 2**:data:`MAX_WINDOW_LOG` bytes, before anything is decoded (a frame header that does
    not parse is left to the decoder, which names it)."""
    for i, s, buf in _stored(data, h):
        if s.kind != "zstd" or s.raw_size <= STREAM_MIN_BYTES:
            continue
        try:
            window = zstandard.get_frame_parameters(buf).window_size
        except zstandard.ZstdError:
            continue
        if window > 1 << MAX_WINDOW_LOG:
            raise CorruptObjectError(
                f"{h.codec} section {i}: zstd frame needs a {window}-byte window, more than the "
                f"{1 << MAX_WINDOW_LOG} bytes a reader decodes a large section in (write it with a smaller window)"
            )


def stream_args(data: bytes, h: SegmentHeader) -> tuple:
    """The sections as the native decode_full kernel takes them: a CONST section's byte, a RAW
    section's bytes, a zstd section's frame as ``(frame,)`` (the kernel decodes it, in one call
    or streamed, :data:`STREAM_MIN_BYTES`). Needs the native zstd decoder."""
    return tuple(buf[0] if s.kind == "const" else buf if s.kind == "raw" else (buf,) for _, s, buf in _stored(data, h))


class SectionPieces:
    """One section of a segment read a piece at a time, in order (the numpy path's counterpart
    of the native kernels' streamed sections): :meth:`take` returns the next ``n`` bytes, a
    CONST section's byte as an int; :meth:`end` checks that a zstd frame ends where the section
    does. A zstd section above :data:`STREAM_MIN_BYTES` is streamed (its window checked by
    :func:`check_windows` first), a smaller one decoded whole. The same checks, and the same
    words, as the one-call decoders (:func:`_zstd_one`, deltastore/_native/zstd.c)."""

    def __init__(self, data: bytes, h: SegmentHeader, i: int, piece_bytes: int):
        s = h.sections[i]
        self._buf = next(buf for j, _, buf in _stored(data, h) if j == i)
        self._codec, self._i, self._raw = h.codec, i, s.raw_size
        self._pos = 0
        self._const: int | None = self._buf[0] if s.kind == "const" else None
        self._plane: np.ndarray | None = None
        self._reader = None
        if s.kind == "raw":
            self._plane = np.frombuffer(self._buf, dtype=np.uint8)
        elif s.kind == "zstd" and s.raw_size <= STREAM_MIN_BYTES:
            self._plane = np.frombuffer(_zstd_whole(self._buf, h, i), dtype=np.uint8)
        elif s.kind == "zstd":
            self._open(piece_bytes)

    def _fail(self, kind: int, value: int, message: str) -> CorruptObjectError:
        return _zstd_failure(self._codec, self._i, self._raw, kind, value, message)

    def _open(self, piece_bytes: int) -> None:
        try:
            declared = zstandard.frame_content_size(self._buf)
            end = _frame_end(self._buf)
        except zstandard.ZstdError as e:
            raise self._fail(_NOT_FRAME, 0, str(e)) from None
        if declared not in (-1, self._raw):
            raise self._fail(_CLAIMS, declared, "")
        if end != len(self._buf):
            raise self._fail(_BAD_FRAME, 0, "bytes after the frame" if end < len(self._buf) else "Src size is incorrect")
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << MAX_WINDOW_LOG)
        self._reader = dctx.stream_reader(self._buf, read_across_frames=False)
        self._piece = bytearray(piece_bytes)

    def take(self, n: int) -> np.ndarray | int:
        """The section's next ``n`` bytes (an int: every one is that byte)."""
        if self._const is not None:
            return self._const
        at = self._pos
        self._pos += n
        if self._plane is not None:
            return self._plane[at : at + n]
        if n > len(self._piece):
            self._piece = bytearray(n)
        view = memoryview(self._piece)[:n]
        got = 0
        try:
            while got < n:
                k = self._reader.readinto(view[got:])
                if k == 0:
                    raise self._fail(_SIZE, at + got, "")
                got += k
        except zstandard.ZstdError as e:
            raise self._fail(_BAD_FRAME, 0, _zstd_words(e)) from None
        return np.frombuffer(self._piece, dtype=np.uint8, count=n)

    def end(self) -> None:
        """Check that a streamed frame holds nothing after the bytes taken (its checksum, when
        it has one, is checked on the way)."""
        if self._reader is None:
            return
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as e:
            raise self._fail(_BAD_FRAME, 0, _zstd_words(e)) from None
        if extra:
            raise self._fail(_BAD_FRAME, 0, "Destination buffer is too small")


def _zstd_whole(buf: memoryview, h: SegmentHeader, i: int) -> bytes:
    """Zstd section ``i`` decoded in one call, as :func:`decode_sections` decodes it."""
    raw = h.sections[i].raw_size
    if kernels.zstd_decompress is None:
        return _zstd_one(buf, raw, h.codec, i)
    got = kernels.zstd_decompress([buf], [raw])
    if type(got) is tuple:
        _, kind, value, message = got
        raise zstd_error(h, i, kind, value, message)
    return got[0]


def _zstd_words(e: zstandard.ZstdError) -> str:
    """zstd's own message (ZSTD_getErrorName's words, as the native decoders report them),
    without the prefix python-zstandard's stream reader adds."""
    return str(e).removeprefix("zstd decompress error: ")


def _frame_end(buf: memoryview) -> int:
    """Where the zstd frame at the start of ``buf`` ends, its blocks walked (RFC 8878 §3.1.1):
    what libzstd's ZSTD_findFrameCompressedSize says, so that bytes after the frame are refused
    on both paths. Raises ZstdError when the header does not parse."""
    at = zstandard.frame_header_size(buf)
    checksum = zstandard.get_frame_parameters(buf).has_checksum
    n = len(buf)
    while True:
        if at + 3 > n:
            return n + 1  # runs past the section: cut short
        head = buf[at] | buf[at + 1] << 8 | buf[at + 2] << 16
        last, kind, size = head & 1, (head >> 1) & 3, head >> 3
        if kind == 3:
            raise zstandard.ZstdError("Corrupted block detected")
        at += 3 + (1 if kind == 1 else size)
        if last:
            return at + (4 if checksum else 0)


# --- element transforms -------------------------------------------------------------------


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 -> bytes holding two each (low nibble first), padded with a 0 code."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    # each pair read as one little-endian uint16 c0 + 256*c1; (x | x >> 4) puts c1 in the low
    # byte's high nibble (c0 < 16 shifts out): 2.6x faster than two strided slices
    pairs = np.ascontiguousarray(codes).view(UINT[2])  # explicitly little-endian
    return (pairs | (pairs >> np.uint16(4))).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, n: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`, checking that the padding code is 0."""
    codes = nibbles(packed)
    if n % 2 and codes[n] != 0:
        raise CorruptObjectError(f"{what} segment's padding code is not 0")
    return codes[:n]


def nibbles(packed: np.ndarray) -> np.ndarray:
    """Each byte's two 4-bit codes, low nibble first (padding included)."""
    codes = np.empty(2 * packed.size, dtype=np.uint8)
    codes[0::2] = packed & np.uint8(15)
    codes[1::2] = packed >> np.uint8(4)
    return codes


def rotl1(v: np.ndarray) -> np.ndarray:
    """Rotate each element left by one bit (sign to bit 0, exponent to the top byte)."""
    bits = 8 * v.itemsize
    return (v << v.dtype.type(1)) | (v >> v.dtype.type(bits - 1))


def rotr1_inplace(v: np.ndarray) -> None:
    """Inverse of :func:`rotl1`, in place (one temporary of ``v``'s size, not three)."""
    bits = 8 * v.itemsize
    low = v >> v.dtype.type(1)
    v <<= v.dtype.type(bits - 1)
    v |= low


def zigzag(d: np.ndarray) -> np.ndarray:
    """Unsigned difference (mod 2**bits) -> zigzag code: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    bits = 8 * d.itemsize
    s = d.view(d.dtype.str.replace("u", "i"))
    return ((s << 1) ^ (s >> (bits - 1))).view(d.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`."""
    one = z.dtype.type(1)
    return (z >> one) ^ (z.dtype.type(0) - (z & one))
