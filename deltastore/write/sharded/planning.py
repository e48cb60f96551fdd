"""Planning a sharded version (SPEC §8, design 010): what each rank holds, the layout every
rank computes from the same reports, each rank's share of it, and the plan rank 0 decides.

Everything here is a value every rank computes alike from the same inputs (the reports of step 1),
or a message between the ranks (pickled by :mod:`~deltastore.write.sharded.collectives`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deltastore.errors import InvalidStateDictError, ShardMismatchError
from deltastore.format.models import Layout, ObjectRef
from deltastore.layout.tensors import TensorSpec, chunk_rows_for, grid_cols_for
from deltastore.write.sharded.collectives import Reported


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, start + local.shape[0])`` of a tensor of ``rows`` rows, held by this rank.

    For tensors split by hand; an FSDP2 parameter (a DTensor sharded on dimension 0) is
    recognised without it.
    """

    local: torch.Tensor
    start: int
    rows: int


@dataclass(frozen=True)
class Claim:
    """What one rank holds of one tensor (sent to every rank in step 1)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    #: shares memory with another tensor this rank passes (tied weights); only looked for
    #: when the publisher has ``column_slices``: a tensor tied on any rank gets no grid.
    tied: bool = False



@dataclass(frozen=True)
class Share:
    """This rank's share of a layout (:func:`share_of`): for each tensor it
    publishes, in layout order, its local spec, the index of its first chunk in the whole
    tensor (its first row block times the column blocks, design 011 D11) and its first row;
    valid for ``layout`` and this rank's ``claims``."""

    layout: Layout
    claims: tuple[Claim, ...]
    specs: dict[str, TensorSpec]
    first_chunk: dict[str, int]
    first_row: dict[str, int]


@dataclass(frozen=True)
class Report:
    """Step 1: one rank's view, or its error.

    ``claims`` is None when they are this rank's claims of the last layout every rank planned,
    whose digest ``planned`` names (design 010 D7): a steady version sends a digest, not
    O(tensors) claims per rank."""

    rank: int
    claims: tuple[Claim, ...] | None = ()
    planned: str | None = None  # digest of the claims of the layout this rank planned last
    held: tuple[int, str] | None = None  # (version, manifest key) its reference copy is at
    known: int | None = None  # the last version this rank saw committed
    step: int | None = None
    anchor: bool = False
    error: Reported | None = None
    plan: Plan | None = None  # rank 0 only: its steady-state plan, made before step 1 (D6)
    settled: tuple[tuple[int, Any], ...] = ()  # rank 0 only: outcomes of earlier async versions (D10)


@dataclass(frozen=True)
class Resume:
    """Step 2: HEAD's version, which every rank not holding it rebuilds its reference copy
    from (its own rows only) before encoding a delta on it (design 010 D11). ``commit_id`` is
    HEAD's (what ``_held`` is compared with: a claim gives HEAD a new one); the manifest is
    pinned by HEAD's key and SHA-256."""

    version: int
    commit_id: str
    manifest: str
    sha256: str | None
    lineage: str | None


@dataclass(frozen=True)
class Plan:
    """Step 2: what rank 0 decided, or the error every rank raises."""

    version: int = 0
    attempt: str = ""
    kind: str = "anchor"
    has_base: bool = False
    lineage: str | None = None
    layout_ref: ObjectRef | None = None
    error: Reported | None = None
    base: tuple[int, str] | None = None  # a pre-plan: the (version, attempt) every rank must hold
    ahead: bool = False  # planned on a version still being committed (publish_async, D10)
    settled: tuple[tuple[int, Any], ...] = ()  # outcomes rank 0 waited for before planning (D10)
    resume: Resume | None = None  # a delta on HEAD's version once every rank has read its rows (D11)



