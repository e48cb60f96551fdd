"""Which segments a pull needs (SPEC §7.4–7.5): manifests in, plan out.

Pure: no IO, no clock, no threads. :mod:`deltastore.read.subscriber` fetches and applies what a plan
names. A plan is per chunk: optionally a ``full`` segment, then the ``delta`` segments to apply
on top, in version order, and the state digest the chunk must have afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import CorruptObjectError
from deltastore.format.models import BlobRef, Manifest, SegmentRef, SquashManifest
from deltastore.layout.tensors import TensorSpec

logger = logging.getLogger(__name__)

#: A stretch of the chain, oldest first: ``(manifest key, manifest)``.
Manifests = Sequence[tuple[str, Manifest]]


@dataclass(frozen=True)
class Step:
    """One segment to apply to a chunk: ``ref`` inside pack ``blob``, listed by manifest ``mi``
    (an index into the planned stretch of the chain)."""

    mi: int
    blob: BlobRef
    ref: SegmentRef

    @property
    def where(self) -> tuple[str, int]:
        """``(pack key, offset)``: where the segment's bytes are, and their key once fetched."""
        return (self.blob.key, self.ref.offset)


@dataclass(frozen=True)
class ChunkPlan:
    """How to bring one chunk to its state at the plan's last version.

    Attributes:
        name, index: the tensor and chunk.
        span: the chunk's element range ``[start, stop)`` in the flattened tensor.
        digest: the chunk's state digest after the plan.
        full: a full segment to start from (None: patch the chunk the target holds).
        deltas: the delta segments to apply after it, oldest first.
        fallbacks: other plans that start from a full segment, cheapest first, to try when
            this one's segments turn out bad (missing, corrupt, or not reaching ``digest``).
    """

    name: str
    index: int
    span: tuple[int, int]
    digest: str
    full: Step | None = None
    deltas: tuple[Step, ...] = ()
    fallbacks: tuple[ChunkPlan, ...] = ()

    def steps(self) -> list[Step]:
        """Every segment the plan reads, in the order it applies them."""
        return ([self.full] if self.full else []) + list(self.deltas)

    @property
    def cost(self) -> int:
        """Bytes of segments the plan reads."""
        return sum(s.ref.length for s in self.steps())


def layout(m: Manifest) -> dict[str, TensorSpec]:
    """The layout an anchor manifest defines: its units (tensors, and group rows with their
    members, design 007)."""
    grid = m._grid  # column grids (design 011 D1), attached from the layout; empty without one
    if not grid:
        return {t.name: TensorSpec(t.name, t.dtype, tuple(t.shape), t.chunk_rows, m.members(t.name)) for t in m.tensors}
    return {t.name: TensorSpec(t.name, t.dtype, tuple(t.shape), t.chunk_rows, m.members(t.name), grid.get(t.name, 0))
            for t in m.tensors}


def digests(ms: Manifests) -> dict[tuple[str, int], str]:
    """Chunk digests after the last manifest of ``ms`` (an anchor first, then its deltas)."""
    out: dict[tuple[str, int], str] = {}
    for _, m in ms:
        for t in m.tensors:
            for c in t.chunks:
                out[(t.name, c.index)] = c.digest
    return out


def check_entries(key: str, m: Manifest, specs: dict[str, TensorSpec], anchor: int | None) -> None:
    """Every tensor ``m`` lists repeats the layout ``specs`` (SPEC §3: a delta, or an anchor
    with deltas, has its anchor's layout); otherwise the manifest is corrupt.

    Raises:
        CorruptObjectError: naming the manifest and the tensor.
    """
    grid = getattr(m, "_grid", None)  # a column grid is part of the layout too (design 011 D1)
    for t in m.tensors:
        spec = specs.get(t.name)
        if (spec is None or (t.dtype, tuple(t.shape), t.chunk_rows) != (spec.dtype, spec.shape, spec.chunk_rows)
                or spec.chunk_cols != (grid.get(t.name, 0) if grid else 0)):
            against = f"anchor {anchor}" if anchor is not None else "the version it builds on"
            raise CorruptObjectError(f"manifest {key!r}: tensor {t.name!r} does not match the layout of {against}")


