"""Decoding and applying delta segments (``add-sparse/1``, ``add-dense/1``): every check first,
then the target written (docs/codec-format.md, read path).

A segment is decoded into a :class:`SparseDelta` or :class:`DenseDelta` (:func:`decode_delta`)
or applied to a target in place or into another array, with the chunk's state digests taken in
the same pass (:func:`apply_delta`, :func:`apply_delta_digests`, :func:`apply_delta_into`): by
the native kernel where it is loaded, else by numpy, both writing the same bits and raising the
same errors. A segment too large to decode at once is applied a piece at a time
(:data:`WHOLE_MAX_BYTES`, SPEC §7 step 8).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from deltastore._util import kernels
from deltastore.codec.container import (
    CODEC_ADD_DENSE,
    CODEC_ADD_SPARSE,
    DELTA_CODECS,
    WIDTHS,
    SegmentHeader,
    expect_codec,
    read_header,
)
from deltastore.codec.delta import ESCAPE, NIBBLE_ESCAPE, n_position_sections
from deltastore.codec.planes import (
    UINT,
    Plane,
    SectionPieces,
    check_dtype,
    check_windows,
    decode_sections,
    join,
    section_args,
    state_digest,
    unzigzag,
    zstd_error,
)
from deltastore.errors import CorruptObjectError


# --- typed results ------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseDelta:
    """A decoded sparse delta: ``values[i]`` applies at ``positions[i]``.

    Attributes:
        positions: int64, strictly increasing, each below the chunk's element count.
        values: the differences ``new - old`` (mod 2**bits), non-zero, little-endian unsigned.
    """

    positions: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class DenseDelta:
    """A decoded dense delta: ``values[i]`` applies at element ``i`` (0 where unchanged)."""

    values: np.ndarray


Decoded = SparseDelta | DenseDelta


@dataclass(frozen=True)
class Changes:
    """Where a sparse delta changed a chunk (:func:`apply_delta_into`).

    Attributes:
        positions: int64, strictly increasing.
        old, new: the chunk's bits there before and after (the chunk's dtype).
    """

    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray


def _positions(gaps: np.ndarray, count: int, codec: str) -> np.ndarray:
    """Gaps (uint64, each < 2**32, fewer than 2**32 of them: the sums below cannot wrap) ->
    positions (int64), checked to be below ``count``. Adding 1 to every gap makes the
    positions strictly increasing (unique) by construction. Works in place on ``gaps``."""
    gaps += np.uint64(1)
    pos = np.cumsum(gaps, out=gaps)
    pos -= np.uint64(1)
    if int(pos[-1]) >= count:
        raise CorruptObjectError(f"{codec} segment has position {int(pos[-1])}, beyond its {count} elements")
    return pos.view(np.int64)  # < count < 2**32: the same numbers


def _code_lut(width: int) -> np.ndarray:
    """Byte of paired value codes -> the two differences it codes (unzigzagged, width bytes
    each; code 15 decodes to ``_ESC_DIFF``): one gather replaces unpack, widen and unzigzag."""
    lut = _CODE_LUTS.get(width)
    if lut is None:
        b = np.arange(256, dtype=UINT[width])
        lut = np.empty((256, 2), dtype=UINT[width])
        lut[:, 0] = unzigzag(b & UINT[width].type(15))
        lut[:, 1] = unzigzag(b >> UINT[width].type(4))
        _CODE_LUTS[width] = lut
    return lut


_CODE_LUTS: dict[int, np.ndarray] = {}  # width -> (256, 2) table; immutable once built
_ESC_DIFF = {w: UINT[w].type((1 << (8 * w)) - 8) for w in WIDTHS}  # unzigzag(15) = -8
_PAIR_VIEW = {1: np.dtype("<u2"), 2: np.dtype("<u4"), 4: np.dtype("<u8")}  # two elements as one


def _read_add_values(secs: Sequence[Plane], h: SegmentHeader, n: int) -> np.ndarray:
    """Paired value codes -> differences, escapes filled in from the escape sections."""
    packed = join(secs[:1], (n + 1) // 2)
    if n % 2 and packed[-1] >> np.uint8(4):
        raise CorruptObjectError(f"{h.codec} segment's padding code is not 0")
    lut = _code_lut(h.width)
    view = _PAIR_VIEW.get(h.width)
    if view is not None:
        diffs = lut.view(view).reshape(256)[packed].view(UINT[h.width])[:n]
    else:
        diffs = np.take(lut, packed, axis=0).reshape(-1)[:n]
    esc_at = (diffs == _ESC_DIFF[h.width]).nonzero()[0]
    if esc_at.size != h.n_escaped:
        raise CorruptObjectError(
            f"{h.codec} segment declares {h.n_escaped} escaped values, its codes hold {esc_at.size}"
        )
    if h.n_escaped:
        esc = join(secs[1:], h.n_escaped)
        if not (esc >= NIBBLE_ESCAPE).all():
            raise CorruptObjectError(f"{h.codec} segment escapes a value below {NIBBLE_ESCAPE}")
        diffs[esc_at] = unzigzag(esc)
    return diffs


def _read_add_positions(secs: Sequence[Plane], h: SegmentHeader, count: int) -> np.ndarray:
    gsym = join(secs[:1], h.n_changed)
    gesc_at = (gsym == ESCAPE).nonzero()[0]
    if gesc_at.size != h.n_gap_escaped:
        raise CorruptObjectError(
            f"{h.codec} segment declares {h.n_gap_escaped} escaped gaps, its symbols hold {gesc_at.size}"
        )
    gaps = gsym.astype(np.uint64)
    if h.n_gap_escaped:
        rest = join(secs[1:], h.n_gap_escaped)  # each < 2**32
        total = int(rest.sum(dtype=np.uint64))  # < 2**32 * 2**32: exact
        if total >= count:  # every gap is below count, so is their sum
            raise CorruptObjectError(
                f"{h.codec} segment has position {total} or beyond, beyond its {count} elements"
            )
        gaps[gesc_at] += rest.astype(np.uint64)
    # gaps are now < 256 + (escaped remainders summing to < count): every partial sum is
    # < 2**40 + 2**32 and cannot wrap.
    return _positions(gaps, count, h.codec)


# --- decoding and applying ----------------------------------------------------------------


def decode_delta(data: bytes, *, codec: str, dtype, count: int) -> Decoded:
    """Decode and fully validate a delta segment without applying it (e.g. to prepare the
    values before a short critical section that applies them).

    Args:
        data: the segment bytes.
        codec: the codec the manifest recorded (one of :data:`DELTA_CODECS`).
        dtype: the chunk's unsigned dtype; count: its element count.

    Returns:
        :class:`SparseDelta` (positions and the operation's values of the changed elements) or
        :class:`DenseDelta` (every element's value); the values are the differences
        ``new - old`` modulo 2**bits.

    Raises:
        UnknownCodecError, CorruptObjectError: as for :func:`apply_delta`.
        ValueError: ``codec`` is a full codec. TypeError: ``dtype`` is not unsigned.

    Example::

        >>> old = np.zeros(8, np.uint16); new = old.copy(); new[2] = 5
        >>> seg = encode_delta(old, new)
        >>> d = decode_delta(seg.data, codec=seg.codec, dtype=np.uint16, count=8)
        >>> d.positions.tolist(), d.values.tolist()
        ([2], [5])
    """
    expect_codec(codec, DELTA_CODECS, "decode_delta")
    return decode(data, codec, check_dtype(dtype).itemsize, int(count))


def decode(data: bytes, codec: str, width: int, count: int) -> Decoded:
    """:func:`decode_delta` for a codec already checked to be a delta codec."""
    return _decode_sections(data, read_header(data, codec, width, count))


def _decode_sections(data: bytes, h: SegmentHeader) -> Decoded:
    codec, count = h.codec, h.count
    secs = decode_sections(data, h)
    if codec != CODEC_ADD_SPARSE:
        values = _read_add_values(secs, h, count)
        nz = int(np.count_nonzero(values))  # escaped values are >= 15, never 0
        if nz != h.n_changed:
            raise CorruptObjectError(f"{codec} segment declares {h.n_changed} changed elements, holds {nz}")
        return DenseDelta(values)
    k = n_position_sections(h)
    values = _read_add_values(secs[k:], h, h.n_changed)
    if not values.all():
        raise CorruptObjectError(f"{codec} segment holds a zero difference (an unchanged element)")
    return SparseDelta(_read_add_positions(secs[:k], h, count), values)


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

    The delta's differences are added modulo 2**bits (``inverse`` subtracts them). Everything is decoded and validated first
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
    _apply(target, data, codec, inverse, 0)


def apply_delta_digests(target: np.ndarray, data: bytes, *, codec: str, inverse: bool = False,
                        before: bool = False, after: bool = False) -> tuple[str | None, str | None]:
    """:func:`apply_delta`, also returning the XXH3-128 hex digests of ``target``'s bytes
    before and/or after (SPEC §2's state digest), as asked.

    With the native kernel the digests are taken in the same pass over the target as the apply
    (block by block: hash, patch, hash), so the target is read from memory once instead of
    three times. A corrupt segment raises before anything is hashed or written.

    Returns:
        ``(before_hex or None, after_hex or None)``.

    Raises:
        as :func:`apply_delta`.

    Example::

        >>> old = np.zeros(8, np.uint16); new = old.copy(); new[2] = 1
        >>> seg = encode_delta(old, new); t = old.copy()
        >>> b, a = apply_delta_digests(t, seg.data, codec=seg.codec, before=True, after=True)
        >>> b == xxhash.xxh3_128_hexdigest(old.tobytes()), a == xxhash.xxh3_128_hexdigest(new.tobytes())
        (True, True)
    """
    return _apply(target, data, codec, inverse, (1 if before else 0) | (2 if after else 0))[:2]


def apply_delta_into(source: np.ndarray, out: np.ndarray, data: bytes, *, codec: str, before: bool = False,
                     after: bool = False) -> tuple[str | None, str | None, Changes | None]:
    """Write ``source`` with the delta applied into ``out``, leaving ``source`` as it is, and
    say which elements differ: what a staged update needs (SPEC §7.7), in one pass.

    Args:
        source: the base values (1-D contiguous unsigned array; only read).
        out: a writable array of ``source``'s dtype and size, not overlapping it.
        data, codec: as for :func:`apply_delta`.
        before, after: return the XXH3-128 hex digest of ``source`` / of ``out``.

    Returns:
        ``(before_hex or None, after_hex or None, changes)``: for a sparse codec, the
        :class:`Changes` -- exactly the elements where ``out`` differs from ``source`` (a
        sparse segment's values are never zero), with their bits in both; None for a dense one.

    Raises:
        as :func:`apply_delta`; a refused segment leaves ``out`` unwritten.

    Example::

        >>> old = np.zeros(8, np.uint16); new = old.copy(); new[2] = 1
        >>> seg = encode_delta(old, new); out = np.empty_like(old)
        >>> _, _, ch = apply_delta_into(old, out, seg.data, codec=seg.codec)
        >>> out.tolist() == new.tolist(), ch.positions.tolist(), ch.old.tolist(), ch.new.tolist()
        (True, [2], [0], [1])
    """
    if not isinstance(out, np.ndarray) or not isinstance(source, np.ndarray):
        raise TypeError("source and out must be numpy arrays")
    if out.dtype != source.dtype or out.shape != source.shape or np.shares_memory(out, source):
        raise ValueError(f"out ({out.dtype} {out.shape}) must match source ({source.dtype} {source.shape}) and not overlap it")
    return _apply(out, data, codec, False, (1 if before else 0) | (2 if after else 0), source=source)


#: apply.c's DS_E_ZSTD: a zstd section the kernel decoded failed.
_ZSTD_FAILED = 9

# The kernel's segment kinds (apply.c K_*).
_KERNEL_KIND = {CODEC_ADD_SPARSE: 0, CODEC_ADD_DENSE: 1}


def _kernel_error(err: int, a: int, b: int, codec: str, count: int) -> CorruptObjectError:
    """The numpy decoder's message for the kernel's error code (apply.c DS_E_*)."""
    message = {
        1: f"{codec} segment's padding code is not 0",
        2: f"{codec} segment declares {a} escaped values, its codes hold {b}",
        3: f"{codec} segment escapes a value below {NIBBLE_ESCAPE}",
        4: f"{codec} segment holds a zero difference (an unchanged element)",
        5: f"{codec} segment declares {a} escaped gaps, its symbols hold {b}",
        6: f"{codec} segment has position {a} or beyond, beyond its {count} elements",
        7: f"{codec} segment has position {a}, beyond its {count} elements",
        8: f"{codec} segment declares {a} changed elements, holds {b}",
    }.get(err, f"{codec} segment refused by the native decoder (error {err})")
    return CorruptObjectError(message)


def _digest(t: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(t).cast("B"))


def _apply(target: np.ndarray, data: bytes, codec: str, inverse: bool, want: int,
           source: np.ndarray | None = None) -> tuple[str | None, str | None, Changes | None]:
    """:func:`apply_delta_digests` with ``want`` as the kernel's bits (1 before, 2 after); with
    ``source``, :func:`apply_delta_into` (``target`` is ``out``, ``before`` hashes ``source``)."""
    expect_codec(codec, DELTA_CODECS, "apply_delta")
    t = _check_target(target)
    sparse = codec == CODEC_ADD_SPARSE
    kernel = kernels.apply_segment
    native = kernel is not None and t.dtype.str[0] != ">"  # the kernel works in little-endian
    h = read_header(data, codec, t.itemsize, t.size)
    if _working_bytes(h, native) > WHOLE_MAX_BYTES:
        return _apply_pieces(t, data, h, inverse, want, source)
    if native:
        secs = section_args(data, h)  # zstd frames decoded by the kernel itself where it can
        ch = None
        if source is not None and sparse:
            ch = Changes(np.empty(h.n_changed, np.int64), np.empty(h.n_changed, t.dtype), np.empty(h.n_changed, t.dtype))
        try:
            if source is None:
                err, a, b, before, after = kernel(
                    t, _KERNEL_KIND[codec], h.width, h.gap_width, secs,
                    h.n_changed, h.n_gap_escaped, h.n_escaped, inverse, want,
                )
            else:
                err, a, b, before, after = kernel(
                    source, _KERNEL_KIND[codec], h.width, h.gap_width, secs,
                    h.n_changed, h.n_gap_escaped, h.n_escaped, inverse, want, t,
                    *((ch.positions, ch.old, ch.new) if ch is not None else ()),
                )
        except ValueError as e:  # sections disagree with the header: read_header should not allow it
            raise CorruptObjectError(f"{codec} segment: {e}") from None
        if err == _ZSTD_FAILED:  # a zstd section's frame (zstd.c): its kind and message in before/after
            raise zstd_error(h, a, before, b, after)
        if err:
            raise _kernel_error(err, a, b, codec, t.size)
        return before, after, ch
    d = _decode_sections(data, h)
    if source is not None:
        before = _digest(source) if want & 1 else None
        np.copyto(t, source)
    else:
        before = _digest(t) if want & 1 else None
    ufunc = np.subtract if inverse else np.add  # modulo 2**bits: unsigned arithmetic wraps
    # astype: the codec works in little-endian; the target may be in native (big) order
    values = d.values.astype(t.dtype, copy=False)
    if isinstance(d, DenseDelta):
        ufunc(t, values, out=t)
    else:
        # positions are unique, so ufunc.at equals t[p] = op(t[p], v); it is ~1.8x faster
        # (numpy >= 1.25 has a fast path for it: one pass instead of a gather and a scatter)
        ufunc.at(t, d.positions, values)
    ch = None
    if source is not None and isinstance(d, SparseDelta):
        ch = Changes(d.positions, source[d.positions], t[d.positions])
    return before, (_digest(t) if want & 2 else None), ch


# --- large segments, a piece at a time ----------------------------------------------------

#: A delta segment whose decoding would hold more than this at once (the native kernel's
#: decoded sections; on the numpy path also the positions and values it builds, see
#: :func:`_working_bytes`) is applied a piece at a time (:func:`_apply_pieces`), so that what a
#: decoder holds is bounded whatever the chunk's size (SPEC §7 step 8). The deltas of the
#: default 16 MiB chunks stay below it on the native path; on the numpy path those of training
#: steps (a few % changed, ~1 % of values escaped) do.
WHOLE_MAX_BYTES = 48 << 20

#: Changes (sparse codecs) or elements (dense codecs) per piece: a piece's planes, positions and
#: values are a few MiB.
PIECE_ELEMENTS = 1 << 18


def _working_bytes(h: SegmentHeader, native: bool) -> int:
    """What applying ``h``'s segment whole holds at its peak, at most: the kernel's decoded
    sections (a CONST one is a byte); the numpy decoder's sections and the arrays it builds
    from them (per change: an int64 position, its gap, the value and masks; per escape: its
    index, planes and widened value)."""
    if native:
        return sum(s.raw_size for s in h.sections if s.kind != "const")
    escapes = h.n_escaped * (16 + 4 * h.width) + h.n_gap_escaped * 24
    if h.codec == CODEC_ADD_SPARSE:
        return h.raw_size + h.n_changed * (16 + h.width) + escapes
    return h.raw_size + h.count * (2 + h.width) + escapes


@dataclass(frozen=True)
class _Piece:
    """Part of a decoded delta: ``values`` for elements ``start …`` (dense), or at
    ``positions`` (sparse, absolute)."""

    start: int
    positions: np.ndarray | None
    values: np.ndarray


class _PieceReader:
    """A segment's sections read a piece at a time, in step (one :class:`SectionPieces` each)."""

    def __init__(self, data: bytes, h: SegmentHeader, piece: int):
        self.h = h
        self.src = [SectionPieces(data, h, i, piece + 1) for i in range(len(h.sections))]

    def planes(self, first: int, k: int, n: int) -> list[Plane]:
        """The next ``n`` bytes of sections ``first … first + k - 1``."""
        return [self.src[i].take(n) for i in range(first, first + k)]

    def end(self, skip: tuple[int, ...] = ()) -> None:
        for i, s in enumerate(self.src):
            if i not in skip:
                s.end()


def _as_array(p: Plane, n: int) -> np.ndarray:
    return np.full(n, p, np.uint8) if isinstance(p, int) else p


class _Escapes:
    """Escaped entries of ``width`` bytes (the byte planes of sections ``first …``), taken in
    order as the codes that stand for them are met; codes beyond the declared count are only
    counted (the count is checked once the whole segment is read)."""

    def __init__(self, reader: _PieceReader, first: int, width: int, declared: int):
        self.reader, self.first, self.width, self.declared = reader, first, width, declared
        self.used = self.held = 0

    def take(self, k: int) -> np.ndarray | None:
        """The next ``k`` entries (uint64), or None once more are met than were declared."""
        self.held += k
        t = min(k, self.declared - self.used)
        if t == 0:
            return None if k else np.empty(0, np.uint64)
        got = join([_as_array(p, t) for p in self.reader.planes(self.first, self.width, t)], t).astype(np.uint64)
        self.used += t
        return got if t == k else None

    @property
    def exact(self) -> bool:
        return self.held == self.declared

    def partly_read(self) -> tuple[int, ...]:
        """The sections left partly read when the count is wrong (not checked for their end)."""
        return () if self.used == self.declared else tuple(range(self.first, self.first + self.width))


def _delta_pieces(data: bytes, h: SegmentHeader) -> Iterator[_Piece]:
    """The segment's delta a piece of :data:`PIECE_ELEMENTS` at a time, with every check of
    :func:`_decode`: a piece's zstd sections as they are read, the rest once the segment is
    read whole (each counted over all of it), reported in :func:`_decode`'s order. A caller
    that must not write before the segment is known good reads it through once first."""
    codec, w, count, piece = h.codec, h.width, h.count, max(2, PIECE_ELEMENTS // 2 * 2)
    r = _PieceReader(data, h, piece)
    found = {"padding": False, "small": False}

    def add_values(first: int, m: int, last: bool, esc: _Escapes) -> np.ndarray | None:
        """Differences of ``m`` paired codes; None when the escapes ran out."""
        packed = _as_array(r.planes(first, 1, (m + 1) // 2)[0], (m + 1) // 2)
        if last and m % 2 and packed[-1] >> np.uint8(4):
            found["padding"] = True
        lut = _code_lut(w)
        view = _PAIR_VIEW.get(w)
        if view is not None:
            diffs = lut.view(view).reshape(256)[packed].view(UINT[w])[:m]
        else:
            diffs = np.take(lut, packed, axis=0).reshape(-1)[:m]
        at = (diffs == _ESC_DIFF[w]).nonzero()[0]
        got = esc.take(int(at.size))
        if got is None:
            return None
        if got.size:
            found["small"] |= not bool((got >= NIBBLE_ESCAPE).all())
            diffs[at] = unzigzag(got.astype(UINT[w]))
        return diffs

    def value_errors(esc: _Escapes) -> list[str]:
        """_read_add_values' checks, in its order."""
        return [msg for bad, msg in [
            (found["padding"], f"{codec} segment's padding code is not 0"),
            (not esc.exact, f"{codec} segment declares {h.n_escaped} escaped values, its codes hold {esc.held}"),
            (found["small"], f"{codec} segment escapes a value below {NIBBLE_ESCAPE}"),
        ] if bad]

    if codec != CODEC_ADD_SPARSE:
        esc = _Escapes(r, 1, w, h.n_escaped)
        nz = 0
        for start in range(0, count, piece):
            m = min(piece, count - start)
            values = add_values(0, m, start + m == count, esc)
            if values is None:
                continue
            nz += int(np.count_nonzero(values))  # escaped values are >= 15, never 0
            yield _Piece(start, None, values)
        r.end(esc.partly_read())
        errors = value_errors(esc)
        if nz != h.n_changed:
            errors.append(f"{codec} segment declares {h.n_changed} changed elements, holds {nz}")
        if errors:
            raise CorruptObjectError(errors[0])
        return

    n = h.n_changed
    n_pos = n_position_sections(h)
    gesc = _Escapes(r, 1, h.gap_width, h.n_gap_escaped)
    vesc = _Escapes(r, n_pos + 1, w, h.n_escaped)
    last = -1  # the last position so far
    zero = False
    for start in range(0, n, piece):
        m = min(piece, n - start)
        sym = _as_array(r.planes(0, 1, m)[0], m)
        gaps = sym.astype(np.uint64)
        at = (sym == ESCAPE).nonzero()[0]
        rest = gesc.take(int(at.size))
        values = add_values(n_pos, m, start + m == n, vesc)
        if rest is None or values is None:
            continue
        gaps[at] += rest
        zero = zero or not values.all()
        # each position is the last one + 1 + its gap: a gap is < 2**32 + 255, so a piece adds
        # < 2**51 and the positions stay far from wrapping (they are checked against count at
        # the end, as _decode checks its last one)
        gaps += np.uint64(1)
        pos = np.cumsum(gaps, out=gaps)  # >= 1
        pos += np.uint64(last + 1)
        pos -= np.uint64(1)
        last = int(pos[-1])
        yield _Piece(0, pos.view(np.int64), values)
    r.end(gesc.partly_read() + vesc.partly_read())
    errors = value_errors(vesc)
    if zero:
        errors.append(f"{codec} segment holds a zero difference (an unchanged element)")
    if not gesc.exact:
        errors.append(f"{codec} segment declares {h.n_gap_escaped} escaped gaps, its symbols hold {gesc.held}")
    if last >= count:
        errors.append(f"{codec} segment has position {last}, beyond its {count} elements")
    if errors:
        raise CorruptObjectError(errors[0])


def _apply_pieces(t: np.ndarray, data: bytes, h: SegmentHeader, inverse: bool, want: int,
                  source: np.ndarray | None) -> tuple[str | None, str | None, Changes | None]:
    """:func:`_apply` for a segment above :data:`WHOLE_MAX_BYTES`: read through once to check
    it (nothing written: a refused segment leaves ``t`` as it was), then again to apply it,
    a piece at a time; the digests in passes of their own."""
    check_windows(data, h)
    for _ in _delta_pieces(data, h):
        pass
    src = t if source is None else source
    before = state_digest(src) if want & 1 else None
    if source is not None:
        np.copyto(t, source)
    ufunc = np.subtract if inverse else np.add
    record = source is not None and h.codec == CODEC_ADD_SPARSE
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for p in _delta_pieces(data, h):
        values = p.values.astype(t.dtype, copy=False)
        if p.positions is None:
            part = t[p.start : p.start + values.size]
            ufunc(part, values, out=part)
        else:
            ufunc.at(t, p.positions, values)
            if record:
                found.append((p.positions.copy(), source[p.positions], t[p.positions]))
    ch = None
    if record:
        ch = Changes(*(np.concatenate([f[i] for f in found]) for i in range(3))) if found else Changes(
            np.empty(0, np.int64), np.empty(0, t.dtype), np.empty(0, t.dtype))
    return before, (state_digest(t) if want & 2 else None), ch
