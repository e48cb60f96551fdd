"""Incremental derivation of a serving stream's delta version (SPEC §15; design 012 D8).

A publisher serving ``fp8-block128`` or ``mxfp8`` beside its bfloat16 chain used to quantize
the whole state and then compare every quantized byte with the stream's reference, at every
version, although an RL step moves a few percent of the bfloat16 elements. The store's own delta
encoding already finds them: :func:`~deltastore.write.encode.encode_version` hands out each
changed chunk's change list (positions, old and new bits: :class:`~deltastore.write.encode.ChunkChange`).
From them, per tensor:

- **a quantized tensor** is requantized where it changed (deltastore/_native/requant.c): a block
  keeps its scale unless its largest ``|x|`` may have moved (a changed element above the block's
  maximum, or one whose old code was the block's top code, or a non-finite scale); such a
  *dirty* block is requantized whole. The stream keeps each block's maximum (bfloat16 bits) and
  scale to decide this. The chunk's delta, the reference's advance and the state digest come out
  of one walk over the chunk, exactly as the full path's (the tests compare the two byte for
  byte); its scale tensor is encoded only when a block turned dirty.
- **a tensor the format keeps** (bfloat16 in both) has, chunk for chunk, the store's delta: its
  segment and digest are reused, and the stream's reference is advanced at the changed elements.

Both need the native kernels, a bfloat16 tensor on the CPU in the store's state, the tensor
stored as itself (not in a group row or a column grid) in both layouts with the same chunks,
and the stream's reference at the version the store's delta starts from (the caller checks
that); everything else is derived in full, as before. Nothing here changes what is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np
import torch

from deltastore._util import kernels
from deltastore.codec.delta import DIGEST_IF_CHANGED, add_segment_from_planes, encode_delta_advance
from deltastore.codec.container import Segment
from deltastore.layout.tensors import TensorSpec, bits
from deltastore.serving.formats import ServingFormat, derive
from deltastore.serving.quantize import scale_shape
from deltastore.write.encode import ChunkChange, ChunkSource

logger = logging.getLogger(__name__)

#: False derives every version in full (benchmarks/serving.py times both ways in one run).
ENABLED = True

#: requant.c's format codes.
_FORMAT_CODE = {"fp8-block128": 0, "mxfp8": 1}


def _plain(spec: TensorSpec | None) -> bool:
    return spec is not None and not spec.members and not spec.chunk_cols


def _bf16_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


def _chunks(changes: list[ChunkChange]) -> list[tuple]:
    """A tensor's changed chunks in order, as ``requant_mark`` takes them."""
    return [(c.start, c.positions, c.old_values, c.new_values) for c in sorted(changes, key=lambda c: c.start)]


class Derived(NamedTuple):
    """A stream's derived state and how its delta is encoded (:meth:`Requantizer.derive`)."""

    #: the derived state (an incrementally requantized tensor is a stand-in there: the
    #: reference's tensor, for its shape and dtype; its scale is the new one)
    state: dict[str, torch.Tensor]
    #: the chunk sources for ``encode_version(sources=)``
    sources: dict[str, ChunkSource]
    #: the quantized tensors requantized incrementally (their stand-ins are not spares)
    incremental: set[str]
    #: the kept tensors whose chunks are the store's delta
    reused: set[str]


