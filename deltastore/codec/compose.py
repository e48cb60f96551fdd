"""Composing deltas: the single delta equivalent to applying one and then another.

Add deltas compose without the weights: their differences add modulo 2**bits.
"""

from __future__ import annotations

import numpy as np

from deltastore.codec.container import DELTA_CODECS, Segment, expect_codec
from deltastore.codec.apply import DenseDelta, SparseDelta, decode
from deltastore.codec.delta import encode_changes
from deltastore.codec.planes import DEFAULT_LEVEL, check_dtype


def _compose(fa: SparseDelta | DenseDelta, fb: SparseDelta | DenseDelta, count: int, width: int,
             level: int | None) -> Segment | None:
    """Two decoded deltas -> one segment (None if they cancel)."""
    if isinstance(fa, SparseDelta) and isinstance(fb, SparseDelta):
        pos = np.concatenate([fa.positions, fb.positions])
        vals = np.concatenate([fa.values, fb.values])
        order = np.argsort(pos, kind="stable")
        pos, vals = pos[order], vals[order]
        # each input has unique positions, so a position occurs at most twice, adjacently
        dup = np.flatnonzero(pos[1:] == pos[:-1])
        vals[dup] = vals[dup] + vals[dup + 1]  # wraps modulo 2**bits
        keep = np.ones(pos.size, dtype=bool)
        keep[dup + 1] = False
        keep &= vals != 0
        return encode_changes(count, width, pos[keep], vals[keep], None, level)
    # at least one is dense: combine into its (freshly decoded, so writable) array
    dense = None
    for d in (fa, fb):
        if isinstance(d, DenseDelta):
            dense = d.values if dense is None else np.add(dense, d.values, out=dense)
    for d in (fa, fb):
        if isinstance(d, SparseDelta):
            np.add.at(dense, d.positions, d.values)  # positions unique: dense[p] += v
    pos = np.flatnonzero(dense)
    return encode_changes(count, width, pos, dense[pos], dense, level)


def compose_deltas(a: bytes, b: bytes, *, codec_a: str, codec_b: str, dtype, count: int,
                   level: int | None = DEFAULT_LEVEL) -> Segment | None:
    """The single delta equivalent to applying ``a`` and then ``b``.

    The differences of the two deltas add modulo 2**bits, without the values they apply to;
    elements where the two cancel are dropped.

    Args:
        a, b: delta segment bytes; ``codec_a``/``codec_b`` their recorded codecs.
        dtype: the unsigned dtype of the chunk; count: its element count.
        level: as for :func:`~deltastore.codec.encode_delta`.

    Returns:
        a :class:`~deltastore.codec.Segment`, or ``None`` if ``b`` undoes ``a`` exactly.

    Raises:
        UnknownCodecError, CorruptObjectError: as for :func:`~deltastore.codec.apply_delta`.
        TypeError: ``dtype`` is not an unsigned integer dtype.

    Example::

        >>> from deltastore.codec import encode_delta
        >>> old = np.zeros(4, np.uint16); mid = old.copy(); mid[1] = 3; new = mid.copy(); new[1] = 0
        >>> a, b = encode_delta(old, mid), encode_delta(mid, new)
        >>> compose_deltas(a.data, b.data, codec_a=a.codec, codec_b=b.codec, dtype=np.uint16, count=4) is None
        True
    """
    expect_codec(codec_a, DELTA_CODECS, "compose_deltas")
    expect_codec(codec_b, DELTA_CODECS, "compose_deltas")
    dt = check_dtype(dtype)
    width, count = dt.itemsize, int(count)
    fa = decode(a, codec_a, width, count)
    fb = decode(b, codec_b, width, count)
    return _compose(fa, fb, count, width, level)
