"""The read path (SPEC §7): poll HEAD, plan which segments to fetch, verify, apply."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from typing_extensions import Self

from deltastore.read.engine import (
    ReadEngine,
    _batched,
    _target_tensors,
    _torch_dtype,
    _verify_chunk,
    digest_mismatches,
    targets_for,
)
from deltastore.read.cache import WorkerCache
from deltastore.read.changes import changed_rows, changed_tensors, merge_spans
from deltastore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CorruptObjectError,
    DeltastoreError,
    FormatError,
    HeadRolledBackError,
    HistoryReplacedError,
    IntegrityError,
    LayoutMismatchError,
    NotFoundError,
    SelectionError,
    SignatureError,
    StaleStageError,
    StorageError,
    TargetModifiedError,
    UnsupportedURLError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from deltastore.layout.groups import allocate_members, member_overlaps
from deltastore._util.heap import release_free_heap
from deltastore.format.history import History, VersionInfo
from deltastore._util.jobs import default_threads, grouped
from deltastore.lifecycle.ledger import HEARTBEAT_INTERVAL_S, HeartbeatWriter
from deltastore.format.models import Head, Index, Manifest, SquashManifest, SquashRef
from deltastore.format.objects import decode_object
from deltastore.format.parse import MAX_MANIFEST_BYTES
from deltastore.read.plan import (
    ChunkPlan,
    Manifests,
    Step,
    chain_price,
    check_entries,
    check_squash,
    full_bytes,
    plan_changed_from_anchor,
    plan_forward,
    plan_from_anchor,
    squash_as_manifest,
)
from deltastore.read.plan import digests as _digests
from deltastore.read.plan import layout as _layout
from deltastore.layout.select import Resolved, Selection, changed_spans, check_target, resolve, slice_targets
from deltastore.read.stage import StagedUpdate
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.layout.tensors import DTYPE_WIDTHS, TensorSpec, check_layout, member_specs
from deltastore.layout.tied import ModuleTensors, alias_hint, recorded_aliases

logger = logging.getLogger(__name__)

_Manifests = Manifests
_Digests = dict[tuple[str, int], str]


@dataclass(frozen=True)
class _Held:
    """What a subscriber keeps of the version it holds: its manifest, the layout and one digest
    per chunk. Its size is the model's chunk count, whatever the number of versions followed
    (the manifests of the anchor span are not kept)."""

    key: str
    manifest: Manifest
    specs: dict[str, TensorSpec]
    digests: _Digests

    @classmethod
    def of(cls, ms: Manifests) -> _Held:
        """From an anchor's chain up to the held version (oldest first)."""
        key, m = ms[-1]
        return cls(key, m, _layout(ms[0][1]), _digests(ms))


@dataclass(frozen=True)
class _Update:
    """A planned fast-forward: plans, the layout they use, the digests the target must hold
    first, what is held afterwards, and the squash it reads (None: none)."""

    plans: list[ChunkPlan]
    specs: dict[str, TensorSpec]
    base: _Digests
    held: _Held
    squash: SquashRef | None = None


