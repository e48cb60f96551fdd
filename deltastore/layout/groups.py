"""Tensor groups (design 007, SPEC §2 *Groups*): many small tensors share one layout row.

The core (plan, compact, gc, history, the read engine's planner) sees *units*: tensors and
group rows, each chunked like a tensor. This module is the only one that knows both views:

- :func:`group_specs` is the publisher's policy: which tensors share a row;
- :func:`gather` reads a group chunk's elements out of its members (publish);
- :class:`GroupTarget` reads and writes a group's element ranges over the member tensors of a
  pull target, with the read engine's ``read``/``write`` interface (pull);
- :func:`member_overlaps` names the members a span of a group row covers (what a pull changed,
  and a staged patch split into its members' patches: ``deltastore.read.stage.split_patch``);
- :func:`unit_reference` builds the publisher's reference copy, one buffer per group.

``deltastore.layout.tensors.member_specs`` is the inverse view (units → the tensors users see).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from deltastore._util import kernels
from deltastore._util.identity import IdentityCache
from deltastore.format.models import DTYPE_WIDTHS, GroupMember
from deltastore.layout import grid
from deltastore.layout.tensors import (
    CHUNK_TARGET_BYTES,
    LayoutTables,
    TensorScan,
    TensorSpec,
    bits,
    layout_tables,
    scan_of,
    torch_dtype,
)

logger = logging.getLogger(__name__)

#: Tensors of at most this many bytes are grouped: above it, a tensor's own per-chunk costs are
#: a small part of coding its bytes, and grouping would only coarsen changes (design 007).
GROUP_MEMBER_MAX_BYTES = 256 * 1024
#: A group closes once it holds this many bytes (one chunk of the default 16 MiB target): a
#: chunk's fixed costs on both sides (segment, entry, plan, hand-off) are then paid per 4 MiB,
#: while a group touched by one changed norm costs one pass over 4 MiB, not over 16 MiB; smaller
#: groups pay the fixed costs more often (design 007).
GROUP_TARGET_BYTES = 4 * 1024 * 1024
#: Prefix of the names the publisher gives group rows (more ``#`` until no tensor has it).
GROUP_NAME_PREFIX = "#group/"

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CTYPES = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _groupable(spec: TensorSpec) -> bool:
    return 0 < spec.nbytes <= GROUP_MEMBER_MAX_BYTES


def group_specs(specs: Mapping[str, TensorSpec], chunk_target_bytes: int = CHUNK_TARGET_BYTES, *,
                exclude: frozenset[str] = frozenset()) -> dict[str, TensorSpec]:
    """The publisher's units: small tensors (≤ GROUP_MEMBER_MAX_BYTES, non-empty) of one dtype
    packed, in ``specs`` order, into group rows of about GROUP_TARGET_BYTES; every other tensor
    (and those in ``exclude``: tied tensors, see :func:`tied_names`) as it is. A group row
    stands where its first member stood; a dtype with a single small tensor left over gets no
    group of one."""
    prefix = GROUP_NAME_PREFIX
    while any(n.startswith(prefix) for n in specs):
        prefix = "#" + prefix
    # First pass: assign members to groups per dtype (a group closes when full).
    open_: dict[str, list[TensorSpec]] = {}
    filled: dict[str, int] = {}  # bytes in each open group (a running sum: O(1) per member)
    closed: list[list[TensorSpec]] = []
    for s in specs.values():
        if not _groupable(s) or s.name in exclude:
            continue
        members = open_.setdefault(s.dtype, [])
        members.append(s)
        filled[s.dtype] = filled.get(s.dtype, 0) + s.nbytes
        if filled[s.dtype] >= GROUP_TARGET_BYTES:
            closed.append(members)
            open_[s.dtype] = []
            filled[s.dtype] = 0
    closed.extend(m for m in open_.values() if m)
    position = {n: i for i, n in enumerate(specs)}
    group_of: dict[str, int] = {}
    for gi, members in enumerate(sorted((g for g in closed if len(g) > 1), key=lambda g: position[g[0].name])):
        for m in members:
            group_of[m.name] = gi
    if not group_of:
        return dict(specs)
    # Second pass: units in layout order, each group at its first member's position.
    rows: dict[int, list[TensorSpec]] = {}
    out: dict[str, TensorSpec] = {}
    for name, s in specs.items():
        gi = group_of.get(name)
        if gi is None:
            out[name] = s
            continue
        if gi not in rows:
            rows[gi] = []
            out[f"{prefix}{gi}"] = s  # placeholder, replaced below (keeps the position)
        rows[gi].append(s)
    for gi, members in rows.items():
        name = f"{prefix}{gi}"
        out[name] = _group_spec(name, members, chunk_target_bytes)
    return out


def tied_names(state: Mapping[str, torch.Tensor], max_bytes: int | None = GROUP_MEMBER_MAX_BYTES) -> frozenset[str]:
    """Tensors of at most ``max_bytes`` (None: any size) that share memory with another tensor
    of ``state`` (tied weights). They stay ungrouped (and without a column grid): the read
    engine updates a tied tensor once, by its owner, which a group holding one half of a tie
    cannot do (its other half would be replayed twice), nor a grid on one half only."""
    seen: dict[tuple[str, int, int], str] = {}
    tied: set[str] = set()
    for name, t in state.items():
        if max_bytes is not None and t.numel() * t.element_size() > max_bytes:
            continue
        k = (t.device.type, t.data_ptr(), t.numel())
        if k in seen and t.numel():
            tied.update((name, seen[k]))
        seen.setdefault(k, name)
    return frozenset(tied)


def _group_spec(name: str, members: list[TensorSpec], chunk_target_bytes: int) -> TensorSpec:
    dtype = members[0].dtype
    out, offset = [], 0
    for m in members:
        out.append(GroupMember(m.name, dtype, m.shape, offset))
        offset += m.numel
    per_chunk = max(1, chunk_target_bytes // DTYPE_WIDTHS[dtype])
    return TensorSpec(name, dtype, (offset,), min(per_chunk, offset), tuple(out))


def member_overlaps(spec: TensorSpec, a: int, b: int) -> list[tuple[GroupMember, int, int]]:
    """``(member, lo, hi)`` for each member of group ``spec`` overlapping its elements
    ``[a, b)``, with ``[lo, hi)`` the overlap in group coordinates."""
    return _overlapping(spec, _starts(spec), a, b)


def _starts(spec: TensorSpec) -> list[int]:
    return [m.offset for m in spec.members]


def _overlapping(spec: TensorSpec, starts: list[int], a: int, b: int) -> list[tuple[GroupMember, int, int]]:
    """``(member, lo, hi)`` for each member overlapping elements ``[a, b)`` of the group, with
    ``[lo, hi)`` the overlap in group coordinates."""
    out = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    members = spec.members
    while i < len(members) and members[i].offset < b:
        m = members[i]
        lo, hi = max(a, m.offset), min(b, m.offset + m.numel)
        if lo < hi:
            out.append((m, lo, hi))
        i += 1
    return out


def gather(spec: TensorSpec, member_bits: Callable[[str, int, int], np.ndarray], a: int, b: int,
           starts: list[int] | None = None) -> np.ndarray:
    """Elements ``[a, b)`` of group ``spec``: its members' bits concatenated (a new array).

    ``member_bits(name, lo, hi)`` returns elements ``[lo, hi)`` of member ``name``'s flat bits.
    """
    out = np.empty(b - a, dtype=_UINT[DTYPE_WIDTHS[spec.dtype]])
    for m, lo, hi in _overlapping(spec, starts if starts is not None else _starts(spec), a, b):
        out[lo - a:hi - a] = member_bits(m.name, lo - m.offset, hi - m.offset)
    return out


#: Member offsets kept per group spec while it lives (by identity; a publisher or subscriber
#: reuses its specs for every version of a layout).
_starts_cache: IdentityCache[np.ndarray] = IdentityCache()


def member_starts(spec: TensorSpec) -> np.ndarray:
    """int64 ``[offset_0, …, offset_{k-1}, n]`` of group ``spec``: member i holds elements
    ``[starts[i], starts[i+1])``. Cached per spec object (the offsets never change for it)."""
    hit = _starts_cache.get(spec)
    if hit is not None:
        return hit
    starts = np.fromiter((m.offset for m in spec.members), dtype=np.int64, count=len(spec.members))
    return _starts_cache.put(spec, np.append(starts, np.int64(spec.numel)))


def member_pointers(spec: TensorSpec, ts: list[torch.Tensor], *, contiguous: bool = False) -> np.ndarray | None:
    """uint64 host addresses of ``spec``'s member tensors ``ts`` (in member order), or None
    unless every one is a contiguous CPU tensor (then gather/scatter go through
    :func:`copy_members`). The caller has checked the members' shapes and dtypes against the
    layout (and their contiguity, if it says ``contiguous``: validate_state_dict does), and
    holds the tensors while the addresses are used."""
    if not all(t.is_cpu for t in ts) or not (contiguous or all(t.is_contiguous() for t in ts)):
        return None
    return np.fromiter((t.data_ptr() for t in ts), dtype=np.uint64, count=len(ts))


class MemberTable:
    """A group row's member tensors (in member order) in a pull target or a published state,
    with their host addresses when every one is a contiguous CPU tensor (else ``ptrs`` is
    None), and whether they lie back to back as one row (``span``: see :func:`_span`).

    ``owner`` holds the members alive (the scan's list of all tensors, shared by every row:
    no list per row for the collector to walk); :attr:`tensors` slices this row's members."""

    __slots__ = ("_hi", "_lo", "owner", "ptrs", "span")

    def __init__(self, owner: list[torch.Tensor], lo: int, hi: int, ptrs: np.ndarray | None, span: bool):
        self.owner = owner
        self._lo, self._hi = lo, hi
        self.ptrs = ptrs
        self.span = span

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.owner[self._lo:self._hi]


