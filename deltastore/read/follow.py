"""Following a store (SPEC §7.7, §10): keep a target at the latest version, for weeks.

The loop polls HEAD by conditional GET, stages each new version while the caller keeps using
its target and swaps it in inside the caller's pause. Around it: a worker cache to restart from
without refetching (verified against the store before it is adopted), heartbeats in the fleet
ledger, backoff after errors, and the policy for a replaced history. The settings come as small
validated values: :class:`PollPolicy`, :class:`CachePolicy`, :class:`HeartbeatPolicy`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltastore.errors import (
    DeltastoreError,
    FormatError,
    HeadRolledBackError,
    HistoryReplacedError,
    IntegrityError,
    LayoutMismatchError,
    NotFoundError,
    StaleStageError,
    StorageError,
    TargetModifiedError,
    VersionNotFoundError,
)
from deltastore.fleet.deadlines import Deadlines
from deltastore.fleet.ledger import HEARTBEAT_INTERVAL_S
from deltastore.fleet.watch import IDLE, FollowWatch
from deltastore.format.history import VersionInfo
from deltastore.layout.tied import recorded_aliases
from deltastore.read.cache import WorkerCache
from deltastore.read.catchup import Held
from deltastore.read.changes import changed_rows, changed_tensors
from deltastore.read.converge import TargetSteer
from deltastore.read.partial import Spare, cached_spare, selection_doc
from deltastore.read.plan import ChunkPlan, digests, layout, plan_from_anchor
from deltastore.read.reader import Reader
from deltastore.read.targets import Target, module_targets, owners, target_tensors, whole

logger = logging.getLogger(__name__)


def _finite(name: str, value: float, *, low: float, strict: bool) -> None:
    ok = math.isfinite(value) and (value > low if strict else value >= low)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'above' if strict else 'at least'} {low}, got {value!r}")


@dataclass(frozen=True)
class PollPolicy:
    """How often :meth:`~deltastore.Subscriber.follow` looks at HEAD.

    Attributes:
        interval: seconds between polls; each is a conditional GET of HEAD (an idle poll: one
            request, no body), and one of the fleet target unless ``fleet_target=False``.
        jitter: each wait is spread by ± this fraction of it (0 to 1), so a fleet does not poll
            in lockstep.
        max_interval: the longest wait of the exponential backoff after errors (at least
            ``interval``).

    Raises:
        ValueError: a value out of range.
    """

    interval: float = 2.0
    jitter: float = 0.1
    max_interval: float = 60.0

    def __post_init__(self) -> None:
        _finite("PollPolicy.interval", self.interval, low=0.0, strict=True)
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"PollPolicy.jitter must be a fraction from 0 to 1, got {self.jitter!r}")
        _finite("PollPolicy.max_interval", self.max_interval, low=self.interval, strict=False)

    def wait_s(self) -> float:
        """The wait before the next poll: ``interval``, jittered."""
        return _jittered(self.interval, self.jitter)

    def backoff_s(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row: doubled per failure up to ``max_interval``, jittered."""
        return _jittered(min(self.max_interval, self.interval * 2**failures), self.jitter)


@dataclass(frozen=True)
class CachePolicy:
    """A worker cache for :meth:`~deltastore.Subscriber.follow` to restart from
    (:class:`deltastore.read.cache.WorkerCache`).

    On start, a cached version is verified against the store (chain, lineage, every chunk
    digest) and adopted without fetching it; anything wrong with it is logged and the cache is
    rebuilt. A save that fails (a full disk) is logged and the loop goes on (the previous
    cached version is kept).

    Attributes:
        path: the cache directory (created if missing; a path that cannot be a directory raises
            WorkerCacheError when the loop starts, before anything is fetched).
        every_s: the held version is saved every this many seconds, and when the loop ends.

    Raises:
        ValueError: a negative ``every_s``.
    """

    path: str | os.PathLike[str]
    every_s: float = 300.0

    def __post_init__(self) -> None:
        _finite("CachePolicy.every_s", self.every_s, low=0.0, strict=False)