class Requantizer:
    """What one serving stream keeps to derive its next delta version incrementally: each
    quantized tensor's blocks' largest ``|x|`` and scales, of the version its reference holds.

    Args:
        fmt: the stream's format.
    """

    def __init__(self, fmt: ServingFormat):
        self.format = fmt
        self._blocks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name → (amax, scales)

    def clear(self) -> None:
        """Forget every block (the stream dropped its reference)."""
        self._blocks.clear()

    def derive(self, state: Mapping[str, torch.Tensor], *, pool: Executor | None,
               reuse: Mapping[str, torch.Tensor] | None, reference: Mapping[str, torch.Tensor] | None,
               specs: Mapping[str, TensorSpec] | None, store_specs: Mapping[str, TensorSpec] | None,
               changes: Mapping[str, list[ChunkChange]] | None, shared: set[str] | frozenset[str] = frozenset(),
               threads: int = 1) -> Derived:
        """The stream's state of ``state``, and the chunk sources of its delta.

        Args:
            state: the store's version's state.
            pool, reuse: as for :func:`~deltastore.serving.formats.derive`; ``threads``: the
                pool's size.
            reference, specs: the stream's reference and layout (None: the version has no base).
            store_specs, changes: the store's layout and the chunks its delta version changed
                (``encode_version(changes=)``), from the version ``reference`` holds; None:
                derive in full.
            shared: kept tensors whose reference is the store's own (already advanced by the
                store's delta: their chunks are reused as they are).
        """
        fmt = self.format
        suffix = fmt.scale_suffix
        ready = (ENABLED and changes is not None and reference is not None and specs is not None
                 and store_specs is not None and kernels.requant_mark is not None)
        quantized: list[str] = []
        kept: list[str] = []
        if ready:
            assert reference is not None and specs is not None and store_specs is not None and changes is not None
            for name, t in state.items():
                if name not in changes or not _bf16_cpu(t) or not _plain(specs.get(name)) or name not in reference:
                    continue
                listed = all(c.positions is not None for c in changes[name])
                if suffix is not None and fmt.selects(name, t.shape):
                    ref = reference[name]
                    if listed and name in self._blocks and ref.dtype == torch.float8_e4m3fn and ref.shape == t.shape:
                        quantized.append(name)
                elif ((listed or name in shared) and _plain(store_specs.get(name))
                      and specs[name].chunk_rows == store_specs[name].chunk_rows
                      and reference[name].dtype == torch.bfloat16 and reference[name].shape == t.shape):
                    kept.append(name)

        def mark(names: list[str]) -> list[tuple[torch.Tensor, ChunkSource, ChunkSource]]:
            assert reference is not None and changes is not None
            return [self._requantize(n, state[n], reference[n], changes[n]) for n in names]

        # one task per thread, tensors dealt largest first to the least loaded (a task per tensor
        # costs a thread hand-off each)
        parts: list[list[str]] = [[] for _ in range(max(1, threads if pool is not None else 1))]
        loads = [0] * len(parts)
        for name in sorted(quantized, key=lambda n: -state[n].numel()):
            k = loads.index(min(loads))
            parts[k].append(name)
            loads[k] += state[name].numel()
        done = (pool.map if pool is not None else map)(mark, [p for p in parts if p])
        marked = dict(zip([n for p in parts if p for n in p], [r for rs in done for r in rs]))
        given = {n: (reference[n], scale) for n, (scale, _, _) in marked.items()} if reference is not None else {}
        amax: dict[str, np.ndarray] = {}
        derived = derive(state, fmt, pool=pool, reuse=reuse, amax=amax, given=given)
        for name in list(self._blocks):
            if name not in marked:
                del self._blocks[name]
        if suffix is not None:
            for name, blocks in amax.items():
                self._blocks[name] = (blocks, derived[name + suffix].numpy().reshape(-1).copy())
        sources: dict[str, ChunkSource] = {n: src for n, (_, src, _) in marked.items()}
        for name, (_, _, scale_source) in marked.items():
            assert specs is not None and suffix is not None
            if _plain(specs.get(name + suffix)):  # unchanged unless a block turned dirty
                sources[name + suffix] = scale_source
        for name in kept:
            assert changes is not None
            sources[name] = _reuse_source(changes[name], advance=name not in shared)
        logger.debug("%s: %d tensors requantized incrementally, %d reuse the store's delta, %d derived in full",
                     fmt.name, len(marked), len(kept), len(amax))
        return Derived(derived, sources, set(marked), set(kept))

    def _requantize(self, name: str, t: torch.Tensor, ref: torch.Tensor,
                    changes: list[ChunkChange]) -> tuple[torch.Tensor, ChunkSource, ChunkSource]:
        """Mark tensor ``name``'s dirty blocks and requantize their scales: its new scale tensor,
        the source of its chunks and that of its scale tensor's."""
        code = _FORMAT_CODE[self.format.name]
        amax, old_scales = self._blocks[name]
        rows, cols = t.shape
        scales = old_scales.copy()
        dirty = np.empty(amax.size, dtype=np.uint8)
        src = bits(t)
        n_dirty, pos_b, oc_b, nc_b = kernels.requant_mark(code, src, rows, cols, _chunks(changes), scales, amax, dirty)
        pos = np.frombuffer(pos_b, dtype=np.int64)
        oc, nc = np.frombuffer(oc_b, dtype=np.uint8), np.frombuffer(nc_b, dtype=np.uint8)
        self._blocks[name] = (amax, scales)
        scale = torch.from_numpy(scales).view(scale_shape(self.format.name, t.shape))

        def source(index: int, start: int, stop: int, old: np.ndarray) -> tuple[Segment, str, None] | None:
            lo, hi = np.searchsorted(pos, (start, stop))
            k, syms, rest, max_rest, codes, esc, digest = kernels.requant_delta(
                code, src, rows, cols, start // cols, stop // cols, pos[lo:hi], oc[lo:hi], nc[lo:hi], dirty, scales,
                old, DIGEST_IF_CHANGED)
            if k == 0:
                return None
            return add_segment_from_planes(stop - start, 1, k, syms, rest, max_rest, codes, esc), digest, None

        scale_bits = bits(scale)

        def scale_source(index: int, start: int, stop: int, old: np.ndarray) -> tuple[Segment, str, None] | None:
            if not n_dirty:  # only a dirty block's scale can have changed
                return None
            seg, digest = encode_delta_advance(old, scale_bits[start:stop], always_digest=False)
            return None if seg is None or digest is None else (seg, digest, None)

        return scale, source, scale_source


def _reuse_source(changes: list[ChunkChange], *, advance: bool) -> ChunkSource:
    """The source of a tensor a stream keeps as the store stores it: the store's chunk deltas,
    and the stream's own reference advanced where they changed it (``advance``; not when the
    reference is the store's)."""
    by_index = {c.index: c for c in changes}

    def source(index: int, start: int, stop: int, old: np.ndarray) -> tuple[Segment, str, str] | None:
        c = by_index.get(index)
        if c is None:
            return None
        if (c.start, c.stop) != (start, stop):  # not reached: the layouts' chunks were compared
            raise ValueError(f"chunk {index} spans [{start}, {stop}) in the stream, [{c.start}, {c.stop}) in the store")
        if advance:
            kernels.scatter_changes(old, old.itemsize, c.positions, c.new_values)
        return c.delta, c.digest, c.delta_sha256

    return source


__all__ = ["Derived", "Requantizer"]