#: Per layout (by its LayoutTables object, which tensors.layout_tables keeps while the layout
#: is in use), while it lives: the group rows' entries in the layout's member order, to check
#: every group's addresses in a few array operations instead of a few per group.
_group_index: IdentityCache[tuple[list[tuple[str, int, int]], np.ndarray, np.ndarray, np.ndarray]] = IdentityCache()


def _groups_of(specs: Mapping[str, TensorSpec], tables: LayoutTables) -> tuple[list[tuple[str, int, int]], np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, sel, first, byte_offsets)``: each group row's ``(name, lo, hi)`` in the layout
    tables, the tables' indices of all members (row by row), the index in ``sel`` where each
    row starts, and each member's byte offset in its row."""
    hit = _group_index.get(tables)
    if hit is not None:
        return hit
    rows = [(name, *tables.spans[name]) for name, s in specs.items() if s.members]
    sel = np.concatenate([np.arange(lo, hi, dtype=np.int64) for _, lo, hi in rows]) if rows else np.zeros(0, np.int64)
    first = np.cumsum([0] + [hi - lo for _, lo, hi in rows[:-1]], dtype=np.int64) if rows else np.zeros(0, np.int64)
    byte_offsets = np.concatenate(
        [member_starts(specs[name])[:-1].astype(np.uint64) * np.uint64(DTYPE_WIDTHS[specs[name].dtype]) for name, _, _ in rows]
    ) if rows else np.zeros(0, np.uint64)
    return _group_index.put(tables, (rows, sel, first, byte_offsets))


