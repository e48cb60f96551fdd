"""The compactor (design 005 D5, SPEC §12): squashed deltas S(h, to) for workers far behind.

A squash replaces the chain of deltas ``(h, to]`` by one delta segment per changed chunk, so a
worker holding h fetches roughly the union of the changes instead of their sum (on MiniLM,
8 deltas add up to ~2× one squash). It is composed from the stored deltas alone
(:func:`deltastore.codec.compose_deltas`, chunk by chunk), **verified before anything is
written** (every changed chunk is materialized at h, from its anchor and the chain's deltas,
the composed segment applied, and the result hashed against the chunk's digest at ``to``),
written create-only under one fresh
attempt (``objects/<attempt>/``: role-``d`` packs, then the squash manifest), and registered in
the history index, where readers find it. Squashes are hints: a reader ignores one it cannot
read or verify.

Example::

    report = compact("s3://bucket/run1")          # bases: live workers' versions, the anchor
    for s in report.squashes:
        print(s.from_, s.to, s.bytes, s.chain_bytes)
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from deltastore import codec
from deltastore._util.jobs import default_threads, grouped
from deltastore.codec.compose import compose_deltas
from deltastore.errors import CorruptObjectError, IntegrityError, VersionNotFoundError
from deltastore.fleet.ledger import read_ledger
from deltastore.format.history import History
from deltastore.format.keys import new_attempt_id, object_key, sha256_hex
from deltastore.format.models import (
    DEFAULT_MAX_ATTEMPT_S,
    BlobRef,
    ChunkEntry,
    Head,
    Index,
    Manifest,
    SegmentRef,
    SquashManifest,
    SquashRef,
    TensorEntry,
)
from deltastore.format.objects import encode_object
from deltastore.layout.tensors import TensorSpec, state_digest
from deltastore.read.engine import ReadEngine
from deltastore.read.fetch import batched
from deltastore.read.plan import Step, check_entries, digests, layout, plan_from_anchor
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.commit import attempt_clock, put_immutable
from deltastore.write.encode import PACK_TARGET_BYTES

logger = logging.getLogger(__name__)

#: A squash over fewer versions is the delta itself: nothing to gain.
MIN_SQUASH_VERSIONS = 2
#: A squash's composed segments stay in memory up to this size while the rest of it is
#: verified; beyond it they go to a local temporary file (a squash of a large model is tens of GB).
SPILL_MEMORY_BYTES = 64 * 1024 * 1024
#: S(anchor, head) is written again once the indexed one ends this many versions before head
#: (design 005 D5): a worker starting from scratch then fetches the anchor, one squash and at
#: most this many deltas. Used by ``--follow`` and the publisher's background compactor; a
#: one-shot ``compact`` writes it whenever the anchor is 2 or more behind.
ANCHOR_SQUASH_EVERY = 8
#: Decode/compose threads of a background compaction: it shares the machine with training and
#: the publisher's encoder, so it takes a little of it rather than every core.
BACKGROUND_THREADS = 2
#: How long ``Publisher.close()`` waits for a running background compaction to finish before
#: asking it to stop (it then stops at its next batch of chunks, writing nothing).
BACKGROUND_CLOSE_TIMEOUT_S = 60.0
#: After asking a background compaction to stop, how long close() still waits for it (one batch).
BACKGROUND_STOP_TIMEOUT_S = 10.0
#: Squashes the compactor keeps listed in the index (newest ``to`` first): readers use only
#: those starting at the version they hold, and the index is read on every change of HEAD's
#: index, so stale ones are dropped rather than accumulated over a run.
MAX_INDEX_SQUASHES = 64

_Key = tuple[str, int]


@dataclass(frozen=True)
class SquashWritten:
    """One squash the compactor wrote.

    Attributes:
        from_, to: its range: applied to the state at ``from_`` it gives the state at ``to``.
        key, sha256: its squash manifest.
        bytes: bytes of its packs (what a reader fetches at most).
        chain_bytes: bytes of the delta segments of versions ``(from_, to]`` it replaces.
        chunks: chunks it lists (those whose composition did not cancel out).
    """

    from_: int
    to: int
    key: str
    sha256: str
    bytes: int
    chain_bytes: int
    chunks: int

    def ref(self) -> SquashRef:
        return SquashRef(from_=self.from_, to=self.to, key=self.key, sha256=self.sha256, bytes=self.bytes)


@dataclass(frozen=True)
class CompactReport:
    """What one :func:`compact` run did.

    Attributes:
        url: the store.
        to: the version every squash ends at.
        squashes: the squashes written (verified), by ``from``.
        skipped: ``(base, reason)`` for each base that got no squash.
        registered: the squashes were registered in the history index.
        seconds: wall time of the run.
    """

    url: str
    to: int
    squashes: tuple[SquashWritten, ...]
    skipped: tuple[tuple[int, str], ...] = ()
    registered: bool = False
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        """Bytes of every squash written."""
        return sum(s.bytes for s in self.squashes)

    @property
    def chain_bytes(self) -> int:
        """Bytes of the chains the squashes replace."""
        return sum(s.chain_bytes for s in self.squashes)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "to": self.to, "registered": self.registered, "seconds": round(self.seconds, 3),
            "bytes": self.bytes, "chain_bytes": self.chain_bytes,
            "squashes": [{"from": s.from_, "to": s.to, "key": s.key, "sha256": s.sha256, "bytes": s.bytes,
                          "chain_bytes": s.chain_bytes, "chunks": s.chunks} for s in self.squashes],
            "skipped": [{"base": b, "reason": r} for b, r in self.skipped],
        }  # fmt: skip


@dataclass(frozen=True)
class _Spilled:
    """One composed segment, kept in its squash's spill file until the whole squash is verified."""

    key: _Key
    digest: str  # the chunk's digest at ``to``
    codec: str
    n_changed: int
    offset: int  # in the spill file
    length: int


