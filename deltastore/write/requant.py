"""Incremental derivation of a serving stream's delta version (SPEC §15; design 012 D8).

A publisher serving ``fp8-block128`` or ``mxfp8`` beside its bfloat16 chain used to quantize
the whole state and then compare every quantized byte with the stream's reference, at every
version, although an RL step moves a few percent of the bfloat16 elements. The store's own delta
encoding already finds them: :func:`~deltastore.write.encode.encode_version` lists each changed
chunk's changed elements (positions, old and new bits). From them, per tensor:

- **a quantized tensor** is requantized where it changed (deltastore/_native/requant.c): a block
  keeps its scale unless its largest ``|x|`` may have moved (a changed element above the block's
  maximum, or one whose old code was the block's top code, or a non-finite scale); such a
  *dirty* block is requantized whole. The stream keeps each block's maximum (bfloat16 bits) and
  scale to decide this. The changes are classified on the store's encode threads, chunk by
  chunk, right after the scan that listed them (:meth:`Requantizer.prepare` gives the
  ``encode_version(sinks=)``), so the lists are neither kept nor read back from memory. The
  chunk's delta, the reference's advance and the state digest come out of one walk over the
  chunk, exactly as the full path's (the tests compare the two byte for byte); its scale tensor
  is encoded only when a block turned dirty.

  A chunk that holds whole blocks (every ``mxfp8`` chunk; an ``fp8-block128`` chunk of whole
  128-row block rows, or the tensor's only chunk), chunked alike in the stream and the store,
  is done in one step on the store's encode thread that listed its changes
  (``requant_chunk``): classified, its dirty blocks rescaled, walked, hashed and its segment
  entropy coded there, while the chunk is in cache, on the threads the store's scan keeps
  busy. Its blocks are its own, so no other chunk waits for it. Other chunks take two steps:
  classified there, then rescaled and walked in :meth:`Requantizer.derive`, once every chunk
  of the tensor has been classified (a dirty block may span two chunks).
- **a tensor the format keeps** (bfloat16 in both) has, chunk for chunk, the store's delta
  (``encode_version(changes=)``): its segment and digest are reused, and the stream's reference
  is advanced at the changed elements.

Both need the native kernels, a bfloat16 tensor on the CPU in the store's state, the tensor
stored as itself (not in a group row or a column grid) in both layouts with the same chunks,
and the stream's reference at the version the store's delta starts from (the caller checks
that); everything else is derived in full, as before. Nothing here changes what is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from deltastore._util import kernels
from deltastore.codec.delta import DIGEST_IF_CHANGED, RawPlanes, add_segment_from_planes, add_segments_from_planes
from deltastore.codec.container import Segment
from deltastore.format.keys import sha256_hex
from deltastore.layout.tensors import TensorSpec, bits
from deltastore.serving.formats import ServingFormat, derive
from deltastore.serving.quantize import scale_shape
from deltastore.write.encode import AnchorChunk, ChangeSink, ChunkChange, ChunkSource

logger = logging.getLogger(__name__)

#: False derives every version in full (benchmarks/serving.py times both ways in one run).
ENABLED = True

#: False takes two steps for every chunk (benchmarks time the one-step path against it).
ONE_STEP = True

#: Elements :func:`_encode_chunks` encodes on the calling thread rather than on the pool (the
#: scale tensors of a version done in one step: a few thousand elements).
INLINE_WORK = 1 << 16

#: requant.c's format codes.
_FORMAT_CODE = {"fp8-block128": 0, "mxfp8": 1}


def _plain(spec: TensorSpec | None) -> bool:
    return spec is not None and not spec.members and not spec.chunk_cols


def _chunked_alike(spec: TensorSpec | None, store_spec: TensorSpec | None) -> bool:
    """A tensor stored as itself in the stream's layout and in the store's, of one shape and
    chunked alike: its chunk ``i`` spans the same elements in both (the store's segments of it
    are the stream's)."""
    return (_plain(spec) and _plain(store_spec) and spec.chunk_rows == store_spec.chunk_rows  # type: ignore[union-attr]
            and tuple(spec.shape) == tuple(store_spec.shape))  # type: ignore[union-attr]


def takes_store_chunks(t: torch.Tensor, spec: TensorSpec | None, store_spec: TensorSpec | None) -> bool:
    """A tensor ``t`` the stream keeps as it is whose reference can be the store's own once
    committed: bfloat16 on the CPU, stored as itself in both layouts and chunked alike, so that
    the store's deltas carry its chunks (:meth:`Requantizer.derive` reuses them; the native
    kernels list the store's changes). Otherwise the stream's next delta diffs it against a
    reference of its own."""
    return ENABLED and kernels.NATIVE and _bf16_cpu(t) and _chunked_alike(spec, store_spec)


def _kept_reference(ref: torch.Tensor | None, t: torch.Tensor) -> bool:
    """The stream's reference of a kept tensor ``t`` is one it can advance with the store's
    changes: bfloat16, of ``t``'s shape."""
    return ref is not None and ref.dtype == torch.bfloat16 and ref.shape == t.shape


def _bf16_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


#: A chunk encoded here: its delta segment, state digest and the segment's SHA-256.
_Coded = tuple[Segment, str, str]


class _Marks:
    """A quantized tensor's changes classified in the version being encoded
    (``requant_classify``): the blocks found dirty, and each changed chunk's changed codes; or,
    done in one step (``requant_chunk``), each changed chunk's segment, digest and SHA-256
    (None: no code changed) and the tensor's new scales."""

    def __init__(self, blocks: int, scales: np.ndarray | None = None):
        self.dirty = np.zeros(blocks, dtype=np.uint8)
        self.chunks: dict[int, tuple[bytes, bytes, bytes]] = {}  # chunk index → positions, old, new codes
        #: one step: the new scales (a copy of the reference's, rescaled in place chunk by chunk)
        self.scales = scales
        self.coded: dict[int, _Coded | None] = {}  # one step: chunk index → its encoding
        self.n_dirty: dict[int, int] = {}  # one step: chunk index → its dirty blocks
        #: one step, a tensor of one chunk: its scale tensor's changed chunks, encoded with it
        #: (None: not encoded there)
        self.scale_coded: dict[int, _Coded] | None = None

    def covers(self, changes: list[ChunkChange]) -> bool:
        """Every chunk the store listed as changed was classified (or done in one step), and
        none else."""
        done = self.coded if self.scales is not None else self.chunks
        return len(done) == len(changes) and all(c.index in done for c in changes)


class _Sink:
    """The change sink of one quantized tensor: classifies each changed chunk into ``marks``
    against the blocks of the stream's reference (read only; the chunks of a tensor may be
    classified on several threads at once). A slotted object, not a closure: one object the
    cyclic collector tracks per tensor and version instead of a function and its cells."""

    __slots__ = ("code", "rows", "cols", "scales", "amax", "marks")

    def __init__(self, code: int, rows: int, cols: int, scales: np.ndarray, amax: np.ndarray, marks: _Marks):
        self.code, self.rows, self.cols, self.scales, self.amax, self.marks = code, rows, cols, scales, amax, marks

    def __call__(self, index: int, start: int, positions: object, old_values: object, new_values: object) -> None:
        marks = self.marks
        marks.chunks[index] = kernels.requant_classify(self.code, self.rows, self.cols, start, positions, old_values,
                                                       new_values, self.scales, self.amax, marks.dirty)


class _OneStep:
    """The change sink of one quantized tensor whose chunks hold whole blocks, chunked alike in
    the stream and the store: each changed chunk done in one step (``requant_chunk``) into
    ``marks``, the stream's reference of it (``ref``, codes) advanced in place. A tensor of one
    chunk has its scales final once that chunk is done: where a block turned dirty, its scale
    tensor's delta is encoded there too (``scale_ref``, ``scale_spec``: the stream's reference
    of it, advanced in place, and its layout; None: encoded in :meth:`Requantizer.derive`).
    Slotted, as :class:`_Sink`."""

    __slots__ = ("code", "rows", "cols", "src", "amax", "ref", "spec", "marks", "scale_ref", "scale_spec")

    def __init__(self, code: int, t: torch.Tensor, amax: np.ndarray, ref: np.ndarray, spec: TensorSpec,
                 marks: _Marks, scale_ref: np.ndarray | None = None, scale_spec: TensorSpec | None = None):
        self.code, self.rows, self.cols = code, int(t.shape[0]), int(t.shape[1])
        self.src, self.amax, self.ref, self.spec, self.marks = bits(t), amax, ref, spec, marks
        self.scale_ref, self.scale_spec = scale_ref, scale_spec
        if scale_ref is not None:
            marks.scale_coded = {}

    def __call__(self, index: int, start: int, positions: object, old_values: object, new_values: object) -> None:
        marks = self.marks
        stop = self.spec.chunk_span(index)[1]
        got = kernels.requant_chunk(self.code, self.rows, self.cols, start, positions, old_values, new_values,
                                    self.src, marks.scales, self.amax, marks.dirty, self.ref[start:stop],
                                    DIGEST_IF_CHANGED)
        n_dirty, n, syms, rest, max_rest, codes, esc, digest = got
        coded = None
        if n:
            seg = add_segment_from_planes(stop - start, 1, n, syms, rest, max_rest, codes, esc)
            coded = (seg, digest, sha256_hex(seg.data))
        marks.n_dirty[index] = n_dirty
        marks.coded[index] = coded
        if n_dirty and self.scale_ref is not None:
            marks.scale_coded = _encoded_scales(self.scale_ref, marks.scales, self.scale_spec)  # type: ignore[arg-type]


def _changed_chunks(spec: TensorSpec, width: int,
                    delta: Callable[[int, int], tuple]) -> list[tuple[int, RawPlanes, str]]:
    """The chunks of layout ``spec`` (elements of ``width`` bytes) whose delta changed elements:
    each one's index, raw planes and digest. ``delta(start, stop)``: the chunk's encode_add
    results (changes, five planes, digest), its reference advanced."""
    out = []
    for index in range(spec.n_chunks):
        start, stop = spec.chunk_span(index)
        n, syms, rest, max_rest, codes, esc, digest = delta(start, stop)
        if n:
            out.append((index, (stop - start, width, n, syms, rest, max_rest, codes, esc), digest))
    return out


def _scale_delta(ref: np.ndarray, new: np.ndarray) -> Callable[[int, int], tuple]:
    """A scale tensor's chunk delta for :func:`_changed_chunks`: ``new`` against ``ref`` (its
    bits, advanced in place)."""
    return lambda start, stop: kernels.encode_add(ref[start:stop], new[start:stop], new.itemsize, True,
                                                  DIGEST_IF_CHANGED)


def _encoded_scales(ref: np.ndarray, scales: np.ndarray, spec: TensorSpec) -> dict[int, _Coded]:
    """The changed chunks of a scale tensor of layout ``spec``: ``scales`` (new) against ``ref``
    (its bits, advanced in place), each chunk's segment, digest and the segment's SHA-256."""
    new = scales.view(ref.dtype)
    found = _changed_chunks(spec, new.itemsize, _scale_delta(ref, new))
    return {index: (seg, digest, sha256_hex(seg.data))
            for (index, _, digest), seg in zip(found, add_segments_from_planes([raw for _, raw, _ in found]))}


def _whole_blocks(fmt: ServingFormat, spec: TensorSpec | None, store_spec: TensorSpec | None) -> bool:
    """Each chunk of a tensor holds whole blocks of ``fmt`` and spans the same elements in the
    stream's layout (``spec``) and the store's: what the layouts need for its chunks to be done in
    one step (:func:`_one_step`: what the run needs)."""
    if not _chunked_alike(spec, store_spec):
        return False
    assert spec is not None
    return fmt.name == "mxfp8" or spec.n_chunks == 1 or spec.chunk_rows % 128 == 0


def _one_step() -> bool:
    """Chunks of whole blocks are done in one step: the kernel is there and the benchmarks did not
    switch it off (read at every version, not kept with a tensor's layout)."""
    return ONE_STEP and kernels.requant_chunk is not None


class _Prepared(NamedTuple):
    """What :meth:`Requantizer.prepare` decides of a tensor from the layouts alone."""

    #: the stream's spec of it, the store's, and the stream's of its scales: the objects it was
    #: decided for
    spec: TensorSpec | None
    store_spec: TensorSpec | None
    scale_spec: TensorSpec | None
    #: its shape; None: not requantized incrementally
    shape: tuple[int, ...] | None
    #: its chunks hold whole blocks, chunked alike in both layouts (:func:`_whole_blocks`)
    whole_blocks: bool
    #: done in one step, its scale tensor is encoded with it (a tensor of one chunk, its scales
    #: stored as themselves)
    with_scales: bool


def _view(views: dict[str, np.ndarray], name: str, t: torch.Tensor) -> np.ndarray:
    """The bit view of ``t`` (tensor ``name`` of a reference) in ``views``, made there if not yet."""
    v = views.get(name)
    if v is None:
        v = views[name] = bits(t)
    return v


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
    #: nothing derived: the reference was advanced in part (see :meth:`Requantizer.derive`)
    stale: bool = False


class Requantizer:
    """What one serving stream keeps to derive its next delta version incrementally: each
    quantized tensor's blocks' largest ``|x|`` and scales, of the version its reference holds.

    Args:
        fmt: the stream's format.
    """

    def __init__(self, fmt: ServingFormat):
        self.format = fmt
        self._blocks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name → (amax, scales)
        self._marks: dict[str, _Marks] = {}  # of the version being encoded (prepare)
        self._plans: dict[str, _Prepared] = {}  # name → what prepare decided of it (layouts alone)

    def clear(self) -> None:
        """Forget every block (the stream dropped its reference)."""
        self._blocks.clear()
        self._marks.clear()
        self._plans.clear()

    def prepare(self, state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                specs: Mapping[str, TensorSpec], store_specs: Mapping[str, TensorSpec] | None = None,
                reference_bits: dict[str, np.ndarray] | None = None) -> dict[str, ChangeSink]:
        """Before the store encodes its delta version of ``state`` (in layout ``store_specs``),
        when ``reference`` (of layout ``specs``) holds the stream's state of the version that
        delta starts from: a sink per quantized tensor that can be requantized incrementally, to
        classify its changes as the store's encoder lists them (``encode_version(sinks=)``), or
        to do its chunks in one step where they hold whole blocks (see the module docstring;
        such a sink advances the reference: should the version fail, the caller drops it). The
        next :meth:`derive` uses what they did. ``reference_bits``: the caller's cache of bit
        views of ``reference``'s tensors (as ``encode_version`` takes it), filled here.

        What it decides of a tensor from the layouts alone is kept while they are the same
        objects (a publisher's are, version after version)."""
        self._marks = {}
        suffix = self.format.scale_suffix
        if not ENABLED or kernels.requant_classify is None or suffix is None:
            return {}
        code = _FORMAT_CODE[self.format.name]
        views = reference_bits if reference_bits is not None else {}
        one_step = _one_step()
        sinks: dict[str, ChangeSink] = {}
        for name, blocks in self._blocks.items():
            t, ref = state.get(name), reference.get(name)
            if t is None or ref is None or not _bf16_cpu(t):
                continue
            spec = specs.get(name)
            store_spec = store_specs.get(name) if store_specs is not None else None
            scale_spec = specs.get(name + suffix)
            plan = self._plans.get(name)
            if (plan is None or plan.spec is not spec or plan.store_spec is not store_spec
                    or plan.scale_spec is not scale_spec):
                plan = self._plans[name] = self._plan(name, spec, store_spec, scale_spec)
            shape = plan.shape
            if shape is None or ref.dtype != torch.float8_e4m3fn or ref.shape != t.shape or t.shape != shape:
                continue
            if not (one_step and plan.whole_blocks):  # two steps
                marks = self._marks[name] = _Marks(blocks[0].size)
                sinks[name] = _Sink(code, shape[0], shape[1], blocks[1], blocks[0], marks)
                continue
            marks = self._marks[name] = _Marks(blocks[0].size, scales=blocks[1].copy())
            scale_ref = reference.get(name + suffix) if plan.with_scales else None
            if (scale_ref is not None and scale_ref.numel() == blocks[1].size
                    and scale_ref.element_size() == blocks[1].itemsize):
                sinks[name] = _OneStep(code, t, blocks[0], _view(views, name, ref), spec, marks,  # type: ignore[arg-type]
                                       _view(views, name + suffix, scale_ref), scale_spec)
            else:
                sinks[name] = _OneStep(code, t, blocks[0], _view(views, name, ref), spec, marks)  # type: ignore[arg-type]
        return sinks

    def _plan(self, name: str, spec: TensorSpec | None, store_spec: TensorSpec | None,
              scale_spec: TensorSpec | None) -> _Prepared:
        """What :meth:`prepare` decides of tensor ``name`` from the layouts alone."""
        shape = tuple(spec.shape) if spec is not None else ()
        if not _plain(spec) or len(shape) != 2 or not self.format.selects(name, shape):
            return _Prepared(spec, store_spec, scale_spec, None, False, False)
        assert spec is not None
        whole = store_spec is not None and _whole_blocks(self.format, spec, store_spec)
        return _Prepared(spec, store_spec, scale_spec, shape, whole, whole and spec.n_chunks == 1 and _plain(scale_spec))

    def derive(self, state: Mapping[str, torch.Tensor], *, pool: Executor | None,
               reuse: Mapping[str, torch.Tensor] | None = None, reference: Mapping[str, torch.Tensor] | None = None,
               specs: Mapping[str, TensorSpec] | None = None, store_specs: Mapping[str, TensorSpec] | None = None,
               changes: Mapping[str, list[ChunkChange]] | None = None,
               shared: set[str] | frozenset[str] = frozenset(), threads: int = 1) -> Derived:
        """The stream's state of ``state``, and the chunk sources of its delta.

        Args:
            state: the store's version's state.
            pool, reuse: as for :func:`~deltastore.serving.formats.derive`; ``threads``: the
                pool's size.
            reference, specs: the stream's reference and layout (None: the version has no base;
                with none of these arguments the version is derived in full).
                An incrementally requantized tensor's chunks of ``reference`` are advanced
                here (the sources hand out their deltas): after a failure the caller drops it.
            store_specs, changes: the store's layout and the chunks its delta version changed
                (``encode_version(changes=)``, with the sinks of :meth:`prepare`), from the
                version ``reference`` holds; None: derive in full.
            shared: kept tensors whose reference is the store's own (already advanced by the
                store's delta: their chunks are reused as they are).
        """
        fmt = self.format
        suffix = fmt.scale_suffix
        marks, self._marks = self._marks, {}
        ready = (ENABLED and changes is not None and reference is not None and specs is not None
                 and store_specs is not None)
        quantized: list[str] = []
        kept: list[str] = []
        stale = False  # a tensor done in one step in part only: its reference is of no version
        if ready:
            assert reference is not None and specs is not None and store_specs is not None and changes is not None
            for name, t in state.items():
                if name not in changes or not _bf16_cpu(t) or not _plain(specs.get(name)) or name not in reference:
                    continue
                if suffix is not None and fmt.selects(name, t.shape):
                    m = marks.get(name)
                    # every changed chunk classified (a chunk the store did not list is not)
                    if m is not None and m.covers(changes[name]):
                        quantized.append(name)
                    elif m is not None and m.scales is not None and m.coded:
                        stale = True  # not reached: the store lists every chunk its sinks saw
                elif ((name in shared or all(c.positions is not None for c in changes[name]))
                      and _chunked_alike(specs[name], store_specs.get(name)) and _kept_reference(reference[name], t)):
                    kept.append(name)
        if stale:
            # what the one-step sinks advanced is of no version: the caller drops the reference
            # and derives the version in full, without a base
            return Derived({}, {}, set(), set(), stale=True)
        plans = [self._requantize(n, state[n], changes[n], marks[n]) for n in quantized]  # type: ignore[index]
        assert not plans or (reference is not None and specs is not None)
        encoded = _encode_chunks(plans, reference, specs, suffix or "", pool, threads)  # type: ignore[arg-type]
        marked = {p.name: (p.scale, _EncodedSource(q), _EncodedSource(sc)) for p, (q, sc) in zip(plans, encoded)}
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
            if _plain(specs.get(name + suffix)):  # encoded with the tensor's (changed only if a block turned dirty)
                sources[name + suffix] = scale_source
        for name in kept:
            assert changes is not None
            sources[name] = _ReuseSource(changes[name], advance=name not in shared)
        logger.debug("%s: %d tensors requantized incrementally, %d reuse the store's delta, %d derived in full",
                     fmt.name, len(marked), len(kept), len(amax))
        return Derived(derived, sources, set(marked), set(kept))

    def _requantize(self, name: str, t: torch.Tensor, changes: list[ChunkChange], marks: _Marks) -> _Plan:
        """What tensor ``name``'s incremental requantization needs (its changes classified into
        ``marks``); its scales are a copy, which :func:`_encode_chunks` requantizes where a
        block turned dirty, and then the stream's."""
        code = _FORMAT_CODE[self.format.name]
        amax, old_scales = self._blocks[name]
        rows, cols = t.shape
        if marks.scales is not None:  # done in one step: its chunks are coded, its scales rescaled
            self._blocks[name] = (amax, marks.scales)
            scale = torch.from_numpy(marks.scales.reshape(scale_shape(self.format.name, t.shape)))
            return _Plan(name, code, None, rows, cols, None, None, None, marks.dirty, amax, marks.scales, scale,
                         coded={i: c for i, c in marks.coded.items() if c is not None},
                         n_dirty=sum(marks.n_dirty.values()), scale_coded=marks.scale_coded)
        scales = old_scales.copy()
        parts = [marks.chunks[c.index] for c in sorted(changes, key=lambda c: c.start)]
        pos = np.frombuffer(b"".join(p[0] for p in parts), dtype=np.int64)
        oc = np.frombuffer(b"".join(p[1] for p in parts), dtype=np.uint8)
        nc = np.frombuffer(b"".join(p[2] for p in parts), dtype=np.uint8)
        self._blocks[name] = (amax, scales)
        scale = torch.from_numpy(scales.reshape(scale_shape(self.format.name, t.shape)))
        return _Plan(name, code, bits(t), rows, cols, pos, oc, nc, marks.dirty, amax, scales, scale)


class _Plan(NamedTuple):
    """A quantized tensor requantized incrementally: its scales and what its chunks' deltas are
    encoded from (``requant_delta``), or its chunks already coded in one step."""

    name: str
    code: int
    src: np.ndarray | None  # the tensor's new bits (None: done in one step, not walked here)
    rows: int
    cols: int
    pos: np.ndarray | None
    oc: np.ndarray | None
    nc: np.ndarray | None
    dirty: np.ndarray
    amax: np.ndarray
    scales: np.ndarray
    scale: torch.Tensor
    #: done in one step (``requant_chunk``): its changed chunks' encodings, and its dirty blocks
    coded: dict[int, _Coded] | None = None
    n_dirty: int = 0
    #: done in one step with its scale tensor's changed chunks (a tensor of one chunk)
    scale_coded: dict[int, _Coded] | None = None

    def work(self, plain_scale: bool) -> int:
        """Elements :func:`_encode_chunks` walks for it: none when it was done in one step and
        its scales did not change, are encoded already, or are not stored as themselves."""
        if self.coded is None:
            assert self.src is not None
            return self.src.size
        return self.scales.size if self.n_dirty and plain_scale and self.scale_coded is None else 0


def _encode_chunks(plans: list[_Plan], reference: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec],
                   suffix: str, pool: Executor | None,
                   threads: int) -> list[tuple[dict[int, _Coded], dict[int, _Coded]]]:
    """Per plan: its dirty blocks' scales and maxima requantized (``requant_rescale``), then the
    delta segments, state digests and the segments' SHA-256 of its changed chunks of the
    stream's layout ``specs`` and of its scale tensor's (stored as itself; changed only where a
    block turned dirty), by chunk index, ``reference`` advanced. One task per thread, tensors
    dealt largest first to the least loaded, each task's segments entropy coded together
    (``add_segments_from_planes``): a task per chunk costs a thread hand-off each, and its
    planes' compressor calls each give up and retake the GIL, which the other thread holds."""
    parts: list[list[int]] = [[] for _ in range(max(1, threads if pool is not None else 1))]
    loads = [0] * len(parts)
    work = [p.work(_plain(specs.get(p.name + suffix))) for p in plans]
    for k in sorted((k for k in range(len(plans)) if work[k]), key=lambda k: -work[k]):
        i = loads.index(min(loads))
        parts[i].append(k)
        loads[i] += work[k]

    def task(part: list[int]) -> list[tuple[int, int, int, Segment, str, str]]:
        raw, keys = [], []
        for k in part:
            p = plans[k]
            one_step = p.coded is not None
            if not one_step:
                assert p.src is not None
            n_dirty = p.n_dirty if one_step else kernels.requant_rescale(p.code, p.src, p.rows, p.cols, p.scales,
                                                                         p.amax, p.dirty)
            for what, name in ((0, p.name), (1, p.name + suffix)):
                spec = specs.get(name)
                if what and (not n_dirty or not _plain(spec) or p.scale_coded is not None):
                    continue  # the scales changed only in a dirty block (or were encoded with it)
                if not what and one_step:  # coded on the store's encode threads
                    continue
                assert spec is not None
                ref = bits(reference[name])
                delta = _scale_delta(ref, p.scales.view(ref.dtype)) if what else _codes_delta(p, ref)
                for index, planes, digest in _changed_chunks(spec, ref.itemsize, delta):
                    raw.append(planes)
                    keys.append((k, what, index, digest))
        # each segment's SHA-256 too (hashlib gives up the GIL): the manifest names it
        return [(k, what, index, seg, digest, sha256_hex(seg.data))
                for (k, what, index, digest), seg in zip(keys, add_segments_from_planes(raw))]

    out: list[tuple[dict[int, _Coded], dict[int, _Coded]]] = [(p.coded or {}, dict(p.scale_coded or {}))
                                                                for p in plans]
    # little to do (the scales of tensors done in one step whose blocks turned dirty): on this
    # thread, in one task; a hand-off to the pool and back costs more than the work
    run = pool.map if pool is not None and sum(loads) > INLINE_WORK else map
    tasks = [p for p in parts if p] if run is not map else [[k for p in parts for k in p]]
    for done in run(task, [t for t in tasks if t]):
        for k, what, index, seg, digest, sha in done:
            out[k][what][index] = (seg, digest, sha)
    return out