def member_tables(specs: Mapping[str, TensorSpec], state: Mapping[str, torch.Tensor],
                  scan: TensorScan | None = None) -> dict[str, MemberTable] | None:
    """A :class:`MemberTable` per group row of ``specs``, of ``state``'s tensors; None when
    ``state`` lacks a tensor of the layout.

    One pass over all members (a :class:`~deltastore.layout.tensors.TensorScan` in layout order:
    ``scan``, or the one ``state`` carries, or a new one), not one per group. The caller has
    checked the tensors' shapes and dtypes against the layout (check_layout) in this call, and
    holds the tensors while the addresses are used."""
    tables = layout_tables(specs)
    if scan is None:
        scan = scan_of(state, tables.names)
        if scan is None:
            return None
    rows, sel, first, byte_offsets = _groups_of(specs, tables)
    out: dict[str, MemberTable] = {}
    if not rows:
        return out
    host = scan.cpu[sel] & scan.contiguous[sel]
    # per row: every member a contiguous CPU tensor; and at base + offset × width (one span)
    host_row = np.logical_and.reduceat(host, first)
    span_row = np.zeros(len(rows), dtype=bool)
    if host_row.any():
        ptrs = scan.ptrs[sel]  # ptrs: one pass over all members, at first use
        base = np.repeat(ptrs[first], np.diff(np.append(first, len(sel))))
        span_row = np.logical_and.reduceat(ptrs - base == byte_offsets, first) & host_row
    for r, (name, lo, hi) in enumerate(rows):
        if host_row[r]:
            out[name] = MemberTable(scan.tensors, lo, hi, ptrs[first[r]:first[r] + hi - lo], bool(span_row[r]))
        else:
            out[name] = MemberTable(scan.tensors, lo, hi, None, False)
    return out


