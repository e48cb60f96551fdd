"""The read path (SPEC §7): poll HEAD, plan which segments to fetch, verify, apply."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from deltastore import codec
from deltastore.errors import (
    CorruptObjectError,
    DeltastoreError,
    FormatError,
    HistoryReplacedError,
    IntegrityError,
    InvalidStateDictError,
    NotFoundError,
    VersionNotFoundError,
)
from deltastore.history import History, VersionInfo
from deltastore.manifest import MAX_MANIFEST_BYTES, BlobRef, Head, Manifest, SegmentRef, sha256_hex
from deltastore.plan import ChunkPlan, Manifests, Step, check_entries, plan_forward, plan_from_anchor
from deltastore.plan import digests as _digests
from deltastore.plan import layout as _layout
from deltastore.jobs import default_threads, grouped
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.tensors import TensorSpec, bits, check_layout, state_digest, torch_dtype

logger = logging.getLogger(__name__)

#: Concurrent GETs: object stores reward parallel requests far beyond the core count.
IO_THREADS = 16
#: Segment bytes fetched per batch: a pull holds at most two batches (one being applied, one
#: being fetched) of compressed data, whatever the model size.
FETCH_BATCH_BYTES = 64 * 1024 * 1024
#: Byte ranges of one pack closer than this are fetched as one GET: a request costs more than
#: a few hundred KiB of transfer.
COALESCE_GAP_BYTES = 256 * 1024

_Manifests = Manifests
_T = TypeVar("_T")
#: What a bad segment or chunk raises: a fallback path may succeed where one of these failed.
_BAD_DATA = (IntegrityError, FormatError, NotFoundError)


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


class _Fetcher:
    """Fetches segments with parallel (coalesced) range GETs and verifies every one."""

    def __init__(self, store: Store, pool: ThreadPoolExecutor):
        self.store = store
        self.pool = pool
        self.bytes_fetched = 0  # segment bytes read from the store, cumulative
        self._lock = threading.Lock()

    def fetch(
        self, steps: Iterable[Step], errors: dict[tuple[str, int], DeltastoreError] | None = None
    ) -> dict[tuple[str, int], memoryview]:
        """Fetch and verify every step's segment, keyed by ``(pack key, offset)``.

        With ``errors``, a segment that is missing, truncated or fails its SHA-256 is recorded
        there (with the error naming it) instead of raising, so a caller can take another path.
        """
        by_blob: dict[str, tuple[BlobRef, dict[int, SegmentRef]]] = {}
        for s in steps:
            by_blob.setdefault(s.blob.key, (s.blob, {}))[1][s.ref.offset] = s.ref
        jobs = []
        for blob, refs in by_blob.values():
            for run in _coalesce(sorted(refs.values(), key=lambda r: r.offset)):
                jobs.append((blob, run, self.pool.submit(self._get_run, blob, run, errors is not None)))
        out: dict[tuple[str, int], memoryview] = {}
        for blob, run, j in jobs:
            try:
                got, bad = j.result()
            except (IntegrityError, NotFoundError) as e:
                if errors is None:
                    raise
                errors.update(((blob.key, r.offset), e) for r in run)
                continue
            out.update(got)
            if errors is not None:
                errors.update(bad)
        return out

    def _get_run(
        self, blob: BlobRef, run: list[SegmentRef], tolerant: bool = False
    ) -> tuple[dict[tuple[str, int], memoryview], dict[tuple[str, int], DeltastoreError]]:
        start, stop = run[0].offset, run[-1].offset + run[-1].length
        whole = start == 0 and stop == blob.size
        try:
            data = self.store.get(blob.key) if whole else self.store.get(blob.key, byte_range=(start, stop))
        except NotFoundError:
            raise NotFoundError(f"pack {blob.key!r} is missing from {self.store.url}: the store was damaged") from None
        with self._lock:
            self.bytes_fetched += len(data)
        if len(data) != stop - start:
            raise IntegrityError(f"pack {blob.key!r}: read {len(data)} bytes of [{start}, {stop}); the object is truncated")
        pack_bad = whole and sha256_hex(data) != blob.sha256
        if pack_bad and not tolerant:
            raise IntegrityError(f"pack {blob.key!r} does not match its SHA-256: the object is corrupt")
        view = memoryview(data)
        out = {}
        bad: dict[tuple[str, int], DeltastoreError] = {}
        for r in run:
            seg = view[r.offset - start : r.offset - start + r.length]  # no copy: codec reads views
            if sha256_hex(seg) != r.sha256:  # also for whole packs: SPEC §7.6, every segment
                e = IntegrityError(f"segment at {r.offset} of pack {blob.key!r} does not match its SHA-256: the object is corrupt")
                if not tolerant:
                    raise e
                bad[(blob.key, r.offset)] = e
                continue
            out[(blob.key, r.offset)] = seg
        if pack_bad and not bad:  # every segment hashes right, so the damage is between them: say so
            raise IntegrityError(f"pack {blob.key!r} does not match its SHA-256 (its segments do): the object is corrupt")
        return out, bad


def _coalesce(refs: list[SegmentRef]) -> list[list[SegmentRef]]:
    runs: list[list[SegmentRef]] = []
    for r in refs:
        if runs and r.offset - (runs[-1][-1].offset + runs[-1][-1].length) <= COALESCE_GAP_BYTES:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


class _Target:
    """Raw access to one target tensor's chunks, on any device (CPU tensors in place)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.cpu = t.device.type == "cpu"
        # Made once: per-chunk torch calls on worker threads queue for the GIL behind numpy.
        self.raw = bits(t) if self.cpu else None

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
        self._pool = ThreadPoolExecutor(max_workers=threads or default_threads(), thread_name_prefix="deltastore-decode")
        self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="deltastore-io")
        self._fetcher = _Fetcher(self.store, self._io)
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

    def log(self) -> list[VersionInfo]:
        """Every committed version, oldest first."""
        head = self._history.poll_head()
        return [] if head is None else self._history.log(head)

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
        targets = {n: _Target(t) for n, t in out.items()}
        for batch, data, _ in self._fetch_batches(plans):
            groups = grouped(batch, lambda p: _span_bytes(specs, p.name, p.index))
            list(self._pool.map(lambda g: [self._build(p, specs, data, targets[p.name]) for p in g], groups))
        self._version, self._held = m.version, ms
        return out

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
        self._check_same_history(key, m)
        if self._version is not None and m.version == self._version:
            return None
        if self._version is not None and m.version < self._version:
            raise VersionNotFoundError(f"pull_into cannot go back from version {self._version} to {m.version}; use pull()")
        tensors = _target_tensors(target)
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
            plans = self._plan_from_anchor(ms, specs)
            base: dict[tuple[str, int], str] = {}
            held = ms
        else:
            specs = held_specs
            check_layout(specs, tensors, against=f"version {self._version} held by this subscriber")
            ms = fwd
            base = _digests(self._held)
            plans = self._plan_forward(ms, specs, base)
            anchors = [i for i, (_, mm) in enumerate(ms) if mm.kind == "anchor"]
            held = ms[anchors[-1]:] if anchors else self._held + ms
        self._apply_in_place(plans, specs, tensors, base)
        self._version, self._held = m.version, held
        return VersionInfo.from_manifest(m, key)

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

                groups = grouped(batch, lambda it: _span_bytes(specs, it[0], it[1].index))
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
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
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

    # --- applying -----------------------------------------------------------------------

    def _build(self, p: ChunkPlan, specs: dict[str, TensorSpec], data: dict, target: _Target) -> None:
        """Decode a plan that starts from a full segment, verify it, write it to ``target``."""
        raw = self._replay(p, specs[p.name], data, None)
        target.write(*p.span, raw)

    @staticmethod
    def _replay(p: ChunkPlan, spec: TensorSpec, data: dict, raw: np.ndarray | None) -> np.ndarray:
        a, b = p.span
        if p.full is not None:
            raw = codec.decode_full(data[p.full.where], codec=p.full.ref.codec, dtype=spec.uint_dtype(), count=b - a)
        assert raw is not None
        applied: list[Step] = []
        try:
            for s in p.deltas:
                codec.apply_delta(raw, data[s.where], codec=s.ref.codec)  # validates before writing
                applied.append(s)
            if state_digest(raw) != p.digest:
                raise IntegrityError(
                    f"chunk {p.name}[{p.index}] does not match its digest after applying {len(p.steps())} segment(s)"
                )
        except BaseException:
            if p.full is None:  # undo in place, newest delta first
                for s in reversed(applied):
                    codec.apply_delta(raw, data[s.where], codec=s.ref.codec, inverse=True)
            raise
        return raw

    def _fetch_batches(
        self, plans: list[ChunkPlan], *, tolerant: bool = False
    ) -> Iterator[tuple[list[ChunkPlan], dict[tuple[str, int], memoryview], dict[tuple[str, int], DeltastoreError]]]:
        """Yield plans in batches of about FETCH_BATCH_BYTES with their verified segments,
        fetching the next batch while the caller applies the current one.

        With ``tolerant``, segments that are missing or fail their SHA-256 come back as errors
        (the third item) instead of raising, so the caller can take another path for them."""
        batches: list[list[ChunkPlan]] = [[]]
        size = 0
        for p in plans:
            cost = sum(st.ref.length for st in p.steps())
            if batches[-1] and size + cost > FETCH_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(p)
            size += cost

        def fetch(batch: list[ChunkPlan]) -> tuple[dict[tuple[str, int], memoryview], dict[tuple[str, int], DeltastoreError]]:
            errors: dict[tuple[str, int], DeltastoreError] = {}
            data = self._fetcher.fetch((st for p in batch for st in p.steps()), errors if tolerant else None)
            return data, errors

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltastore-prefetch") as ahead:
            nxt = ahead.submit(fetch, batches[0])
            for i, batch in enumerate(batches):
                data, errors = nxt.result()
                if i + 1 < len(batches):
                    nxt = ahead.submit(fetch, batches[i + 1])
                yield batch, data, errors

    def _apply_in_place(self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor], base: dict[tuple[str, int], str]) -> None:
        """Apply every plan to ``tensors``; on any failure restore what was applied, then raise."""
        # Tied weights (one storage under two names) are updated once.
        seen: dict[tuple[int, int], str] = {}
        owner: dict[str, str] = {}
        for n, t in tensors.items():
            k = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), t.numel())
            owner[n] = seen.setdefault(k, n)
        plans = [p for p in plans if owner[p.name] == p.name]
        targets = {n: _Target(t) for n, t in tensors.items()}

        # SPEC §7.5: every chunk the target keeps or patches must hold version h's bits, not only
        # the chunks this update touches (a local edit elsewhere would survive silently).
        replaced = {(p.name, p.index) for p in plans if p.full is not None}
        kept = {k for k in base if owner.get(k[0]) == k[0]} | {(p.name, p.index) for p in plans if p.full is None}

        def check_base(k: tuple[str, int]) -> None:
            name, index = k
            if state_digest(targets[name].read(*specs[name].chunk_span(index))) != base.get(k):
                raise IntegrityError(
                    f"tensor {name!r} chunk {index} is not what version {self._version} holds there: "
                    "the target was modified since it was pulled (pull() it again)"
                )

        keys = sorted(kept - replaced)
        list(self._pool.map(lambda g: [check_base(k) for k in g], grouped(keys, lambda k: _span_bytes(specs, *k))))

        done: list[tuple[ChunkPlan, np.ndarray | None]] = []  # (plan, saved old bits if replaced)
        undo: dict[tuple[str, int], bytes] = {}  # delta segments of applied chunks, to roll back
        _Segs = dict[tuple[str, int], memoryview]
        _Errs = dict[tuple[str, int], DeltastoreError]
        _Done = tuple[ChunkPlan, "np.ndarray | None", _Segs]

        def attempt(p: ChunkPlan, data: _Segs, errors: _Errs) -> _Done:
            for st in p.steps():
                if st.where in errors:
                    raise errors[st.where]
            tgt = targets[p.name]
            if p.full is None:
                if tgt.cpu:
                    self._replay(p, specs[p.name], data, tgt.read(*p.span))
                else:
                    raw = tgt.read(*p.span)
                    self._replay(p, specs[p.name], data, raw)
                    tgt.write(*p.span, raw)
                return p, None, data
            new = self._replay(p, specs[p.name], data, None)
            saved = tgt.read(*p.span).copy()
            tgt.write(*p.span, new)
            return p, saved, data

        def run(p: ChunkPlan, data: _Segs, errors: _Errs) -> _Done:
            """The chunk's chosen path, else its fallbacks (a failed attempt leaves it as it was)."""
            try:
                return attempt(p, data, errors)
            except _BAD_DATA as e:
                error: DeltastoreError = e
            for alt in p.fallbacks:
                assert alt.full is not None
                logger.warning(
                    "chunk %s[%d]: %s; taking the full segment at %d of pack %s instead",
                    p.name, p.index, error, alt.full.ref.offset, alt.full.blob.key,
                )
                try:
                    alt_errors: _Errs = {}
                    return attempt(alt, self._fetcher.fetch(alt.steps(), alt_errors), alt_errors)
                except _BAD_DATA as e:
                    error = e
            raise error

        def run_group(group: list[ChunkPlan], data: _Segs, errors: _Errs) -> tuple[list[_Done], BaseException | None]:
            applied = []
            for p in group:
                try:
                    applied.append(run(p, data, errors))
                except BaseException as e:  # noqa: BLE001 - re-raised by the caller after rollback
                    return applied, e
            return applied, None

        error: BaseException | None = None
        try:
            for batch, data, errors in self._fetch_batches(plans, tolerant=True):
                groups = grouped(batch, lambda p: _span_bytes(specs, p.name, p.index))
                for f in [self._pool.submit(run_group, g, data, errors) for g in groups]:
                    applied, failed = f.result()
                    error = error or failed
                    for p, saved, segs in applied:
                        done.append((p, saved))
                        if saved is None:
                            undo.update((s.where, segs[s.where]) for s in p.deltas)
                if error is not None:
                    break
        except BaseException as e:  # noqa: BLE001 - a fetch failed: roll back what was applied
            error = e
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