def _codes_delta(p: _Plan, ref: np.ndarray) -> Callable[[int, int], tuple]:
    """A quantized tensor's chunk delta in two steps for :func:`_changed_chunks`
    (``requant_delta``: its classified changes in the chunk, its dirty blocks), ``ref`` (its
    codes) advanced in place."""
    assert p.src is not None and p.pos is not None and p.oc is not None and p.nc is not None

    def delta(start: int, stop: int) -> tuple:
        lo, hi = np.searchsorted(p.pos, (start, stop))
        return kernels.requant_delta(p.code, p.src, p.rows, p.cols, start // p.cols, stop // p.cols, p.pos[lo:hi],
                                     p.oc[lo:hi], p.nc[lo:hi], p.dirty, p.scales, ref[start:stop], DIGEST_IF_CHANGED)

    return delta


class _EncodedSource:
    """The source of a quantized tensor, or of its scale tensor, whose chunks
    :func:`_encode_chunks` encoded (and whose reference it advanced): each changed chunk's
    segment, digest and the segment's SHA-256 (slotted, as :class:`_Sink`)."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: dict[int, _Coded]):
        self.chunks = chunks

    def __call__(self, index: int, start: int, stop: int, old: np.ndarray | None) -> _Coded | None:
        return self.chunks.get(index)


class _ReuseSource:
    """The source of a tensor a stream keeps as the store stores it: the store's chunk deltas,
    and the stream's own reference advanced where they changed it (``advance``; not when the
    reference is the store's). Slotted, as :class:`_Sink`."""

    __slots__ = ("by_index", "advance")

    def __init__(self, changes: list[ChunkChange], *, advance: bool):
        self.by_index = {c.index: c for c in changes}
        self.advance = advance

    def __call__(self, index: int, start: int, stop: int, old: np.ndarray | None) -> tuple[Segment, str, str] | None:
        c = self.by_index.get(index)
        if c is None:
            return None
        _check_span(c, start, stop)
        if self.advance and old is not None:
            kernels.scatter_changes(old, old.itemsize, c.positions, c.new_values)
        return c.delta, c.digest, c.delta_sha256