def copy_members(row: np.ndarray, ptrs: np.ndarray, starts: np.ndarray, a: int, *, to_row: bool) -> None:
    """Copy elements ``[a, a + row.size)`` of a group between ``row`` and its members (at
    ``ptrs``, see :func:`member_pointers`): ``to_row`` gathers into ``row``, else scatters
    ``row`` into the members. One native call per range; the numpy fallback copies the same
    bytes member by member (tests/layout/test_groups.py compares them)."""
    width = row.dtype.itemsize
    kernel = kernels.gather_members if to_row else kernels.scatter_members
    if kernel is not None:
        kernel(row, ptrs, starts, width, a)
        return
    b = a + row.size
    if a < 0 or b > int(starts[-1]):
        raise ValueError(f"elements [{a}, {b}) are outside the group's {int(starts[-1])}")
    i = max(0, int(np.searchsorted(starts, a, side="right")) - 1)
    while i < len(ptrs) and starts[i] < b:
        lo, hi = max(a, int(starts[i])), min(b, int(starts[i + 1]))
        if lo < hi:
            member = np.frombuffer((ctypes.c_uint8 * ((hi - lo) * width)).from_address(int(ptrs[i]) + (lo - int(starts[i])) * width),
                                   dtype=row.dtype)
            if to_row:
                row[lo - a:hi - a] = member
            else:
                member[...] = row[lo - a:hi - a]
        i += 1


def host_bits(t: torch.Tensor) -> np.ndarray:
    """A 1-D unsigned view of a contiguous CPU tensor's bits, like ``tensors.bits`` but several
    times cheaper per call: a group has thousands of members.

    The array does not keep ``t`` alive: the caller MUST hold ``t`` while it uses the array
    (every caller here keeps the tensor next to the view). Falls back to ``bits`` for anything
    else (a device tensor: ``bits`` raises).
    """
    n = t.numel()
    if t.device.type != "cpu" or not t.is_contiguous() or n == 0:
        return bits(t)
    w = t.element_size()
    return np.frombuffer((_CTYPES[w] * n).from_address(t.data_ptr()), dtype=_UINT[w])


class _HostView:
    """Live bits of a pull target's CPU memory, held with what owns it: a member tensor
    (``host_bits`` of it), or the members of a group lying back to back in member order (as
    ``pull`` allocates them: one view over the whole row, as fast as a tensor's, no gather or
    scatter)."""

    cpu = True

    def __init__(self, owner: Any, raw: np.ndarray):
        self.owner = owner  # keeps the memory of ``raw`` alive
        self.raw = raw

    def read(self, a: int, b: int) -> np.ndarray:
        return self.raw[a:b]

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        view = self.raw[a:b]
        if not np.shares_memory(view, raw):
            view[...] = raw


def _span(spec: TensorSpec, ts: list[torch.Tensor], ptrs: np.ndarray) -> _HostView | None:
    """A :class:`_HostView` over the whole row when ``spec``'s members (of the layout's shapes, checked before;
    contiguous CPU tensors at ``ptrs``) lie at addresses base + offset × width: then the
    members' own memory covers exactly [base, base + n × width), and one view over it is as
    safe as theirs."""
    w = DTYPE_WIDTHS[spec.dtype]
    if not np.array_equal(ptrs - ptrs[0], member_starts(spec)[:-1].astype(np.uint64) * np.uint64(w)):
        return None
    return _span_view(spec, ts, ptrs)


