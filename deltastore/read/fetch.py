"""Fetching segments (SPEC §7 steps 4-6): parallel coalesced range GETs, the SHA-256 of every
segment, and the prefetch of the next batch while the current one is applied.

:class:`deltastore.read.engine.ReadEngine` decodes and applies what this module reads. Nothing
here holds version state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from typing_extensions import Self

from deltastore.errors import DeltastoreError, IntegrityError, NotFoundError
from deltastore.format.models import BlobRef, SegmentRef
from deltastore.format.keys import sha256_hex
from deltastore.read.plan import ChunkPlan, Step
from deltastore.storage.base import Store

#: Concurrent GETs: object stores reward parallel requests far beyond the core count.
IO_THREADS = 16
#: Segment bytes fetched per batch: a pull holds at most two batches (one being applied, one
#: being fetched) of compressed data, whatever the model size.
FETCH_BATCH_BYTES = 64 * 1024 * 1024
#: Byte ranges of one pack closer than this are fetched as one GET: a request costs more than
#: a few hundred KiB of transfer.
COALESCE_GAP_BYTES = 256 * 1024

_T = TypeVar("_T")
_R = TypeVar("_R")
#: Fetched segments, keyed by ``(pack key, offset)``.
Segments = dict[tuple[str, int], memoryview]
#: Why a segment cannot be used, keyed like :data:`Segments`.
SegmentErrors = dict[tuple[str, int], DeltastoreError]
#: One item of :meth:`Fetcher.batches`: plans, their segments, and the segments' errors.
Batch = tuple[list[ChunkPlan], Segments, SegmentErrors]


def batched(items: list[_T], nbytes: Callable[[_T], int]) -> list[list[_T]]:
    """Consecutive items in batches of about FETCH_BATCH_BYTES (the memory a fetch may hold)."""
    batches: list[list[_T]] = [[]]
    size = 0
    for item in items:
        if batches[-1] and size + nbytes(item) > FETCH_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += nbytes(item)
    return batches if batches[0] else []


def _run_here(fn: Callable[..., _R], *args: Any) -> Future[_R]:
    """``fn(*args)`` called now, on this thread, as a finished Future (an inline ``submit``)."""
    done: Future[_R] = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - re-raised by result(), as a pool's Future would
        done.set_exception(e)
    return done


def _bad_segment(blob_key: str, offset: int, url: str) -> IntegrityError:
    return IntegrityError(f"segment at {offset} of pack {blob_key!r} of {url} does not match its SHA-256: the object "
                          "is corrupt")


class CheckedOnRead(dict):
    """Fetched segments keyed by ``(pack key, offset)``, each checked against its SHA-256 the
    first time it is read (``[]``, ``get``): by the decode thread that is about to decode it.

    Hashing a steady version's pack on the fetch thread, before the first chunk can be applied,
    leaves the decode threads idle; read here, each segment is hashed by the thread that
    decodes it next, from cache, while the other threads apply (design 006, "The ``pull_into``
    path"). The rule of SPEC §7.6 is unchanged: no segment is decoded before its SHA-256
    matched; a mismatch raises the IntegrityError the eager check raises.
    """

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url  # of the store the packs are in (for the error)
        self._pending: dict[tuple[str, int], str] = {}  # where → expected SHA-256, not yet checked

    def defer(self, where: tuple[str, int], view: memoryview, sha256: str) -> None:
        dict.__setitem__(self, where, view)
        self._pending[where] = sha256

    def absorb(self, other: CheckedOnRead) -> None:
        """Take ``other``'s segments as they are: those not yet checked stay unchecked."""
        dict.update(self, dict.items(other))
        self._pending.update(other._pending)

    def __getitem__(self, where: tuple[str, int]) -> memoryview:
        view = dict.__getitem__(self, where)
        want = self._pending.get(where)
        if want is not None:  # two threads may both hash one segment: harmless, never skipped
            if sha256_hex(view) != want:
                raise _bad_segment(*where, self.url)
            self._pending.pop(where, None)
        return view

    def get(self, where: tuple[str, int], default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[where]
        except KeyError:
            return default

    def values(self) -> Any:  # pragma: no cover - no caller; checked reads only
        raise TypeError("CheckedOnRead: read segments by key")

    items = values


class Fetcher:
    """Fetches segments with parallel (coalesced) range GETs and verifies every one.

    Args:
        store: the store to read packs from.
        io: the pool the GETs run on.
        ahead: the one thread that fetches the next batch of :meth:`batches`.
    """

    def __init__(self, store: Store, io: ThreadPoolExecutor, ahead: ThreadPoolExecutor):
        self.store = store
        self.pool = io
        self.ahead = ahead
        self.bytes_fetched = 0  # segment bytes read from the store, cumulative
        self._lock = threading.Lock()
        #: Byte ranges closer than this are read as one GET (a partial subscriber sets 0).
        self.gap = COALESCE_GAP_BYTES
        #: Longest run read by one GET (None: no cap): on a far, lossy link one TCP connection
        #: carries little, so a pack is better read as parallel ranges (Subscriber(range_part_bytes)).
        self.max_run: int | None = None

    def fetch(
        self, steps: Iterable[Step], errors: SegmentErrors | None = None, *, check_on_read: bool = False,
    ) -> Segments:
        """Fetch and verify every step's segment, keyed by ``(pack key, offset)``.

        With ``errors``, a segment that is missing, truncated or fails its SHA-256 is recorded
        there (with the error naming it) instead of raising, so a caller can take another path.
        With ``check_on_read``, segments are returned in a :class:`CheckedOnRead` that checks
        each one's SHA-256 when it is first read (a mismatch raises there, not here); a pack
        whose segments do not tile it is still checked here, whole and per segment.
        """
        by_blob: dict[str, tuple[BlobRef, dict[int, SegmentRef]]] = {}
        for s in steps:
            by_blob.setdefault(s.blob.key, (s.blob, {}))[1][s.ref.offset] = s.ref
        runs = [(blob, run) for blob, refs in by_blob.values()
                for run in _coalesce(sorted(refs.values(), key=lambda r: r.offset), self.gap, self.max_run)]
        # One GET (a steady version: one pack) runs on this thread: a hand-off to an IO thread
        # and back costs two wake-ups, milliseconds on a busy machine, before anything applies.
        submit = _run_here if len(runs) == 1 else self.pool.submit
        jobs = [(blob, run, submit(self._get_run, blob, run, errors is not None, check_on_read)) for blob, run in runs]
        out: Segments = CheckedOnRead(self.store.url) if check_on_read else {}
        try:
            for blob, run, j in jobs:
                try:
                    got, bad = j.result()
                except (IntegrityError, NotFoundError) as e:
                    if errors is None:
                        raise
                    errors.update(((blob.key, r.offset), e) for r in run)
                    continue
                if isinstance(got, CheckedOnRead):
                    assert isinstance(out, CheckedOnRead)
                    out.absorb(got)
                else:
                    out.update(got)
                if errors is not None:
                    errors.update(bad)
        except BaseException:
            # The other reads end before the error goes up: none goes on past the call, against
            # the caller's retry (a node cache then sees every file this fetch read as read
            # once, and hashes it before serving it again) or a store the caller closes.
            wait([j for *_, j in jobs])
            raise
        return out

    def _get_run(
        self, blob: BlobRef, run: list[SegmentRef], tolerant: bool = False, check_on_read: bool = False,
    ) -> tuple[Segments, SegmentErrors]:
        start, stop = run[0].offset, run[-1].offset + run[-1].length
        whole = start == 0 and stop == blob.size
        try:
            data = self.store.get(blob.key) if whole else self.store.get(blob.key, byte_range=(start, stop))
        except NotFoundError:
            raise NotFoundError(f"pack {blob.key!r} is missing from {self.store.url}: the store was damaged") from None
        with self._lock:
            self.bytes_fetched += len(data)
        if len(data) != stop - start:
            raise IntegrityError(f"pack {blob.key!r} of {self.store.url}: read {len(data)} bytes of [{start}, {stop}); the "
                                 "object is truncated")
        # A whole pack's own SHA-256 adds nothing when the run's segments tile it (every
        # schema-3 pack read whole: segments fill packs back to back, SPEC §3): each byte is
        # then checked by its segment's SHA-256 below, so it is hashed once, not twice.
        pack_bad = whole and not _tiles(run, blob.size) and sha256_hex(data) != blob.sha256
        if pack_bad and not tolerant:
            raise IntegrityError(f"pack {blob.key!r} of {self.store.url} does not match its SHA-256: the object is corrupt")
        view = memoryview(data)
        bad: SegmentErrors = {}
        if check_on_read and not (whole and not _tiles(run, blob.size)):
            lazy = CheckedOnRead(self.store.url)
            for r in run:  # no copy: codec reads views
                lazy.defer((blob.key, r.offset), view[r.offset - start : r.offset - start + r.length], r.sha256)
            return lazy, bad
        out = {}
        for r in run:
            seg = view[r.offset - start : r.offset - start + r.length]  # no copy: codec reads views
            if sha256_hex(seg) != r.sha256:  # also for whole packs: SPEC §7.6, every segment
                e = _bad_segment(blob.key, r.offset, self.store.url)
                if not tolerant:
                    raise e
                bad[(blob.key, r.offset)] = e
                continue
            out[(blob.key, r.offset)] = seg
        if pack_bad and not bad:  # every segment hashes right, so the damage is between them: say so
            raise IntegrityError(f"pack {blob.key!r} of {self.store.url} does not match its SHA-256 (its segments do): the "
                                 "object is corrupt")
        return out, bad

    def batches(self, plans: list[ChunkPlan], *, tolerant: bool = False, check_on_read: bool = False) -> Iterator[Batch]:
        """Yield plans in batches of about FETCH_BATCH_BYTES with their verified segments,
        fetching the next batch while the caller applies the current one.

        The first batch's fetch starts when this is called, not at the first ``next``: a caller
        that has other work before it applies (apply_in_place hashes the chunks it keeps) does
        it while the segments arrive. Close the iterator (or exhaust it) to end the prefetch.

        With ``tolerant``, segments that are missing or fail their SHA-256 come back as errors
        (the third item) instead of raising, so the caller can take another path for them. With
        ``check_on_read``, each segment's SHA-256 is checked when the caller first reads it
        (:class:`CheckedOnRead`), on the caller's thread."""
        batches = batched(plans, lambda p: p.cost)
        if not batches:
            return (item for item in ())  # closeable, like the prefetching iterator

        def fetch(batch: list[ChunkPlan]) -> tuple[Segments, SegmentErrors]:
            errors: SegmentErrors = {}
            data = self.fetch((st for p in batch for st in p.steps()), errors if tolerant else None,
                              check_on_read=check_on_read)
            return data, errors

        inflight = [self.ahead.submit(fetch, batches[0])]  # the batch being fetched (one at a time)

        def run() -> Iterator[Batch]:
            for i, batch in enumerate(batches):
                data, errors = inflight[0].result()
                if i + 1 < len(batches):
                    inflight[0] = self.ahead.submit(fetch, batches[i + 1])
                yield batch, data, errors

        return _Prefetch(run(), inflight)


def _tiles(run: list[SegmentRef], size: int) -> bool:
    """The segments (sorted by offset) cover ``[0, size)`` back to back, with no gap."""
    at = 0
    for r in run:
        if r.offset != at:
            return False
        at += r.length
    return at == size


def _coalesce(refs: list[SegmentRef], gap: int = COALESCE_GAP_BYTES, max_run: int | None = None) -> list[list[SegmentRef]]:
    """Segments (sorted by offset) grouped into runs read by one GET each: neighbours closer
    than ``gap``, up to ``max_run`` bytes a run (None: no cap; a segment is never split)."""
    runs: list[list[SegmentRef]] = []
    for r in refs:
        if (runs and r.offset - (runs[-1][-1].offset + runs[-1][-1].length) <= gap
                and (max_run is None or r.offset + r.length - runs[-1][0].offset <= max_run)):
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


class _Prefetch(Iterator[_T]):
    """An iterator over a prefetching generator that ends the prefetch when closed, also when
    it was never started: the fetch in flight (``inflight[0]``, which the generator replaces as
    it submits the next) is cancelled or waited for, so no fetch outlives the iterator."""

    def __init__(self, gen: Iterator[_T], inflight: list[Future[Any]]):
        self._gen = gen
        self._inflight = inflight

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> _T:
        return next(self._gen)

    def ready(self) -> bool:
        """The next item's fetch has ended (``next`` will not wait for it)."""
        return self._inflight[0].done()

    def close(self) -> None:
        self._gen.close()  # type: ignore[attr-defined]
        f = self._inflight[0]
        f.cancel()
        wait([f])
