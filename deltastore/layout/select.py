"""Partial pulls (SPEC §8 "Partial pulls"): which part of a version a subscriber reads.

A :class:`Selection` names tensors by pattern and may cut some of them along their first
dimension (tensor-parallel serving of a column-parallel weight: rank r of N holds rows
``[r·S//N, (r+1)·S//N)``) or their second (a row-parallel weight: columns ``[r·C//N,
(r+1)·C//N)`` of every row). :func:`resolve` turns it, with a version's layout, into what a
partial pull needs: per layout unit (a tensor or a group row, design 007) the element windows
the user's tensors hold and the chunks that overlap them. Pure: layouts in, a :class:`Resolved`
out.

A chunk is the smallest thing a reader can fetch and verify: whole rows (SPEC §2), or with a
column grid (``chunk_cols`` > 0, design 011) a row block × a column block. A window is a
rectangle of the unit seen as rows × element columns (whole rows, or the user's columns of
every row), so :func:`resolve` enumerates the chunks it overlaps by arithmetic over row blocks
and column blocks (never a loop over every chunk of a grid). A chunk straddling the edge of a
window is read whole and cut. Its bits outside the window are kept by the subscriber
(:class:`SliceTarget`'s ``spare``) so that later deltas, which apply to the whole chunk, can be
applied and checked against the chunk's digest.

A cut along dimension 1 of a tensor without a grid makes every chunk such an edge: the reader
fetches and verifies the whole tensor and keeps the bits outside its columns; the user's tensor
holds only the columns. With a grid only the column blocks overlapping the cut are read, and at
most two of them straddle it per row block (011 D5). When the grid is aligned to the cut (each
chunk read spans exactly the user's columns) nothing is kept: each chunk is a contiguous span
of the user's slice, and the read engine applies and hashes it in place (:class:`SliceView`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deltastore.errors import SelectionError
from deltastore.layout.tensors import ROW_PARALLEL as ROW_PARALLEL  # re-exported here (design 011 D6)
from deltastore.layout.tensors import TensorSpec, bits, dtype_name


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
            when ``world`` divides the extent, else parts differing by at most one). A cut along
            0 reads only its rows' chunks. A cut along 1 reads the chunks overlapping its
            columns: with whole-row chunks (SPEC §2) that is the whole tensor, verified, with the
            other columns kept beside the user's tensor; with a column grid (design 011) only the
            column blocks it overlaps.
        shard_names: fnmatch patterns of the selected tensors to cut (default: every selected
            tensor with at least one dimension); the others are read whole (replicated).
        shard_dims: ``{pattern: dim}``: tensors to cut along another dimension than
            ``shard``'s (the first matching pattern wins; they are cut whether or not
            ``shard_names`` names them). Tensor-parallel serving cuts column-parallel weights
            along 0 and row-parallel weights (attention output, MLP down) along 1.
        exclude: fnmatch patterns of tensors left out even where ``names`` matches them (a
            pipeline-parallel stage leaves out the other stages' layers); unlike ``names``,
            a pattern may match nothing.

    Example::

        sel = Selection(names=["layers.*.mlp.*"], shard=(0, rank, world))
        sub = Subscriber(url, select=sel)
        mine = sub.pull()            # only this rank's rows of the MLP weights

        tp = Selection(shard=(0, rank, world), shard_names=["*_proj.weight"],
                       shard_dims={"*.o_proj.weight": 1, "*.down_proj.weight": 1})
        stage = Selection(exclude=["model.layers.1[6-9].*", "model.layers.2?.*", "lm_head.*"])
    """

    names: tuple[str, ...] = ("*",)
    shard: tuple[int, int, int] | None = None
    shard_names: tuple[str, ...] | None = None
    shard_dims: tuple[tuple[str, int], ...] | None = None
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.names, str) or isinstance(self.exclude, str):
            raise SelectionError("names and exclude are lists of patterns, e.g. names=['layers.*'], not one string")
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "exclude", tuple(self.exclude))
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


#: Dimensions a selection can cut along: rows and columns (a chunk is rows × a column block, so
#: either cut is a rectangle of chunks; see :meth:`Window.rect`).
CUT_DIMS = (0, 1)


