"""Column grids (design 011): the one place that knows both orders of a grid tensor.

A tensor with ``chunk_cols`` > 0 is cut into row blocks × column blocks (SPEC §2 *Pieces and
grid*). Its chunk spans (:meth:`TensorSpec.chunk_span`) are in its *unit order*: the chunks
back to back in index order, each in its own C order (011 D1). Users hold the tensor in its
natural order. This module converts between the two: pure numpy over 1-D unsigned views of a
tensor's bits (:func:`deltastore.layout.tensors.bits`), plus :class:`GridTarget` (the read engine's
target of a grid tensor, 011 D4) and :func:`patch_region` (where a staged patch lands).

A chunk of the natural tensor is a 2-D strided block: ``r1 − r0`` rows of ``e1 − e0``
contiguous elements (``e`` counts element columns: a column of dimension 1 times the trailing
elements). Gather and scatter are one numpy 2-D copy each, a C loop of row pieces, so they
have one answer and need no native kernel (011 D3). Without a grid every function here is
the identity on spans, so a caller may use it for any tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deltastore.layout.tensors import TensorSpec, bits

__all__ = ["GridTarget", "block_view", "gather", "patch_put", "patch_region", "patch_take", "scatter", "to_unit_order"]


def _as_2d(raw: Any, spec: TensorSpec) -> Any:
    """``raw`` (a natural-order flat array or tensor of ``spec.numel`` elements) as
    ``(shape[0], row_elems)``; a 0-d tensor as one row of one element."""
    rows = spec.shape[0] if spec.shape else 1
    return raw.reshape(rows, spec.row_elems)


def block_view(raw: np.ndarray, spec: TensorSpec, index: int) -> np.ndarray:
    """The 2-D strided view (no copy) of chunk ``index`` in ``raw``, the tensor's bits in
    natural order (1-D, ``spec.numel`` elements): rows ``[r0, r1)`` × element columns
    ``[e0, e1)``. Its C order is the chunk's order (the unit order's span of the chunk)."""
    r0, r1, e0, e1 = spec.chunk_block(index)
    return _as_2d(raw, spec)[r0:r1, e0:e1]


def gather(raw: np.ndarray, spec: TensorSpec, index: int, out: np.ndarray | None = None) -> np.ndarray:
    """Chunk ``index`` of the natural-order bits ``raw``, copied in its C order into ``out``
    (1-D, the chunk's elements, e.g. a slot ``unit[a:b]`` of a unit-order buffer) or into a new
    array. Returns the filled buffer."""
    view = block_view(raw, spec, index)
    if out is None:
        out = np.empty(view.size, dtype=raw.dtype)
    elif out.shape != (view.size,):
        raise ValueError(f"tensor {spec.name!r} chunk {index} has {view.size} elements; the buffer has {out.size}")
    np.copyto(out.reshape(view.shape), view)
    return out


def scatter(raw: np.ndarray, spec: TensorSpec, index: int, chunk: np.ndarray) -> None:
    """Write ``chunk`` (1-D, in the chunk's C order) into its block of the natural-order bits
    ``raw`` (the inverse of :func:`gather`)."""
    view = block_view(raw, spec, index)
    if chunk.shape != (view.size,):
        raise ValueError(f"tensor {spec.name!r} chunk {index} has {view.size} elements; the buffer has {chunk.size}")
    np.copyto(view, chunk.reshape(view.shape))


def to_unit_order(raw: np.ndarray, spec: TensorSpec, out: np.ndarray | None = None) -> np.ndarray:
    """The whole tensor ``raw`` (natural order) in unit order: every chunk gathered into its
    span ``[a, b)`` of ``out`` (or of a new array). Without a grid, a copy."""
    if out is None:
        out = np.empty(raw.size, dtype=raw.dtype)
    if not spec.chunk_cols:
        np.copyto(out, raw)
        return out
    for i in range(spec.n_chunks):
        a, b = spec.chunk_span(i)
        block = block_view(raw, spec, i)
        np.copyto(out[a:b].reshape(block.shape), block)
    return out


def _chunks_of(spec: TensorSpec, a: int, b: int) -> list[tuple[int, int, int]]:
    """The chunks that unit-order range ``[a, b)`` overlaps, as ``(index, lo, hi)`` with
    ``[lo, hi)`` the overlap (unit order). The first is found from ``a`` by arithmetic
    (:meth:`TensorSpec.chunk_containing`), the rest by stepping forward: no table of every chunk."""
    n = spec.n_chunks
    if not 0 <= a <= b <= spec.numel:
        raise ValueError(f"range [{a}, {b}) is outside tensor {spec.name!r} of {spec.numel} elements")
    i = spec.chunk_containing(a)
    out = []
    while i < n:
        lo, hi = spec.chunk_span(i)
        if lo >= b and out:
            break
        if hi > a or lo == a:
            out.append((i, max(lo, a), min(hi, b)))
        if hi >= b:
            break
        i += 1
    return out


class GridTarget:
    """A grid tensor of a pull target, seen in unit order (011 D4): ``read(a, b)`` gathers a
    copy of a unit-order range, ``write(a, b, raw)`` scatters one. Never a live view (``cpu``
    is False), so the read engine applies on the copy and writes back what it changed, as it
    does for a device tensor or a :class:`~deltastore.layout.groups.GroupTarget`. On a device, a chunk
    moves as one ``contiguous().cpu()`` of its block (read) or one ``copy_`` into it (write)."""

    cpu = False
    raw = None

    def __init__(self, spec: TensorSpec, tensor: torch.Tensor):
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name!r} is {list(tensor.shape)}, its layout {list(spec.shape)}")
        self.spec = spec
        self.tensor = tensor
        # a CPU tensor: its bits viewed once (natural order); a device tensor: its rows
        self._bits = bits(tensor) if tensor.device.type == "cpu" else None

    def _block(self, index: int) -> torch.Tensor:
        r0, r1, e0, e1 = self.spec.chunk_block(index)
        return _as_2d(self.tensor.detach(), self.spec)[r0:r1, e0:e1]

    def read(self, a: int, b: int) -> np.ndarray:
        """Elements ``[a, b)`` of the tensor in unit order (a new array)."""
        parts = _chunks_of(self.spec, a, b)
        if len(parts) == 1:
            i, lo, hi = parts[0]
            ca, cb = self.spec.chunk_span(i)
            if (lo, hi) == (ca, cb):
                return self._gather(i)
        out = np.empty(b - a, dtype=self.spec.uint_dtype())
        for i, lo, hi in parts:
            ca, _ = self.spec.chunk_span(i)
            out[lo - a:hi - a] = self._gather(i)[lo - ca:hi - ca]
        return out

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        """Write ``raw`` (unit order) at elements ``[a, b)``; a chunk only partly covered is
        read, patched and written whole."""
        if raw.shape != (b - a,):
            raise ValueError(f"tensor {self.spec.name!r}: {raw.size} elements for the range [{a}, {b})")
        for i, lo, hi in _chunks_of(self.spec, a, b):
            ca, cb = self.spec.chunk_span(i)
            if (lo, hi) == (ca, cb):
                self._scatter(i, raw[lo - a:hi - a])
            else:
                chunk = self._gather(i)
                chunk[lo - ca:hi - ca] = raw[lo - a:hi - a]
                self._scatter(i, chunk)

    def _gather(self, index: int) -> np.ndarray:
        if self._bits is not None:
            return gather(self._bits, self.spec, index)
        return bits(self._block(index).contiguous().cpu())  # a new CPU tensor: the view owns it

    def _scatter(self, index: int, chunk: np.ndarray) -> None:
        if self._bits is not None:
            scatter(self._bits, self.spec, index, chunk)
            return
        view = self._block(index)
        src = torch.from_numpy(_signed(np.ascontiguousarray(chunk))).view(view.dtype).reshape(view.shape)
        view.copy_(src)


def patch_region(t: torch.Tensor, span: tuple[int, int], block: tuple[int, int, int, int] | None = None) -> Any:
    """Where a staged patch of chunk ``span`` lands in tensor ``t`` (natural order, 011 D4):
    without ``block``, the 1-D range ``[a, b)`` of its flat bits; with ``block`` =
    ``(r0, r1, e0, e1)`` (a grid chunk, :meth:`TensorSpec.chunk_block`), the 2-D strided block
    ``r1 − r0`` × ``e1 − e0`` whose C order is the chunk's order. A CPU tensor gives a numpy view
    of its unsigned bits, any other a torch view of its signed bits (same width). Write and read
    it through :func:`patch_put` and :func:`patch_take`, with chunk-relative positions."""
    return _region(bits(t) if t.device.type == "cpu" else _torch_bits(t), t, span, block)


def _torch_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat torch view of ``t``'s bits as :data:`_SIGNED` integers (any device, no copy)."""
    return t.detach().reshape(-1).view(_SIGNED[t.element_size()])


def _region(flat: Any, t: torch.Tensor, span: tuple[int, int], block: tuple[int, int, int, int] | None) -> Any:
    """:func:`patch_region` over ``flat``, the flat bits of ``t`` (numpy or torch)."""
    if block is None:
        return flat[span[0]:span[1]]
    r0, r1, e0, e1 = block
    rows = t.shape[0] if t.dim() else 1
    region = flat.reshape(rows, flat.shape[0] // rows if rows else 0)[r0:r1, e0:e1]
    if region.shape[0] * region.shape[1] != span[1] - span[0]:
        raise ValueError(f"block {block} has {region.shape[0] * region.shape[1]} elements; the chunk {span[1] - span[0]}")
    return region


#: torch's dtype for raw bits of each width: signed (torch lacks most unsigned dtypes), but
#: uint8 for bytes, as stage.py's device writes use.
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(values: np.ndarray) -> np.ndarray:
    """Unsigned bits as the numpy dtype matching :data:`_SIGNED` (a view, no copy)."""
    return values.view(values.dtype.str.replace("u", "i")) if values.dtype.itemsize > 1 else values


def _index(region: Any, positions: np.ndarray) -> Any:
    """Chunk-relative C-order ``positions`` as an index into ``region`` (1-D or a 2-D block)."""
    if isinstance(region, torch.Tensor):
        pos = torch.from_numpy(positions.astype(np.int64)).to(region.device)
        return pos if region.dim() == 1 else (pos // region.shape[1], pos % region.shape[1])
    return positions if region.ndim == 1 else np.divmod(positions, region.shape[1])


def patch_take(region: Any, positions: np.ndarray | None) -> np.ndarray:
    """The bits of ``region`` (from :func:`patch_region`) at chunk-relative ``positions``, or
    the whole chunk in its C order (``positions`` None), as a numpy array of unsigned bits."""
    got = region if positions is None else region[_index(region, positions)]
    if isinstance(got, torch.Tensor):
        arr = got.reshape(-1).cpu().numpy()
        return arr.view(arr.dtype.str.replace("i", "u"))
    return got.reshape(-1) if positions is None else got


def patch_put(region: Any, positions: np.ndarray | None, values: np.ndarray) -> None:
    """Write ``values`` (unsigned bits) at chunk-relative ``positions`` of ``region``, or the
    whole chunk in its C order (``positions`` None)."""
    if isinstance(region, torch.Tensor):
        src = torch.from_numpy(_signed(np.ascontiguousarray(values)))
        src = src.to(region.device)
        if positions is None:
            region.copy_(src.reshape(region.shape))
        else:
            region[_index(region, positions)] = src
        return
    if positions is None:
        region[...] = values.reshape(region.shape)
    else:
        region[_index(region, positions)] = values
