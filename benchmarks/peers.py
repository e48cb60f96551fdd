"""The formats deltastore is measured against, each written from its published description.

Every format is a ``Format`` with two operations:

``encode(prev, new) -> bytes``
    Everything a worker holding ``prev`` must download to reach ``new``.
``decode_apply(target, blob) -> target``
    Bring ``target`` (a copy of ``prev``) to ``new`` in place and return it; dense formats
    decode the whole snapshot and copy it in, as a worker loading into live parameters would.

State dicts map names to bf16 tensors. Formats are independent of the workload and of each
other; ``FORMATS`` lists them in table order. ``entropy_bytes`` is the order-0 reference.

Peers (see docs/benchmarks.md for sources):

``full``            safetensors of the whole bf16 state dict.
``full+zstd``       the same, zstd level 3.
``trl-sparse``      TRL delta-weight-sync (huggingface/trl PR #5417): one safetensors file with
                    ``{name}.indices`` (int32 flat) and ``{name}.values`` (bf16) per changed
                    tensor, uncompressed.
``pulse``           PULSE (arXiv 2602.03839): COO int32 flat indices + new values per tensor,
                    concatenated, zstd level 3.
``grail-v2``        grail's shipped sparse codec (one-covenant/grail ``sparse_codec`` v2):
                    as ``pulse`` but indices sorted and gap-coded (int32 diffs), zstd level 1.
``zipnn``           ZipNN dense snapshot (byte grouping + Huffman/zstd) of the new weights.
``zipnn-delta``     ZipNN's delta mode: XOR of the new bytes with the previous, then ZipNN.
``deltastore``      ``deltastore.codec.encode_delta`` per tensor.
``deltastore-anchor`` ``deltastore.codec.encode_full`` per tensor (a dense snapshot).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from collections.abc import Callable

import numpy as np
import torch
import zstandard

logger = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]

# zstd level 3 is zstd's default and what PULSE and the full+zstd baseline use.
ZSTD_LEVEL = 3
# grail's sparse_codec pins level 1 ("best speed/ratio tradeoff from benchmarks").
GRAIL_ZSTD_LEVEL = 1
# The harness compares formats single-threaded; see benchmarks/run.py.
ZIPNN_THREADS = 1
_LEN = struct.Struct("<I")


def u16(t: torch.Tensor) -> np.ndarray:
    """Flat uint16 bit view of a bf16 tensor (no copy when already contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _flat_i16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).reshape(-1)


def _pack(header: object, payload: list[bytes]) -> bytes:
    """``u32 header length | JSON header | payload...``: the framing the sparse peers share."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(h)), h, *payload])


def _unpack(blob: bytes) -> tuple[object, memoryview]:
    (n,) = _LEN.unpack_from(blob, 0)
    mv = memoryview(blob)
    return json.loads(bytes(mv[4:4 + n])), mv[4 + n:]


def changed_positions(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions where the bf16 bit patterns differ (bitwise, so NaN-safe)."""
    return torch.nonzero(_flat_i16(prev) != _flat_i16(new)).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Format:
    """One wire format: a name, an encoder and an applier."""

    name: str
    encode: Callable[[StateDict, StateDict], bytes]
    decode_apply: Callable[[StateDict, bytes], StateDict]
    kind: str  # "delta" (needs prev) or "dense" (a whole snapshot)
    note: str = ""


# --- full snapshots -------------------------------------------------------------------------

def _full_encode(prev: StateDict, new: StateDict) -> bytes:
    from safetensors.torch import save

    return save(new)


def _full_apply(target: StateDict, blob: bytes) -> StateDict:
    from safetensors.torch import load

    for k, v in load(blob).items():
        target[k].copy_(v)
    return target


def _full_zstd_encode(prev: StateDict, new: StateDict) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_full_encode(prev, new))


def _full_zstd_apply(target: StateDict, blob: bytes) -> StateDict:
    return _full_apply(target, zstandard.ZstdDecompressor().decompress(blob))


# --- TRL delta-weight-sync ------------------------------------------------------------------

