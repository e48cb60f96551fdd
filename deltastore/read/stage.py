"""Staged updates: everything a fast-forward needs, prepared before the pause (SPEC §7.7).

A worker that serves inference cannot stop for a whole download + decode + apply. Staging
splits a fast-forward in two:

1. **Prepare** (the engine keeps serving): fetch and verify the segments, rebuild each changed
   chunk in a scratch buffer from the target's current bits, check the target's base digest and
   the result's digest there, and keep only the *patch*: the positions whose bits change and
   their new bits (or the whole chunk, when most of it changes). Nothing touches the target.
2. **Swap** (the pause): write the patches into the target. The old bits at those positions are
   gathered first, so a failure in the middle restores every chunk already written; the target
   holds either the old version or the new one, never a mix.

The swap is a scatter of the changed elements only (about 1% of the model at RL learning
rates), so the pause is a small fraction of a full ``load_state_dict``.

Preparing reads the target while the engine may read it too; it must not be *written* by
anyone else between prepare and swap. The swap checks that the bits it replaces are the ones
the patch was prepared against, so a write in between is detected at the touched positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltastore.codec.apply import Changes
from deltastore.errors import IntegrityError
from deltastore.format.history import VersionInfo
from deltastore.layout.grid import patch_put, patch_region, patch_take
from deltastore.layout.groups import member_overlaps
from deltastore.layout.tensors import TensorSpec

logger = logging.getLogger(__name__)

#: A chunk whose changed fraction exceeds this is staged whole: past about a quarter, positions
#: (8 bytes each) plus values cost more memory and scatter time than a dense copy.
DENSE_PATCH_FRACTION = 0.25


@dataclass
class ChunkPatch:
    """The new bits of one chunk: at ``positions`` (sparse), or the whole chunk (``positions`` None).

    ``expected_old`` holds the bits the patch was prepared against at the same positions (for a
    dense patch, the whole chunk's), so the swap can tell that nobody wrote the target since.

    Positions are chunk-relative, in the chunk's C order. ``block`` is None when the chunk is
    the span ``span`` of the flattened tensor; for a column-grid chunk (design 011 D4) it is
    ``(r0, r1, e0, e1)`` (:meth:`~deltastore.layout.tensors.TensorSpec.chunk_block`): the chunk is
    that 2-D block of the tensor seen as ``(shape[0], row)`` rows of ``row`` elements, and
    ``span`` is its span in the tensor's unit order.
    """

    name: str
    index: int
    span: tuple[int, int]
    positions: np.ndarray | None
    values: np.ndarray
    expected_old: np.ndarray
    block: tuple[int, int, int, int] | None = None
    #: elements per row of the tensor when ``block`` is set (the row band it reports as changed)
    row: int = 0

    @property
    def changed(self) -> tuple[int, int]:
        """The element span ``[start, stop)`` of the flattened tensor the patch may write: its
        span, or for a grid chunk its whole row band ``[r0·row, r1·row)`` (a superset)."""
        if self.block is None:
            return self.span
        return (self.block[0] * self.row, self.block[1] * self.row)

    @property
    def nbytes(self) -> int:
        pos = 0 if self.positions is None else self.positions.nbytes
        return pos + self.values.nbytes + self.expected_old.nbytes


def make_patch(name: str, index: int, span: tuple[int, int], current: np.ndarray, result: np.ndarray,
               changes: Changes | None = None) -> ChunkPatch | None:
    """The patch turning ``current`` into ``result`` (equal-length uint arrays); None if equal.

    ``changes``: where they differ and the bits there, when the caller knows them (a sparse
    delta applied by :func:`~deltastore.codec.apply_delta_into`), so the two chunks need not be
    compared and gathered element by element."""
    changed = changes.positions if changes is not None else np.flatnonzero(current != result)
    if changed.size == 0:
        return None
    if changed.size > DENSE_PATCH_FRACTION * current.size:
        return ChunkPatch(name, index, span, None, np.array(result, copy=True), np.array(current, copy=True))
    if changes is not None:
        return ChunkPatch(name, index, span, changed, changes.new, changes.old)
    return ChunkPatch(name, index, span, changed, result[changed], current[changed])


def split_patch(patch: ChunkPatch, spec: TensorSpec) -> list[ChunkPatch]:
    """The patches of ``spec``'s members that together make ``patch`` (of a group chunk): a
    swap writes tensors, never group rows (design 007 D4)."""
    a, b = patch.span
    out = []
    for m, lo, hi in member_overlaps(spec, a, b):
        span = (lo - m.offset, hi - m.offset)
        if patch.positions is None:
            out.append(ChunkPatch(m.name, 0, span, None, patch.values[lo - a:hi - a], patch.expected_old[lo - a:hi - a]))
            continue
        i, j = np.searchsorted(patch.positions, [lo - a, hi - a])
        if i == j:
            continue
        out.append(ChunkPatch(m.name, 0, span, patch.positions[i:j] - (lo - a), patch.values[i:j], patch.expected_old[i:j]))
    return out


@dataclass
class StagedUpdate:
    """A verified fast-forward, ready to be swapped into its target.

    Attributes:
        info: the version it brings the target to.
        from_version: the version the target held when it was prepared (None: a full load).
        patches: the per-chunk patches.
        bytes_fetched: bytes read from the store to prepare it.
        fetch_s / decode_s: time spent waiting for segments (fetched and SHA-256-checked in
            parallel) / checking the target, decoding and checking digests.
    """

    info: VersionInfo
    from_version: int | None
    patches: list[ChunkPatch] = field(default_factory=list)
    bytes_fetched: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    #: The held manifest it was prepared against, and the manifests to hold after the swap
    #: (set by the Subscriber that staged it; it refuses a staged update made for another state).
    base_manifest: str | None = field(default=None, repr=False)
    held: Any = field(default=None, repr=False)
    owner: Any = field(default=None, repr=False)
    #: For a swap by rebinding: tensor name → a patched copy, built by build_replacements().
    replacements: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    #: After a rebind, the storages the tensors pointed at before: freed when this update is
    #: dropped (or retired.clear()), so that unmapping them is not part of the pause.
    retired: list[torch.Tensor] = field(default_factory=list, repr=False)
    #: A partial subscriber's spare bits once swapped (its edge chunks' bits outside the
    #: selection, deltastore.read.partial): installed by the swap with the patches (None: a
    #: whole target).
    spare: dict[tuple[str, int], np.ndarray] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Memory held by the prepared patches."""
        return sum(p.nbytes for p in self.patches)

    @property
    def changed(self) -> dict[str, list[tuple[int, int]]]:
        """Tensor name → element spans ``[start, stop)`` of the chunks this update writes."""
        out: dict[str, list[tuple[int, int]]] = {}
        for p in self.patches:
            out.setdefault(p.name, []).append(p.changed)
        return out

    def swap(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """Write every patch into ``tensors``; all or nothing. Returns the seconds it took.

        Raises:
            IntegrityError: the target's bits at a patched position are not those the patch
                was prepared against (someone wrote the target since); nothing is left applied.
        """
        t0 = time.perf_counter()
        done: list[tuple[ChunkPatch, torch.Tensor]] = []
        try:
            for p in self.patches:
                t = tensors[p.name]
                # the chunk's place in ``t``: a 1-D span, or a grid chunk's 2-D block (011 D4)
                region = patch_region(t, p.span, p.block)
                if not np.array_equal(patch_take(region, p.positions), p.expected_old):
                    raise IntegrityError(
                        f"tensor {p.name!r} chunk {p.index}{_block_words(p)} changed between staging and swap: "
                        f"the target was written by someone else; nothing applied (stage it again)"
                    )
                patch_put(region, p.positions, p.values)
                done.append((p, t))
        except BaseException:
            for p, t in reversed(done):
                _restore(t, p)
            raise
        return time.perf_counter() - t0


    def build_replacements(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Prepare a swap by rebinding: copy each touched CPU tensor and patch the copy, now.

        The copies cost memory (the touched tensors, once more) and a copy's time, both outside
        the pause; the pause of :meth:`rebind` then only points each tensor at its copy. The
        patches' old bits are checked against ``tensors`` here, while copying.

        Raises:
            IntegrityError: ``tensors`` does not hold the bits the patches were prepared against.
            ValueError: a touched tensor is not on the CPU (rebinding would move it).
        """
        names = sorted({p.name for p in self.patches})
        off = [n for n in names if tensors[n].device.type != "cpu"]
        if off:
            raise ValueError(f"rebinding needs CPU tensors; {off[0]!r} is on {tensors[off[0]].device}: swap in place")
        out = {n: tensors[n].detach().clone() for n in names}
        for p in self.patches:
            region = patch_region(out[p.name], p.span, p.block)
            if not np.array_equal(patch_take(region, p.positions), p.expected_old):
                raise IntegrityError(f"tensor {p.name!r} chunk {p.index}{_block_words(p)} changed since it was staged; "
                                     "nothing applied (stage it again)")
            patch_put(region, p.positions, p.values)
        self.replacements = out

    def rebind(self, owners: Mapping[str, torch.Tensor]) -> float:
        """The pause of a swap by rebinding: point each touched tensor at its patched copy.

        ``owners`` holds the tensor objects the engine reads: ``nn.Parameter`` s are rebound
        through ``.data``, other tensors through ``set_`` (same object, new storage). A write to
        the old storage after :meth:`build_replacements` is lost. Returns the seconds it took.
        """
        t0 = time.perf_counter()
        done: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for name, new in self.replacements.items():
                    obj = owners[name]
                    old = obj.data if isinstance(obj, torch.nn.Parameter) else obj.detach()  # aliases the old storage
                    _point(obj, new)
                    done.append((obj, old))
        except BaseException:
            with torch.no_grad():
                for obj, old in reversed(done):
                    _point(obj, old)
            raise
        self.replacements = {}
        self.retired = [old for _, old in done]
        return time.perf_counter() - t0


def _point(obj: torch.Tensor, new: torch.Tensor) -> None:
    if isinstance(obj, torch.nn.Parameter):
        obj.data = new
    else:
        obj.set_(new)


def _block_words(p: ChunkPatch) -> str:
    """`` (rows r0-r1, element columns e0-e1)`` for a grid chunk's patch (design 011 D4), else ''."""
    if p.block is None:
        return ""
    r0, r1, e0, e1 = p.block
    return f" (rows {r0}-{r1}, element columns {e0}-{e1})"


def _restore(t: torch.Tensor, p: ChunkPatch) -> None:
    patch_put(patch_region(t, p.span, p.block), p.positions, p.expected_old)