@dataclass
class _Composed:
    """A verified squash, not yet written: its segments in layout order, their bytes in a spill
    file (in memory up to SPILL_MEMORY_BYTES, then on local disk), so that nothing is uploaded
    before every chunk is verified while memory stays bounded whatever the squash's size."""

    h: int
    h_key: str
    chain_bytes: int
    specs: dict[str, TensorSpec]
    spill: Any = field(default_factory=lambda: tempfile.SpooledTemporaryFile(max_size=SPILL_MEMORY_BYTES))  # noqa: SIM115 - closed by close()
    segments: list[_Spilled] = field(default_factory=list)
    size: int = 0

    def add(self, key: _Key, digest: str, seg: codec.Segment) -> None:
        self.spill.write(seg.data)
        self.segments.append(_Spilled(key, digest, seg.codec, seg.n_changed, self.size, len(seg.data)))
        self.size += len(seg.data)

    def read(self, offset: int, length: int) -> bytes:
        self.spill.seek(offset)
        data = self.spill.read(length)
        if len(data) != length:  # a local disk that lost what it was given
            raise OSError(f"squash spill file: read {len(data)} of {length} bytes at {offset}")
        return data

    def close(self) -> None:
        self.spill.close()


def compact(
    store_or_url: Store | str,
    *,
    bases: Iterable[int] | None = None,
    to: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    writer: str | None = None,
    register: bool = True,
    threads: int | None = None,
    anchor_squash_every: int | None = None,
    stop: threading.Event | None = None,
) -> CompactReport:
    """Write the squashes S(h, to) for each base h, verified, and register them in the index.

    Args:
        store_or_url: an open store or a store URL.
        bases: the versions to squash from. Default: the versions live workers hold (the
            ledger, SPEC §10, lineage matching HEAD's) at least two behind ``to``, plus the
            anchor of ``to`` when it is at least two behind (see ``anchor_squash_every``),
            less the versions the index already has a squash to ``to`` from.
        to: the version the squashes end at (default: head).
        storage_options: for the store, when ``store_or_url`` is a URL.
        writer: recorded in the squash manifests and the index (default ``compactor-<host>-<pid>``).
        register: register the squashes in the history index (HEAD CAS changing only
            ``index``); False writes them unregistered (readers will not find them).
        threads: decode/compose threads (default: all cores).
        anchor_squash_every: with the default bases, the anchor of ``to`` is a base only when
            the index has no squash from it ending within this many versions of ``to``
            (``ANCHOR_SQUASH_EVERY`` for a compactor that runs every version); None (default):
            whenever it is at least two behind.
        stop: when set during the run, the run stops at its next batch of chunks (or before
            its first write) and writes nothing; every base is reported skipped.

    Returns:
        A :class:`CompactReport`. A base below the floor, less than two versions behind, or
        with a chain break (a version whose ``delta_base`` is null) in ``(h, to]`` is skipped
        with its reason.

    Raises:
        VersionNotFoundError: the store is empty, or ``to`` is not a committed version.
        IntegrityError: a composed chunk does not reach its digest at ``to`` (the error names
            the chunk and the range); nothing was written.
        StorageError: a read or write failed; packs already written are unreferenced garbage.
    """
    t0 = time.monotonic()
    own = isinstance(store_or_url, str)
    store = open_store(store_or_url, storage_options=dict(storage_options or {})) if own else store_or_url
    writer = writer or f"compactor-{socket.gethostname()}-{os.getpid()}"
    engine = ReadEngine(store, threads or default_threads())
    composed: list[_Composed] = []
    try:
        history = History(store)
        got = history.read_head()
        if got is None or got[0].manifest is None:
            raise VersionNotFoundError(f"{store.url} has no committed version to compact")
        head = got[0]
        to = head.version if to is None else to
        to_key, to_m = history.find(to, head)
        index = history.index(head)
        floor = 1 if index is None else index.floor
        if bases is None:
            bases = _default_bases(store, head, to_m, index, anchor_squash_every)
        wanted = sorted({int(b) for b in bases})
        skipped: list[tuple[int, str]] = []
        usable: list[int] = []
        for h in wanted:
            if to - h < MIN_SQUASH_VERSIONS or h < 1:
                skipped.append((h, f"fewer than {MIN_SQUASH_VERSIONS} versions before {to}"))
            elif h < floor:
                skipped.append((h, f"below the floor {floor} (collected)"))
            else:
                usable.append(h)
        if usable:
            chain = history.chain(to_key, to_m, down_to=usable[0])
            by_version = {m.version: (k, m) for k, m in chain}
            to_chain = history.anchor_chain(to_key, to_m)
            at_to = digests(to_chain)
            chained = []  # bases with no chain break before `to`: all on one chain, composed in one pass
            for h in usable:
                breaks = [v for v in range(h + 1, to + 1) if by_version[v][1].delta_base is None]
                if breaks:
                    skipped.append((h, f"version {breaks[0]} starts a new chain (delta_base null): a squash never spans it"))
                    continue
                chained.append(h)
            if chained:
                try:
                    composed.extend(_compose(history, engine, by_version, chained, to, at_to, stop))
                except _Stopped:
                    skipped.extend((h, "stopped before it was written") for h in chained)
            if stop is not None and stop.is_set() and composed:  # nothing written yet: stop cleanly
                skipped.extend((c.h, "stopped before it was written") for c in composed)
                for c in composed:
                    c.close()
                composed = []
        for h, why in skipped:
            logger.warning("no squash %d→%d for %s: %s", h, to, store.url, why)
        attempt, first_write = new_attempt_id(), attempt_clock()
        written = [_write(store, c, to_key, to_m, writer, attempt) for c in composed]
        registered = False
        if written and register:
            # SPEC §5 step 3a: the attempt's HEAD write must come within max_attempt_s of its
            # first write, or GC may already have judged its objects abandoned.
            limit = min(DEFAULT_MAX_ATTEMPT_S, to_m.max_attempt_s or DEFAULT_MAX_ATTEMPT_S)  # the publisher's
            left = limit - (attempt_clock() - first_write)
            if left <= 0:
                logger.warning("not registering the squashes of attempt %s: its deadline passed; they are garbage", attempt)
            else:
                registered = _register(store, history, written, writer, left)
        report = CompactReport(store.url, to, tuple(written), tuple(sorted(skipped)), registered, time.monotonic() - t0)
        for s in written:
            logger.info("wrote squash %d→%d of %s: %d bytes replacing %d bytes of deltas (%s)",
                        s.from_, s.to, store.url, s.bytes, s.chain_bytes, s.key)
        return report
    finally:
        for c in composed:
            c.close()
        engine.close()
        if own:
            store.close()


