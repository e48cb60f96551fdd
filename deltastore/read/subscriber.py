"""The read path (SPEC §7): a :class:`Subscriber` polls HEAD, plans which segments to fetch,
verifies them and applies them to the user's tensors.

The Subscriber is the public face; its state and moves are a :class:`deltastore.read.reader.Reader`,
the paths it plans are :mod:`deltastore.read.catchup`'s, following is :mod:`deltastore.read.follow`
and checking a store whole is :mod:`deltastore.read.verify`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from typing_extensions import Self

from deltastore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    StorageError,
    UnsupportedURLError,
    VersionNotFoundError,
    WaitTimeoutError,
)
from deltastore.fleet.deadlines import DeadlineStore, Deadlines
from deltastore.fleet.ledger import HEARTBEAT_INTERVAL_S, HeartbeatWriter
from deltastore.fleet.nodecache import NodeCache, with_node_cache
from deltastore.format.history import VersionInfo
from deltastore.format.models import FORMAT_NAME_PATTERN
from deltastore.format.parse import MAX_MANIFEST_BYTES
from deltastore.layout.select import Selection
from deltastore.layout.tensors import TensorSpec, member_specs
from deltastore.read.follow import CachePolicy, FollowRecord, HeartbeatPolicy, PollPolicy, follow
from deltastore.read.reader import Reader
from deltastore.read.stage import StagedUpdate
from deltastore.read.streams import StreamView
from deltastore.read.targets import Target
from deltastore.read.verify import VerifyReport, verify_chain
from deltastore.storage import open_store
from deltastore.storage.base import Store

logger = logging.getLogger(__name__)

#: Seconds between looks at HEAD while waiting for a version (a conditional GET each).
WAIT_INTERVAL_S = 2.0


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
            :meth:`follow` update the selected tensors alike, and swap those bits with them
            (a worker cache holds them too).
        range_part_bytes: read packs as parallel range GETs of at most this many bytes (cut at
            segment boundaries; None: one GET per pack's run of needed segments). For far or
            lossy links, where one TCP connection carries a fraction of the link (at 80 ms and
            0.1 % loss, ~5.6 Mbit/s): e.g. 256 KiB. Costs more requests per version.
        format: the serving format to read (SPEC §15), e.g. ``"fp8-block128"``: the stream a
            publisher declared with ``formats=``, fetched alone (the other formats' bytes are
            never read), verified like any version. None (default): the versions as published.
            A version without that format raises
            :class:`~deltastore.errors.UnknownFormatError`, listing the formats it has.
        node_cache: a directory shared by the worker processes of this host (the ranks of a
            tensor-parallel engine, several engines), or a
            :class:`~deltastore.fleet.nodecache.NodeCache`: each immutable object (packs,
            manifests) is fetched from the store by one process and read from the directory by
            the others, so a version leaves the bucket once per node (docs/fleet.md). None
            (default): the directory ``DELTASTORE_NODE_CACHE`` names, else no node cache.
            Raises NodeCacheError when the directory cannot be used.
        mirrors: mirrors of ``url`` (URLs or stores, nearest first; ``deltastore mirror``
            keeps them current), opened with ``storage_options``: every object named by its
            SHA-256 is read from the first mirror that holds it with the right bytes, the
            origin ``url`` last; HEAD is the origin's, or a mirror's older head that the
            origin's chain vouches for (SPEC §16.1, :mod:`deltastore.fleet.sources`). A mirror
            serving a corrupt or foreign object is skipped with a warning naming it.
        deadlines: how long each request may take (:class:`~deltastore.fleet.deadlines.Deadlines`:
            a HEAD poll, a read growing with its bytes, a heartbeat write); a stalled request is
            abandoned and raises :class:`~deltastore.errors.DeadlineExceededError`, which
            :meth:`follow` logs, counts and retries. None: no deadlines but the client's own
            socket timeouts.

    Example::

        sub = Subscriber("s3://bucket/run1")
        weights = sub.pull()                 # the latest version, verified
        fp8 = Subscriber("s3://bucket/run1", format="fp8-block128").pull()  # weights + weight_scale_inv
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
        format: str | None = None,
        node_cache: str | os.PathLike[str] | NodeCache | None = None,
        mirrors: Sequence[str | Store] | None = None,
        deadlines: Deadlines | None = Deadlines(),
    ):
        """``store``: an already opened store to use instead of ``url`` (not closed by us)."""
        if range_part_bytes is not None and range_part_bytes < 1:
            raise ValueError(f"range_part_bytes must be positive, got {range_part_bytes}")
        keys = None
        # read here, and again by the stream subscribers of verify(streams=True)
        trusted_keys = None if trusted_keys is None else list(trusted_keys)
        if trusted_keys is not None:
            from deltastore.format.signing import TrustedKeys

            keys = TrustedKeys(trusted_keys)  # keys checked before the store is opened
        self.store = store if store is not None else open_store(url, storage_options=dict(storage_options or {}))
        self._owns_store = store is None  # a store passed in belongs to the caller
        if mirrors:  # the nearest mirror serves the bytes, the origin vouches (deltastore.fleet.sources)
            from deltastore.fleet.sources import Sources

            try:
                # each source bounded by the deadlines: a stalled mirror fails over to the next source
                self.store = Sources.open(self.store, mirrors, storage_options=storage_options, owns_origin=self._owns_store,
                                          deadlines=deadlines)
            except BaseException:
                if self._owns_store:
                    self.store.close()
                raise
            self._owns_store = True
        self.url = self.store.url
        self.format = format
        # what a subscriber of one of the store's serving streams is opened with (verify(streams=True))
        self._stream_options: dict[str, Any] = dict(
            threads=threads, trusted_keys=trusted_keys, max_model_bytes=max_model_bytes,
            max_manifest_bytes=max_manifest_bytes, range_part_bytes=range_part_bytes, deadlines=deadlines)
        if format is not None:
            if not isinstance(format, str) or not re.fullmatch(FORMAT_NAME_PATTERN, format):
                if self._owns_store:
                    self.store.close()
                raise ValueError(f"format must be a serving format's name such as 'fp8-block128', got {format!r}")
        # a format's stream is read as a store of its own (deltastore.read.streams; its URL names
        # the format): every read path and check applies to it unchanged
        view = None if format is None else StreamView(self.store, format)
        read_from = self.store if view is None else view
        self._deadlines = deadlines
        if deadlines is not None and not mirrors:  # under the node cache: every request is bounded (fleet.deadlines)
            read_from = DeadlineStore(read_from, deadlines)
        try:
            read_from = with_node_cache(read_from, node_cache)  # one fetch per node (fleet.nodecache)
        except (OSError, ValueError):
            if self._owns_store:
                self.store.close()
            raise
        self.url = read_from.url
        self._reader = Reader(read_from, threads=threads, trusted_keys=keys, max_manifest_bytes=max_manifest_bytes,
                              max_model_bytes=max_model_bytes, select=select, serving_format=format,
                              index_source=None if view is None else view.stream_index,
                              earlier=None if view is None else view.earlier)
        if range_part_bytes is not None:
            self._reader.engine.fetcher.max_run = range_part_bytes
        self._closed = False

    @property
    def select(self) -> Selection | None:
        """The selection of a partial subscriber (None: whole targets)."""
        return None if self._reader.partial is None else self._reader.partial.select

    @property
    def max_model_bytes(self) -> int | None:
        """The most bytes of tensors this subscriber materializes (None: no bound known)."""
        return self._reader.max_model_bytes

    @property
    def version(self) -> int | None:
        """The version this subscriber last pulled (None before the first pull)."""
        return self._reader.version

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
        return {n: list(s) for n, s in self._reader.changed.items()}

    @property
    def bytes_fetched(self) -> int:
        """Bytes of packs read from the store by this subscriber so far (manifests excluded)."""
        return self._reader.engine.bytes_fetched

    def layout(self) -> dict[str, TensorSpec]:
        """The tensor layout (names, dtypes, shapes, chunking) of the version last pulled: the
        tensors users see, group members included (design 007)."""
        return member_specs(self.units())

    def units(self) -> dict[str, TensorSpec]:
        """The layout rows of the version last pulled: tensors, and group rows of small
        tensors (each spec's ``members``) as the store chunks them (design 007)."""
        held = self._reader.held
        if held is None:
            raise VersionNotFoundError(f"no version of {self.url} has been pulled yet")
        return dict(held.specs)

    def latest(self) -> VersionInfo | None:
        """The newest committed version (None for an empty store), via a conditional GET."""
        return self._reader.history.latest()

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
            The running :class:`~deltastore.fleet.ledger.HeartbeatWriter` (a context manager); the
            same one while it runs.

        Raises:
            ValueError: a malformed worker id, or another id than the running writer's.

        Example::

            with sub.heartbeat("serve-1"):
                while serving:
                    staged = sub.stage(model)
                    ...
        """
        return self._reader.heartbeat(worker_id, interval_s)

    def info(self, version: int) -> VersionInfo:
        """The :class:`VersionInfo` of ``version``; raises VersionNotFoundError."""
        key, m = self._reader.history.find(version, self._reader.require_head())
        return VersionInfo.from_manifest(m, key)

    def log(self, since: int = 1) -> list[VersionInfo]:
        """Every committed version from ``since`` (default: the first) to the latest, oldest
        first; versions below the history index's floor were collected and are not listed."""
        r = self._reader
        head = r.history.poll_head()
        if head is None:
            return []
        r.head = head
        return r.history.log(head, since=since)

    def pull(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """Materialize ``version`` (default: the latest) as new CPU tensors, verified.

        In a store with tensor groups (design 007), the small tensors of one group are views of
        one buffer, back to back (each of its own shape; safetensors and ``torch.save`` store
        them as usual), so that ``pull_into`` updates the group in place.

        Raises:
            VersionNotFoundError: no such version (or an empty store).
            IntegrityError: a segment or a reconstructed chunk failed its digest.
        """
        return self._reader.materialize(*self._reader.resolve(version))

    def allocate(self, version: int | None = None, *,
                 into: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Zeroed CPU tensors in the layout of ``version`` (default: the latest), to follow into.

        Fetches manifests only; the model size is checked against ``max_model_bytes`` first.
        Raises VersionNotFoundError on an empty store: :meth:`wait_for_version` waits for one.

        Args:
            version: the version whose layout to allocate (default: the latest).
            into: carve every tensor from one buffer of the caller's instead: called once
                with the bytes needed, it returns a contiguous 1-D ``uint8`` tensor at least
                that long (shared or pinned memory; a ``meta`` tensor gives each tensor's offset
                without memory). The tensors are views of it, each at a multiple of 64 bytes,
                in layout order; its bytes are left as they are (not zeroed).
        """
        return self._reader.allocate(*self._reader.resolve(version), into=into)

    def pull_into(self, target: Target, version: int | None = None) -> VersionInfo | None:
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
        return self._reader.fast_forward(*self._reader.resolve(version), target)

    def adopt(self, target: Target, version: int | None = None) -> VersionInfo:
        """Hold ``version`` (default: the latest) with the bits ``target`` already has, fetching
        no pack: every chunk of ``target`` is hashed and checked against the version's digest,
        and afterwards :meth:`pull_into`, :meth:`stage` and :meth:`follow` fast-forward it from
        there. For weights that are already this version: a copy a process on the same host
        kept (a shared host copy whose leader went away), a checkpoint saved at it.

        Args:
            target: a dict of the version's tensors or an ``nn.Module``, as :meth:`pull_into`
                takes (a partial subscriber's: its selection's tensors and slices); it is read,
                never written.
            version: the version it holds (default: the latest).

        Returns:
            The adopted version's info.

        Raises:
            TargetModifiedError: a chunk of ``target`` does not match its digest (named, with
                how many more do not); nothing is held.
            LayoutMismatchError: ``target``'s names, dtypes or shapes are not the version's.
            ValueError: this subscriber already holds a version, or its selection straddles
                a chunk (one cut inside a chunk: the chunk cannot be checked without the bits
                the target leaves out).
            VersionNotFoundError: no such version (or an empty store).
        """
        return self._reader.adopt(*self._reader.resolve(version), target)

    def stage(self, target: Target, version: int | None = None) -> StagedUpdate | None:
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
        return self._reader.stage(*self._reader.resolve(version), target)

    def swap(self, staged: StagedUpdate, target: Target) -> float:
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
        return self._reader.swap(staged, target)

    def follow(
        self,
        target: Target,
        *,
        poll: PollPolicy = PollPolicy(),
        pause: Any = None,
        stop: threading.Event | None = None,
        cache: CachePolicy | None = None,
        heartbeat: HeartbeatPolicy | None = HeartbeatPolicy(),
        max_versions: int | None = None,
        swap_mode: str = "inplace",
        on_history_replaced: str | None = None,
        fleet_target: bool = True,
        metrics_port: int | None = None,
    ) -> Iterator[FollowRecord]:
        """Keep ``target`` at the latest version, yielding one :class:`FollowRecord` per version.

        Polls HEAD every ``poll.interval`` seconds (± ``poll.jitter`` of it) by conditional GET:
        an idle poll is one request with no body (two with the fleet target: ``fleet_target``).
        A new version is staged (fetched, verified,
        decoded) while the caller keeps using ``target``; only the swap runs inside ``pause``,
        which is None, a context manager (e.g. a ``threading.Lock`` the engine holds while
        generating), or a callable returning one. The first version (nothing held, no usable
        cache) is loaded whole inside the pause.

        Args:
            poll: the poll cadence and the backoff after errors (:class:`~deltastore.read.follow.PollPolicy`).
            pause: the critical section in which ``target`` is written.
            stop: a ``threading.Event``; the loop returns soon after it is set.
            cache: a local worker cache to start from and save to
                (:class:`~deltastore.read.follow.CachePolicy`; None: none). A cached version is
                verified against the store (chain, lineage, every chunk digest) before it is
                adopted; anything wrong with it is logged and the cache is rebuilt.
            heartbeat: write heartbeats to the store's ledger (SPEC §10) as this worker
                (:class:`~deltastore.read.follow.HeartbeatPolicy`; :meth:`heartbeat`, one
                already running is used as it is), and a last one marked stopped when the loop
                ends; read-only credentials are tolerated. None: no heartbeats.
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
            fleet_target: hold the store's fleet target (``deltastore target``, SPEC §1.2)
                instead of HEAD while one applies, going back to an older version if it names
                one (staged, all or nothing); each poll then also reads the target (one more
                conditional GET). With ``trusted_keys`` a target must be signed by one of them,
                else it is ignored (logged) and the version kept. False: follow HEAD only.
            metrics_port: serve Prometheus metrics of this loop on this port
                (:mod:`deltastore.fleet.metrics`: versions, lag, bytes, fetch/decode/pause times,
                errors; ``GET /metrics``) while it runs; needs ``prometheus-client``
                (``deltastore-weights[metrics]``). None (default): no metrics.

        Raises:
            LayoutMismatchError: the store's layout no longer fits ``target``.
            TargetModifiedError: ``target`` was modified by someone else.
            HistoryReplacedError: the history was replaced, under ``on_history_replaced="raise"``.
            WorkerCacheError: ``cache.path`` cannot be a directory (before anything is fetched).
            MetricsPortInUseError, MetricsUnavailableError: ``metrics_port`` cannot be served
                (before anything is fetched).
            Storage errors, a corrupt segment or a missing manifest are logged and retried
            with backoff; the target keeps the last good version. A HEAD older than the held
            version (HeadRolledBackError) is logged once per HEAD and polled at
            ``poll.interval``: the target keeps its version and takes the next newer one.

        Example::

            lock = threading.Lock()               # the engine holds it while generating
            for rec in sub.follow(model, pause=lock, cache=CachePolicy("/var/cache/ds")):
                print(rec.info.version, rec.pause_s)
        """
        return follow(self._reader, target, poll=poll, pause=pause, stop=stop, cache=cache, heartbeat=heartbeat,
                      max_versions=max_versions, swap_mode=swap_mode, on_history_replaced=on_history_replaced,
                      fleet_target=fleet_target, metrics_port=metrics_port, deadlines=self._deadlines)

    def verify(self, version: int | None = None, *, all_versions: bool = False, streams: bool = False) -> VerifyReport:
        """Check every segment of a version's chain, or of every version, and report each bad one.

        Unlike :meth:`pull`, which reads only the segments one path needs, this fetches every
        segment each manifest lists, full and delta (an anchor's delta segments too), checks its
        SHA-256, decodes it, and checks the chunk it produces against the recorded digest:
        versions are replayed oldest first, so a delta is applied to the verified state of its
        parent. Problems are collected, not raised, so one run names every bad object.

        Args:
            version: the version whose chain (from its anchor) to check; default the latest.
            all_versions: check every version from 1 (the index's floor once versions were
                collected) to the latest instead; a serving stream's from its first version
                when it starts later (a format declared after the store's first version), and
                its versions from before a pause in it too.
            streams: check each serving stream too (SPEC §15) of the version checked (with
                ``all_versions``, every stream a retained version carries, a format no longer
                published included), each from its subscriber; their reports are the report's
                ``streams``, by format, and count in its ``ok``. Only for a subscriber of the
                store's versions as published (no ``format``).

        Raises:
            ValueError: ``streams`` on a subscriber of one format.
            VersionNotFoundError: no such version (or an empty store).
            CorruptObjectError, IntegrityError, NotFoundError: a manifest of the chain itself is
                unreadable or the chain is broken (nothing further can be checked).
        """
        if streams and self.format is not None:
            raise ValueError(f"streams=True checks the serving streams of a store's versions: pass it to a subscriber "
                             f"of the store (format=None), not of the {self.format} stream")
        r = self._reader
        if all_versions:
            head = r.require_head()
            top = r.history.head_manifest(head)
            assert top is not None
            index = r.index(head)
            floor = 1 if index is None else index.floor
            if self.format is not None:  # every chain of the stream (a pause in a format starts a new one)
                ms = r.history.chains(*top, down_to=floor)
            else:
                ms = r.history.chain(*top, down_to=floor)
            for k, m in ms:
                if m.base is not None:  # a site store's based version (design 009): BaseElsewhereError
                    r.history.anchor_chain(k, m)
        else:
            ms = r.history.anchor_chain(*r.resolve(version))
        report = verify_chain(ms, url=self.url, fetcher=r.engine.fetcher, pool=r.engine.pool,
                              check_size=r.check_model_size)
        if not streams:
            return report
        # the streams of the manifests just checked (with all_versions, every retained version's)
        top = ms[-1][1].version  # the version checked (a newer HEAD meanwhile is not)
        formats = sorted({r.format for _, m in (ms if all_versions else ms[-1:]) for r in m.streams})
        checked = {}
        for fmt in formats:
            with Subscriber(self.url, store=self.store, format=fmt, **self._stream_options) as sub:
                checked[fmt] = sub.verify(None if all_versions else top, all_versions=all_versions)
        return replace(report, streams=checked)

    def close(self) -> None:
        """Stop worker threads and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reader.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