def plan_layout(reports: Sequence[Report], world: int, chunk_bytes: int, column_slices: Sequence[str] = (),
                slice_align: int | None = None) -> Layout:
    """The sharded layout every rank computes from the same reports (step 1): tensors in the
    order ranks 0, 1, … list them, each tensor's pieces and the part (rank) of each piece.

    A tensor matching ``column_slices`` gets the column grid an unsharded publisher would give
    it (:func:`~deltastore.layout.tensors.grid_cols_for`, from its global shape and ``slice_align``),
    unless a rank reports it tied; its chunk rows then size a grid block, and still divide
    every piece boundary (design 011 D11).

    Rows claimed by several ranks alike (replicated tensors, whole tensors every rank passes)
    are owned by the lowest of them. Raises ShardMismatchError, naming the tensor and ranks,
    when ranks disagree on a dtype or shape, or when rows are claimed by no rank or by
    overlapping ranges.
    """
    order: dict[str, list[tuple[int, Claim]]] = {}
    for r in sorted(reports, key=lambda r: r.rank):
        for c in r.claims:
            order.setdefault(c.name, []).append((r.rank, c))
    names, dtypes, shapes, rows_col, cols_col, pieces, owners_col = [], [], [], [], [], [], []
    for name, claims in order.items():
        rank0, first = claims[0]
        for rank, c in claims[1:]:
            if (c.dtype, c.shape) != (first.dtype, first.shape):
                raise ShardMismatchError(f"tensor {name!r} is {first.dtype}{list(first.shape)} on rank {rank0} but "
                                         f"{c.dtype}{list(c.shape)} on rank {rank}: the ranks disagree on the layout")
        extent = first.shape[0] if first.shape else 1
        ranges: dict[tuple[int, int], int] = {}
        for rank, c in claims:
            if c.start < c.stop or extent == 0:
                ranges.setdefault((c.start, c.stop), rank)  # the lowest rank owns a replicated range
        pos, bounds, owners = 0, [], []
        for (start, stop), rank in sorted(ranges.items()):
            if start != pos:
                what = f"rows [{pos}, {start}) are held by no rank" if start > pos else (
                    f"rows [{start}, {min(stop, pos)}) are claimed twice (rank {rank} and rank {owners[-1]})")
                raise ShardMismatchError(f"tensor {name!r} {list(first.shape)}: {what}: the ranks disagree on who owns which rows")
            if owners:
                bounds.append(start)
            owners.append(rank)
            pos = stop
        if pos != extent or not owners:
            raise ShardMismatchError(f"tensor {name!r} {list(first.shape)}: rows [{pos}, {extent}) are held by no rank")
        width = torch.empty((), dtype=getattr(torch, first.dtype)).element_size()
        block_bytes = math.prod(first.shape[1:]) * width
        cols = 0
        if (column_slices and slice_align is not None and not any(c.tied for _, c in claims)
                and any(fnmatch.fnmatchcase(name, p) for p in column_slices)):
            cols = grid_cols_for(first.shape, width, slice_align, chunk_bytes)
            if cols:
                block_bytes = cols * math.prod(first.shape[2:]) * width
        names.append(name)
        dtypes.append(first.dtype)
        shapes.append(first.shape)
        rows_col.append(chunk_rows_for(block_bytes, extent, bounds, chunk_bytes))
        cols_col.append(cols)
        pieces.append(tuple(bounds))
        owners_col.append(tuple(owners))
    layout = Layout(schema=3, name=tuple(names), dtype=tuple(dtypes), shape=tuple(shapes), chunk_rows=tuple(rows_col),
                    chunk_cols=tuple(cols_col), pieces=tuple(pieces), piece_parts=tuple(owners_col), parts=world)
    return layout


def local_shard(name: str, t: Any) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """``(local rows, first row, global shape)`` of one state value on this rank."""
    if isinstance(t, Rows):
        local = t.local
        shape = (t.rows, *local.shape[1:])
        if local.dim() == 0 or not 0 <= t.start <= t.start + local.shape[0] <= t.rows:
            raise InvalidStateDictError(f"tensor {name!r}: Rows(start={t.start}, rows={t.rows}) with local shape "
                                        f"{list(local.shape)} is not a row range of a {t.rows}-row tensor")
        return local, t.start, shape
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        DTensor = ()  # type: ignore[assignment]
    if isinstance(t, DTensor):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        for p in t.placements:
            if not isinstance(p, (Replicate, Shard)) or (isinstance(p, Shard) and p.dim != 0):
                raise InvalidStateDictError(f"tensor {name!r} is a DTensor placed {t.placements}: deltastore publishes "
                                            "row shards (Shard(0)) and replicas; column shards would need column pieces "
                                            "(not in the format; column_slices grids rows for column readers)")
        shape = tuple(t.shape)
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise InvalidStateDictError(f"tensor {name!r}: its local shard is {list(local.shape)}, not the "
                                        f"{list(local_shape)} its placement {t.placements} implies (padded?)")
        return local, (offset[0] if shape else 0), shape
    if isinstance(t, torch.Tensor):
        return t, 0, tuple(t.shape)
    raise InvalidStateDictError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor, DTensor or Rows")




def share_of(layout: Layout, claims: tuple[Claim, ...], local: Mapping[str, tuple[torch.Tensor, int]], rank: int) -> Share:
    """What ``rank`` publishes of ``layout``: the tensors whose pieces the layout gives it (the
    lowest rank of a replicated range), each one's local spec and first chunk.

    It depends on the local tensors only through their name, dtype, global shape, first and
    last row, which are exactly the rank's ``claims``: a rank makes it once per layout and
    claims, then reuses it (design 010 D8). Nothing keyed by tensor identity: a tensor swapped
    for another of the same claim is encoded from the new one."""
    specs: dict[str, TensorSpec] = {}
    first_chunk: dict[str, int] = {}
    first_row: dict[str, int] = {}
    for i, name in enumerate(layout.name):
        if name not in local:
            continue
        t, start = local[name]
        bounds = (0, *(layout.pieces[i] or ()))
        for b, owner in zip(bounds, layout.piece_parts[i] or ()):
            if owner == rank and b == start:
                rows = layout.chunk_rows[i]
                spec = TensorSpec(name, layout.dtype[i], tuple(t.shape), rows, (), layout.chunk_cols[i])
                specs[name] = spec
                # a grid piece's local chunk (i, j) is global (first row block + i, j): the
                # shift is whole row blocks of n_colblocks chunks (design 011 D11)
                first_chunk[name] = start // rows * spec.n_colblocks
                first_row[name] = start
    return Share(layout, claims, specs, first_chunk, first_row)


def preplan_holds(plan: Plan, reports: Sequence[Report], held_layout: Layout | None, layout: Layout) -> bool:
    """Whether rank 0's pre-plan is the plan step 2 would make from these reports; every rank
    decides alike (the same reports; equal ``held`` means each rank's last commit was that
    base, with the same layout: ``held_layout``, this rank's). Else step 2 plans and
    broadcasts."""
    return (
        plan.base is not None and all(r.held == plan.base for r in reports) and held_layout == layout
        and (plan.kind == "anchor" or not any(r.anchor for r in reports))
    )
