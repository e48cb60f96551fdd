"""A rank's part of a sharded version (SPEC §8, design 010): its rows encoded and uploaded,
and its part manifest; and, to resume, its rows of a stored version read back (design 010 D11).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deltastore._util.heap import release_free_heap
from deltastore.errors import CorruptObjectError, ShardMismatchError
from deltastore.format.history import History
from deltastore.format.models import Layout, PartRef, SegmentRef, Stats
from deltastore.format.parts import encode_part
from deltastore.format.keys import part_key, sha256_hex
from deltastore.layout.groups import unit_order
from deltastore.layout.tensors import torch_dtype
from deltastore.storage.base import Store
from deltastore.write.encode import LayoutWorks, encode_version
from deltastore.write.sharded.planning import Plan, Resume, Share

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PartChunk:
    """A chunk of this rank's part, its index shifted to the whole tensor's: what
    :func:`~deltastore.format.manifest.encode_part` reads of a ChunkEntry. Not a pydantic model:
    the part's table is built once per version and discarded (its bytes are what rank 0 joins
    and checks), and a validated copy per chunk would cost more than the rest of the part's
    bookkeeping (design 010 D8)."""

    index: int
    digest: str
    full: SegmentRef | None
    delta: SegmentRef | None


@dataclass(frozen=True, slots=True)
class PartTensor:
    """One tensor of this rank's part: what encode_part reads of a TensorEntry (as
    :class:`PartChunk`: the encoder's entries are validated; these only regroup them)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_rows: int
    chunks: tuple[Any, ...]


@dataclass(frozen=True)
class Part:
    """What a rank sends rank 0 in step 4: its part's reference, the part manifest's bytes
    (rank 0 uploads them), the tensors it changed and its stats."""

    ref: PartRef
    data: bytes
    changed: list[str]
    stats: Stats


class RankPart:
    """One rank's encoding side: its threads, its store and the chunk jobs of its layouts.

    Args:
        store: the store (the publisher owns it).
        rank, writer_id: recorded in the part.
        threads: encode threads; ``pool`` and ``uploader`` run them and the uploads.
    """

    def __init__(self, store: Store, rank: int, writer_id: str, threads: int, pool: ThreadPoolExecutor,
                 uploader: ThreadPoolExecutor):
        self.store = store
        self.rank = rank
        self.writer_id = writer_id
        self.threads = threads
        self.pool = pool
        self.uploader = uploader
        self.layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across versions

    def write(self, plan: Plan, layout: Layout, mine: Mapping[str, torch.Tensor], share: Share,
              reference: dict[str, torch.Tensor] | None, gathered: dict[str, torch.Tensor]) -> Part:
        """Step 3: encode this rank's rows (chunk indices of the whole tensor) on ``reference``
        (None: no base), upload the packs under the attempt and build the part manifest (rank
        0 uploads it in step 5). ``gathered`` receives an anchor's grid units' reference
        buffers (design 011 D3)."""
        index = {n: i for i, n in enumerate(layout.name)}
        specs, first_chunk = share.specs, share.first_chunk
        state = {n: t for n, t in mine.items()}
        encoded = encode_version(state, specs, kind=plan.kind, reference=reference, pool=self.pool,  # type: ignore[arg-type]
                                 uploader=self.uploader, store=self.store, threads=self.threads, attempt=plan.attempt,
                                 gathered=gathered, layouts=self.layout_works)
        if plan.kind == "anchor":
            release_free_heap()  # the encode threads' chunk-sized buffers (deltastore._util.heap)
        tensors: list[Any] = []
        changed = []
        for e in encoded.entries:
            i = index[e.name]
            shift = first_chunk[e.name]
            chunks = tuple(PartChunk(c.index + shift, c.digest, c.full, c.delta) for c in e.chunks) if shift else tuple(e.chunks)
            tensors.append(PartTensor(e.name, e.dtype, layout.shape[i], e.chunk_rows, chunks))
            if any(c.delta is not None for c in chunks):
                changed.append(e.name)
        assert plan.layout_ref is not None
        data = encode_part(schema=layout.schema_, version=plan.version, part=self.rank, commit_id=plan.attempt,
                           lineage=plan.lineage, layout_ref=plan.layout_ref, layout=layout, tensors=tensors,
                           blobs=encoded.blobs, stats=encoded.stats)
        digest = sha256_hex(data)
        key = part_key(plan.attempt, self.rank, digest)
        # Not uploaded here: rank 0 receives these bytes in step 4 anyway and uploads every part
        # manifest in parallel with the version manifest (one upload fewer on the critical path).
        ref = PartRef(part=self.rank, key=key, sha256=digest, writer=self.writer_id, bytes=encoded.stats.bytes_stored)
        return Part(ref, data, changed, encoded.stats)

    def read_rows(self, point: Resume, layout: Layout, share: Share) -> tuple[dict[str, torch.Tensor], int]:
        """This rank's rows of version ``point`` (its share of ``layout``), as a reader reads a
        partial pull: the chain from the anchor, only the chunks of these rows, each verified
        against its digest. Returns the tensors (this rank's local shapes) and the segment bytes
        fetched.

        Raises:
            CorruptObjectError: the manifest is not HEAD's version (its SHA-256, version or lineage).
            IntegrityError, StorageError, ...: as a reader's pull.
        """
        # the read path: loaded only when a publisher resumes
        from deltastore.layout.select import resolve_rows, slice_targets
        from deltastore.read.engine import ReadEngine
        from deltastore.read.plan import layout as units_of
        from deltastore.read.plan import plan_from_anchor

        history = History(self.store)
        m = history.manifest(point.manifest, point.sha256)
        if m.version != point.version or (point.lineage is not None and m.lineage != point.lineage):
            raise CorruptObjectError(f"manifest {point.manifest!r} is version {m.version} of lineage {m.lineage}, not "
                                     f"HEAD's version {point.version} of lineage {point.lineage}")
        ms = history.anchor_chain(point.manifest, m)
        units = units_of(ms[0][1])
        rows = {}
        for name, spec in share.specs.items():
            start = share.first_row[name]
            rows[name] = (start, start + (spec.shape[0] if spec.shape else 1))
        res = resolve_rows(units, rows)
        for name, spec in share.specs.items():
            if res.shapes[name] != (spec.dtype, tuple(spec.shape)):
                raise ShardMismatchError(f"tensor {name!r}: version {point.version} holds {res.shapes[name][0]}"
                                         f"{list(res.shapes[name][1])} of rows {list(rows[name])}, this rank "
                                         f"{spec.dtype}{list(spec.shape)}")
        out = {n: torch.empty(shape, dtype=torch_dtype(dt)) for n, (dt, shape) in res.shapes.items()}
        plans = [p for p in plan_from_anchor(ms, units) if (p.name, p.index) in res.chunks]
        engine = ReadEngine(self.store, self.threads)
        spare: dict[tuple[str, int], Any] = {}  # chunk bits outside the rows: none (pieces are chunk-aligned, D2)
        try:
            engine.materialize(plans, units, out, lambda specs, t: slice_targets(specs, res, t, spare))
            # a grid piece's reference copy is in its unit order (design 011 D3, D11): each is
            # permuted and its natural copy dropped at once (one extra piece alive at a time)
            for name, spec in share.specs.items():
                if spec.chunk_cols:
                    out[name] = unit_order(out.pop(name), spec)
            return out, engine.bytes_fetched
        finally:
            engine.close()
            release_free_heap()  # the read threads' chunk-sized buffers (deltastore._util.heap)


__all__ = ["Part", "PartChunk", "PartTensor", "RankPart"]
