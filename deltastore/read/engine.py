"""The read engine (SPEC §7 steps 5-8): replay planned chunks, verify them, apply with rollback.

:class:`deltastore.read.subscriber.Subscriber` decides *what* to read (HEAD, versions, the held
state, the plan); :mod:`deltastore.read.fetch` reads the segments; this module decodes a chunk's
segments and checks its digest, writes targets on any device, and applies a whole plan in place
with rollback (or stages it, see :mod:`deltastore.read.stage`). It holds no version state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from deltastore import codec
from deltastore._util.jobs import grouped
from deltastore.errors import DeltastoreError, FormatError, IntegrityError, NotFoundError, TargetModifiedError
from deltastore.layout.groups import unit_targets
from deltastore.layout.tensors import TensorSpec, bits, state_digest
from deltastore.read.fetch import IO_THREADS, Fetcher, SegmentErrors, Segments
from deltastore.read.plan import ChunkPlan, Step
from deltastore.read.stage import ChunkPatch, make_patch, split_patch
from deltastore.storage.base import Store

logger = logging.getLogger(__name__)

#: What a decode thread holds at most besides the tensors it writes (SPEC §7 step 8), whatever a
#: chunk's size: the largest segment the codec decodes whole (codec.apply.WHOLE_MAX_BYTES;
#: full segments go straight into their tensor), or a piece's working set and the windows of the
#: zstd sections it streams. A target that is not a live view adds one chunk (see replay).
DECODE_MEMORY_BYTES = 64 << 20

_T = TypeVar("_T")
_R = TypeVar("_R")
#: What a bad segment or chunk raises: a fallback path may succeed where one of these failed.
_BAD_DATA = (IntegrityError, FormatError, NotFoundError)
#: A chunk's expected digest at the held version, and that version (for the error message).
_Base = tuple["str | None", "int | None"]
#: Builds the engine's per-unit targets from a layout and the user's tensors (default: targets_for).
_MakeTargets = Callable[[Mapping[str, TensorSpec], Mapping[str, torch.Tensor]], dict[str, Any]]


def _modified(name: str, index: int, held_version: int | None, spec: TensorSpec | None = None) -> TargetModifiedError:
    members = spec.members if spec is not None else ()
    what = f"tensor {name!r}" if not members else (
        f"group {name!r} (tensors {members[0].name!r} … {members[-1].name!r}; one of them)")
    return TargetModifiedError(
        f"{what} chunk {index}{_block_words(spec, index)} is not what version {held_version} holds there: "
        "the target was modified since it was pulled (pull() it again)"
    )


def _block_words(spec: TensorSpec | None, index: int) -> str:
    """`` (rows r0-r1, columns c0-c1)`` for a chunk of a column-grid tensor (design 011 D4),
    else ''."""
    if spec is None or not spec.chunk_cols:
        return ""
    r0, r1, _, _ = spec.chunk_block(index)
    # columns from the index (not element columns ÷ trailing elements: those may be 0)
    c0 = index % spec.n_colblocks * spec.chunk_cols
    return f" (rows {r0}-{r1}, columns {c0}-{min(c0 + spec.chunk_cols, spec.shape[1])})"


def spread(pool: ThreadPoolExecutor, fn: Callable[[_T], _R], items: list[_T],
           stop: Callable[[], bool] | None = None) -> list[_R | None]:
    """``[fn(item) for item in items]`` on ``pool``, on as many jobs as it has threads, each
    taking the next item from a shared queue: one Future per thread, not per item.

    A Future with its Condition, lock and work item is about eleven objects the cyclic garbage
    collector tracks; one per chunk keeps the collector running several times a pull, promoting
    what a pull holds to the old generation, whose collection walks the whole heap (design 006,
    "The cyclic collector"). Results are in ``items`` order; once
    ``stop()`` is true, or ``fn`` raised, no further item is started (its result is None);
    the first exception is raised once every job has finished.
    """
    if len(items) == 1:  # on this thread, which would only wait: no hand-off, no wake-up
        return [None] if stop is not None and stop() else [fn(items[0])]
    queue = deque(enumerate(items))  # popleft is atomic: the jobs share it without a lock
    out: list[_R | None] = [None] * len(items)
    failed: list[BaseException] = []

    def work() -> None:
        while queue and not failed and not (stop is not None and stop()):
            try:
                i, item = queue.popleft()
            except IndexError:  # another job took the last one
                return
            try:
                out[i] = fn(item)
            except BaseException as e:  # noqa: BLE001 - raised by spread once every job finished
                failed.append(e)
                return

    for j in [pool.submit(work) for _ in range(min(len(items), _pool_threads(pool)))]:
        j.result()
    if failed:
        raise failed[0]
    return out


def _largest_first(groups: list[list[ChunkPlan]], specs: Mapping[str, TensorSpec]) -> list[list[ChunkPlan]]:
    """Groups of plans, the most bytes first: the threads take them from one queue, so the
    last one to finish runs at most the smallest group past the others (in file order, a large
    chunk taken last keeps one thread busy alone for its whole apply)."""
    return sorted(groups, key=lambda g: -sum(specs[p.name].chunk_bytes(p.index) for p in g))


def _pool_threads(pool: ThreadPoolExecutor) -> int:
    return max(1, getattr(pool, "_max_workers", 1))  # not public, but stable since Python 3.2


class _Target:
    """Raw access to one target tensor's chunks, on any device (CPU tensors in place)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.cpu = t.device.type == "cpu"
        self._raw: np.ndarray | None = None

    @property
    def raw(self) -> np.ndarray | None:
        """The CPU tensor's bits as a numpy view (None on a device), made on first use and kept:
        per-chunk torch calls on worker threads queue for the GIL behind numpy, and making all
        of them up front holds up the start of every pull_into on one thread while most are
        needed by one decode thread only (two threads racing make equal views)."""
        if self._raw is None and self.cpu:
            self._raw = bits(self.t)
        return self._raw

    def read(self, a: int, b: int) -> np.ndarray:
        """The chunk's bits: a live view for CPU tensors, a copy for device tensors."""
        if self.raw is not None:
            return self.raw[a:b]
        return bits(self.t.detach().reshape(-1)[a:b].cpu())

    def write(self, a: int, b: int, raw: np.ndarray) -> None:
        if self.raw is not None:
            view = self.raw[a:b]
            if not np.shares_memory(view, raw):
                view[...] = raw
            return
        src = torch.from_numpy(raw.view(raw.dtype.str.replace("u", "i"))).view(self.t.dtype)
        self.t.detach().reshape(-1)[a:b].copy_(src)


