"""Delta segments (``add-sparse/1``, ``add-dense/1``): the change from one version of a chunk
to the next.

A delta is a set of changed positions with one value each: the difference ``new - old`` modulo
2**bits, applied by addition and undone by subtraction. It is coded into sections as:

- positions (sparse form): gaps ``p_0, p_i - p_{i-1} - 1`` as one-byte gap symbols, long gaps
  escaped;
- values: the zigzag of ``new - old`` as paired 4-bit codes, large values escaped.

Each delta is written in the sparse form, and also in the dense form (every element's value)
when enough elements changed; the smaller wins. Decoding and applying a delta is
:mod:`deltastore.codec.apply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from deltastore._util import kernels
from deltastore.codec.container import CODEC_ADD_DENSE, CODEC_ADD_SPARSE, GAP_WIDTHS, Segment, SegmentHeader, pack
from deltastore.codec.planes import (
    DEFAULT_LEVEL,
    UINT,
    ZSTD_PLANE_PARAMS,
    check_values,
    encode_byte_sections,
    encode_byte_sections_many,
    encode_sections,
    pack_nibbles,
    split,
    unpack_nibbles,
    unzigzag,
    zigzag,
)

# Only above this changed fraction is the dense form also encoded. On bf16 Adam-step deltas the
# dense form first wins at ~55 % changed (Huffman spends >= 1 bit on every unchanged element's
# zero byte); at 40 % it is still 9 % larger. Below
# this line, trying dense would double the encoding work for nothing.
DENSE_TRY_FRACTION = 0.40

# Gap symbols of add-sparse are one byte: a gap below this value is the symbol itself, anything
# else is this symbol plus (gap - ESCAPE) in the gap escape sections. A gap's high byte, mostly
# zero, costs Huffman >= 1 bit; escaping it saves 0.02 B per changed element at lr 1e-6
# (0.961 vs 0.984 for plain byte planes; order-0 position entropy 0.93).
ESCAPE = 255

# Value codes of the add codecs are 4 bits, two per byte: zigzag(new - old) below this value is
# the code itself, anything else is this code plus the full-width value in the escape sections.
# Adam steps move bf16 weights by 1-2 ulp, so codes 1..4 dominate and Huffman over single bytes
# pays ~0.3 bit per symbol of redundancy; pairs halve it (design 003: 0.293 -> 0.249 B per
# changed element on a small model's steps); ~1 % of changed elements escape.
NIBBLE_ESCAPE = 15


# --- coding positions and values ---------------------------------------------------------


@dataclass(frozen=True)
class _Coded:
    """One part of a delta (positions or values) as planes, and the header fields it sets."""

    planes: list[np.ndarray]
    param: int = 0  # gap width of the position planes
    n_escaped: int = 0


def _gaps(pos: np.ndarray) -> np.ndarray:
    """Strictly increasing positions -> gaps ``p_0, p_i - p_{i-1} - 1`` (int64)."""
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    return gaps


def _gap_width(max_gap: int) -> int:
    for gw in GAP_WIDTHS:
        if max_gap < 1 << (8 * gw):
            return gw
    raise AssertionError("gap >= 2**32 despite count <= MAX_COUNT")  # pragma: no cover


def code_positions(pos: np.ndarray) -> _Coded:
    """One-byte gap symbols (``ESCAPE`` for gaps >= ``ESCAPE``), then the byte planes of
    ``gap - ESCAPE`` for the escaped ones."""
    gaps = _gaps(pos)
    sym = np.minimum(gaps, ESCAPE).astype(np.uint8)
    rest = gaps[gaps >= ESCAPE]
    if rest.size == 0:
        return _Coded([sym], param=1)
    rest -= ESCAPE  # gaps are geometric-like: the remainder past the escape is distributed alike
    gw = _gap_width(int(rest.max()))
    return _Coded([sym, *split(rest.astype(UINT[gw]))], param=gw, n_escaped=int(rest.size))


def code_values(diffs: np.ndarray) -> _Coded:
    """Paired 4-bit codes of the zigzag values (``NIBBLE_ESCAPE`` for the large ones), then the
    byte planes of the escaped zigzag values."""
    zz = zigzag(diffs)
    big = zz >= NIBBLE_ESCAPE
    n_esc = int(np.count_nonzero(big))
    packed = pack_nibbles(np.minimum(zz, NIBBLE_ESCAPE).astype(np.uint8))
    if n_esc == 0:
        return _Coded([packed])
    return _Coded([packed, *split(zz[big])], n_escaped=n_esc)


def n_position_sections(h: SegmentHeader) -> int:
    """Sections of an add-sparse segment that hold positions: the gap symbols, then the gap
    escapes' byte planes when a gap was escaped."""
    return 1 + (h.gap_width if h.n_gap_escaped else 0)