def anchor_sources(state: Mapping[str, torch.Tensor], fmt: ServingFormat, specs: Mapping[str, TensorSpec],
                   store_specs: Mapping[str, TensorSpec], anchors: Mapping[str, list[AnchorChunk]], *,
                   reference: Mapping[str, torch.Tensor] | None,
                   shared: set[str] | frozenset[str]) -> dict[str, ChunkSource]:
    """The chunk sources of a stream's anchor for the bfloat16 tensors it keeps as the store
    stores them (stored as themselves in both layouts, ``specs`` and ``store_specs``, chunked
    alike): the store's :class:`~deltastore.write.encode.AnchorChunk` of the same version
    (``encode_version(anchors=)``), bit for bit what the stream would encode.

    Args:
        reference: the stream's reference, the state of the version before (its deltas are
            then the store's, taken against the same bits); None: the anchor has no base (the
            store's deltas are left out).
        shared: kept tensors whose reference is the store's own (the store's encode advanced
            it); the others' are advanced here.
    """
    out: dict[str, ChunkSource] = {}
    for name, chunks in anchors.items():
        t, spec, store_spec = state.get(name), specs.get(name), store_specs.get(name)
        if (t is None or not _bf16_cpu(t) or fmt.selects(name, t.shape) or not _chunked_alike(spec, store_spec)
                or len(chunks) != spec.n_chunks):  # type: ignore[union-attr]
            continue
        if reference is not None and not _kept_reference(reference.get(name), t):
            continue
        out[name] = _AnchorSource(chunks, new=bits(t) if reference is not None and name not in shared else None,
                                  with_delta=reference is not None)
    return out


