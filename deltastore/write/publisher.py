"""The commit path (SPEC §5): validate, choose anchor or delta, encode, write the manifest, CAS HEAD.

The :class:`Publisher` is thin: encoding a state into packs lives in :mod:`deltastore.write.encode`,
the version's place in the chain (tip, anchors, header, signing, manifest, HEAD) in
:mod:`deltastore.write.chain`, its settings in :mod:`deltastore.write.policy`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deltastore._util.heap import release_free_heap
from deltastore._util.jobs import default_threads
from deltastore.errors import ConflictError, InvalidStateDictError, LayoutMismatchError, StorageError
from deltastore.fleet.ledger import LIVE_TTL_S, oldest_live_version, read_ledger
from deltastore.fleet.tracing import span
from deltastore.format.history import VersionInfo
from deltastore.format.models import Head, Layout, layout_of
from deltastore.format.manifest import encode_manifest
from deltastore.layout import grid
from deltastore.layout.groups import unit_order, unit_reference
from deltastore.layout.tensors import TensorSpec, bits, check_layout, dtype_name, validate_state_dict
from deltastore.layout.tied import TIED_WEIGHTS_KEY, module_state
from deltastore.serving.formats import ServingFormat
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.storage.probe import require_atomic_writes
from deltastore.write.chain import VersionChain
from deltastore.write.commit import attempt_clock
from deltastore.write import requant
from deltastore.write.encode import (UPLOADS_IN_FLIGHT, AnchorChunk, ChangeSink, ChunkChange, LayoutWorks,
                                     encode_version)
from deltastore.write.policy import (
    AnchorPolicy,
    AsyncPolicy,
    LayoutPolicy,
    WriterPolicy,
    check_dtype,
    check_policy,
)
from deltastore.write.queue import PublishQueue, snapshot
from deltastore.write.streams import StreamVersion, StreamWriter, is_identity, serving_formats

if TYPE_CHECKING:
    from deltastore.fleet.metrics import PublisherExport
    from deltastore.lifecycle.compact import BackgroundCompactor, CompactPolicy

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes successive versions of a state dict to one store URL.

    Each :meth:`publish` commits one version: changed chunks are encoded against the previous
    published version (a CPU copy of it is kept in the served dtype), uploaded as
    content-addressed packs with a manifest, and made visible by one compare-and-swap of HEAD.

    :meth:`publish_async` does the same in the background: it validates the state and takes a
    host snapshot (in the served ``dtype``) before it returns, so the caller may modify its
    tensors at once; change detection, encoding, upload and commit then run on one background
    thread, in call order, and the returned Future resolves to the version's
    :class:`VersionInfo` (or to its error). When the store is slower than training,
    ``async_policy`` decides (:class:`~deltastore.write.policy.AsyncPolicy`): ``"block"``
    waits for room, ``"latest"`` replaces the newest waiting snapshot.

    A background failure (ConflictError, FencedError, StorageError, CommitUnknownError, ...)
    resolves that call's Future with the error, and the next :meth:`publish_async`,
    :meth:`publish`, :meth:`flush` or :meth:`close` raises it, once: a failure is never lost.
    :meth:`publish` first waits for every queued publish, so versions stay in call order. Call
    one Publisher from one thread.

    Args:
        url: store URL (a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``, or
            another fsspec URL — those lack atomic commit, see docs/SPEC.md).
        store: an already opened :class:`~deltastore.storage.Store` to use instead of ``url``
            (the caller keeps ownership: it is not closed by :meth:`close`).
        storage_options: passed to the storage backend (endpoint, credentials, ...).
        dtype: the served dtype of floating tensors (e.g. ``torch.bfloat16`` from fp32
            masters), for :meth:`publish` and :meth:`publish_async` alike; None (default)
            keeps each tensor's dtype. Integer and bool tensors always keep theirs.
        signing_key: an Ed25519 private key (a ``cryptography`` key object, PEM bytes or a
            PEM file path) to sign every manifest with (SPEC §3.1; ``deltastore-weights[signing]``).
        writer_policy: who writes and how safely (:class:`~deltastore.write.policy.WriterPolicy`:
            ``writer_id``, ``threads``, ``takeover``, ``resume``, ``skip_unchanged``,
            ``max_attempt_s``, ``allow_unsafe_store``, ``allow_unsigned``).
        anchor_policy: when a version is a full snapshot
            (:class:`~deltastore.write.policy.AnchorPolicy`; default: the cost rule, β = 1).
        layout_policy: how new layouts are chunked (:class:`~deltastore.write.policy.LayoutPolicy`:
            ``chunk_bytes``, ``slice_align``, ``column_slices``, ``group_small_tensors``).
        async_policy: what :meth:`publish_async` does when the store is slower than training
            (:class:`~deltastore.write.policy.AsyncPolicy`: ``mode``, ``max_pending``).
        compact: after each commit, write squashes to the new head in a background thread
            (:class:`~deltastore.lifecycle.compact.BackgroundCompactor`: the versions live
            workers hold, and the anchor every ``ANCHOR_SQUASH_EVERY`` versions; one run at a
            time). ``True`` or a :class:`~deltastore.lifecycle.compact.CompactPolicy`; default
            False (off). A failed compaction is logged and never fails a publish;
            :meth:`close` waits for the running one (bounded).
        formats: serving formats to publish each version in (SPEC §15), e.g.
            ``["bf16", "fp8-block128", "mxfp8"]`` (names or
            :class:`~deltastore.serving.formats.ServingFormat` values). Each is derived from the
            version's state and published as its own chain under ``streams/<format>/``,
            committed by the version's one HEAD write with the others; a format the state already
            is (``"bf16"`` for a bf16 state) is the version itself, not a second copy. Workers
            pick one with ``Subscriber(url, format=...)``. Default: none.
        metrics_port: serve Prometheus metrics of this publisher on this port
            (:mod:`deltastore.fleet.metrics`: the version committed, bytes published, commit
            times, errors, the :meth:`publish_async` queue's depth); needs ``prometheus-client``
            (``deltastore-weights[metrics]``; else MetricsUnavailableError). A port in use
            raises MetricsPortInUseError. None (default): no metrics.

    Raises:
        ValueError: ``dtype`` is not a floating dtype deltastore stores.
        UnknownFormatError: a format deltastore does not define (the message lists them).
        TypeError: a policy argument is not of its policy class, or ``compact`` is neither a
            bool nor a CompactPolicy.
        UnsupportedURLError, BucketNotFoundError, AccessDeniedError: from opening the store.
        UnsafeStoreError: the endpoint does not honour conditional writes (the message says
            what it did); ``WriterPolicy(allow_unsafe_store=True)`` if this is the only writer.
        FencedError: ``takeover`` lost a race with another publisher claiming the store.
        CommitUnknownError: the claim's HEAD write failed and HEAD could not be read back.
        SigningRequiredError: no ``signing_key`` and the store's head version is signed
            (``WriterPolicy(allow_unsigned=True)`` publishes anyway); nothing was written.

    Example::

        with Publisher("file:///tmp/run1") as pub:
            info = pub.publish(model.state_dict(), step=0)
            print(info.version, info.kind)

        with Publisher("s3://bucket/run2", dtype=torch.bfloat16,  # fp32 masters
                       anchor_policy=AnchorPolicy(every=50), async_policy=AsyncPolicy("latest")) as pub:
            for step in range(steps):
                train_step()
                pub.publish_async(model.state_dict(), step=step)  # returns after the snapshot
        # leaving the block published every queued step (or raised the failure)
    """

    #: Internal test hook (design 011 D10), not an API: tensor name → the TensorSpec a new
    #: layout uses for it instead of the layout policy's choice, e.g. a column grid for
    #: tensors ``column_slices`` would not grid (golden stores of small grids). Set on an
    #: instance before its first publish; see :meth:`LayoutPolicy.units`.
    _explicit_specs: Mapping[str, TensorSpec] | None = None

    def __init__(
        self,
        url: str,
        *,
        store: Store | None = None,
        storage_options: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        signing_key: Any = None,
        writer_policy: WriterPolicy = WriterPolicy(),
        anchor_policy: AnchorPolicy = AnchorPolicy(),
        layout_policy: LayoutPolicy = LayoutPolicy(),
        async_policy: AsyncPolicy = AsyncPolicy(),
        compact: bool | CompactPolicy = False,
        formats: Sequence[str | ServingFormat] = (),
        metrics_port: int | None = None,
    ):
        check_dtype(dtype)
        self.formats = serving_formats(formats)  # an unknown format fails before any IO
        check_policy(writer_policy, WriterPolicy, "writer_policy")
        check_policy(anchor_policy, AnchorPolicy, "anchor_policy")
        check_policy(layout_policy, LayoutPolicy, "layout_policy")
        check_policy(async_policy, AsyncPolicy, "async_policy")
        key = None
        if signing_key is not None:
            from deltastore.format.signing import load_private_key

            key = load_private_key(signing_key)  # a bad key fails before any IO
        self.writer_policy = writer_policy
        self.anchor_policy = anchor_policy
        self.layout_policy = layout_policy
        self.async_policy = async_policy
        self.dtype = dtype
        self.store = store if store is not None else open_store(url, storage_options=dict(storage_options or {}))
        self._owns_store = store is None  # a store passed in belongs to the caller
        try:
            # A store that ignores If-None-Match/If-Match (rclone serve s3, old MinIO) would let
            # two publishers fork history: probe it (the verdict cached in the store) before any write.
            require_atomic_writes(self.store, allow_unsafe_store=writer_policy.allow_unsafe_store)
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self.url = self.store.url
        self.writer_id = writer_policy.writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.threads = writer_policy.threads or default_threads()
        self._queue: PublishQueue | None = None  # started by the first publish_async
        # One commit at a time: the caller's publish() and the queue's thread share the state below.
        self._commit_lock = threading.Lock()
        # The layout of the newest state accepted (committed or queued), to refuse a layout
        # change without anchor=True in the caller's thread; None until one is known.
        self._accepted_layout: dict[str, tuple[str, tuple[int, ...]]] | None = None
        # The specs whose state's layout ``_accepted_layout`` is (set by a synchronous commit):
        # a later commit that kept those specs had a state of the same layout, so it need not
        # build the dict again (costly at tens of thousands of tensors). None after publish_async sets it.
        self._accepted_specs: dict[str, TensorSpec] | None = None
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-encode")
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-upload")
        self._layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across versions
        # The last committed state as this publisher wrote it (None until its first commit),
        # with the bit views encode_version made of its tensors (see the property below).
        self._reference = None
        self._specs: dict[str, TensorSpec] | None = None
        #: the layout object of ``_specs`` once committed (rebuilding it validates every row and
        #: group member again, per publish)
        self._layout: Layout | None = None
        self._closed = False
        self._compactor: BackgroundCompactor | None = None
        self._metrics: PublisherExport | None = None
        self._chain = VersionChain(self.store, self.writer_id, anchors=anchor_policy,
                                   max_attempt_s=writer_policy.max_attempt_s, signing_key=key,
                                   allow_unsigned=writer_policy.allow_unsigned)
        self._streams = {f.name: StreamWriter(self.store, f, writer_id=self.writer_id, anchors=anchor_policy,
                                              max_attempt_s=writer_policy.max_attempt_s, signing_key=key,
                                              layout_policy=layout_policy) for f in self.formats}
        self._history = self._chain.history
        try:
            self._chain.open(takeover=writer_policy.takeover)
        except BaseException:
            self.close()
            raise
        if compact is not False:
            from deltastore.lifecycle.compact import BackgroundCompactor, CompactPolicy

            policy = CompactPolicy() if compact is True else compact
            if not isinstance(policy, CompactPolicy):
                self.close()
                raise TypeError(f"compact must be a bool or a CompactPolicy, got {compact!r}")
            self._compactor = BackgroundCompactor(self.store, policy, writer=f"{self.writer_id}-compactor")
        if metrics_port is not None:  # deltastore.fleet.metrics; a taken port fails here
            from deltastore.fleet.metrics import PublisherExport

            try:
                self._metrics = PublisherExport(self.url, metrics_port, lambda: self.pending)
            except BaseException:
                self.close()
                raise

    # --- public API ---------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Snapshots queued by :meth:`publish_async` and not yet committed (the one being committed included)."""
        return 0 if self._queue is None else self._queue.pending

    @property
    def version(self) -> int:
        """The latest version this publisher knows to be committed (0 for an empty store)."""
        return self._chain.version

    @property
    def epoch(self) -> int:
        """This publisher's epoch (SPEC §4): a takeover raises it above every older publisher's."""
        return self._chain.epoch

    @property
    def _head(self) -> Head | None:
        return self._chain.head

    @property
    def _reference(self) -> dict[str, torch.Tensor] | None:
        """The last committed state as this publisher wrote it (None until its first commit)."""
        return self._held_reference

    @_reference.setter
    def _reference(self, value: dict[str, torch.Tensor] | None) -> None:
        # encode_version's bit views of the reference's tensors live with it: made once per
        # reference, not per publish (a view per tensor and its bookkeeping add up on models
        # of many tensors). A view holds its tensor's storage, so the views go whenever the
        # reference is replaced or dropped, in this one place.
        self._held_reference: dict[str, torch.Tensor] | None = value
        self._reference_bits: dict[str, np.ndarray] = {}

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        anchor: bool = False,
    ) -> VersionInfo:
        """Commit ``state_dict`` as the next version and return once it is visible.

        The tensors must not be modified while this call runs. The first version of a store is
        an anchor; a publisher opened on a store that has versions first reads the head back
        (``resume``) so that its first publish can be a delta. Earlier :meth:`publish_async`
        calls are committed first (this call waits for them), so versions keep call order.

        Args:
            state_dict: name → tensor, dense and contiguous; or an ``nn.Module``: its
                ``state_dict()`` with each tied memory once (``lm_head.weight`` tied to the
                embeddings is left out), the aliases recorded as ``metadata["tied_weights"]``
                (alias → published name), as the integrations publish a model.
            step: the trainer's step, recorded in the manifest.
            metadata: JSON-serializable user metadata.
            anchor: write a full snapshot; also the way to change the layout.

        Returns:
            The committed version's :class:`VersionInfo`.

        Raises:
            InvalidStateDictError: a value is not publishable.
            LayoutMismatchError: names/dtypes/shapes differ from the previous version and
                ``anchor`` is False.
            ConflictError: another writer committed first; nothing was committed.
            FencedError: a newer publisher took over the store.
            CommitUnknownError: HEAD was written but could not be read back, so whether this
                version committed is unknown; the next publish settles it first.
            CommitAbandonedError: the attempt ran past ``max_attempt_s`` before its HEAD write
                and was abandoned; nothing was committed. Publishing again is a new attempt.
            StorageError: the store failed; nothing was committed (HEAD is as it was).
            DeltastoreError: an earlier :meth:`publish_async` failed in the background and was
                not yet reported (raised once, instead of publishing this state).
        """
        state, meta, step = self._checked(state_dict, metadata, step)
        state = self._served(state)
        if self._queue is not None:
            self._queue.flush()  # earlier publish_async calls commit first: versions in call order
        return self._commit_locked(state, step=step, meta=meta, anchor=anchor, owned=False)

    def publish_async(
        self,
        state_dict: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        anchor: bool = False,
        copy: bool = True,
    ) -> Future[VersionInfo]:
        """Snapshot ``state_dict`` and commit it as a later version in the background.

        The state, ``step`` and ``metadata`` are checked here, in the caller's thread (bad
        input raises at once and nothing is queued). Then a host copy is taken in the served
        ``dtype`` (pinned memory and non-blocking copies for CUDA tensors) and queued; the call
        returns right after the copy, and the caller may modify its tensors at once. The
        version is published as by :meth:`publish`, after every earlier call, on the
        Publisher's background thread. Under ``async_policy="block"`` the call first waits
        while ``max_pending`` snapshots are waiting; under ``"latest"`` it never waits (see
        the class docstring).

        Args:
            state_dict, step, metadata, anchor: as for :meth:`publish`.
            copy: False hands ``state_dict`` over instead (a dict of CPU tensors, already in the
                served dtype, that the caller never touches again, e.g. one it assembled for
                this call): those are queued as they are, without a second host copy; any other
                tensor is still copied (cast).

        Returns:
            A Future of the committed version's :class:`VersionInfo`. It raises what the
            background commit raised (ConflictError, FencedError, StorageError, ...), or
            :class:`~deltastore.errors.VersionSkippedError` if a newer snapshot replaced this
            one under ``"latest"``.

        Raises:
            InvalidStateDictError: a value, ``step`` or ``metadata`` is not publishable.
            LayoutMismatchError: names/dtypes/shapes differ from the newest version published
                or queued and ``anchor`` is False.
            DeltastoreError: an earlier background publish failed and was not yet reported
                (raised once; this call's state is not queued).
            FencedError: a newer publisher took the store over (known from an earlier
                commit): this publisher can never commit again, so nothing is queued.
            StorageError: the publisher is closed.
        """
        state, meta, step = self._checked(state_dict, metadata, step)
        layout = self._check_accepted_layout(state, anchor)
        if self._chain.commits.fenced:  # permanent: say so now rather than snapshot and fail later
            self.flush()  # the background failure that found it is reported first (once)
            self._chain.commits.check_can_commit()
        if self._queue is None:
            self._queue = PublishQueue(
                self._publish_snapshot, self.async_policy, name=self.url, sticky=("anchor",),
            )
        take = (lambda: snapshot(state, self.dtype)) if copy else (lambda: handed_over(state, self.dtype))
        future = self._queue.submit_snapshot(take, step=step, meta=meta, anchor=anchor)
        self._accepted_layout, self._accepted_specs = layout, None
        return future

    def flush(self) -> None:
        """Wait until every :meth:`publish_async` call is committed (or failed).

        Raises:
            DeltastoreError: the first background failure not yet reported (once).
        """
        if self._queue is not None:
            self._queue.flush()

    def oldest_live_version(self, ttl_s: float = LIVE_TTL_S) -> int | None:
        """The lowest version held by a live worker of the fleet ledger (SPEC §10).

        A worker is live when its heartbeat reached the store within ``ttl_s`` seconds. Async
        RL bounds staleness with it (e.g. wait while ``version - oldest > k``). The ledger is
        advisory: workers that write no heartbeat are not counted.

        Returns:
            That version, or None when no worker is live.

        Raises:
            StorageError: the ledger could not be listed.
        """
        return oldest_live_version(read_ledger(self.store), ttl_s=ttl_s)

    # --- the commit path ----------------------------------------------------------------

    def _publish_snapshot(self, state: dict[str, torch.Tensor], *, step: int | None, meta: dict[str, Any],
                          anchor: bool) -> VersionInfo:
        """The queue's publish function: commit one snapshot (validated and cast already)."""
        return self._commit_locked(state, step=step, meta=meta, anchor=anchor, owned=True)

    def _commit_locked(self, state: dict[str, torch.Tensor], *, step: int | None, meta: dict[str, Any],
                       anchor: bool, owned: bool) -> VersionInfo:
        with self._commit_lock:
            t0 = time.perf_counter()
            try:
                with span("commit", url=self.url):
                    info = self._commit(state, step=step, meta=meta, anchor=anchor, owned=owned)
            except BaseException as e:
                if self._metrics is not None:
                    self._metrics.failed(e)
                raise
            if self._metrics is not None:
                self._metrics.committed(info, time.perf_counter() - t0)
            if not owned and self._accepted_specs is not self._specs:  # publish_async records it when it queues
                self._accepted_layout, self._accepted_specs = _layout_of(state), self._specs
            if self._compactor is not None:  # never blocks, never raises
                self._compactor.submit(info.version)
            return info

    def _commit(self, state: dict[str, torch.Tensor], *, step: int | None, meta: dict[str, Any],
                anchor: bool, owned: bool) -> VersionInfo:
        """Commit ``state`` (validated, in the served dtype) as the next version.

        ``owned``: ``state`` is a snapshot nobody else holds, so an anchor adopts its tensors
        as the reference copy instead of copying them.
        """
        chain = self._chain
        if chain.prepare():
            # HEAD moved since our last commit (an earlier unknown outcome turned out to have
            # landed, or another writer committed): resume from it (or write an anchor).
            self._reference = None
        tip = chain.tip()
        chain.require_key(tip)  # HEAD may have moved to a signed version since open
        head = chain.head
        if self._reference is None and self.writer_policy.resume and not anchor and head is not None and head.manifest:
            self._resume_from_head(state)

        same_layout = False
        if self._specs is not None:
            try:
                check_layout(self._specs, state, against=f"version {self.version} of {self.url}")
                same_layout = True
            except LayoutMismatchError:
                if not anchor:
                    raise
        has_base = same_layout and self._reference is not None
        # skip_unchanged: a delta finds "nothing changed" in the encode pass itself (no extra
        # pass over the model; checked below); only an anchor the policy asks for is compared
        # first, so that an unchanged state never uploads a snapshot.
        skippable = (self.writer_policy.skip_unchanged and has_base and not anchor and head is not None
                     and bool(head.manifest))
        version = self.version + 1
        why = chain.anchor_reason(version, tip, has_base=has_base, requested=anchor,
                                  no_base="no base" if self._specs is None or self._reference is None else "layout change")
        kind = "anchor" if why else "delta"
        if (skippable and kind == "anchor" and _identical(state, self._reference, self._specs)
                and chain.commits.head_is_current()):
            return self._unchanged()
        specs = self._specs if same_layout else self.layout_policy.units(state, self._explicit_specs)
        assert specs is not None
        if same_layout and self._layout is not None:
            layout = self._layout
        else:
            layout = layout_of(specs, schema=None)

        draft = chain.draft(version, kind, has_base=has_base, tip=tip)  # its attempt names every object (D1)
        built: list[StreamVersion] = []
        gathered: dict[str, torch.Tensor] = {}  # grid units' reference buffers, filled by an anchor's encode
        # what a delta changed, chunk by chunk: the serving streams derive their versions from it
        changes: dict[str, list[ChunkChange]] | None = (
            {} if self.formats and requant.ENABLED and kind == "delta" and has_base else None)
        # the format ``state`` itself is (no stream of its own), None: none declared is
        own = next((f.name for f in self.formats if is_identity(f, state)), None)
        change_lists: set[str] = set()
        sinks: dict[str, list[ChangeSink]] = {}
        derived = [w for n, w in self._streams.items() if n != own]
        if changes is not None:
            change_lists = set().union(*(w.change_lists(state) for w in derived))
            for w in derived:
                for name, sink in w.sinks(state, version, specs).items():
                    sinks.setdefault(name, []).append(sink)
        # an anchor's chunks of the tensors the streams keep as they are: their anchors take them
        anchors: dict[str, list[AnchorChunk]] | None = (
            {n: [] for n in set().union(*(w.kept(state) for w in derived))} if kind == "anchor" and derived else None)
        try:
            # The deadline runs from just before the attempt's first write (design 005 D3).
            deadline = attempt_clock() + self.writer_policy.max_attempt_s
            encoded = encode_version(
                state, specs, kind=kind, reference=self._reference if has_base else None,
                pool=self._pool, uploader=self._uploader, store=self.store, threads=self.threads,
                attempt=draft.attempt, reference_bits=self._reference_bits if has_base else None,
                gathered=gathered, layouts=self._layout_works, wait_stored=False, changes=changes,
                change_lists=change_lists, sinks=sinks, anchors=anchors,
            )
            # The manifest is built while the last packs are stored (encode_version handed them
            # to the uploader); nothing that names them is written before they are.
            try:
                if (skippable and kind == "delta" and not encoded.blobs and encoded.stats.elements_changed == 0
                        and chain.commits.head_is_current()):
                    # Nothing was written (no packs for an unchanged state), and HEAD is still the
                    # version the state equals (read: a publisher fenced or overtaken since must
                    # not report a version that is no longer the head; it commits and learns why).
                    encoded.wait_stored()  # no packs: returns at once
                    return self._unchanged()
                built = self._build_streams(state, own, version=version, kind=kind, draft=draft, head=head, tip=tip,
                                            step=step, meta=meta, changes=changes, anchors=anchors,
                                            has_base=has_base, specs=specs)
                served = {"streams": tuple(b.ref for b in built), "stream": own} if self.formats else {}
                layout_ref = chain.layout_ref(draft.attempt, layout, tip)
                header = chain.header(draft, layout, layout_ref, step=step, metadata=meta, stats=encoded.stats,
                                      blobs=encoded.blobs, tensors=encoded.entries, **served).with_layout(layout)
                manifest = chain.sign(header)
                sealed = chain.seal(manifest, encode_manifest(manifest, layout))
            except BaseException:
                with contextlib.suppress(Exception):  # the first failure is the one reported
                    encoded.wait_stored()
                raise
            encoded.wait_stored()
            superseded = chain.commit(draft, sealed, layout, deadline=deadline)
        except ConflictError:
            # Another writer's version is HEAD now: the next publish resumes from it.
            self._reference = None
            self._drop_streams()
            raise
        except BaseException:
            # Encoding advances the reference copy chunk by chunk (while the chunk is hot in
            # cache); without a commit it matches no version: drop it, so that the next publish
            # resumes from the store's head (or writes an anchor).
            if has_base:
                self._reference = None
            self._drop_streams()
            raise
        if not has_base:  # deltas advanced the reference while encoding
            # A new dict (the queue clears the snapshot's dict once this returns), per unit: a
            # group row is one buffer of its members' bits (design 007 D5).
            self._reference = unit_reference(state, specs, owned=owned, gathered=gathered)
        for b in built:
            self._streams[b.ref.format].landed(b, superseded=superseded, store_reference=self._reference)
        self._specs, self._layout = specs, layout
        if kind == "anchor":
            release_free_heap()  # the encode threads' chunk-sized buffers (deltastore._util.heap)
        if superseded:  # committed, but another writer is already on top: resume next time
            self._reference = None
        m = sealed.manifest
        logger.info(
            "published version %d (%s%s, step %s): %d bytes (%d delta, %d full; %d delta bytes since chain start %d), "
            "%d tensors / %d elements changed",
            version, kind, f": {why}" if why else "", step, m.stats.bytes_stored, m.stats.delta_bytes or 0,
            m.stats.full_bytes or 0, m.stats.cum_delta_bytes, m.chain_start, m.stats.tensors_changed,
            m.stats.elements_changed,
        )
        return VersionInfo.from_manifest(m, sealed.key)

    def _build_streams(self, state: dict[str, torch.Tensor], own: str | None, *, version: int, kind: str,
                       draft: Any, head: Head | None, tip: Any, step: int | None, meta: dict[str, Any],
                       changes: dict[str, list[ChunkChange]] | None,
                       anchors: dict[str, list[AnchorChunk]] | None, has_base: bool,
                       specs: dict[str, TensorSpec]) -> list[StreamVersion]:
        """Each declared format's version of ``state`` but ``own`` (the format ``state`` itself
        is), stored under the attempt and not yet committed (SPEC §15). ``changes``: what this
        delta version changed from the reference (the state of ``version - 1``), for the streams
        to derive from; ``anchors``: this anchor's chunks of the tensors they keep, encoded
        against the reference where ``has_base``; ``specs``: its layout."""
        if not self.formats:
            return []
        parents = {r.format: r for r in tip.streams} if tip is not None else {}
        built = []
        for f in self.formats:
            if f.name == own:
                continue
            built.append(self._streams[f.name].build(
                state, version=version, kind=kind, draft=draft, parent=head, parent_ref=parents.get(f.name),
                epoch=self.epoch,
                step=step, metadata=meta, pool=self._pool, uploader=self._uploader, threads=self.threads,
                resume=self.writer_policy.resume, changes=changes, store_specs=specs,
                store_reference=self._reference if changes is not None else None,
                anchors=anchors, store_has_base=has_base,
            ))
        return sorted(built, key=lambda b: b.ref.format)

    def _drop_streams(self) -> None:
        for w in self._streams.values():
            w.drop()

    def _unchanged(self) -> VersionInfo:
        """skip_unchanged: the head version, which the state equals; nothing is committed."""
        assert self._head is not None
        key, m = self._history.resolve(self._head.version, self._head)
        logger.info("state identical to version %d of %s: nothing committed (skip_unchanged)", m.version, self.url)
        return VersionInfo.from_manifest(m, key)

    def close(self) -> None:
        """Publish what :meth:`publish_async` queued, stop the threads, release the store.

        Idempotent. The threads and the store are released even when a failure is raised.

        Raises:
            DeltastoreError: a background failure not yet reported (once), after the cleanup.
        """
        self._close(raise_errors=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # With an exception already propagating, a background failure is logged, not raised:
        # raising here would replace the caller's exception.
        self._close(raise_errors=exc_type is None)

    def _close(self, *, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            if self._queue is not None:
                try:
                    self._queue.close(raise_errors=True)  # drains: every queued snapshot is published
                except BaseException as e:  # noqa: BLE001 - raised or logged below, after the cleanup
                    error = e
        finally:
            if self._compactor is not None:  # before the store closes under it
                self._compactor.close()
            if self._metrics is not None:
                self._metrics.close()
            self._pool.shutdown(wait=True)
            self._uploader.shutdown(wait=True)
            self._reference = None
            if self._owns_store:
                self.store.close()
        if error is not None:
            if raise_errors:
                raise error
            logger.error("closing the publisher of %s: a background publish failed (not raised: another "
                         "exception is propagating): %s", self.url, error)

    # --- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"publisher for {self.url} is closed")

    def _checked(self, state_dict: Any, metadata: Any, step: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], int | None]:
        """The caller's input validated before anything is queued or written."""
        self._check_open()
        meta = metadata_of(metadata)
        if isinstance(state_dict, torch.nn.Module):  # each tied memory once, its aliases recorded (deltastore.layout.tied)
            state_dict, tied = module_state(state_dict)
            if tied:
                meta[TIED_WEIGHTS_KEY] = tied
        return validate_state_dict(state_dict), meta, step_of(step)

    def _served(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with floating tensors cast to the served dtype (others as they are)."""
        if self.dtype is None:
            return state
        return {n: t.detach().to(self.dtype) if t.is_floating_point() else t for n, t in state.items()}

    def _check_accepted_layout(self, state: Mapping[str, torch.Tensor], anchor: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The served layout of ``state``; LayoutMismatchError if it differs from the newest
        accepted one and ``anchor`` is False (the background commit checks again)."""
        served = {
            n: torch.empty(t.shape, dtype=self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype, device="meta")
            for n, t in state.items()
        }
        layout = _layout_of(served)
        accepted = self._accepted_layout
        if accepted is not None and not anchor and layout != accepted:
            specs = {n: TensorSpec(n, dt, shape, 1) for n, (dt, shape) in accepted.items()}
            check_layout(specs, served, against=f"the newest version published or queued to {self.url}")
        return layout

    # --- resume -----------------------------------------------------------------------

    def _resume_from_head(self, state: dict[str, torch.Tensor]) -> None:
        """Rebuild the reference copy by pulling the head version, if its layout matches."""
        from deltastore.read.subscriber import Subscriber  # the read path: loaded only when a publisher resumes

        assert self._head is not None
        with Subscriber(self.url, store=self.store, threads=self.threads) as sub:
            reference = sub.pull(self._head.version)
            specs = sub.units()  # group rows stay rows: the chain continues their grouping
        try:
            check_layout(specs, state, against=f"version {self._head.version} of {self.url}")
        except LayoutMismatchError:
            logger.info("not resuming from version %d: its layout differs", self._head.version)
            self._specs, self._layout = specs, None  # so publish() reports the mismatch (or anchors, if asked)
            return
        # a grid tensor pulled in natural order is permuted into its unit order (design 011 D3)
        # and dropped at once: at most one extra tensor alive
        gathered = {n: unit_order(reference.pop(n), sp) for n, sp in specs.items() if sp.chunk_cols}
        self._reference = unit_reference(reference, specs, owned=True, gathered=gathered)
        self._specs, self._layout = specs, None
        logger.info("resumed from version %d of %s", self._head.version, self.url)


def _identical(state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
               specs: Mapping[str, TensorSpec] | None = None) -> bool:
    """True when both hold the same names, dtypes, shapes and bits (NaN payloads and -0.0
    included). A column-grid unit of ``specs`` (its reference in unit order, design 011 D3)
    is compared chunk by chunk: each gathered chunk against its reference span."""
    if state.keys() != reference.keys():
        return False
    for name, t in state.items():
        r = reference[name]
        spec = specs.get(name) if specs is not None else None
        if spec is not None and spec.chunk_cols:
            if t.dtype != r.dtype or tuple(t.shape) != spec.shape or r.numel() != spec.numel:
                return False
            new, old = _cpu_bits(t), bits(r)
            for i in range(spec.n_chunks):
                a, b = spec.chunk_span(i)
                if not np.array_equal(grid.gather(new, spec, i), old[a:b]):
                    return False
            continue
        if t.dtype != r.dtype or t.shape != r.shape:
            return False
        if not torch.equal(t.detach().to("cpu").reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)):
            return False
    return True


def _cpu_bits(t: torch.Tensor) -> np.ndarray:
    """The natural-order bits of ``t`` on the CPU (a view of a CPU tensor, else a copy)."""
    return bits(t.detach() if t.device.type == "cpu" else t.detach().to("cpu"))


def handed_over(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` handed over by its caller (publish_async(copy=False)): CPU tensors in the
    served dtype are kept as they are, the others copied as a snapshot would."""
    def ready(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and (dtype is None or not t.is_floating_point() or t.dtype == dtype)

    out = {n: t.detach() for n, t in state.items() if ready(t)}
    out.update(snapshot({n: t for n, t in state.items() if n not in out}, dtype))
    return {n: out[n] for n in state}


def _layout_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    names: dict[torch.dtype, str] = {}  # dtype_name once per dtype (20,000-tensor models)
    return {n: (names.get(t.dtype) or names.setdefault(t.dtype, dtype_name(t.dtype)), tuple(t.shape)) for n, t in state.items()}


def step_of(step: Any) -> int | None:
    """``step`` as an int (numpy and 0-d torch integers accepted), checked before any write."""
    if step is None:
        return None
    try:
        return operator.index(step)
    except TypeError:
        raise InvalidStateDictError(f"step must be an integer or None, got {step!r} ({type(step).__name__})") from None


def metadata_of(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as JSON (a new dict), checked before any write."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidStateDictError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidStateDictError(f"metadata is not JSON-serializable: {e}") from None
