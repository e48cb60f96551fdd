"""Sharded publishing (SPEC §8, design 010): every rank publishes the rows it owns.

A :class:`ShardedPublisher` runs on every rank of a ``torch.distributed`` process group. Each
rank passes the tensors, or the row ranges of tensors, it holds (FSDP2 DTensor local shards
among them, never gathered), encodes them against its own reference copy of those rows, and
uploads its packs under the version's attempt. Rank 0 then checks the parts, uploads their part
manifests and the version manifest that lists them, and makes the version visible with the one
HEAD compare-and-swap of SPEC §5. No rank ever holds another rank's rows.

One publish is five steps, all ranks in lockstep (every collective is over ``group``)::

    1. all_gather   each rank: what it owns (name, dtype, global shape, rows; a digest when
                    that is what every rank planned last, design 010 D7), the version it
                    holds, step, anchor request, or its local error; rank 0 adds its pre-plan
                    of a steady-state version (next version, same layout and base, design 010 D6)
                    -> every rank computes the same layout, or the same ShardMismatchError,
                       and the same verdict on the pre-plan
    2. broadcast    only when the pre-plan does not hold (the first version, a layout change, an
                    anchor request, a failure before): rank 0 reads HEAD (claim, fencing,
                    unknown outcomes: commit.py), picks version, attempt, kind, lineage; writes
                    the layout object if new
    3. (local)      each rank: encode its rows, upload its packs, build its part manifest
    4. gather       part references and part manifests to rank 0, or each rank's error
    5. broadcast    rank 0: uploads the part manifests, and an unsigned version's manifest
                    (its header and part list), while it joins and checks the parts (once:
                    the version manifest is stored without a second join), then CASes HEAD
                    once (nothing read back: the next tip is what it wrote); the outcome (or
                    the error) goes to every rank

:meth:`ShardedPublisher.publish_async` runs steps 1-4 alike and returns there: rank 0 joins and
commits the version (step 5) on a thread of its own while every rank goes on to the next
version, planned on the one being committed (design 010 D10); the outcome reaches every rank
with the next call's step 1 (or a :meth:`~ShardedPublisher.flush`), and a version whose base
then failed fails too, so nothing is committed on a base that is not in the store.

A steady-state version therefore costs three collectives (on gloo, four gloo operations: design
010 D9) and, on rank 0, no read of the store; the uploads overlap the join instead of preceding
the gather or following it.

A rank that fails raises its own error after telling the others, which raise
:class:`~deltastore.errors.PartFailedError`; a rank that dies makes the collectives of the
others fail, which is reported the same way. Either way HEAD has not moved: the packs already
uploaded sit unreferenced under the attempt and GC collects them after its grace period. The
next publish is a new attempt.

A publisher that holds no reference copy (a restarted job, or after any failure) resumes from
the store (``resume=True``, design 010 D11): when HEAD's version has the layout the ranks plan
now, step 2 names it, every rank reads back only its own rows of it (the chunks of its pieces,
each verified against its digest), and the ranks agree in one more all_gather that every rank
did, so the version is a delta; if any rank failed, every rank drops what it read and the
version is an anchor.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import math
import os
import pickle
import socket
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from deltastore import errors as _errors
from deltastore.write.commit import attempt_clock, now, put_immutable
from deltastore.write.encode import UPLOADS_IN_FLIGHT, LayoutWorks, encode_version
from deltastore.errors import (
    CorruptObjectError,
    DeltastoreError,
    InvalidStateDictError,
    PartFailedError,
    ShardMismatchError,
)
from deltastore.layout.groups import tied_names, unit_order, unit_reference
from deltastore._util.heap import release_free_heap
from deltastore.format.history import History, VersionInfo
from deltastore._util.jobs import default_threads
from deltastore.format.keys import manifest_key, new_attempt_id, part_key, sha256_hex
from deltastore.format.manifest import encode_joined, join_parts
from deltastore.format.models import (
    DEFAULT_MAX_ATTEMPT_S,
    Head,
    Layout,
    Manifest,
    ObjectRef,
    PartRef,
    SegmentRef,
    Stats,
)
from deltastore.format.parts import encode_part
from deltastore.write.publisher import _Tip
from deltastore.storage import open_store
from deltastore.layout.tensors import (
    CHUNK_TARGET_BYTES,
    TensorSpec,
    chunk_rows_for,
    dtype_name,
    grid_cols_for,
    torch_dtype,
    validate_state_dict,
)

logger = logging.getLogger(__name__)

#: The rank that reads HEAD, writes the layout and the version manifest and CASes HEAD: the
#: one rank every process group has.
COORDINATOR = 0
#: Pickled bytes a broadcast or all_gather carries in its one round (after an 8-byte length):
#: a steady version's report, plan and outcome are ~0.3-2 KB, so each is one gloo operation
#: instead of the two (sizes, then data) of torch's object collectives; a larger object (the
#: first version's claims, large metadata) takes a second round with its remaining bytes.
INLINE_BYTES = 8192
#: The length prefix of a collective's buffer (little-endian unsigned).
_LENGTH_BYTES = 8
#: Versions of :meth:`ShardedPublisher.publish_async` rank 0 holds at once between the gather and
#: HEAD (one committing, one waiting): a store slower than the ranks makes the next call wait on
#: rank 0, instead of parts piling up (each holds its part manifests, and a deadline runs).
COMMITS_IN_FLIGHT = 2


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
class _Claim:
    """What one rank holds of one tensor (sent to every rank in step 1)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    #: shares memory with another tensor this rank passes (tied weights); only looked for
    #: when the publisher has ``column_slices``: a tensor tied on any rank gets no grid.
    tied: bool = False


@dataclass(frozen=True, slots=True)
class _PartChunk:
    """A chunk of this rank's part, its index shifted to the whole tensor's: what
    :func:`~deltastore.format.parts.encode_part` reads of a ChunkEntry. Not a pydantic model: the
    part's table is built once per version and discarded (its bytes are what rank 0 joins and
    checks), and a validated copy per chunk cost ~9 µs × 169 chunks per rank (design 010 D8)."""

    index: int
    digest: str
    full: SegmentRef | None
    delta: SegmentRef | None


@dataclass(frozen=True, slots=True)
class _PartTensor:
    """One tensor of this rank's part: what encode_part reads of a TensorEntry (as
    :class:`_PartChunk`: the encoder's entries are validated; these only regroup them)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_rows: int
    chunks: tuple[Any, ...]


@dataclass(frozen=True)
class _Share:
    """This rank's share of a layout (:meth:`ShardedPublisher._share_of`): for each tensor it
    publishes, in layout order, its local spec, the index of its first chunk in the whole
    tensor (its first row block times the column blocks, design 011 D11) and its first row;
    valid for ``layout`` and this rank's ``claims``."""

    layout: Layout
    claims: tuple[_Claim, ...]
    specs: dict[str, TensorSpec]
    first_chunk: dict[str, int]
    first_row: dict[str, int]


@dataclass(frozen=True)
class _Report:
    """Step 1: one rank's view, or its error.

    ``claims`` is None when they are this rank's claims of the last layout every rank planned,
    whose digest ``planned`` names (design 010 D7): a steady version sends a digest, not
    O(tensors) claims per rank."""

    rank: int
    claims: tuple[_Claim, ...] | None = ()
    planned: str | None = None  # digest of the claims of the layout this rank planned last
    held: tuple[int, str] | None = None  # (version, manifest key) its reference copy is at
    known: int | None = None  # the last version this rank saw committed
    step: int | None = None
    anchor: bool = False
    error: tuple[str, str] | None = None
    plan: _Plan | None = None  # rank 0 only: its steady-state plan, made before step 1 (D6)
    settled: tuple[tuple[int, Any], ...] = ()  # rank 0 only: outcomes of earlier async versions (D10)


@dataclass(frozen=True)
class _Resume:
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
class _Plan:
    """Step 2: what rank 0 decided, or the error every rank raises."""

    version: int = 0
    attempt: str = ""
    kind: str = "anchor"
    has_base: bool = False
    lineage: str | None = None
    layout_ref: ObjectRef | None = None
    error: tuple[str, str] | None = None
    base: tuple[int, str] | None = None  # a pre-plan: the (version, attempt) every rank must hold
    ahead: bool = False  # planned on a version still being committed (publish_async, D10)
    settled: tuple[tuple[int, Any], ...] = ()  # outcomes rank 0 waited for before planning (D10)
    resume: _Resume | None = None  # a delta on HEAD's version once every rank has read its rows (D11)