def targets_for(specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Raw access per unit of ``specs``: a tensor's :class:`_Target`, or a group row's
    gather/scatter over its members' targets (design 007 D4)."""
    return unit_targets(specs, tensors, _Target)


def _views_while_reading(targets: dict[str, Any], batches: Iterator[Any]) -> None:
    """Make the CPU targets' views (:attr:`_Target.raw`) on this thread until the first batch
    of segments is read: each costs torch calls with the GIL held, which an apply thread would
    otherwise spend at the tensor's first chunk (while the others wait for the GIL), and this
    thread only waits for the read meanwhile."""
    ready = getattr(batches, "ready", None)
    if ready is None:
        return
    for t in targets.values():
        if ready():
            return
        if type(t) is _Target:
            t.raw  # noqa: B018 - made and kept on first use


class ReadEngine:
    """Fetches, verifies, decodes and applies planned chunks for one subscriber.

    Args:
        store: the store to read packs from.
        threads: decode threads.
    """

    def __init__(self, store: Store, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltastore-decode")
        self.io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="deltastore-io")
        # the next batch of Fetcher.batches, fetched while the current one is applied: one
        # thread for the engine's life, not one started per pull (design 006, "The pull_into path")
        self.ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltastore-prefetch")
        self.fetcher = Fetcher(store, self.io, self.ahead)
        self._local = threading.local()  # per decode thread: the staging scratch buffer

    @property
    def bytes_fetched(self) -> int:
        """Segment bytes read from the store so far (cumulative)."""
        return self.fetcher.bytes_fetched

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.ahead.shutdown(wait=True)
        self.io.shutdown(wait=True)

    def materialize(self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], out: dict[str, torch.Tensor],
                    make_targets: _MakeTargets | None = None) -> None:
        """Build every plan (each starts from a full segment) into the new tensors ``out``
        (through ``make_targets(specs, out)`` when given: a partial target, deltastore.layout.select)."""
        targets = (make_targets or targets_for)(specs, out)
        for batch, data, _ in self.fetcher.batches(plans):
            groups = grouped(batch, lambda p: specs[p.name].chunk_bytes(p.index))
            spread(self.pool, partial(self._build_group, specs, data, targets), groups)

    def _build_group(self, specs: dict[str, TensorSpec], data: dict, targets: dict[str, Any], group: list[ChunkPlan]) -> None:
        for p in group:
            self.build(p, specs, data, targets[p.name])

    def build(self, p: ChunkPlan, specs: dict[str, TensorSpec], data: dict, target: _Target) -> None:
        """Decode a plan that starts from a full segment, verify it, write it to ``target``: in
        place where the target is a live view (the new tensors ``pull`` allocated), so that no
        chunk-sized buffer is held besides them (SPEC §7 step 8)."""
        if target.cpu:
            self.replay(p, specs[p.name], data, target.read(*p.span))
            return
        target.write(*p.span, self.replay(p, specs[p.name], data, None))

    @staticmethod
    def replay(
        p: ChunkPlan, spec: TensorSpec, data: dict, raw: np.ndarray | None, base: _Base | None = None,
    ) -> np.ndarray:
        """Run plan ``p`` on ``raw`` (its bits at the plan's start; for a plan that starts from a
        full segment, where to decode it, or None for a new array) in place and check the result
        against the chunk's digest; on any failure ``raw`` is restored (every applied delta
        undone; a decoded full segment leaves unspecified bits) and the error raised.

        With ``base`` (a delta plan's expected digest of ``raw`` at the start, and the held
        version), ``raw``'s start is checked through the result (SPEC §7.5 (iv)): deltas are
        bijections on the bits, so the result matches its digest only if ``raw`` held the base
        bits. Only the result is hashed, in the pass of the last delta (a one-delta plan reads
        ``raw`` once and hashes it once); on a mismatch the deltas are undone and ``raw`` is
        hashed to tell a modified target (TargetModifiedError) from a bad segment (IntegrityError).
        """
        a, b = p.span
        digest = None
        if p.full is not None:
            if raw is None:
                raw = np.empty(b - a, dtype=spec.uint_dtype())
            # the full segment's digest in its decode pass, unless deltas follow
            digest = codec.decode_full_into(data[p.full.where], raw, codec=p.full.ref.codec, digest=not p.deltas)
            base = None  # the plan does not read the target's bits
        assert raw is not None
        applied: list[Step] = []
        try:
            if base is not None and not p.deltas and state_digest(raw) != base[0]:
                raise _modified(p.name, p.index, base[1], spec)
            for i, s in enumerate(p.deltas):
                _, digest = codec.apply_delta_digests(  # validates before writing
                    raw, data[s.where], codec=s.ref.codec, after=i == len(p.deltas) - 1,
                )
                applied.append(s)
            if (digest if p.deltas or p.full is not None else state_digest(raw)) != p.digest:
                raise IntegrityError(
                    f"chunk {p.name}[{p.index}]{_block_words(spec, p.index)} does not match its digest after applying "
                    f"{len(p.steps())} segment(s)"
                )
        except BaseException as e:
            if p.full is None:  # undo in place, newest delta first
                for s in reversed(applied):
                    codec.apply_delta(raw, data[s.where], codec=s.ref.codec, inverse=True)
                if applied and base is not None and isinstance(e, IntegrityError) and state_digest(raw) != base[0]:
                    raise _modified(p.name, p.index, base[1], spec) from e
            raise
        return raw

    def patch_one(self, p: ChunkPlan, data: dict, current: np.ndarray, base: _Base | None,
                  spec: TensorSpec | None = None) -> ChunkPatch | None:
        """Stage a one-delta plan: ``current`` (only read) with the delta applied into a scratch
        buffer and the result hashed in that pass, ``current``'s base checked through the result
        (as :meth:`replay` does in place), and the patch made from the delta's own positions."""
        s = p.deltas[0]
        scratch = self._scratch(current)
        _, after, changes = codec.apply_delta_into(current, scratch, data[s.where], codec=s.ref.codec, after=True)
        if after != p.digest:
            # the result is wrong: from a modified base or a bad segment (SPEC §7.5 (iv))
            if base is not None and state_digest(current) != base[0]:
                raise _modified(p.name, p.index, base[1], spec)
            raise IntegrityError(f"chunk {p.name}[{p.index}]{_block_words(spec, p.index)} does not match its digest "
                                 "after applying 1 segment(s)")
        return make_patch(p.name, p.index, p.span, current, scratch, changes)

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """An uninitialised array like ``like`` in this thread's reused buffer. A fresh chunk-sized
        allocation is a fresh mapping whose first touch page-faults (~a third of a staged chunk's
        cost); the buffer is only read until the patch is made (make_patch copies what it keeps),
        and there is one per decode thread, of at most one chunk."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < like.nbytes:
            buf = self._local.scratch = np.empty(like.nbytes, np.uint8)
        return buf[: like.nbytes].view(like.dtype)

    def check_base(
        self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
        base: dict[tuple[str, int], str], held_version: int | None, make_targets: _MakeTargets | None = None,
    ) -> tuple[list[ChunkPlan], dict[str, _Target], dict[tuple[str, int], _Base]]:
        """Check that ``tensors`` hold the base version's bits in the chunks the update keeps;
        the plans to run (tied weights once), the targets, and the base digest of every chunk a
        delta plan patches, to be checked through its result (:meth:`replay`).

        Raises:
            TargetModifiedError: a chunk the update keeps is not what ``base`` says.
        """
        plans, targets, deferred, expected = self.prepare(plans, specs, tensors, base, held_version, make_targets)
        self.check_kept(specs, targets, expected, held_version)
        return plans, targets, deferred

    def prepare(
        self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
        base: dict[tuple[str, int], str], held_version: int | None, make_targets: _MakeTargets | None = None,
    ) -> tuple[list[ChunkPlan], dict[str, _Target], dict[tuple[str, int], _Base], dict[tuple[str, int], str | None]]:
        """:meth:`check_base` without the hashing: the plans to run, the targets, the deferred
        base digests, and the digests the kept chunks must have (for :meth:`check_kept`)."""
        # Tied weights (one storage under two names) are updated once.
        # A group row is its own owner: its members are written through it (design 007 D4).
        seen: dict[tuple[int, int], str] = {}
        owner: dict[str, str] = {n: n for n, s in specs.items() if s.members}
        # members are never tied (groups.tied_names); ``tensors`` holds exactly the layout's
        # tensors (checked before), so the ungrouped units, in target order, are the rest
        for n, t in tensors.items():
            if n not in specs or specs[n].members:
                continue
            k = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), t.numel())
            owner[n] = seen.setdefault(k, n)
        plans = [p for p in plans if owner[p.name] == p.name]
        targets = (make_targets or targets_for)(specs, tensors)

        # SPEC §7.5: every chunk the target keeps or patches must hold version h's bits, not only
        # the chunks this update touches (a local edit elsewhere would survive silently).
        # Chunks a delta plan patches are checked through their result (hashed once, in the
        # pass of the last delta; a mismatch is undone before anything is reported, see
        # replay and SPEC §7.5 (iv)); the rest here, before any write.
        replaced = {(p.name, p.index) for p in plans if p.full is not None}
        patched = {(p.name, p.index) for p in plans if p.full is None}
        kept = {k for k in base if owner.get(k[0]) == k[0]} | patched

        expected = {k: base.get(k) for k in kept - replaced - patched}
        deferred: dict[tuple[str, int], _Base] = {k: (base.get(k), held_version) for k in patched - replaced}
        return plans, targets, deferred, expected

    def check_kept(self, specs: Mapping[str, TensorSpec], targets: dict[str, Any],
                   expected: dict[tuple[str, int], str | None], held_version: int | None) -> None:
        """Raise TargetModifiedError unless every chunk in ``expected`` hashes to its digest."""
        bad = digest_mismatches(self.pool, specs, expected, lambda name, a, b: targets[name].read(a, b))
        if bad:
            raise _modified(*bad[0], held_version, specs[bad[0][0]])

    @staticmethod
    def base_checker(
        targets: dict[str, _Target], deferred: dict[tuple[str, int], _Base],
    ) -> Callable[[ChunkPlan], None]:
        """A check that a delta plan's chunk still holds its base bits, for when the plan failed
        before its apply pass could tell (a fallback must not overwrite a modified chunk)."""

        def check(p: ChunkPlan) -> None:
            want = deferred.get((p.name, p.index))
            if p.full is None and want is not None and state_digest(targets[p.name].read(*p.span)) != want[0]:
                raise _modified(p.name, p.index, want[1], getattr(targets[p.name], "spec", None))

        return check

    def with_fallbacks(
        self, p: ChunkPlan, data: Segments, errors: SegmentErrors, attempt: Callable[[ChunkPlan, Segments, SegmentErrors], _R],
        check_base: Callable[[ChunkPlan], None] | None = None,
    ) -> _R:
        """``attempt(p)``, else ``attempt`` of each full-segment fallback (a failed attempt
        must leave the target as it was); raises the last error when all fail.

        ``check_base(p)`` runs after ``p`` failed, before anything else: a modified target
        (TargetModifiedError, never a reason to fall back) is reported as such."""
        try:
            return attempt(p, data, errors)
        except TargetModifiedError:
            raise
        except _BAD_DATA as e:
            error: DeltastoreError = e
        if check_base is not None:
            check_base(p)
        for alt in p.fallbacks:
            assert alt.full is not None
            logger.warning(
                "chunk %s[%d]: %s; taking the full segment at %d of pack %s instead",
                p.name, p.index, error, alt.full.ref.offset, alt.full.blob.key,
            )
            try:
                alt_errors: SegmentErrors = {}
                return attempt(alt, self.fetcher.fetch(alt.steps(), alt_errors), alt_errors)
            except _BAD_DATA as e:
                error = e
        raise error

    def stage(
        self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
        base: dict[tuple[str, int], str], held_version: int | None, make_targets: _MakeTargets | None = None,
    ) -> tuple[list[ChunkPatch], float, float]:
        """Prepare every plan as a patch against ``tensors`` without writing them (SPEC §7.7).

        Each chunk is rebuilt in a scratch buffer (from the target's current bits, or from a full
        segment), its digest checked there, and only the difference kept (:func:`make_patch`).
        The patches are of ``tensors``; with ``make_targets`` (a partial target,
        deltastore.layout.select) they are of the layout's units, each chunk's patch as it is,
        for the caller to carry into the user's tensors (:meth:`Partial.user_patches
        <deltastore.read.partial.Partial.user_patches>`).

        Returns:
            ``(patches, fetch_s, decode_s)``: the seconds spent waiting for segments, and
            checking and decoding them.

        Raises:
            TargetModifiedError: the target does not hold the base version (nothing staged).
            IntegrityError, FormatError, NotFoundError: a chunk failed on every path.
        """
        t0 = time.perf_counter()
        plans, targets, deferred = self.check_base(plans, specs, tensors, base, held_version, make_targets)
        check = self.base_checker(targets, deferred)
        decode_s = time.perf_counter() - t0
        fetch_s = 0.0

        def attempt(p: ChunkPlan, data: Segments, errors: SegmentErrors) -> ChunkPatch | None:
            for st in p.steps():
                if st.where in errors:
                    raise errors[st.where]
            tgt = targets[p.name]
            current = tgt.read(*p.span)
            if p.full is None and len(p.deltas) == 1:  # the common case: one pass, no compare
                return self.patch_one(p, data, current, deferred.get((p.name, p.index)), specs[p.name])
            scratch = None if p.full is not None else current.copy()
            result = self.replay(p, specs[p.name], data, scratch, deferred.get((p.name, p.index)))  # checks both digests
            return make_patch(p.name, p.index, p.span, current, result)

        def run_group(group: list[ChunkPlan], data: Segments, errors: SegmentErrors) -> list[ChunkPatch]:
            out = []
            for p in group:
                patch = self.with_fallbacks(p, data, errors, attempt, check)
                if patch is not None:
                    out.append(patch)
            return out

        patches: list[ChunkPatch] = []
        batches = self.fetcher.batches(plans, tolerant=True)
        try:
            while True:
                t = time.perf_counter()
                item = next(batches, None)
                fetch_s += time.perf_counter() - t
                if item is None:
                    break
                batch, data, errors = item
                t = time.perf_counter()
                groups = grouped(batch, lambda p: specs[p.name].chunk_bytes(p.index))
                for found in spread(self.pool, partial(run_group, data=data, errors=errors), groups):
                    patches.extend(found or ())
                decode_s += time.perf_counter() - t
        finally:
            batches.close()  # stops the prefetch thread when a chunk failed
        if make_targets is not None:
            return patches, fetch_s, decode_s
        if any(specs[p.name].members for p in patches):  # swaps write tensors (design 007 D4)
            patches = [q for p in patches for q in (split_patch(p, specs[p.name]) if specs[p.name].members else [p])]
        for p in patches:  # a grid chunk lands in its block of the tensor (design 011 D4)
            spec = specs.get(p.name)
            if spec is not None and spec.chunk_cols:
                p.block, p.row = spec.chunk_block(p.index), spec.row_elems
        return patches, fetch_s, decode_s

    def apply_in_place(
        self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
        base: dict[tuple[str, int], str], held_version: int | None, make_targets: _MakeTargets | None = None,
    ) -> None:
        """Apply every plan to ``tensors``; on any failure restore what was applied, then raise.

        The chunks the update keeps are checked against ``base`` before any write; each chunk a
        delta plan patches is checked through its result, and a mismatch there is
        rolled back like any other failure (undoing is exact, so the target ends with the bits
        it had, modified or not: SPEC §7.5)."""
        plans, targets, deferred, expected = self.prepare(plans, specs, tensors, base, held_version, make_targets)
        check = self.base_checker(targets, deferred)
        # The segments are read (and each checked as it is decoded, CheckedOnRead) while the
        # kept chunks are hashed: nothing is written before check_kept passed (SPEC §7.5).
        batches = self.fetcher.batches(plans, tolerant=True, check_on_read=True)
        try:
            self.check_kept(specs, targets, expected, held_version)
        except BaseException:
            batches.close()
            raise
        _views_while_reading(targets, batches)

        done: list[tuple[ChunkPlan, np.ndarray | None]] = []  # (plan, saved old bits if replaced)
        undo: dict[tuple[str, int], bytes] = {}  # delta segments of applied chunks, to roll back
        _Done = tuple[ChunkPlan, "np.ndarray | None", Segments]

        def attempt(p: ChunkPlan, data: Segments, errors: SegmentErrors) -> _Done:
            for st in p.steps():
                if st.where in errors:
                    raise errors[st.where]
                data[st.where]  # CheckedOnRead: its SHA-256, before anything is applied
            tgt = targets[p.name]
            if p.full is None:
                b = deferred.get((p.name, p.index))
                if tgt.cpu:
                    self.replay(p, specs[p.name], data, tgt.read(*p.span), b)
                else:
                    raw = tgt.read(*p.span)
                    self.replay(p, specs[p.name], data, raw, b)
                    tgt.write(*p.span, raw)
                return p, None, data
            if tgt.cpu:  # decoded in place (SPEC §7 step 8), the bits it replaces saved for a rollback
                view = tgt.read(*p.span)
                saved = view.copy()
                try:
                    self.replay(p, specs[p.name], data, view)
                except BaseException:
                    view[...] = saved  # a failed attempt leaves the target as it was
                    raise
                return p, saved, data
            new = self.replay(p, specs[p.name], data, None)
            saved = tgt.read(*p.span).copy()
            tgt.write(*p.span, new)
            return p, saved, data

        def run(p: ChunkPlan, data: Segments, errors: SegmentErrors) -> _Done:
            return self.with_fallbacks(p, data, errors, attempt, check)

        failures: list[BaseException] = []  # a failed group stops the others of its batch early

        def run_group(group: list[ChunkPlan], data: Segments, errors: SegmentErrors) -> tuple[list[_Done], BaseException | None]:
            applied = []
            for p in group:
                try:
                    applied.append(run(p, data, errors))
                except BaseException as e:  # noqa: BLE001 - re-raised by the caller after rollback
                    failures.append(e)
                    return applied, e
            return applied, None

        error: BaseException | None = None
        try:
            for batch, data, errors in batches:
                groups = _largest_first(grouped(batch, lambda p: specs[p.name].chunk_bytes(p.index)), specs)
                for result in spread(self.pool, partial(run_group, data=data, errors=errors), groups, lambda: bool(failures)):
                    if result is None:  # not started: another group failed first
                        continue
                    applied, failed = result
                    error = error or failed
                    for p, saved, segs in applied:
                        done.append((p, saved))
                        if saved is None:
                            undo.update((s.where, segs[s.where]) for s in p.deltas)
                if error is not None:
                    break
        except BaseException as e:  # noqa: BLE001 - a fetch failed: roll back what was applied
            error = e
        finally:
            batches.close()
        if error is None:
            return
        for p, saved in done:
            tgt = targets[p.name]
            if saved is not None:
                tgt.write(*p.span, saved)
            else:
                raw = tgt.read(*p.span)
                for s in reversed(p.deltas):
                    codec.apply_delta(raw, undo[s.where], codec=s.ref.codec, inverse=True)
                if not tgt.cpu:
                    tgt.write(*p.span, raw)
        logger.error("pull_into failed and rolled back %d chunk(s): %s", len(done), error)
        raise error


def digest_mismatches(
    pool: ThreadPoolExecutor, specs: Mapping[str, TensorSpec], expected: Mapping[tuple[str, int], str | None],
    read: Callable[[str, int, int], np.ndarray],
) -> list[tuple[str, int]]:
    """The chunks, in key order, whose bits (``read(name, start, stop)``) do not hash to their
    ``expected`` digest; hashed on ``pool`` in groups of about JOB_BYTES."""

    def bad(group: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [k for k in group if state_digest(read(k[0], *specs[k[0]].chunk_span(k[1]))) != expected[k]]

    groups = grouped(sorted(expected), lambda k: specs[k[0]].chunk_bytes(k[1]))
    return [k for found in spread(pool, bad, groups) for k in found or ()]
