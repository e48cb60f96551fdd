"""Torch glue: validating state dicts, their layout, chunking, and raw bit views.

This is the only module (with publish/pull, which call it) that knows about torch. The codec
sees 1-D unsigned-integer numpy views of a tensor's bits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch
import xxhash

from deltastore.codec import _kernels
from deltastore.errors import InvalidStateDictError, LayoutMismatchError
from deltastore.manifest import DTYPE_WIDTHS, GroupMember, chunk_count

#: A chunk of about this size is the unit of change detection, encoding, threading and
#: partial reads: big enough that per-chunk overhead vanishes, small enough that a few chunks
#: in flight per thread keep memory bounded.
CHUNK_TARGET_BYTES = 16 * 1024 * 1024
#: The tensor-parallel degree to align chunk edges for when a publisher asks for it
#: (``Publisher(slice_align=SLICE_ALIGN)``): degrees 1, 2, 4 and 8 (rank r of N holds rows
#: [r·S//N, (r+1)·S//N), SPEC §8) then read only their own rows, since a chunk is the unit a
#: partial pull reads. Not the default: it multiplies the chunks of mid-sized tensors (a 531 MB
#: model: 171 → 1,301), and per-chunk costs with them (docs/scale.md §5).
SLICE_ALIGN = 8
#: Aligned chunks are never cut smaller than this: below it, per-chunk costs (a manifest entry
#: and digest, a segment header, a task) outweigh the bytes saved, and tiny tensors stay one
#: chunk. 32 KiB still aligns a 384-wide bf16 matrix (a 1/8 slice of 48 rows is 36 KiB).
SLICE_CHUNK_MIN_BYTES = 32 * 1024
#: Where the slice edges cannot be chunk edges (rows with no fitting divisor, e.g. a 30522-row
#: vocabulary), chunks of 1/SLICE_EDGE_PARTS of a slice bound what a rank reads beyond its
#: rows to two such chunks, 2/16 of its share.
SLICE_EDGE_PARTS = 16
#: An aligned chunk is taken only if it is at least 1/ALIGN_MAX_SHRINK of the unaligned
#: choice: a slice whose rows have no divisor near the target (a prime) would otherwise be cut
#: into thousands of tiny chunks.
ALIGN_MAX_SHRINK = 4

_UINT_BY_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling stored in manifests)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` for the dtypes deltastore stores (``DTYPE_WIDTHS``);
    raises InvalidStateDictError for any other name (never an attribute lookup on torch)."""
    dt = getattr(torch, name, None) if name in DTYPE_WIDTHS else None
    if not isinstance(dt, torch.dtype):
        raise InvalidStateDictError(f"unknown dtype {name!r} (this torch {torch.__version__} lacks it, or deltastore does not store it)")
    return dt


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout: what must not change between an anchor and its deltas."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_rows: int
    #: a group row's tensors (design 007), in storage order; empty for a tensor.
    members: tuple[GroupMember, ...] = ()

    @property
    def width(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def n_chunks(self) -> int:
        return chunk_count(self.shape, self.chunk_rows)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_WIDTHS[self.dtype]

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of chunk ``index`` in the flattened tensor."""
        if not self.shape:
            return (0, 1)
        r0 = index * self.chunk_rows
        r1 = min(r0 + self.chunk_rows, self.shape[0])
        return (r0 * self.row_elems, r1 * self.row_elems)

    def chunk_bytes(self, index: int) -> int:
        """Bytes of chunk ``index``."""
        a, b = self.chunk_span(index)
        return (b - a) * self.width

    def uint_dtype(self) -> np.dtype:
        return np.dtype(_UINT_BY_WIDTH[self.width])


def chunk_rows_for(row_bytes: int, rows: int, bounds: Sequence[int], chunk_bytes: int) -> int:
    """Rows per chunk of a tensor of ``rows`` rows of ``row_bytes`` whose chunk edges must fall
    on ``bounds``: the largest divisor of every boundary that keeps a chunk within about
    ``chunk_bytes`` (at least one row, at most ``rows``). With no bounds, just the size target.
    Sharded layouts pass their piece boundaries (SPEC §2: no chunk crosses a piece); the
    unsharded writer passes the 1/SLICE_ALIGN row boundaries (:func:`slice_chunk_rows`)."""
    target = max(1, chunk_bytes // max(1, row_bytes))
    target = max(1, min(target, rows)) if rows else 1
    if not bounds:
        return target
    g = 0
    for b in bounds:
        g = math.gcd(g, b)
    best = 1
    d = 1
    while d * d <= g:
        if g % d == 0:
            for c in (d, g // d):
                if c <= target and c > best:
                    best = c
        d += 1
    return best


def slice_chunk_rows(row_bytes: int, rows: int, chunk_bytes: int = CHUNK_TARGET_BYTES, align: int = SLICE_ALIGN) -> int:
    """The unsharded writer's ``chunk_rows`` (SPEC §2) with ``slice_align=align``: at most
    ``chunk_bytes`` per chunk, with chunk edges on the row boundaries of the tensor-parallel
    degrees that divide ``align`` (e.g. 1, 2, 4 and 8 for 8) when the rows allow it with chunks of at least
    :data:`SLICE_CHUNK_MIN_BYTES`; else chunks of 1/:data:`SLICE_EDGE_PARTS` of a slice (so a
    rank reads at most two edge chunks beyond its rows), never below that floor; tensors too
    small for either stay one chunk, and no chunk exceeds the size target."""
    target = chunk_rows_for(row_bytes, rows, (), chunk_bytes)
    if rows < align or target * row_bytes <= SLICE_CHUNK_MIN_BYTES:
        return target
    floor_rows = -(-SLICE_CHUNK_MIN_BYTES // max(1, row_bytes))
    share = rows // align
    unaligned = min(target, max(floor_rows, -(-share // SLICE_EDGE_PARTS)))
    bounds = [k * rows // align for k in range(1, SLICE_ALIGN)]
    aligned = chunk_rows_for(row_bytes, rows, bounds, chunk_bytes)
    if aligned * row_bytes >= SLICE_CHUNK_MIN_BYTES and aligned * ALIGN_MAX_SHRINK >= unaligned:
        return aligned
    return unaligned


def spec_for(name: str, t: torch.Tensor, chunk_target_bytes: int = CHUNK_TARGET_BYTES,
             slice_align: int | None = None) -> TensorSpec:
    """The layout deltastore uses for tensor ``t``: chunk rows sized to about
    ``chunk_target_bytes``, or with ``slice_align`` by :func:`slice_chunk_rows` (edges on the
    1/slice_align row slices where they fit)."""
    shape = tuple(t.shape)
    row_bytes = (math.prod(shape[1:]) if shape else 1) * t.element_size()
    if not shape:
        rows = 1
    elif slice_align is None or slice_align <= 1:
        rows = chunk_rows_for(row_bytes, shape[0], (), chunk_target_bytes)
    else:
        rows = slice_chunk_rows(row_bytes, shape[0], chunk_target_bytes, slice_align)
    return TensorSpec(name, dtype_name(t.dtype), shape, rows)


def validate_state_dict(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Check that ``state`` can be published; return it as a plain dict of CPU-able tensors.

    Raises:
        InvalidStateDictError: a value is not a dense, contiguous tensor of a supported dtype,
            or a key is not a non-empty string.
    """
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise InvalidStateDictError(f"expected a state dict (mapping of name → tensor) or nn.Module, got {type(state).__name__}")
    if not state:
        raise InvalidStateDictError("the state dict is empty: nothing to publish")
    out: dict[str, torch.Tensor] = {}
    # The dtype checks run once per dtype: a model of 20,000 small tensors has a handful.
    dtypes_ok: set[torch.dtype] = set()
    for name, t in state.items():
        if not isinstance(name, str) or not name:
            raise InvalidStateDictError(f"state dict key {name!r} is not a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise InvalidStateDictError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise InvalidStateDictError(f"tensor {name!r} is {t.layout}; convert it with .to_dense() before publishing")
        if t.dtype in dtypes_ok:
            pass
        elif t.is_quantized or t.is_complex() and t.element_size() not in _UINT_BY_WIDTH:
            raise InvalidStateDictError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        elif t.element_size() not in _UINT_BY_WIDTH:
            raise InvalidStateDictError(f"tensor {name!r} has dtype {t.dtype} of {t.element_size()} bytes; deltastore stores 1-, 2-, 4- and 8-byte elements")
        elif dtype_name(t.dtype) not in DTYPE_WIDTHS:  # readers refuse any other dtype name
            raise InvalidStateDictError(f"tensor {name!r} has dtype {t.dtype}, which deltastore does not store")
        else:
            dtypes_ok.add(t.dtype)
        if not t.is_contiguous():
            raise InvalidStateDictError(f"tensor {name!r} is not contiguous; pass .contiguous() (deltastore never copies silently)")
        if t.is_meta:  # not t.device.type: a device object per tensor costs ~1.5 µs
            raise InvalidStateDictError(f"tensor {name!r} is on the meta device and has no data")
        out[name] = t
    return out


def check_layout(specs: Mapping[str, TensorSpec], state: Mapping[str, torch.Tensor], *, against: str) -> None:
    """Raise LayoutMismatchError naming the first tensor whose name, dtype or shape differ.

    ``specs`` may hold group rows (design 007): their members are what ``state`` must hold."""
    # One pass, no per-tensor objects that outlive their line: at 20,000 group members a list
    # of expected (name, dtype, shape) triples cost more in collector passes than the checks.
    # Names are unique across rows and members (the layout check), so "every expected name is
    # in ``state`` and the counts are equal" means the name sets are equal.
    names_of: dict[torch.dtype, str] = {}  # dtype_name once per dtype, not per tensor
    count = 0
    for s in specs.values():
        for e in s.members or (s,):
            t = state.get(e.name)
            if t is None:
                _mismatched_names(specs, state, against)
            dt = names_of.get(t.dtype)
            if dt is None:
                dt = names_of[t.dtype] = dtype_name(t.dtype)
            if dt != e.dtype or t.shape != e.shape:
                if _names(specs) != state.keys():  # a missing or extra name is reported first
                    _mismatched_names(specs, state, against)
                raise LayoutMismatchError(
                    f"tensor {e.name!r} is {dt}{list(t.shape)} but {against} has {e.dtype}{list(e.shape)}"
                )
        count += len(s.members) or 1
    if count != len(state):
        _mismatched_names(specs, state, against)


def _names(specs: Mapping[str, TensorSpec]) -> set[str]:
    return {e.name for s in specs.values() for e in (s.members or (s,))}


def _mismatched_names(specs: Mapping[str, TensorSpec], state: Mapping[str, torch.Tensor], against: str) -> NoReturn:
    """LayoutMismatchError naming the first tensor missing from ``state`` (else the first extra)."""
    names = _names(specs)
    missing = sorted(names - set(state))
    extra = sorted(set(state) - names)
    if missing:
        raise LayoutMismatchError(f"tensor {missing[0]!r} of {against} is missing ({len(missing)} missing in all)")
    raise LayoutMismatchError(f"tensor {extra[0]!r} is not in {against} ({len(extra)} new in all)")


def bits(t: torch.Tensor) -> np.ndarray:
    """A 1-D unsigned-integer numpy view of a contiguous CPU tensor's bits (no copy)."""
    flat = t.detach().reshape(-1)
    return flat.view(_TORCH_INT_BY_WIDTH[t.element_size()]).numpy().view(_UINT_BY_WIDTH[t.element_size()])


def state_digest(raw: np.ndarray) -> str:
    """XXH3-128 hex of an array's raw bytes (SPEC §2, state digests)."""
    buf = memoryview(np.ascontiguousarray(raw)).cast("B")
    if _kernels.xxh3_128_hex is not None:  # same digest, without holding the GIL
        return _kernels.xxh3_128_hex(buf)
    return xxhash.xxh3_128_hexdigest(buf)


def from_bits(raw: np.ndarray, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec``'s dtype and shape over the bits in ``raw`` (takes ownership)."""
    signed = torch.from_numpy(raw.view(np.dtype(_UINT_BY_WIDTH[spec.width]).str.replace("u", "i")))
    return signed.view(torch_dtype(spec.dtype)).reshape(spec.shape)


def member_specs(specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The tensors as users see them (design 007 D4): every group row replaced by its members
    (in the group's place); ``specs`` itself when it has no groups."""
    if not any(s.members for s in specs.values()):
        return dict(specs)
    out: dict[str, TensorSpec] = {}
    for name, s in specs.items():
        if not s.members:
            out[name] = s
            continue
        for m in s.members:
            out[m.name] = TensorSpec(m.name, m.dtype, m.shape, max(1, m.shape[0]) if m.shape else 1)
    return out