# --- encoding -----------------------------------------------------------------------------


def encode_changes(count: int, width: int, pos: np.ndarray, vals: np.ndarray,
                   dense: np.ndarray | None, level: int | None) -> Segment | None:
    """Encode the change set {pos: vals} (differences, non-zero; ``dense``: every element's
    difference, if the caller has it) as the smaller of add-sparse and add-dense; None if empty."""
    n = int(pos.size)
    if n == 0:
        return None
    best = _sparse_segment(count, width, n, code_positions(pos), code_values(vals), level)
    if n > DENSE_TRY_FRACTION * count:
        if dense is None:
            dense = np.zeros(count, dtype=UINT[width])
            dense[pos] = vals
        v = code_values(dense)
        data = pack(CODEC_ADD_DENSE, width=width, count=count, n_changed=n, n_escaped=v.n_escaped,
                    sections=encode_sections(v.planes, level))
        if len(data) < len(best.data):
            best = Segment(CODEC_ADD_DENSE, data, n)
    return best


def _sparse_segment(count: int, width: int, n: int, p: _Coded, v: _Coded, level: int | None) -> Segment:
    data = pack(CODEC_ADD_SPARSE, width=width, count=count, n_changed=n, param=p.param, aux=p.n_escaped,
                n_escaped=v.n_escaped, sections=encode_sections(p.planes + v.planes, level))
    return Segment(CODEC_ADD_SPARSE, data, n)


def _encode(old: np.ndarray, new: np.ndarray, level: int | None) -> Segment | None:
    o = check_values(old, "old")
    n = check_values(new, "new")
    if o.dtype != n.dtype or o.size != n.size:
        raise ValueError(f"old ({o.dtype}, {o.size}) and new ({n.dtype}, {n.size}) differ in layout")
    pos = np.flatnonzero(o != n)
    if pos.size == 0:
        return None
    dense = None
    if pos.size > DENSE_TRY_FRACTION * o.size:
        dense = n - o  # unsigned: wraps modulo 2**bits
        vals = dense[pos]
    else:
        vals = n[pos] - o[pos]
    return encode_changes(int(o.size), o.itemsize, pos, vals, dense, level)