def _trl_encode(prev: StateDict, new: StateDict) -> bytes:
    from safetensors.torch import save

    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        idx = changed_positions(prev[name], t)
        if idx.numel():
            out[f"{name}.indices"] = idx.to(torch.int32)
            out[f"{name}.values"] = t.reshape(-1)[idx]
    return save(out)


def _trl_apply(target: StateDict, blob: bytes) -> StateDict:
    from safetensors.torch import load

    d = load(blob)
    for key, idx in d.items():
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            target[name].view(-1)[idx.long()] = d[f"{name}.values"]
    return target


# --- PULSE and grail ------------------------------------------------------------------------

def _coo_encode(prev: StateDict, new: StateDict, *, gaps: bool, level: int) -> bytes:
    header, payload = [], []
    for name, t in new.items():
        idx = changed_positions(prev[name], t)
        if not idx.numel():
            continue
        values = u16(t)[idx.numpy()]
        ind = idx.numpy().astype(np.int32)
        if gaps:  # nonzero() is already sorted; first entry is absolute, the rest are gaps
            ind = np.diff(ind, prepend=np.int32(0)).astype(np.int32)
        header.append([name, int(idx.numel())])
        payload += [ind.tobytes(), values.tobytes()]
    return zstandard.ZstdCompressor(level=level).compress(_pack(header, payload))


def _coo_apply(target: StateDict, blob: bytes, *, gaps: bool) -> StateDict:
    header, body = _unpack(zstandard.ZstdDecompressor().decompress(blob))
    off = 0
    for name, n in header:
        ind = np.frombuffer(body, dtype=np.int32, count=n, offset=off)
        off += 4 * n
        vals = np.frombuffer(body, dtype=np.uint16, count=n, offset=off)
        off += 2 * n
        pos = np.cumsum(ind, dtype=np.int64) if gaps else ind.astype(np.int64)
        u16(target[name])[pos] = vals  # target tensors are contiguous: this writes through
    return target


# --- ZipNN ----------------------------------------------------------------------------------

def _concat_bytes(sd: StateDict) -> bytes:
    return np.concatenate([u16(t) for t in sd.values()]).tobytes()


def _scatter_bytes(target: StateDict, raw: bytes) -> StateDict:
    flat = np.frombuffer(raw, dtype=np.uint16)
    off = 0
    for t in target.values():
        n = t.numel()
        u16(t)[:] = flat[off:off + n]
        off += n
    return target


def _zipnn(delta: bool):
    import zipnn

    # bfloat16 byte grouping is ZipNN's headline mode for bf16 checkpoints.
    # One thread, like every other format in the harness (ZipNN defaults to all cores).
    kw = {"delta_compressed_type": "byte"} if delta else {}
    return zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=ZIPNN_THREADS,
                       **kw)


def _zipnn_encode(prev: StateDict, new: StateDict) -> bytes:
    return bytes(_zipnn(False).compress(_concat_bytes(new)))


def _zipnn_apply(target: StateDict, blob: bytes) -> StateDict:
    return _scatter_bytes(target, bytes(_zipnn(False).decompress(blob)))


def _zipnn_delta_encode(prev: StateDict, new: StateDict) -> bytes:
    return bytes(_zipnn(True).compress(_concat_bytes(new), delta_second_data=_concat_bytes(prev)))


def _zipnn_delta_apply(target: StateDict, blob: bytes) -> StateDict:
    raw = _zipnn(True).decompress(blob, delta_second_data=_concat_bytes(target))
    return _scatter_bytes(target, bytes(raw))


# --- deltastore -----------------------------------------------------------------------------

def _codec():
    """``deltastore.codec`` if it exposes the API the benchmark needs, else None."""
    try:
        from deltastore import codec
    except ImportError:
        return None
    names = ("encode_delta", "apply_delta", "encode_full", "decode_full")
    return codec if all(hasattr(codec, n) for n in names) else None


def _ds_encode(prev: StateDict, new: StateDict) -> bytes:
    codec = _codec()
    header, payload = [], []
    for name, t in new.items():
        seg = codec.encode_delta(u16(prev[name]), u16(t))
        if seg is not None:
            header.append([name, seg.codec, len(seg.data)])
            payload.append(seg.data)
    return _pack(header, payload)


