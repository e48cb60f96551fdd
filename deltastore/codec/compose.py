"""Composing deltas: the single delta equivalent to applying one and then another.

Deltas of one operation compose without the weights (XOR by XOR, add by addition modulo
2**bits); deltas of different operations need the values they apply to.
"""

from __future__ import annotations

import numpy as np

from deltastore.codec.container import DELTA_CODECS, Segment, expect_codec
from deltastore.codec.delta import (
    OPERATION,
    DenseDelta,
    SparseDelta,
    _Operation,
    _decode,
    apply_delta,
    encode_changes,
    encode_delta,
)
from deltastore.codec.planes import DEFAULT_LEVEL, check_dtype, check_values


def _compose(op: _Operation, fa: SparseDelta | DenseDelta, fb: SparseDelta | DenseDelta, count: int,
             width: int, level: int | None) -> Segment | None:
    """Two decoded deltas of ``op``'s family -> one segment (None if they cancel)."""
    if isinstance(fa, SparseDelta) and isinstance(fb, SparseDelta):
        pos = np.concatenate([fa.positions, fb.positions])
        vals = np.concatenate([fa.values, fb.values])
        order = np.argsort(pos, kind="stable")
        pos, vals = pos[order], vals[order]
        # each input has unique positions, so a position occurs at most twice, adjacently
        dup = np.flatnonzero(pos[1:] == pos[:-1])
        vals[dup] = op.combine(vals[dup], vals[dup + 1])  # add wraps modulo 2**bits
        keep = np.ones(pos.size, dtype=bool)
        keep[dup + 1] = False
        keep &= vals != 0
        return encode_changes(op, count, width, pos[keep], vals[keep], None, level)
    # at least one is dense: combine into its (freshly decoded, so writable) array
    dense = None
    for d in (fa, fb):
        if isinstance(d, DenseDelta):
            dense = d.values if dense is None else op.combine(dense, d.values, out=dense)
    for d in (fa, fb):
        if isinstance(d, SparseDelta):
            op.combine.at(dense, d.positions, d.values)  # positions unique: dense[p] op= v
    pos = np.flatnonzero(dense)
    return encode_changes(op, count, width, pos, dense[pos], dense, level)


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
        level: as for :func:`~deltastore.codec.encode_delta`.
        base: the values ``a`` applies to; needed only when the two codecs' families differ.

    Returns:
        a :class:`~deltastore.codec.Segment`, or ``None`` if ``b`` undoes ``a`` exactly.

    Raises:
        UnknownCodecError, CorruptObjectError: as for :func:`~deltastore.codec.apply_delta`.
        TypeError: ``dtype`` is not an unsigned integer dtype.
        ValueError: the families differ and ``base`` is missing, or ``base`` has the wrong
            dtype or length.

    Example::

        >>> old = np.zeros(4, np.uint16); mid = old.copy(); mid[1] = 3; new = mid.copy(); new[1] = 0
        >>> a, b = encode_delta(old, mid), encode_delta(mid, new)
        >>> compose_deltas(a.data, b.data, codec_a=a.codec, codec_b=b.codec, dtype=np.uint16, count=4) is None
        True
    """
    expect_codec(codec_a, DELTA_CODECS, "compose_deltas")
    expect_codec(codec_b, DELTA_CODECS, "compose_deltas")
    dt = check_dtype(dtype)
    width, count = dt.itemsize, int(count)
    fa = _decode(a, codec_a, width, count)
    fb = _decode(b, codec_b, width, count)
    op = OPERATION[codec_a]
    if OPERATION[codec_b] is op:
        return _compose(op, fa, fb, count, width, level)
    if base is None:
        raise ValueError(
            f"composing {codec_a} with {codec_b} needs the values they apply to: pass base="
        )
    old = check_values(base, "base")
    if old.itemsize != width or old.size != count:
        raise ValueError(f"base ({old.dtype}, {old.size}) does not match dtype {dt} and count {count}")
    new = old.copy()
    apply_delta(new, a, codec=codec_a)
    apply_delta(new, b, codec=codec_b)
    return encode_delta(old, new, level=level)