@dataclass(frozen=True)
class _Forecast:
    """Rank 0: what the store will hold once the last version handed to the committer is
    committed: the version (and attempt) the next one builds on, its tip and anchor (D10)."""

    version: int
    attempt: str
    lineage: str | None
    tip: _Tip
    anchor_version: int


class _VersionFuture(Future):
    """The Future :meth:`ShardedPublisher.publish_async` returns. It is resolved by this rank's
    own next collective call (the outcome comes from rank 0 with it), so waiting for it with no
    timeout before that call would wait forever: that raises instead."""

    def result(self, timeout: float | None = None) -> Any:
        self._check(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check(timeout)
        return super().exception(timeout)

    def _check(self, timeout: float | None) -> None:
        if timeout is None and not self.done():
            raise InvalidStateError("this version's outcome reaches the ranks with their next publish_async, publish, "
                                    "flush or close (collectives): call flush() first, or pass a timeout")


def _framed(data: bytes, inline: int) -> torch.Tensor:
    """``inline`` + 8 bytes: the length of ``data``, then its first ``inline`` bytes (zeros after)."""
    buf = torch.zeros(_LENGTH_BYTES + inline, dtype=torch.uint8)
    head = len(data).to_bytes(_LENGTH_BYTES, "little") + data[:inline]
    buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return buf


def _error_of(e: BaseException) -> tuple[str, str]:
    return (type(e).__name__, str(e))


def _done(outcome: tuple[str, Any]) -> Future[tuple[str, Any]]:
    """A Future already resolved with ``outcome``."""
    f: Future[tuple[str, Any]] = Future()
    f.set_result(outcome)
    return f


def _raise(error: tuple[str, str], *, default: type[DeltastoreError] = PartFailedError) -> None:
    """Raise an error reported by another rank: its own deltastore class when it has one (so a
    ConflictError or FencedError reads the same on every rank), else ``default``."""
    raise _exception(error, default=default)


def _exception(error: tuple[str, str], *, default: type[DeltastoreError] = PartFailedError) -> DeltastoreError:
    """The exception :func:`_raise` raises."""
    name, message = error
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, DeltastoreError):
        try:
            return cls(message)
        except TypeError:  # a class whose constructor wants more than a message
            pass
    return default(f"{name}: {message}")


def _next_tip(tip: _Tip | None, plan: _Plan, layout: Layout, delta_bytes: int, full_bytes: int, key: str) -> _Tip:
    """The tip after committing ``plan`` on ``tip`` (design 005 D7/D10 bookkeeping): what rank 0
    keeps after a commit, and forecasts before one (D10; ``key`` unknown then: "")."""
    restart = not plan.has_base or tip is None or not tip.schema3
    cum = 0 if restart else tip.cum + delta_bytes  # type: ignore[union-attr]
    anchor = plan.kind == "anchor"
    return _Tip(
        version=plan.version, key=key, schema3=True, chain_start=plan.version if restart else tip.chain_start,  # type: ignore[union-attr]
        cum=cum, layout=layout, layout_ref=plan.layout_ref, anchor=plan.version if anchor else tip.anchor,  # type: ignore[union-attr]
        anchor_key=key if anchor else tip.anchor_key,  # type: ignore[union-attr]
        anchor_full=full_bytes if anchor else tip.anchor_full,  # type: ignore[union-attr]
        anchor_cum=cum if anchor else tip.anchor_cum,  # type: ignore[union-attr]
    )


