"""The read path (SPEC §7): poll HEAD, plan which segments to fetch, verify, apply."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltastore.apply import (
    ReadEngine,
    _batched,
    digest_mismatches,
    _target_tensors,
    _torch_dtype,
    _verify_chunk,
)
from deltastore.cache import WorkerCache
from deltastore.errors import (
    CorruptObjectError,
    DeltastoreError,
    FormatError,
    HistoryReplacedError,
    IntegrityError,
    LayoutMismatchError,
    NotFoundError,
    StaleStageError,
    StorageError,
    TargetModifiedError,
    VersionNotFoundError,
)
from deltastore.history import History, VersionInfo
from deltastore.jobs import default_threads, grouped
from deltastore.ledger import HeartbeatWriter
from deltastore.manifest import MAX_MANIFEST_BYTES, Head, Manifest
from deltastore.plan import (
    ChunkPlan,
    Manifests,
    Step,
    check_entries,
    plan_forward,
    plan_from_anchor,
)
from deltastore.plan import digests as _digests
from deltastore.plan import layout as _layout
from deltastore.stage import StagedUpdate
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.tensors import TensorSpec, bits, check_layout

logger = logging.getLogger(__name__)

_Manifests = Manifests


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class Problem:
    """One bad segment or chunk found by :meth:`Subscriber.verify`.

    Attributes:
        version: the version whose manifest lists it.
        manifest: that manifest's key.
        message: what is wrong, naming the tensor, chunk, segment and pack.
    """

    version: int
    manifest: str
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`Subscriber.verify` checked, and every problem it found.

    Attributes:
        url: the store.
        versions: the versions whose manifests were checked, oldest first.
        tensors: per version, the number of tensors in its layout.
        segments: segments fetched, SHA-256-checked and decoded.
        problems: every bad segment or chunk (empty when the store is sound).
    """

    url: str
    versions: list[int]
    tensors: dict[int, int]
    segments: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


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