#: Plans tried for one update: a squash that turns out bad, then a held version collected
#: meanwhile, each cost one more plan; more than this means the store keeps changing under us.
MAX_REPLANS = 4
#: Seconds between looks at HEAD while waiting for a version (a conditional GET each).
WAIT_INTERVAL_S = 2.0
#: A partial subscriber reads adjacent segments as one GET but never the bytes between: they
#: are other ranks' segments, and what it reads is what its link carries.
PARTIAL_COALESCE_GAP_BYTES = 0


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

    def updates(self, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor this version changed, taken from ``target`` (the
        one followed), whole: what ``model.load_weights`` takes. Computed from the plan, no pass
        over the weights (:func:`deltastore.read.changes.changed_tensors`)."""
        return changed_tensors(target, self.changed)

    def rows(self, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> Iterator[tuple[str, list[tuple[int, int]], torch.Tensor]]:
        """``(name, rows, tensor)``: as :meth:`updates`, with the row ranges along dim 0 that
        changed (:func:`deltastore.read.changes.changed_rows`)."""
        return changed_rows(target, self.changed)


class Subscriber:
    """Reads versions from a store and keeps a state dict or module up to date.

    Args:
        url: store URL (see :class:`deltastore.Publisher`).
        storage_options: passed to the storage backend.
        threads: decode threads (default: all cores).
        trusted_keys: Ed25519 public keys (key objects, PEM bytes or PEM file paths); when
            given, every manifest used must be signed by one of them, else SignatureError
            (UnsignedVersionError for an unsigned version above a signed one of its history),
            and :meth:`follow` does not load another history unless told to (SPEC §3.1).
            Needs ``cryptography`` (``deltastore-weights[signing]``).
        max_model_bytes: refuse to materialize a version whose tensors declare more bytes than
            this (default: this machine's physical memory), checked before allocating: a few KB
            of hostile metadata must not become gigabytes resident.
        max_manifest_bytes: refuse a manifest larger than this before parsing it.
        select: a partial subscriber (:class:`deltastore.layout.select.Selection`, SPEC §8 "Partial
            pulls"): :meth:`pull`, :meth:`allocate` and :meth:`pull_into` then handle only the
            selected tensors, sharded ones as their slice, and fetch only the chunks that
            overlap them (a chunk straddling a slice's edge is read whole and cut; its bits
            outside the slice are kept by the subscriber). :meth:`stage`, :meth:`swap` and
            :meth:`follow` are for whole targets (SelectionError).
        range_part_bytes: read packs as parallel range GETs of at most this many bytes (cut at
            segment boundaries; None: one GET per pack's run of needed segments). For far or
            lossy links, where one TCP connection carries a fraction of the link (at 80 ms and
            0.1 % loss, ~5.6 Mbit/s): e.g. 256 KiB. Costs more requests per version.

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
        select: Selection | None = None,
        range_part_bytes: int | None = None,
    ):
        """``store``: an already opened store to use instead of ``url`` (not closed by us)."""
        check = None
        self._keys = None
        if trusted_keys is not None:
            from deltastore.format.signing import TrustedKeys

            self._keys = TrustedKeys(trusted_keys)  # keys checked before the store is opened
            check = self._verify
        self.store = store if store is not None else open_store(url, storage_options=dict(storage_options or {}))
        self._owns_store = store is None  # a store passed in belongs to the caller
        self.url = self.store.url
        self.max_model_bytes = max_model_bytes if max_model_bytes is not None else physical_memory()
        self._history = History(self.store, check, max_manifest_bytes=max_manifest_bytes)
        self._engine = ReadEngine(self.store, threads or default_threads())
        self._pool = self._engine.pool
        self._fetcher = self._engine.fetcher
        self._version: int | None = None
        self._held: _Held | None = None  # the held version's manifest, layout and chunk digests
        self._head: Head | None = None  # the HEAD last read
        self._collected_logged: int | None = None  # the held version last logged as collected
        self._bad_squashes: set[str] = set()  # squashes that failed for the held version (cleared on update)
        # Squashes are unsigned hints (the compactor signs nothing yet): a subscriber that requires
        # signatures does not use them (SPEC §12), since a forged squash could match an XXH3 digest.
        self._use_squashes = trusted_keys is None
        self._last_changed: dict[str, list[tuple[int, int]]] | Callable[[], dict[str, list[tuple[int, int]]]] = {}
        self._closed = False
        self._beats: HeartbeatWriter | None = None  # the fleet ledger's writer (heartbeat())
        self._worker_id: str | None = None  # the id it used, kept by the next one
        self._said_waiting = False  # "waiting for the first version" logged by follow
        self.select = select
        # A partial subscriber's bits of edge chunks outside its slices (deltastore.layout.select).
        self._spare: dict[tuple[str, int], np.ndarray] = {}
        self._resolved_for: tuple[dict[str, TensorSpec], Resolved] | None = None
        if select is not None:
            self._fetcher.gap = PARTIAL_COALESCE_GAP_BYTES
        if range_part_bytes is not None:
            if range_part_bytes < 1:
                raise ValueError(f"range_part_bytes must be positive, got {range_part_bytes}")
            self._fetcher.max_run = range_part_bytes

    @property
    def version(self) -> int | None:
        """The version this subscriber last pulled (None before the first pull)."""
        return self._version

    @property
    def last_changed(self) -> dict[str, list[tuple[int, int]]]:
        """What the last :meth:`pull_into`, :meth:`swap` or :meth:`follow` step wrote: tensor
        name → merged element spans ``[start, stop)`` of the flattened tensor (chunk-granular,
        from the plan; a full load lists every tensor whole). Empty before any and after a
        call that found the target current. Feed it to
        :func:`deltastore.read.changes.changed_tensors` or ``changed_rows`` to reload only those::

            if sub.pull_into(weights):
                engine.load_weights(changed_tensors(weights, sub.last_changed))
        """
        if callable(self._last_changed):
            self._last_changed = self._last_changed()
        return {n: list(s) for n, s in self._last_changed.items()}

    @property
    def bytes_fetched(self) -> int:
        """Bytes of packs read from the store by this subscriber so far (manifests excluded)."""
        return self._fetcher.bytes_fetched

    def layout(self) -> dict[str, TensorSpec]:
        """The tensor layout (names, dtypes, shapes, chunking) of the version last pulled: the
        tensors users see, group members included (design 007)."""
        return member_specs(self.units())

    def units(self) -> dict[str, TensorSpec]:
        """The layout rows of the version last pulled: tensors, and group rows of small
        tensors (each spec's ``members``) as the store chunks them (design 007)."""
        if self._held is None:
            raise VersionNotFoundError(f"no version of {self.url} has been pulled yet")
        return dict(self._held.specs)

    def latest(self) -> VersionInfo | None:
        """The newest committed version (None for an empty store), via a conditional GET."""
        return self._history.latest()

    def wait_for_version(self, version: int | None = None, *, timeout: float | None = None,
                         interval: float = WAIT_INTERVAL_S, stop: threading.Event | None = None) -> VersionInfo | None:
        """Wait until the store has a committed version (at least ``version`` when given).

        For workers started before the trainer: an empty store (or one behind ``version``) is
        polled every ``interval`` seconds by conditional GET, with one log line "waiting for the
        first version of URL", not one per poll. A storage error meanwhile is logged and
        retried at the next poll; a missing bucket or refused credentials are raised.

        Args:
            version: the version to wait for (default: any).
            timeout: give up after this many seconds (default: wait for ever).
            interval: seconds between polls of HEAD.
            stop: a ``threading.Event`` that ends the wait early (then None is returned).

        Returns:
            The latest version's :class:`VersionInfo` (its version ≥ ``version``); None only
            when ``stop`` was set.

        Raises:
            WaitTimeoutError: ``timeout`` passed first (a ``TimeoutError``).
            BucketNotFoundError, AccessDeniedError: the store cannot be read at all.

        Example::

            sub = Subscriber("s3://bucket/run1")
            sub.wait_for_version(timeout=3600)   # the trainer may start after its workers
            weights = sub.allocate()
        """
        if version is not None and version < 1:
            raise ValueError(f"version must be 1 or more, got {version}")
        if interval <= 0 or (timeout is not None and timeout < 0):
            raise ValueError(f"interval must be positive and timeout not negative, got {interval} and {timeout}")
        what = "the first version" if version is None else f"version {version}"
        start = time.monotonic()
        stop = stop if stop is not None else threading.Event()
        latest: int | None = None
        said = False
        while True:
            try:
                info = self.latest()
            except (BucketNotFoundError, AccessDeniedError, UnsupportedURLError):
                raise
            except StorageError as e:
                logger.warning("waiting for %s of %s: %s: %s; looking again in %.1f s",
                               what, self.url, type(e).__name__, e, interval)
                info = None
            if info is not None:
                if version is None or info.version >= version:
                    return info
                latest = info.version
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                has = "no version" if latest is None else f"version {latest}"
                raise WaitTimeoutError(
                    f"waited {waited:.1f} s for {what} of {self.url}, which has {has}: is the trainer publishing "
                    "there? (wait longer with a larger timeout)"
                )
            if not said:  # said only when it does wait (not by a timeout=0 look)
                logger.info("waiting for %s of %s", what, self.url)
                said = True
            pause = interval if timeout is None else min(interval, timeout - waited)
            if stop.wait(pause):
                return None

    def heartbeat(self, worker_id: str | None = None, *, interval_s: float = HEARTBEAT_INTERVAL_S) -> HeartbeatWriter:
        """Announce this worker in the store's fleet ledger (SPEC §10) while it runs.

        Starts a thread that writes ``workers/<worker_id>.json`` with the version this
        subscriber holds: at once, whenever it changes (:meth:`pull`, :meth:`pull_into`,
        :meth:`swap`, :meth:`follow`; never inside the caller's pause) and every
        ``interval_s``. :meth:`follow` starts one by itself; a worker that updates with
        :meth:`stage` / :meth:`swap` or :meth:`pull_into` calls this once. Closing the writer
        (or this subscriber) writes a last heartbeat marked stopped, which ``deltastore status``
        shows as such. Read-only credentials are tolerated (one log line, no heartbeats).

        Args:
            worker_id: the worker's id in the ledger (default: the id this subscriber used
                before, else ``host-pid-random``).
            interval_s: the longest time between two heartbeats of an unchanged version.

        Returns:
            The running :class:`~deltastore.lifecycle.ledger.HeartbeatWriter` (a context manager); the
            same one while it runs.

        Raises:
            ValueError: a malformed worker id, or another id than the running writer's.

        Example::

            with sub.heartbeat("serve-1"):
                while serving:
                    staged = sub.stage(model)
                    ...
        """
        running = self._beats
        if running is not None and not running.closed:
            if worker_id is not None and worker_id != running.worker_id:
                raise ValueError(f"this subscriber already writes heartbeats as {running.worker_id!r}; "
                                 "close that writer first")
            return running
        beats = HeartbeatWriter(self.store, worker_id if worker_id is not None else self._worker_id, interval_s=interval_s)
        self._beats, self._worker_id = beats, beats.worker_id
        return beats.start(self._held_for_ledger)

    def _held_for_ledger(self) -> tuple[int, str | None] | None:
        held = self._held
        return None if held is None else (held.manifest.version, held.manifest.lineage)

    def info(self, version: int) -> VersionInfo:
        """The :class:`VersionInfo` of ``version``; raises VersionNotFoundError."""
        key, m = self._history.find(version, self._require_head())
        return VersionInfo.from_manifest(m, key)

    def log(self, since: int = 1) -> list[VersionInfo]:
        """Every committed version from ``since`` (default: the first) to the latest, oldest
        first; versions below the history index's floor were collected and are not listed."""
        head = self._history.poll_head()
        if head is None:
            return []
        self._head = head
        return self._history.log(head, since=since)

    def pull(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """Materialize ``version`` (default: the latest) as new CPU tensors, verified.

        In a store with tensor groups (design 007), the small tensors of one group are views of
        one buffer, back to back (each of its own shape; safetensors and ``torch.save`` store
        them as usual), so that ``pull_into`` updates the group in place.

        Raises:
            VersionNotFoundError: no such version (or an empty store).
            IntegrityError: a segment or a reconstructed chunk failed its digest.
        """
        key, m = self._resolve(version)
        ms = self._history.anchor_chain(key, m)
        specs = _layout(ms[0][1])
        plans = self._plan_from_anchor(ms, specs)  # checks the whole chain before allocating
        if self.select is not None:
            res = self._selected(specs)
            self._check_model_size(specs, m.version, res)
            out = self._empty(res, torch.empty)
            spare: dict[tuple[str, int], np.ndarray] = {}
            self._engine.materialize(self._narrow(plans, res), specs, out,
                                     lambda sp, t: slice_targets(sp, res, t, spare))
            self._spare = spare
        else:
            self._check_model_size(specs, m.version)
            out = allocate_members(specs, _torch_dtype)  # a group's members share one buffer (design 007)
            self._engine.materialize(plans, specs, out)
        self._set_held(_Held.of(ms))
        release_free_heap()  # the read threads' chunk-sized buffers of a whole version (deltastore._util.heap)
        return out

    def allocate(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """Zeroed CPU tensors in the layout of ``version`` (default: the latest), to follow into.

        Fetches manifests only; the model size is checked against ``max_model_bytes`` first.
        Raises VersionNotFoundError on an empty store: :meth:`wait_for_version` waits for one.
        """
        key, m = self._resolve(version)
        specs = _layout(self._history.anchor_chain(key, m)[0][1])
        if self.select is not None:  # the selection's tensors, sharded ones as their slice
            res = self._selected(specs)
            self._check_model_size(specs, m.version, res)
            return self._empty(res, torch.zeros)
        self._check_model_size(specs, m.version)
        return allocate_members(specs, _torch_dtype, zeros=True)

    def pull_into(self, target: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None) -> VersionInfo | None:
        """Fast-forward ``target`` in place to ``version`` (default: the latest).

        ``target`` must hold the version this subscriber last pulled (or, before any pull,
        tensors of the right layout, which are then overwritten). Only the chunks that changed
        are fetched, and per chunk the cheaper of the deltas and the latest snapshot is used.
        ``target`` is a dict of the version's tensors, exactly, or an ``nn.Module``: a name of
        the module that the version leaves out but that shares memory with one of its tensors
        (a tied alias, e.g. ``lm_head.weight`` published once as ``model.embed_tokens.weight``)
        is updated through that tensor (``stage``, ``swap`` and ``follow`` alike).

        Returns:
            The new version's info, or None when ``target`` is already current.

        Raises:
            LayoutMismatchError: ``target``'s names/dtypes/shapes differ from the store's, or
                the store changed its layout since the held version (use :meth:`pull`).
            IntegrityError: ``target`` was modified since it was pulled, or a digest failed.
                Nothing was applied.
            HistoryReplacedError: the store's history is no longer the one the held version
                belongs to (HEAD deleted and another run published); nothing was applied.
            HeadRolledBackError: HEAD names an older version than the held one; nothing was
                applied (a subscriber never goes backwards; ``pull(version)`` reads one).
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
        self._refuse_partial("stage")
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
        self._refuse_partial("swap")
        held_key = None if self._held is None else self._held.key
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
        self._set_held(staged.held)
        self._last_changed = {n: merge_spans(s) for n, s in staged.changed.items()}
        return dt

    def _plan_update(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> _Update:
        """The plans that bring ``tensors`` from the held version h to ``m`` (version t).

        Candidate paths (design 005 D6): the chain ``(h, t]``; each usable squash from h plus
        the chain from its ``to``; the anchor of t (its full segments, less the chunks already
        at their digest at t, plus the chain after it). The cheapest by bytes is planned, per
        chunk as :func:`plan_forward` does. When h was collected (below the index's floor),
        only the anchor path (and squashes from a pinned h) remain.
        """
        held = self._held
        if self._version is None or held is None:
            ms = self._history.anchor_chain(key, m)
            specs = _layout(ms[0][1])
            self._check_target(specs, tensors, against=f"version {m.version} of {self.url}",
                               tied=recorded_aliases(m.metadata))
            return _Update(self._plan_from_anchor(ms, specs), specs, {}, _Held.of(ms))
        self._check_target(held.specs, tensors, against=f"version {self._version} held by this subscriber",
                           tied=recorded_aliases(held.manifest.metadata))
        h = held.manifest.version
        index = self._index()
        floor = 1 if index is None else index.floor
        below = h < floor
        if below and self._collected_logged != h:
            logger.info("version %d was collected (floor %d); catching up from anchor %d", h, floor, m.anchor)
            self._collected_logged = h

        def between(low: int) -> _Manifests:  # versions low+1 .. t, oldest first
            return [] if low >= m.version else self._history.chain(key, m, down_to=low + 1)

        cands: list[tuple[int, int, str, SquashRef | None]] = []  # (bytes, rank, path, squash)
        if not below:
            cands.append((chain_price(held.manifest, m, lambda: between(h)), 0, "chain", None))
        pinned = index is not None and any(p.version == h for p in index.pins)
        for ref in self._squash_refs(index, m, h):
            if below and not (pinned and ref.to >= floor):
                continue
            try:
                to_m = between(ref.to - 1)[0][1] if ref.to < m.version else m
                cands.append((ref.bytes + chain_price(to_m, m, lambda r=ref: between(r.to)), 1, "squash", ref))
            except NotFoundError:
                if not below:
                    raise
        if m.anchor > h:
            a_m = self._anchor_of(key, m, between)
            cands.append((full_bytes(a_m) + chain_price(a_m, m, lambda: between(m.anchor)), 2, "anchor", None))
        if not cands:
            raise VersionNotFoundError(
                f"no way from version {h} to {m.version} of {self.url}: {h} was collected (floor {floor}) and "
                f"version {m.version}'s anchor {m.anchor} is not after it; pull() it"
            )
        cands.sort(key=lambda c: (c[0], c[1]))
        logger.debug("catch-up %d→%d candidates (bytes, path): %s", h, m.version, [(c[0], c[2]) for c in cands])
        for _, _, path, ref in cands:
            if path == "squash":
                assert ref is not None
                upd = self._plan_squash(ref, key, m, held, between)
                if upd is not None:
                    return upd
                continue
            if path == "chain":
                fwd = between(h)
                if fwd[0][1].parent_manifest != held.key:
                    raise self._replaced(f"version {fwd[0][1].version} does not follow the held manifest {held.key!r}")
                # An anchor written without deltas and with another chunking (a restarted
                # publisher with other settings) cannot be bridged chunk by chunk: replace
                # everything from it.
                if not self._relaid(fwd, held):
                    plans = self._plan_forward(fwd, held.specs, held.digests)
                    return _Update(plans, held.specs, held.digests, _Held(key, m, held.specs, {**held.digests, **_digests(fwd)}))
            return self._plan_anchor(key, m, held, tensors)
        raise AssertionError("unreachable: the anchor path always plans")  # pragma: no cover

    def _anchor_of(self, key: str, m: Manifest, between: Any) -> Manifest:
        """``m``'s anchor manifest, to price the anchor path: one GET through
        ``anchor_manifest`` (schema 3), so that pricing reads no manifest of the chain in
        between (design 005 D6); the chain walk only without that pointer, or when it names
        another version (pricing is a hint; the anchor path checks every link it plans)."""
        if m.kind == "anchor" and m.version == m.anchor:
            return m
        if m.anchor_manifest is not None:
            a = self._history.manifest(m.anchor_manifest)
            if a.version == m.anchor and a.kind == "anchor" and a.lineage == m.lineage:
                return a
            logger.warning("version %d's anchor_manifest %r is version %d (%s), not its anchor %d; walking the chain",
                           m.version, m.anchor_manifest, a.version, a.kind, m.anchor)
        return between(m.anchor - 1)[0][1]

    @staticmethod
    def _relaid(fwd: _Manifests, held: _Held) -> bool:
        return any(mm.kind == "anchor" and mm.delta_base is None and _layout(mm) != held.specs for _, mm in fwd)

    def _plan_anchor(self, key: str, m: Manifest, held: _Held, tensors: dict[str, torch.Tensor]) -> _Update:
        """From ``m``'s anchor: only the chunks whose held digest differs from their digest at
        ``m`` are fetched (the others are kept, checked against the held digests)."""
        ms = self._history.anchor_chain(key, m)
        specs = _layout(ms[0][1])
        if specs != held.specs:  # another layout: everything from the anchor
            self._check_target(specs, tensors, against=f"version {m.version} of {self.url}",
                               tied=recorded_aliases(m.metadata))
            return _Update(self._plan_from_anchor(ms, specs), specs, {}, _Held.of(ms))
        return _Update(plan_changed_from_anchor(ms, specs, held.digests), specs, held.digests, _Held.of(ms))

    def _squash_refs(self, index: Index | None, m: Manifest, h: int) -> list[SquashRef]:
        """Squashes from the held version ``h`` to at most ``m`` (the index's and ``m``'s own),
        except those that already failed for ``h``."""
        out: dict[str, SquashRef] = {}
        if not self._use_squashes:
            return []
        for ref in [*(index.squashes if index is not None else ()), *m.squashes]:
            if ref.from_ == h and h < ref.to <= m.version and ref.key not in self._bad_squashes:
                out.setdefault(ref.key, ref)
        return list(out.values())

    def _plan_squash(self, ref: SquashRef, key: str, m: Manifest, held: _Held,
                     between: Any) -> _Update | None:
        """Plan through squash ``ref`` then the chain after its ``to``; None (logged, and the
        squash not tried again for this held version) when it cannot be read or does not fit."""
        try:
            try:
                data = self.store.get(ref.key)
            except NotFoundError:
                raise NotFoundError(f"squash manifest {ref.key!r} is missing") from None
            sq: SquashManifest = decode_object(SquashManifest, data, ref.key, ref.sha256)
            check_squash(ref.key, sq, held.specs)
            tail = between(ref.to)
            to_key = tail[0][1].parent_manifest if tail else key
            if (sq.from_, sq.to) != (ref.from_, ref.to) or sq.from_manifest != held.key or sq.to_manifest != to_key:
                raise CorruptObjectError(
                    f"squash manifest {ref.key!r} is {sq.from_}→{sq.to} from {sq.from_manifest!r} to {sq.to_manifest!r}, "
                    f"not {ref.from_}→{ref.to} from the held {held.key!r} to {to_key!r}"
                )
            if sq.lineage is not None and m.lineage is not None and sq.lineage != m.lineage:
                raise CorruptObjectError(f"squash manifest {ref.key!r} belongs to lineage {sq.lineage}, not {m.lineage}")
            if self._relaid(tail, held):
                raise CorruptObjectError(f"the layout changes after version {ref.to}")
            ms = [(ref.key, squash_as_manifest(ref.key, sq, held.specs)), *tail]
            # planned inside the try: a squash whose tables do not fit is skipped like one that
            # cannot be read (a fault of the tail is raised again by the plan without it)
            plans = self._plan_forward(ms, held.specs, held.digests)
        except (StorageError, FormatError, IntegrityError) as e:
            if isinstance(e, StorageError) and not isinstance(e, NotFoundError):
                raise  # transient: the caller retries the whole update (a ref's key was checked when it was parsed)
            logger.warning("not using squash %d→%d (%s): %s; planning without it", ref.from_, ref.to, ref.key, e)
            self._bad_squashes.add(ref.key)
            return None
        logger.info("catching up %d→%d through squash %d→%d (%d bytes)", held.manifest.version, m.version, ref.from_, ref.to, ref.bytes)
        return _Update(plans, held.specs, held.digests, _Held(key, m, held.specs, {**held.digests, **_digests(ms)}), ref)

    def _updated(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor], run: Any) -> tuple[_Update, Any]:
        """Plan and ``run(update)``; when a squash's segments turn out bad, plan again without
        it; when a pack or manifest is missing because the held version was just collected
        (HEAD's index now has a higher floor), plan again from the anchor."""
        error: BaseException | None = None
        for _ in range(MAX_REPLANS):
            upd = None
            floor = self._floor()
            try:
                upd = self._plan_update(key, m, tensors)
                return upd, run(upd)
            except TargetModifiedError:
                raise
            except (IntegrityError, FormatError, NotFoundError) as e:
                error = e
                if upd is not None and upd.squash is not None:
                    ref = upd.squash
                    logger.warning("squash %d→%d (%s) failed: %s; planning without it", ref.from_, ref.to, ref.key, e)
                    self._bad_squashes.add(ref.key)
                    continue
                if isinstance(e, NotFoundError) and self._collected_since(floor):
                    continue
                raise
        assert error is not None
        raise error

    def _floor(self) -> int:
        index = self._index()
        return 1 if index is None else index.floor

    def _collected_since(self, floor: int) -> bool:
        """Re-read HEAD and its index (SPEC §7.7): True when the floor rose above the held
        version since it was ``floor`` (a NotFound is then collection, not damage)."""
        got = self._history.read_head()
        if got is None or self._held is None:
            return False
        self._head = got[0]
        now = self._floor()
        return now > floor and self._held.manifest.version < now

    def _check_forward(self, key: str, m: Manifest) -> bool:
        """True when ``m`` is newer than the held version (False: current); raises if older."""
        self._check_same_history(key, m)
        if self._version is not None and m.version == self._version:
            return False
        if self._version is not None and m.version < self._version:
            if self._head is not None and key == self._head.manifest:
                raise HeadRolledBackError(
                    f"HEAD of {self.url} names version {m.version} ({key!r}), older than version {self._version} this "
                    "subscriber holds (restored from a backup, a lagging mirror, or rolled back by a party with write "
                    "access): nothing was applied; a subscriber never goes backwards (pull() reads an older version)"
                )
            raise VersionNotFoundError(f"pull_into cannot go back from version {self._version} to {m.version}; use pull()")
        return True

    def _fast_forward(self, key: str, m: Manifest, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> VersionInfo | None:
        if not self._check_forward(key, m):
            self._last_changed = {}
            return None
        tensors = _targets(target)
        if self.select is not None:
            return self._fast_forward_partial(key, m, tensors)
        upd, _ = self._updated(
            key, m, tensors, lambda u: self._engine.apply_in_place(u.plans, u.specs, tensors, u.base, self._version)
        )
        self._set_held(upd.held)
        # computed when asked (last_changed): per group member, ~30 ms at 20,000 members
        self._last_changed = functools.partial(_plan_spans, upd.plans, upd.specs)
        return VersionInfo.from_manifest(m, key)

    # --- partial pulls (SPEC §8 "Partial pulls", deltastore.layout.select) ----------------------------

    def _selected(self, specs: dict[str, TensorSpec]) -> Resolved:
        """The selection against layout ``specs`` (resolved once per layout)."""
        assert self.select is not None
        if self._resolved_for is None or self._resolved_for[0] != specs:
            self._resolved_for = (specs, resolve(self.select, specs))
        return self._resolved_for[1]

    @staticmethod
    def _empty(res: Resolved, make: Any) -> dict[str, torch.Tensor]:
        return {n: make(shape, dtype=_torch_dtype(dt)) for n, (dt, shape) in res.shapes.items()}

    @staticmethod
    def _narrow(plans: list[ChunkPlan], res: Resolved) -> list[ChunkPlan]:
        """The plans of the chunks the selection reads."""
        return [p for p in plans if (p.name, p.index) in res.chunks]

    def _check_target(self, specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor], *, against: str,
                      tied: Mapping[str, str] | None = None) -> None:
        """``tensors`` against the layout ``specs``. A module target first sets aside the tied
        aliases the version leaves out (:class:`~deltastore.layout.tied.ModuleTensors`); a dict target
        is checked as it is, and a tied alias that keeps it from fitting is named in the error
        (``tied``: the aliases the version records)."""
        if self.select is not None:
            check_target(self._selected(specs), tensors, against=against)
            return
        try:
            check_layout(specs, tensors, against=against)
            return
        except LayoutMismatchError as e:
            error = e
        names = member_specs(specs).keys()
        if isinstance(tensors, ModuleTensors) and tensors.fit(names):
            try:
                check_layout(specs, tensors, against=against)
                return
            except LayoutMismatchError as e:
                error = e
        hint = alias_hint(tensors, names, tied or {}, module=isinstance(tensors, ModuleTensors))
        if not hint:
            raise error
        raise LayoutMismatchError(f"{error}{hint}") from None

    def _fast_forward_partial(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> VersionInfo:
        """``pull_into`` of a partial target: the whole-target update, narrowed to the chunks
        the selection reads (plans, and the held digests the target must match)."""

        def run(u: _Update) -> None:
            res = self._selected(u.specs)
            base = {k: d for k, d in u.base.items() if k in res.chunks}
            spare = {k: v for k, v in self._spare.items() if k in res.edges} if u.base else {}
            self._engine.apply_in_place(self._narrow(u.plans, res), u.specs, tensors, base, self._version,
                                        lambda sp, t: slice_targets(sp, res, t, spare))
            self._spare = spare

        upd, _ = self._updated(key, m, tensors, run)
        self._set_held(upd.held)
        res = self._selected(upd.specs)
        self._last_changed = changed_spans(self._narrow(upd.plans, res), res)
        return VersionInfo.from_manifest(m, key)

    def _refuse_partial(self, what: str) -> None:
        if self.select is not None:
            raise SelectionError(f"{what} updates whole targets; a partial subscriber of {self.url} uses pull_into")

    def _stage(self, key: str, m: Manifest, target: Mapping[str, torch.Tensor] | torch.nn.Module) -> StagedUpdate | None:
        if not self._check_forward(key, m):
            return None
        tensors = _targets(target)
        before = self.bytes_fetched
        upd, (patches, fetch_s, decode_s) = self._updated(
            key, m, tensors, lambda u: self._engine.stage(u.plans, u.specs, tensors, u.base, self._version)
        )
        return StagedUpdate(
            info=VersionInfo.from_manifest(m, key), from_version=self._version, patches=patches,
            bytes_fetched=self.bytes_fetched - before, fetch_s=fetch_s, decode_s=decode_s,
            base_manifest=None if self._held is None else self._held.key, held=upd.held, owner=self,
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
        on_history_replaced: str | None = None,
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
            cache_dir: a local :class:`deltastore.read.cache.WorkerCache`: on start, a cached
                version is verified against the store (chain, lineage, every chunk digest) and
                adopted without fetching it; anything wrong with it is logged and the cache is
                rebuilt. The held version is saved every ``cache_every_s`` and at the end; a
                save that fails (a full disk) is logged and the loop goes on (the previous
                cached version is kept). A ``cache_dir`` that is not a directory raises
                WorkerCacheError before anything is fetched.
            worker_id, heartbeat: write heartbeats to the store's ledger (SPEC §10) as this
                worker (:meth:`heartbeat`; one already running is used as it is), and a last
                one marked stopped when the loop ends; read-only credentials are tolerated.
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
            on_history_replaced: what to do when HEAD names a version of another history
                than the held one (another lineage, or a manifest that does not continue the
                held one; also a worker cache of another lineage): ``"raise"``
                HistoryReplacedError, the target keeps its version; ``"reload"`` logs it and
                loads the new history whole (inside the pause, all or nothing). Default:
                ``"raise"`` with ``trusted_keys`` (a party with write access but no key could
                otherwise move the worker to any run signed by the same key, older or newer:
                SPEC §3.1), ``"reload"`` without (whoever writes HEAD is trusted then, and a new
                run under the same URL is the usual cause).

        Raises:
            LayoutMismatchError: the store's layout no longer fits ``target``.
            TargetModifiedError: ``target`` was modified by someone else.
            HistoryReplacedError: the history was replaced, under ``on_history_replaced="raise"``.
            Storage errors, a corrupt segment or a missing manifest are logged and retried
            with backoff; the target keeps the last good version. A HEAD older than the held
            version (HeadRolledBackError) is logged once per HEAD and polled at ``interval``:
            the target keeps its version and takes the next newer one.

        Example::

            lock = threading.Lock()               # the engine holds it while generating
            for rec in sub.follow(model, pause=lock, cache_dir="/var/cache/ds"):
                print(rec.info.version, rec.pause_s)
        """
        self._refuse_partial("follow")
        if swap_mode not in ("inplace", "rebind"):
            raise ValueError(f"swap_mode must be 'inplace' or 'rebind', got {swap_mode!r}")
        if on_history_replaced not in (None, "raise", "reload"):
            raise ValueError(f"on_history_replaced must be 'raise' or 'reload' (or None), got {on_history_replaced!r}")
        replaced = on_history_replaced or ("raise" if self._keys is not None else "reload")
        rolled_back: str | None = None  # the older HEAD manifest last warned about (once per HEAD)
        tensors = _targets(target)
        owners = _owners(target) if swap_mode == "rebind" else None
        stop = stop if stop is not None else threading.Event()
        cache = WorkerCache(cache_dir) if cache_dir is not None else None
        try_cache = cache is not None and self._version is None
        saved: str | None = None  # manifest key of the version last written to the cache
        last_save = time.monotonic()
        applied = failures = 0

        def save() -> None:
            nonlocal saved, last_save
            if cache is None or self._held is None or self._held.key == saved:
                return  # (a key, not a number: a replaced history reuses version numbers)
            key, m = self._held.key, self._held.manifest
            try:
                cache.save(tensors, url=self.url, version=m.version, manifest=key, lineage=m.lineage)
                saved = key
            except Exception as e:  # noqa: BLE001 - the cache is a hint: failing to write it never stops serving
                logger.warning("following %s without updating the worker cache: %s: %s", self.url, type(e).__name__, e)
            last_save = time.monotonic()  # a failed save is retried after cache_every_s, not at every poll

        # Started last before the loop, so that the finally below always closes it (marks it stopped).
        own_beats = heartbeat and (self._beats is None or self._beats.closed)
        beats = self.heartbeat(worker_id) if heartbeat else None
        try:
            while not stop.is_set():
                try:
                    if try_cache:
                        assert cache is not None
                        rec = self._adopt_cache(cache, tensors, pause, replaced)
                        try_cache = False
                        saved = None if rec is None else rec.info.manifest
                    else:
                        rec = self._follow_once(tensors, pause, owners)
                    failures = 0
                except HistoryReplacedError as e:
                    if replaced == "raise":
                        raise HistoryReplacedError(
                            f"{e}; or follow with on_history_replaced='reload' to load it whole (with trusted keys, "
                            "only if a new run is expected: anyone who can write HEAD can point it at any run signed "
                            "by the same key)"
                        ) from None
                    logger.warning("following %s: %s; loading the new history whole", self.url, e)
                    self._version = self._held = None
                    continue
                except HeadRolledBackError as e:
                    # Not a failure to back off from: HEAD may stay there (a restored backup) or
                    # come back; the target keeps its version and takes the next newer one.
                    head_key = None if self._head is None else self._head.manifest
                    if head_key != rolled_back:
                        logger.warning("following %s: %s; keeping version %s", self.url, e, self._version)
                        rolled_back = head_key
                    stop.wait(_jittered(interval, jitter))
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
                if rec is not None:
                    applied += 1
                    rolled_back = None
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
        else:
            save()
        finally:
            if own_beats and beats is not None:
                beats.close()  # a worker that stops following says so in the ledger

    def _follow_once(self, tensors: dict[str, torch.Tensor], pause: Any,
                     owners: dict[str, torch.Tensor] | None = None) -> FollowRecord | None:
        """One poll: None when HEAD has not moved, else the record of the version applied."""
        head = self._history.poll_head()  # a conditional GET: no body when unchanged
        if head is None or head.manifest is None:
            if self._version is None and not self._said_waiting:
                logger.info("waiting for the first version of %s", self.url)
                self._said_waiting = True
            return None
        self._head = head
        if self._held is not None and head.manifest == self._held.key:
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

    def _adopt_cache(self, cache: WorkerCache, tensors: dict[str, torch.Tensor], pause: Any,
                     replaced: str = "reload") -> FollowRecord | None:
        """Verify a cached state against the store and load it into ``tensors`` (in the pause).

        Returns None (the cache cleared, with a log line) when it is not usable; a transient
        storage error is raised (the cache is kept for the retry), and so is a cache of
        another lineage under ``replaced="raise"`` (HistoryReplacedError, the cache kept).
        """
        st = cache.load()
        if st is None:
            return None
        collected: int | None = None  # the floor, when the cached version was collected
        try:
            if st.url != self.url:
                raise _Unusable(f"it belongs to {st.url}")
            head = self._require_head()
            top = self._history.head_manifest(head)
            assert top is not None
            if top[1].lineage != st.lineage:
                if replaced == "raise" and top[1].lineage is not None and st.lineage is not None:
                    # the cache is the held version of a restarted follower: the same rule as follow's
                    raise HistoryReplacedError(
                        f"the history of {self.url} was replaced: its lineage is {top[1].lineage}, the worker cache in "
                        f"{cache.path} holds version {st.version} of lineage {st.lineage}; nothing was loaded and the "
                        "cache is kept. Delete the cache directory to start over"
                    )
                raise _Unusable(f"the store's lineage is {top[1].lineage}, the cache's {st.lineage}")
            index = self._index(head)
            if index is not None and st.version < index.floor:
                # Design 005 D2: the cached version's manifests are gone; hash the cached chunks
                # against head's digests and fetch only the chunks that differ (from its anchor).
                collected = index.floor
                key, m = top
            elif self._keys is not None and st.version > top[1].version:
                # HEAD is older than the cached version of the same lineage (rolled back): a
                # trusted follower keeps its version across a restart too, checked against its
                # own signed manifest; the loop then meets the older HEAD (HeadRolledBackError).
                key = st.manifest
                try:
                    m = self._history.manifest(key)
                except NotFoundError:
                    raise _Unusable(f"its manifest {key!r} is gone") from None
                if m.version != st.version or m.lineage != st.lineage:
                    raise _Unusable(f"{key!r} is version {m.version} of lineage {m.lineage}")
            else:
                key, m = self._history.find(st.version, head)
                if key != st.manifest:
                    raise _Unusable(f"version {st.version} of {self.url} is now {key!r}, not {st.manifest!r}")
            ms = self._history.anchor_chain(key, m)
            specs = _layout(ms[0][1])
            check_layout(specs, st.tensors, against=f"version {m.version} of {self.url}")
            cached = targets_for(specs, st.tensors)
            bad = digest_mismatches(self._pool, specs, _digests(ms), lambda name, a, b: cached[name].read(a, b))
            if bad and collected is None:
                raise _Unusable(f"tensor {bad[0][0]!r} chunk {bad[0][1]} does not match its digest")
        except NotFoundError:
            raise  # maybe transient (HEAD briefly ahead of its manifest): keep the cache, retry
        except (StorageError, HistoryReplacedError):
            raise
        except (_Unusable, DeltastoreError, KeyError) as e:
            logger.warning("the worker cache in %s is not usable for %s (%s): clearing it and loading in full",
                           cache.path, self.url, e)
            cache.clear()
            return None
        self._check_target(specs, tensors, against=f"version {m.version} of {self.url}",  # the target's problem
                           tied=recorded_aliases(m.metadata))
        plans: list[ChunkPlan] = []
        if collected is not None:
            logger.info("version %d was collected (floor %d); catching up from anchor %d", st.version, collected, m.anchor)
            stale = set(bad)
            plans = [p for p in self._plan_from_anchor(ms, specs) if (p.name, p.index) in stale]
        before = self.bytes_fetched
        with _pause_context(pause):
            t0 = time.perf_counter()
            for n, t in tensors.items():
                t.copy_(st.tensors[n])
            if plans:  # the chunks the cache lacks, from the anchor (all or nothing, as a full load)
                kept = {k: d for k, d in _digests(ms).items() if k not in stale}
                self._engine.apply_in_place(plans, specs, tensors, kept, None)
            pause_s = time.perf_counter() - t0
        self._set_held(_Held.of(ms))
        self._last_changed = _whole(tensors)
        logger.info("resumed version %d of %s from the worker cache in %s (%d chunk(s) fetched)",
                    m.version, self.url, cache.path, len(plans))
        return FollowRecord(VersionInfo.from_manifest(m, key), None, self.bytes_fetched - before, 0.0, 0.0, pause_s,
                            _whole(tensors), True)

    def verify(self, version: int | None = None, *, all_versions: bool = False) -> VerifyReport:
        """Check every segment of a version's chain, or of every version, and report each bad one.

        Unlike :meth:`pull`, which reads only the segments one path needs, this fetches every
        segment each manifest lists, full and delta (an anchor's delta segments too), checks its
        SHA-256, decodes it, and checks the chunk it produces against the recorded digest:
        versions are replayed oldest first, so a delta is applied to the verified state of its
        parent. Problems are collected, not raised, so one run names every bad object.

        Args:
            version: the version whose chain (from its anchor) to check; default the latest.
            all_versions: check every version from 1 (the index's floor once versions were
                collected) to the latest instead.

        Raises:
            VersionNotFoundError: no such version (or an empty store).
            CorruptObjectError, IntegrityError, NotFoundError: a manifest of the chain itself is
                unreadable or the chain is broken (nothing further can be checked).
        """
        if all_versions:
            head = self._require_head()
            top = self._history.head_manifest(head)
            assert top is not None
            index = self._index(head)
            ms = self._history.chain(*top, down_to=1 if index is None else index.floor)
            for k, m in ms:
                if m.base is not None:  # a site store's based version (design 009): BaseElsewhereError
                    self._history.anchor_chain(k, m)
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
        if self._beats is not None:
            self._beats.close()  # marks the worker stopped: a write, so before the store goes
        self._engine.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _verify(self, key: str, m: Manifest) -> None:
        """The trusted keys' check of each manifest read; an unsigned one above a signed version
        of its history is named for what it is (UnsignedVersionError)."""
        assert self._keys is not None
        try:
            self._keys.verify(key, m)
        except SignatureError:
            below = self._signed_below(m) if m.signature is None else None
            if below is None:
                raise
            from deltastore.format.signing import unsigned_version_error

            raise unsigned_version_error(self.url, key, m, *below) from None

    def _signed_below(self, m: Manifest) -> tuple[str, Manifest] | None:
        """A version below ``m`` in its history that is signed by a trusted key, if one is at
        hand: the held version, else ``m``'s parent (one read, not cached; None on any error)."""
        assert self._keys is not None
        held = self._held
        if held is not None and held.manifest.signature is not None and held.manifest.lineage == m.lineage \
                and held.manifest.version < m.version:
            return held.key, held.manifest  # verified when it was read
        from deltastore.format.signing import signed_parent

        return signed_parent(self._keys, self._history, m)

    def _check_same_history(self, key: str, m: Manifest) -> None:
        """SPEC §7 step 3: the version to reach must be in the held version's history (D7)."""
        if self._held is None:
            return
        held_key, held = self._held.key, self._held.manifest
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

    def _check_model_size(self, specs: dict[str, TensorSpec], version: int, res: Resolved | None = None) -> None:
        total = sum(s.nbytes for s in specs.values())
        if res is not None:  # a partial subscriber holds its selection and whole edge chunks
            total = sum(math.prod(shape) * DTYPE_WIDTHS[dt] for dt, shape in res.shapes.values())
            total += sum(specs[u].chunk_bytes(i) for u, i in res.edges)
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
        self._head = head
        return head

    def _resolve(self, version: int | None) -> tuple[str, Manifest]:
        head = self._require_head()
        if version is None:
            top = self._history.head_manifest(head)
            assert top is not None
            return top
        return self._history.resolve(version, head)  # below the floor: its pin, or collected

    def _index(self, head: Head | None = None) -> Index | None:
        """The history index of ``head`` (default: the HEAD last read); History caches it by key."""
        head = head if head is not None else self._head
        return None if head is None else self._history.index(head)

    def _set_held(self, held: _Held) -> None:
        if self._held is None or held.key != self._held.key:
            self._bad_squashes.clear()  # squash hints are per held version
        self._version, self._held = held.manifest.version, held
        if self._beats is not None:
            self._beats.notify()  # written by its thread: never inside the caller's pause

    # Planning is pure (deltastore.read.plan); pull_into calls it under these names.
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


def _plan_spans(plans: list[ChunkPlan], specs: Mapping[str, TensorSpec]) -> dict[str, list[tuple[int, int]]]:
    """Tensor name → the merged spans of the chunks ``plans`` write (what changed). A group
    row's span (design 007) is reported as the spans of the member tensors it overlaps, in
    each member's own element coordinates: users see tensors, never group rows. A column-grid
    chunk (design 011 D4) is reported as its whole row band ``[r0·row, r1·row)``: a superset
    in natural order, one span per chunk (merged with its neighbours)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in plans:
        spec = specs.get(p.name)
        if spec is not None and spec.members:
            for member, lo, hi in member_overlaps(spec, *p.span):
                spans.setdefault(member.name, []).append((lo - member.offset, hi - member.offset))
        elif spec is not None and spec.chunk_cols:
            r0, r1, _, _ = spec.chunk_block(p.index)
            spans.setdefault(p.name, []).append((r0 * spec.row_elems, r1 * spec.row_elems))
        else:
            spans.setdefault(p.name, []).append(p.span)
    return {n: merge_spans(s) for n, s in spans.items()}


def _targets(target: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """The target's tensors (``_target_tensors``); a module's as :class:`~deltastore.layout.tied.ModuleTensors`,
    which fit a version that publishes each tied memory once (kept as they are when passed again)."""
    if isinstance(target, ModuleTensors):
        return target
    tensors = _target_tensors(target)
    return ModuleTensors(tensors) if isinstance(target, torch.nn.Module) else tensors


def _owners(target: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensor objects to repoint in a swap by rebinding: a module's own Parameters and
    buffers, or the tensors of a mapping as they are."""
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)
