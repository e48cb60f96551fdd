"""Segment codecs: lossless encodings of one chunk of raw bit patterns, and of deltas between them.

The codec is pure: numpy arrays and bytes in, numpy arrays and bytes out. It knows nothing of
tensors, files or stores. Callers hand it 1-D contiguous arrays of an unsigned integer dtype
(``uint8``/``uint16``/``uint32``/``uint64``) holding the raw bits of their values (bf16 and fp16
as ``uint16``, fp32 as ``uint32``, ...), so every round trip is bit-exact, NaN payloads and
``-0.0`` included.

Six codecs exist, each identified by a string ``"<name>/<version>"``. Writers produce the v2
codecs; the v1 codecs stay decodable forever (stores written by v1 hold them).

``full/2`` (:data:`CODEC_FULL2`), v2
    The values of a whole chunk (an anchor), split into byte planes (plane ``k`` holds byte
    ``k``, little-endian order, of every element), each stored on its own. With
    ``encode_full(..., float_bits=True)`` the bit patterns are first rotated left by one bit so
    the exponent fills the top plane, and that plane may be coded as pairs of 4-bit codes in a
    window of 15 exponents (whichever is smaller); the header records the transform.
``add-sparse/1`` (:data:`CODEC_ADD_SPARSE`), v2
    Positions of the changed elements as gaps (one-byte symbols, long gaps escaped), then the
    zigzag of ``new - old`` (mod 2**bits) as paired 4-bit codes (large values escaped). Applied
    by addition, undone by subtraction (``apply_delta(..., inverse=True)``), composed by
    addition without the weights.
``add-dense/1`` (:data:`CODEC_ADD_DENSE`), v2
    The zigzag difference of every element as paired 4-bit codes. Wins when most elements change.
``full/1``, ``xor-sparse/1``, ``xor-dense/1`` (:data:`CODEC_FULL`, :data:`CODEC_XOR_SPARSE`,
:data:`CODEC_XOR_DENSE`), v1
    Byte planes of the values; gaps and ``old ^ new`` of the changed elements in byte planes;
    ``old ^ new`` of every element in byte planes. XOR deltas are their own inverse.

Segments are self-describing: ``DSG1`` segments (v1 codecs) and ``DSG2`` segments (v2 codecs)
differ in their header; the normative byte layouts and read path are in
``docs/codec-format.md``, the measurements behind v2 in ``docs/design/003-codec-v2.md``.
``DSG1`` (28-byte header, 12-byte table entries)::

    offset  size  field
    0       4     magic          b"DSG1"
    4       1     codec id       1 = full, 2 = xor-sparse, 3 = xor-dense
    5       1     codec version  1
    6       1     width          element width in bytes: 1, 2, 4 or 8
    7       1     gap width      xor-sparse: bytes per gap, 1, 2 or 4; otherwise 0
    8       8     count          elements in the chunk (< 2**32)
    16      8     n_changed      elements that differ from the base (== count for full)
    24      1     n_sections     full, xor-dense: width; xor-sparse: gap width + width
    25      3     reserved       zero
    28      12*n  section table  per section: kind u8, 3 zero bytes, stored size u32, raw size u32
    ...           payload        the sections' stored bytes, in table order, nothing after

``DSG2`` (25-byte header, 5-byte table entries; raw sizes implied by the header)::

    offset  size  field
    0       4     magic          b"DSG2"
    4       1     codec id       1 = full (version 2), 4 = add-sparse, 5 = add-dense (version 1)
    5       1     codec version
    6       1     width          element width in bytes: 1, 2, 4 or 8
    7       1     param          full/2: transform 0/1/2; add-sparse: gap escape width; else 0
    8       4     count          u32
    12      4     n_changed      u32
    16      4     aux            add-sparse: escaped gaps; full/2 transform 2: exponent window low
    20      4     n_escaped      escaped values (add-*) or exponents (full/2 transform 2)
    24      1     n_sections
    25      5*n   section table  per section: kind u8, stored size u32
    ...           payload

    section kind 0 RAW   stored bytes are the plane itself (stored size == raw size)
                 1 ZSTD  stored bytes are exactly one zstd frame of raw-size bytes
                 2 CONST stored bytes are one byte, repeated raw-size (>= 1) times

Decoders check every header field against the caller's expectations (codec, width, count) and
every declared size against what the codec implies, before allocating anything; a zstd frame is
decompressed only after its own header agrees with the declared raw size. Failures raise
:class:`~deltastore.errors.UnknownCodecError` (magic, codec or version this code does not know)
or :class:`~deltastore.errors.CorruptObjectError` (anything else wrong with the bytes), never a
bare ``IndexError`` or ``zstd.ZstdError``.

Example::

    >>> import numpy as np
    >>> old = np.zeros(1000, dtype=np.uint16); new = old.copy(); new[[3, 500]] = 7
    >>> seg = encode_delta(old, new)
    >>> seg.codec, seg.n_changed
    ('add-sparse/1', 2)
    >>> t = old.copy(); apply_delta(t, seg.data, codec=seg.codec); bool((t == new).all())
    True
    >>> apply_delta(t, seg.data, codec=seg.codec, inverse=True); bool((t == old).all())
    True
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

import numpy as np
import zstandard

from deltastore.errors import CorruptObjectError, UnknownCodecError

__all__ = [
    "ADD_CODECS",
    "CODEC_ADD_DENSE",
    "CODEC_ADD_SPARSE",
    "CODEC_FULL",
    "CODEC_FULL2",
    "CODEC_XOR_DENSE",
    "CODEC_XOR_SPARSE",
    "DELTA_CODECS",
    "FULL_CODECS",
    "XOR_CODECS",
    "DEFAULT_LEVEL",
    "KNOWN_CODECS",
    "MAX_COUNT",
    "SectionInfo",
    "Segment",
    "SegmentHeader",
    "apply_delta",
    "compose_deltas",
    "decode_full",
    "encode_delta",
    "encode_full",
    "peek_header",
]

CODEC_FULL = "full/1"
CODEC_XOR_SPARSE = "xor-sparse/1"
CODEC_XOR_DENSE = "xor-dense/1"
CODEC_FULL2 = "full/2"
CODEC_ADD_SPARSE = "add-sparse/1"
CODEC_ADD_DENSE = "add-dense/1"
KNOWN_CODECS: frozenset[str] = frozenset(
    {CODEC_FULL, CODEC_XOR_SPARSE, CODEC_XOR_DENSE, CODEC_FULL2, CODEC_ADD_SPARSE, CODEC_ADD_DENSE}
)
# what each entry point takes
FULL_CODECS = (CODEC_FULL, CODEC_FULL2)
XOR_CODECS = (CODEC_XOR_SPARSE, CODEC_XOR_DENSE)
ADD_CODECS = (CODEC_ADD_SPARSE, CODEC_ADD_DENSE)
DELTA_CODECS = XOR_CODECS + ADD_CODECS

# --- tuning constants ---------------------------------------------------------------------------

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

# Only above this changed fraction is the dense form also encoded. On bf16 Adam-step deltas the
# dense form first wins at ~55 % changed (Huffman spends >= 1 bit on every unchanged element's
# zero byte); at 40 % it is still 9 % larger, and on random XORs sparse wins even at 50 %. Below
# this line, trying dense would double the encoding work for nothing.
DENSE_TRY_FRACTION = 0.40

# Section sizes are u32 (12-byte table entries instead of 20); a chunk is at most this many
# elements. Callers split larger tensors into chunks, which they do anyway for parallelism.
MAX_COUNT = 2**32 - 1

# Gap symbols of add-sparse are one byte: a gap below this value is the symbol itself, anything
# else is this symbol plus (gap - ESCAPE) in the gap escape sections. A gap's high byte, mostly
# zero, costs Huffman >= 1 bit; escaping it saves 0.02 B per changed element at lr 1e-6
# (0.961 vs 0.984 for plain byte planes; order-0 position entropy 0.93).
ESCAPE = 255

# Value codes of the add codecs are 4 bits, two per byte: zigzag(new - old) below this value is
# the code itself, anything else is this code plus the full-width value in the escape sections.
# Adam steps move bf16 weights by 1-2 ulp, so codes 1..4 dominate and Huffman over single bytes
# pays ~0.3 bit per symbol of redundancy; pairs halve it. MiniLM lr 1e-6: 0.293 -> 0.249 B per
# changed element (one-byte symbols vs pairs; order-0 entropy of the zigzag values 0.225,
# of v1's XOR values 0.341); ~1 % of changed elements escape.
NIBBLE_ESCAPE = 15

# Below this many elements the paired exponent form is not tried: its extra section entry and
# Huffman table outweigh any gain on tiny tensors (LayerNorm weights, biases).
MIN_PAIR_COUNT = 4096

# Stride of the sample of exponents from which the paired form's window is chosen.
PAIR_SAMPLE_STRIDE = 16

# Smallest stored size worth handing to zstd: a frame costs ~10 bytes of header, so a plane this
# short is stored RAW (or CONST) without trying.
MIN_ZSTD_INPUT = 32

# --- header -------------------------------------------------------------------------------------

_MAGIC = b"DSG1"
_HEADER = struct.Struct("<4sBBBBQQB3s")
_ENTRY = struct.Struct("<B3sII")
_ZERO3 = b"\x00\x00\x00"

_KIND_RAW = 0
_KIND_ZSTD = 1
_KIND_CONST = 2
_KIND_NAMES = {_KIND_RAW: "raw", _KIND_ZSTD: "zstd", _KIND_CONST: "const"}

# Segments of the v2 codecs (full/2, add-*): a 25-byte header and 5-byte table entries whose raw
# sizes are implied by the header (v1: 28 + 12 per section, 76 bytes for a bf16 xor-sparse
# segment, ~3 % of a typical small-tensor delta at < 1 % changed; v2 add-sparse: 35-45 bytes).
_MAGIC2 = b"DSG2"
_HEADER2 = struct.Struct("<4sBBBBIIIIB")
_ENTRY2 = struct.Struct("<BI")
_TRANSFORM_NONE = 0
_TRANSFORM_ROTL1 = 1  # float bit patterns rotated left by one bit: the exponent fills the top byte
_TRANSFORM_PAIRS = 2  # rotated, and the top (exponent) byte coded as pairs of 4-bit window codes
# Exponent codes of the paired form: 0..14 are exponents low..low+14, 15 escapes. Two codes per
# byte halve Huffman's per-symbol redundancy on the skewed exponent distribution: on MiniLM's
# 39 large bf16 tensors the exponent plane drops from 7,487,646 to 7,468,312 bytes (entropy
# 7,411,197), enough to come in under ZipNN; 0.03 % of exponents fall outside the window.
_EXP_WINDOW = 15
_EXP_ESCAPE = 15

# codec string <-> (id byte, version byte)
_CODEC_IDS: dict[str, tuple[int, int]] = {
    CODEC_FULL: (1, 1),
    CODEC_XOR_SPARSE: (2, 1),
    CODEC_XOR_DENSE: (3, 1),
}
_CODEC_BY_ID = {v: k for k, v in _CODEC_IDS.items()}
_CODEC_IDS2: dict[str, tuple[int, int]] = {
    CODEC_FULL2: (1, 2),
    CODEC_ADD_SPARSE: (4, 1),
    CODEC_ADD_DENSE: (5, 1),
}
_CODEC_BY_ID2 = {v: k for k, v in _CODEC_IDS2.items()}
_CODEC_NAME_BY_ID = {1: "full", 2: "xor-sparse", 3: "xor-dense", 4: "add-sparse", 5: "add-dense"}

_WIDTHS = (1, 2, 4, 8)
_GAP_WIDTHS = (1, 2, 4)
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


@dataclass(frozen=True)
class Segment:
    """One encoded segment.

    Attributes:
        codec: the codec id, one of :data:`KNOWN_CODECS`; record it next to ``data`` (the
            decoders check it against the segment's own header).
        data: the self-describing encoded bytes (header + payload).
        n_changed: elements that differ from the base (the element count for ``full/1``).
    """

    codec: str
    data: bytes
    n_changed: int


@dataclass(frozen=True)
class SectionInfo:
    """One entry of a segment's section table."""

    kind: str  # "raw" | "zstd" | "const"
    stored_size: int
    raw_size: int


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment says about itself (see :func:`peek_header`).

    Attributes:
        codec: codec id string, e.g. ``"xor-sparse/1"``.
        width: element width in bytes (1, 2, 4, 8).
        count: elements in the chunk.
        n_changed: elements that differ from the base (== count for ``full/1``).
        gap_width: bytes per position gap (``xor-sparse``/``add-sparse`` only, else 0).
        sections: the section table, in payload order.
        header_size: bytes of fixed header plus section table.
        total_size: header_size plus every section's stored size: the exact segment length.
        transform: ``full/2`` only: 1 if the values are stored rotated left by one bit, else 0.
        n_escaped: ``add-*`` only: values stored in full in the value escape sections.
        n_gap_escaped: ``add-sparse`` only: gaps of 255 or more (stored in the gap escape
            sections).
        exp_low: ``full/2`` with transform 2 only: the lowest exponent of the coded window.
    """

    codec: str
    width: int
    count: int
    n_changed: int
    gap_width: int
    sections: tuple[SectionInfo, ...]
    header_size: int
    total_size: int
    transform: int = 0
    n_escaped: int = 0
    n_gap_escaped: int = 0
    exp_low: int = 0

    @property
    def stored_size(self) -> int:
        """Payload bytes (everything after the section table)."""
        return self.total_size - self.header_size

    @property
    def raw_size(self) -> int:
        """Payload bytes once every section is decompressed."""
        return sum(s.raw_size for s in self.sections)


def peek_header(data: bytes) -> SegmentHeader:
    """Parse and structurally validate a segment's header and section table.

    Only the header and table need be present: the payload's length is reported in
    ``total_size`` and checked by the decoders, not here, so a caller may peek at a prefix.

    Raises:
        UnknownCodecError: unknown magic, codec id or codec version.
        CorruptObjectError: truncated header/table or fields inconsistent with each other.

    Example::

        >>> h = peek_header(encode_full(np.arange(10, dtype=np.uint16)).data)
        >>> h.codec, h.width, h.count
        ('full/2', 2, 10)
    """
    mv = memoryview(data)
    if len(mv) >= len(_MAGIC2) and bytes(mv[: len(_MAGIC2)]) == _MAGIC2:
        return _peek_header2(mv)
    if len(mv) < len(_MAGIC) or bytes(mv[: len(_MAGIC)]) != _MAGIC:
        if len(mv) < len(_MAGIC) and (bytes(mv) == _MAGIC[: len(mv)] or bytes(mv) == _MAGIC2[: len(mv)]):
            raise CorruptObjectError(f"segment truncated: {len(mv)} bytes, shorter than its magic")
        raise UnknownCodecError(
            f"not a deltastore segment: magic {bytes(mv[:4])!r}, expected {_MAGIC!r} or {_MAGIC2!r}"
        )
    if len(mv) < _HEADER.size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, the fixed header alone is {_HEADER.size}"
        )
    _, cid, cver, width, gap_width, count, n_changed, n_sections, reserved = _HEADER.unpack_from(mv)
    codec = _CODEC_BY_ID.get((cid, cver))
    if codec is None:
        _unknown_codec(cid, cver, _MAGIC)
    if reserved != _ZERO3:
        raise CorruptObjectError(f"segment header reserved bytes are {reserved!r}, must be zero")
    if width not in _WIDTHS:
        raise CorruptObjectError(f"segment declares element width {width}, must be 1, 2, 4 or 8")
    if count > MAX_COUNT:
        raise CorruptObjectError(f"segment declares {count} elements, more than {MAX_COUNT}")
    if n_changed > count:
        raise CorruptObjectError(f"segment declares n_changed {n_changed} > count {count}")
    if codec == CODEC_XOR_SPARSE:
        if gap_width not in _GAP_WIDTHS:
            raise CorruptObjectError(f"xor-sparse segment declares gap width {gap_width}")
        want_sections = gap_width + width
    else:
        if gap_width != 0:
            raise CorruptObjectError(f"{codec} segment declares gap width {gap_width}, must be 0")
        want_sections = width
    if n_sections != want_sections:
        raise CorruptObjectError(
            f"{codec} segment declares {n_sections} sections, its widths imply {want_sections}"
        )
    header_size = _HEADER.size + n_sections * _ENTRY.size
    if len(mv) < header_size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, header and section table need {header_size}"
        )
    sections = []
    total = header_size
    for i in range(n_sections):
        kind, pad, stored, raw = _ENTRY.unpack_from(mv, _HEADER.size + i * _ENTRY.size)
        if pad != _ZERO3:
            raise CorruptObjectError(f"section {i} reserved bytes are {pad!r}, must be zero")
        _check_entry(i, kind, stored, raw)
        sections.append(SectionInfo(_KIND_NAMES[kind], stored, raw))
        total += stored
    return SegmentHeader(
        codec=codec,
        width=width,
        count=count,
        n_changed=n_changed,
        gap_width=gap_width if codec == CODEC_XOR_SPARSE else 0,
        sections=tuple(sections),
        header_size=header_size,
        total_size=total,
    )


def _unknown_codec(cid: int, cver: int, magic: bytes) -> None:
    name = _CODEC_NAME_BY_ID.get(cid)
    if name is None:
        raise UnknownCodecError(f"{magic.decode()} segment has unknown codec id {cid}; upgrade deltastore")
    table = _CODEC_IDS if magic == _MAGIC else _CODEC_IDS2
    known = sorted(v for c, (i, v) in table.items() if i == cid)
    raise UnknownCodecError(
        f"{magic.decode()} segment uses codec {name!r} version {cver}, this deltastore reads "
        f"version(s) {known} in {magic.decode()} segments; upgrade deltastore"
    )


def _peek_header2(mv: memoryview) -> SegmentHeader:
    """:func:`peek_header` for ``DSG2`` segments (full/2, add-sparse/1, add-dense/1)."""
    if len(mv) < _HEADER2.size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, the fixed header alone is {_HEADER2.size}"
        )
    _, cid, cver, width, param, count, n_changed, n_gap_esc, n_escaped, n_sections = _HEADER2.unpack_from(mv)
    codec = _CODEC_BY_ID2.get((cid, cver))
    if codec is None:
        _unknown_codec(cid, cver, _MAGIC2)
    if width not in _WIDTHS:
        raise CorruptObjectError(f"segment declares element width {width}, must be 1, 2, 4 or 8")
    if n_changed > count:
        raise CorruptObjectError(f"segment declares n_changed {n_changed} > count {count}")
    gap_width = transform = exp_low = 0
    if codec == CODEC_FULL2:
        if param not in (_TRANSFORM_NONE, _TRANSFORM_ROTL1, _TRANSFORM_PAIRS) or (param and width == 1):
            raise CorruptObjectError(f"full/2 segment declares transform {param} for width {width}")
        if n_changed != count:
            raise CorruptObjectError(f"full/2 segment declares n_changed {n_changed} != count {count}")
        transform = param
        if transform == _TRANSFORM_PAIRS:
            # the u32 at offset 16 is the exponent window's low end
            if n_gap_esc > 256 - _EXP_WINDOW or n_escaped > count:
                raise CorruptObjectError(
                    f"full/2 segment declares exponent window at {n_gap_esc} and {n_escaped} escapes"
                )
            exp_low, n_gap_esc = n_gap_esc, 0
            sizes = [count] * (width - 1) + [(count + 1) // 2] + ([n_escaped] if n_escaped else [])
        else:
            if n_escaped != 0 or n_gap_esc != 0:
                raise CorruptObjectError(
                    f"full/2 segment declares escapes {n_gap_esc}/{n_escaped} without transform 2"
                )
            sizes = [count] * width
    else:
        if n_changed == 0:
            raise CorruptObjectError(f"{codec} segment declares no changed elements")
        if n_escaped > n_changed or n_gap_esc > n_changed:
            raise CorruptObjectError(
                f"{codec} segment declares {n_gap_esc}/{n_escaped} escapes > {n_changed} changed"
            )
        esc = [n_escaped] * width if n_escaped else []
        if codec == CODEC_ADD_SPARSE:
            if param not in _GAP_WIDTHS or (param != 1 and not n_gap_esc):
                raise CorruptObjectError(
                    f"add-sparse segment declares gap width {param} for {n_gap_esc} escaped gaps "
                    "(1, 2 or 4; 1 when none)"
                )
            gap_width = param
            gap_esc = [n_gap_esc] * gap_width if n_gap_esc else []
            sizes = [n_changed, *gap_esc, (n_changed + 1) // 2, *esc]
        else:
            if param != 0 or n_gap_esc != 0:
                raise CorruptObjectError(
                    f"add-dense segment declares parameter {param} and {n_gap_esc} gap escapes, must be 0"
                )
            sizes = [(count + 1) // 2] + esc
    if n_sections != len(sizes):
        raise CorruptObjectError(
            f"{codec} segment declares {n_sections} sections, its header implies {len(sizes)}"
        )
    header_size = _HEADER2.size + n_sections * _ENTRY2.size
    if len(mv) < header_size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, header and section table need {header_size}"
        )
    sections = []
    total = header_size
    for i, raw in enumerate(sizes):
        kind, stored = _ENTRY2.unpack_from(mv, _HEADER2.size + i * _ENTRY2.size)
        _check_entry(i, kind, stored, raw)
        sections.append(SectionInfo(_KIND_NAMES[kind], stored, raw))
        total += stored
    return SegmentHeader(
        codec=codec, width=width, count=count, n_changed=n_changed, gap_width=gap_width,
        sections=tuple(sections), header_size=header_size, total_size=total,
        transform=transform, n_escaped=n_escaped, n_gap_escaped=n_gap_esc, exp_low=exp_low,
    )


def _check_entry(i: int, kind: int, stored: int, raw: int) -> None:
    if kind == _KIND_RAW:
        if stored != raw:
            raise CorruptObjectError(f"raw section {i} stores {stored} bytes, declares {raw}")
    elif kind == _KIND_CONST:
        if stored != 1 or raw == 0:
            raise CorruptObjectError(
                f"const section {i} must store 1 byte for >= 1 raw bytes, has {stored}/{raw}"
            )
    elif kind == _KIND_ZSTD:
        if stored == 0:
            raise CorruptObjectError(f"zstd section {i} is empty")
    else:
        raise CorruptObjectError(f"section {i} has unknown kind {kind}")


# --- encoding -----------------------------------------------------------------------------------


def _check_values(a: np.ndarray, what: str) -> np.ndarray:
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
    return a.astype(_UINT[a.itemsize], copy=False)


def _planes(a: np.ndarray) -> list[np.ndarray]:
    """Split a 1-D little-endian array into its byte planes (plane k = byte k of each element)."""
    w = a.itemsize
    if w == 1:
        return [a.view(np.uint8)]
    u8 = a.view(np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(u8[:, k]) for k in range(w)]


def _encode_section(plane: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, bytes, int]:
    """Pick the smallest of CONST / ZSTD / RAW for one plane: (kind, stored bytes, raw size)."""
    n = plane.size
    if n and not np.any(plane != plane[0]):
        return _KIND_CONST, bytes(plane[:1]), n
    if n >= MIN_ZSTD_INPUT:
        z = cctx.compress(plane)
        if len(z) < n:
            return _KIND_ZSTD, z, n
    return _KIND_RAW, memoryview(np.ascontiguousarray(plane)).cast("B"), n


def _cctx(level: int | None) -> zstandard.ZstdCompressor:
    # per call: compressors are not thread-safe
    if level is None:
        return zstandard.ZstdCompressor(compression_params=ZSTD_PLANE_PARAMS)
    return zstandard.ZstdCompressor(level=level)


def _assemble2(codec: str, width: int, param: int, count: int, n_changed: int, n_gap_esc: int,
               n_escaped: int, planes: list[np.ndarray], level: int | None) -> bytes:
    cctx = _cctx(level)
    secs = [_encode_section(p, cctx)[:2] for p in planes]
    return _pack2(codec, width, param, count, n_changed, n_gap_esc, n_escaped, secs)


def _pack2(codec: str, width: int, param: int, count: int, n_changed: int, aux: int,
           n_escaped: int, secs: list[tuple[int, bytes]]) -> bytes:
    """A DSG2 segment from encoded sections [(kind, stored bytes)]."""
    cid, cver = _CODEC_IDS2[codec]
    table = [_ENTRY2.pack(kind, len(stored)) for kind, stored in secs]
    head = _HEADER2.pack(_MAGIC2, cid, cver, width, param, count, n_changed, aux, n_escaped, len(secs))
    return b"".join([head, *table, *(stored for _, stored in secs)])


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes < 16 -> bytes holding two each (low nibble first), padded with a 0 code."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    return codes[0::2] | (codes[1::2] << np.uint8(4))


def _unpack_nibbles(packed: np.ndarray, n: int, what: str) -> np.ndarray:
    codes = np.empty(2 * packed.size, dtype=np.uint8)
    codes[0::2] = packed & np.uint8(15)
    codes[1::2] = packed >> np.uint8(4)
    if n % 2 and codes[n] != 0:
        raise CorruptObjectError(f"{what} segment's padding code is not 0")
    return codes[:n]


def _pair_exponents(top: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """The top byte plane as pairs of 4-bit window codes: (window low end, packed codes,
    escaped bytes). The window is the 15 consecutive values holding the most elements."""
    # the window only affects size, not correctness: choose it on a sample (bincount widens
    # uint8 to intp, ~7 ms per 8M elements; a 1/16 sample picks the same window on real weights)
    counts = np.bincount(top[::PAIR_SAMPLE_STRIDE], minlength=256)
    csum = np.concatenate([[0], np.cumsum(counts)])
    low = int(np.argmax(csum[_EXP_WINDOW:] - csum[:-_EXP_WINDOW]))
    codes = top - np.uint8(low)  # wraps: in the window iff < 15
    out = codes >= _EXP_WINDOW
    esc = top[out]
    codes[out] = _EXP_ESCAPE
    return low, _pack_nibbles(codes), esc


def _unpair_exponents(packed: np.ndarray, esc: np.ndarray | None, low: int, count: int,
                      n_escaped: int) -> np.ndarray:
    codes = _unpack_nibbles(packed, count, "full/2")
    at = np.flatnonzero(codes == _EXP_ESCAPE)
    if at.size != n_escaped:
        raise CorruptObjectError(
            f"full/2 segment declares {n_escaped} escaped exponents, its codes hold {at.size}"
        )
    top = codes + np.uint8(low)  # low <= 241: codes < 15 do not wrap
    if n_escaped:
        if np.any((esc - np.uint8(low)) < _EXP_WINDOW):
            raise CorruptObjectError("full/2 segment escapes an exponent inside its window")
        top[at] = esc
    return top


def _rotl1(v: np.ndarray) -> np.ndarray:
    """Rotate each element left by one bit (sign to bit 0, exponent to the top byte)."""
    bits = 8 * v.itemsize
    return (v << v.dtype.type(1)) | (v >> v.dtype.type(bits - 1))


def _rotr1(v: np.ndarray) -> np.ndarray:
    bits = 8 * v.itemsize
    return (v >> v.dtype.type(1)) | (v << v.dtype.type(bits - 1))


def _zigzag(d: np.ndarray) -> np.ndarray:
    """Unsigned difference (mod 2**bits) -> zigzag code: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    bits = 8 * d.itemsize
    s = d.view(d.dtype.str.replace("u", "i"))
    return ((s << 1) ^ (s >> (bits - 1))).view(d.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (z.dtype.type(0) - (z & one))


def _assemble(codec: str, width: int, gap_width: int, count: int, n_changed: int,
              planes: list[np.ndarray], level: int | None) -> bytes:
    cctx = _cctx(level)
    cid, cver = _CODEC_IDS[codec]
    table = []
    payload = []
    for p in planes:
        kind, stored, raw = _encode_section(p, cctx)
        table.append(_ENTRY.pack(kind, _ZERO3, len(stored), raw))
        payload.append(stored)
    head = _HEADER.pack(_MAGIC, cid, cver, width, gap_width, count, n_changed, len(planes), _ZERO3)
    return b"".join([head, *table, *payload])


def encode_full(values: np.ndarray, *, level: int | None = DEFAULT_LEVEL,
                float_bits: bool = False) -> Segment:
    """Encode a whole chunk (an anchor) as a ``full/2`` segment.

    Args:
        values: 1-D contiguous array of dtype uint8/16/32/64 holding raw bit patterns.
        level: ``None`` for the tuned plane parameters (:data:`ZSTD_PLANE_PARAMS`), or a zstd level.
        float_bits: the bit patterns are IEEE-style floats (sign, exponent, mantissa: bf16, fp16,
            fp32, fp64). They are then stored rotated left by one bit, so that one byte plane
            holds (nearly) only exponent bits and compresses to their ~2.6-bit entropy; the
            segment records this, so :func:`decode_full` needs no flag. Wrong for integers only
            in size, never in correctness.

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
    v = _check_values(values, "values")
    w, n = v.itemsize, int(v.size)
    if not float_bits or w == 1:
        return Segment(CODEC_FULL2, _assemble2(CODEC_FULL2, w, _TRANSFORM_NONE, n, n, 0, 0, _planes(v), level), n)
    cctx = _cctx(level)
    planes = _planes(_rotl1(v))
    secs = [_encode_section(p, cctx)[:2] for p in planes]
    best = _pack2(CODEC_FULL2, w, _TRANSFORM_ROTL1, n, n, 0, 0, secs)
    if n >= MIN_PAIR_COUNT:
        low, packed, esc = _pair_exponents(planes[-1])
        tail = [_encode_section(packed, cctx)[:2]] + ([_encode_section(esc, cctx)[:2]] if esc.size else [])
        paired = _pack2(CODEC_FULL2, w, _TRANSFORM_PAIRS, n, n, low, int(esc.size), secs[:-1] + tail)
        if len(paired) < len(best):
            best = paired
    return Segment(CODEC_FULL2, best, n)


def _encode_full_v1(values: np.ndarray, *, level: int | None = DEFAULT_LEVEL) -> Segment:
    """A ``full/1`` segment (kept for tests and for comparisons; writers use ``full/2``)."""
    v = _check_values(values, "values")
    data = _assemble(CODEC_FULL, v.itemsize, 0, v.size, v.size, _planes(v), level)
    return Segment(CODEC_FULL, data, int(v.size))


def _value_sections(zz: np.ndarray) -> tuple[list[np.ndarray], int]:
    """Paired 4-bit codes for zigzag values (``NIBBLE_ESCAPE`` for the large ones) and the
    escape planes: (sections, number of escaped values)."""
    big = zz >= NIBBLE_ESCAPE
    n_esc = int(np.count_nonzero(big))
    packed = _pack_nibbles(np.minimum(zz, NIBBLE_ESCAPE).astype(np.uint8))
    if n_esc == 0:
        return [packed], 0
    return [packed, *_planes(zz[big])], n_esc


def _gaps(pos: np.ndarray) -> tuple[int, list[np.ndarray]]:
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    gw = _gap_width(int(gaps.max()))
    return gw, _planes(gaps.astype(_UINT[gw]))


def _gap_sections(pos: np.ndarray) -> tuple[int, list[np.ndarray], int]:
    """add-sparse positions: one-byte gap symbols (``ESCAPE`` for gaps >= ``ESCAPE``) and the
    byte planes of ``gap - ESCAPE`` for the escaped ones: (gap width, sections, n escaped)."""
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    sym = np.minimum(gaps, ESCAPE).astype(np.uint8)
    rest = gaps[gaps >= ESCAPE]
    if rest.size == 0:
        return 1, [sym], 0
    rest -= ESCAPE  # gaps are geometric-like: the remainder past the escape is distributed alike
    gw = _gap_width(int(rest.max()))
    return gw, [sym, *_planes(rest.astype(_UINT[gw]))], int(rest.size)


def _encode_add(count: int, width: int, pos: np.ndarray, diffs: np.ndarray,
                dense: np.ndarray | None, level: int | None) -> Segment | None:
    """Encode the change set {pos: diffs} (diffs = new - old mod 2**bits, non-zero; dense: the
    whole difference array if the caller has it) as the smaller of add-sparse and add-dense."""
    n = int(pos.size)
    if n == 0:
        return None
    gw, gap_secs, n_gesc = _gap_sections(pos)
    vals, n_esc = _value_sections(_zigzag(diffs))
    best = Segment(CODEC_ADD_SPARSE, _assemble2(CODEC_ADD_SPARSE, width, gw, count, n, n_gesc, n_esc,
                                                gap_secs + vals, level), n)
    if n > DENSE_TRY_FRACTION * count:
        if dense is None:
            dense = np.zeros(count, dtype=_UINT[width])
            dense[pos] = diffs
        vals, n_esc = _value_sections(_zigzag(dense))
        d = _assemble2(CODEC_ADD_DENSE, width, 0, count, n, 0, n_esc, vals, level)
        if len(d) < len(best.data):
            best = Segment(CODEC_ADD_DENSE, d, n)
    return best


def _gap_width(max_gap: int) -> int:
    for gw in _GAP_WIDTHS:
        if max_gap < 1 << (8 * gw):
            return gw
    raise AssertionError("gap >= 2**32 despite count <= MAX_COUNT")  # pragma: no cover


def _encode_sparse(count: int, pos: np.ndarray, xvals: np.ndarray, level: int | None) -> bytes:
    gw, gap_planes = _gaps(pos)
    w = xvals.itemsize
    return _assemble(CODEC_XOR_SPARSE, w, gw, count, pos.size, gap_planes + _planes(xvals), level)


def _encode_xor(count: int, width: int, pos: np.ndarray, xvals: np.ndarray,
                dense: np.ndarray | None, level: int | None) -> Segment | None:
    """Encode the change set {pos: xvals} (dense: the full XOR, if the caller has it) as the
    smaller of xor-sparse and xor-dense."""
    n = int(pos.size)
    if n == 0:
        return None
    best = Segment(CODEC_XOR_SPARSE, _encode_sparse(count, pos, xvals, level), n)
    if n > DENSE_TRY_FRACTION * count:
        if dense is None:
            dense = np.zeros(count, dtype=_UINT[width])
            dense[pos] = xvals
        d = _assemble(CODEC_XOR_DENSE, width, 0, count, n, _planes(dense), level)
        if len(d) < len(best.data):
            best = Segment(CODEC_XOR_DENSE, d, n)
    return best


def encode_delta(old: np.ndarray, new: np.ndarray, *, level: int | None = DEFAULT_LEVEL,
                 float_bits: bool = False) -> Segment | None:
    """Encode the change from ``old`` to ``new`` as the smaller of add-sparse and add-dense.

    Values are stored as zigzag(new - old mod 2**bits): an Adam step moves a bf16 weight by a
    few units in the last place, so the difference is a small signed integer (XOR, as in v1,
    spreads a carry over several bits).

    Args:
        old, new: 1-D contiguous arrays of the same unsigned dtype and length (raw bits).
        level: ``None`` for the tuned plane parameters (:data:`ZSTD_PLANE_PARAMS`), or a zstd level.
        float_bits: the bit patterns are floats. Accepted so that callers can pass the same flag
            as to :func:`encode_full`; the current delta codecs do not use it (an
            exponent-conditioned position model that would is measured in
            ``docs/design/003-codec-v2.md``), and the result is the same either way.

    Returns:
        ``None`` when ``old`` and ``new`` are bit-identical, else a :class:`Segment` whose
        ``apply_delta`` turns a copy of ``old`` into ``new``.

    Raises:
        TypeError, ValueError: bad arrays, or ``old`` and ``new`` disagree in dtype or length.

    Example::

        >>> old = np.zeros(8, np.uint16); new = old.copy(); new[2] = 1
        >>> encode_delta(old, old) is None, encode_delta(old, new).n_changed
        (True, 1)
    """
    o = _check_values(old, "old")
    n = _check_values(new, "new")
    if o.dtype != n.dtype or o.size != n.size:
        raise ValueError(f"old ({o.dtype}, {o.size}) and new ({n.dtype}, {n.size}) differ in layout")
    del float_bits  # see the docstring
    pos = np.flatnonzero(o != n)
    if pos.size == 0:
        return None
    dense = None
    if pos.size > DENSE_TRY_FRACTION * o.size:
        dense = n - o
        diffs = dense[pos]
    else:
        diffs = n[pos] - o[pos]
    return _encode_add(int(o.size), o.itemsize, pos, diffs, dense, level)


def _encode_delta_xor(old: np.ndarray, new: np.ndarray, *, level: int | None = DEFAULT_LEVEL) -> Segment | None:
    """The v1 encoder (xor-sparse/1, xor-dense/1): kept for tests and comparisons."""
    o = _check_values(old, "old")
    n = _check_values(new, "new")
    if o.dtype != n.dtype or o.size != n.size:
        raise ValueError(f"old ({o.dtype}, {o.size}) and new ({n.dtype}, {n.size}) differ in layout")
    pos = np.flatnonzero(o != n)
    if pos.size == 0:
        return None
    dense = None
    if pos.size > DENSE_TRY_FRACTION * o.size:
        dense = o ^ n
        xvals = dense[pos]
    else:
        xvals = o[pos] ^ n[pos]
    return _encode_xor(int(o.size), o.itemsize, pos, xvals, dense, level)


# --- decoding -----------------------------------------------------------------------------------


def _expect_codec(codec: str, allowed: tuple[str, ...], fn: str) -> None:
    if codec not in KNOWN_CODECS:
        raise UnknownCodecError(f"unknown codec {codec!r}; known: {sorted(KNOWN_CODECS)}")
    if codec not in allowed:
        hint = "; a full segment is not a delta, use decode_full" if codec in FULL_CODECS else ""
        raise ValueError(f"{fn} cannot handle codec {codec!r}; it takes {' or '.join(allowed)}{hint}")


def _read_header(data: bytes, codec: str, width: int, count: int) -> SegmentHeader:
    """Parse the header and check it against the caller's expectations; no allocation."""
    h = peek_header(data)
    if h.codec != codec:
        raise CorruptObjectError(f"segment is {h.codec}, but its manifest says {codec}")
    if h.width != width:
        raise CorruptObjectError(f"{h.codec} segment has element width {h.width}, expected {width}")
    if h.count != count:
        raise CorruptObjectError(f"{h.codec} segment has {h.count} elements, expected {count}")
    if h.total_size != len(data):
        what = "truncated" if len(data) < h.total_size else "has trailing bytes"
        raise CorruptObjectError(
            f"{h.codec} segment {what}: header and table declare {h.total_size} bytes, got {len(data)}"
        )
    if codec in _CODEC_IDS2:
        return h  # raw sizes are implied by the header, n_changed/n_escaped checked by peek
    if codec == CODEC_FULL:
        if h.n_changed != count:
            raise CorruptObjectError(f"full segment declares n_changed {h.n_changed} != count {count}")
        plane_size = count
    else:
        if h.n_changed == 0:
            raise CorruptObjectError(f"{h.codec} segment declares no changed elements")
        plane_size = h.n_changed if codec == CODEC_XOR_SPARSE else count
    for i, s in enumerate(h.sections):
        if s.raw_size != plane_size:
            raise CorruptObjectError(
                f"{h.codec} section {i} declares {s.raw_size} raw bytes, expected {plane_size}"
            )
    return h


def _decode_sections(data: bytes, h: SegmentHeader) -> list[Union[np.ndarray, int]]:
    """Decode each section to a uint8 array (or an int for a CONST plane). Sizes are trusted
    only because :func:`_read_header` already checked them against the caller's expectations."""
    mv = memoryview(data)
    dctx = None  # created on the first ZSTD section: tiny segments are all RAW/CONST
    out: list[Union[np.ndarray, int]] = []
    off = h.header_size
    for i, s in enumerate(h.sections):
        buf = mv[off : off + s.stored_size]
        off += s.stored_size
        if s.kind == "const":
            out.append(buf[0])
        elif s.kind == "raw":
            out.append(np.frombuffer(buf, dtype=np.uint8))
        else:
            try:
                declared = zstandard.frame_content_size(buf)
            except zstandard.ZstdError as e:
                raise CorruptObjectError(f"{h.codec} section {i}: not a zstd frame ({e})") from None
            # A frame header's content size is what zstd would allocate, whatever max_output_size
            # says: check it before decompressing (decompression-bomb guard).
            if declared not in (-1, s.raw_size):
                raise CorruptObjectError(
                    f"{h.codec} section {i}: zstd frame claims {declared} bytes, table says {s.raw_size}"
                )
            if dctx is None:
                dctx = zstandard.ZstdDecompressor()
            try:
                raw = dctx.decompress(buf, max_output_size=s.raw_size, allow_extra_data=False)
            except zstandard.ZstdError as e:
                raise CorruptObjectError(f"{h.codec} section {i}: bad zstd frame ({e})") from None
            if len(raw) != s.raw_size:
                raise CorruptObjectError(
                    f"{h.codec} section {i}: decompressed to {len(raw)} bytes, table says {s.raw_size}"
                )
            out.append(np.frombuffer(raw, dtype=np.uint8))
    return out


def _join(planes: list[Union[np.ndarray, int]], n: int) -> np.ndarray:
    """Inverse of :func:`_planes`: a new writable little-endian uint array of n elements."""
    w = len(planes)
    if w == 1:
        p = planes[0]
        if isinstance(p, int):
            return np.full(n, p, dtype=np.uint8)
        return p.copy()
    u8 = np.empty((n, w), dtype=np.uint8)
    for k, p in enumerate(planes):
        u8[:, k] = p
    return u8.view(_UINT[w]).reshape(n)


def decode_full(data: bytes, *, codec: str, dtype: np.dtype, count: int) -> np.ndarray:
    """Decode a ``full/1`` or ``full/2`` segment.

    Args:
        data: the segment bytes.
        codec: the codec the manifest recorded for it (``full/1`` or ``full/2``).
        dtype: the unsigned dtype expected (its itemsize must match the segment's width).
        count: the element count expected.

    Returns:
        a new writable 1-D array of ``count`` elements of ``dtype``.

    Raises:
        UnknownCodecError: ``codec`` (or the segment's own codec) is unknown.
        CorruptObjectError: the segment is truncated, inconsistent, or disagrees with
            ``codec``/``dtype``/``count``.
    """
    _expect_codec(codec, FULL_CODECS, "decode_full")
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise TypeError(f"dtype must be an unsigned integer dtype, got {dt}")
    h = _read_header(data, codec, dt.itemsize, int(count))
    secs = _decode_sections(data, h)
    if h.transform == _TRANSFORM_PAIRS:
        w = h.width
        packed = _join(secs[w - 1 : w], (h.count + 1) // 2)
        esc = _join(secs[w:], h.n_escaped) if h.n_escaped else None
        secs = secs[: w - 1] + [_unpair_exponents(packed, esc, h.exp_low, h.count, h.n_escaped)]
    out = _join(secs, h.count)
    if h.transform in (_TRANSFORM_ROTL1, _TRANSFORM_PAIRS):
        out = _rotr1(out)
    return out.astype(dt, copy=False)


def _decode_xor(data: bytes, codec: str, width: int, count: int):
    """Decode and fully validate a delta segment, without touching any target.

    Returns ("sparse", positions int64, xor values) or ("dense", xor array, None)."""
    h = _read_header(data, codec, width, count)
    secs = _decode_sections(data, h)
    if codec == CODEC_XOR_DENSE:
        xor = _join(secs, count)
        nz = int(np.count_nonzero(xor))
        if nz != h.n_changed:
            raise CorruptObjectError(
                f"xor-dense segment declares {h.n_changed} changed elements, holds {nz}"
            )
        return "dense", xor, None
    gw = h.gap_width
    gaps = _join(secs[:gw], h.n_changed)
    xvals = _join(secs[gw:], h.n_changed)
    # gaps < 2**32 and n_changed <= count < 2**32, so the uint64 sum cannot overflow; adding 1
    # to every gap makes the positions strictly increasing by construction.
    pos = np.cumsum(gaps.astype(np.uint64) + np.uint64(1)) - np.uint64(1)
    if int(pos[-1]) >= count:
        raise CorruptObjectError(
            f"xor-sparse segment has position {int(pos[-1])}, beyond its {count} elements"
        )
    if not np.all(xvals):
        raise CorruptObjectError("xor-sparse segment holds a zero XOR value (an unchanged element)")
    return "sparse", pos.astype(np.int64), xvals


def _code_lut(width: int) -> np.ndarray:
    """Byte of paired value codes -> the two differences it codes (unzigzagged, width bytes
    each; code 15 decodes to ``_ESC_DIFF``): one gather replaces unpack, widen and unzigzag."""
    lut = _CODE_LUTS.get(width)
    if lut is None:
        b = np.arange(256, dtype=_UINT[width])
        lut = np.empty((256, 2), dtype=_UINT[width])
        lut[:, 0] = _unzigzag(b & _UINT[width].type(15))
        lut[:, 1] = _unzigzag(b >> _UINT[width].type(4))
        _CODE_LUTS[width] = lut
    return lut


_CODE_LUTS: dict[int, np.ndarray] = {}  # width -> (256, 2) table; immutable once built
_ESC_DIFF = {w: _UINT[w].type((1 << (8 * w)) - 8) for w in _WIDTHS}  # unzigzag(15) = -8
_PAIR_VIEW = {1: np.dtype("<u2"), 2: np.dtype("<u4"), 4: np.dtype("<u8")}  # two elements as one


def _decode_codes(packed: np.ndarray, n: int, width: int, what: str) -> np.ndarray:
    """Paired value codes -> differences (escape code 15 as ``-8``), checking the padding."""
    if n % 2 and packed[-1] >> np.uint8(4):
        raise CorruptObjectError(f"{what} segment's padding code is not 0")
    lut = _code_lut(width)
    view = _PAIR_VIEW.get(width)
    if view is not None:
        out = lut.view(view).reshape(256)[packed].view(_UINT[width])
    else:
        out = np.take(lut, packed, axis=0).reshape(-1)
    return out[:n]


def _decode_add(data: bytes, codec: str, width: int, count: int):
    """Decode and fully validate an add-* segment, without touching any target.

    Returns ("sparse", positions int64, diffs) or ("dense", diff array, None); diffs are
    ``new - old`` modulo 2**bits."""
    h = _read_header(data, codec, width, count)
    secs = _decode_sections(data, h)
    # sections: [gap symbols, gap escape planes...] (sparse only), value codes, value escapes
    gsec = (1 + (h.gap_width if h.n_gap_escaped else 0)) if codec == CODEC_ADD_SPARSE else 0
    n_sym = h.n_changed if codec == CODEC_ADD_SPARSE else count
    diffs = _decode_codes(_join(secs[gsec : gsec + 1], (n_sym + 1) // 2), n_sym, width, codec)
    esc_diff = _ESC_DIFF[width]
    esc_at = (diffs == esc_diff).nonzero()[0]
    if esc_at.size != h.n_escaped:
        raise CorruptObjectError(
            f"{codec} segment declares {h.n_escaped} escaped values, its codes hold {esc_at.size}"
        )
    if h.n_escaped:
        esc = _join(secs[gsec + 1 :], h.n_escaped)
        if not (esc >= NIBBLE_ESCAPE).all():
            raise CorruptObjectError(f"{codec} segment escapes a value below {NIBBLE_ESCAPE}")
        diffs[esc_at] = _unzigzag(esc)
    if codec == CODEC_ADD_DENSE:
        nz = int(np.count_nonzero(diffs))  # escaped values are >= 15, never 0
        if nz != h.n_changed:
            raise CorruptObjectError(f"add-dense segment declares {h.n_changed} changed elements, holds {nz}")
        return "dense", diffs, None
    if not diffs.all():
        raise CorruptObjectError("add-sparse segment holds a zero difference (an unchanged element)")
    gsym = _join(secs[:1], h.n_changed)
    gaps = gsym.astype(np.int64)
    if h.n_gap_escaped:
        gesc_at = (gsym == ESCAPE).nonzero()[0]
        n_gesc = gesc_at.size
    else:
        n_gesc = int(np.count_nonzero(gsym == ESCAPE))
    if n_gesc != h.n_gap_escaped:
        raise CorruptObjectError(
            f"add-sparse segment declares {h.n_gap_escaped} escaped gaps, its symbols hold {n_gesc}"
        )
    if h.n_gap_escaped:
        rest = _join(secs[1:gsec], h.n_gap_escaped)  # each < 2**32
        total = int(rest.sum(dtype=np.uint64))  # < 2**32 * 2**32: exact
        if total >= count:  # every gap is below count, so is their sum
            raise CorruptObjectError(
                f"add-sparse segment has position {total} or beyond, beyond its {count} elements"
            )
        gaps[gesc_at] += rest.astype(np.int64)
    # gaps are now < 256 + (escaped remainders summing to < count): every partial sum below is
    # < 2**40 + 2**32 and cannot wrap. Adding 1 to every gap makes the positions strictly
    # increasing (unique) by construction.
    gaps += 1
    pos = np.cumsum(gaps, out=gaps)
    pos -= 1
    if int(pos[-1]) >= count:
        raise CorruptObjectError(
            f"add-sparse segment has position {int(pos[-1])}, beyond its {count} elements"
        )
    return "sparse", pos, diffs


def _decode_delta(data: bytes, codec: str, width: int, count: int):
    if codec in ADD_CODECS:
        return _decode_add(data, codec, width, count)
    return _decode_xor(data, codec, width, count)


def _check_target(target: np.ndarray) -> np.ndarray:
    if not isinstance(target, np.ndarray):
        raise TypeError(f"target must be a numpy array, got {type(target).__name__}")
    if target.ndim != 1 or not target.flags.c_contiguous or target.dtype.kind != "u":
        raise ValueError(
            f"target must be a 1-D contiguous unsigned array, got {target.dtype} {target.shape}"
        )
    if not target.flags.writeable:
        raise ValueError("target is read-only; apply_delta works in place")
    return target


def apply_delta(target: np.ndarray, data: bytes, *, codec: str, inverse: bool = False) -> None:
    """Apply a delta segment to ``target`` in place (or, with ``inverse``, undo it).

    ``xor-*`` deltas are XOR-ed in (their own inverse); ``add-*`` deltas add their differences
    modulo 2**bits (``inverse`` subtracts them). Everything is decoded and validated first
    (header, codec matches ``codec``, width and count match ``target``, positions strictly
    increasing and in range, value counts match), and ``target`` is written only after all
    checks pass: a bad segment leaves it untouched.

    Args:
        target: the base values (1-D contiguous writable unsigned array); becomes the new values
            (with ``inverse``: holds the new values, becomes the base values).
        data: the segment bytes.
        codec: the codec the manifest recorded (one of :data:`DELTA_CODECS`).
        inverse: undo the delta instead: ``apply_delta(t, d, codec=c, inverse=True)`` after
            ``apply_delta(t, d, codec=c)`` restores ``t`` bit for bit, for every codec.

    Raises:
        UnknownCodecError: ``codec`` or the segment's own codec is unknown.
        CorruptObjectError: the segment is truncated, inconsistent or disagrees with ``codec``
            or ``target``; ``target`` is unchanged.
        ValueError: ``codec`` is a full codec (use :func:`decode_full`) or ``target`` unusable.

    Example::

        >>> old = np.arange(6, dtype=np.uint16); t = old.copy(); t[4] = 9
        >>> seg = encode_delta(old, t)
        >>> apply_delta(t, seg.data, codec=seg.codec, inverse=True); t.tolist() == old.tolist()
        True
    """
    _expect_codec(codec, DELTA_CODECS, "apply_delta")
    t = _check_target(target)
    form, a, b = _decode_delta(data, codec, t.itemsize, t.size)
    # astype: the codec works in little-endian; the target may be in native (big) order
    if codec in XOR_CODECS:
        op = np.bitwise_xor
    else:
        op = np.subtract if inverse else np.add  # unsigned arithmetic wraps modulo 2**bits
    if form == "dense":
        op(t, a.astype(t.dtype, copy=False), out=t)
    else:
        # positions are unique, so ufunc.at equals t[a] = op(t[a], b); it is ~1.8x faster
        # (numpy >= 1.25 has a fast path for it: one pass instead of a gather and a scatter)
        op.at(t, a, b.astype(t.dtype, copy=False))


def _compose_xor(fa, fb, count: int, width: int, level: int | None) -> Segment | None:
    if fa[0] == "sparse" and fb[0] == "sparse":
        pos = np.concatenate([fa[1], fb[1]])
        vals = np.concatenate([fa[2], fb[2]])
        order = np.argsort(pos, kind="stable")
        pos, vals = pos[order], vals[order]
        # each input has unique positions, so a position occurs at most twice, adjacently
        dup = np.flatnonzero(pos[1:] == pos[:-1])
        vals[dup] ^= vals[dup + 1]
        keep = np.ones(pos.size, dtype=bool)
        keep[dup + 1] = False
        keep &= vals != 0
        return _encode_xor(count, width, pos[keep], vals[keep], None, level)
    dense = None
    for form, x, v in (fa, fb):
        if form == "dense":
            dense = x if dense is None else np.bitwise_xor(dense, x, out=dense)
    for form, x, v in (fa, fb):
        if form == "sparse":
            dense[x] ^= v
    pos = np.flatnonzero(dense)
    return _encode_xor(count, width, pos, dense[pos], dense, level)


def _compose_add(fa, fb, count: int, width: int, level: int | None) -> Segment | None:
    if fa[0] == "sparse" and fb[0] == "sparse":
        pos = np.concatenate([fa[1], fb[1]])
        vals = np.concatenate([fa[2], fb[2]])
        order = np.argsort(pos, kind="stable")
        pos, vals = pos[order], vals[order]
        dup = np.flatnonzero(pos[1:] == pos[:-1])  # at most twice, adjacently (see _compose_xor)
        vals[dup] += vals[dup + 1]  # wraps modulo 2**bits
        keep = np.ones(pos.size, dtype=bool)
        keep[dup + 1] = False
        keep &= vals != 0
        return _encode_add(count, width, pos[keep], vals[keep], None, level)
    dense = None
    for form, x, v in (fa, fb):
        if form == "dense":
            dense = x if dense is None else np.add(dense, x, out=dense)
    for form, x, v in (fa, fb):
        if form == "sparse":
            dense[x] += v
    pos = np.flatnonzero(dense)
    return _encode_add(count, width, pos, dense[pos], dense, level)


def compose_deltas(a: bytes, b: bytes, *, codec_a: str, codec_b: str, dtype, count: int,
                   level: int | None = DEFAULT_LEVEL, base: np.ndarray | None = None) -> Segment | None:
    """The single delta equivalent to applying ``a`` and then ``b``.

    Deltas of one family compose without the weights: XOR deltas by XOR (the result is
    ``xor-*``, so stores written by v1 compact into v1 codecs), add deltas by adding their
    differences modulo 2**bits (the result is ``add-*``). Elements where the two cancel are
    dropped. An ``xor-*`` and an ``add-*`` delta do not compose without the values they apply
    to: pass ``base`` (the chunk ``a`` applies to, e.g. materialized from the anchor) and the
    result is ``encode_delta(base, b(a(base)))``.

    Args:
        a, b: delta segment bytes; ``codec_a``/``codec_b`` their recorded codecs.
        dtype: the unsigned dtype of the chunk; count: its element count.
        level: as for :func:`encode_delta`.
        base: the values ``a`` applies to; needed only when the two codecs' families differ.

    Returns:
        a :class:`Segment`, or ``None`` if ``b`` undoes ``a`` exactly.

    Raises:
        UnknownCodecError, CorruptObjectError: as for :func:`apply_delta`.
        ValueError: the families differ and ``base`` is missing, or ``base`` has the wrong
            dtype or length.
    """
    _expect_codec(codec_a, DELTA_CODECS, "compose_deltas")
    _expect_codec(codec_b, DELTA_CODECS, "compose_deltas")
    dt = np.dtype(dtype)
    if dt.kind != "u":
        raise TypeError(f"dtype must be an unsigned integer dtype, got {dt}")
    width, count = dt.itemsize, int(count)
    fa = _decode_delta(a, codec_a, width, count)
    fb = _decode_delta(b, codec_b, width, count)
    if codec_a in XOR_CODECS and codec_b in XOR_CODECS:
        return _compose_xor(fa, fb, count, width, level)
    if codec_a in ADD_CODECS and codec_b in ADD_CODECS:
        return _compose_add(fa, fb, count, width, level)
    if base is None:
        raise ValueError(
            f"composing {codec_a} with {codec_b} needs the values they apply to: pass base="
        )
    old = _check_values(base, "base")
    if old.itemsize != width or old.size != count:
        raise ValueError(f"base ({old.dtype}, {old.size}) does not match dtype {dt} and count {count}")
    new = old.copy()
    apply_delta(new, a, codec=codec_a)
    apply_delta(new, b, codec=codec_b)
    return encode_delta(old, new, level=level)
