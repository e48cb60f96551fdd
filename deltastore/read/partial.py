"""A partial subscriber's reads (SPEC §8 "Partial pulls"): its selection against each layout,
and the bits of edge chunks outside its slices.

:mod:`deltastore.layout.select` says which chunks a selection overlaps and how a chunk lands
in the user's slices; this module keeps what a subscriber carries from one pull to the next:
the selection resolved once per layout, and ``spare``, the bits of the chunks read whole and
cut whose other part the user does not hold (a later delta applies to the whole chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from deltastore.format.models import DTYPE_WIDTHS
from deltastore.layout.select import Resolved, Selection, resolve
from deltastore.layout.tensors import TensorSpec
from deltastore.read.changes import merge_spans
from deltastore.read.plan import ChunkPlan
from deltastore.read.targets import stored_dtype

#: A partial subscriber reads adjacent segments as one GET but never the bytes between: they
#: are other ranks' segments, and what it reads is what its link carries.
PARTIAL_COALESCE_GAP_BYTES = 0


class Partial:
    """One partial subscriber's selection and the spare bits of its edge chunks.

    Args:
        select: the selection (:class:`deltastore.layout.select.Selection`).
    """

    def __init__(self, select: Selection):
        self.select = select
        #: the bits of edge chunks outside the slices (deltastore.layout.select.SliceTarget)
        self.spare: dict[tuple[str, int], np.ndarray] = {}
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
    def empty(res: Resolved, make: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
        """New tensors of the selection's shapes (``make``: ``torch.empty`` or ``torch.zeros``)."""
        return {n: make(shape, dtype=stored_dtype(dt)) for n, (dt, shape) in res.shapes.items()}


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
