"""Partial pulls (SPEC §8 "Partial pulls"): which part of a version a subscriber reads.

A :class:`Selection` names tensors by pattern and may cut some of them along their first
dimension (tensor-parallel serving of a column-parallel weight: rank r of N holds rows
``[r·S//N, (r+1)·S//N)``) or their second (a row-parallel weight: columns ``[r·C//N,
(r+1)·C//N)`` of every row). :func:`resolve` turns it, with a version's layout, into what a
partial pull needs: per layout unit (a tensor or a group row, design 007) the element windows
the user's tensors hold and the chunks that overlap them. Pure: layouts in, a :class:`Resolved`
out.

Chunks are whole rows (SPEC §2), so a chunk is the smallest thing a reader can fetch and verify:
a chunk straddling the edge of a slice is read whole and cut. Its bits outside the slice are
kept by the subscriber (:class:`SliceTarget`'s ``spare``) so that later deltas, which apply to
the whole chunk, can be applied and checked against the chunk's digest. A cut along dimension 1
makes every chunk of the tensor such an edge: the reader fetches and verifies the whole tensor
and keeps the bits outside its columns; the user's tensor holds only the columns.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deltastore.errors import SelectionError
from deltastore.tensors import TensorSpec, bits, dtype_name
from deltastore.tensors import ROW_PARALLEL as ROW_PARALLEL  # re-exported here (design 011 D6)


@dataclass(frozen=True)
class Selection:
    """The part of each version a partial subscriber reads.

    Args:
        names: fnmatch patterns over tensor names (the names users see: group members, never
            group rows). A tensor is selected when any pattern matches it; every pattern must
            match at least one tensor.
        shard: ``(dim, rank, world)``: cut the sharded tensors along ``dim`` (0 or 1) and keep
            part ``rank`` of ``world``: along 0 rows ``[rank·S//world, (rank+1)·S//world)``,
            along 1 columns ``[rank·C//world, (rank+1)·C//world)`` of every row (equal parts
            when ``world`` divides the extent, else parts differing by at most one). Chunks are
            whole rows (SPEC §2): a cut along 0 reads only its rows' chunks, a cut along 1 reads
            and verifies the whole tensor and keeps the other columns beside the user's tensor.
        shard_names: fnmatch patterns of the selected tensors to cut (default: every selected
            tensor with at least one dimension); the others are read whole (replicated).
        shard_dims: ``{pattern: dim}``: tensors to cut along another dimension than
            ``shard``'s (the first matching pattern wins; they are cut whether or not
            ``shard_names`` names them). Tensor-parallel serving cuts column-parallel weights
            along 0 and row-parallel weights (attention output, MLP down) along 1.

    Example::

        sel = Selection(names=["layers.*.mlp.*"], shard=(0, rank, world))
        sub = Subscriber(url, select=sel)
        mine = sub.pull()            # only this rank's rows of the MLP weights

        tp = Selection(shard=(0, rank, world), shard_names=["*_proj.weight"],
                       shard_dims={"*.o_proj.weight": 1, "*.down_proj.weight": 1})
    """

    names: tuple[str, ...] = ("*",)
    shard: tuple[int, int, int] | None = None
    shard_names: tuple[str, ...] | None = None
    shard_dims: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))
        if self.shard_names is not None:
            object.__setattr__(self, "shard_names", tuple(self.shard_names))
        if self.shard_dims is not None:
            dims = self.shard_dims.items() if isinstance(self.shard_dims, Mapping) else self.shard_dims
            object.__setattr__(self, "shard_dims", tuple((str(p), int(d)) for p, d in dims))
        if not self.names:
            raise SelectionError("a selection needs at least one name pattern")
        if self.shard is None:
            if self.shard_dims:
                raise SelectionError("shard_dims needs shard=(dim, rank, world): the rank and world to cut by")
            return
        dim, rank, world = self.shard
        if world < 1 or not 0 <= rank < world:
            raise SelectionError(f"shard {self.shard}: rank must be in [0, world) and world ≥ 1")
        for d in (dim, *(d for _, d in self.shard_dims or ())):
            if d not in CUT_DIMS:
                raise SelectionError(
                    f"shard {self.shard}: a cut along dim {d} is not supported; chunks hold whole rows (SPEC §2), "
                    "so a tensor is cut along dim 0 (its rows) or dim 1 (its columns). Leave the tensor out of "
                    "shard_names and cut it after the pull"
                )

    def cut_dim(self, name: str) -> int | None:
        """The dimension tensor ``name`` is cut along, or None when it is read whole."""
        if self.shard is None:
            return None
        for pattern, d in self.shard_dims or ():
            if fnmatch.fnmatchcase(name, pattern):
                return d
        if self.shard_names is None or _matches(name, self.shard_names):
            return self.shard[0]
        return None


#: Dimensions a selection can cut along: rows (chunks are whole rows) and columns (every row's
#: span of columns is contiguous, so the reader cuts it out of a chunk without a gather).
CUT_DIMS = (0, 1)


@dataclass(frozen=True)
class Window:
    """Elements ``[start, stop)`` of a layout unit, held by the user's tensor ``name`` from
    its element ``offset`` on.

    With ``cols = (lo, hi)`` (a cut along dimension 1) ``[start, stop)`` are whole rows of
    ``row`` elements and the user's tensor holds only elements ``[lo, hi)`` of each, back to
    back: unit element ``e`` is the user's ``offset + ((e - start) // row)·(hi - lo) + e % row - lo``.
    """

    start: int
    stop: int
    name: str
    offset: int = 0
    cols: tuple[int, int] | None = None
    row: int = 0

    def held(self, a: int, b: int) -> int:
        """How many elements of ``[a, b)`` (whole rows when ``cols`` is set) the user holds."""
        x, y = max(a, self.start), min(b, self.stop)
        if x >= y:
            return 0
        if self.cols is None:
            return y - x
        return (y - x) // self.row * (self.cols[1] - self.cols[0])

    def user_span(self, a: int, b: int) -> tuple[int, int] | None:
        """The user's elements covering unit elements ``[a, b)`` (rows, for ``cols``), or None."""
        x, y = max(a, self.start), min(b, self.stop)
        if x >= y:
            return None
        if self.cols is None:
            return (self.offset + x - self.start, self.offset + y - self.start)
        w = self.cols[1] - self.cols[0]
        return (self.offset + (x - self.start) // self.row * w, self.offset + (y - self.start) // self.row * w)


@dataclass(frozen=True)
class Resolved:
    """A selection against one layout.

    Attributes:
        windows: per unit, the windows the user's tensors hold, in element order.
        chunks: the chunks a pull reads: ``(unit, index)`` of every chunk overlapping a window.
        edges: the chunks of ``chunks`` not wholly inside windows (read whole and cut).
        shapes: per user tensor, ``(dtype, shape)`` of what the subscriber hands out.
        rows: per sharded tensor, its row range ``[start, stop)``.
    """

    windows: dict[str, tuple[Window, ...]]
    chunks: frozenset[tuple[str, int]]
    edges: frozenset[tuple[str, int]]
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def resolve(sel: Selection, units: Mapping[str, TensorSpec]) -> Resolved:
    """What ``sel`` reads of a version with layout ``units`` (tensors and group rows).

    Raises:
        SelectionError: a pattern matches no tensor, a sharded tensor has fewer rows than
            ``world``, or a sharded tensor is a group member (those are small and
            stored back to back with others: read them whole).
    """
    used: set[str] = set()
    windows: dict[str, list[Window]] = {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    rows: dict[str, tuple[int, int]] = {}

    def picked(name: str) -> bool:
        hit = [p for p in sel.names if fnmatch.fnmatchcase(name, p)]
        used.update(hit)
        return bool(hit)

    for uname, spec in units.items():
        if spec.members:
            for m in spec.members:
                if not picked(m.name):
                    continue
                if sel.shard is not None and (
                        (sel.shard_names is not None and _matches(m.name, sel.shard_names))
                        or any(fnmatch.fnmatchcase(m.name, p) for p, _ in sel.shard_dims or ())):
                    raise SelectionError(
                        f"tensor {m.name!r} is stored in group row {uname!r} (a small tensor, design 007): it cannot "
                        "be cut; leave it out of shard_names to read it whole"
                    )
                windows.setdefault(uname, []).append(Window(m.offset, m.offset + m.numel, m.name))
                shapes[m.name] = (m.dtype, tuple(m.shape))
            continue
        if not picked(uname):
            continue
        dim = sel.cut_dim(uname) if spec.shape else None
        if dim is None:
            windows[uname] = [Window(0, spec.numel, uname)]
            shapes[uname] = (spec.dtype, tuple(spec.shape))
            continue
        assert sel.shard is not None
        _, rank, world = sel.shard
        if dim >= len(spec.shape):
            raise SelectionError(
                f"tensor {uname!r} has shape {list(spec.shape)}: it has no dimension {dim} to cut (leave it out of "
                "shard_names and shard_dims to read it whole)"
            )
        n = spec.shape[dim]
        what = "rows" if dim == 0 else "columns"
        if n < world:
            raise SelectionError(
                f"tensor {uname!r} has {n} {what}, fewer than {world} ranks: rank {rank} would hold none of them "
                "(leave it out of shard_names to read it whole)"
            )
        lo, hi = rank * n // world, (rank + 1) * n // world
        if dim == 0:
            rows[uname] = (lo, hi)
            windows[uname] = [Window(lo * spec.row_elems, hi * spec.row_elems, uname)]
        else:
            inner = spec.row_elems // n  # elements per column of one row (the trailing dims)
            windows[uname] = [Window(0, spec.numel, uname, cols=(lo * inner, hi * inner), row=spec.row_elems)]
        shape = list(spec.shape)
        shape[dim] = hi - lo
        shapes[uname] = (spec.dtype, tuple(shape))
    unused = [p for p in sel.names if p not in used]
    if unused:
        raise SelectionError(f"name pattern {unused[0]!r} matches no tensor of the store's layout")
    return _resolved(units, windows, shapes, rows)


def resolve_rows(units: Mapping[str, TensorSpec], rows: Mapping[str, tuple[int, int]]) -> Resolved:
    """What a reader of exactly ``rows`` (tensor name → rows ``[start, stop)``; a 0-d tensor
    counts as one row) reads of a version with layout ``units``: the row ranges a caller knows
    already, such as a sharded writer's own pieces (design 010 D11: FSDP2's ``torch.chunk``
    rows, which :attr:`Selection.shard`'s ``rank·S//world`` formula does not give). Internal:
    exact names, no patterns (a rank may own tens of thousands of tensors).

    Raises:
        SelectionError: a name is not a tensor of ``units`` (or is a group member), or its
            rows are not within the tensor.
    """
    windows: dict[str, list[Window]] = {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for name, (lo, hi) in rows.items():
        spec = units.get(name)
        if spec is None or spec.members:
            raise SelectionError(f"tensor {name!r} is not a tensor of the store's layout")
        extent = spec.shape[0] if spec.shape else 1
        if not 0 <= lo <= hi <= extent:
            raise SelectionError(f"rows [{lo}, {hi}) of tensor {name!r} are not rows of its shape {list(spec.shape)}")
        windows[name] = [Window(lo * spec.row_elems, hi * spec.row_elems, name)]
        shapes[name] = (spec.dtype, (hi - lo, *spec.shape[1:]) if spec.shape else ())
        spans[name] = (lo, hi)
    return _resolved(units, windows, shapes, spans)


def _resolved(units: Mapping[str, TensorSpec], windows: Mapping[str, Sequence[Window]],
              shapes: dict[str, tuple[str, tuple[int, ...]]], rows: dict[str, tuple[int, int]]) -> Resolved:
    """The :class:`Resolved` of ``windows``: the chunks overlapping them, and the edges."""
    chunks: set[tuple[str, int]] = set()
    edges: set[tuple[str, int]] = set()
    for uname, ws in windows.items():
        spec = units[uname]
        for i in range(spec.n_chunks):
            a, b = spec.chunk_span(i)
            inside = sum(w.held(a, b) for w in ws)
            if inside:
                chunks.add((uname, i))
                if inside < b - a:
                    edges.add((uname, i))
    return Resolved({u: tuple(ws) for u, ws in windows.items()}, frozenset(chunks), frozenset(edges), shapes, rows)


def check_target(res: Resolved, tensors: Mapping[str, torch.Tensor], *, against: str) -> None:
    """The user's tensors are exactly the selection's, with its dtypes and (sliced) shapes, on
    the CPU.

    Raises:
        SelectionError: naming the first tensor that differs.
    """
    missing = sorted(set(res.shapes) - set(tensors))
    extra = sorted(set(tensors) - set(res.shapes))
    if missing:
        raise SelectionError(f"tensor {missing[0]!r} of the selection of {against} is missing from the target")
    if extra:
        raise SelectionError(f"tensor {extra[0]!r} of the target is not in the selection of {against}")
    for name, (dtype, shape) in res.shapes.items():
        t = tensors[name]
        if dtype_name(t.dtype) != dtype or tuple(t.shape) != shape:
            raise SelectionError(
                f"tensor {name!r} is {dtype_name(t.dtype)}{list(t.shape)} but the selection of {against} "
                f"is {dtype}{list(shape)}"
            )
        if t.device.type != "cpu":
            raise SelectionError(f"tensor {name!r} is on {t.device}: a partial target is held on the CPU")


class SliceTarget:
    """The read engine's access to one layout unit of a partial target (a tensor's slice, or
    the selected members of a group row) in the unit's element coordinates.

    ``read`` assembles a chunk from the user's tensors and, outside the windows, from
    ``spare`` (the subscriber's copy of each edge chunk's bits); ``write`` scatters into both.
    Reads are copies (``cpu = False``: the engine writes results back).
    """

    cpu = False
    raw = None

    def __init__(self, spec: TensorSpec, windows: Sequence[Window], tensors: Mapping[str, torch.Tensor],
                 spare: dict[tuple[str, int], np.ndarray], edges: frozenset[tuple[str, int]]):
        self.spec = spec
        self.windows = [(w, bits(tensors[w.name])) for w in windows]
        self.spare = spare
        self.edges = edges
        self._index = {spec.chunk_span(i)[0]: i for i in range(spec.n_chunks)}

    def _key(self, a: int) -> tuple[str, int]:
        return (self.spec.name, self._index[a])

    def read(self, a: int, b: int) -> np.ndarray:
        key = self._key(a)
        sp = self.spare.get(key) if key in self.edges else None
        out = sp.copy() if sp is not None else np.zeros(b - a, dtype=self.spec.uint_dtype())
        for w, arr in self.windows:
            span = w.user_span(a, b)
            if span is None:
                continue
            if w.cols is None:
                x = max(a, w.start)
                out[x - a : x - a + span[1] - span[0]] = arr[span[0] : span[1]]
            else:  # whole rows [a, b): the user's columns of each
                lo, hi = w.cols
                out.reshape(-1, w.row)[:, lo:hi] = arr[span[0] : span[1]].reshape(-1, hi - lo)
        return out

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        key = self._key(a)
        if key in self.edges:
            self.spare[key] = np.array(raw, copy=True)
        for w, arr in self.windows:
            span = w.user_span(a, b)
            if span is None:
                continue
            if w.cols is None:
                x = max(a, w.start)
                arr[span[0] : span[1]] = raw[x - a : x - a + span[1] - span[0]]
            else:
                lo, hi = w.cols
                arr[span[0] : span[1]].reshape(-1, hi - lo)[:] = raw.reshape(-1, w.row)[:, lo:hi]


def slice_targets(units: Mapping[str, TensorSpec], res: Resolved, tensors: Mapping[str, torch.Tensor],
                  spare: dict[tuple[str, int], np.ndarray]) -> dict[str, SliceTarget]:
    """One :class:`SliceTarget` per selected unit."""
    return {u: SliceTarget(units[u], ws, tensors, spare, res.edges) for u, ws in res.windows.items()}
