"""A partial subscriber's reads (SPEC §8 "Partial pulls"): its selection against each layout,
and the bits of edge chunks outside its slices.

:mod:`deltastore.layout.select` says which chunks a selection overlaps and how a chunk lands
in the user's slices; this module keeps what a subscriber carries from one pull to the next:
the selection resolved once per layout, and ``spare``, the bits of the chunks read whole and
cut whose other part the user does not hold (a later delta applies to the whole chunk).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from deltastore.format.models import DTYPE_WIDTHS
from deltastore.layout.groups import carve
from deltastore.layout.select import Resolved, Selection, resolve
from deltastore.layout.tensors import TensorSpec
from deltastore.read.changes import merge_spans
from deltastore.read.plan import ChunkPlan
from deltastore.read.stage import ChunkPatch
from deltastore.read.targets import stored_dtype

#: Edge chunk ``(unit, index)`` → its bits (the subscriber's ``spare``).
Spare = dict[tuple[str, int], np.ndarray]

#: A partial subscriber reads adjacent segments as one GET but never the bytes between: they
#: are other ranks' segments, and what it reads is what its link carries.
PARTIAL_COALESCE_GAP_BYTES = 0


def selection_doc(select: Selection) -> dict[str, Any]:
    """``select`` as a JSON object (a worker cache records the selection it holds; two
    selections are the same when their objects are equal)."""
    return json.loads(json.dumps(dataclasses.asdict(select)))


def cached_spare(specs: dict[str, TensorSpec], res: Resolved, saved: dict[tuple[str, int], np.ndarray]) -> Spare | None:
    """A worker cache's bytes of edge chunks (:class:`deltastore.read.cache.CachedState`
    ``spare``) as the spare bits of ``res``: each chunk's bits in its unit's unsigned type.
    None when they are not exactly ``res``'s edge chunks, whole (another layout, or damage)."""
    if set(saved) != set(res.edges):
        return None
    out: Spare = {}
    for (unit, index), raw in saved.items():
        spec = specs[unit]
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != spec.chunk_bytes(index):
            return None
        out[(unit, index)] = raw.view(spec.uint_dtype()).copy()
    return out