def plan_from_anchor(ms: Manifests, specs: dict[str, TensorSpec]) -> list[ChunkPlan]:
    """Materialize the last version of ``ms`` (SPEC §7.4): every chunk of the layout from the
    anchor's full segment, then each later delta that lists it.

    Args:
        ms: the chain from an anchor (first) to the version wanted, oldest first.
        specs: the anchor's layout (:func:`layout` of ``ms[0]``).

    Raises:
        CorruptObjectError: ``ms[0]`` is not an anchor, a manifest disagrees with the layout,
            a delta lists a chunk the anchor lacks, or the anchor lacks a chunk.
    """
    akey, a = ms[0]
    if a.kind != "anchor":
        raise CorruptObjectError(f"manifest {akey!r} (version {a.version}) is a {a.kind}, but a later version names it as its anchor")
    # Per chunk: [full step, delta steps, digest after the last of them], in anchor order.
    acc: dict[tuple[str, int], tuple[Step, list[Step], list[str]]] = {}
    for mi, (key, m) in enumerate(ms):
        check_entries(key, m, specs, a.version)
        for t in m.tensors:
            for c in t.chunks:
                got = acc.get((t.name, c.index))
                if got is None:
                    if mi != 0 or c.full is None:
                        raise CorruptObjectError(f"manifest {key!r}: chunk {t.name}[{c.index}] is not in anchor {a.version}")
                    acc[(t.name, c.index)] = (Step(mi, m.blobs[c.full.blob], c.full), [], [c.digest])
                elif c.delta is not None:
                    got[1].append(Step(mi, m.blobs[c.delta.blob], c.delta))
                    got[2][0] = c.digest
    missing = sum(s.n_chunks for s in specs.values()) - len(acc)
    if missing:  # parse_manifest already refuses this; kept as the planner's own guard
        raise CorruptObjectError(f"anchor {akey!r} lacks {missing} chunk(s) of its layout")
    return [
        ChunkPlan(name, idx, specs[name].chunk_span(idx), digest[0], full, tuple(deltas))
        for (name, idx), (full, deltas, digest) in acc.items()
    ]


def plan_forward(ms: Manifests, specs: dict[str, TensorSpec],
                 base: Mapping[tuple[str, int], str] | None = None) -> list[ChunkPlan]:
    """Fast-forward from the version before ``ms`` to its last (SPEC §7.5): for each chunk
    changed in ``ms``, the cheapest of its deltas and the paths from a full segment.

    An anchor with deltas lists a chunk without a ``delta`` segment to say "unchanged since
    the parent". With ``base`` (the chunk digests held at h), that claim is checked against
    the digests along the way: a chunk whose digest changes without a delta saying how is
    brought forward from the anchor's full segment (so ``pull_into`` reaches what ``pull``
    reads from that anchor), with a log line; it is never left as it was.

    Args:
        ms: versions h+1..t, oldest first. Every anchor in it has the layout ``specs`` (a
            caller re-plans from the anchor otherwise).
        specs: the layout held at h.
        base: chunk digests at h (:func:`digests` of the held chain), or None to trust the
            manifests' "unchanged" claims.

    Returns:
        One plan per changed chunk, each with its fallbacks (see :class:`ChunkPlan`).

    Raises:
        CorruptObjectError: a manifest disagrees with the layout, or a chunk has no path.
    """
    # Per chunk: the entries touching it, in version order.
    touched: dict[tuple[str, int], list[tuple[int, Any]]] = {}
    running = dict(base) if base is not None else None  # each chunk's digest so far
    for mi, (key, m) in enumerate(ms):
        check_entries(key, m, specs, None)
        for t in m.tensors:
            for c in t.chunks:
                k = (t.name, c.index)
                if c.delta is not None or (m.kind == "anchor" and m.delta_base is None):
                    touched.setdefault(k, []).append((mi, c))
                elif running is not None and running.get(k) != c.digest:
                    # "Unchanged" (no delta), yet the digest moved: the manifest contradicts the
                    # chain. Only the full segment can say what the chunk is at this anchor.
                    logger.warning(
                        "manifest %r lists chunk %s[%d] as unchanged, but its digest differs from the version "
                        "before; bringing it forward from the anchor's full segment", key, t.name, c.index,
                    )
                    touched[k] = [(mi, c)]
                if running is not None:
                    running[k] = c.digest
    plans = []
    for (name, idx), entries in touched.items():
        candidates: list[ChunkPlan] = []
        # Candidate starts: pure deltas from h (start=-1), or a full segment at an anchor.
        starts = [-1] + [i for i, (mi, c) in enumerate(entries) if c.full is not None]
        for si in starts:
            rest = entries[si + 1 :] if si >= 0 else entries
            if any(c.delta is None for _, c in rest):
                continue  # an anchor without deltas breaks the chain: need its full segment
            full = None
            if si >= 0:
                mi, c = entries[si]
                full = Step(mi, ms[mi][1].blobs[c.full.blob], c.full)
            deltas = tuple(Step(mi, ms[mi][1].blobs[c.delta.blob], c.delta) for mi, c in rest)
            candidates.append(ChunkPlan(name, idx, specs[name].chunk_span(idx), entries[-1][1].digest, full, deltas))
        if not candidates:
            raise CorruptObjectError(f"no way to bring chunk {name}[{idx}] forward: the chain lacks segments")
        if len(candidates) == 1:  # a steady delta: no anchor in range, nothing to compare
            plans.append(candidates[0])
            continue
        candidates.sort(key=lambda p: p.cost)  # cheapest; stable: on a tie, the earliest start
        best, others = candidates[0], candidates[1:]
        # When the chosen path's segments turn out bad, a path from a full segment (an anchor
        # in range) reaches the same digest without them. A path that patches the held chunk
        # is no fallback for a full one: the held chunk's base was not checked.
        plans.append(ChunkPlan(best.name, best.index, best.span, best.digest, best.full, best.deltas,
                               tuple(p for p in others if p.full is not None)))  # fmt: skip
    return plans