def _span_view(spec: TensorSpec, ts: list[torch.Tensor], ptrs: np.ndarray) -> _HostView:
    """The :class:`_HostView` of :func:`_span`, once the addresses were checked (``ts`` holds
    the members, whose memory the view covers)."""
    w = DTYPE_WIDTHS[spec.dtype]
    return _HostView(ts, np.frombuffer((_CTYPES[w] * spec.numel).from_address(int(ptrs[0])), dtype=_UINT[w]))


class _HostGroup:
    """A group whose members are contiguous CPU tensors anywhere in memory (a model's own
    parameters): ``read`` gathers a copy of an element range and ``write`` scatters one, each in
    one native call over the members' addresses (:func:`copy_members`). Never a live view
    (``cpu`` is False), so the read engine writes back what it changed."""

    cpu = False
    raw = None

    def __init__(self, spec: TensorSpec, ts: list[torch.Tensor], ptrs: np.ndarray):
        self.tensors = ts  # keep the memory at ``ptrs`` alive
        self.ptrs = ptrs
        self.starts = member_starts(spec)
        self.dtype = _UINT[DTYPE_WIDTHS[spec.dtype]]

    def read(self, a: int, b: int) -> np.ndarray:
        out = np.empty(b - a, dtype=self.dtype)
        copy_members(out, self.ptrs, self.starts, a, to_row=True)
        return out

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        copy_members(np.ascontiguousarray(raw, dtype=self.dtype), self.ptrs, self.starts, a, to_row=False)


#: Byte alignment of each tensor carved from a caller's buffer (:func:`carve`): a cache line,
#: and a multiple of every element size.
CARVE_ALIGN = 64