class Partial:
    """One partial subscriber's selection and the spare bits of its edge chunks.

    Args:
        select: the selection (:class:`deltastore.layout.select.Selection`).
    """

    def __init__(self, select: Selection):
        self.select = select
        #: the bits of edge chunks outside the slices (deltastore.layout.select.SliceTarget)
        self.spare: Spare = {}
        self._resolved_for: tuple[dict[str, TensorSpec], Resolved] | None = None

    def resolved(self, specs: dict[str, TensorSpec]) -> Resolved:
        """The selection against layout ``specs`` (resolved once per layout)."""
        if self._resolved_for is None or self._resolved_for[0] != specs:
            self._resolved_for = (specs, resolve(self.select, specs))
        return self._resolved_for[1]

    @staticmethod
    def model_bytes(specs: dict[str, TensorSpec], res: Resolved) -> int:
        """What a partial subscriber holds: its selection, and its edge chunks whole."""
        total = sum(math.prod(shape) * DTYPE_WIDTHS[dt] for dt, shape in res.shapes.values())
        return total + sum(specs[u].chunk_bytes(i) for u, i in res.edges)

    @staticmethod
    def narrow(plans: list[ChunkPlan], res: Resolved) -> list[ChunkPlan]:
        """The plans of the chunks the selection reads."""
        return [p for p in plans if (p.name, p.index) in res.chunks]

    @staticmethod
    def narrow_digests(digests: dict[tuple[str, int], str], res: Resolved) -> dict[tuple[str, int], str]:
        """The chunk digests (``(unit, index)`` → hex) of the chunks the selection reads."""
        return {k: d for k, d in digests.items() if k in res.chunks}

    def kept_spare(self, res: Resolved, based: bool) -> Spare:
        """The spare bits an update of the held version starts from: those of ``res``'s edge
        chunks when the update is ``based`` on the held version, else none (a full load reads
        every chunk it needs whole)."""
        return {k: v for k, v in self.spare.items() if k in res.edges} if based else {}

    @staticmethod
    def user_patches(patches: Iterable[ChunkPatch], res: Resolved, spare: Spare) -> tuple[list[ChunkPatch], Spare]:
        """The patches of a partial target's tensors that together make ``patches`` (one per
        chunk of a unit, from :meth:`ReadEngine.stage <deltastore.read.engine.ReadEngine.stage>`
        with slice targets), and the spare bits after them.

        A chunk's positions (in its block's C order, :meth:`TensorSpec.chunk_block`) are kept
        where they fall in a window and carried to the user's tensor of that window as flat
        positions, relative to the span they cover there; the rest of an edge chunk's changes go
        to its spare bits, which a swap installs with the tensors' patches (``spare``, the bits
        before, is not modified)."""
        after = dict(spare)
        out: list[ChunkPatch] = []
        for p in patches:
            spec = res.specs[p.name]
            r0, r1, e0, e1 = spec.chunk_block(p.index)
            width = e1 - e0
            pos = p.positions if p.positions is not None else np.arange(p.span[1] - p.span[0], dtype=np.int64)
            rc: tuple[np.ndarray, np.ndarray] | None = None  # each position's row and column, when a window needs them
            for w in res.windows.get(p.name, ()):
                wr0, wr1, we0, we1 = w.rect(spec.row_elems)
                x0, x1 = max(r0, wr0), min(r1, wr1)
                if x0 >= x1 or max(e0, we0) >= min(e1, we1):
                    continue
                at: slice | np.ndarray
                if we0 <= e0 and e1 <= we1:  # the window spans the chunk's columns: its rows are one run
                    at = slice(*np.searchsorted(pos, ((x0 - r0) * width, (x1 - r0) * width)))
                else:
                    if rc is None:
                        rc = (r0 + pos // width, e0 + pos % width)
                    rr, cc = rc
                    at = np.flatnonzero((rr >= wr0) & (rr < wr1) & (cc >= we0) & (cc < we1))
                q = pos[at]
                if not q.size:
                    continue
                # row-major in the chunk and in the window alike: the user's positions ascend
                user = w.offset + (r0 + q // width - wr0) * (we1 - we0) + (e0 + q % width - we0)
                lo = int(user[0])
                out.append(ChunkPatch(w.name, p.index, (lo, int(user[-1]) + 1), user - lo, p.values[at],
                                      p.expected_old[at]))
            key = (p.name, p.index)
            if key in res.edges:
                if p.positions is None:
                    after[key] = np.array(p.values, copy=True)
                else:
                    # the patch was made against the chunk as the slice target read it: the
                    # spare bits outside the windows, zeros where none are held (a full load)
                    bits = spare.get(key)
                    new = bits.copy() if bits is not None else np.zeros(p.span[1] - p.span[0], dtype=p.values.dtype)
                    new[p.positions] = p.values
                    after[key] = new
        return out, after

    @staticmethod
    def empty(res: Resolved, make: Callable[..., torch.Tensor],
              into: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """New tensors of the selection's shapes (``make``: ``torch.empty`` or ``torch.zeros``),
        or carved from the buffer ``into`` returns (:func:`~deltastore.layout.groups.carve`)."""
        if into is None:
            return {n: make(shape, dtype=stored_dtype(dt)) for n, (dt, shape) in res.shapes.items()}
        shapes = list(res.shapes.items())
        flat = carve([(stored_dtype(dt), math.prod(shape)) for _, (dt, shape) in shapes], into)
        return {n: t.view(shape) for (n, (_, shape)), t in zip(shapes, flat)}


def changed_spans(plans: Iterable[ChunkPlan], res: Resolved) -> dict[str, list[tuple[int, int]]]:
    """What ``plans`` wrote, in the coordinates of the partial target's tensors (a slice's
    elements from 0; a group member's own elements), merged per tensor: for every chunk, the
    rows of each window it overlaps, as the user holds them. A grid chunk is reported as its
    row band (design 011 D4), a superset: chunk-granular, as ``last_changed`` promises."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in plans:
        ws = res.windows.get(p.name)
        if not ws:
            continue
        spec = res.specs[p.name]
        r0, r1, e0, e1 = spec.chunk_block(p.index)
        for w in ws:
            wr0, wr1, we0, we1 = w.rect(spec.row_elems)
            x0, x1 = max(r0, wr0), min(r1, wr1)
            if x0 < x1 and max(e0, we0) < min(e1, we1):
                width = we1 - we0
                spans.setdefault(w.name, []).append((w.offset + (x0 - wr0) * width, w.offset + (x1 - wr0) * width))
    return {n: merge_spans(s) for n, s in spans.items()}