def _default_bases(store: Store, head: Head, to_m: Manifest, index: Index | None, anchor_every: int | None) -> list[int]:
    """Versions held by live workers of this lineage, and the anchor of ``to`` (when due:
    ``anchor_every``), less those the index already has a squash to ``to`` from."""
    to = to_m.version
    floor = 1 if index is None else index.floor
    indexed = () if index is None else index.squashes
    served = {r.from_ for r in indexed if r.to == to}  # another round (or compactor) did them
    live = {b.version for b in read_ledger(store) if b.live() and b.lineage in (None, head.lineage)}
    out = {h for h in live if floor <= h and to - h >= MIN_SQUASH_VERSIONS}
    a = to_m.anchor
    if to - a >= MIN_SQUASH_VERSIONS and a >= floor:
        newest = max((r.to for r in indexed if r.from_ == a), default=None)
        if anchor_every is None or newest is None or to - newest >= anchor_every:
            out.add(a)
    return sorted(out - served)


class _Stopped(Exception):
    """A run was asked to stop (``compact(stop=...)``) before it wrote anything (internal)."""


def _compose(history: History, engine: ReadEngine, by_version: dict[int, tuple[str, Manifest]], bases: list[int],
             to: int, at_to: dict[_Key, str], stop: threading.Event | None = None) -> list[_Composed]:
    """Compose and verify S(h, to) for every base h (ascending, no chain break in (bases[0], to]),
    in one pass over the chunks changed since the first base.

    Per chunk: its state at ``bases[0]`` is materialized from that base's anchor, then carried
    forward to each later base by the chain's own deltas; the squashes are folded from the last
    base backwards (S(h_i, to) = deltas of (h_i, h_i+1] then S(h_i+1, to)), each applied to the
    chunk's state at its base and checked against the chunk's digest at ``to``. Memory: one
    batch of segments, and per chunk in flight one copy of it per base.
    """
    h0_key, h0_m = by_version[bases[0]]
    h0_chain = history.anchor_chain(h0_key, h0_m)
    specs = layout(h0_chain[0][1])
    at_h0 = {(p.name, p.index): p for p in plan_from_anchor(h0_chain, specs)}
    changed: dict[_Key, list[tuple[int, Step]]] = {}  # chunk -> (version, delta step), oldest first
    outs = []
    for h in bases:
        outs.append(_Composed(h, by_version[h][0], 0, specs))
    for mi, v in enumerate(range(bases[0] + 1, to + 1)):
        key, m = by_version[v]
        check_entries(key, m, specs, None)
        for t in m.tensors:
            for c in t.chunks:
                if c.delta is None:
                    continue
                changed.setdefault((t.name, c.index), []).append((v, Step(mi, m.blobs[c.delta.blob], c.delta)))
                for out in outs:
                    if out.h < v:
                        out.chain_bytes += c.delta.length
    order = {name: i for i, name in enumerate(specs)}
    todo = sorted(changed, key=lambda k: (order[k[0]], k[1]))

    def one(k: _Key, data: dict) -> list[codec.Segment | None]:
        """The chunk's segment in each base's squash (None: unlisted there)."""
        name, index = k
        spec = specs[name]
        a, b = spec.chunk_span(index)
        deltas = changed[k]
        raw = ReadEngine.replay(at_h0[k], spec, data, None)  # the chunk at bases[0], checked against its digest
        states: list[np.ndarray] = []
        i = 0
        for h in bases:  # carry the chunk forward from base to base with the chain's deltas
            while i < len(deltas) and deltas[i][0] <= h:
                codec.apply_delta(raw, data[deltas[i][1].where], codec=deltas[i][1].ref.codec)
                i += 1
            states.append(raw.copy())
        segs: list[codec.Segment | None] = [None] * len(bases)
        acc: codec.Segment | None = None  # S(bases[j], to) for the base after the current one
        for j in range(len(bases) - 1, -1, -1):
            hi = bases[j + 1] if j + 1 < len(bases) else to
            block = [s for v, s in deltas if bases[j] < v <= hi]
            parts = [codec.Segment(s.ref.codec, bytes(data[s.where]), s.ref.n_changed) for s in block]
            if acc is not None:
                parts.append(acc)
            if not parts:
                continue  # unchanged in (bases[j], to]: not listed in that squash
            acc = _fold(parts, spec.uint_dtype(), b - a)
            want = at_to.get(k)
            result = states[j].copy()
            if acc is not None:
                codec.apply_delta(result, acc.data, codec=acc.codec)
            if want is None or state_digest(result) != want:
                raise IntegrityError(
                    f"squash {bases[j]}→{to}: chunk {name}[{index}] composed from {sum(v > bases[j] for v, _ in deltas)} "
                    f"delta(s) does not reach its digest at version {to} ({want}); nothing was written"
                )
            segs[j] = acc
        return segs

    def group_job(group: list[_Key], data: dict) -> list[tuple[_Key, list[codec.Segment | None]]]:
        return [(k, one(k, data)) for k in group]

    def cost(k: _Key) -> int:
        return at_h0[k].cost + sum(s.ref.length for _, s in changed[k])

    try:
        for batch in batched(todo, cost):
            if stop is not None and stop.is_set():
                raise _Stopped
            steps = [s for k in batch for s in at_h0[k].steps() + [st for _, st in changed[k]]]
            data = engine.fetcher.fetch(steps)  # every segment SHA-256-checked
            groups = grouped(batch, lambda k: specs[k[0]].chunk_bytes(k[1]))
            for results in list(engine.pool.map(lambda g, d=data: group_job(g, d), groups)):
                for k, segs in results:
                    for out, seg in zip(outs, segs):
                        if seg is not None:  # None: unchanged since that base, or cancelled out (checked above)
                            out.add(k, at_to[k], seg)
    except BaseException:
        for out in outs:
            out.close()
        raise
    return outs