@dataclass(frozen=True)
class Window:
    """Elements ``[start, stop)`` of a layout unit in its natural (C) order, whole rows, held by
    the user's tensor ``name`` from its element ``offset`` on.

    With ``cols = (lo, hi)`` (a cut along dimension 1) ``[start, stop)`` are whole rows of
    ``row`` elements and the user's tensor holds only elements ``[lo, hi)`` of each, back to
    back: unit element ``e`` is the user's ``offset + ((e - start) // row)·(hi - lo) + e % row - lo``.
    Chunks are matched against windows as rectangles (:meth:`rect` and
    :meth:`TensorSpec.chunk_block`), never by spans: a grid chunk's span is in unit order.
    """

    start: int
    stop: int
    name: str
    offset: int = 0
    cols: tuple[int, int] | None = None
    row: int = 0

    def rect(self, row: int) -> tuple[int, int, int, int]:
        """``(r0, r1, e0, e1)``: the rows and element columns the window covers of its unit seen
        as rows of ``row`` elements (the unit's ``row_elems``; a group row's are single elements).
        The user holds them in C order from ``offset``: rows of ``e1 − e0`` elements."""
        if self.cols is not None:
            # rows of no elements (a zero trailing dimension): no rows to hold, as below
            return (self.start // self.row, self.stop // self.row, *self.cols) if self.row else (0, 0, *self.cols)
        if not row:
            return (0, 0, 0, 0)
        return (self.start // row, self.stop // row, 0, row)


@dataclass(frozen=True)
class Resolved:
    """A selection against one layout.

    Attributes:
        windows: per unit, the windows the user's tensors hold, in element order.
        chunks: the chunks a pull reads: ``(unit, index)`` of every chunk overlapping a window.
        edges: the chunks of ``chunks`` not wholly inside windows (read whole and cut).
        shapes: per user tensor, ``(dtype, shape)`` of what the subscriber hands out.
        rows: per sharded tensor, its row range ``[start, stop)``.
        specs: the layout of every unit in ``windows``.
        views: the units read through a live view of the user's tensor (:class:`SliceView`):
            grid units whose chunks read are each exactly the window's columns (design 011 D5).
    """

    windows: dict[str, tuple[Window, ...]]
    chunks: frozenset[tuple[str, int]]
    edges: frozenset[tuple[str, int]]
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    views: frozenset[str] = frozenset()


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
        return bool(hit) and not _matches(name, sel.exclude)

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
    """The :class:`Resolved` of ``windows``: the chunks overlapping them, the edges, and the
    grid units aligned to their window (011 D5)."""
    chunks: set[tuple[str, int]] = set()
    edges: set[tuple[str, int]] = set()
    views: set[str] = set()
    for uname, ws in windows.items():
        spec = units[uname]
        held = chunks_held(spec, ws)
        # the aligned fast path is for grid units only: without a grid a pull reads through a
        # SliceTarget (design 011 D5)
        aligned = bool(held) and spec.chunk_cols > 0 and len(ws) == 1
        cols = ws[0].rect(spec.row_elems)[2:] if aligned else None
        for i, n in held.items():
            r0, r1, e0, e1 = spec.chunk_block(i)
            chunks.add((uname, i))
            if n < (r1 - r0) * (e1 - e0):
                edges.add((uname, i))
                aligned = False
            elif (e0, e1) != cols:
                aligned = False
        if aligned:
            views.add(uname)
    return Resolved({u: tuple(ws) for u, ws in windows.items()}, frozenset(chunks), frozenset(edges), shapes, rows,
                    {u: units[u] for u in windows}, frozenset(views))


def chunks_held(spec: TensorSpec, windows: Sequence[Window]) -> dict[int, int]:
    """Chunk index → how many of its elements ``windows`` hold, for every chunk of ``spec`` they
    overlap. By arithmetic: a window's rows overlap a range of row blocks and its columns a
    range of column blocks (one without a grid), so the work is the chunks overlapped, never
    every chunk of a grid (011 D7: ``nr·nc`` may be huge)."""
    out: dict[int, int] = {}
    if not spec.numel:
        return out
    height = spec.shape[0] if spec.shape else 1
    row = spec.row_elems
    band = spec.chunk_rows
    nc = spec.n_colblocks
    # element columns of a full column block (the whole row without a grid)
    width = spec.chunk_cols * (row // spec.shape[1]) if spec.chunk_cols else row
    for w in windows:
        wr0, wr1, we0, we1 = w.rect(row)
        if wr0 >= wr1 or we0 >= we1:
            continue
        for i in range(wr0 // band, -(-wr1 // band)):
            r0 = i * band
            h = min(r0 + band, height, wr1) - max(r0, wr0)
            for j in range(we0 // width, -(-we1 // width)):
                e0 = j * width
                n = h * (min(e0 + width, row, we1) - max(e0, we0))
                k = i * nc + j
                out[k] = out.get(k, 0) + n
    return out


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
    the selected members of a group row) in the unit's element coordinates (unit order: a grid
    chunk's span is its block in C order, design 011 D1).

    ``read`` assembles a chunk from the user's tensors and, outside the windows, from
    ``spare`` (the subscriber's copy of each edge chunk's bits); ``write`` scatters into both.
    Each chunk is a block of rows × element columns (:meth:`TensorSpec.chunk_block`) and each
    window a rectangle of the user's tensor (:meth:`Window.rect`), so both are 2-D copies of
    their overlap. Reads are copies (``cpu = False``: the engine writes results back).
    """

    cpu = False
    raw = None

    def __init__(self, spec: TensorSpec, windows: Sequence[Window], tensors: Mapping[str, torch.Tensor],
                 spare: dict[tuple[str, int], np.ndarray], edges: frozenset[tuple[str, int]]):
        self.spec = spec
        self.spare = spare
        self.edges = edges
        self._row = spec.row_elems
        self._band = spec.chunk_rows * self._row
        self._height = spec.shape[0] if spec.shape else 1
        # per window: its rectangle of the unit, and the user's bits as that rectangle
        self.windows: list[tuple[tuple[int, int, int, int], np.ndarray]] = []
        for w in windows:
            r0, r1, e0, e1 = w.rect(spec.row_elems)
            user = bits(tensors[w.name])[w.offset:w.offset + (r1 - r0) * (e1 - e0)]
            self.windows.append(((r0, r1, e0, e1), user.reshape(r1 - r0, e1 - e0)))

    def _block(self, a: int, b: int) -> tuple[tuple[str, int], tuple[int, int, int, int]]:
        """The key and block of the chunk whose span is ``[a, b)``."""
        spec = self.spec
        if spec.chunk_cols:
            i = spec.chunk_at(a)
            r0, r1, e0, e1 = block = spec.chunk_block(i)
        else:  # whole rows: the span is the rows (a group row's rows are elements); no spec calls per chunk
            row, band = self._row, self._band
            i, off = divmod(a, band) if band else (0, 0)
            r0, r1, e0, e1 = block = (a // row, b // row, 0, row) if row else (0, 0, 0, 0)
            if off or b % max(row, 1) or r1 != min(r0 + spec.chunk_rows, self._height):
                i = -1
        if i < 0 or (r1 - r0) * (e1 - e0) != b - a:
            raise ValueError(f"[{a}, {b}) is not the span of a chunk of tensor {spec.name!r}")
        return (spec.name, i), block

    def _overlaps(self, block: tuple[int, int, int, int]) -> Iterator[tuple[tuple[slice, slice], np.ndarray]]:
        """``(chunk part, user part)`` index pairs of every window overlapping ``block``."""
        r0, r1, e0, e1 = block
        for (wr0, wr1, we0, we1), user in self.windows:
            x0, x1, y0, y1 = max(r0, wr0), min(r1, wr1), max(e0, we0), min(e1, we1)
            if x0 < x1 and y0 < y1:
                yield (slice(x0 - r0, x1 - r0), slice(y0 - e0, y1 - e0)), user[x0 - wr0:x1 - wr0, y0 - we0:y1 - we0]

    def read(self, a: int, b: int) -> np.ndarray:
        key, block = self._block(a, b)
        sp = self.spare.get(key) if key in self.edges else None
        out = sp.copy() if sp is not None else np.zeros(b - a, dtype=self.spec.uint_dtype())
        chunk = out.reshape(block[1] - block[0], block[3] - block[2])
        for part, user in self._overlaps(block):
            chunk[part] = user
        return out

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        key, block = self._block(a, b)
        if key in self.edges:
            self.spare[key] = np.array(raw, copy=True)
        chunk = raw.reshape(block[1] - block[0], block[3] - block[2])
        for part, user in self._overlaps(block):
            user[...] = chunk[part]


class SliceView:
    """The aligned fast path of design 011 D5: a grid unit whose every chunk read spans exactly
    the window's columns (a column cut by a degree the grid was made for). Chunk ``(i, j)`` is
    then rows ``[r0, r1)`` of the user's slice, a contiguous span of it, so ``read`` returns a
    live view (``cpu = True``: the engine applies and hashes in place), with no gather and no
    spare bits kept."""

    cpu = True
    raw = None

    def __init__(self, spec: TensorSpec, window: Window, tensor: torch.Tensor):
        self.spec = spec
        self.rect = window.rect(spec.row_elems)
        self.offset = window.offset
        self.user = bits(tensor)  # the view holds the tensor's storage

    def _span(self, a: int, b: int) -> np.ndarray:
        i = self.spec.chunk_at(a)
        r0, r1, e0, e1 = self.spec.chunk_block(i)
        wr0, wr1, we0, we1 = self.rect
        if (e0, e1) != (we0, we1) or not wr0 <= r0 <= r1 <= wr1 or (r1 - r0) * (e1 - e0) != b - a:
            raise ValueError(f"chunk {i} of tensor {self.spec.name!r} (rows {r0}-{r1}, element columns {e0}-{e1}) "
                             f"is not a span of the slice (rows {wr0}-{wr1}, element columns {we0}-{we1})")
        x = self.offset + (r0 - wr0) * (e1 - e0)
        return self.user[x:x + b - a]

    def read(self, a: int, b: int) -> np.ndarray:
        return self._span(a, b)

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        view = self._span(a, b)
        if not np.shares_memory(view, raw):
            view[...] = raw


def slice_targets(units: Mapping[str, TensorSpec], res: Resolved, tensors: Mapping[str, torch.Tensor],
                  spare: dict[tuple[str, int], np.ndarray]) -> dict[str, SliceTarget | SliceView]:
    """One target per selected unit: a :class:`SliceView` for an aligned grid unit, else a
    :class:`SliceTarget`."""
    out: dict[str, SliceTarget | SliceView] = {}
    for u, ws in res.windows.items():
        if u in res.views:
            out[u] = SliceView(units[u], ws[0], tensors[ws[0].name])
        else:
            out[u] = SliceTarget(units[u], ws, tensors, spare, res.edges)
    return out
