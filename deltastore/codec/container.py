"""The segment container: codec ids, the ``DSG1`` and ``DSG2`` headers, the section table.

A segment is a fixed header, a table of sections (kind and sizes), then the sections' stored
bytes. ``DSG1`` (v1 codecs) stores both sizes of every section; ``DSG2`` (v2 codecs) stores only
the stored size, the raw sizes being implied by the header. Each layout has its own parser
(:func:`_parse_dsg1`, :func:`_parse_dsg2`); the checks common to both (width, counts, the
table's entries, truncation) are written once. The normative layout is docs/codec-format.md.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import CorruptObjectError, UnknownCodecError

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
SPARSE_CODECS = (CODEC_XOR_SPARSE, CODEC_ADD_SPARSE)

# Section sizes are u32 (12-byte table entries instead of 20); a chunk is at most this many
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


@dataclass(frozen=True)
class _Layout:
    """One header layout: its magic, header and table-entry structs, and the codecs it holds
    (codec string -> (id byte, version byte))."""

    magic: bytes
    header: struct.Struct
    entry: struct.Struct
    ids: dict[str, tuple[int, int]]

    def codec_of(self, cid: int, cver: int) -> str:
        for codec, key in self.ids.items():
            if key == (cid, cver):
                return codec
        name = _CODEC_NAME_BY_ID.get(cid)
        magic = self.magic.decode()
        if name is None:
            raise UnknownCodecError(f"{magic} segment has unknown codec id {cid}; upgrade deltastore")
        known = sorted(v for i, v in self.ids.values() if i == cid)
        raise UnknownCodecError(
            f"{magic} segment uses codec {name!r} version {cver}, this deltastore reads "
            f"version(s) {known} in {magic} segments; upgrade deltastore"
        )


# DSG1: a 28-byte header and 12-byte table entries (kind, 3 zero bytes, stored size, raw size)
DSG1 = _Layout(
    b"DSG1", struct.Struct("<4sBBBBQQB3s"), struct.Struct("<B3sII"),
    {CODEC_FULL: (1, 1), CODEC_XOR_SPARSE: (2, 1), CODEC_XOR_DENSE: (3, 1)},
)
# DSG2: a 25-byte header and 5-byte table entries whose raw sizes are implied by the header
# (v1: 28 + 12 per section, 76 bytes for a bf16 xor-sparse segment, ~3 % of a typical
# small-tensor delta at < 1 % changed; v2 add-sparse: 35-45 bytes).
DSG2 = _Layout(
    b"DSG2", struct.Struct("<4sBBBBIIIIB"), struct.Struct("<BI"),
    {CODEC_FULL2: (1, 2), CODEC_ADD_SPARSE: (4, 1), CODEC_ADD_DENSE: (5, 1)},
)
_LAYOUT_OF = {codec: layout for layout in (DSG1, DSG2) for codec in layout.ids}
_CODEC_NAME_BY_ID = {1: "full", 2: "xor-sparse", 3: "xor-dense", 4: "add-sparse", 5: "add-dense"}
_ZERO3 = b"\x00\x00\x00"


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
        UnknownCodecError: unknown magic, codec id or codec version.
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
    if head == DSG2.magic:
        return _parse_dsg2(mv)
    if head == DSG1.magic:
        return _parse_dsg1(mv)
    if len(mv) < 4 and (head == DSG1.magic[: len(mv)] or head == DSG2.magic[: len(mv)]):
        raise CorruptObjectError(f"segment truncated: {len(mv)} bytes, shorter than its magic")
    raise UnknownCodecError(
        f"not a deltastore segment: magic {head!r}, expected {DSG1.magic!r} or {DSG2.magic!r}"
    )


def _unpack_fixed(mv: memoryview, layout: _Layout) -> tuple:
    if len(mv) < layout.header.size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, the fixed header alone is {layout.header.size}"
        )
    return layout.header.unpack_from(mv)


def _check_counts(width: int, count: int, n_changed: int) -> None:
    """Checks of the fields that both layouts share."""
    if width not in WIDTHS:
        raise CorruptObjectError(f"segment declares element width {width}, must be 1, 2, 4 or 8")
    if count > MAX_COUNT:
        raise CorruptObjectError(f"segment declares {count} elements, more than {MAX_COUNT}")
    if n_changed > count:
        raise CorruptObjectError(f"segment declares n_changed {n_changed} > count {count}")


def _parse_dsg1(mv: memoryview) -> SegmentHeader:
    """:func:`peek_header` for ``DSG1`` segments (full/1, xor-sparse/1, xor-dense/1)."""
    _, cid, cver, width, gap_width, count, n_changed, n_sections, reserved = _unpack_fixed(mv, DSG1)
    codec = DSG1.codec_of(cid, cver)
    if reserved != _ZERO3:
        raise CorruptObjectError(f"segment header reserved bytes are {reserved!r}, must be zero")
    _check_counts(width, count, n_changed)
    if codec == CODEC_XOR_SPARSE:
        if gap_width not in GAP_WIDTHS:
            raise CorruptObjectError(f"xor-sparse segment declares gap width {gap_width}")
        want_sections = gap_width + width
    else:
        if gap_width != 0:
            raise CorruptObjectError(f"{codec} segment declares gap width {gap_width}, must be 0")
        want_sections = width
    _check_n_sections(codec, n_sections, want_sections, "its widths imply")

    def entry(i: int, raw_hint: None) -> tuple[int, int, int]:
        kind, pad, stored, raw = DSG1.entry.unpack_from(mv, DSG1.header.size + i * DSG1.entry.size)
        if pad != _ZERO3:
            raise CorruptObjectError(f"section {i} reserved bytes are {pad!r}, must be zero")
        return kind, stored, raw

    sections, header_size, total = _read_table(mv, DSG1, [None] * n_sections, entry)
    return SegmentHeader(
        codec=codec, width=width, count=count, n_changed=n_changed, gap_width=gap_width,
        sections=sections, header_size=header_size, total_size=total,
    )


def _parse_dsg2(mv: memoryview) -> SegmentHeader:
    """:func:`peek_header` for ``DSG2`` segments (full/2, add-sparse/1, add-dense/1); the
    section raw sizes follow from the header fields."""
    _, cid, cver, width, param, count, n_changed, aux, n_escaped, n_sections = _unpack_fixed(mv, DSG2)
    codec = DSG2.codec_of(cid, cver)
    _check_counts(width, count, n_changed)
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
    _check_n_sections(codec, n_sections, len(sizes), "its header implies")

    def entry(i: int, raw: int) -> tuple[int, int, int]:
        kind, stored = DSG2.entry.unpack_from(mv, DSG2.header.size + i * DSG2.entry.size)
        return kind, stored, raw

    sections, header_size, total = _read_table(mv, DSG2, sizes, entry)
    return SegmentHeader(
        codec=codec, width=width, count=count, n_changed=n_changed, gap_width=gap_width,
        sections=sections, header_size=header_size, total_size=total,
        transform=transform, n_escaped=n_escaped, n_gap_escaped=n_gap_esc, exp_low=exp_low,
    )


def _check_n_sections(codec: str, n_sections: int, want: int, why: str) -> None:
    if n_sections != want:
        raise CorruptObjectError(f"{codec} segment declares {n_sections} sections, {why} {want}")


def _read_table(mv: memoryview, layout: _Layout, raw_hints: Sequence,
                entry: Callable[[int, Any], tuple[int, int, int]]) -> tuple[tuple[SectionInfo, ...], int, int]:
    """The section table: ``entry(i, raw_hints[i])`` unpacks entry ``i`` as (kind, stored, raw).
    Returns (sections, header size, total size)."""
    header_size = layout.header.size + len(raw_hints) * layout.entry.size
    if len(mv) < header_size:
        raise CorruptObjectError(
            f"segment truncated: {len(mv)} bytes, header and section table need {header_size}"
        )
    sections = []
    total = header_size
    for i, hint in enumerate(raw_hints):
        kind, stored, raw = entry(i, hint)
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
    if _LAYOUT_OF[codec] is DSG2:
        return h  # raw sizes are implied by the header, n_changed/n_escaped checked by peek
    # DSG1 declares raw sizes: each must be the one the codec implies
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


# --- writing ------------------------------------------------------------------------------


def pack(codec: str, *, width: int, count: int, n_changed: int, sections: Sequence[tuple[int, bytes, int]],
         param: int = 0, aux: int = 0, n_escaped: int = 0) -> bytes:
    """A segment from its encoded sections [(kind, stored bytes, raw size)].

    ``param`` is DSG1's gap width or DSG2's param byte; ``aux`` and ``n_escaped`` exist in DSG2
    only (see docs/codec-format.md)."""
    layout = _LAYOUT_OF[codec]
    cid, cver = layout.ids[codec]
    if layout is DSG1:
        assert aux == 0 and n_escaped == 0, "DSG1 has no escape fields"
        head = DSG1.header.pack(DSG1.magic, cid, cver, width, param, count, n_changed, len(sections), _ZERO3)
        table = [DSG1.entry.pack(kind, _ZERO3, len(stored), raw) for kind, stored, raw in sections]
    else:
        head = DSG2.header.pack(DSG2.magic, cid, cver, width, param, count, n_changed, aux, n_escaped, len(sections))
        table = [DSG2.entry.pack(kind, len(stored)) for kind, stored, _ in sections]
    return b"".join([head, *table, *(stored for _, stored, _ in sections)])


def packed_size(codec: str, n_sections: int, stored_bytes: int) -> int:
    """The length :func:`pack` returns for ``n_sections`` sections of ``stored_bytes`` in all
    (lets an encoder compare candidate forms without building each)."""
    layout = _LAYOUT_OF[codec]
    return layout.header.size + n_sections * layout.entry.size + stored_bytes