def _fold(parts: list[codec.Segment], dtype: Any, count: int) -> codec.Segment | None:
    """The one delta equivalent to ``parts`` applied in order (None: they cancel)."""
    acc: codec.Segment | None = None
    for p in parts:
        if acc is None:  # nothing yet, or what came before cancelled out
            acc = p
            continue
        acc = compose_deltas(acc.data, p.data, codec_a=acc.codec, codec_b=p.codec, dtype=dtype, count=count)
    return acc


def _write(store: Store, c: _Composed, to_key: str, to_m: Manifest, writer: str, attempt: str) -> SquashWritten:
    """Upload a verified squash: its role-d packs, then its manifest, create-only."""
    blobs: list[BlobRef] = []
    buf = bytearray()  # one pack at a time: memory is PACK_TARGET_BYTES, whatever the squash
    entries: dict[str, list[ChunkEntry]] = {}

    def flush() -> None:
        nonlocal buf
        if not buf:
            return
        data, buf = bytes(buf), bytearray()
        digest = sha256_hex(data)
        blob = BlobRef(key=object_key(attempt, digest, ".pack"), size=len(data), sha256=digest, role="d")
        put_immutable(store, blob.key, data, "squash pack")
        blobs.append(blob)

    for sp in c.segments:
        name, index = sp.key
        if buf and len(buf) + sp.length > PACK_TARGET_BYTES:
            flush()
        data = c.read(sp.offset, sp.length)
        ref = SegmentRef(blob=len(blobs), offset=len(buf), length=sp.length, sha256=sha256_hex(data),
                         codec=sp.codec, n_changed=sp.n_changed)
        buf += data
        entries.setdefault(name, []).append(ChunkEntry(index=index, digest=sp.digest, delta=ref))
    flush()
    specs = c.specs
    tensors = tuple(
        TensorEntry(name=n, dtype=specs[n].dtype, shape=specs[n].shape, chunk_rows=specs[n].chunk_rows, chunks=tuple(cs))
        for n, cs in entries.items()
    )
    sq = SquashManifest(
        from_=c.h, to=to_m.version, from_manifest=c.h_key, to_manifest=to_key, commit_id=attempt,
        lineage=to_m.lineage, layout=to_m.layout, writer=writer,
        created=datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        blobs=tuple(blobs), tensors=tensors,
    )  # fmt: skip
    data = encode_object(sq)
    digest = sha256_hex(data)
    key = object_key(attempt, digest, ".squash.json.zst")
    put_immutable(store, key, data, "squash manifest")
    return SquashWritten(c.h, to_m.version, key, digest, sum(b.size for b in blobs), c.chain_bytes, len(c.segments))