def _verify_chunk(
    name: str,
    c: Any,
    spec: TensorSpec,
    base: np.ndarray | None,
    steps: dict[tuple[str, int, str], Step],
    data: dict[tuple[str, int], memoryview],
    errors: dict[tuple[str, int], DeltastoreError],
) -> tuple[tuple[str, int], np.ndarray | None, list[str]]:
    """Check both segments of one chunk entry: ``(key, verified bits or None, problems)``.

    A delta segment is applied to ``base`` (the verified bits at the parent) and checked
    against the digest; with no verified base it is still decoded (onto zeros), which checks
    its structure but not its values.
    """
    a, b = spec.chunk_span(c.index)
    problems: list[str] = []
    result: np.ndarray | None = None
    for which in ("delta", "full"):
        st = steps.get((name, c.index, which))
        if st is None:
            continue
        what = f"chunk {name}[{c.index}] {which} segment ({st.ref.codec}) at {st.ref.offset} of pack {st.blob.key!r}"
        if st.where in errors:
            problems.append(f"{what}: {errors[st.where]}")
            continue
        try:
            if which == "full":
                raw = codec.decode_full(data[st.where], codec=st.ref.codec, dtype=spec.uint_dtype(), count=b - a)
            else:
                raw = base.copy() if base is not None else np.zeros(b - a, dtype=spec.uint_dtype())
                codec.apply_delta(raw, data[st.where], codec=st.ref.codec)
        except (DeltastoreError, ValueError) as e:
            problems.append(f"{what} does not decode: {type(e).__name__}: {e}")
            continue
        if which == "delta" and base is None:
            continue  # structure checked; values unknowable without a verified parent
        if state_digest(raw) != c.digest:
            problems.append(f"{what} does not reproduce the chunk's digest {c.digest}")
            continue
        result = raw
    return (name, c.index), result, problems


def _batched(items: list[_T], nbytes: Callable[[_T], int]) -> list[list[_T]]:
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


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a (validated) manifest's dtype name."""
    try:
        return torch_dtype(name)
    except InvalidStateDictError as e:  # a name deltastore stores, but this torch is too old
        raise FormatError(f"{e}: upgrade torch to read this store") from None


def _span_bytes(specs: dict[str, TensorSpec], name: str, index: int) -> int:
    a, b = specs[name].chunk_span(index)
    return (b - a) * specs[name].width


def _target_tensors(target: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        target = target.state_dict(keep_vars=True)
    if not isinstance(target, Mapping):
        raise InvalidStateDictError(f"pull_into needs a state dict or nn.Module, got {type(target).__name__}")
    out = {}
    for n, t in target.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidStateDictError(f"target {n!r} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise InvalidStateDictError(f"target tensor {n!r} is not contiguous; it cannot be updated in place")
        out[n] = t.data if isinstance(t, torch.nn.Parameter) else t
    return out

