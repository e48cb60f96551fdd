"""Segment codecs: lossless encodings of one chunk of raw bit patterns, and of deltas between them.

The codec is pure: numpy arrays and bytes in, numpy arrays and bytes out. It knows nothing of
tensors, files or stores. Callers hand it 1-D contiguous arrays of an unsigned integer dtype
(``uint8``/``uint16``/``uint32``/``uint64``) holding the raw bits of their values (bf16 and fp16
as ``uint16``, fp32 as ``uint32``, ...), so every round trip is bit-exact, NaN payloads and
``-0.0`` included.

Three codecs exist, each identified by a string ``"<name>/<version>"``:

``full/2`` (:data:`CODEC_FULL2`)
    The values of a whole chunk (an anchor), split into byte planes (plane ``k`` holds byte
    ``k``, little-endian order, of every element), each stored on its own. With
    ``encode_full(..., float_bits=True)`` the bit patterns are first rotated left by one bit so
    the exponent fills the top plane, and that plane may be coded as pairs of 4-bit codes in a
    window of 15 exponents (whichever is smaller); the header records the transform.
``add-sparse/1`` (:data:`CODEC_ADD_SPARSE`)
    Positions of the changed elements as gaps (one-byte symbols, long gaps escaped), then the
    zigzag of ``new - old`` (mod 2**bits) as paired 4-bit codes (large values escaped). Applied
    by addition, undone by subtraction (``apply_delta(..., inverse=True)``), composed by
    addition without the weights.
``add-dense/1`` (:data:`CODEC_ADD_DENSE`)
    The zigzag difference of every element as paired 4-bit codes. Wins when most elements change.

Segments are self-describing ``DSG2`` segments; the normative byte layout and read path are in
``docs/codec-format.md``, the measurements behind the codecs in ``docs/design/003-codec-v2.md``.

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
bare ``IndexError`` or ``zstd.ZstdError``. :func:`decode_delta` returns a validated delta as a
:class:`SparseDelta` or :class:`DenseDelta` without applying it.

The package follows the format: :mod:`~deltastore.codec.container` (codec ids, the header,
the section table), :mod:`~deltastore.codec.planes` (byte planes, sections and their entropy
coding), :mod:`~deltastore.codec.full` (``full/2``), :mod:`~deltastore.codec.delta` (encoding
``add-sparse/1`` and ``add-dense/1``), :mod:`~deltastore.codec.apply` (decoding and applying
them) and :mod:`~deltastore.codec.compose`.

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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltastore.codec.compose import compose_deltas
    from deltastore.codec.container import (
        CODEC_ADD_DENSE,
        CODEC_ADD_SPARSE,
        CODEC_FULL2,
        DELTA_CODECS,
        FULL_CODECS,
        KNOWN_CODECS,
        MAX_COUNT,
        SectionInfo,
        Segment,
        SegmentHeader,
        peek_header,
    )
    from deltastore.codec.apply import (
        Changes,
        DenseDelta,
        SparseDelta,
        apply_delta,
        apply_delta_digests,
        apply_delta_into,
        decode_delta,
    )
    from deltastore.codec.delta import DENSE_TRY_FRACTION, ESCAPE, NIBBLE_ESCAPE, encode_delta
    from deltastore.codec.full import (
        MIN_PAIR_COUNT,
        PAIR_SAMPLE_STRIDE,
        decode_full,
        decode_full_into,
        encode_full,
    )
    from deltastore.codec.planes import DEFAULT_LEVEL, MIN_ZSTD_INPUT, ZSTD_PLANE_PARAMS

#: Each public name's module, imported on first access (PEP 562): the metadata path (manifests,
#: HEAD, ``deltastore log``) imports ``deltastore._util.kernels`` only, and numpy (~0.1 s) is
#: loaded by the first caller that encodes or decodes a segment.
_LAZY = {
    **dict.fromkeys(("compose_deltas",), "deltastore.codec.compose"),
    **dict.fromkeys(("CODEC_ADD_DENSE", "CODEC_ADD_SPARSE", "CODEC_FULL2", "DELTA_CODECS", "FULL_CODECS",
                     "KNOWN_CODECS", "MAX_COUNT", "SectionInfo", "Segment", "SegmentHeader", "peek_header"),
                    "deltastore.codec.container"),
    **dict.fromkeys(("Changes", "DenseDelta", "SparseDelta", "apply_delta", "apply_delta_digests", "apply_delta_into",
                     "decode_delta"), "deltastore.codec.apply"),
    **dict.fromkeys(("DENSE_TRY_FRACTION", "ESCAPE", "NIBBLE_ESCAPE", "encode_delta"), "deltastore.codec.delta"),
    **dict.fromkeys(("MIN_PAIR_COUNT", "PAIR_SAMPLE_STRIDE", "decode_full", "decode_full_into", "encode_full"),
                    "deltastore.codec.full"),
    **dict.fromkeys(("DEFAULT_LEVEL", "MIN_ZSTD_INPUT", "ZSTD_PLANE_PARAMS"), "deltastore.codec.planes"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CODEC_ADD_DENSE",
    "CODEC_ADD_SPARSE",
    "CODEC_FULL2",
    "Changes",
    "DEFAULT_LEVEL",
    "DELTA_CODECS",
    "DENSE_TRY_FRACTION",
    "DenseDelta",
    "ESCAPE",
    "FULL_CODECS",
    "KNOWN_CODECS",
    "MAX_COUNT",
    "MIN_PAIR_COUNT",
    "MIN_ZSTD_INPUT",
    "NIBBLE_ESCAPE",
    "PAIR_SAMPLE_STRIDE",
    "SectionInfo",
    "Segment",
    "SegmentHeader",
    "SparseDelta",
    "ZSTD_PLANE_PARAMS",
    "apply_delta",
    "apply_delta_digests",
    "apply_delta_into",
    "compose_deltas",
    "decode_delta",
    "decode_full",
    "decode_full_into",
    "encode_delta",
    "encode_full",
    "peek_header",
]