def _register(store: Store, history: History, written: list[SquashWritten], writer: str, max_attempt_s: float) -> bool:
    """Add the squashes to the history index (one HEAD CAS changing only ``index``)."""
    from deltastore.lifecycle.index import update_index  # the index writer (HEAD CAS of D4)

    refs = [s.ref() for s in written]

    def mutate(head: Head, index: Index | None) -> Index:
        return merge_squashes(head, index, refs, writer)

    update_index(store, history, mutate, writer=writer, max_attempt_s=max_attempt_s)
    return True


def merge_squashes(head: Head, index: Index | None, refs: list[SquashRef], writer: str) -> Index:
    """``index`` with ``refs`` added: squashes below the floor dropped, one per ``from`` (the
    newest ``to``), at most MAX_INDEX_SQUASHES (newest ``to`` first)."""
    if head.lineage is None:
        raise CorruptObjectError(f"HEAD (version {head.version}) has no lineage: a history index needs a schema-2+ store")
    floor = 1 if index is None else index.floor
    best: dict[int, SquashRef] = {}
    for r in [*(index.squashes if index is not None else ()), *refs]:
        if r.from_ < floor:
            continue
        old = best.get(r.from_)
        if old is None or r.to >= old.to:
            best[r.from_] = r
    kept = sorted(best.values(), key=lambda r: (-r.to, r.from_))[:MAX_INDEX_SQUASHES]
    return Index(
        lineage=head.lineage, generation=1 if index is None else index.generation + 1, floor=floor,
        pins=() if index is None else index.pins, squashes=tuple(sorted(kept, key=lambda r: (r.from_, r.to))),
        writer=writer, created=datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        previous=head.index,
    )  # fmt: skip


