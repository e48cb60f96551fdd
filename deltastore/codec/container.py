"""The segment container: codec ids, the ``DSG2`` header, the section table.

A segment is a fixed header, a table of sections (kind and stored size; the raw sizes are
implied by the header), then the sections' stored bytes. The normative layout is
docs/codec-format.md.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from deltastore.errors import CorruptObjectError, UnknownCodecError

CODEC_FULL2 = "full/2"
CODEC_ADD_SPARSE = "add-sparse/1"
CODEC_ADD_DENSE = "add-dense/1"
KNOWN_CODECS: frozenset[str] = frozenset({CODEC_FULL2, CODEC_ADD_SPARSE, CODEC_ADD_DENSE})
# what each entry point takes
FULL_CODECS = (CODEC_FULL2,)
DELTA_CODECS = (CODEC_ADD_SPARSE, CODEC_ADD_DENSE)

# Counts and section sizes are u32 (5-byte table entries); a chunk is at most this many
# elements. Callers split larger tensors into chunks, which they do anyway for parallelism.
MAX_COUNT = 2**32 - 1

WIDTHS = (1, 2, 4, 8)
GAP_WIDTHS = (1, 2, 4)

# full/2's ``param``: how the values are stored
TRANSFORM_NONE = 0
TRANSFORM_ROTL1 = 1  # float bit patterns rotated left by one bit: the exponent fills the top byte
TRANSFORM_PAIRS = 2  # rotated, and the top (exponent) byte coded as pairs of 4-bit window codes
# Width of full/2's exponent window (transform 2): codes 0..14 are exponents low..low+14, so the
# window's low end is at most 256 - 15.
EXP_WINDOW = 15

KIND_RAW = 0  # stored bytes are the plane itself (stored size == raw size)
KIND_ZSTD = 1  # stored bytes are exactly one zstd frame of raw-size bytes
KIND_CONST = 2  # stored bytes are one byte, repeated raw-size (>= 1) times
_KIND_NAMES = {KIND_RAW: "raw", KIND_ZSTD: "zstd", KIND_CONST: "const"}


# DSG2: a 25-byte header (magic, codec id, codec version, width, param, count, n_changed, aux,
# n_escaped, n_sections) and 5-byte table entries (kind, stored size): the raw sizes are implied
# by the header.
MAGIC = b"DSG2"
HEADER = struct.Struct("<4sBBBBIIIIB")
ENTRY = struct.Struct("<BI")
#: codec -> (codec id byte, codec version byte)
CODEC_IDS = {CODEC_FULL2: (1, 2), CODEC_ADD_SPARSE: (4, 1), CODEC_ADD_DENSE: (5, 1)}
_CODEC_BY_ID = {key: codec for codec, key in CODEC_IDS.items()}


def _codec_of(cid: int, cver: int) -> str:
    codec = _CODEC_BY_ID.get((cid, cver))
    if codec is None:
        raise UnknownCodecError(f"DSG2 segment has codec id {cid} version {cver}, which this deltastore does not read "
                                f"(it reads {', '.join(sorted(KNOWN_CODECS))}); upgrade deltastore")
    return codec


@dataclass(frozen=True)
class Segment:
    """One encoded segment.

    Attributes:
        codec: the codec id, one of :data:`KNOWN_CODECS`; record it next to ``data`` (the
            decoders check it against the segment's own header).
        data: the self-describing encoded bytes (header + payload).
        n_changed: elements that differ from the base (the element count for a full segment).
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
        n_changed: elements that differ from the base (== count for full segments).
        gap_width: bytes per position gap (``xor-sparse``) or per escaped gap remainder
            (``add-sparse``); 0 for the other codecs.
        sections: the section table, in payload order.
        header_size: bytes of fixed header plus section table.
        total_size: header_size plus every section's stored size: the exact segment length.
        transform: ``full/2`` only: 0 plain, 1 rotated left by one bit, 2 rotated with the
            exponent plane as paired window codes.
        n_escaped: ``add-*``: values stored in full in the value escape sections; ``full/2``
            with transform 2: exponents outside the window.
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


# --- reading ------------------------------------------------------------------------------


def peek_header(data: bytes) -> SegmentHeader:
    """Parse and structurally validate a segment's header and section table.

    Only the header and table need be present: the payload's length is reported in
    ``total_size`` and checked by the decoders, not here, so a caller may peek at a prefix.

    Raises:
        UnknownCodecError: not a ``DSG2`` segment, or an unknown codec id or version.
        CorruptObjectError: truncated header/table or fields inconsistent with each other.

    Example::

        >>> import numpy as np
        >>> from deltastore.codec import encode_full
        >>> h = peek_header(encode_full(np.arange(10, dtype=np.uint16)).data)
        >>> h.codec, h.width, h.count
        ('full/2', 2, 10)
    """
    mv = memoryview(data)
    head = bytes(mv[:4])
    if head != MAGIC:
        if len(mv) < 4 and head == MAGIC[: len(mv)]:
            raise CorruptObjectError(f"segment truncated: {len(mv)} bytes, shorter than its magic")
        raise UnknownCodecError(f"not a segment this deltastore reads: magic {head!r}, expected {MAGIC!r}")
    if len(mv) < HEADER.size:
        raise CorruptObjectError(f"segment truncated: {len(mv)} bytes, the fixed header alone is {HEADER.size}")
    _, cid, cver, width, param, count, n_changed, aux, n_escaped, n_sections = HEADER.unpack_from(mv)
    codec = _codec_of(cid, cver)
    if width not in WIDTHS:
        raise CorruptObjectError(f"segment declares element width {width}, must be 1, 2, 4 or 8")
    if n_changed > count:
        raise CorruptObjectError(f"segment declares n_changed {n_changed} > count {count}")
    gap_width = transform = exp_low = n_gap_esc = 0
    if codec == CODEC_FULL2:
        if param not in (TRANSFORM_NONE, TRANSFORM_ROTL1, TRANSFORM_PAIRS) or (param and width == 1):
            raise CorruptObjectError(f"full/2 segment declares transform {param} for width {width}")
        if n_changed != count:
            raise CorruptObjectError(f"full/2 segment declares n_changed {n_changed} != count {count}")
        transform = param
        if transform == TRANSFORM_PAIRS:
            # aux is the exponent window's low end
            if aux > 256 - EXP_WINDOW or n_escaped > count:
                raise CorruptObjectError(
                    f"full/2 segment declares exponent window at {aux} and {n_escaped} escapes"
                )
            exp_low = aux
            sizes = [count] * (width - 1) + [(count + 1) // 2] + ([n_escaped] if n_escaped else [])
        else:
            if n_escaped != 0 or aux != 0:
                raise CorruptObjectError(
                    f"full/2 segment declares escapes {aux}/{n_escaped} without transform 2"
                )
            sizes = [count] * width
    else:
        if n_changed == 0:
            raise CorruptObjectError(f"{codec} segment declares no changed elements")
        if n_escaped > n_changed or aux > n_changed:
            raise CorruptObjectError(
                f"{codec} segment declares {aux}/{n_escaped} escapes > {n_changed} changed"
            )
        esc = [n_escaped] * width if n_escaped else []
        if codec == CODEC_ADD_SPARSE:
            if param not in GAP_WIDTHS or (param != 1 and not aux):
                raise CorruptObjectError(
                    f"add-sparse segment declares gap width {param} for {aux} escaped gaps "
                    "(1, 2 or 4; 1 when none)"
                )
            gap_width, n_gap_esc = param, aux
            gap_esc = [n_gap_esc] * gap_width if n_gap_esc else []
            sizes = [n_changed, *gap_esc, (n_changed + 1) // 2, *esc]
        else:
            if param != 0 or aux != 0:
                raise CorruptObjectError(
                    f"add-dense segment declares parameter {param} and {aux} gap escapes, must be 0"
                )
            sizes = [(count + 1) // 2] + esc
    sections, header_size, total = _read_table(mv, codec, n_sections, sizes)
    return SegmentHeader(
        codec=codec, width=width, count=count, n_changed=n_changed, gap_width=gap_width,
        sections=sections, header_size=header_size, total_size=total,
        transform=transform, n_escaped=n_escaped, n_gap_escaped=n_gap_esc, exp_low=exp_low,
    )


def _read_table(mv: memoryview, codec: str, n_sections: int,
                sizes: Sequence[int]) -> tuple[tuple[SectionInfo, ...], int, int]:
    """The section table, each entry's raw size from ``sizes`` (what the header implies).
    Returns (sections, header size, total size)."""
    if n_sections != len(sizes):
        raise CorruptObjectError(f"{codec} segment declares {n_sections} sections, its header implies {len(sizes)}")
    header_size = HEADER.size + n_sections * ENTRY.size
    if len(mv) < header_size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, header and section table need {header_size}"
        )
    sections = []
    total = header_size
    for i, raw in enumerate(sizes):
        kind, stored = ENTRY.unpack_from(mv, HEADER.size + i * ENTRY.size)
        _check_entry(i, kind, stored, raw)
        sections.append(SectionInfo(_KIND_NAMES[kind], stored, raw))
        total += stored
    return tuple(sections), header_size, total


def _check_entry(i: int, kind: int, stored: int, raw: int) -> None:
    if kind == KIND_RAW:
        if stored != raw:
            raise CorruptObjectError(f"raw section {i} stores {stored} bytes, declares {raw}")
    elif kind == KIND_CONST:
        if stored != 1 or raw == 0:
            raise CorruptObjectError(
                f"const section {i} must store 1 byte for >= 1 raw bytes, has {stored}/{raw}"
            )
    elif kind == KIND_ZSTD:
        if stored == 0:
            raise CorruptObjectError(f"zstd section {i} is empty")
    else:
        raise CorruptObjectError(f"section {i} has unknown kind {kind}")


def expect_codec(codec: str, allowed: tuple[str, ...], fn: str) -> None:
    """Check a caller's codec argument: known, and one that ``fn`` takes."""
    if codec not in KNOWN_CODECS:
        raise UnknownCodecError(f"unknown codec {codec!r}; known: {sorted(KNOWN_CODECS)}")
    if codec not in allowed:
        hint = "; a full segment is not a delta, use decode_full" if codec in FULL_CODECS else ""
        raise ValueError(f"{fn} cannot handle codec {codec!r}; it takes {' or '.join(allowed)}{hint}")


def read_header(data: bytes, codec: str, width: int, count: int) -> SegmentHeader:
    """Parse the header and check it against the caller's expectations (the codec, width and
    count its manifest recorded; the exact length; every raw size); allocates nothing."""
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
    return h  # raw sizes are implied by the header, n_changed/n_escaped checked by peek


# --- writing ------------------------------------------------------------------------------


def pack(codec: str, *, width: int, count: int, n_changed: int, sections: Sequence[tuple[int, bytes, int]],
         param: int = 0, aux: int = 0, n_escaped: int = 0) -> bytes:
    """A segment from its encoded sections [(kind, stored bytes, raw size)] and the header
    fields ``param``, ``aux`` and ``n_escaped`` (see docs/codec-format.md)."""
    cid, cver = CODEC_IDS[codec]
    head = HEADER.pack(MAGIC, cid, cver, width, param, count, n_changed, aux, n_escaped, len(sections))
    table = [ENTRY.pack(kind, len(stored)) for kind, stored, _ in sections]
    return b"".join([head, *table, *(stored for _, stored, _ in sections)])


def packed_size(n_sections: int, stored_bytes: int) -> int:
    """The length :func:`pack` returns for ``n_sections`` sections of ``stored_bytes`` in all
    (lets an encoder compare candidate forms without building each)."""
    return HEADER.size + n_sections * ENTRY.size + stored_bytes