def carve(units: list[tuple[torch.dtype, int]], into: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """1-D tensors of ``units`` (dtype, element count), back to back in one buffer: ``into(n)``
    is called once with the bytes they need (each unit at a multiple of :data:`CARVE_ALIGN`)
    and returns a contiguous 1-D ``uint8`` tensor of at least ``n`` elements (shared memory,
    pinned memory, a ``meta`` tensor to learn the offsets). Its bytes are left as they are.

    Raises:
        ValueError: ``into`` returned something else.
    """
    offsets, end = [], 0
    for dt, n in units:
        offsets.append(end)
        end += -(-n * dt.itemsize // CARVE_ALIGN) * CARVE_ALIGN
    buf = into(end)
    if (not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous()
            or buf.numel() < end):
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(f"a buffer to carve {end} bytes from must be a contiguous 1-D uint8 tensor of at least "
                         f"{end} elements, not {got}")
    return [buf[o:o + n * dt.itemsize].view(dt) for (dt, n), o in zip(units, offsets)]


def allocate_members(specs: Mapping[str, TensorSpec], dtype_of: Callable[[str], torch.dtype], *,
                     zeros: bool = False, into: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """New CPU tensors for every tensor of ``specs`` (units); a group's members are views of
    one buffer per group, back to back (so the read engine writes the group in place, see
    :class:`_HostView`): like a flattened parameter, each member is a tensor of its own shape
    sharing one storage with its group's other members. ``into``: carve every unit from the
    one buffer it returns instead (:func:`carve`; ``zeros`` then does not apply)."""
    units = list(specs.values())
    if into is not None:
        flat = carve([(dtype_of(s.dtype), s.numel) for s in units], into)
    else:
        new = torch.zeros if zeros else torch.empty
        flat = [new(s.numel, dtype=dtype_of(s.dtype)) for s in units]
    out: dict[str, torch.Tensor] = {}
    for (name, s), buf in zip(specs.items(), flat):
        if not s.members:
            out[name] = buf.view(s.shape)
            continue
        for m in s.members:
            out[m.name] = buf[m.offset:m.offset + m.numel].view(m.shape)
    return out


class _Raw(Protocol):
    cpu: bool

    def read(self, a: int, b: int) -> np.ndarray: ...

    def write(self, a: int, b: int, raw: np.ndarray) -> None: ...


class GroupTarget:
    """A group row over the member tensors of a pull target: ``read`` gathers a copy of an
    element range, ``write`` scatters one. Never a live view (``cpu`` is False), so the read
    engine writes back what it changed, as it does for a device tensor."""

    cpu = False
    raw = None

    def __init__(self, spec: TensorSpec, members: Mapping[str, _Raw]):
        self.spec = spec
        self.members = members
        self.starts = _starts(spec)

    def read(self, a: int, b: int) -> np.ndarray:
        return gather(self.spec, lambda n, lo, hi: self.members[n].read(lo, hi), a, b, self.starts)

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        for m, lo, hi in _overlapping(self.spec, self.starts, a, b):
            self.members[m.name].write(lo - m.offset, hi - m.offset, raw[lo - a:hi - a])


def unit_targets(specs: Mapping[str, TensorSpec], tensors: Mapping[str, Any], make: Callable[[Any], _Raw]) -> dict[str, Any]:
    """The read engine's targets per unit: ``make(tensor)`` for a tensor, a :class:`GroupTarget`
    over its members (``make`` of a device member) for a group row, a
    :class:`~deltastore.layout.grid.GridTarget` for a column-grid tensor (design 011 D4: gathered and
    scattered, never a live view). Tensors of ``tensors`` that no unit names are left out. ``tensors`` are of the layout's shapes and dtypes (checked
    before, in this call)."""

    def member(t: torch.Tensor) -> _Raw:
        return _HostView(t, host_bits(t)) if t.device.type == "cpu" else make(t)

    groups = member_tables(specs, tensors) if any(s.members for s in specs.values()) else {}
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        if spec.members:
            if groups is not None:
                g = groups[name]
                ptrs = g.ptrs
                if ptrs is not None:  # the memory at ptrs is the members': ``g.owner`` holds them
                    out[name] = _span_view(spec, g.owner, ptrs) if g.span else _HostGroup(spec, g.owner, ptrs)
                    continue
                ts = g.tensors
                view = None
            else:  # ``tensors`` lacks a tensor of the layout: look each member up
                ts = [tensors[m.name] for m in spec.members]
                ptrs = member_pointers(spec, ts)
                view = _span(spec, ts, ptrs) if ptrs is not None else None
            if ptrs is not None:
                out[name] = view or _HostGroup(spec, ts, ptrs)
            else:
                out[name] = GroupTarget(spec, {m.name: member(t) for m, t in zip(spec.members, ts)})
        elif name in tensors:
            out[name] = grid.GridTarget(spec, tensors[name]) if spec.chunk_cols else make(tensors[name])
    return out


def unit_order(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A new 1-D CPU tensor holding column-grid tensor ``t``'s bits in its unit order (design
    011 D1): the publisher's reference copy of a grid unit."""
    buf = torch.empty(spec.numel, dtype=torch_dtype(spec.dtype))
    src = t.detach() if t.device.type == "cpu" else t.detach().to("cpu")
    if spec.numel:
        grid.to_unit_order(bits(src), spec, bits(buf))
    return buf


def unit_reference(state: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], *, owned: bool,
                   gathered: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The publisher's reference copy per unit (design 007 D5): a tensor as it is (``owned``:
    the caller's snapshot, adopted) or copied to the CPU; a group row as one new CPU buffer of
    its members' bits, gathered; a column-grid tensor as one 1-D CPU buffer in its unit order
    (design 011 D3): ``gathered[name]`` when the anchor's encode filled it, else permuted here."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.chunk_cols:
            got = gathered.get(name) if gathered is not None else None
            out[name] = got if got is not None else unit_order(state[name], spec)
            continue
        if not spec.members:
            t = state[name]
            out[name] = t if owned and t.device.type == "cpu" else t.detach().to("cpu", copy=True)
            continue
        buf = torch.empty(spec.shape, dtype=_SIGNED[DTYPE_WIDTHS[spec.dtype]])
        raw = bits(buf)
        for m in spec.members:
            t = state[m.name]
            if t.device.type != "cpu":
                t = t.detach().to("cpu")
            raw[m.offset:m.offset + m.numel] = host_bits(t)
        out[name] = buf
    return out
