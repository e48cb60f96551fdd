"""The read path (SPEC §7): poll HEAD, plan which segments to fetch, verify, apply."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltastore.apply import (
    ReadEngine,
    _batched,
    _span_bytes,
    _target_tensors,
    _torch_dtype,
    _verify_chunk,
)
from deltastore.errors import (
    CorruptObjectError,
    DeltastoreError,
    HistoryReplacedError,
    VersionNotFoundError,
)
from deltastore.history import History, VersionInfo
from deltastore.jobs import default_threads, grouped
from deltastore.manifest import MAX_MANIFEST_BYTES, Head, Manifest
from deltastore.plan import (
    Manifests,
    Step,
    check_entries,
    plan_forward,
    plan_from_anchor,
)
from deltastore.plan import digests as _digests
from deltastore.plan import layout as _layout
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.tensors import TensorSpec, check_layout

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
        self._engine.materialize(plans, specs, out)
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
            plans = self._plan_forward(ms, specs)
            base = _digests(self._held)
            anchors = [i for i, (_, mm) in enumerate(ms) if mm.kind == "anchor"]
            held = ms[anchors[-1]:] if anchors else self._held + ms
        self._engine.apply_in_place(plans, specs, tensors, base, self._version)
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