def _ds_apply(target: StateDict, blob: bytes) -> StateDict:
    codec = _codec()
    header, body = _unpack(blob)
    off = 0
    for name, codec_name, n in header:
        codec.apply_delta(u16(target[name]), bytes(body[off:off + n]), codec=codec_name)
        off += n
    return target


def _ds_anchor_encode(prev: StateDict, new: StateDict) -> bytes:
    codec = _codec()
    header, payload = [], []
    for name, t in new.items():
        seg = codec.encode_full(u16(t), float_bits=True)  # bf16, as the publisher passes it
        header.append([name, seg.codec, len(seg.data)])
        payload.append(seg.data)
    return _pack(header, payload)


def _ds_anchor_apply(target: StateDict, blob: bytes) -> StateDict:
    codec = _codec()
    header, body = _unpack(blob)
    off = 0
    for name, codec_name, n in header:
        t = target[name]
        vals = codec.decode_full(bytes(body[off:off + n]), codec=codec_name,
                                 dtype=np.dtype(np.uint16), count=t.numel())
        u16(t)[:] = vals
        off += n
    return target


# --- registry -------------------------------------------------------------------------------

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("full", _full_encode, _full_apply, "dense", "safetensors.torch.save"),
        Format("full+zstd", _full_zstd_encode, _full_zstd_apply, "dense", "zstd level 3"),
        Format("trl-sparse", _trl_encode, _trl_apply, "delta", "int32 idx + bf16 values, raw"),
        Format("pulse", lambda p, n: _coo_encode(p, n, gaps=False, level=ZSTD_LEVEL),
               lambda t, b: _coo_apply(t, b, gaps=False), "delta", "COO int32 + values, zstd-3"),
        Format("grail-v2", lambda p, n: _coo_encode(p, n, gaps=True, level=GRAIL_ZSTD_LEVEL),
               lambda t, b: _coo_apply(t, b, gaps=True), "delta", "gap int32 + values, zstd-1"),
        Format("zipnn", _zipnn_encode, _zipnn_apply, "dense", "ZipNN bf16 byte mode"),
        Format("zipnn-delta", _zipnn_delta_encode, _zipnn_delta_apply, "delta",
               "ZipNN XOR-with-previous mode"),
        Format("deltastore", _ds_encode, _ds_apply, "delta", "codec.encode_delta per tensor"),
        Format("deltastore-anchor", _ds_anchor_encode, _ds_anchor_apply, "dense",
               "codec.encode_full per tensor"),
    )
}


def unavailable(name: str) -> str | None:
    """Why format ``name`` cannot run here, or None if it can."""
    if name.startswith("zipnn"):
        try:
            import zipnn  # noqa: F401
        except ImportError:
            return "zipnn not installed (pip install zipnn)"
    if name.startswith("deltastore") and _codec() is None:
        return "deltastore.codec lacks encode_delta/apply_delta/encode_full/decode_full"
    return None


# --- order-0 entropy reference --------------------------------------------------------------

def _binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def entropy_bits(prev: torch.Tensor, new: torch.Tensor) -> float:
    """Order-0 estimate for one tensor: n*H(p) for positions + count*H(XOR values).

    p is the tensor's changed fraction; the XOR values ``old ^ new`` of changed elements are
    taken as 16-bit symbols with their empirical distribution.
    """
    a, b = _flat_i16(prev), _flat_i16(new)
    n = a.numel()
    idx = torch.nonzero(a != b).reshape(-1)
    k = idx.numel()
    if k == 0:
        return 0.0
    xor = (a[idx] ^ b[idx]).numpy().view(np.uint16)
    counts = np.bincount(xor, minlength=1 << 16)
    q = counts[counts > 0] / k
    h_vals = float(-(q * np.log2(q)).sum())
    return n * _binary_entropy(k / n) + k * h_vals


def entropy_bytes(prev: StateDict, new: StateDict) -> float:
    """Order-0 entropy estimate of the whole step in bytes (sum over tensors)."""
    return sum(entropy_bits(prev[k], t) for k, t in new.items()) / 8