# --- catch-up paths (design 005 D6): pricing candidates and reading squashes -------------------


def delta_bytes(m: Manifest) -> int:
    """Bytes of ``m``'s delta segments (``stats.delta_bytes`` when the writer recorded it)."""
    if m.stats.delta_bytes is not None:
        return m.stats.delta_bytes
    return sum(c.delta.length for t in m.tensors for c in t.chunks if c.delta is not None)


def full_bytes(m: Manifest) -> int:
    """Bytes of ``m``'s full segments (``stats.full_bytes`` when the writer recorded it)."""
    if m.stats.full_bytes is not None:
        return m.stats.full_bytes
    return sum(c.full.length for t in m.tensors for c in t.chunks if c.full is not None)


def chain_price(low: Manifest, high: Manifest, between: Callable[[], Manifests]) -> int:
    """Bytes of the chain ``(low, high]``: ``cum(high) − cum(low)`` when both record
    ``cum_delta_bytes`` and no chain break lies between them (no manifest read), else the sum of
    the delta bytes of the manifests ``between()`` returns (versions low+1..high), counting an
    anchor without deltas (a chain break) by its full bytes."""
    cl, ch = low.stats.cum_delta_bytes, high.stats.cum_delta_bytes
    if cl is not None and ch is not None and high.chain_start is not None and high.chain_start <= low.version:
        return ch - cl
    return sum(delta_bytes(m) if m.delta_base is not None else full_bytes(m) for _, m in between())


def squash_as_manifest(key: str, sq: SquashManifest, specs: Mapping[str, TensorSpec] | None = None) -> Manifest:
    """A squash read as one delta version ``to`` on top of ``from`` (SPEC §12), so that
    :func:`plan_forward` chooses among its segments like among a delta's. ``specs``: the held
    layout the squash applies to (checked by :func:`check_squash`); its column grids are the
    squash's (a squash names no layout of its own in its tables, design 011 D1), so that
    :func:`check_entries` compares them as for a version's manifest."""
    m = Manifest.model_construct(
        version=sq.to, parent=sq.from_, parent_manifest=sq.from_manifest, kind="delta", anchor=1,
        delta_base=sq.from_, created=sq.created, writer=sq.writer, epoch=0, commit_id=sq.commit_id,
        blobs=sq.blobs, tensors=sq.tensors, lineage=sq.lineage,
    )  # fmt: skip
    if specs:
        m._grid = {n: sp.chunk_cols for n, sp in specs.items() if sp.chunk_cols}
    return m


def check_squash(key: str, sq: SquashManifest, specs: Mapping[str, TensorSpec]) -> None:
    """A squash manifest's own consistency against the held layout: each listed chunk exists,
    has exactly one delta segment inside its pack, and every pack is a role-``d`` pack named by
    its SHA-256 (SPEC §12). Checked before any of its segments is planned.

    Raises:
        CorruptObjectError: naming the squash and what is wrong.
    """

    def bad(msg: str) -> CorruptObjectError:
        return CorruptObjectError(f"squash manifest {key!r} ({sq.from_}→{sq.to}): {msg}")

    if sq.to <= sq.from_:
        raise bad("'to' is not after 'from'")
    for i, b in enumerate(sq.blobs):
        if b.role not in (None, "d") or not b.key.endswith(f"{b.sha256}.pack") or len(b.sha256) != 64:
            raise bad(f"pack {i} ({b.key!r}) is not a delta pack named by its SHA-256")
    for t in sq.tensors:
        spec = specs.get(t.name)
        if spec is None or (t.dtype, tuple(t.shape), t.chunk_rows) != (spec.dtype, spec.shape, spec.chunk_rows):
            raise bad(f"tensor {t.name!r} does not match the held layout")
        seen: set[int] = set()
        for c in t.chunks:
            if not 0 <= c.index < spec.n_chunks or c.index in seen:
                raise bad(f"chunk {t.name}[{c.index}] is out of range or listed twice")
            seen.add(c.index)
            if c.delta is None or c.full is not None:
                raise bad(f"chunk {t.name}[{c.index}] must have one delta segment and no full one")
            if c.delta.blob >= len(sq.blobs) or c.delta.offset + c.delta.length > sq.blobs[c.delta.blob].size:
                raise bad(f"chunk {t.name}[{c.index}] names bytes outside its packs")


def plan_changed_from_anchor(ms: Manifests, specs: dict[str, TensorSpec], held: Mapping[tuple[str, int], str]) -> list[ChunkPlan]:
    """Catch up from the anchor ``ms[0]`` (a holder whose version was collected, design 005
    D2): :func:`plan_from_anchor`, less the chunks whose held digest already equals their
    digest at the last version of ``ms`` (those are kept, and checked against ``held``)."""
    return [p for p in plan_from_anchor(ms, specs) if held.get((p.name, p.index)) != p.digest]