def encode_delta(old: np.ndarray, new: np.ndarray, *, level: int | None = DEFAULT_LEVEL,
                 float_bits: bool = False) -> Segment | None:
    """Encode the change from ``old`` to ``new`` as the smaller of add-sparse and add-dense.

    Values are stored as zigzag(new - old mod 2**bits): an Adam step moves a bf16 weight by a
    few units in the last place, so the difference is a small signed integer (an XOR would
    spread a carry over several bits).

    Args:
        old, new: 1-D contiguous arrays of the same unsigned dtype and length (raw bits).
        level: ``None`` for the tuned plane parameters
            (:data:`~deltastore.codec.planes.ZSTD_PLANE_PARAMS`), or a zstd level.
        float_bits: accepted for compatibility; ignored (the delta codecs do not depend on the
            values being floats, and the result is the same either way).

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
    del float_bits  # accepted for compatibility (deltastore/write/publisher.py passes it); ignored
    if kernels.encode_add is None:
        return _encode(old, new, level)
    return _encode_add_native(old, new, level, advance=False, digest=DIGEST_NONE)[0]


def encode_delta_advance(old: np.ndarray, new: np.ndarray, *, level: int | None = DEFAULT_LEVEL,
                         advance: bool = True, always_digest: bool = True,
                         changes: list[tuple[object, object, object]] | None = None) -> tuple[Segment | None, str | None]:
    """:func:`encode_delta`, the reference advance and the chunk's state digest in one pass.

    With the native kernels loaded (:mod:`deltastore._util.kernels`) each element of ``old``
    and ``new`` is read once; otherwise the numpy path runs. Both write the same bytes.

    Args:
        old, new: as for :func:`encode_delta`. ``old`` is overwritten with ``new`` (at the
            changed elements) when ``advance``; it must then be writable.
        level: as for :func:`encode_delta`.
        advance: advance ``old`` to ``new``. After an exception ``old`` may be partly advanced
            (an encoder's reference copy is dropped after any failure, SPEC §5 step 7).
        always_digest: return the digest even when nothing changed (else None then).
        changes: when given, and the native kernel ran and something changed, the change list
            is appended to it: ``(positions, old values, new values)``, each changed element's
            position in the chunk (uint32) and its values (raw bits), in order, as read-only
            bytes-like buffers.

    Returns:
        ``(segment, digest)``: the segment as :func:`encode_delta` returns it, and the XXH3-128
        hex digest of ``new`` (SPEC §2, state digests).

    Example::

        >>> old = np.zeros(8, np.uint16); new = old.copy(); new[2] = 1
        >>> seg, digest = encode_delta_advance(old, new)
        >>> seg.n_changed, old.tolist() == new.tolist(), len(digest)
        (1, True, 32)
    """
    if kernels.encode_add is not None:
        return _encode_add_native(old, new, level, advance=advance,
                                  digest=DIGEST_ALWAYS if always_digest else DIGEST_IF_CHANGED, changes=changes)
    seg = _encode(old, new, level)
    n = check_values(new, "new")
    digest = xxhash.xxh3_128_hexdigest(memoryview(n).cast("B")) if seg is not None or always_digest else None
    if advance and seg is not None:
        old[...] = new
    return seg, digest


#: The native encode_add kernel's digest modes (deltastore/_native/encode.c): the chunk's
#: XXH3-128 never, only when something changed (a delta publish), or always (an anchor).
#: Public for benchmarks.publish_budget, which times the kernel with and without it.
DIGEST_NONE, DIGEST_IF_CHANGED, DIGEST_ALWAYS = 0, 1, 2


def _encode_add_native(old: np.ndarray, new: np.ndarray, level: int | None, *, advance: bool,
                       digest: int, changes: list[tuple[object, object, object]] | None = None
                       ) -> tuple[Segment | None, str | None]:
    o = check_values(old, "old")
    n = check_values(new, "new")
    if o.dtype != n.dtype or o.size != n.size:
        raise ValueError(f"old ({o.dtype}, {o.size}) and new ({n.dtype}, {n.size}) differ in layout")
    # o is old unless old is big-endian (then o is a little-endian copy): advance old afterwards
    if changes is None:
        k, syms, rest, max_rest, codes, esc, hexdigest = kernels.encode_add(o, n, o.itemsize, advance and o is old, digest)
    else:
        k, syms, rest, max_rest, codes, esc, hexdigest, positions, olds, news = kernels.encode_add(
            o, n, o.itemsize, advance and o is old, digest, True)
        if k:
            changes.append((positions, olds, news))
    if k == 0:
        return None, hexdigest
    if advance and o is not old:
        old[...] = new
    seg = add_segment_from_planes(int(o.size), o.itemsize, k, syms, rest, max_rest, codes, esc, level)
    return seg, hexdigest


def add_segment_from_planes(count: int, width: int, k: int, syms: bytes, rest: bytes, max_rest: int,
                            codes: bytes, esc: bytes, level: int | None = DEFAULT_LEVEL) -> Segment:
    """The add segment of a chunk of ``count`` elements of ``width`` bytes from the raw planes of
    its ``k`` changes, as the native ``encode_add`` (encode.c) returns them: exactly what
    :func:`encode_changes` writes for the same change set."""
    return add_segments_from_planes([(count, width, k, syms, rest, max_rest, codes, esc)], level)[0]


#: One chunk's raw planes, as :func:`add_segment_from_planes` takes them.
RawPlanes = tuple[int, int, int, bytes, bytes, int, bytes, bytes]


def add_segments_from_planes(chunks: Sequence[RawPlanes], level: int | None = DEFAULT_LEVEL) -> list[Segment]:
    """:func:`add_segment_from_planes` of several chunks (each ``(count, width, k, syms, rest,
    max_rest, codes, esc)``): the same segments.

    With the default level, a sparse segment is built by the native ``add_sparse_segment``
    (planes.c: its planes compressed by the system's libzstd, without the GIL) where that writes
    exactly what this module writes (:func:`native_segments`); otherwise the planes are entropy
    coded here, several chunks' together
    (:func:`~deltastore.codec.planes.encode_byte_sections_many`)."""
    if level is None and native_segments():
        build = kernels.add_sparse_segment
        return [Segment(CODEC_ADD_SPARSE, build(*c), c[2]) if c[2] <= DENSE_TRY_FRACTION * c[0]
                else _segments_from_planes([c], level)[0] for c in chunks]
    return _segments_from_planes(chunks, level)


#: Whether the native segments are this module's (None: not checked yet; see native_segments).
_NATIVE_SEGMENTS: bool | None = None


def native_segments() -> bool:
    """Whether the native ``add_sparse_segment`` builds sparse segments here, checked once per
    process: it is loaded, libzstd can compress, its parameters are
    :data:`~deltastore.codec.planes.ZSTD_PLANE_PARAMS`, and the segments it builds of a set of
    probe planes are byte for byte the ones python-zstandard's frames give (another libzstd
    version may write other frames: then every segment is built here, and the bytes in the bucket
    do not depend on the machine's libzstd)."""
    global _NATIVE_SEGMENTS
    if _NATIVE_SEGMENTS is None:
        _NATIVE_SEGMENTS = _native_segments_agree()
    return _NATIVE_SEGMENTS


def _native_segments_agree() -> bool:
    params = kernels.zstd_plane_params() if kernels.zstd_plane_params is not None else None
    p = ZSTD_PLANE_PARAMS
    if kernels.add_sparse_segment is None or params != (p.window_log, p.hash_log, p.chain_log, p.search_log,
                                                         p.min_match, p.target_length, p.strategy):
        return False
    rng = np.random.default_rng(20250)
    # sparse well below DENSE_TRY_FRACTION with the run below: the native builder writes the sparse form only
    for count, width, density in ((1 << 16, 2, 0.02), (1 << 14, 1, 0.1), (1 << 12, 4, 0.2), (300, 2, 0.01)):
        old = rng.integers(0, 1 << (8 * width), count, dtype=np.uint64).astype(UINT[width])
        new = old.copy()
        at = rng.random(count) < density
        new[at] += rng.geometric(0.3, int(at.sum())).astype(UINT[width])
        new[: count // 8] += 1  # a long run of equal codes: a CONST-prone plane
        k, syms, rest, max_rest, codes, esc = kernels.encode_add(old, new, width, True, DIGEST_NONE)[:6]
        chunk = (count, width, k, syms, rest, max_rest, codes, esc)
        if kernels.add_sparse_segment(*chunk) != _segments_from_planes([chunk], None)[0].data:
            return False
    return True


def _segments_from_planes(chunks: Sequence[RawPlanes], level: int | None) -> list[Segment]:
    """:func:`add_segments_from_planes` with the planes entropy coded here."""
    out: list[Segment | None] = [None] * len(chunks)
    sparse: list[tuple[int, list[bytes], dict[str, int]]] = []
    for i, (count, width, k, syms, rest, max_rest, codes, esc) in enumerate(chunks):
        if k > DENSE_TRY_FRACTION * count:
            # the dense form is tried too: rebuild the change set (rare: > 40 % changed) and let
            # encode_changes choose, as the numpy path does
            sym = np.frombuffer(syms, dtype=np.uint8)
            rest_u32 = np.frombuffer(rest, dtype=UINT[4])
            esc_w = np.frombuffer(esc, dtype=UINT[width])
            gaps = sym.astype(np.int64)
            gaps[sym == ESCAPE] += rest_u32
            gaps += 1
            pos = np.cumsum(gaps) - 1
            zz = unpack_nibbles(np.frombuffer(codes, dtype=np.uint8), k, CODEC_ADD_SPARSE).astype(UINT[width])
            zz[zz == NIBBLE_ESCAPE] = esc_w
            out[i] = encode_changes(count, width, pos, unzigzag(zz), None, level)
            continue
        # The planes as bytes, no numpy (this runs per changed chunk): byte b of each little-endian
        # element (the kernels run on little-endian hosts only) is the slice [b::element width].
        # The same planes as _add_positions / _add_values, so the same sections (tests/codec/test_native.py).
        planes = [syms]
        gw = 1
        if rest:
            gw = _gap_width(max_rest)
            planes += [rest[b::4] for b in range(gw)]  # each rest < 2**(8 gw): its low gw bytes
        planes.append(codes)
        if esc:
            planes += [esc[b::width] for b in range(width)]
        sparse.append((i, planes, dict(width=width, count=count, n_changed=k, param=gw, aux=len(rest) // 4,
                                       n_escaped=len(esc) // width)))
    if sparse:
        # one chunk (the store's own encoder, per chunk): its planes compressed one call each
        many = ([encode_byte_sections(sparse[0][1], level)] if len(sparse) == 1
                else encode_byte_sections_many([p for _, p, _ in sparse], level))
        for (i, _, head), secs in zip(sparse, many):
            out[i] = Segment(CODEC_ADD_SPARSE, pack(CODEC_ADD_SPARSE, sections=secs, **head), head["n_changed"])
    return out  # type: ignore[return-value]  # every None was filled
