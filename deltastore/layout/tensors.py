"""Torch glue: validating state dicts, their layout, chunking, and raw bit views.

This is the only module (with publish/pull, which call it) that knows about torch. The codec
sees 1-D unsigned-integer numpy views of a tensor's bits.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import math
import operator
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Self

import numpy as np
import torch
import xxhash

from deltastore._util import kernels
from deltastore._util.identity import IdentityCache
from deltastore.errors import InvalidStateDictError, LayoutMismatchError
from deltastore.format.models import DTYPE_WIDTHS, GroupMember, chunk_count

#: A chunk of about this size is the unit of change detection, encoding, threading and
#: partial reads: big enough that per-chunk overhead vanishes, small enough that a few chunks
#: in flight per thread keep memory bounded.
CHUNK_TARGET_BYTES = 16 * 1024 * 1024
#: The tensor-parallel degree to align chunk edges for when a publisher asks for it
#: (``Publisher(slice_align=SLICE_ALIGN)``): degrees 1, 2, 4 and 8 (rank r of N holds rows
#: [r·S//N, (r+1)·S//N), SPEC §8) then read only their own rows, since a chunk is the unit a
#: partial pull reads. Not the default: it multiplies the chunks of mid-sized tensors, several
#: times over for a whole model, and per-chunk costs with them (docs/scale.md §5).
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

#: The row-parallel weights of Llama, Qwen and Mistral models: tensor-parallel serving cuts
#: them along dimension 1 (columns), so ``Publisher(slice_align=N, column_slices=ROW_PARALLEL)``
#: gives them a column grid (design 011 D6) and
#: ``Selection(shard_dims=dict.fromkeys(ROW_PARALLEL, 1))`` cuts them the same way. Re-exported
#: as ``deltastore.layout.select.ROW_PARALLEL``.
ROW_PARALLEL: tuple[str, ...] = ("*.o_proj.weight", "*.down_proj.weight")

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
    """A tensor's layout: what must not change between an anchor and its deltas.

    With ``chunk_cols`` > 0 (a column grid, design 011 D1)
    chunk ``i·nc + j`` is row block i × column block j of the tensor, and the chunks' spans are
    in the tensor's *unit order*: its chunks back to back in index order, each in its own C
    order (:mod:`deltastore.layout.grid` converts). Without a grid, unit order is the natural order.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_rows: int
    #: a group row's tensors (design 007), in storage order; empty for a tensor.
    members: tuple[GroupMember, ...] = ()
    #: columns (of dimension 1) per chunk: 0 for whole rows.
    #: Checked where a grid's geometry is first asked (:meth:`n_colblocks`), not here: building
    #: specs stays cheap (a layout builds one per tensor); the layout check refuses an
    #: impossible grid before any spec is built from it.
    chunk_cols: int = 0

    # Cached (in the instance's __dict__, outside the fields that equality, hashing and
    # dataclasses.replace see): a pull plans and groups by chunk spans and sizes, hundreds of
    # calls per version, each of which would recompute these.
    @functools.cached_property
    def width(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def n_colblocks(self) -> int:
        """Column blocks per row block: ``ceil(shape[1] / chunk_cols)`` (at least 1), 1 without a grid."""
        k = self.chunk_cols
        if not k:
            return 1
        if k < 0 or len(self.shape) < 2 or self.members:
            raise ValueError(f"tensor {self.name!r} {list(self.shape)}: chunk_cols {k} "
                             "(a column grid needs a tensor of two or more dimensions and chunk_cols > 0)")
        return max(1, -(-self.shape[1] // k))

    @property
    def n_chunks(self) -> int:
        return chunk_count(self.shape, self.chunk_rows, self.chunk_cols)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_WIDTHS[self.dtype]

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of chunk ``index`` in the flattened tensor (for a
        grid tensor, in its unit order: design 011 D1)."""
        if not self.shape:
            return (0, 1)
        if self.chunk_cols:
            return self._grid_span(index)
        r0 = index * self.chunk_rows
        r1 = min(r0 + self.chunk_rows, self.shape[0])
        return (r0 * self.row_elems, r1 * self.row_elems)

    def _grid_span(self, index: int) -> tuple[int, int]:
        """011 D1's closed form: every chunk before (i, j) in unit order is a full row block
        (rows before r0) or a full-height column block of row block i (columns before c0)."""
        r0, r1, e0, e1 = self.chunk_block(index)
        a = r0 * self.row_elems + (r1 - r0) * e0
        return (a, a + (r1 - r0) * (e1 - e0))

    def chunk_block(self, index: int) -> tuple[int, int, int, int]:
        """``(r0, r1, e0, e1)``: chunk ``index`` holds rows ``[r0, r1)`` × element columns
        ``[e0, e1)`` of the tensor seen as ``(shape[0], row_elems)`` (an element column ``e`` is
        column ``e // inner`` of dimension 1, ``inner`` the trailing elements). Without a grid
        that is ``(r0, r1, 0, row_elems)``; a 0-d tensor is one row of one element."""
        if not self.shape:
            return (0, 1, 0, 1)
        k = self.chunk_cols
        i, j = divmod(index, self.n_colblocks) if k else (index, 0)  # n_colblocks checks the grid
        r0 = i * self.chunk_rows
        r1 = min(r0 + self.chunk_rows, self.shape[0])
        if not k:
            return (r0, r1, 0, self.row_elems)
        inner = math.prod(self.shape[2:])
        c0 = j * k
        c1 = min(c0 + k, self.shape[1])
        return (r0, r1, c0 * inner, c1 * inner)

    def chunk_at(self, start: int) -> int:
        """The index of the chunk whose span starts at element ``start`` (the inverse of
        :meth:`chunk_span`). Of empty chunks starting there, the first.

        Raises:
            ValueError: no chunk starts at ``start``.
        """
        i = self.chunk_containing(start) if 0 <= start <= self.numel else -1
        if i < 0 or self.chunk_span(i)[0] != start:
            raise ValueError(f"no chunk of tensor {self.name!r} starts at element {start}")
        return i

    def chunk_containing(self, pos: int) -> int:
        """The index of the chunk whose span holds element ``pos`` (in unit order), by two
        divisions: the row band, then the column block within it (whose height is the band's).
        A ``pos`` past the end gives the last chunk; an empty tensor's is chunk 0."""
        row = self.row_elems
        if not self.shape or not row or not self.shape[0]:
            return 0
        band = self.chunk_rows * row
        i = min(max(0, pos) // band, -(-self.shape[0] // self.chunk_rows) - 1)
        if not self.chunk_cols:
            return i
        nc = self.n_colblocks
        h = min(self.chunk_rows, self.shape[0] - i * self.chunk_rows)
        width = self.chunk_cols * (row // self.shape[1])  # element columns of a full column block
        return i * nc + min(max(0, pos - i * band) // (h * width), nc - 1)

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


def slice_chunk_cols(cols: int, inner: int, width: int, align: int = SLICE_ALIGN,
                     chunk_bytes: int = CHUNK_TARGET_BYTES) -> int:
    """The column-grid writer's ``chunk_cols`` (design 011 D6) for a tensor of ``cols`` columns
    of ``inner`` elements of ``width`` bytes, cut by columns among ``align`` ranks (mirroring
    :func:`slice_chunk_rows` over columns): ``cols/align`` when ``align`` divides ``cols`` (a
    rank's share: row pieces as long as possible); otherwise ``⌈⌊cols/align⌋/SLICE_EDGE_PARTS⌉``,
    so a rank reads at most 2/16 of its share beyond its columns per row block; in either case
    reduced to the largest divisor of that choice whose single-row block fits ``chunk_bytes``
    (only rows wider than ``chunk_bytes × align``). At least 1."""
    share = cols // max(1, align)
    k = share if share and cols % align == 0 else -(-share // SLICE_EDGE_PARTS)
    k = max(1, k)
    # the largest divisor of k whose single-row block fits: chunk_rows_for over columns
    return chunk_rows_for(max(1, inner * width), k, (k,), chunk_bytes)


def grid_spec_for(name: str, t: torch.Tensor, align: int, chunk_target_bytes: int = CHUNK_TARGET_BYTES) -> TensorSpec | None:
    """The column-grid layout of tensor ``t`` cut by columns among ``align`` ranks (design 011
    D6), or None when it gets no grid: fewer than 2 dimensions, fewer than ``align`` columns,
    at most ``align × SLICE_CHUNK_MIN_BYTES`` (a rank reads a small tensor whole), or one
    column block (``chunk_cols = shape[1]``: whole rows, written as 0). Rows per chunk then
    keep a chunk near the target (no row alignment: nobody cuts these tensors by rows)."""
    shape = tuple(t.shape)
    cols = grid_cols_for(shape, t.element_size(), align, chunk_target_bytes)
    if not cols:
        return None
    rows = chunk_rows_for(cols * math.prod(shape[2:]) * t.element_size(), shape[0], (), chunk_target_bytes)
    return TensorSpec(name, dtype_name(t.dtype), shape, rows, (), cols)


def grid_cols_for(shape: tuple[int, ...], width: int, align: int, chunk_target_bytes: int = CHUNK_TARGET_BYTES) -> int:
    """The ``chunk_cols`` :func:`grid_spec_for` gives a tensor of ``shape`` and element
    ``width`` bytes, or 0 when it gets no grid; from the global shape alone, so that the ranks
    of a sharded publisher, each holding some rows, choose alike (design 011 D11)."""
    if len(shape) < 2 or shape[1] < align or math.prod(shape) * width <= align * SLICE_CHUNK_MIN_BYTES:
        return 0
    cols = slice_chunk_cols(shape[1], math.prod(shape[2:]), width, align, chunk_target_bytes)
    return 0 if cols >= shape[1] else cols


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


class TensorScan:
    """Metadata of a list of tensors, read for all of them in one pass when first asked.

    Why: with thousands of group members, a Python loop reading an attribute per tensor costs
    bytecode and dict lookups per attribute besides torch's own getter; validate,
    check_layout and the member tables each read the same few attributes, so sharing one scan
    (see :class:`TensorDict`) reads each once per call. With the native kernels, one C pass
    reads every attribute of a tensor at once (``_native.scan_tensors``, through torch's own
    getters: the same values); without them, or for a tensor of another type, each attribute
    is read for all tensors in one C-level ``map`` over its getter. Never kept across calls:
    torch has no metadata version counter, so a tensor swapped, resized or moved since must be
    seen anew.
    """

    __slots__ = ("_contiguous", "_cpu", "_dims", "_dtypes", "_meta", "_native", "_ndims", "_ptrs", "_strided", "tensors")

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self._native: bool | None = None  # None: not tried yet
        self._dtypes: list[torch.dtype] | None = None
        self._strided: np.ndarray | None = None
        self._cpu: np.ndarray | None = None
        self._contiguous: np.ndarray | None = None
        self._meta: np.ndarray | None = None
        self._ptrs: np.ndarray | None = None
        self._ndims: np.ndarray | None = None  # with the native scan: int64 rank per tensor
        self._dims: np.ndarray | None = None  # ... and the tensors' sizes, concatenated (see shape_code)

    def __len__(self) -> int:
        return len(self.tensors)

    def _read_native(self) -> bool:
        """Fill every attribute in one native pass (tried once); False when the kernel is
        absent or declined (a tensor of another type, a getter that raised)."""
        if self._native is None:
            self._native = False
            kernel = kernels.scan_tensors
            if kernel is not None and _SCAN_ARGS is not None and type(self.tensors) is list:
                got = kernel(self.tensors, *_SCAN_ARGS)
                if got is not None:
                    dtypes, flags, ptrs, ndims, dims = got
                    f = np.frombuffer(flags, dtype=np.uint8)
                    self._dtypes = dtypes
                    self._strided = (f & _FLAG_STRIDED) != 0
                    self._cpu = (f & _FLAG_CPU) != 0
                    self._contiguous = (f & _FLAG_CONTIGUOUS) != 0
                    self._meta = (f & _FLAG_META) != 0
                    self._ptrs = np.frombuffer(ptrs, dtype=np.uint64)
                    self._ndims = np.frombuffer(ndims, dtype=np.int64)
                    self._dims = np.frombuffer(dims, dtype=np.int64)
                    self._native = True
        return self._native

    @property
    def dtypes(self) -> list[torch.dtype]:
        if self._dtypes is None and not self._read_native():
            self._dtypes = list(map(_DTYPE, self.tensors))
        assert self._dtypes is not None
        return self._dtypes

    def shapes_equal(self, shapes: list[tuple[int, ...]], code: ShapeCode | None = None) -> bool:
        """Whether the tensors' shapes are ``shapes``, in order (``code``: the same shapes as
        :func:`shape_code` encodes them, compared as two arrays with the native scan). Each
        ``torch.Size`` is compared and freed at once: a list of thousands of them, held, makes
        the cyclic collector run (and promote them) several times per call (design 006, "The
        cyclic collector")."""
        if len(shapes) != len(self.tensors):
            return False
        if code is not None and self._read_native():
            return np.array_equal(self._ndims, code[0]) and np.array_equal(self._dims, code[1])
        return all(map(operator.eq, map(_SHAPE, self.tensors), shapes))

    @property
    def strided(self) -> np.ndarray:
        """bool per tensor: ``layout`` is ``torch.strided`` (dense)."""
        if self._strided is None and not self._read_native():
            self._strided = np.fromiter(map(operator.is_, map(_LAYOUT, self.tensors), itertools.repeat(torch.strided)),
                                        dtype=bool, count=len(self.tensors))
        assert self._strided is not None
        return self._strided

    @property
    def cpu(self) -> np.ndarray:
        """bool per tensor: on the CPU."""
        if self._cpu is None and not self._read_native():
            self._cpu = np.fromiter(map(_IS_CPU, self.tensors), dtype=bool, count=len(self.tensors))
        assert self._cpu is not None
        return self._cpu

    @property
    def meta(self) -> np.ndarray:
        """bool per tensor: on the meta device (no data)."""
        if self._meta is None and not self._read_native():
            self._meta = np.fromiter(map(_IS_META, self.tensors), dtype=bool, count=len(self.tensors))
        assert self._meta is not None
        return self._meta

    @property
    def contiguous(self) -> np.ndarray:
        """bool per tensor: ``is_contiguous()``."""
        if self._contiguous is None and not self._read_native():
            self._contiguous = np.fromiter(map(torch.Tensor.is_contiguous, self.tensors), dtype=bool, count=len(self.tensors))
        assert self._contiguous is not None
        return self._contiguous

    @property
    def ptrs(self) -> np.ndarray:
        """uint64 ``data_ptr()`` per tensor (a host address only where :attr:`cpu`). Only for
        strided tensors (a sparse tensor's ``data_ptr()`` raises; the native scan says 0)."""
        if self._ptrs is None and not self._read_native():
            self._ptrs = np.fromiter(map(torch.Tensor.data_ptr, self.tensors), dtype=np.uint64, count=len(self.tensors))
        assert self._ptrs is not None
        return self._ptrs


#: ``(ndims, dims)``: int64 rank per shape, and every shape's sizes concatenated (int64).
ShapeCode = tuple[np.ndarray, np.ndarray]


def shape_code(shapes: Sequence[tuple[int, ...]]) -> ShapeCode:
    """``shapes`` encoded as the native scan reports a list of tensors' shapes (two int64
    arrays; equal arrays mean equal shapes, since the ranks say where each shape ends)."""
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    dims = np.fromiter((d for sh in shapes for d in sh), dtype=np.int64, count=int(ndims.sum()))
    return ndims, dims


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")
_IS_META = operator.attrgetter("is_meta")
_LAYOUT = operator.attrgetter("layout")

#: The native scan's flag bits per tensor (deltastore/_native/groups.c, ``scan_tensors``).
_FLAG_STRIDED, _FLAG_CPU, _FLAG_CONTIGUOUS, _FLAG_META = 1, 2, 4, 8
#: The attributes the native scan reads, in the order it takes their descriptors.
_SCAN_ATTRS = ("layout", "dtype", "is_cpu", "is_contiguous", "shape", "data_ptr", "is_meta")


def _scan_args() -> tuple[tuple[type, ...], Any, tuple[Any, ...]] | None:
    """``(types, torch.strided, descriptors)`` for ``_native.scan_tensors``, or None (then the
    scan reads in Python). The descriptors are torch's getters of :data:`_SCAN_ATTRS` on its
    tensor base class; only types on which attribute lookup finds exactly those descriptors
    (no Python-level override) are read natively, so the values are what ``getattr`` gives."""
    base = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase", None)
    types = (torch.Tensor, torch.nn.Parameter)
    if base is None:
        return None
    descrs = []
    for name in _SCAN_ATTRS:
        d = base.__dict__.get(name)
        if d is None or any(inspect.getattr_static(tp, name, None) is not d for tp in types):
            return None
        descrs.append(d)
    return types, torch.strided, tuple(descrs)


_SCAN_ARGS = _scan_args()


class TensorDict(dict):
    """The dict :func:`validate_state_dict` (and :func:`deltastore.read.targets.target_tensors`) return: a plain
    ``dict[str, Tensor]`` that also carries the :class:`TensorScan` of its values made for the
    checks, so that check_layout and the member tables of the same call reuse it. Any change
    to the dict drops the scan (it then no longer describes the values)."""

    _scan: tuple[list[str], TensorScan] | None = None

    def __init__(self, items: Any = (), scan: tuple[list[str], TensorScan] | None = None):
        super().__init__(items)
        self._scan = scan

    def __reduce__(self) -> Any:  # pickles as a plain dict (a scan holds no state worth keeping)
        return (dict, (dict(self),))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._scan = None
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._scan = None
        super().__delitem__(key)

    def __ior__(self, other: Any) -> Self:
        self._scan = None
        return super().__ior__(other)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._scan = None
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._scan = None
        return super().setdefault(key, default)

    def pop(self, *args: Any) -> Any:
        self._scan = None
        return super().pop(*args)

    def popitem(self) -> Any:
        self._scan = None
        return super().popitem()

    def clear(self) -> None:
        self._scan = None
        super().clear()


def scan_of(state: Mapping[str, torch.Tensor], names: list[str]) -> TensorScan | None:
    """A :class:`TensorScan` of ``state``'s tensors in the order of ``names`` (None when one
    of ``names`` is not in ``state``): the one ``state`` carries when it is a
    :class:`TensorDict` scanned in that order, else a new one (remembered on a TensorDict)."""
    held = state._scan if isinstance(state, TensorDict) else None
    if held is not None and len(state) == len(names) and (held[0] is names or held[0] == names):
        if held[0] is not names:
            state._scan = (names, held[1])  # the next caller with this layout matches by identity
        return held[1]
    try:
        sc = TensorScan(list(map(state.__getitem__, names)))
    except KeyError:
        return None
    if isinstance(state, TensorDict):
        state._scan = (names, sc)
    return sc


def validate_state_dict(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Check that ``state`` can be published; return it as a plain dict of CPU-able tensors
    (a :class:`TensorDict`, carrying the scan the checks made).

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
    # The checks run over all tensors at once (TensorScan); only when one fails does the
    # per-tensor loop run, to name the first bad tensor.
    names, values = list(state), list(state.values())
    if set(map(type, names)) == {str} and "" not in state and all(issubclass(tp, torch.Tensor) for tp in set(map(type, values))):
        sc = TensorScan(values)
        if (sc.strided.all() and all(map(_dtype_ok, set(sc.dtypes)))
                and sc.contiguous.all() and (sc.cpu.all() or not sc.meta.any())):
            # a dict is copied whole (much faster than pairs from zip)
            return TensorDict(state if type(state) is dict else zip(names, values), (names, sc))
    out = _validate_each(state)
    return TensorDict(out, None)


def _dtype_ok(dt: torch.dtype) -> bool:
    """Whether tensors of ``dt`` can be stored (every such name in DTYPE_WIDTHS is of a
    1-, 2-, 4- or 8-byte, non-quantized dtype; the itemsize check guards a torch that differs)."""
    return dtype_name(dt) in DTYPE_WIDTHS and dt.itemsize in _UINT_BY_WIDTH


def _dtype_problem(name: str, t: torch.Tensor) -> str | None:
    """Why tensor ``name`` (``t``) cannot be stored for its dtype, or None."""
    if t.is_quantized or t.is_complex() and t.element_size() not in _UINT_BY_WIDTH:
        return f"tensor {name!r} has unsupported dtype {t.dtype}"
    if t.element_size() not in _UINT_BY_WIDTH:
        return f"tensor {name!r} has dtype {t.dtype} of {t.element_size()} bytes; deltastore stores 1-, 2-, 4- and 8-byte elements"
    if dtype_name(t.dtype) not in DTYPE_WIDTHS:  # readers refuse any other dtype name
        return f"tensor {name!r} has dtype {t.dtype}, which deltastore does not store"
    return None


def _validate_each(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The per-tensor checks of :func:`validate_state_dict`, raising for the first bad tensor."""
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
        if t.dtype not in dtypes_ok:
            problem = _dtype_problem(name, t)
            if problem is not None:
                raise InvalidStateDictError(problem)
            dtypes_ok.add(t.dtype)
        if not t.is_contiguous():
            raise InvalidStateDictError(f"tensor {name!r} is not contiguous; pass .contiguous() (deltastore never copies silently)")
        if t.is_meta:  # not t.device.type: that makes a device object per tensor
            raise InvalidStateDictError(f"tensor {name!r} is on the meta device and has no data")
        out[name] = t
    return out


@dataclass(frozen=True)
class LayoutTables:
    """A layout's tensors as the user sees them (group members in place of their rows), as
    parallel lists in layout order, for the one-pass checks of :func:`check_layout`."""

    names: list[str]
    dtypes: list[torch.dtype | None]  # None: a dtype this torch lacks (never matches)
    shapes: list[tuple[int, ...]]
    #: ``shapes`` as :func:`shape_code` encodes them (for :meth:`TensorScan.shapes_equal`)
    shapes_code: ShapeCode
    #: per unit, ``[lo, hi)`` of its tensors (a group row: its members) in the lists above
    spans: dict[str, tuple[int, int]]


#: Tables kept per layout, while its unit specs live (by the identity of its first unit; every
#: unit is checked through a weak reference): a publisher or subscriber checks every version
#: against the same layout objects.
_tables: IdentityCache[tuple[tuple[weakref.ref, ...], LayoutTables]] = IdentityCache()


def layout_tables(specs: Mapping[str, TensorSpec]) -> LayoutTables:
    """The :class:`LayoutTables` of ``specs`` (cached per layout: O(units) to find)."""
    units = tuple(specs.values())
    hit = _tables.get(units[0]) if units else None
    if (hit is not None and len(hit[0]) == len(units) and all(r() is u for r, u in zip(hit[0], units))
            and list(specs) == [s.name for s in units]):
        return hit[1]
    names: list[str] = []
    dtypes: list[torch.dtype | None] = []
    shapes: list[tuple[int, ...]] = []
    spans: dict[str, tuple[int, int]] = {}
    by_name: dict[str, torch.dtype | None] = {}
    for key_name, s in specs.items():
        lo = len(names)
        for e in s.members or (s,):
            names.append(e.name)
            if e.dtype not in by_name:
                try:
                    by_name[e.dtype] = torch_dtype(e.dtype)
                except InvalidStateDictError:
                    by_name[e.dtype] = None
            dtypes.append(by_name[e.dtype])
            shapes.append(tuple(e.shape))
        spans[key_name] = (lo, len(names))
    tables = LayoutTables(names, dtypes, shapes, shape_code(shapes), spans)
    if units:
        _tables.put(units[0], (tuple(weakref.ref(u) for u in units), tables))
    return tables


def check_layout(specs: Mapping[str, TensorSpec], state: Mapping[str, torch.Tensor], *, against: str) -> TensorScan:
    """Raise LayoutMismatchError naming the first tensor whose name, dtype or shape differ;
    return the :class:`TensorScan` of ``state`` in layout order (:func:`layout_tables`).

    ``specs`` may hold group rows (design 007): their members are what ``state`` must hold."""
    tables = layout_tables(specs)
    if len(state) == len(tables.names):
        sc = scan_of(state, tables.names)
        # element by element in C (torch.Size is a tuple; a dtype a singleton)
        if sc is not None and sc.dtypes == tables.dtypes and sc.shapes_equal(tables.shapes, tables.shapes_code):
            return sc
    _check_each(specs, state, against=against)
    sc = scan_of(state, tables.names)
    assert sc is not None  # _check_each found every name
    return sc


def _check_each(specs: Mapping[str, TensorSpec], state: Mapping[str, torch.Tensor], *, against: str) -> None:
    """The per-tensor checks of :func:`check_layout`, raising for the first mismatch."""
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
    """A 1-D unsigned-integer numpy view of a contiguous CPU tensor's bits (no copy).

    The view keeps ``t``'s storage alive. A plain dense CPU tensor is viewed through its address
    (a ctypes array that holds the storage), cheaper than four torch calls and ``numpy()``, with
    no short-lived tensors for the collector (the publisher views every unit's reference on
    each call). Anything else (a subclass, a conjugate or negative view, another device, no
    elements) goes through torch, which copies a non-contiguous tensor or raises.
    """
    w = t.element_size()
    n = t.numel()
    if (type(t) in _PLAIN_TYPES and n and t.is_cpu and t.layout is torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and w in _CTYPES_BY_WIDTH):
        raw = (_CTYPES_BY_WIDTH[w] * n).from_address(t.data_ptr())
        # keep the memory alive with the view: t's storage, not t (t.set_() may give t another
        # storage and free this one; torch's own numpy() view holds the storage the same way)
        raw._owner = t.untyped_storage()
        return np.frombuffer(raw, dtype=_UINT_BY_WIDTH[w])
    flat = t.detach().reshape(-1)
    return flat.view(_TORCH_INT_BY_WIDTH[w]).numpy().view(_UINT_BY_WIDTH[w])


_CTYPES_BY_WIDTH = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}
#: Tensor types whose ``data_ptr()`` is the memory ``numpy()`` would view (no Python overrides).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def state_digest(raw: np.ndarray) -> str:
    """XXH3-128 hex of an array's raw bytes (SPEC §2, state digests)."""
    buf = memoryview(np.ascontiguousarray(raw)).cast("B")
    if kernels.xxh3_128_hex is not None:  # same digest, without holding the GIL
        return kernels.xxh3_128_hex(buf)
    return xxhash.xxh3_128_hexdigest(buf)


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
