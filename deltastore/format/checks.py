"""The invariants of a manifest and a layout that pydantic cannot express (docs/SPEC.md §3,
§3.2, §8, §14), checked before any planning: a reader may then index chunks, allocate tensors
and slice packs by what the objects say.
"""

from __future__ import annotations

from collections.abc import Callable

from deltastore._util.identity import IdentityCache
from deltastore.errors import CorruptObjectError, UnsupportedSchemaError
from deltastore.format.keys import EARLIER_MANIFEST_KEY, PACK_KEY, manifest_key_version
from deltastore.format.models import (
    DTYPE_WIDTHS,
    GROUPS_SCHEMA,
    GroupRecord,
    Layout,
    Manifest,
    SegmentRef,
    chunk_count,
    chunk_elements,
)
from deltastore.format.parse import INT_LIMIT, check_depth, check_int

#: torch's limit on a tensor's number of dimensions.
MAX_NDIM = 64
#: The refusal of a sharded layout whose pieces are not aligned to its chunks.
SHARDED_UNALIGNED = "pieces that do not start on a chunk boundary are not read by this deltastore: upgrade deltastore"


def check_manifest(m: Manifest, key: str) -> None:
    """Cross-field invariants pydantic cannot express (SPEC §3), checked before any planning:
    a reader may then index chunks, allocate tensors and slice packs by what the manifest says."""

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {key!r}: {msg}")

    for name in ("version", "parent", "anchor", "delta_base", "epoch"):
        check_int(getattr(m, name), name, "manifest", key)
    check_int(m.step, "step", "manifest", key, low=-INT_LIMIT)
    for name in type(m.stats).model_fields:
        check_int(getattr(m.stats, name), f"stats.{name}", "manifest", key, low=-INT_LIMIT)
    check_depth(m.metadata, "manifest", key)
    if (m.parent is None) != (m.parent_manifest is None):
        raise bad("parent and parent_manifest must both be set or both be null")
    if m.parent is not None and m.parent != m.version - 1:
        raise bad(f"version {m.version} has parent {m.parent}; versions must be consecutive")
    if m.parent_manifest is not None and m.parent is not None:
        _check_link(m.parent_manifest, m.parent, "parent_manifest", key, bad)
    if m.kind == "anchor" and m.anchor != m.version:
        raise bad("an anchor's 'anchor' must be its own version")
    if m.base is not None:
        _check_based(m, bad)
    elif m.kind == "delta" and (m.parent is None or m.anchor >= m.version or m.delta_base != m.parent):
        raise bad("a delta needs a parent, an earlier anchor, and delta_base equal to its parent")
    if m.delta_base is not None and m.delta_base != m.parent:
        raise bad("delta_base must be the parent version or null")
    for i, b in enumerate(m.blobs):
        check_int(b.size, f"blobs[{i}].size", "manifest", key)
        match = PACK_KEY.fullmatch(b.key)
        if match is None or match.group(1) != b.sha256 or b.role not in ("f", "d"):
            raise bad(f"pack {i} has key {b.key!r} and role {b.role!r}: not objects/<attempt>/{b.sha256}.pack with a role")
    _check_links(m, key, bad)
    names: set[str] = set()
    anchor, is_delta = m.kind == "anchor", m.kind == "delta"
    no_delta_base = m.delta_base is None and m.base is None
    blob_roles = [b.role for b in m.blobs]
    blob_sizes = [b.size for b in m.blobs]
    grid = m._grid  # column grids (design 011 D1): empty unless the layout has one
    for t in m.tensors:
        if t.name in names:
            raise bad(f"tensor {t.name!r} is listed twice")
        names.add(t.name)
        if t.dtype not in DTYPE_WIDTHS:
            raise bad(f"tensor {t.name!r} has dtype {t.dtype!r}, which deltastore does not store")
        shape = t.shape
        if len(shape) > MAX_NDIM or (shape and (min(shape) < 0 or max(shape) >= INT_LIMIT)):
            raise bad(f"tensor {t.name!r} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
        rows = shape[0] if shape else 1
        row_elems = 1
        for d in shape[1:]:
            row_elems *= d
        if rows * row_elems * DTYPE_WIDTHS[t.dtype] >= INT_LIMIT:
            raise bad(f"tensor {t.name!r} of shape {list(shape)} has more than 2**63 bytes")
        chunk_rows = t.chunk_rows
        if chunk_rows is not None and not 1 <= chunk_rows < INT_LIMIT:
            check_int(chunk_rows, f"tensor {t.name!r} chunk_rows", "manifest", key, low=1)
        cols = grid.get(t.name, 0) if grid else 0
        n_chunks = chunk_count(shape, chunk_rows, cols)
        seen: set[int] = set()
        for c in t.chunks:
            # (messages are formatted only on failure: this loop runs per chunk of every parse)
            index, full, delta = c.index, c.full, c.delta
            if not 0 <= index < n_chunks:
                raise bad(f"chunk {t.name}[{index}] is out of range: tensor {t.name!r} {list(shape)} has {n_chunks} chunk(s) "
                          f"of {chunk_rows} rows" + (f" × {cols} columns" if cols else ""))
            if index in seen:
                raise bad(f"chunk {t.name}[{index}] is listed twice")
            seen.add(index)
            if anchor and full is None:
                raise bad(f"anchor chunk {t.name}[{index}] has no full segment")
            if delta is None:
                if is_delta:
                    raise bad(f"delta chunk {t.name}[{index}] has no delta segment")
            elif no_delta_base:
                raise bad(f"chunk {t.name}[{index}] has a delta segment but the manifest has no delta_base")
            if cols or not shape:
                elements = chunk_elements(shape, chunk_rows, index, cols)
            else:  # chunk_elements without a grid, inline
                elements = rows - index * chunk_rows
                elements = (chunk_rows if elements > chunk_rows else elements if elements > 0 else 0) * row_elems
            if full is not None:
                _check_segment(m, full, "full", t.name, index, elements, blob_roles, blob_sizes, bad)
            if delta is not None:
                _check_segment(m, delta, "delta", t.name, index, elements, blob_roles, blob_sizes, bad)
        if m.kind == "anchor" and len(seen) != n_chunks:
            raise bad(f"anchor lists {len(seen)} of the {n_chunks} chunks of tensor {t.name!r}")


def _check_segment(m: Manifest, seg: SegmentRef, which: str, name: str, index: int, elements: int,
                   blob_roles: list[str | None], blob_sizes: list[int], bad: Callable[[str], CorruptObjectError]) -> None:
    """The rules of SPEC §3 for one segment ref of chunk ``name[index]`` (``which``: full or delta)."""
    blob = seg.blob
    if blob >= len(blob_sizes):
        raise bad(f"chunk {name}[{index}] {which} names blob {blob} of {len(blob_sizes)}")
    role = blob_roles[blob]
    if role is not None and role != which[0]:
        raise bad(f"chunk {name}[{index}] {which} segment lies in pack {blob} of role {role!r}")
    if seg.offset + seg.length > blob_sizes[blob]:
        raise bad(f"chunk {name}[{index}] {which} runs past the end of {m.blobs[blob].key!r}")
    if seg.n_changed > elements:
        raise bad(f"chunk {name}[{index}] {which} changes {seg.n_changed} elements of {elements}")


def _check_based(m: Manifest, bad: Callable[[str], CorruptObjectError]) -> None:
    """A based version (SPEC §14): a delta of another store's version, starting its own chain.

    Its chunks' delta segments apply to the base's chunks, never to its parent's; so it is its
    own anchor and chain start, with no anchor manifest, no delta_base and no full segment."""
    b = m.base
    assert b is not None
    if m.kind != "delta" or m.delta_base is not None or m.anchor != m.version:
        raise bad("a based version is a delta with delta_base null and 'anchor' its own version")
    if m.anchor_manifest is not None or m.chain_start != m.version:
        raise bad("a based version has no anchor_manifest and starts its own chain (chain_start = version)")
    check_int(b.version, "base.version", "manifest", "")
    if manifest_key_version(b.manifest) != b.version or not b.manifest.endswith(f"-{b.sha256}.json.zst"):
        raise bad(f"base.manifest {b.manifest!r} is not the manifest key of version {b.version} "
                  f"with SHA-256 {b.sha256}")
    for t in m.tensors:
        for c in t.chunks:
            if c.full is not None or c.delta is None:
                raise bad(f"based chunk {t.name}[{c.index}] must have a delta segment and no full segment")


#: Skip pointers of one manifest: versions v−2, …, v−2^62 cover every version below 2**63.
MAX_BACK = 62


def _check_link(link: str, version: int, field: str, key: str, bad: Callable[[str], CorruptObjectError]) -> None:
    """``link`` (field ``field`` of manifest ``key``) is the manifest key of ``version``; the
    key of a plain-JSON manifest (schemas 1 and 2) is refused as an earlier format."""
    if manifest_key_version(link) == version:
        return
    if EARLIER_MANIFEST_KEY.fullmatch(link):
        raise UnsupportedSchemaError(f"manifest {key!r}: {field} {link!r} names a plain-JSON manifest of schema 1 or 2, "
                                     "an earlier format this deltastore does not read: publish the model to a new store")
    raise bad(f"{field} {link!r} is not the manifest key of version {version}")


def _check_links(m: Manifest, key: str, bad: Callable[[str], CorruptObjectError]) -> None:
    """Header fields that name other versions say which version they name (SPEC §3)."""
    if m.layout is None:
        raise bad("a manifest needs a layout")
    if m.kind == "anchor" and m.anchor_manifest is not None:
        raise bad("an anchor has no anchor_manifest")
    if m.kind == "delta" and m.base is None:
        if m.anchor_manifest is None:
            raise bad(f"a delta needs anchor_manifest, the manifest key of version {m.anchor}")
        _check_link(m.anchor_manifest, m.anchor, "anchor_manifest", key, bad)
    if len(m.back) > MAX_BACK:
        raise bad(f"back lists {len(m.back)} keys, more than {MAX_BACK}")
    for j, k in enumerate(m.back, start=1):
        _check_link(k, m.version - 2**j, f"back[{j - 1}]", key, bad)
    if m.chain_start is not None and (
        not 1 <= m.chain_start <= m.version or (m.delta_base is None and m.chain_start != m.version)
    ):
        raise bad(f"chain_start {m.chain_start} is not the latest version ≤ {m.version} with a null delta_base")
    if m.max_attempt_s is not None and not 1 <= m.max_attempt_s < INT_LIMIT:
        raise bad(f"max_attempt_s = {m.max_attempt_s} is not a positive number of seconds")


def _check_groups(layout: Layout, what: str, key: str) -> None:
    """Schema 4's group records (design 007 D6): each names one 1-D row, once; its members
    tile the row in order (no overlap, no gap, nothing past the end); every name is unique
    across rows and members. After this, gather and scatter stay in range."""
    if layout.schema_ not in (3, GROUPS_SCHEMA):
        raise CorruptObjectError(f"{what} {key!r} has schema {layout.schema_}: layouts are schema 3 or 4")
    if (layout.groups is None) != (layout.schema_ == 3):
        raise CorruptObjectError(f"{what} {key!r}: a schema-{layout.schema_} layout "
                                 f"{'has no' if layout.schema_ == 3 else 'needs a'} groups record")
    n = len(layout.name)
    names = set(layout.name)
    units: set[int] = set()
    for gi, g in enumerate(layout.groups or ()):
        def bad(msg: str, gi: int = gi, g: GroupRecord = g) -> CorruptObjectError:
            row = layout.name[g.unit] if 0 <= g.unit < n else g.unit
            return CorruptObjectError(f"{what} {key!r}: group record {gi} (row {row!r}) {msg}")

        if not 0 <= g.unit < n:
            raise bad(f"names row {g.unit}; the layout has {n}")
        if g.unit in units:
            raise bad("names a row another group record names")
        units.add(g.unit)
        k = len(g.name)
        if k == 0 or len(g.shape) != k or len(g.offset) != k:
            raise bad(f"has {k} names, {len(g.shape)} shapes and {len(g.offset)} offsets (non-empty, all equal)")
        row_shape = layout.shape[g.unit]
        if len(row_shape) != 1:
            raise bad(f"has shape {list(row_shape)[:MAX_NDIM + 1]}: a group row is 1-D")
        total, pos = row_shape[0], 0
        for i in range(k):
            shape, name = g.shape[i], g.name[i]
            if len(shape) > MAX_NDIM or any(not 0 <= d < INT_LIMIT for d in shape):
                raise bad(f"member {name!r} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
            count = 1
            for d in shape:
                count *= d
            if g.offset[i] != pos:
                raise bad(f"member {name!r} starts at element {g.offset[i]}, not {pos}: members tile the group "
                          "in order, without overlap or gap")
            pos += count
            if pos > total:
                raise bad(f"member {name!r} ends at element {pos}, past the group's {total}")
            if not name or name in names:
                raise bad(f"member name {name!r} is empty or also names another row or member")
            names.add(name)
        if pos != total:
            raise bad(f"members end at element {pos}, but the group has {total}")


#: Layout objects that passed :func:`check_layout`, while they live (by identity; History
#: caches layouts, and every manifest of an anchor span is parsed against the same object):
#: re-checking a layout of 20,000 rows for every manifest would dominate a parse (design 007).
_CHECKED_LAYOUTS: IdentityCache[bool] = IdentityCache()


def check_layout(layout: Layout, what: str, key: str) -> None:
    """A layout's columns agree, and describe tensors a reader can allocate; pieces of a sharded
    layout off chunk boundaries are refused (UnsupportedSchemaError); schema 4's groups are
    checked (design 007 D6)."""
    if _CHECKED_LAYOUTS.get(layout):  # the same (immutable) object passed before
        return
    _check_layout_once(layout, what, key)
    _CHECKED_LAYOUTS.put(layout, True)


def _check_layout_once(layout: Layout, what: str, key: str) -> None:
    n = len(layout.name)
    columns = (layout.dtype, layout.shape, layout.chunk_rows, layout.chunk_cols, layout.pieces, layout.piece_parts)
    if any(len(c) != n for c in columns):
        raise CorruptObjectError(f"{what} {key!r}: the layout's columns have different lengths")
    if len(set(layout.name)) != n:
        raise CorruptObjectError(f"{what} {key!r}: the layout lists a tensor name twice")
    for i in range(n):
        where = f"{what} {key!r}: tensor {layout.name[i]!r}"
        if layout.dtype[i] not in DTYPE_WIDTHS:
            raise CorruptObjectError(f"{where} has dtype {layout.dtype[i]!r}, which deltastore does not store")
        shape = layout.shape[i]
        if len(shape) > MAX_NDIM or any(not 0 <= d < INT_LIMIT for d in shape):
            raise CorruptObjectError(f"{where} has impossible shape {list(shape)[:MAX_NDIM + 1]}")
        if not 1 <= layout.chunk_rows[i] < INT_LIMIT:
            raise CorruptObjectError(f"{where} has chunk_rows {layout.chunk_rows[i]}")
        if layout.chunk_cols[i]:
            _check_grid(layout, i, where)
    _check_pieces(layout, what, key)
    _check_groups(layout, what, key)


def _check_grid(layout: Layout, i: int, where: str) -> None:
    """Row ``i``'s column grid (SPEC §3.2, design 011 D7): ``chunk_cols`` in ``[1, shape[1]]``
    of a tensor with a second dimension, never a group row. Then every chunk index, count and
    block follows by arithmetic (chunk_count, chunk_elements, TensorSpec.chunk_block)."""
    k, shape = layout.chunk_cols[i], layout.shape[i]
    if type(k) is not int or not 0 < k < INT_LIMIT:
        raise CorruptObjectError(f"{where} has chunk_cols {k!r}")
    if len(shape) < 2 or any(g.unit == i for g in layout.groups or ()):
        raise CorruptObjectError(f"{where} {list(shape)[:MAX_NDIM + 1]} has chunk_cols {k}: a grid needs a second "
                                 "dimension (and a group row has none)")
    if k > shape[1]:
        raise CorruptObjectError(f"{where} {list(shape)} has chunk_cols {k}, more than its {shape[1]} columns")


def _check_pieces(layout: Layout, what: str, key: str) -> None:
    """Pieces of a sharded layout (SPEC §2 *Pieces*, §8): ``parts`` = 0 is unsharded (no pieces);
    otherwise every row has its inner boundaries (strictly increasing, inside the first
    dimension) and one part in ``[0, parts)`` per piece. Readers read boundaries that are
    multiples of the row's ``chunk_rows`` (chunking restarting at each piece is then the
    unsharded chunking) and refuses others (UnsupportedSchemaError)."""
    if not 0 <= layout.parts < INT_LIMIT:
        raise CorruptObjectError(f"{what} {key!r} has parts = {layout.parts}")
    if layout.parts == 0:
        if any(p is not None for p in (*layout.pieces, *layout.piece_parts)):
            raise CorruptObjectError(f"{what} {key!r}: an unsharded layout (parts 0) has pieces")
        return
    for i in range(len(layout.name)):
        where = f"{what} {key!r}: tensor {layout.name[i]!r}"
        bounds, owners = layout.pieces[i], layout.piece_parts[i]
        if bounds is None or owners is None or len(owners) != len(bounds) + 1:
            raise CorruptObjectError(f"{where} needs pieces and one part per piece in a sharded layout")
        shape, rows = layout.shape[i], layout.chunk_rows[i]
        previous = 0
        for b in bounds:
            if not shape or not previous < b < shape[0]:
                raise CorruptObjectError(f"{where} {list(shape)} has piece boundaries {list(bounds)[:8]}: not strictly "
                                         "increasing inside its first dimension")
            if b % rows:
                raise UnsupportedSchemaError(f"{where} has a piece boundary at row {b}, not a multiple of its "
                                             f"chunk_rows {rows}: {SHARDED_UNALIGNED}")
            previous = b
        if any(not 0 <= p < layout.parts for p in owners):
            raise CorruptObjectError(f"{where} names parts {list(owners)[:8]} of {layout.parts}")
        if layout.groups and any(g.unit == i for g in layout.groups) and bounds:
            raise CorruptObjectError(f"{where} is a group row split into pieces: a group row is one piece")