def plan_layout(reports: Sequence[_Report], world: int, chunk_bytes: int, column_slices: Sequence[str] = (),
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
    order: dict[str, list[tuple[int, _Claim]]] = {}
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


def _local_shard(name: str, t: Any) -> tuple[torch.Tensor, int, tuple[int, ...]]:
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


class ShardedPublisher:
    """Publishes versions of a model whose rows are spread over the ranks of a process group.

    Create one on every rank with the same ``url`` and ``group``; call :meth:`publish` on
    every rank for each version, in the same order (it is a collective). Each rank passes only
    what it holds: plain tensors (owned whole), :class:`Rows` (a row range of a larger tensor),
    or FSDP2 parameters (DTensors sharded on dimension 0; their ``to_local()`` rows are read,
    never gathered). Rows several ranks pass alike (replicas, buffers every rank holds) are
    published by the lowest of them. A rank keeps a reference copy of its own rows only.

    The version becomes visible by one HEAD compare-and-swap on rank 0, after every rank's part
    is stored; until then nothing is visible, whatever fails. Readers need nothing special: a
    :class:`~deltastore.read.subscriber.Subscriber` reads a sharded version whole, bit-exactly.
    :meth:`publish_async` returns once the rank's part is stored and lets rank 0 commit while
    the ranks encode the next version (design 010 D10).

    Args:
        url: the store URL (as for :class:`~deltastore.write.publisher.Publisher`).
        group: the ``torch.distributed`` process group (default: the world). Object
            collectives over it carry a few small Python objects per publish.
        storage_options: passed to the storage backend.
        anchor_every, anchor_policy, anchor_cost_ratio, max_attempt_s, takeover,
            allow_unsafe_store, signing_key, allow_unsigned, dtype: as for Publisher (rank 0
            decides anchors, claims the store and signs, or refuses a signed store without a
            key on every rank; ``dtype`` casts floating tensors on every rank).
        writer_id: this rank's id (default ``host-pid-random``); recorded in its part.
        threads: encode threads per rank (default: this process's cores).
        chunk_bytes: target chunk size (default 16 MiB); chunk rows also divide every piece
            boundary, so no chunk crosses two ranks' rows.
        resume: when the ranks hold no reference copy of HEAD's version (a restarted job, or
            after a failure) and HEAD's layout is the one they plan now (same tensors, dtypes,
            shapes, row split and chunking), every rank reads back its own rows of HEAD's
            version, verified, so that the version is a delta (design 010 D11). Only the chunks
            of the rank's pieces are fetched (and the chain's manifests); memory: the rank's
            reference copy and the reader's bounded buffers. If any rank fails to read, every
            rank drops what it read and the version is an anchor. False: an anchor, as before.
        slice_align, column_slices: as for Publisher, for the column grid only (design 011
            D11): the tensors matching ``column_slices`` get the grid an unsharded publisher
            with ``slice_align`` gives them, chosen from their global shapes, so that
            tensor-parallel readers of a sharded store read only their column blocks. Row
            alignment stays the pieces' (``slice_align`` does not re-chunk rows here). Every
            rank must pass the same values (ShardMismatchError at construction otherwise).

    Raises:
        ShardMismatchError: (from publish) the ranks disagree on the layout, step or version.
        PartFailedError: (from publish) another rank failed; nothing was committed.
        Everything Publisher raises, on rank 0 and (re-raised by class) on the other ranks.

    Example::

        dist.init_process_group("gloo")
        fully_shard(model)
        pub = ShardedPublisher("s3://bucket/run", dtype=torch.bfloat16)
        for step in range(steps):
            train_step()
            pub.publish(model.state_dict(), step=step)  # every rank; DTensor shards, no gather
    """

    def __init__(
        self,
        url: str,
        *,
        group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        anchor_every: int | None = None,
        anchor_policy: Any = None,
        anchor_cost_ratio: float = 1.0,
        max_attempt_s: float = DEFAULT_MAX_ATTEMPT_S,
        takeover: bool = True,
        writer_id: str | None = None,
        threads: int | None = None,
        chunk_bytes: int = CHUNK_TARGET_BYTES,
        allow_unsafe_store: bool = False,
        signing_key: Any = None,
        allow_unsigned: bool = False,
        dtype: torch.dtype | None = None,
        resume: bool = True,
        slice_align: int | None = None,
        column_slices: Sequence[str] | None = None,
    ):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ShardedPublisher needs torch.distributed initialised (init_process_group) on every rank")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # CPU tensors carry the collectives' bytes on gloo; other backends use torch's object collectives
        self._lean = str(dist.get_backend(group)) == "gloo"
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-r{self.rank}"
        self.chunk_bytes = chunk_bytes
        self.dtype = dtype
        self.threads = threads or default_threads()
        self.max_attempt_s = max_attempt_s
        self.resume = resume
        self._coordinator = None
        self.slice_align = slice_align
        self.column_slices: tuple[str, ...] = tuple(column_slices or ()) if not isinstance(column_slices, str) else ()
        # this rank's encode of an anchor without a base: its grid units' unit-order buffers and
        # specs, adopted as the reference copy once the version is committed (design 011 D3)
        self._fresh: tuple[Mapping[str, TensorSpec], dict[str, torch.Tensor]] | None = None
        self._closed = False
        self._reference: dict[str, torch.Tensor] | None = None  # this rank's rows of the held version
        self._held: tuple[int, str] | None = None  # (version, attempt) of the reference copy
        self._layout: Layout | None = None
        self._known: int | None = None
        # The layout planned from the last claims (and their digest): a trainer passes the same
        # claims every step, and planning is O(tensors × ranks) per version (every rank plans).
        self._planned: tuple[tuple[tuple[_Claim, ...], ...], Layout, str] | None = None
        self._share: _Share | None = None  # this rank's share of the layout planned last
        # publish_async (design 010 D10). Every rank: the Futures it returned, by version, not
        # yet resolved, and its own error for a version whose part it failed to write.
        self._waiting: dict[int, _VersionFuture] = {}
        self._own_errors: dict[int, BaseException] = {}
        # Rank 0: the versions handed to the committer thread (or failed before it), in order,
        # with the Future of each one's outcome; the forecast of the store once they commit;
        # whether one failed (those after it, planned on it, then fail too: set by the committer).
        self._committer: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future[tuple[str, Any]]]] = []
        self._forecast: _Forecast | None = None
        self._broken = False
        error: tuple[str, str] | None = None
        try:
            # the same checks as Publisher's, before any rank opens the store
            if slice_align is not None and (isinstance(slice_align, bool) or not isinstance(slice_align, int)
                                            or slice_align < 1):
                raise ValueError(f"slice_align must be an int ≥ 1 or None, got {slice_align!r}")
            if column_slices is not None:
                if isinstance(column_slices, str) or not all(isinstance(p, str) for p in column_slices):
                    raise ValueError(f"column_slices must be a sequence of fnmatch patterns, got {column_slices!r}")
                if slice_align is None:
                    raise ValueError("column_slices needs slice_align: the tensor-parallel degree (e.g. slice_align=8)")
            if self.rank == COORDINATOR:
                from deltastore.write.publisher import Publisher

                # Rank 0's HEAD side is an ordinary publisher's (claim, fencing, anchors, back,
                # lost responses); it never encodes a state itself.
                self._coordinator = Publisher(
                    url, storage_options=storage_options, anchor_every=anchor_every, anchor_policy=anchor_policy,
                    anchor_cost_ratio=anchor_cost_ratio, max_attempt_s=max_attempt_s, takeover=takeover,
                    writer_id=self.writer_id, threads=1, chunk_bytes=chunk_bytes, allow_unsafe_store=allow_unsafe_store,
                    resume=False, signing_key=signing_key, allow_unsigned=allow_unsigned, skip_unchanged=False,
                )
                self.store = self._coordinator.store
            else:
                self.store = open_store(url, storage_options=dict(storage_options or {}))
        except BaseException as e:  # noqa: BLE001 - every rank learns it below, then it is raised
            error = _error_of(e)
            self._open_error: BaseException | None = e
        else:
            self._open_error = None
        # Every rank opens or none does: a rank left waiting in the first publish would hang.
        # The grid policy is a layout field every rank must agree on (design 011 D11).
        policy = (self.column_slices, self.slice_align if self.column_slices else None)
        opened = self._all_gather((error, policy))
        errors = [e for e, _ in opened]
        if any(errors):
            self._release()
            if self._open_error is not None:
                raise self._open_error
            _raise(next(e for e in errors if e is not None))
        policies = [p for _, p in opened]
        if any(p != policies[0] for p in policies):
            self._release()
            rank = next(r for r, p in enumerate(policies) if p != policies[0])
            (cols0, align0), (cols, align) = policies[0], policies[rank]
            raise ShardMismatchError(f"the ranks disagree on the column grid: rank 0 has column_slices={list(cols0)}, "
                                     f"slice_align={align0}, rank {rank} column_slices={list(cols)}, slice_align={align}; "
                                     "every rank must pass the same (nothing was written)")
        self.url = self.store.url
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-encode")
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-upload")
        self._layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across versions

    # --- collectives ------------------------------------------------------------------------

    # On a gloo group the three collectives move pickled bytes in CPU tensors themselves (design
    # 010 D9): a small object's all_gather or broadcast is one gloo operation, not torch's two
    # (sizes, then data) with their device and size bookkeeping; two ranks, per version, 2.7 ->
    # 1.7 ms of a rank's CPU and 6.3 -> 3.1 ms of wall on a loaded 2-core machine. Any other
    # backend (NCCL: device tensors) keeps torch's. Pickle among one job's ranks, as torch's.

    def _all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        try:
            if self._lean:
                out = self._all_gather_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # gloo/NCCL: a rank died or the group timed out
            raise PartFailedError(f"a rank of the sharded publisher of {getattr(self, 'url', '?')} was lost ({e}); "
                                  "nothing was committed by this step") from e
        return out

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        try:
            if self._lean:
                return self._broadcast_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == COORDINATOR else b"")
            self._dist.broadcast_object_list(box, src=self._global(COORDINATOR), group=self.group)
        except RuntimeError as e:
            raise PartFailedError(f"a rank of the sharded publisher of {self.url} was lost ({e}); "
                                  "nothing was committed unless rank 0 reports otherwise") from e
        return box[0]

    def _gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == COORDINATOR else None
        try:
            if self._lean:
                return self._gather_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            self._dist.gather_object(obj, out, dst=self._global(COORDINATOR), group=self.group)
        except RuntimeError as e:
            raise PartFailedError(f"a rank of the sharded publisher of {self.url} was lost ({e}); nothing was committed") from e
        return out

    def _all_gather_bytes(self, data: bytes) -> list[Any]:
        """Every rank's object: one all_gather of ``INLINE_BYTES`` (and a length) per rank; a
        second round of the remaining bytes only when some rank's object is larger."""
        mine = _framed(data, INLINE_BYTES)
        rows = torch.empty((self.world, mine.numel()), dtype=torch.uint8)
        self._dist.all_gather(list(rows.unbind(0)), mine, group=self.group)
        table = rows.numpy()
        lengths = [int.from_bytes(table[r, :_LENGTH_BYTES].tobytes(), "little") for r in range(self.world)]
        rest = max(lengths) - INLINE_BYTES
        if rest <= 0:
            return [pickle.loads(table[r, _LENGTH_BYTES:_LENGTH_BYTES + n].tobytes()) for r, n in enumerate(lengths)]
        tail = torch.zeros(rest, dtype=torch.uint8)
        extra = data[INLINE_BYTES:]
        if extra:
            tail[:len(extra)] = torch.frombuffer(bytearray(extra), dtype=torch.uint8)
        tails = torch.empty((self.world, rest), dtype=torch.uint8)
        self._dist.all_gather(list(tails.unbind(0)), tail, group=self.group)
        more = tails.numpy()
        return [pickle.loads(table[r, _LENGTH_BYTES:_LENGTH_BYTES + min(n, INLINE_BYTES)].tobytes()
                             + more[r, :max(n - INLINE_BYTES, 0)].tobytes()) for r, n in enumerate(lengths)]

    def _broadcast_bytes(self, data: bytes) -> Any:
        """Rank 0's object (``data``: its pickle on rank 0): one broadcast of ``INLINE_BYTES``
        and the length; a second of the remaining bytes only for a larger object."""
        src = self._global(COORDINATOR)
        buf = _framed(data, INLINE_BYTES)
        self._dist.broadcast(buf, src=src, group=self.group)
        head = buf.numpy()
        n = int.from_bytes(head[:_LENGTH_BYTES].tobytes(), "little")
        if n <= INLINE_BYTES:
            return pickle.loads(head[_LENGTH_BYTES:_LENGTH_BYTES + n].tobytes())
        if self.rank == COORDINATOR:
            tail = torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
        else:
            tail = torch.empty(n - INLINE_BYTES, dtype=torch.uint8)
        self._dist.broadcast(tail, src=src, group=self.group)
        return pickle.loads(head[_LENGTH_BYTES:].tobytes() + tail.numpy().tobytes())

    def _gather_bytes(self, data: bytes) -> list[Any] | None:
        """Every rank's object on rank 0 (None elsewhere): an all_gather of the lengths (every
        rank sends a buffer of the largest), then one gather."""
        lengths = torch.empty((self.world, 1), dtype=torch.int64)
        self._dist.all_gather(list(lengths.unbind(0)), torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        sizes = lengths.view(-1).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = torch.empty((self.world, buf.numel()), dtype=torch.uint8) if self.rank == COORDINATOR else None
        self._dist.gather(buf, list(rows.unbind(0)) if rows is not None else None, dst=self._global(COORDINATOR),
                          group=self.group)
        if rows is None:
            return None
        table = rows.numpy()
        return [pickle.loads(table[r, :n].tobytes()) for r, n in enumerate(sizes)]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    # --- publish ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest version this rank saw committed (0 before the first)."""
        return self._known or 0

    def publish(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None = None,
                metadata: Mapping[str, Any] | None = None, anchor: bool = False) -> VersionInfo:
        """Commit this rank's rows, with every other rank's, as the next version (a collective).

        Args:
            state_dict: what this rank holds: name → tensor, :class:`Rows` or DTensor (or an
                FSDP2-sharded ``nn.Module``). The tensors must not change while this runs.
            step: the trainer's step; every rank must pass the same.
            metadata: user JSON, taken from rank 0.
            anchor: write a full snapshot (any rank asking is enough).

        Returns:
            The committed version's VersionInfo (the same on every rank).

        Raises:
            ShardMismatchError: ranks disagree on a tensor's dtype/shape, who owns which rows,
                the step, or the version they hold; nothing was written.
            PartFailedError: another rank failed or was lost; nothing was committed.
            InvalidStateDictError, StorageError, ConflictError, FencedError, ...: as Publisher
                (this rank's own failure, or rank 0's commit outcome).
        """
        if self._waiting:  # every rank has the same ones: earlier publish_async calls report first
            self.flush()
        result = self._run(state_dict, step=step, metadata=metadata, anchor=anchor, asynchronous=False)
        assert isinstance(result, VersionInfo)
        return result

    def publish_async(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None = None,
                      metadata: Mapping[str, Any] | None = None, anchor: bool = False) -> Future[VersionInfo]:
        """Store this rank's rows of the next version and go on; rank 0 commits it in the
        background (a collective, design 010 D10).

        Runs :meth:`publish`'s steps up to rank 0 holding every part: when it returns, this
        rank's rows are encoded and uploaded, so the caller may change its tensors. Rank 0 then
        joins the parts and CASes HEAD on a thread of its own, one version at a time, in call
        order, while the ranks go on to the next version, which is planned on this one (a delta
        on it). The version becomes visible as with :meth:`publish`: once, when every part is
        stored, or never.

        The outcome reaches every rank with its next collective call on this publisher
        (``publish_async``, :meth:`publish`, :meth:`flush` or :meth:`close`): that call resolves
        the returned Future, and if the version failed it raises the failure (once; the call's
        own state is then not published) and every rank drops its reference copy, so the next
        version resumes from HEAD's (or is an anchor). A version planned on one that failed
        fails too (it was a delta on a version that is not in the store); its Future says so,
        and only the first failure is raised. Call :meth:`flush` (a collective) to wait for
        every outcome.

        Args:
            state_dict, step, metadata, anchor: as for :meth:`publish`.

        Returns:
            A Future of the committed version's VersionInfo, resolved on every rank by its next
            call on this publisher; ``result()`` without a timeout before then raises
            ``InvalidStateError`` (it would wait forever).

        Raises:
            What :meth:`publish` raises before it writes (bad input, ShardMismatchError, a plan
            failure), and an earlier version's failure (once). A failure while this rank
            encodes or uploads is this version's outcome, reported like a failed commit.
        """
        result = self._run(state_dict, step=step, metadata=metadata, anchor=anchor, asynchronous=True)
        assert isinstance(result, Future)
        return result

    def flush(self) -> None:
        """Wait until every :meth:`publish_async` version is committed or failed (a collective:
        rank 0 waits for its committer and tells every rank), and resolve their Futures.

        Raises:
            DeltastoreError: the first failure not yet raised (once).
        """
        if self._closed:
            raise _errors.StorageError(f"sharded publisher for {self.url} is closed")
        settled = self._settle(block=True) if self.rank == COORDINATOR else ()
        settled = self._broadcast(settled)
        failure = self._apply(settled)
        if failure is not None:
            raise failure

    def _run(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None, metadata: Mapping[str, Any] | None,
             anchor: bool, asynchronous: bool) -> VersionInfo | Future[VersionInfo]:
        if self._closed:
            raise _errors.StorageError(f"sharded publisher for {self.url} is closed")
        # The attempt deadline runs from before its first write (on rank 0: the layout object,
        # or its pre-plan, which writes nothing, made before step 1).
        deadline = attempt_clock() + self.max_attempt_s
        # --- 0: rank 0 collects the outcomes of earlier publish_async versions (D10) ---
        known = self._known  # what every rank reports: the outcomes below are applied after
        settled: tuple[tuple[int, Any], ...] = ()
        failure: BaseException | None = None
        if self.rank == COORDINATOR and self._pending:
            settled = self._settle(block=False)
            if any(outcome[0] != "ok" for _, outcome in settled):
                settled += self._settle(block=True)  # the rest were planned on the failed one: they fail at once
            failure = self._apply(settled)
        # --- 1: what each rank holds (and, from rank 0, the plan of a steady-state version) ---
        local: dict[str, tuple[torch.Tensor, int]] = {}
        report: _Report
        pre: _Plan | None = None
        own_plan_error: BaseException | None = None
        try:
            from deltastore.write.publisher import _int_step, _json_metadata

            step = _int_step(step)
            meta = _json_metadata(metadata) if self.rank == COORDINATOR else {}
            claims = []
            state = state_dict.state_dict() if isinstance(state_dict, torch.nn.Module) else state_dict
            if not isinstance(state, Mapping) or not state:
                raise InvalidStateDictError("expected a non-empty state dict (name → tensor, Rows or DTensor)")
            names: dict[torch.dtype, str] = {}
            given: dict[str, torch.Tensor] = {}  # as passed (before a cast): where ties are seen
            for name, value in state.items():
                t, start, shape = _local_shard(name, value)
                given[name] = t
                if self.dtype is not None and t.is_floating_point():
                    t = t.detach().to(self.dtype)
                dt = t.dtype
                dname = names.get(dt) or names.setdefault(dt, dtype_name(dt))
                claims.append(_Claim(name, dname, shape, start, start + (t.shape[0] if t.dim() else 1)))
                local[name] = (t, start)
            if self.column_slices:  # a tied tensor gets no grid (design 011 D6), on any rank
                tied = tied_names(given, max_bytes=None)
                claims = [dataclasses.replace(c, tied=True) if c.name in tied else c for c in claims]
            del given
            # One batched check of every local tensor (one scan, design 007's TensorScan), not
            # one call per tensor: 165 calls cost ~2.5 ms per rank per version (design 010 D8).
            validate_state_dict({name: t for name, (t, _) in local.items()})
            if self.rank == COORDINATOR and failure is None:
                try:
                    # on a version still being committed: planned on its forecast (D10)
                    pre = self._preplan_ahead(anchor=anchor) if self._pending else self._preplan(anchor=anchor)
                except Exception as e:  # noqa: BLE001 - raised on every rank after the layout checks
                    pre = _Plan(error=_error_of(e))
                    own_plan_error = e
            mine_claims = tuple(claims)
            last = self._planned
            same = last is not None and last[0][self.rank] == mine_claims  # then the digest says it
            if same:  # the stored tuple, equal: later comparisons with it (_share_of) are identity checks
                mine_claims = last[0][self.rank]  # type: ignore[union-attr]
            report = _Report(self.rank, None if same else mine_claims, planned=last[2] if last is not None else None,
                             held=self._held, known=known, step=step, anchor=anchor, plan=pre, settled=settled)
        except Exception as e:  # noqa: BLE001 - told to every rank, raised below
            report = _Report(self.rank, error=_error_of(e), settled=settled)
            own: BaseException | None = e
        else:
            own = None
        reports: list[_Report] = self._all_gather(report)
        if self.rank != COORDINATOR:
            failure = self._apply(reports[COORDINATOR].settled)
        if failure is not None:  # an earlier version failed: raised once, on every rank; this state is not published
            raise failure
        failed = [r for r in reports if r.error is not None]
        if failed:
            if own is not None:
                raise own
            _raise(failed[0].error, default=PartFailedError)  # type: ignore[arg-type]
        if all(r.claims is None for r in reports) and len({r.planned for r in reports}) == 1:
            # every rank: the claims of the layout every rank planned last (one digest)
            assert self._planned is not None
            layout = self._planned[1]
        else:
            reports = self._full_claims(reports, mine_claims)
            claimed = tuple(r.claims or () for r in reports)
            if self._planned is not None and self._planned[0] == claimed:
                layout = self._planned[1]
            else:
                layout = plan_layout(reports, self.world, self.chunk_bytes, self.column_slices,  # the same verdict
                                     self.slice_align)  # on every rank
                self._planned = (claimed, layout, hashlib.sha256(repr(claimed).encode()).hexdigest())
        steps = {r.step for r in reports}
        if len(steps) > 1:
            raise ShardMismatchError(f"the ranks publish different steps {sorted(map(str, steps))}: every rank must "
                                     "call publish for the same step")
        known = {r.known for r in reports if r.known is not None}
        if len(known) > 1:
            raise ShardMismatchError(f"the ranks hold different versions {sorted(known)} of {self.url}: a rank missed a "
                                     "publish; nothing was written")
        share = self._share_of(layout, mine_claims, local)
        mine = {name: local[name][0] for name in share.specs}

        # --- 2: rank 0 plans the version (unless its pre-plan holds: no round trip then) ---
        plan: _Plan | None = reports[COORDINATOR].plan
        if plan is not None and plan.error is not None:
            if self.rank == COORDINATOR:
                own = own_plan_error
        elif plan is None or not self._preplan_holds(plan, reports, layout):
            plan = None
            if self.rank == COORDINATOR:
                # Planning reads and writes the coordinator's state: the committer must be done with it.
                waited = self._settle(block=True) if self._pending else ()
                failure = self._apply(waited)
                try:
                    plan = _Plan(settled=waited) if failure is not None else dataclasses.replace(
                        self._plan(reports, layout, anchor=any(r.anchor for r in reports)), settled=waited)
                except Exception as e:  # noqa: BLE001
                    plan = _Plan(error=_error_of(e), settled=waited)
                    own = e
            plan = self._broadcast(plan)
            assert plan is not None
            if self.rank != COORDINATOR:
                failure = self._apply(plan.settled)
            if failure is not None:
                raise failure
        assert plan is not None
        if plan.error is not None:
            self._drop()
            if own is not None:
                raise own
            _raise(plan.error)
        if plan.resume is not None:  # --- 2b: every rank reads its rows of HEAD's version (D11) ---
            plan = self._resume_from(plan, layout, share)
            # Nothing of the attempt is written yet (a resume reuses HEAD's layout object), and
            # reading a large shard back takes a while: the attempt deadline runs from here.
            deadline = attempt_clock() + self.max_attempt_s

        # --- 3: encode and upload this rank's part ---
        result: tuple[str, Any]
        try:
            result = ("ok", self._write_part(plan, layout, mine, share))
        except Exception as e:  # noqa: BLE001
            result = ("error", _error_of(e))
            own = e
        except BaseException as e:  # KeyboardInterrupt & co: tell the others, then leave
            self._drop()
            self._gather(("error", _error_of(e)))
            raise

        # --- 4 and 5: rank 0 joins the parts and commits (publish_async: in the background) ---
        try:
            return self._conclude(plan, layout, mine, result, own, reports, meta, step, deadline, asynchronous=asynchronous)
        except BaseException:
            # The version failed, or a rank was lost and its outcome is unknown here: encoding
            # advanced the reference to rows no committed version may hold (SPEC §5 step 7).
            self._drop()
            raise

    def _conclude(self, plan: _Plan, layout: Layout, mine: Mapping[str, torch.Tensor], result: tuple[str, Any],
                  own: BaseException | None, reports: Sequence[_Report], meta: dict[str, Any], step: int | None,
                  deadline: float, *, asynchronous: bool) -> VersionInfo | Future[VersionInfo]:
        """Steps 4 and 5: the parts to rank 0, which commits (publish) or hands them to its
        committer (publish_async); raises the version's failure on every rank."""
        parts = self._gather(result)
        if asynchronous:
            return self._launch(plan, layout, mine, parts, own, reports, meta, step, deadline)
        outcome: tuple[str, Any] = ("error", ("PartFailedError", "no outcome"))
        if self.rank == COORDINATOR:
            assert parts is not None
            bad = [(r, p[1]) for r, p in enumerate(parts) if p[0] != "ok"]
            if bad:
                why = f"part {bad[0][0]} of version {plan.version} failed ({bad[0][1][0]}: {bad[0][1][1]}); nothing was committed"
                outcome = ("error", ("PartFailedError", why))
            else:
                try:
                    outcome = ("ok", self._commit(plan, layout, [p[1] for p in parts], reports, meta, step, deadline))
                except Exception as e:  # noqa: BLE001
                    outcome = ("error", _error_of(e))
                    own = e
        outcome = self._broadcast(outcome)
        if outcome[0] != "ok":
            if own is not None:
                raise own
            _raise(outcome[1])
        info: VersionInfo = outcome[1]
        self._known = info.version
        self._held = (info.version, plan.attempt)
        self._layout = layout
        if not plan.has_base:  # an anchor without a base: these rows are the reference from now on
            self._reference = self._new_reference(mine)
        return info

    def _new_reference(self, mine: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reference copy after an anchor without a base: this rank's rows copied to the
        CPU, a grid unit in its unit order (the buffers its encode gathered into: no extra
        pass, design 011 D3)."""
        specs, gathered = self._fresh if self._fresh is not None else ({}, {})
        self._fresh = None
        out = unit_reference(mine, specs, owned=False, gathered=gathered) if specs else {}
        for n, t in mine.items():  # not reached for a part just encoded: its specs name every tensor
            if n not in out:
                out[n] = t.detach().to("cpu", copy=True)
        return out

    def _full_claims(self, reports: list[_Report], mine: tuple[_Claim, ...]) -> list[_Report]:
        """``reports`` (in rank order) with every rank's claims: those sent as a digest are the
        claims of the layout planned last, which every rank holds when every report names the
        same digest; else (a rank planned another layout, or none) one more round sends every
        rank's claims. The choice depends on the reports only, so every rank makes it alike."""
        reports = sorted(reports, key=lambda r: r.rank)
        if all(r.claims is not None for r in reports):
            return reports
        digests = {r.planned for r in reports}
        if len(digests) == 1 and None not in digests:  # this rank's digest among them: _planned is that
            assert self._planned is not None
            last = self._planned[0]
            return [r if r.claims is not None else dataclasses.replace(r, claims=last[r.rank]) for r in reports]
        full = self._all_gather(mine)
        return [dataclasses.replace(r, claims=full[r.rank]) for r in reports]

    def _share_of(self, layout: Layout, claims: tuple[_Claim, ...], local: Mapping[str, tuple[torch.Tensor, int]]) -> _Share:
        """What this rank publishes of ``layout``: the tensors whose pieces the layout gives it
        (the lowest rank of a replicated range), each one's local spec and first chunk.

        Made once per layout and claims, then reused (design 010 D8): what it depends on of the
        local tensors — name, dtype, global shape, first and last row — is exactly this rank's
        claims, which every publish builds anew from the tensors and compares with the last ones
        anyway (to send a digest). The layout object is replaced whenever any rank's claims
        change. Nothing keyed by tensor identity: a tensor swapped for another of the same claim
        is encoded from the new one."""
        last = self._share
        if last is not None and last.layout is layout and last.claims == claims:
            if last.claims is not claims:  # keep the tuple publish passes: the next check is by identity
                self._share = last = dataclasses.replace(last, claims=claims)
            return last
        specs: dict[str, TensorSpec] = {}
        first_chunk: dict[str, int] = {}
        first_row: dict[str, int] = {}
        for i, name in enumerate(layout.name):
            if name not in local:
                continue
            t, start = local[name]
            bounds = (0, *(layout.pieces[i] or ()))
            for b, owner in zip(bounds, layout.piece_parts[i] or ()):
                if owner == self.rank and b == start:
                    rows = layout.chunk_rows[i]
                    spec = TensorSpec(name, layout.dtype[i], tuple(t.shape), rows, (), layout.chunk_cols[i])
                    specs[name] = spec
                    # a grid piece's local chunk (i, j) is global (first row block + i, j): the
                    # shift is whole row blocks of n_colblocks chunks (design 011 D11)
                    first_chunk[name] = start // rows * spec.n_colblocks
                    first_row[name] = start
        self._share = _Share(layout, claims, specs, first_chunk, first_row)
        return self._share

    # --- publish_async (design 010 D10) -----------------------------------------------------

    def _launch(self, plan: _Plan, layout: Layout, mine: Mapping[str, torch.Tensor], parts: list[Any] | None,
                own: BaseException | None, reports: Sequence[_Report], meta: dict[str, Any], step: int | None,
                deadline: float) -> Future[VersionInfo]:
        """Step 5 of :meth:`publish_async`, every rank: hold the version as committed (the next
        one is planned on it; a failure reported later drops it) and return its Future; rank 0
        hands the parts to its committer thread."""
        future = _VersionFuture()
        self._waiting[plan.version] = future
        if own is not None:  # this rank's part failed: its own error is the version's, for this rank
            self._own_errors[plan.version] = own
            self._drop()
        else:
            self._held = (plan.version, plan.attempt)
            self._layout = layout
            if not plan.has_base:  # the caller may change its tensors once this returns
                self._reference = self._new_reference(mine)
        if self.rank == COORDINATOR:
            assert parts is not None
            self._hand_over(plan, layout, parts, reports, meta, step, deadline)
        return future

    def _hand_over(self, plan: _Plan, layout: Layout, parts: list[Any], reports: Sequence[_Report],
                   meta: dict[str, Any], step: int | None, deadline: float) -> None:
        """Rank 0: queue the version's commit (at most COMMITS_IN_FLIGHT at once), or record
        its failure when a part failed, for the next call to report."""
        bad = [(r, p[1]) for r, p in enumerate(parts) if p[0] != "ok"]
        if bad:
            why = f"part {bad[0][0]} of version {plan.version} failed ({bad[0][1][0]}: {bad[0][1][1]}); nothing was committed"
            self._broken = True  # nothing is planned on it
            self._pending.append((plan.version, _done(("error", ("PartFailedError", why)))))
            return
        good = [p[1] for p in parts]
        try:
            forecast = self._forecast_after(plan, layout, good)
        except Exception as e:  # noqa: BLE001 - reading HEAD's tip failed: the version's outcome
            self._broken = True
            self._pending.append((plan.version, _done(("error", _error_of(e)))))
            return
        while sum(not f.done() for _, f in self._pending) >= COMMITS_IN_FLIGHT:
            wait([next(f for _, f in self._pending if not f.done())])
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltastore-commit")
        self._forecast = forecast
        self._pending.append((plan.version, self._committer.submit(
            self._commit_later, plan, layout, good, reports, meta, step, deadline)))

    def _forecast_after(self, plan: _Plan, layout: Layout, parts: Sequence[Any]) -> _Forecast:
        """Rank 0: the store once ``plan`` commits. A plan made ahead builds on the forecast it
        was planned on; any other was planned with the committer idle, so HEAD's tip is read."""
        pub = self._coordinator
        assert pub is not None
        if plan.ahead:
            assert self._forecast is not None
            tip: _Tip | None = self._forecast.tip
            anchor_version = self._forecast.anchor_version
        else:
            tip, anchor_version = pub._current_tip(), pub._anchor_version
        delta = sum(p[3].delta_bytes or 0 for p in parts)
        full = sum(p[3].full_bytes or 0 for p in parts)
        return _Forecast(version=plan.version, attempt=plan.attempt, lineage=plan.lineage,
                         tip=_next_tip(tip, plan, layout, delta, full, key=""),
                         anchor_version=plan.version if plan.kind == "anchor" else anchor_version)

    def _commit_later(self, plan: _Plan, layout: Layout, parts: Sequence[Any], reports: Sequence[_Report],
                      meta: dict[str, Any], step: int | None, deadline: float) -> tuple[str, Any]:
        """The committer thread: step 5 of one version (the coordinator's state is this thread's
        until the main thread has taken every outcome). A version planned on one that failed
        is not committed: its base is not in the store."""
        if self._broken:
            return ("after", ("PartFailedError", f"version {plan.version} was planned on version {plan.version - 1}, "
                                                 "which was not committed; nothing was committed"))
        try:
            return ("ok", self._commit(plan, layout, parts, reports, meta, step, deadline))
        except Exception as e:  # noqa: BLE001 - the version's outcome, reported by the next call
            self._broken = True
            logger.warning("sharded version %d of %s was not committed: %s: %s", plan.version, self.url, type(e).__name__, e)
            return ("error", _error_of(e))

    def _settle(self, *, block: bool) -> tuple[tuple[int, Any], ...]:
        """Rank 0: the outcomes of the queued versions, oldest first: those done (``block``:
        all, waiting for the committer). Once none is queued, a failure no longer taints the
        next plan (which reads HEAD again)."""
        out = []
        while self._pending:
            version, fut = self._pending[0]
            if not block and not fut.done():
                break
            out.append((version, fut.result()))
            self._pending.pop(0)
        if not self._pending:
            self._broken = False
        return tuple(out)

    def _apply(self, settled: Sequence[tuple[int, Any]]) -> BaseException | None:
        """Every rank: resolve the Futures of ``settled`` outcomes; a failure drops the
        reference copy (it holds rows of a version that is not in the store). Returns the
        first failure to raise (one planned on a failed version is only its Future's)."""
        first: BaseException | None = None
        for version, (status, value) in settled:
            future = self._waiting.pop(version, None)
            own = self._own_errors.pop(version, None)
            if status == "ok":
                self._known = value.version
                if future is not None:
                    future.set_result(value)
                continue
            self._drop()
            exc = own if own is not None else _exception(value)
            if future is not None:
                future.set_exception(exc)
            if status == "error" and first is None:
                first = exc
        return first

    def _preplan_ahead(self, *, anchor: bool) -> _Plan | None:
        """Rank 0, before step 1 while a version is being committed: the plan of the next one
        on it, from its forecast (the coordinator's state is the committer's meanwhile). None
        (then step 2 waits for the committer and plans from HEAD) unless every rank will hold
        the forecast version on its layout and no failure is known."""
        pub, f = self._coordinator, self._forecast
        assert pub is not None
        if f is None or self._broken or self._held != (f.version, f.attempt) or self._layout is None or f.tip.layout != self._layout:
            return None
        version = f.version + 1
        why = pub._anchor_reason(version, f.tip, has_base=True, anchor=anchor, anchor_version=f.anchor_version)
        return _Plan(version=version, attempt=new_attempt_id(), kind="anchor" if why else "delta", has_base=True,
                     lineage=f.lineage, layout_ref=f.tip.layout_ref, base=(f.version, f.attempt), ahead=True)

    def _drop(self) -> None:
        """Forget the reference copy: encoding advances it in place, so after a failure it
        matches no version (SPEC §5 step 7); the next version resumes from HEAD's version
        (design 010 D11) or is an anchor."""
        self._reference = None
        self._held = None
        self._fresh = None

    def _preplan(self, *, anchor: bool) -> _Plan | None:
        """Rank 0, before step 1: the plan step 2 would make in the steady state (the next
        version on the layout and base of the last one this publisher committed), sent with
        rank 0's report so that step 2 needs no broadcast when every report confirms it
        (:meth:`_preplan_holds`; design 010 D6). Writes nothing.

        Returns None when there is no such base (nothing committed yet by this publisher, a
        failure dropped the reference, HEAD moved under us): step 2 then plans from the reports.
        Raises what :meth:`CommitProtocol.prepare` raises (fenced, an outcome still unknown).
        """
        pub = self._coordinator
        assert pub is not None
        if pub._commits.prepare():
            pub._tip = None
            return None
        head = pub._head
        if self._held is None or self._layout is None or head is None or self._held != (head.version, head.commit_id):
            return None
        tip = pub._current_tip()
        if tip is None or tip.layout_ref is None or tip.layout != self._layout:
            return None
        version = pub.version + 1
        why = pub._anchor_reason(version, tip, has_base=True, anchor=anchor)
        return _Plan(version=version, attempt=new_attempt_id(), kind="anchor" if why else "delta", has_base=True,
                     lineage=pub._commits.lineage_for_commit(), layout_ref=tip.layout_ref, base=self._held)

    def _preplan_holds(self, plan: _Plan, reports: Sequence[_Report], layout: Layout) -> bool:
        """Whether rank 0's pre-plan is the plan step 2 would make from these reports; every
        rank decides alike (the same reports; equal ``held`` means each rank's last commit was
        that base, with the same layout). Else step 2 plans and broadcasts as before."""
        return (
            plan.base is not None and all(r.held == plan.base for r in reports) and self._layout == layout
            and (plan.kind == "anchor" or not any(r.anchor for r in reports))
        )

    def _plan(self, reports: Sequence[_Report], layout: Layout, *, anchor: bool) -> _Plan:
        """Rank 0: read HEAD, decide the version, its kind and attempt; write a new layout."""
        pub = self._coordinator
        assert pub is not None
        if pub._commits.prepare():
            pub._tip = None
        head = pub._head
        head_key = head.manifest if head is not None else None
        tip = pub._current_tip()
        pub._require_key_for(tip)  # HEAD may have moved to a signed version since open; before any write
        version = pub.version + 1
        # A delta needs every rank's reference at HEAD's version and HEAD's layout.
        has_base = (
            head_key is not None and tip is not None and tip.layout == layout
            and all(r.held == (head.version, head.commit_id) for r in reports)  # type: ignore[union-attr]
        )
        pub._specs = pub._reference = None  # only for _anchor_reason's wording of "no base"
        resume = None
        if not has_base and self.resume and not anchor and head is not None and head_key is not None:
            resume = self._resume_point(head, tip, layout, version)
            if resume is not None:
                has_base = True
                pub._anchor_version = tip.anchor  # type: ignore[union-attr] - HEAD's anchor: the policy counts from it
        why = pub._anchor_reason(version, tip, has_base=has_base, anchor=anchor)
        attempt = new_attempt_id()
        if tip is not None and tip.layout is not None and tip.layout == layout:
            layout_ref = tip.layout_ref
        else:
            layout_ref = pub._write_layout(attempt, layout)
        logger.info("sharded version %d of %s: %s over %d parts%s%s", version, self.url, "anchor" if why else "delta",
                    self.world, f" ({why})" if why else "",
                    f" on version {resume.version}, resumed from the store" if resume is not None else "")
        return _Plan(version=version, attempt=attempt, kind="anchor" if why else "delta", has_base=has_base,
                     lineage=pub._commits.lineage_for_commit(), layout_ref=layout_ref, resume=resume)

    # --- resume from the store (design 010 D11) ----------------------------------------------

    def _resume_point(self, head: Head, tip: _Tip | None, layout: Layout, version: int) -> _Resume | None:
        """Rank 0, planning: HEAD's version, when the ranks may rebuild their reference copies
        from it (its layout is the one they plan now, and the version would be a delta on it);
        else None (an anchor), with one line saying why."""
        pub = self._coordinator
        assert pub is not None
        why = None
        if tip is None or not tip.schema3 or tip.layout is None:
            why = "it is not a schema-3 version"
        elif tip.layout != layout:
            fields = ("parts", "name", "dtype", "shape", "piece_parts", "pieces", "chunk_rows", "chunk_cols")
            differ = next((f for f in fields if getattr(tip.layout, f) != getattr(layout, f)), "schema")
            why = (f"its layout differs from the one the ranks plan now (its {differ}: another world size, tensors, "
                   "row split or chunk size)")
        else:
            policy = pub._anchor_reason(version, tip, has_base=True, anchor=False, anchor_version=tip.anchor)
            if policy is not None:
                why = f"version {version} is an anchor anyway ({policy})"
        if why is not None:
            logger.info("sharded publisher of %s not resuming from version %d: %s", self.url, head.version, why)
            return None
        assert head.manifest is not None
        return _Resume(version=head.version, commit_id=head.commit_id, manifest=head.manifest,
                       sha256=head.manifest_sha256, lineage=head.lineage)

    def _resume_from(self, plan: _Plan, layout: Layout, share: _Share) -> _Plan:
        """Step 2b, every rank: rebuild the reference copy of this rank's rows at the version
        ``plan.resume`` names (unless held already), then agree: the plan if every rank did, else
        the same version as an anchor, every rank having dropped what it read. No rank ever holds
        another version than the others (design 010 D11)."""
        point = plan.resume
        assert point is not None
        reference: dict[str, torch.Tensor] | None = None
        verdict: tuple[str, tuple[str, str] | None] = ("ok", None)
        fetched = 0
        try:
            if self._held != (point.version, point.commit_id) or self._reference is None:
                reference, fetched = self._read_rows(point, layout, share)
        except Exception as e:  # noqa: BLE001 - every rank learns it below: an anchor then
            verdict = ("failed", _error_of(e))
        except BaseException as e:  # KeyboardInterrupt & co: the others give the version up, then leave
            self._drop()
            self._all_gather(("lost", _error_of(e)))
            raise
        verdicts = self._all_gather(verdict)
        lost = [(rank, v[1]) for rank, v in enumerate(verdicts) if v[0] == "lost"]
        if lost:  # a rank is leaving: nothing was written, so the version is given up on every rank
            self._drop()
            raise PartFailedError(f"rank {lost[0][0]} of the sharded publisher of {self.url} stopped while reading its "
                                  f"rows back ({lost[0][1][0]}: {lost[0][1][1]}); nothing was written")
        failed = [(rank, v[1]) for rank, v in enumerate(verdicts) if v[0] == "failed"]
        if failed:
            self._drop()
            rank, (name, message) = failed[0]
            logger.warning("sharded version %d of %s: an anchor, not a delta on version %d: rank %d could not read its "
                           "rows back (%s: %s)", plan.version, self.url, point.version, rank, name, message)
            return dataclasses.replace(plan, kind="anchor", has_base=False, resume=None)
        if reference is not None:
            self._reference = reference
            logger.info("rank %d resumed from version %d of %s: its rows of %d tensors, %d bytes read", self.rank,
                        point.version, self.url, len(reference), fetched)
        self._held = (point.version, point.commit_id)
        self._layout = layout
        return dataclasses.replace(plan, resume=None)

    def _read_rows(self, point: _Resume, layout: Layout, share: _Share) -> tuple[dict[str, torch.Tensor], int]:
        """This rank's rows of version ``point`` (its share of ``layout``), as a reader reads a
        partial pull: the chain from the anchor, only the chunks of these rows, each verified
        against its digest. Returns the tensors (this rank's local shapes) and the segment bytes
        fetched.

        Raises:
            CorruptObjectError: the manifest is not HEAD's version (its SHA-256, version or lineage).
            IntegrityError, StorageError, ...: as a reader's pull.
        """
        # the read path: loaded only when a publisher resumes
        from deltastore.read.engine import ReadEngine
        from deltastore.read.plan import layout as units_of
        from deltastore.read.plan import plan_from_anchor
        from deltastore.layout.select import resolve_rows, slice_targets

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

    def _write_part(self, plan: _Plan, layout: Layout, mine: Mapping[str, torch.Tensor],
                    share: _Share) -> tuple[PartRef, bytes, list[str], Stats]:
        """Step 3: encode this rank's rows (chunk indices of the whole tensor), upload the
        packs under the attempt and build the part manifest (rank 0 uploads it in step 5)."""
        index = {n: i for i, n in enumerate(layout.name)}
        specs, first_chunk = share.specs, share.first_chunk
        reference = self._reference if plan.has_base else None
        if plan.has_base and (reference is None or set(reference) != set(mine)):
            raise ShardMismatchError(f"rank {self.rank} holds no reference copy of its rows for version {plan.version - 1}")
        state = {n: t for n, t in mine.items()}
        gathered: dict[str, torch.Tensor] = {}  # grid units' reference buffers, filled by an anchor without a base
        self._fresh = None
        encoded = encode_version(state, specs, kind=plan.kind, reference=reference, pool=self._pool,  # type: ignore[arg-type]
                                 uploader=self._uploader, store=self.store, threads=self.threads, attempt=plan.attempt,
                                 gathered=gathered, layouts=self._layout_works)
        if reference is None:
            self._fresh = (specs, gathered)
        if plan.kind == "anchor":
            release_free_heap()  # the encode threads' chunk-sized buffers (deltastore._util.heap)
        tensors: list[Any] = []
        changed = []
        for e in encoded.entries:
            i = index[e.name]
            shift = first_chunk[e.name]
            chunks = tuple(_PartChunk(c.index + shift, c.digest, c.full, c.delta) for c in e.chunks) if shift else tuple(e.chunks)
            tensors.append(_PartTensor(e.name, e.dtype, layout.shape[i], e.chunk_rows, chunks))
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
        return ref, data, changed, encoded.stats

    def _commit(self, plan: _Plan, layout: Layout, parts: Sequence[Any], reports: Sequence[_Report],
                meta: dict[str, Any], step: int | None, deadline: float) -> VersionInfo:
        """Rank 0, step 5: join and check the parts, write the version manifest, CAS HEAD."""
        pub = self._coordinator
        assert pub is not None
        # The part manifests go up first, in parallel (each rank's bytes came with step 4);
        # joining, signing and encoding the version manifest overlap them.
        uploads = [self._uploader.submit(put_immutable, self.store, p[0].key, p[1], f"part manifest {p[0].part}")
                   for p in parts]
        try:
            return self._commit_parts(plan, layout, parts, meta, step, deadline, uploads)
        finally:
            for u in uploads:  # none outlives the attempt (an error in joining leaves them running)
                u.cancel()
            wait(uploads)

    def _commit_parts(self, plan: _Plan, layout: Layout, parts: Sequence[Any], meta: dict[str, Any],
                      step: int | None, deadline: float, uploads: list[Future[None]]) -> VersionInfo:
        pub = self._coordinator
        assert pub is not None
        tip = pub._current_tip()
        head = pub._head
        refs = [p[0] for p in parts]
        stats_of: list[Stats] = [p[3] for p in parts]
        changed = {n for p in parts for n in p[2]}
        delta_bytes = sum(s.delta_bytes or 0 for s in stats_of)
        full_bytes = sum(s.full_bytes or 0 for s in stats_of)
        after = _next_tip(tip, plan, layout, delta_bytes, full_bytes, key="")  # the key once the manifest is encoded
        chain_start, cum = after.chain_start, after.cum
        kind = plan.kind
        total = len(layout.name)
        stats = Stats(
            bytes_stored=delta_bytes + full_bytes, delta_bytes=delta_bytes, full_bytes=full_bytes, cum_delta_bytes=cum,
            tensors_changed=total if kind == "anchor" and not plan.has_base else len(changed),
            elements_changed=sum(s.elements_changed for s in stats_of),
            tensors_total=total, elements_total=sum(math.prod(s) for s in layout.shape),
        )
        parent_key = head.manifest if head is not None else None
        header = Manifest(
            schema=layout.schema_, version=plan.version,
            parent=head.version if head is not None and head.version else None, parent_manifest=parent_key,
            kind=kind, anchor=plan.version if kind == "anchor" else tip.anchor,  # type: ignore[union-attr]
            delta_base=head.version if plan.has_base and head is not None else None,
            step=step, created=now(), writer=self.writer_id, epoch=pub.epoch, commit_id=plan.attempt, metadata=meta,
            stats=stats, parts=tuple(refs), lineage=plan.lineage,
            anchor_manifest=None if kind == "anchor" else tip.anchor_key,  # type: ignore[union-attr]
            back=pub._back_for(plan.version, parent_key), chain_start=chain_start, layout=plan.layout_ref,
            max_attempt_s=math.ceil(self.max_attempt_s),
        )
        datas = {p[0].key: p[1] for p in parts}
        early: bytes | None = None
        if pub._signing_key is None:
            # An unsigned sharded version is stored as its header and part list (SPEC §8), which
            # the join does not change: its bytes are known now, and their upload overlaps the
            # join as the part manifests' do (design 010 D9). If the join refuses the parts, the
            # manifest is an unreferenced object, as after a failed HEAD write (SPEC §5 step 6):
            # HEAD names it only after the join and every upload succeeded.
            early = encode_joined(header, layout, header)
            mkey = manifest_key(plan.version, sha256_hex(early))
            uploads.append(self._uploader.submit(put_immutable, self.store, mkey, early, "manifest"))
        joined = join_parts(header, layout, datas)  # the reader's checks, before anything is visible
        manifest = joined
        if pub._signing_key is not None:
            from deltastore.format.signing import sign_manifest

            manifest = sign_manifest(joined, pub._signing_key)
        # Not encode_manifest: it would join every part again to check what join_parts checked.
        data = encode_joined(manifest, layout, joined)
        digest = sha256_hex(data)
        if early is not None and data != early:  # not reached: the join decodes the header as it is
            raise ValueError(f"sharded version {plan.version}: the joined version does not store as its header "
                             "did; nothing was committed")
        mkey = manifest_key(plan.version, digest)
        if early is None:
            put_immutable(self.store, mkey, data, "manifest")
        for u in uploads:
            u.result()  # the manifest and every part manifest are stored before HEAD names the version
        pub._commits.commit(Head(
            version=plan.version, manifest=mkey, manifest_sha256=digest, commit_id=plan.attempt, writer=self.writer_id,
            epoch=pub.epoch, updated=manifest.created, lineage=plan.lineage, index=head.index if head is not None else None,
        ), deadline=deadline)
        if pub._commits.superseded:  # landed, but another writer is on top: no rank's reference is HEAD's
            pub._commits.superseded = False
        pub._remember(mkey, manifest)
        # The next version's tip, from what was just written: reading it back would fetch the
        # manifest and every part manifest again and join them, once per version.
        pub._tip = dataclasses.replace(after, key=mkey, anchor_key=mkey if kind == "anchor" else after.anchor_key,
                                       signed_by=None if manifest.signature is None else manifest.signature.key_id)
        if kind == "anchor":
            pub._anchor_version = plan.version
        logger.info("published sharded version %d (%s, %d parts): %d bytes (%d delta, %d full)", plan.version, kind,
                    len(refs), stats.bytes_stored, delta_bytes, full_bytes)
        return VersionInfo.from_manifest(manifest, mkey)

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release threads and the store (not a collective). Idempotent.

        Rank 0 first waits for the versions its committer holds and resolves its Futures; the
        other ranks cannot learn those outcomes without a collective, so their unresolved
        Futures raise PartFailedError saying so (call :meth:`flush` on every rank before
        closing to learn them everywhere).

        Raises:
            DeltastoreError: on rank 0, a publish_async failure not yet raised (once).
        """
        self._close(raise_errors=True)

    def _close(self, *, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        try:
            if self._pending:
                failure = self._apply(self._settle(block=True))
            for version, future in self._waiting.items():
                future.set_exception(PartFailedError(
                    f"version {version} of {self.url}: its outcome had not reached rank {self.rank} when the publisher "
                    "closed (flush, a collective, reports it to every rank); HEAD says whether it was committed"))
            self._waiting.clear()
        finally:
            if self._committer is not None:
                self._committer.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._uploader.shutdown(wait=True)
            self._release()
        if failure is not None:
            if raise_errors:
                raise failure
            logger.error("sharded publisher of %s closed with a failure not reported: %s", self.url, failure)

    def _release(self) -> None:
        self._reference = None
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None
        elif getattr(self, "store", None) is not None:
            self.store.close()

    def __enter__(self) -> ShardedPublisher:  # noqa: PYI034 - as Publisher
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close(raise_errors=exc_type is None)