# --- the publisher's background compactor --------------------------------------------------------


@dataclass(frozen=True)
class CompactPolicy:
    """How a publisher compacts in the background (``Publisher(compact=CompactPolicy(...))``;
    ``compact=True`` is ``CompactPolicy()``).

    After each commit the publisher asks for one :func:`compact` run to head with the default
    bases (versions live workers hold, and the anchor every ``anchor_every`` versions).

    Attributes:
        anchor_every: S(anchor, head) is rewritten once the indexed one ends this many
            versions before head (design 005 D5).
        threads: decode/compose threads of a run.
        close_timeout_s: how long ``Publisher.close()`` waits for a running run before asking
            it to stop (it then writes nothing).
    """

    anchor_every: int = ANCHOR_SQUASH_EVERY
    threads: int = BACKGROUND_THREADS
    close_timeout_s: float = BACKGROUND_CLOSE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be ≥ 1, got {self.anchor_every}")
        if self.threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {self.threads}")
        if not self.close_timeout_s >= 0:
            raise ValueError(f"close_timeout_s must be ≥ 0, got {self.close_timeout_s}")


class BackgroundCompactor:
    """Runs :func:`compact` to head on one background thread, one run at a time.

    :meth:`submit` (the publisher calls it after each commit) never blocks and never raises: a
    head that lands while a run is going is remembered, and the heads that landed meanwhile
    are served by **one** next run to the newest head (never a queue of runs). A failed run is
    logged at WARNING and forgotten; the next head gets a new run.

    Example::

        bg = BackgroundCompactor(store, CompactPolicy(), writer="trainer-0-compactor")
        bg.submit(12)       # after version 12 was committed
        bg.close()          # waits (bounded) for the running run, then stops
    """

    def __init__(self, store: Store, policy: CompactPolicy | None = None, *, writer: str | None = None):
        self.store = store
        self.policy = policy or CompactPolicy()
        self.writer = writer
        self.runs = 0  # runs finished (written or not)
        self.failures = 0  # runs that raised (logged)
        self.last_report: CompactReport | None = None
        self._cond = threading.Condition()
        self._wanted: int | None = None  # newest head submitted and not yet served by a run
        self._running = False
        self._closed = False
        self._stop = threading.Event()  # asks a running compact() to stop (close() timed out)
        self._thread: threading.Thread | None = None

    def submit(self, version: int) -> None:
        """Ask for a run to head now that ``version`` was committed (coalesced, non-blocking)."""
        try:
            with self._cond:
                if self._closed:
                    return
                self._wanted = version if self._wanted is None else max(self._wanted, version)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="deltastore-compact", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - a failure here must never fail the publish
            logger.warning("background compaction of %s not started for version %d: %s", self.store.url, version, e)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no run is going and none is wanted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running and self._wanted is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Serve no further head; wait up to ``timeout`` (default the policy's) for a running
        run, then ask it to stop and wait up to BACKGROUND_STOP_TIMEOUT_S more. Idempotent."""
        timeout = self.policy.close_timeout_s if timeout is None else timeout
        with self._cond:
            self._closed = True
            self._wanted = None
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("background compaction of %s still running after %.0f s: asking it to stop (it writes nothing)",
                           self.store.url, timeout)
            self._stop.set()
            thread.join(BACKGROUND_STOP_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("background compaction of %s did not stop; abandoning its thread", self.store.url)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._wanted is not None)
                if self._closed:
                    return
                version, self._wanted, self._running = self._wanted, None, True
            try:
                # to=None: the newest head when the run starts (heads that landed since the
                # submit are served too); the run's own index write moves no version.
                report = compact(self.store, writer=self.writer, threads=self.policy.threads,
                                 anchor_squash_every=self.policy.anchor_every, stop=self._stop)
                self.last_report = report
                if report.squashes:
                    logger.info("background compaction of %s to version %d: %d squash(es), %d bytes in %.1f s",
                                self.store.url, report.to, len(report.squashes), report.bytes, report.seconds)
            except Exception as e:  # logged; a compaction never fails a publish
                self.failures += 1
                logger.warning("background compaction of %s after version %d failed (the publish is unaffected): %s",
                               self.store.url, version, e, exc_info=logger.isEnabledFor(logging.DEBUG))
            finally:
                with self._cond:
                    self.runs += 1
                    self._running = False
                    self._cond.notify_all()


__all__ = [
    "ANCHOR_SQUASH_EVERY",
    "BackgroundCompactor",
    "CompactPolicy",
    "CompactReport",
    "SquashWritten",
    "compact",
    "merge_squashes",
]