class Subscriber:
    """Reads versions from a store and keeps a state dict or module up to date.

    Args:
        url: store URL (see :class:`deltastore.Publisher`).
        storage_options: passed to the storage backend.
        threads: decode threads (default: all cores).
        trusted_keys: Ed25519 public keys (key objects, PEM bytes or PEM file paths); when
            given, every manifest used must be signed by one of them, else SignatureError
            (SPEC §3.1). Needs ``cryptography`` (``deltastore[signing]``).
        max_model_bytes: refuse to materialize a version whose tensors declare more bytes than
            this (default: this machine's physical memory), checked before allocating: a few KB
            of hostile metadata must not become gigabytes resident.
        max_manifest_bytes: refuse a manifest larger than this before parsing it.

    Example::

        sub = Subscriber("s3://bucket/run1")
        weights = sub.pull()                 # the latest version, verified
        model.load_state_dict(weights)
        while True:
            if sub.pull_into(model):         # fetches only what changed
                ...
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        threads: int | None = None,
        store: Store | None = None,
        trusted_keys: Iterable[Any] | None = None,
        max_model_bytes: int | None = None,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
    ):
        """``store``: an already opened store to use instead of ``url`` (not closed by us)."""
        check = None
        if trusted_keys is not None:
            from deltastore.signing import TrustedKeys

            check = TrustedKeys(trusted_keys).verify  # keys checked before the store is opened
        self.store = store if store is not None else open_store(url, storage_options=dict(storage_options or {}))
        self._owns_store = store is None  # a store passed in belongs to the caller
        self.url = self.store.url
        self.max_model_bytes = max_model_bytes if max_model_bytes is not None else physical_memory()
        self._history = History(self.store, check, max_manifest_bytes=max_manifest_bytes)
        self._engine = ReadEngine(self.store, threads or default_threads())
        self._pool = self._engine.pool
        self._fetcher = self._engine.fetcher
        self._version: int | None = None
        self._held: _Manifests | None = None  # anchor..held version, for layout and digests
        self._closed = False

    @property
    def version(self) -> int | None:
        """The version this subscriber last pulled (None before the first pull)."""
        return self._version

    @property
    def bytes_fetched(self) -> int:
        """Bytes of packs read from the store by this subscriber so far (manifests excluded)."""
        return self._fetcher.bytes_fetched

    def layout(self) -> dict[str, TensorSpec]:
        """The tensor layout (names, dtypes, shapes, chunking) of the version last pulled."""
        if self._held is None:
            raise VersionNotFoundError(f"no version of {self.url} has been pulled yet")
        return _layout(self._held[0][1])

    def latest(self) -> VersionInfo | None:
        """The newest committed version (None for an empty store), via a conditional GET."""
        head = self._history.poll_head()
        if head is None:
            return None
        top = self._history.head_manifest(head)
        return None if top is None else VersionInfo.from_manifest(top[1], top[0])

    def info(self, version: int) -> VersionInfo:
        """The :class:`VersionInfo` of ``version``; raises VersionNotFoundError."""
        key, m = self._history.find(version, self._require_head())
        return VersionInfo.from_manifest(m, key)

    def log(self, since: int = 1) -> list[VersionInfo]:
        """Every committed version from ``since`` (default: the first) to the latest, oldest first."""
        head = self._history.poll_head()
        return [] if head is None else self._history.log(head, since=since)

    def pull(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """Materialize ``version`` (default: the latest) as new CPU tensors, verified.

        Raises:
            VersionNotFoundError: no such version (or an empty store).
            IntegrityError: a segment or a reconstructed chunk failed its digest.
        """
        key, m = self._resolve(version)
        ms = self._history.anchor_chain(key, m)
        specs = _layout(ms[0][1])
        plans = self._plan_from_anchor(ms, specs)  # checks the whole chain before allocating
        self._check_model_size(specs, m.version)
        out = {n: torch.empty(s.shape, dtype=_torch_dtype(s.dtype)) for n, s in specs.items()}
        self._engine.materialize(plans, specs, out)
        self._version, self._held = m.version, ms
        return out

    def allocate(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """Zeroed CPU tensors in the layout of ``version`` (default: the latest), to follow into.

        Fetches manifests only; the model size is checked against ``max_model_bytes`` first.
        """
        key, m = self._resolve(version)
        specs = _layout(self._history.anchor_chain(key, m)[0][1])
        self._check_model_size(specs, m.version)
        return {n: torch.zeros(s.shape, dtype=_torch_dtype(s.dtype)) for n, s in specs.items()}

    def pull_into(self, target: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None) -> VersionInfo | None:
        """Fast-forward ``target`` in place to ``version`` (default: the latest).

        ``target`` must hold the version this subscriber last pulled (or, before any pull,
        tensors of the right layout, which are then overwritten). Only the chunks that changed
        are fetched, and per chunk the cheaper of the deltas and the latest snapshot is used.

        Returns:
            The new version's info, or None when ``target`` is already current.

        Raises:
            LayoutMismatchError: ``target``'s names/dtypes/shapes differ from the store's, or
                the store changed its layout since the held version (use :meth:`pull`).
            IntegrityError: ``target`` was modified since it was pulled, or a digest failed.
                Nothing was applied.
            HistoryReplacedError: the store's history is no longer the one the held version
                belongs to (HEAD deleted and another run published); nothing was applied.
        """
        key, m = self._resolve(version)
        return self._fast_forward(key, m, target)

    def stage(self, target: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None) -> StagedUpdate | None:
        """Prepare the fast-forward of ``target`` to ``version`` (default: the latest) without
        writing it: the phase an inference engine keeps serving through (SPEC §7.7).

        Plans the update from the held version (from the anchor when nothing is held), checks
        that ``target`` holds the held version's bits, fetches and verifies the segments,
        rebuilds each changed chunk in a scratch buffer, checks its digest there and keeps only
        the positions that change (a chunk whose delta path fails is taken from a full segment).
        Memory grows with what changed, not with the model. Apply it with :meth:`swap`.

        Returns:
            The staged update, or None when ``target`` is already current.

        Raises:
            The errors of :meth:`pull_into` (TargetModifiedError when ``target`` was modified);
            nothing is written either way.
        """
        key, m = self._resolve(version)
        return self._stage(key, m, target)

    def swap(self, staged: StagedUpdate, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
        """Write a staged update into ``target`` (the pause); the subscriber then holds its version.

        All or nothing: a failure in the middle restores what was written, and a position
        written by someone else since :meth:`stage` is detected (TargetModifiedError).

        Returns:
            The seconds the writes took.

        Raises:
            StaleStageError: ``staged`` was prepared by another subscriber or against another
                held version; nothing was written.
            TargetModifiedError: ``target`` was written since it was staged; nothing is left
                applied.
        """
        held_key = None if self._held is None else self._held[-1][0]
        if staged.owner is not self or staged.base_manifest != held_key or staged.from_version != self._version:
            raise StaleStageError(
                f"the update to version {staged.info.version} was staged against version {staged.from_version} "
                f"({staged.base_manifest!r}), but this subscriber holds {self._version} ({held_key!r}): stage it again"
            )
        try:
            if staged.replacements:  # prepared for a swap by rebinding (see follow's swap_mode)
                dt = staged.rebind(_owners(target))
            else:
                dt = staged.swap(_target_tensors(target))
        except IntegrityError as e:
            raise TargetModifiedError(str(e)) from None
        self._version, self._held = staged.info.version, staged.held
        return dt

    def _plan_update(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> tuple[
        list[ChunkPlan], dict[str, TensorSpec], dict[tuple[str, int], str], _Manifests
    ]:
        """The plans that bring ``tensors`` from the held version to ``m``: ``(plans, specs,
        base digests the target must hold, manifests to hold afterwards)``."""
        fwd: _Manifests = []
        relaid = False
        if self._version is not None and self._held is not None:
            fwd = self._history.chain(key, m, down_to=self._version + 1)
            if fwd[0][1].parent_manifest != self._held[-1][0]:
                raise self._replaced(f"version {fwd[0][1].version} does not follow the held manifest {self._held[-1][0]!r}")
            held_specs = _layout(self._held[0][1])
            # An anchor written without deltas and with another chunking (a restarted publisher
            # with other settings) cannot be bridged chunk by chunk: replace everything from it.
            relaid = any(mm.kind == "anchor" and mm.delta_base is None and _layout(mm) != held_specs for _, mm in fwd)
        if self._version is None or self._held is None or relaid:
            ms = self._history.chain(key, m, down_to=m.anchor)
            specs = _layout(ms[0][1])
            check_layout(specs, tensors, against=f"version {m.version} of {self.url}")
            return self._plan_from_anchor(ms, specs), specs, {}, ms
        check_layout(held_specs, tensors, against=f"version {self._version} held by this subscriber")
        anchors = [i for i, (_, mm) in enumerate(fwd) if mm.kind == "anchor"]
        held = fwd[anchors[-1]:] if anchors else self._held + fwd
        base = _digests(self._held)
        return self._plan_forward(fwd, held_specs, base), held_specs, base, held

    def _check_forward(self, key: str, m: Manifest) -> bool:
        """True when ``m`` is newer than the held version (False: current); raises if older."""
        self._check_same_history(key, m)
        if self._version is not None and m.version == self._version:
            return False
        if self._version is not None and m.version < self._version:
            raise VersionNotFoundError(f"pull_into cannot go back from version {self._version} to {m.version}; use pull()")
        return True

    def _fast_forward(self, key: str, m: Manifest, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> VersionInfo | None:
        if not self._check_forward(key, m):
            return None
        tensors = _target_tensors(target)
        plans, specs, base, held = self._plan_update(key, m, tensors)
        self._engine.apply_in_place(plans, specs, tensors, base, self._version)
        self._version, self._held = m.version, held
        return VersionInfo.from_manifest(m, key)

    def _stage(self, key: str, m: Manifest, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> StagedUpdate | None:
        if not self._check_forward(key, m):
            return None
        tensors = _target_tensors(target)
        before = self.bytes_fetched
        plans, specs, base, held = self._plan_update(key, m, tensors)
        patches, fetch_s, decode_s = self._engine.stage(plans, specs, tensors, base, self._version)
        return StagedUpdate(
            info=VersionInfo.from_manifest(m, key), from_version=self._version, patches=patches,
            bytes_fetched=self.bytes_fetched - before, fetch_s=fetch_s, decode_s=decode_s,
            base_manifest=None if self._held is None else self._held[-1][0], held=held, owner=self,
        )

    def follow(
        self,
        target: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        interval: float = 2.0,
        jitter: float = 0.1,
        max_interval: float = 60.0,
        pause: Any = None,
        stop: threading.Event | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_every_s: float = 300.0,
        worker_id: str | None = None,
        heartbeat: bool = True,
        max_versions: int | None = None,
        swap_mode: str = "inplace",
    ) -> Iterator[FollowRecord]:
        """Keep ``target`` at the latest version, yielding one :class:`FollowRecord` per version.

        Polls HEAD every ``interval`` seconds (± ``jitter`` of it) by conditional GET: an idle
        poll is one request with no body. A new version is staged (fetched, verified, decoded)
        while the caller keeps using ``target``; only the swap runs inside ``pause``, which is
        None, a context manager (e.g. a ``threading.Lock`` the engine holds while generating),
        or a callable returning one. The first version (nothing held, no usable cache) is
        loaded whole inside the pause.

        Args:
            interval, jitter, max_interval: poll period, its random spread (a fraction), and
                the longest wait of the exponential backoff after errors.
            pause: the critical section in which ``target`` is written.
            stop: a ``threading.Event``; the loop returns soon after it is set.
            cache_dir: a local :class:`deltastore.cache.WorkerCache`: on start, a cached
                version is verified against the store (chain, lineage, every chunk digest) and
                adopted without fetching it; anything wrong with it is logged and the cache is
                rebuilt. The held version is saved every ``cache_every_s`` and at the end.
            worker_id, heartbeat: write heartbeats to the store's ledger (SPEC §10) as this
                worker; read-only credentials are tolerated.
            max_versions: return after applying this many versions.
            swap_mode: ``"inplace"`` (default) writes the changed elements into ``target``'s
                memory in the pause: on a CPU target that touches most cache lines at RL change
                rates, so it costs about a full copy. ``"rebind"`` patches a copy of each
                touched tensor before the pause and only repoints the tensors in it (a pause of
                microseconds per tensor), at the cost of the touched tensors' memory once more
                while staging and of the tensors' identity of storage (``data_ptr`` changes:
                not for engines that captured pointers, e.g. CUDA graphs). With ``"rebind"``,
                pass the ``nn.Module`` or a dict of the very tensors the engine reads, not
                ``model.state_dict()`` (its tensors are detached aliases); CPU tensors only.

        Raises:
            LayoutMismatchError: the store's layout no longer fits ``target``.
            TargetModifiedError: ``target`` was modified by someone else.
            Storage errors, a corrupt segment or a missing manifest are logged and retried
            with backoff; the target keeps the last good version. A replaced history is
            logged and loaded whole (inside the pause, all or nothing).

        Example::

            lock = threading.Lock()               # the engine holds it while generating
            for rec in sub.follow(model, pause=lock, cache_dir="/var/cache/ds"):
                print(rec.info.version, rec.pause_s)
        """
        if swap_mode not in ("inplace", "rebind"):
            raise ValueError(f"swap_mode must be 'inplace' or 'rebind', got {swap_mode!r}")
        tensors = _target_tensors(target)
        owners = _owners(target) if swap_mode == "rebind" else None
        stop = stop if stop is not None else threading.Event()
        cache = WorkerCache(cache_dir) if cache_dir is not None else None
        beats = HeartbeatWriter(self.store, worker_id) if heartbeat else None
        try_cache = cache is not None and self._version is None
        saved: str | None = None  # manifest key of the version last written to the cache
        last_save = time.monotonic()
        applied = failures = 0

        def save() -> None:
            nonlocal saved, last_save
            if cache is None or self._held is None or self._held[-1][0] == saved:
                return  # (a key, not a number: a replaced history reuses version numbers)
            key, m = self._held[-1]
            try:
                cache.save(tensors, url=self.url, version=m.version, manifest=key, lineage=m.lineage)
                saved, last_save = key, time.monotonic()
            except OSError as e:
                logger.warning("could not write the worker cache in %s: %s", cache.path, e)

        try:
            while not stop.is_set():
                try:
                    if try_cache:
                        assert cache is not None
                        rec = self._adopt_cache(cache, tensors, pause)
                        try_cache = False
                        saved = None if rec is None else rec.info.manifest
                    else:
                        rec = self._follow_once(tensors, pause, owners)
                    failures = 0
                except HistoryReplacedError as e:
                    logger.warning("following %s: %s; loading the new history whole", self.url, e)
                    self._version = self._held = None
                    continue
                except (LayoutMismatchError, TargetModifiedError, StaleStageError):
                    raise
                except (StorageError, IntegrityError, FormatError, VersionNotFoundError) as e:
                    failures += 1
                    delay = _jittered(min(max_interval, interval * 2**failures), jitter)
                    logger.warning(
                        "following %s: %s: %s; keeping version %s, retrying in %.1f s",
                        self.url, type(e).__name__, e, self._version, delay,
                    )
                    stop.wait(delay)
                    continue
                lineage = None if self._held is None else self._held[-1][1].lineage
                if beats is not None and self._version is not None:
                    beats.beat(self._version, lineage=lineage)  # rate-limits itself on idle polls
                if rec is not None:
                    applied += 1
                    yield rec
                    if max_versions is not None and applied >= max_versions:
                        break
                if time.monotonic() - last_save >= cache_every_s:
                    save()
                if rec is None:
                    stop.wait(_jittered(interval, jitter))
        except GeneratorExit:  # the caller stopped iterating: a normal end too
            save()
            raise
        save()

    def _follow_once(self, tensors: dict[str, torch.Tensor], pause: Any,
                     owners: dict[str, torch.Tensor] | None = None) -> FollowRecord | None:
        """One poll: None when HEAD has not moved, else the record of the version applied."""
        head = self._history.poll_head()  # a conditional GET: no body when unchanged
        if head is None or head.manifest is None:
            return None
        if self._held is not None and head.manifest == self._held[-1][0]:
            return None
        top = self._history.head_manifest(head)
        assert top is not None
        key, m = top
        if self._version is None:  # nothing held: a full load, all or nothing, in the pause
            before = self.bytes_fetched
            with _pause_context(pause):
                t0 = time.perf_counter()
                info = self._fast_forward(key, m, tensors)
                pause_s = time.perf_counter() - t0
            assert info is not None
            return FollowRecord(info, None, self.bytes_fetched - before, 0.0, 0.0, pause_s, _whole(tensors), True)
        staged = self._stage(key, m, tensors)
        if staged is None:
            return None
        if owners is not None:  # swap_mode="rebind": patch copies now, repoint in the pause
            t0 = time.perf_counter()
            staged.build_replacements(tensors)
            staged.decode_s += time.perf_counter() - t0
        with _pause_context(pause):
            t0 = time.perf_counter()
            self.swap(staged, owners if owners is not None else tensors)
            pause_s = time.perf_counter() - t0
        if owners is not None:  # later stages read the new storage (Parameters got new .data)
            staged.retired.clear()  # the old storages are freed here, after the pause
            tensors.update(_target_tensors(owners))
        return FollowRecord(
            staged.info, staged.from_version, staged.bytes_fetched, staged.fetch_s, staged.decode_s,
            pause_s, staged.changed, False,
        )

    def _adopt_cache(self, cache: WorkerCache, tensors: dict[str, torch.Tensor], pause: Any) -> FollowRecord | None:
        """Verify a cached state against the store and load it into ``tensors`` (in the pause).

        Returns None (the cache cleared, with a log line) when it is not usable; a transient
        storage error is raised (the cache is kept for the retry).
        """
        st = cache.load()
        if st is None:
            return None
        try:
            if st.url != self.url:
                raise _Unusable(f"it belongs to {st.url}")
            head = self._require_head()
            key, m = self._history.find(st.version, head)
            if key != st.manifest:
                raise _Unusable(f"version {st.version} of {self.url} is now {key!r}, not {st.manifest!r}")
            top = self._history.head_manifest(head)
            assert top is not None
            if top[1].lineage != st.lineage:
                raise _Unusable(f"the store's lineage is {top[1].lineage}, the cache's {st.lineage}")
            ms = self._history.anchor_chain(key, m)
            specs = _layout(ms[0][1])
            check_layout(specs, st.tensors, against=f"version {m.version} of {self.url}")
            cached = {n: bits(t) for n, t in st.tensors.items()}
            bad = digest_mismatches(self._pool, specs, _digests(ms), lambda name, a, b: cached[name][a:b])
            if bad:
                raise _Unusable(f"tensor {bad[0][0]!r} chunk {bad[0][1]} does not match its digest")
        except NotFoundError:
            raise  # maybe transient (HEAD briefly ahead of its manifest): keep the cache, retry
        except StorageError:
            raise
        except (_Unusable, DeltastoreError, KeyError) as e:
            logger.warning("the worker cache in %s is not usable for %s (%s): clearing it and loading in full",
                           cache.path, self.url, e)
            cache.clear()
            return None
        check_layout(specs, tensors, against=f"version {m.version} of {self.url}")  # the target's problem
        with _pause_context(pause):
            t0 = time.perf_counter()
            for n, t in tensors.items():
                t.copy_(st.tensors[n])
            pause_s = time.perf_counter() - t0
        self._version, self._held = m.version, ms
        logger.info("resumed version %d of %s from the worker cache in %s", m.version, self.url, cache.path)
        return FollowRecord(VersionInfo.from_manifest(m, key), None, 0, 0.0, 0.0, pause_s, _whole(tensors), True)

    def verify(self, version: int | None = None, *, all_versions: bool = False) -> VerifyReport:
        """Check every segment of a version's chain, or of every version, and report each bad one.

        Unlike :meth:`pull`, which reads only the segments one path needs, this fetches every
        segment each manifest lists, full and delta (an anchor's delta segments too), checks its
        SHA-256, decodes it, and checks the chunk it produces against the recorded digest:
        versions are replayed oldest first, so a delta is applied to the verified state of its
        parent. Problems are collected, not raised, so one run names every bad object.

        Args:
            version: the version whose chain (from its anchor) to check; default the latest.
            all_versions: check every version from 1 to the latest instead.

        Raises:
            VersionNotFoundError: no such version (or an empty store).
            CorruptObjectError, IntegrityError, NotFoundError: a manifest of the chain itself is
                unreadable or the chain is broken (nothing further can be checked).
        """
        if all_versions:
            top = self._history.head_manifest(self._require_head())
            assert top is not None
            ms = self._history.chain(*top, down_to=1)
        else:
            ms = self._history.anchor_chain(*self._resolve(version))
        problems: list[Problem] = []
        tensors: dict[int, int] = {}
        state: dict[tuple[str, int], np.ndarray | None] = {}  # verified chunk bits; None: unknown
        specs: dict[str, TensorSpec] = {}
        n_segments = 0
        for key, m in ms:
            if m.kind == "anchor":
                if m.delta_base is None:
                    state.clear()  # a new start: nothing carries over
                specs = _layout(m)
                self._check_model_size(specs, m.version)
            tensors[m.version] = len(specs)
            try:
                check_entries(key, m, specs, m.anchor)
            except CorruptObjectError as e:
                problems.append(Problem(m.version, key, str(e)))
                continue
            items = [(t.name, c) for t in m.tensors for c in t.chunks]
            steps = {
                (name, c.index, which): Step(0, m.blobs[seg.blob], seg)
                for name, c in items
                for which, seg in (("full", c.full), ("delta", c.delta))
                if seg is not None
            }
            n_segments += len(steps)
            for batch in _batched(items, lambda it: sum(seg.length for seg in (it[1].full, it[1].delta) if seg is not None)):
                errors: dict[tuple[str, int], DeltastoreError] = {}
                want = [steps[k] for name, c in batch for w in ("full", "delta") if (k := (name, c.index, w)) in steps]
                data = self._fetcher.fetch(want, errors)

                def check(group: list[tuple[str, Any]]) -> list[tuple[tuple[str, int], np.ndarray | None, list[str]]]:
                    return [_verify_chunk(name, c, specs[name], state.get((name, c.index)), steps, data, errors) for name, c in group]

                groups = grouped(batch, lambda it: specs[it[0]].chunk_bytes(it[1].index))
                # All results first: the checks read ``state``, which is updated only after them.
                for results in list(self._pool.map(check, groups)):
                    for k, raw, msgs in results:
                        state[k] = raw
                        problems.extend(Problem(m.version, key, msg) for msg in msgs)
        for p in problems:
            logger.error("version %d (%s): %s", p.version, p.manifest, p.message)
        return VerifyReport(self.url, [m.version for _, m in ms], tensors, n_segments, problems)

    def close(self) -> None:
        """Stop worker threads and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_same_history(self, key: str, m: Manifest) -> None:
        """SPEC §7 step 3: the version to reach must be in the held version's history (D7)."""
        if self._held is None:
            return
        held_key, held = self._held[-1]
        if m.lineage is not None and held.lineage is not None and m.lineage != held.lineage:
            raise self._replaced(f"its lineage is {m.lineage}, the held version's is {held.lineage}")
        if m.version == held.version and key != held_key:
            raise self._replaced(f"version {m.version} is now {key!r}, not the held {held_key!r}")

    def _replaced(self, why: str) -> HistoryReplacedError:
        return HistoryReplacedError(
            f"the history of {self.url} was replaced (HEAD deleted or restored, then another run published): {why}; "
            f"this subscriber holds version {self._version} of the old history and nothing was applied. "
            "Open a new Subscriber or call pull() to read the new history"
        )

    # --- planning -----------------------------------------------------------------------

    def _check_model_size(self, specs: dict[str, TensorSpec], version: int) -> None:
        total = sum(s.nbytes for s in specs.values())
        if self.max_model_bytes is not None and total > self.max_model_bytes:
            raise CorruptObjectError(
                f"version {version} of {self.url} declares {total} bytes of tensors, more than "
                f"max_model_bytes={self.max_model_bytes} (default: this machine's memory); if that is "
                "real, open the Subscriber with a larger max_model_bytes"
            )

    def _require_head(self) -> Head:
        head = self._history.poll_head()
        if head is None or head.manifest is None:
            raise VersionNotFoundError(f"{self.url} has no committed version yet")
        return head

    def _resolve(self, version: int | None) -> tuple[str, Manifest]:
        head = self._require_head()
        if version is None:
            top = self._history.head_manifest(head)
            assert top is not None
            return top
        return self._history.find(version, head)

    # Planning is pure (deltastore.plan); pull_into calls it under these names.
    _plan_from_anchor = staticmethod(plan_from_anchor)
    _plan_forward = staticmethod(plan_forward)


class _Unusable(Exception):
    """A worker cache that does not hold a version of this store (internal)."""


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


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
    return {n: [(0, t.numel())] for n, t in tensors.items()}


def _owners(target: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensor objects to repoint in a swap by rebinding: a module's own Parameters and
    buffers, or the tensors of a mapping as they are."""
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)