class _AnchorSource:
    """The source of a kept tensor's chunks in a stream's anchor: the store's anchor chunks
    (without their deltas unless ``with_delta``), and the stream's reference advanced to
    ``new`` (the tensor's bits; None: nothing to advance). Slotted, as :class:`_Sink`."""

    __slots__ = ("by_index", "new", "with_delta")

    def __init__(self, chunks: list[AnchorChunk], *, new: np.ndarray | None, with_delta: bool):
        self.by_index = {c.index: c for c in chunks}
        self.new, self.with_delta = new, with_delta

    def __call__(self, index: int, start: int, stop: int, old: np.ndarray | None) -> AnchorChunk:
        c = self.by_index[index]
        _check_span(c, start, stop)
        if self.new is not None and old is not None:
            old[...] = self.new[start:stop]
        return c if self.with_delta or c.delta is None else replace(c, delta=None, delta_sha256=None)


def _check_span(c: ChunkChange | AnchorChunk, start: int, stop: int) -> None:
    """The store's chunk ``c`` spans the stream's ``[start, stop)`` (not reached when it does
    not: the callers compared the layouts' chunks)."""
    if (c.start, c.stop) != (start, stop):
        raise ValueError(f"chunk {c.index} spans [{start}, {stop}) in the stream, [{c.start}, {c.stop}) in the store")


__all__ = ["Derived", "Requantizer", "anchor_sources", "takes_store_chunks"]
