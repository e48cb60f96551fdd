"""The commit path (SPEC §5): validate, choose anchor or delta, encode, write the manifest, CAS HEAD.

The :class:`Publisher` is thin: encoding a state into packs lives in :mod:`deltastore.write.encode`,
the HEAD protocol (claim, compare-and-swap, lost responses, fencing) in :mod:`deltastore.write.commit`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import operator
import os
import socket
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from deltastore.write.commit import CommitProtocol, attempt_clock, now, put_immutable
from deltastore.write.encode import UPLOADS_IN_FLIGHT, LayoutWorks, encode_version
from deltastore.errors import (
    ConflictError,
    InvalidStateDictError,
    LayoutMismatchError,
    NotFoundError,
    SigningRequiredError,
    StorageError,
)
from deltastore.layout import grid
from deltastore.layout.groups import GROUP_MEMBER_MAX_BYTES, group_specs, tied_names, unit_order, unit_reference
from deltastore._util.heap import release_free_heap
from deltastore.format.history import History, VersionInfo
from deltastore._util.jobs import default_threads
from deltastore.lifecycle.ledger import LIVE_TTL_S, oldest_live_version, read_ledger
from deltastore.format.keys import manifest_key, manifest_key_version, new_attempt_id, object_key, sha256_hex
from deltastore.format.manifest import encode_manifest
from deltastore.format.models import (
    DEFAULT_MAX_ATTEMPT_S,
    DTYPE_WIDTHS,
    GROUPS_SCHEMA,
    Head,
    Layout,
    Manifest,
    ObjectRef,
    layout_of,
)
from deltastore.format.objects import encode_object
from deltastore.write.queue import DEFAULT_MAX_PENDING, POLICIES, Policy, PublishQueue, snapshot
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.storage.probe import require_atomic_writes
from deltastore.layout.tensors import (
    CHUNK_TARGET_BYTES,
    SLICE_CHUNK_MIN_BYTES,
    TensorSpec,
    bits,
    check_layout,
    dtype_name,
    grid_spec_for,
    spec_for,
    validate_state_dict,
)
from deltastore.layout.tied import TIED_WEIGHTS_KEY, module_state

if TYPE_CHECKING:
    from deltastore.lifecycle.compact import BackgroundCompactor, CompactPolicy

logger = logging.getLogger(__name__)

#: ``anchor_policy="every"``: a full snapshot every this many versions bounds how much history
#: a new worker replays (the policy before schema 3, and still the CLI's).
DEFAULT_ANCHOR_EVERY = 20
#: ``anchor_policy="cost"`` (design 005 D7): an anchor once the delta bytes written since the
#: last anchor reach this multiple of its full bytes. At 1 (ski rental) a new worker reads at
#: most twice an anchor's bytes and anchors are at most half of the bytes written.
DEFAULT_ANCHOR_COST_RATIO = 1.0
#: Manifests whose skip-pointer links (key, parent key, ``back``) the publisher keeps: the
#: ``back`` list of version v is derived from those of v−1, v−2, v−4, … (design 005 D6), so
#: the recent ones are read from memory and only older levels cost a manifest read.
LINK_CACHE_ENTRIES = 64
#: group_small_tensors="auto" groups a layout with at least this many small tensors: below it,
#: per-tensor costs (~20-60 µs each per publish and pull) add well under 0.1 s per version,
#: and the store stays schema 3 (readable by older releases); MoE experts and per-layer norms
#: of large models run to thousands, where groups cut publish and pull 10-40× (design 007).
GROUP_AUTO_MIN_TENSORS = 1000

AnchorPolicy = Literal["cost", "every"]
ANCHOR_POLICIES: tuple[str, ...] = ("cost", "every")


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
    ``async_policy`` decides:

    - ``"block"`` (default): at most ``max_pending`` snapshots wait behind the one being
      published; a further ``publish_async`` blocks (before copying anything) until one starts.
      Every call is published.
    - ``"latest"``: ``publish_async`` never waits; a newer snapshot replaces the newest one still
      waiting, which is never published (its Future raises
      :class:`~deltastore.errors.VersionSkippedError`; an ``anchor=True`` request passes on to
      the snapshot that replaced it). The one being published is never replaced.

    Either way at most ``max_pending + 1`` snapshots are alive at once (plus the reference
    copy). A background failure (ConflictError, FencedError, StorageError,
    CommitUnknownError, ...) resolves that call's Future with the error, and the next
    :meth:`publish_async`, :meth:`publish`, :meth:`flush` or :meth:`close` raises it, once:
    a failure is never lost. :meth:`publish` first waits for every queued publish, so
    versions stay in call order. Call one Publisher from one thread.

    Args:
        url: store URL (a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``, or
            another fsspec URL — those lack atomic commit, see docs/SPEC.md).
        storage_options: passed to the storage backend (endpoint, credentials, ...).
        anchor_policy: when a version is written as an anchor (a full snapshot) besides the
            first version, a layout change, a version without a base and ``anchor=True``:
            ``"cost"`` (design 005 D7) once the delta bytes written since the last anchor
            reach ``anchor_cost_ratio`` × that anchor's full bytes; ``"every"`` every
            ``anchor_every`` versions (the policy before schema 3). Default: ``"every"`` when
            ``anchor_every`` is passed (callers that set a cadence keep it), else ``"cost"``.
        anchor_cost_ratio: β of the cost policy (default 1.0), > 0.
        anchor_every: under ``"every"``, the cadence (default 20); under ``"cost"``, an optional
            cap: an anchor at the latest after this many versions (default None: no cap).
        max_attempt_s: the attempt deadline (design 005 D3): a commit attempt whose HEAD write
            would be sent more than this many seconds after its first upload (on a clock that counts
            suspended time, :func:`deltastore.write.commit.attempt_clock`)
            is abandoned with CommitAbandonedError, since GC may have collected its objects.
            At most 6 h (the GC grace period must exceed it; default 6 h).
        takeover: claim the store on open, fencing any older publisher (default True); an
            empty store is claimed too (HEAD at version 0 without a manifest).
        writer_id: id recorded in manifests and HEAD (default ``host-pid-random``).
        threads: encode threads (default: all cores).
        chunk_bytes: target chunk size for new layouts (default 16 MiB).
        slice_align: lay new layouts out for tensor-parallel readers of degree N dividing this
            (e.g. :data:`deltastore.layout.tensors.SLICE_ALIGN` = 8 for N = 1, 2, 4, 8): chunk edges
            fall on every 1/slice_align of a tensor's rows where they fit, so a partial
            Subscriber holding rows r/N reads about its share instead of whole 16 MiB chunks
            (docs/scale.md §5). It costs more, smaller chunks (per-chunk work, manifest size).
            Default None: chunks of about ``chunk_bytes``. A resumed layout keeps its chunks.
        column_slices: fnmatch patterns of the tensors tensor-parallel readers cut by columns
            (dimension 1), e.g. :data:`deltastore.layout.select.ROW_PARALLEL`; needs ``slice_align``
            (the degree N; ValueError without it). Each matched tensor of a new layout gets a
            column grid (design 011, SPEC §2): chunks of ``C/N`` columns (when N divides C),
            so a rank reading its columns reads only its own chunks. Not gridded (one INFO
            line names them): tensors of fewer than 2 dimensions or N columns, of at most
            N × 32 KiB, tied tensors; gridded tensors are never grouped. A whole reader pays
            about one extra copy of the gridded tensors per publish and two per ``pull_into``
            (design 011 D8; measured: +8 % delta publish and +22 % ``pull_into`` on a 531 MB
            Llama-shaped model, ×3.3 ``pull_into`` of the gridded tensors at 8B shapes), so it
            is opt-in. A layout choice: a resumed publisher keeps the
            store's grid; open it with ``resume=False`` to switch (an anchor with the new
            layout). Default None: no grid.
        group_small_tensors: pack small tensors (≤ 256 KiB) of one dtype into shared ~4 MiB
            rows of new layouts (design 007): per-segment and per-entry costs are then paid per
            4 MiB, not per tensor (20,000 norms publish and pull ~10-40× faster). A store with
            groups is schema 4, which releases before it do not read (they refuse it: "upgrade
            deltastore"). ``"auto"`` (default): group only a layout with at least
            :data:`GROUP_AUTO_MIN_TENSORS` small tensors, where it pays; a typical transformer
            has far fewer and stays schema 3. True: always; False: never (schema 3).
            A resumed publisher continues the grouping of the version it resumes from until a
            layout change.
        allow_unsafe_store: publish to a store without atomic conditional writes (this
            publisher promises to be the only writer); otherwise an ``s3://`` endpoint is probed
            for If-None-Match/If-Match support (cached in ``_deltastore/probe.json`` for the
            endpoint that earned it, docs/SPEC.md §1.1).
        resume: when the store already has versions and this publisher holds none (a restart,
            a CLI call, or after a ConflictError), read the head version back once so the next
            publish is a delta against it rather than a full anchor (default True).
        store: an already opened :class:`~deltastore.storage.Store` to use instead of ``url``
            (the caller keeps ownership: it is not closed by :meth:`close`).
        signing_key: an Ed25519 private key (a ``cryptography`` key object, PEM bytes or a
            PEM file path) to sign every manifest with (SPEC §3.1; ``deltastore-weights[signing]``).
        allow_unsigned: without ``signing_key``, publish onto a store whose head version is
            signed (default False: SigningRequiredError, checked on open before the claim and
            before each version, nothing written). Subscribers that trust the store's key
            refuse the unsigned versions (UnsignedVersionError).
        dtype: the served dtype of floating tensors (e.g. ``torch.bfloat16`` from fp32
            masters), for :meth:`publish` and :meth:`publish_async` alike; None (default)
            keeps each tensor's dtype. Integer and bool tensors always keep theirs.
        async_policy: ``"block"`` or ``"latest"``, what :meth:`publish_async` does when the
            store is slower than training (above).
        max_pending: snapshots that may wait behind the one being published (≥ 1; default 1:
            encoding step n overlaps training step n+1 with two snapshots alive).
        compact: after each commit, write squashes to the new head in a background thread
            (:class:`~deltastore.lifecycle.compact.BackgroundCompactor`: the versions live workers hold,
            and the anchor every ``ANCHOR_SQUASH_EVERY`` versions; one run at a time, heads
            that land meanwhile coalesced into one run to the newest). ``True`` or a
            :class:`~deltastore.lifecycle.compact.CompactPolicy`; default False (off). A failed
            compaction is logged and never fails a publish; :meth:`close` waits for the
            running one (bounded).
        skip_unchanged: a state bit-identical to the head version this publisher holds is not
            committed again (default True): no new version, no worker woken for nothing;
            :meth:`publish` returns the head's :class:`VersionInfo` (its ``version`` is the
            current one, not +1) and logs it. ``step`` and ``metadata`` alone do not make a
            new version. False: every call commits (an empty delta). ``anchor=True`` always
            commits.

    Raises:
        UnsupportedURLError, BucketNotFoundError, AccessDeniedError: from opening the store.
        UnsafeStoreError: the endpoint does not honour conditional writes (the message says
            what it did); pass ``allow_unsafe_store=True`` if this is the only writer.
        FencedError: ``takeover=True`` lost a race with another publisher claiming the store.
        CommitUnknownError: the claim's HEAD write failed and HEAD could not be read back.
        SigningRequiredError: no ``signing_key`` and the store's head version is signed
            (``allow_unsigned=True`` publishes anyway); nothing was written.

    Example::

        with Publisher("file:///tmp/run1") as pub:
            info = pub.publish(model.state_dict(), step=0)
            print(info.version, info.kind)

        with Publisher("s3://bucket/run2", dtype=torch.bfloat16) as pub:  # fp32 masters
            for step in range(steps):
                train_step()
                pub.publish_async(model.state_dict(), step=step)  # returns after the snapshot
        # leaving the block published every queued step (or raised the failure)
    """

    #: Internal test hook (design 011 D10 step 3), not an API: tensor name → the TensorSpec a new
    #: layout uses for it instead of the writer's choice, e.g. a column grid
    #: (``chunk_cols`` > 0) for tensors the public policy would not grid. Set on an instance
    #: before its first publish; each spec must have the tensor's dtype and shape. A spec with
    #: a grid is never grouped. Replaced by ``column_slices`` (D10 step 4).
    _explicit_specs: Mapping[str, TensorSpec] | None = None

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        anchor_every: int | None = None,
        takeover: bool = True,
        writer_id: str | None = None,
        threads: int | None = None,
        chunk_bytes: int = CHUNK_TARGET_BYTES,
        slice_align: int | None = None,
        allow_unsafe_store: bool = False,
        resume: bool = True,
        store: Store | None = None,
        signing_key: Any = None,
        allow_unsigned: bool = False,
        dtype: torch.dtype | None = None,
        async_policy: Policy = "block",
        max_pending: int = DEFAULT_MAX_PENDING,
        anchor_policy: AnchorPolicy | None = None,
        anchor_cost_ratio: float = DEFAULT_ANCHOR_COST_RATIO,
        max_attempt_s: float = DEFAULT_MAX_ATTEMPT_S,
        compact: bool | CompactPolicy = False,
        group_small_tensors: bool | Literal["auto"] = "auto",
        skip_unchanged: bool = True,
        column_slices: Sequence[str] | None = None,
    ):
        if anchor_policy is None:
            anchor_policy = "every" if anchor_every is not None else "cost"
        if anchor_policy not in ANCHOR_POLICIES:
            raise ValueError(f"anchor_policy must be one of {ANCHOR_POLICIES}, got {anchor_policy!r}")
        if anchor_policy == "every" and anchor_every is None:
            anchor_every = DEFAULT_ANCHOR_EVERY
        if anchor_every is not None and anchor_every < 1:
            raise ValueError(f"anchor_every must be ≥ 1, got {anchor_every}")
        if not (isinstance(anchor_cost_ratio, (int, float)) and math.isfinite(anchor_cost_ratio) and anchor_cost_ratio > 0):
            raise ValueError(f"anchor_cost_ratio must be a finite number > 0, got {anchor_cost_ratio!r}")
        if not (isinstance(max_attempt_s, (int, float)) and 0 < max_attempt_s <= DEFAULT_MAX_ATTEMPT_S):
            # GC's grace period (default 24 h) must exceed every writer's deadline by a clock
            # margin (design 005 D3); a publisher cannot know the grace, so it stays ≤ 6 h.
            raise ValueError(f"max_attempt_s must be in (0, {DEFAULT_MAX_ATTEMPT_S}] seconds, got {max_attempt_s!r}")
        if dtype is not None and not (
            isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype_name(dtype) in DTYPE_WIDTHS
        ):
            raise ValueError(f"dtype must be a floating torch.dtype deltastore stores (e.g. torch.bfloat16) or None, got {dtype!r}")
        if async_policy not in POLICIES:
            raise ValueError(f"async_policy must be one of {POLICIES}, got {async_policy!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be ≥ 1, got {max_pending}")
        self._signing_key = None
        if signing_key is not None:
            from deltastore.format.signing import load_private_key

            self._signing_key = load_private_key(signing_key)  # a bad key fails before any IO
        self.allow_unsigned = allow_unsigned
        self.store = store if store is not None else open_store(url, storage_options=dict(storage_options or {}))
        self._owns_store = store is None  # a store passed in belongs to the caller
        try:
            # A store that ignores If-None-Match/If-Match (rclone serve s3, old MinIO) would let
            # two publishers fork history: probe it (the verdict cached in the store) before any write.
            require_atomic_writes(self.store, allow_unsafe_store=allow_unsafe_store)
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self.url = self.store.url
        self.anchor_policy: AnchorPolicy = anchor_policy
        self.anchor_every = anchor_every
        self.anchor_cost_ratio = float(anchor_cost_ratio)
        self.max_attempt_s = max_attempt_s
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.threads = threads or default_threads()
        self.chunk_bytes = chunk_bytes
        if slice_align is not None and (isinstance(slice_align, bool) or not isinstance(slice_align, int) or slice_align < 1):
            raise ValueError(f"slice_align must be an int ≥ 1 or None, got {slice_align!r}")
        self.slice_align = slice_align
        if column_slices is not None:
            if isinstance(column_slices, str) or not all(isinstance(p, str) for p in column_slices):
                raise ValueError(f"column_slices must be a sequence of fnmatch patterns, got {column_slices!r}")
            if slice_align is None:
                raise ValueError("column_slices needs slice_align: the tensor-parallel degree (e.g. slice_align=8)")
        self.column_slices: tuple[str, ...] = tuple(column_slices or ())
        if group_small_tensors not in (True, False, "auto"):
            raise ValueError(f'group_small_tensors must be True, False or "auto", got {group_small_tensors!r}')
        self.group_small_tensors = group_small_tensors
        self.resume = resume
        self.skip_unchanged = skip_unchanged
        self.dtype = dtype
        self.async_policy = async_policy
        self.max_pending = max_pending
        self._queue: PublishQueue | None = None  # started by the first publish_async
        # One commit at a time: the caller's publish() and the queue's thread share the state below.
        self._commit_lock = threading.Lock()
        # The layout of the newest state accepted (committed or queued), to refuse a layout
        # change without anchor=True in the caller's thread; None until one is known.
        self._accepted_layout: dict[str, tuple[str, tuple[int, ...]]] | None = None
        # The specs whose state's layout ``_accepted_layout`` is (set by a synchronous commit):
        # a later commit that kept those specs had a state of the same layout, so it need not
        # build the dict again (~30 ms at 20,000 tensors). None after publish_async sets it.
        self._accepted_specs: dict[str, TensorSpec] | None = None
        self._history = History(self.store)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-encode")
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-upload")
        self._layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across versions
        # The last committed state as this publisher wrote it (None until its first commit),
        # with the bit views encode_version made of its tensors (see the property below).
        self._reference = None
        self._specs: dict[str, TensorSpec] | None = None
        #: the layout object of ``_specs`` once committed (rebuilding it validates every row and
        #: group member again: ~0.2 s per publish at 20,000 tensors)
        self._layout: Layout | None = None
        self._anchor_version = 0
        # What the next version needs of the version it builds on (schema-3 fields), and the
        # skip-pointer links of recent manifests (bounded).
        self._tip: _Tip | None = None
        self._links: dict[str, _Link] = {}
        self._closed = False
        self._compactor: BackgroundCompactor | None = None

        self._commits = CommitProtocol(self.store, self._history, self.writer_id)
        try:
            self._commits.open(takeover=False)
            if self._signing_key is None and not allow_unsigned:
                # before the claim writes HEAD, so that a refusal writes nothing (the tip read
                # here is the one the first publish needs: read once)
                self._require_key_for(self._current_tip())
            if takeover:
                self._commits.claim()
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

    # --- public API ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest version this publisher knows to be committed (0 for an empty store)."""
        return self._commits.version

    @property
    def epoch(self) -> int:
        """This publisher's epoch (SPEC §4): a takeover raises it above every older publisher's."""
        return self._commits.epoch

    @property
    def _head(self) -> Head | None:
        return self._commits.head

    @property
    def _reference(self) -> dict[str, torch.Tensor] | None:
        """The last committed state as this publisher wrote it (None until its first commit)."""
        return self._held_reference

    @_reference.setter
    def _reference(self, value: dict[str, torch.Tensor] | None) -> None:
        # encode_version's bit views of the reference's tensors live with it: made once per
        # reference, not per publish (tf265m: 165 views, ~1,000 torch calls and ~500 objects
        # for the cyclic collector each time). A view holds its tensor's storage, so the views
        # go whenever the reference is replaced or dropped, in this one place.
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
        if self._commits.fenced:  # permanent: say so now rather than snapshot and fail later
            self.flush()  # the background failure that found it is reported first (once)
            self._commits.check_can_commit()
        if self._queue is None:
            self._queue = PublishQueue(
                self._publish_snapshot, policy=self.async_policy, max_pending=self.max_pending,
                name=self.url, sticky=("anchor",),
            )
        take = (lambda: snapshot(state, self.dtype)) if copy else (lambda: _handed_over(state, self.dtype))
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
            info = self._commit(state, step=step, meta=meta, anchor=anchor, owned=owned)
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
        if self._commits.prepare():
            # HEAD moved since our last commit (an earlier unknown outcome turned out to have
            # landed, or another writer committed): resume from it (or write an anchor).
            self._reference = None
        self._require_key_for(self._current_tip())  # HEAD may have moved to a signed version since open
        if self._reference is None and self.resume and not anchor and self._head is not None and self._head.manifest:
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
        skippable = self.skip_unchanged and has_base and not anchor and self._head is not None and bool(self._head.manifest)
        version = self.version + 1
        tip = self._current_tip()
        why = self._anchor_reason(version, tip, has_base=has_base, anchor=anchor)
        kind = "anchor" if why else "delta"
        if (skippable and kind == "anchor" and _identical(state, self._reference, self._specs)
                and self._commits.head_is_current()):
            return self._unchanged()
        assert kind == "anchor" or (tip is not None and tip.schema3)  # a delta continues a schema-3 chain
        specs = self._specs if same_layout else self._new_specs(state)
        assert specs is not None
        if same_layout and self._layout is not None:
            layout = self._layout
        else:
            grouped = any(s.members for s in specs.values())
            layout = layout_of(specs, schema=GROUPS_SCHEMA if grouped else 3)

        lineage = self._commits.lineage_for_commit()
        attempt = new_attempt_id()  # the commit id: every object of this attempt is under it (D1)
        gathered: dict[str, torch.Tensor] = {}  # grid units' reference buffers, filled by an anchor's encode
        try:
            # The deadline runs from just before the attempt's first write (design 005 D3).
            deadline = attempt_clock() + self.max_attempt_s
            encoded = encode_version(
                state, specs, kind=kind, reference=self._reference if has_base else None,
                pool=self._pool, uploader=self._uploader, store=self.store, threads=self.threads,
                attempt=attempt, reference_bits=self._reference_bits if has_base else None,
                gathered=gathered, layouts=self._layout_works, wait_stored=False,
            )
            # The manifest is built while the last packs are stored (encode_version handed them
            # to the uploader); nothing that names them is written before they are.
            try:
                if (skippable and kind == "delta" and not encoded.blobs and encoded.stats.elements_changed == 0
                        and self._commits.head_is_current()):
                    # Nothing was written (no packs for an unchanged state), and HEAD is still the
                    # version the state equals (read: a publisher fenced or overtaken since must
                    # not report a version that is no longer the head; it commits and learns why).
                    encoded.wait_stored()  # no packs: returns at once
                    return self._unchanged()
                if tip is not None and tip.layout is not None and tip.layout == layout:
                    layout_ref = tip.layout_ref
                else:  # a new layout, or the first schema-3 version of this chain
                    layout_ref = self._write_layout(attempt, layout)
                assert layout_ref is not None
                delta_bytes = encoded.stats.delta_bytes or 0
                # The chain of composable deltas restarts at a version without a base, and at the
                # first schema-3 version (cum_delta_bytes and back start there: design 005 D10).
                restart = not has_base or tip is None or not tip.schema3
                chain_start = version if restart else tip.chain_start
                cum = 0 if restart else tip.cum + delta_bytes
                parent_key = self._head.manifest if self._head else None
                manifest = Manifest(
                    schema=layout.schema_,
                    version=version,
                    parent=self._head.version if self._head and self._head.version else None,
                    parent_manifest=parent_key,
                    kind=kind,
                    anchor=version if kind == "anchor" else tip.anchor,
                    delta_base=self._head.version if has_base and self._head else None,
                    step=step,
                    created=now(),
                    writer=self.writer_id,
                    epoch=self.epoch,
                    commit_id=attempt,
                    metadata=meta,
                    blobs=encoded.blobs,
                    tensors=encoded.entries,
                    stats=encoded.stats.model_copy(update={"cum_delta_bytes": cum}),
                    lineage=lineage,
                    anchor_manifest=None if kind == "anchor" else tip.anchor_key,
                    back=self._back_for(version, parent_key),
                    chain_start=chain_start,
                    layout=layout_ref,
                    max_attempt_s=math.ceil(self.max_attempt_s),
                ).with_layout(layout)
                if self._signing_key is not None:
                    from deltastore.format.signing import sign_manifest

                    manifest = sign_manifest(manifest, self._signing_key)
                data = encode_manifest(manifest, layout)
                digest = sha256_hex(data)
                mkey = manifest_key(version, digest)
            except BaseException:
                with contextlib.suppress(Exception):  # the first failure is the one reported
                    encoded.wait_stored()
                raise
            encoded.wait_stored()
            put_immutable(self.store, mkey, data, "manifest")
            self._commits.commit(Head(
                version=version,
                manifest=mkey,
                manifest_sha256=digest,
                commit_id=manifest.commit_id,
                writer=self.writer_id,
                epoch=self.epoch,
                updated=manifest.created,
                lineage=lineage,
                # HEAD's history index (GC's floor and pins, squashes) is carried over; a
                # rebase in commit() picks up a newer one (design 005 D4)
                index=self._head.index if self._head else None,
            ), deadline=deadline)
        except ConflictError:
            # Another writer's version is HEAD now: the next publish resumes from it.
            self._reference = None
            raise
        except BaseException:
            # Encoding advances the reference copy chunk by chunk (while the chunk is hot in
            # cache); without a commit it matches no version: drop it, so that the next publish
            # resumes from the store's head (or writes an anchor).
            if has_base:
                self._reference = None
            raise
        if not has_base:  # deltas advanced the reference while encoding
            # A new dict (the queue clears the snapshot's dict once this returns), per unit: a
            # group row is one buffer of its members' bits (design 007 D5).
            self._reference = unit_reference(state, specs, owned=owned, gathered=gathered)
        self._specs, self._layout = specs, layout
        if kind == "anchor":
            self._anchor_version = version
            release_free_heap()  # the encode threads' chunk-sized buffers (deltastore._util.heap)
        self._remember(mkey, manifest)
        full_bytes = encoded.stats.full_bytes or 0
        self._tip = _Tip(
            version=version, key=mkey, schema3=True, chain_start=chain_start, cum=cum, layout=layout,
            layout_ref=layout_ref, anchor=manifest.anchor,
            anchor_key=mkey if kind == "anchor" else tip.anchor_key,
            anchor_full=full_bytes if kind == "anchor" else tip.anchor_full,
            anchor_cum=cum if kind == "anchor" else tip.anchor_cum,
            signed_by=None if manifest.signature is None else manifest.signature.key_id,
        )
        if self._commits.superseded:  # committed, but another writer is already on top: resume next time
            self._reference, self._commits.superseded = None, False
        info = VersionInfo.from_manifest(manifest, mkey)
        logger.info(
            "published version %d (%s%s, step %s): %d bytes (%d delta, %d full; %d delta bytes since chain start %d), "
            "%d tensors / %d elements changed",
            version, kind, f": {why}" if why else "", step, encoded.stats.bytes_stored, delta_bytes, full_bytes, cum,
            chain_start, encoded.stats.tensors_changed, encoded.stats.elements_changed,
        )
        return info

    # --- schema-3 fields: anchors, layout, skip pointers ----------------------------------

    def _unchanged(self) -> VersionInfo:
        """skip_unchanged: the head version, which the state equals; nothing is committed."""
        assert self._head is not None
        key, m = self._history.resolve(self._head.version, self._head)
        logger.info("state identical to version %d of %s: nothing committed (skip_unchanged)", m.version, self.url)
        return VersionInfo.from_manifest(m, key)

    def _anchor_reason(self, version: int, tip: _Tip | None, *, has_base: bool, anchor: bool,
                       anchor_version: int | None = None) -> str | None:
        """Why ``version`` must be an anchor (None: it is a delta), design 005 D7 / D10.
        ``anchor_version``: the last anchor's version, when not this publisher's (a sharded
        plan made ahead of a commit, design 010 D10)."""
        if anchor_version is None:
            anchor_version = self._anchor_version
        if anchor:
            return "requested"
        if not has_base:
            return "no base" if self._specs is None or self._reference is None else "layout change"
        if tip is None or not tip.schema3:
            return "first schema-3 version"  # every schema-3 anchor span is homogeneous (D10)
        if self.anchor_every is not None and version - anchor_version >= self.anchor_every:
            return f"every {self.anchor_every} versions"
        if self.anchor_policy == "cost":
            since = tip.cum - tip.anchor_cum  # delta bytes written since the anchor (C)
            if since > 0 and since >= self.anchor_cost_ratio * tip.anchor_full:
                return f"{since} delta bytes since anchor {tip.anchor} ≥ {self.anchor_cost_ratio:g} × its {tip.anchor_full} full bytes"
        return None

    def _new_specs(self, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """The units of a new layout: a spec per tensor, small ones grouped if asked (design 007)."""
        specs = {n: spec_for(n, t, self.chunk_bytes, self.slice_align) for n, t in state.items()}
        gridded: frozenset[str] = frozenset()
        if self.column_slices:
            specs.update(self._grid_specs(state))
            gridded = frozenset(n for n, sp in specs.items() if sp.chunk_cols)
        if self._explicit_specs:  # the internal test hook above
            for n, sp in self._explicit_specs.items():
                if n in specs:
                    if (sp.name, sp.dtype, sp.shape) != (n, specs[n].dtype, specs[n].shape):
                        raise ValueError(f"_explicit_specs[{n!r}] is {sp.dtype}{list(sp.shape)}, the tensor "
                                         f"{specs[n].dtype}{list(specs[n].shape)}")
                    specs[n] = sp
            gridded = frozenset(n for n, sp in specs.items() if sp.chunk_cols)
        if self.group_small_tensors == "auto":
            small = sum(1 for sp in specs.values() if 0 < sp.nbytes <= GROUP_MEMBER_MAX_BYTES)
            if small < GROUP_AUTO_MIN_TENSORS:
                return specs
        elif not self.group_small_tensors:
            return specs
        return group_specs(specs, self.chunk_bytes, exclude=tied_names(state) | gridded)

    def _grid_specs(self, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Column grids of a new layout (design 011 D6): the tensors matching ``column_slices``
        that can take one (:func:`~deltastore.layout.tensors.grid_spec_for`), except tied tensors (the
        read engine updates a storage shared by two names once, through its owner, which needs
        both chunked alike). The matched tensors left ungridded are logged once per layout."""
        assert self.slice_align is not None
        matched = [n for n in state if any(fnmatch.fnmatchcase(n, p) for p in self.column_slices)]
        if not matched:
            return {}
        tied = tied_names(state, max_bytes=None)
        out: dict[str, TensorSpec] = {}
        left: list[str] = []
        for n in matched:
            sp = None if n in tied else grid_spec_for(n, state[n], self.slice_align, self.chunk_bytes)
            if sp is None:
                left.append(n)
            else:
                out[n] = sp
        if left:
            logger.info("column_slices: %d of %d matched tensor(s) get no column grid (fewer than 2 dimensions or "
                        "%d columns, at most %d bytes, one column block, or tied): %s", len(left), len(matched),
                        self.slice_align, self.slice_align * SLICE_CHUNK_MIN_BYTES, ", ".join(left[:20]) + (" …" if len(left) > 20 else ""))
        return out

    def _write_layout(self, attempt: str, layout: Layout) -> ObjectRef:
        data = encode_object(layout)
        digest = sha256_hex(data)
        key = object_key(attempt, digest, ".layout.json.zst")
        put_immutable(self.store, key, data, "layout")
        return ObjectRef(key=key, sha256=digest)

    def _current_tip(self) -> _Tip | None:
        """The :class:`_Tip` of HEAD's version: kept from our last commit, else read (after a
        restart, a resume or another writer's commit)."""
        head = self._head
        if head is None or head.manifest is None:
            self._tip = None
            return None
        if self._tip is not None and self._tip.key == head.manifest:
            return self._tip
        top = self._history.head_manifest(head)
        assert top is not None  # HEAD names a manifest
        key, m = top
        self._remember(key, m)
        self._tip = _tip_of(key, m, self._history)
        return self._tip

    def _require_key_for(self, tip: _Tip | None) -> None:
        """Refuse to build on a signed version ``tip`` without a key (unless ``allow_unsigned``):
        the unsigned versions would stop every subscriber that trusts the store's key."""
        if tip is None or tip.signed_by is None or self._signing_key is not None or self.allow_unsigned:
            return
        raise SigningRequiredError(
            f"{self.url} is signed (version {tip.version}, {tip.key!r}, by key {tip.signed_by}) but this publisher has no "
            "signing_key: subscribers that trust that key would refuse its unsigned versions. Pass signing_key "
            "(the store's private key), or allow_unsigned=True to publish unsigned versions anyway; nothing was written"
        )

    def _remember(self, key: str, m: Manifest) -> None:
        self._links[key] = _Link(m.version, m.parent_manifest, m.back, m.schema_ >= 3)
        while len(self._links) > LINK_CACHE_ENTRIES:
            # the oldest version goes first: sources of the next back lists are the newest
            del self._links[min(self._links, key=lambda k: self._links[k].version)]

    def _link(self, key: str, *, keep: bool) -> _Link:
        """The links of manifest ``key``, read if not cached; ``keep``: cache what was read (a
        recent version, a source again soon; an old one is a source once per level)."""
        link = self._links.get(key)
        if link is not None:
            return link
        m = self._history.manifest(key)
        if keep:
            self._remember(key, m)
        return _Link(m.version, m.parent_manifest, m.back, m.schema_ >= 3)

    def _back_for(self, version: int, parent_key: str | None) -> tuple[str, ...]:
        """``back`` of ``version``: the manifest keys of versions v−2, v−4, …, v−2^j ≥ 1.

        Derived from manifests, never remembered whole (the publisher keeps O(log v) links of a
        few recent versions): key(v−2) is the parent's ``parent_manifest``, and for j ≥ 2
        key(v−2^j) is ``back[j−2]`` of version v−2^(j−1), whose key the step before found. On
        a chain upgraded from schema 1/2 the list stops where a schema-1/2 manifest (which has
        no ``back``) would have to supply the next entry: it is a prefix of the full list.
        """
        out: list[str] = []
        source = parent_key  # the manifest of version v − 2^(j−1)
        j = 1
        while source is not None and version - 2**j >= 1:
            try:
                link = self._link(source, keep=2 ** (j - 1) < LINK_CACHE_ENTRIES)
            except NotFoundError:
                # Collected below GC's floor: skip pointers are hints (D1), the list stops here.
                logger.info("manifest %s is gone (collected); version %d gets %d back entries", source, version, len(out))
                break
            if j == 1:
                key = link.parent_key
            else:
                key = link.back[j - 2] if link.schema3 and len(link.back) >= j - 1 else None
            if key is None:
                break
            if manifest_key_version(key) != version - 2**j:
                logger.warning("manifest %s has a skip pointer %s that is not version %d; version %d gets %d back entries",
                               source, key, version - 2**j, version, len(out))
                break
            out.append(key)
            source = key
            j += 1
        return tuple(out)

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
        meta = _json_metadata(metadata)
        if isinstance(state_dict, torch.nn.Module):  # each tied memory once, its aliases recorded (deltastore.layout.tied)
            state_dict, tied = module_state(state_dict)
            if tied:
                meta[TIED_WEIGHTS_KEY] = tied
        return validate_state_dict(state_dict), meta, _int_step(step)

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
            anchor = sub.info(self._head.version).anchor
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
        self._specs, self._layout, self._anchor_version = specs, None, anchor
        logger.info("resumed from version %d of %s", self._head.version, self.url)


@dataclass(frozen=True)
class _Link:
    """A manifest's links, all the skip-pointer derivation needs of it."""

    version: int
    parent_key: str | None
    back: tuple[str, ...]
    schema3: bool


@dataclass(frozen=True)
class _Tip:
    """What the next version needs to know of the version it builds on (HEAD's).

    ``schema3`` False: a schema-1/2 version; the next one is an anchor and starts the chain,
    the cumulative bytes and the layout objects (design 005 D10), so the other fields are
    unused."""

    version: int
    key: str
    schema3: bool
    chain_start: int = 0
    cum: int = 0
    layout: Layout | None = None
    layout_ref: ObjectRef | None = None
    anchor: int = 0
    anchor_key: str | None = None
    anchor_full: int = 0
    anchor_cum: int = 0
    signed_by: str | None = None  # the key id of the version's signature (None: unsigned)


def _tip_of(key: str, m: Manifest, history: History) -> _Tip:
    """Read the :class:`_Tip` of manifest ``m`` (its anchor's manifest and its layout)."""
    signed_by = None if m.signature is None else m.signature.key_id
    if m.schema_ < 3:
        return _Tip(version=m.version, key=key, schema3=False, signed_by=signed_by)
    anchor_key = key if m.kind == "anchor" else m.anchor_manifest
    a = m if m.kind == "anchor" else (history.manifest(anchor_key) if anchor_key else None)
    if (a is None or m.chain_start is None or m.layout is None or m.stats.cum_delta_bytes is None
            or a.stats.full_bytes is None or a.stats.cum_delta_bytes is None):
        # Not what this writer writes: start over with an anchor rather than guess.
        logger.warning("manifest %s lacks schema-3 fields (anchor, chain_start, layout or byte counts): "
                       "the next version is an anchor", key)
        return _Tip(version=m.version, key=key, schema3=False, signed_by=signed_by)
    return _Tip(
        version=m.version, key=key, schema3=True, chain_start=m.chain_start, cum=m.stats.cum_delta_bytes,
        layout=history.layout(m.layout), layout_ref=m.layout, anchor=a.version, anchor_key=anchor_key,
        anchor_full=a.stats.full_bytes, anchor_cum=a.stats.cum_delta_bytes, signed_by=signed_by,
    )


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


def _handed_over(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
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


def _int_step(step: Any) -> int | None:
    """``step`` as an int (numpy and 0-d torch integers accepted), checked before any write."""
    if step is None:
        return None
    try:
        return operator.index(step)
    except TypeError:
        raise InvalidStateDictError(f"step must be an integer or None, got {step!r} ({type(step).__name__})") from None


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    import json

    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidStateDictError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidStateDictError(f"metadata is not JSON-serializable: {e}") from None