@dataclass(frozen=True)
class HeartbeatPolicy:
    """Heartbeats in the store's fleet ledger (SPEC §10) while :meth:`~deltastore.Subscriber.follow` runs.

    A writer already running (:meth:`~deltastore.Subscriber.heartbeat`) is used as it is; one
    started by the loop writes a last heartbeat marked stopped when the loop ends. Read-only
    credentials are tolerated (one log line, no heartbeats).

    Attributes:
        worker_id: the worker's id in the ledger (default: the id the subscriber used before,
            else ``host-pid-random``).
        interval_s: the longest time between two heartbeats of an unchanged version.

    Raises:
        ValueError: a ``interval_s`` that is not positive.
    """

    worker_id: str | None = None
    interval_s: float = HEARTBEAT_INTERVAL_S

    def __post_init__(self) -> None:
        _finite("HeartbeatPolicy.interval_s", self.interval_s, low=0.0, strict=True)


@dataclass(frozen=True)
class FollowRecord:
    """One version applied by :meth:`Subscriber.follow`.

    Attributes:
        info: the version now held by the target.
        from_version: the version the target held before (None: a full load).
        bytes_fetched: bytes of packs read from the store for it.
        fetch_s: seconds spent waiting for segments (before the pause).
        decode_s: seconds spent checking, decoding and verifying chunks (before the pause).
        pause_s: seconds inside the pause hook (the only time the target is written). A full
            load runs wholly inside the pause: its fetch_s and decode_s are 0.
        changed: tensor name → element spans ``[start, stop)`` written, so an engine can
            reload only those (a full load lists every tensor whole).
        full_load: the target was loaded whole (the first version, or a replaced history).
    """

    info: VersionInfo
    from_version: int | None
    bytes_fetched: int
    fetch_s: float
    decode_s: float
    pause_s: float
    changed: dict[str, list[tuple[int, int]]]
    full_load: bool

    def updates(self, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor this version changed, taken from ``target`` (the
        one followed), whole: what ``model.load_weights`` takes. Computed from the plan, no pass
        over the weights (:func:`deltastore.read.changes.changed_tensors`)."""
        return changed_tensors(target, self.changed)

    def rows(self, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> Iterator[tuple[str, list[tuple[int, int]], torch.Tensor]]:
        """``(name, rows, tensor)``: as :meth:`updates`, with the row ranges along dim 0 that
        changed (:func:`deltastore.read.changes.changed_rows`)."""
        return changed_rows(target, self.changed)


def follow(
    reader: Reader,
    target: Target,
    *,
    poll: PollPolicy,
    pause: Any,
    stop: threading.Event | None,
    cache: CachePolicy | None,
    heartbeat: HeartbeatPolicy | None,
    max_versions: int | None,
    swap_mode: str,
    on_history_replaced: str | None,
    fleet_target: bool = True,
    metrics_port: int | None = None,
    deadlines: Deadlines | None = None,
) -> Iterator[FollowRecord]:
    """The loop of :meth:`deltastore.Subscriber.follow` (see there), on ``reader``."""
    for name, value, kind in (("poll", poll, PollPolicy), ("cache", cache, CachePolicy),
                              ("heartbeat", heartbeat, HeartbeatPolicy)):
        if not isinstance(value, kind) and (value is not None or kind is PollPolicy):
            raise TypeError(f"follow's {name} must be a {kind.__name__}, not {type(value).__name__}")
    if swap_mode not in ("inplace", "rebind"):
        raise ValueError(f"swap_mode must be 'inplace' or 'rebind', got {swap_mode!r}")
    if on_history_replaced not in (None, "raise", "reload"):
        raise ValueError(f"on_history_replaced must be 'raise' or 'reload' (or None), got {on_history_replaced!r}")
    replaced = on_history_replaced or ("raise" if reader.keys is not None else "reload")
    steer = TargetSteer(reader) if fleet_target else None
    rolled_back: str | None = None  # the older HEAD manifest last warned about (once per HEAD)
    tensors = module_targets(target)
    rebind = owners(target) if swap_mode == "rebind" else None
    stop = stop if stop is not None else threading.Event()
    worker_cache = WorkerCache(cache.path) if cache is not None else None
    try_cache = worker_cache is not None and reader.held is None
    saved: str | None = None  # manifest key of the version last written to the cache
    last_save = time.monotonic()
    applied = failures = 0

    def save() -> None:
        nonlocal saved, last_save
        held = reader.held
        if worker_cache is None or held is None or held.key == saved:
            return  # (a key, not a number: a replaced history reuses version numbers)
        key, m = held.key, held.manifest
        part = reader.partial
        try:
            worker_cache.save(tensors, url=reader.url, version=m.version, manifest=key, lineage=m.lineage,
                              selection=None if part is None else selection_doc(part.select),
                              spare=None if part is None else part.spare)
            saved = key
        except Exception as e:  # noqa: BLE001 - the cache is a hint: failing to write it never stops serving
            logger.warning("following %s without updating the worker cache: %s: %s", reader.url, type(e).__name__, e)
        last_save = time.monotonic()  # a failed save is retried after every_s, not at every poll

    # spans, CPU-phase deadlines, metrics (deltastore.fleet.watch): a taken port fails here, before any IO
    watch = FollowWatch.start(reader.url, tensors, metrics_port=metrics_port, deadlines=deadlines)
    # Started last before the loop, so that the finally below always closes it (marks it stopped).
    own_beats = heartbeat is not None and (reader.beats is None or reader.beats.closed)
    try:
        beats = reader.heartbeat(heartbeat.worker_id, heartbeat.interval_s) if heartbeat is not None else None
    except BaseException:
        watch.close()
        raise
    try:
        while not stop.is_set():
            try:
                if try_cache:
                    assert worker_cache is not None
                    rec = _adopt_cache(reader, worker_cache, tensors, pause, replaced)
                    try_cache = False
                    saved = None if rec is None else rec.info.manifest
                else:
                    rec = _follow_once(reader, tensors, pause, rebind, steer, watch)
                failures = 0
                watch.seen(reader, rec)
            except HistoryReplacedError as e:
                if replaced == "raise":
                    raise HistoryReplacedError(
                        f"{e}; or follow with on_history_replaced='reload' to load it whole (with trusted keys, "
                        "only if a new run is expected: anyone who can write HEAD can point it at any run signed "
                        "by the same key)"
                    ) from None
                logger.warning("following %s: %s; loading the new history whole", reader.url, e)
                reader.drop_held()
                continue
            except HeadRolledBackError as e:
                # Not a failure to back off from: HEAD may stay there (a restored backup) or
                # come back; the target keeps its version and takes the next newer one.
                watch.failed(e)  # counted per poll while it lasts: an operator must see it
                head_key = None if reader.head is None else reader.head.manifest
                if head_key != rolled_back:
                    logger.warning("following %s: %s; keeping version %s", reader.url, e, reader.version)
                    rolled_back = head_key
                stop.wait(poll.wait_s())
                continue
            except (LayoutMismatchError, TargetModifiedError, StaleStageError):
                raise
            except (StorageError, IntegrityError, FormatError, VersionNotFoundError) as e:
                failures += 1
                watch.failed(e)
                if steer is not None:
                    steer.failed(e)  # the last error, in the worker's heartbeat
                delay = poll.backoff_s(failures)
                logger.warning(
                    "following %s: %s: %s; keeping version %s, retrying in %.1f s",
                    reader.url, type(e).__name__, e, reader.version, delay,
                )
                stop.wait(delay)
                continue
            if rec is not None:
                applied += 1
                rolled_back = None
                if steer is not None:
                    steer.applied()
                yield rec
                if max_versions is not None and applied >= max_versions:
                    break
            if cache is not None and time.monotonic() - last_save >= cache.every_s:
                save()
            if rec is None:
                stop.wait(poll.wait_s())
    except GeneratorExit:  # the caller stopped iterating: a normal end too
        save()
        raise
    else:
        save()
    finally:
        watch.close()
        if own_beats and beats is not None:
            beats.close()  # a worker that stops following says so in the ledger


def _follow_once(reader: Reader, tensors: dict[str, torch.Tensor], pause: Any,
                 rebind: dict[str, torch.Tensor] | None = None, steer: TargetSteer | None = None,
                 watch: FollowWatch = IDLE) -> FollowRecord | None:
    """One poll: None when HEAD has not moved, else the record of the version applied. With
    ``steer``, the version to hold is the fleet target's while one applies (forwards or back)."""
    with watch.phase("poll"):
        head = reader.history.poll_head()  # a conditional GET: no body when unchanged
    if head is None or head.manifest is None:
        if reader.held is None and not reader.said_waiting:
            logger.info("waiting for the first version of %s", reader.url)
            reader.said_waiting = True
        return None
    reader.head = head
    goal = None if steer is None else steer.goal(head)  # None: HEAD's version
    if reader.held is not None and (head.manifest if goal is None else goal[0]) == reader.held.key:
        return None
    top = goal or reader.history.head_manifest(head)
    assert top is not None
    key, m = top
    if reader.held is None:  # nothing held: a full load, all or nothing, in the pause
        before = reader.engine.bytes_fetched
        with _pause_context(pause), watch.phase("apply", m.version):
            t0 = time.perf_counter()
            info = reader.fast_forward(key, m, tensors)
            pause_s = time.perf_counter() - t0
        assert info is not None
        return FollowRecord(info, None, reader.engine.bytes_fetched - before, 0.0, 0.0, pause_s, whole(tensors), True)
    with watch.phase("stage", m.version):
        staged = reader.stage(key, m, tensors) if steer is None else steer.stage(key, m, tensors)
    if staged is None:
        return None
    if rebind is not None:  # swap_mode="rebind": patch copies now, repoint in the pause
        t0 = time.perf_counter()
        staged.build_replacements(tensors)
        staged.decode_s += time.perf_counter() - t0
    with _pause_context(pause), watch.phase("apply", m.version):
        t0 = time.perf_counter()
        reader.swap(staged, rebind if rebind is not None else tensors)
        pause_s = time.perf_counter() - t0
    if rebind is not None:  # later stages read the new storage (Parameters got new .data)
        staged.retired.clear()  # the old storages are freed here, after the pause
        tensors.update(target_tensors(rebind))
    return FollowRecord(
        staged.info, staged.from_version, staged.bytes_fetched, staged.fetch_s, staged.decode_s,
        pause_s, staged.changed, False,
    )


class _Unusable(Exception):
    """A worker cache that does not hold a version of this store (internal)."""


def _adopt_cache(reader: Reader, cache: WorkerCache, tensors: dict[str, torch.Tensor], pause: Any,
                 replaced: str = "reload") -> FollowRecord | None:
    """Verify a cached state against the store and load it into ``tensors`` (in the pause).

    Returns None (the cache cleared, with a log line) when it is not usable; a transient
    storage error is raised (the cache is kept for the retry), and so is a cache of
    another lineage under ``replaced="raise"`` (HistoryReplacedError, the cache kept).
    """
    st = cache.load()
    if st is None:
        return None
    url, history = reader.url, reader.history
    part = reader.partial
    collected: int | None = None  # the floor, when the cached version was collected
    spare: Spare = {}
    try:
        if st.url != url:
            raise _Unusable(f"it belongs to {st.url}")
        if st.selection != (None if part is None else selection_doc(part.select)):
            raise _Unusable("it holds another selection" if st.selection is not None else "it holds whole tensors")
        head = reader.require_head()
        top = history.head_manifest(head)
        assert top is not None
        if top[1].lineage != st.lineage:
            if replaced == "raise" and top[1].lineage is not None and st.lineage is not None:
                # the cache is the held version of a restarted follower: the same rule as follow's
                raise HistoryReplacedError(
                    f"the history of {url} was replaced: its lineage is {top[1].lineage}, the worker cache in "
                    f"{cache.path} holds version {st.version} of lineage {st.lineage}; nothing was loaded and the "
                    "cache is kept. Delete the cache directory to start over"
                )
            raise _Unusable(f"the store's lineage is {top[1].lineage}, the cache's {st.lineage}")
        index = reader.index(head)
        if index is not None and st.version < index.floor:
            # Design 005 D2: the cached version's manifests are gone; hash the cached chunks
            # against head's digests and fetch only the chunks that differ (from its anchor).
            collected = index.floor
            key, m = top
        elif reader.keys is not None and st.version > top[1].version:
            # HEAD is older than the cached version of the same lineage (rolled back): a
            # trusted follower keeps its version across a restart too, checked against its
            # own signed manifest; the loop then meets the older HEAD (HeadRolledBackError).
            key = st.manifest
            try:
                m = history.manifest(key)
            except NotFoundError:
                raise _Unusable(f"its manifest {key!r} is gone") from None
            if m.version != st.version or m.lineage != st.lineage:
                raise _Unusable(f"{key!r} is version {m.version} of lineage {m.lineage}")
        else:
            key, m = history.find(st.version, head)
            if key != st.manifest:
                raise _Unusable(f"version {st.version} of {url} is now {key!r}, not {st.manifest!r}")
        ms = history.anchor_chain(key, m)
        specs = layout(ms[0][1])
        if part is not None:
            if collected is not None:
                raise _Unusable(f"its version {st.version} was collected (a partial cache is loaded whole or not at all)")
            got = cached_spare(specs, part.resolved(specs), st.spare)
            if got is None:
                raise _Unusable("its bits of the chunks straddling the selection are not the layout's")
            spare = got
        bad = reader.chunk_mismatches(specs, digests(ms), st.tensors, against=f"version {m.version} of {url}",
                                      spare=spare)
        if bad and collected is None:
            raise _Unusable(f"tensor {bad[0][0]!r} chunk {bad[0][1]} does not match its digest")
    except NotFoundError:
        raise  # maybe transient (HEAD briefly ahead of its manifest): keep the cache, retry
    except (StorageError, HistoryReplacedError):
        raise
    except (_Unusable, DeltastoreError, KeyError) as e:
        logger.warning("the worker cache in %s is not usable for %s (%s): clearing it and loading in full",
                       cache.path, url, e)
        cache.clear()
        return None
    reader.check_target(specs, tensors, against=f"version {m.version} of {url}",  # the target's problem
                        tied=recorded_aliases(m.metadata))
    plans: list[ChunkPlan] = []
    if collected is not None:
        logger.info("version %d was collected (floor %d); catching up from anchor %d", st.version, collected, m.anchor)
        stale = set(bad)
        plans = [p for p in plan_from_anchor(ms, specs) if (p.name, p.index) in stale]
    before = reader.engine.bytes_fetched
    with _pause_context(pause):
        t0 = time.perf_counter()
        for n, t in tensors.items():
            t.copy_(st.tensors[n])
        if plans:  # the chunks the cache lacks, from the anchor (all or nothing, as a full load)
            kept = {k: d for k, d in digests(ms).items() if k not in stale}
            reader.engine.apply_in_place(plans, specs, tensors, kept, None)
        pause_s = time.perf_counter() - t0
    if part is not None:
        part.spare = spare
    reader.set_held(Held.of(ms))
    reader.changed = whole(tensors)
    logger.info("resumed version %d of %s from the worker cache in %s (%d chunk(s) fetched)",
                m.version, url, cache.path, len(plans))
    return FollowRecord(VersionInfo.from_manifest(m, key), None, reader.engine.bytes_fetched - before, 0.0, 0.0,
                        pause_s, whole(tensors), True)


def _jittered(seconds: float, jitter: float) -> float:
    """``seconds`` spread by ± ``jitter`` of it, so a fleet does not poll in lockstep."""
    return max(0.0, seconds * (1.0 + random.uniform(-jitter, jitter)))


def _pause_context(pause: Any) -> contextlib.AbstractContextManager[Any]:
    """The pause hook as a context manager: None, a context manager, or a callable returning one."""
    if pause is None:
        return contextlib.nullcontext()
    if not isinstance(pause, type) and hasattr(pause, "__enter__") and hasattr(pause, "__exit__"):
        return pause  # a lock or any context manager (a class is a callable making one)
    if callable(pause):
        return pause()
    raise TypeError(f"pause must be None, a context manager or a callable returning one, not {type(pause).__name__}")
