"""One subscriber's reading state (SPEC §7): HEAD as last read, the version held, and the moves
from it: a full materialization, a fast-forward in place, a staged update and its swap.

:class:`deltastore.read.subscriber.Subscriber` is the public face of a :class:`Reader`, and
:mod:`deltastore.read.follow` drives one in a loop. Planning which path to take is
:mod:`deltastore.read.catchup`'s; fetching and applying is the engine's
(:mod:`deltastore.read.engine`). Package-internal: users hold a Subscriber.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deltastore._util.heap import release_free_heap
from deltastore._util.jobs import default_threads
from deltastore.errors import (
    CorruptObjectError,
    FormatError,
    HeadRolledBackError,
    IntegrityError,
    NotFoundError,
    SignatureError,
    StaleStageError,
    TargetModifiedError,
    VersionNotFoundError,
)
from deltastore.fleet.ledger import HeartbeatWriter
from deltastore.format.history import History, VersionInfo
from deltastore.format.models import Head, Index, Manifest
from deltastore.layout.groups import allocate_members
from deltastore.layout.select import Resolved, Selection, check_target, slice_targets
from deltastore.layout.tensors import TensorSpec
from deltastore.layout.tied import recorded_aliases
from deltastore.read.catchup import CatchUp, Held, Update, history_replaced
from deltastore.read.changes import merge_spans
from deltastore.read.engine import ReadEngine, digest_mismatches, targets_for
from deltastore.read.partial import PARTIAL_COALESCE_GAP_BYTES, Partial, Spare, changed_spans
from deltastore.read.plan import ChunkPlan, layout, plan_from_anchor
from deltastore.read.stage import ChunkPatch, StagedUpdate
from deltastore.read.targets import Target, check_tensors, module_targets, owners, plan_spans, stored_dtype, target_tensors
from deltastore.storage.base import Store

if TYPE_CHECKING:
    from deltastore.format.signing import TrustedKeys

logger = logging.getLogger(__name__)

#: Plans tried for one update: a squash that turns out bad, then a held version collected
#: meanwhile, each cost one more plan; more than this means the store keeps changing under us.
MAX_REPLANS = 4

#: Tensor name → element spans ``[start, stop)`` written (see Subscriber.last_changed).
Changed = dict[str, list[tuple[int, int]]]


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


class Reader:
    """The state behind one :class:`~deltastore.read.subscriber.Subscriber`.

    Args:
        store: the store to read (not closed here).
        threads: decode threads (None: all cores).
        trusted_keys: a :class:`~deltastore.format.signing.TrustedKeys` every manifest used must
            be signed by (None: signatures are not required).
        max_manifest_bytes: refuse a manifest larger than this before parsing it.
        max_model_bytes: refuse to materialize more bytes of tensors than this (None: this
            machine's physical memory).
        select: a partial subscriber's selection (None: whole targets).
        serving_format: the serving format ``store`` presents (its heartbeats say so; None: the
            versions as published).
        index_source: the history index that applies under a HEAD (a serving format's reader:
            :meth:`~deltastore.read.streams.StreamView.stream_index`); None: the one HEAD names.
        earlier: the version before a chain that starts without a parent link (History's
            ``earlier``; a serving format's reader: :meth:`~deltastore.read.streams.StreamView.earlier`).
    """

    def __init__(self, store: Store, *, threads: int | None, trusted_keys: TrustedKeys | None, max_manifest_bytes: int,
                 max_model_bytes: int | None, select: Selection | None, serving_format: str | None = None,
                 index_source: Callable[[Head], Index | None] | None = None,
                 earlier: Callable[[int], tuple[str, str | None] | None] | None = None):
        self.store = store
        self.serving_format = serving_format
        self.url = store.url
        self.keys = trusted_keys
        self.max_model_bytes = max_model_bytes if max_model_bytes is not None else physical_memory()
        self.history = History(store, None if trusted_keys is None else self._check_signature,
                               max_manifest_bytes=max_manifest_bytes, index_source=index_source,
                               earlier=earlier)
        self.engine = ReadEngine(store, threads or default_threads())
        # Squashes are unsigned hints (the compactor signs none): a subscriber that requires
        # signatures does not use them (SPEC §12), since a forged squash could match an XXH3 digest.
        self.catchup = CatchUp(self.history, self.url, use_squashes=trusted_keys is None)
        self.partial = Partial(select) if select is not None else None
        if select is not None:
            self.engine.fetcher.gap = PARTIAL_COALESCE_GAP_BYTES
        self.held: Held | None = None  # the held version's manifest, layout and chunk digests
        self.head: Head | None = None  # the HEAD last read
        self._changed: Changed | Callable[[], Changed] = {}
        self.beats: HeartbeatWriter | None = None  # the fleet ledger's writer (heartbeat())
        self.worker_id: str | None = None  # the id it used, kept by the next one
        self.said_waiting = False  # "waiting for the first version" logged (by follow), once

    # --- state ------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The version held (None before the first pull)."""
        return None if self.held is None else self.held.manifest.version

    @property
    def changed(self) -> Changed:
        """What the last update wrote (computed on first use: per group member, it is a walk
        over every member a plan touches)."""
        if callable(self._changed):
            self._changed = self._changed()
        return self._changed

    @changed.setter
    def changed(self, value: Changed | Callable[[], Changed]) -> None:
        self._changed = value

    def set_held(self, held: Held) -> None:
        if self.held is None or held.key != self.held.key:
            self.catchup.bad_squashes.clear()  # squash hints are per held version
        self.held = held
        if self.beats is not None:
            self.beats.notify()  # written by its thread: never inside the caller's pause

    def drop_held(self) -> None:
        """Hold nothing: the next update is a full load."""
        self.held = None

    def heartbeat(self, worker_id: str | None, interval_s: float) -> HeartbeatWriter:
        """The running ledger writer, or a new one started (see Subscriber.heartbeat)."""
        running = self.beats
        if running is not None and not running.closed:
            if worker_id is not None and worker_id != running.worker_id:
                raise ValueError(f"this subscriber already writes heartbeats as {running.worker_id!r}; "
                                 "close that writer first")
            return running
        beats = HeartbeatWriter(self.store, worker_id if worker_id is not None else self.worker_id, interval_s=interval_s,
                                serving_format=self.serving_format)
        self.beats, self.worker_id = beats, beats.worker_id
        return beats.start(self._held_for_ledger)

    def _held_for_ledger(self) -> tuple[int, str | None] | None:
        held = self.held
        return None if held is None else (held.manifest.version, held.manifest.lineage)

    def close(self) -> None:
        if self.beats is not None:
            self.beats.close()  # marks the worker stopped: a write, so before the store goes
        self.engine.close()

    # --- HEAD and versions --------------------------------------------------------------------

    def require_head(self) -> Head:
        head = self.history.poll_head()
        if head is None or head.manifest is None:
            raise VersionNotFoundError(f"{self.url} has no committed version yet")
        self.head = head
        return head

    def resolve(self, version: int | None) -> tuple[str, Manifest]:
        """HEAD's version (``version`` None) or ``version``, read through HEAD's history."""
        head = self.require_head()
        if version is None:
            top = self.history.head_manifest(head)
            assert top is not None
            return top
        return self.history.resolve(version, head)  # below the floor: its pin, or collected

    def index(self, head: Head | None = None) -> Index | None:
        """The history index of ``head`` (default: the HEAD last read); History caches it by key."""
        head = head if head is not None else self.head
        return None if head is None else self.history.index(head)

    def floor(self) -> int:
        index = self.index()
        return 1 if index is None else index.floor

    def collected_since(self, floor: int) -> bool:
        """Re-read HEAD and its index (SPEC §7.7): True when the floor rose above the held
        version since it was ``floor`` (a NotFound is then collection, not damage)."""
        got = self.history.read_head()
        if got is None or self.held is None:
            return False
        self.head = got[0]
        now = self.floor()
        return now > floor and self.held.manifest.version < now

    def _check_signature(self, key: str, m: Manifest) -> None:
        """The trusted keys' check of each manifest read; an unsigned one above a signed version
        of its history is named for what it is (UnsignedVersionError)."""
        assert self.keys is not None
        try:
            self.keys.verify(key, m)
        except SignatureError:
            below = self._signed_below(m) if m.signature is None else None
            if below is None:
                raise
            from deltastore.format.signing import unsigned_version_error

            raise unsigned_version_error(self.url, key, m, *below) from None

    def _signed_below(self, m: Manifest) -> tuple[str, Manifest] | None:
        """A version below ``m`` in its history that is signed by a trusted key, if one is at
        hand: the held version, else ``m``'s parent (one read, not cached; None on any error)."""
        assert self.keys is not None
        held = self.held
        if held is not None and held.manifest.signature is not None and held.manifest.lineage == m.lineage \
                and held.manifest.version < m.version:
            return held.key, held.manifest  # verified when it was read
        from deltastore.format.signing import signed_parent

        return signed_parent(self.keys, self.history, m)

    # --- checks -------------------------------------------------------------------------------

    def check_model_size(self, specs: dict[str, TensorSpec], version: int, res: Resolved | None = None) -> None:
        total = sum(s.nbytes for s in specs.values()) if res is None else Partial.model_bytes(specs, res)
        if self.max_model_bytes is not None and total > self.max_model_bytes:
            raise CorruptObjectError(
                f"version {version} of {self.url} declares {total} bytes of tensors, more than "
                f"max_model_bytes={self.max_model_bytes} (default: this machine's memory); if that is "
                "real, open the Subscriber with a larger max_model_bytes"
            )

    def check_target(self, specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor], *, against: str,
                     tied: Mapping[str, str] | None = None) -> None:
        """``tensors`` against the layout ``specs``: the selection's slices for a partial
        subscriber, else the whole layout (:func:`deltastore.read.targets.check_tensors`)."""
        if self.partial is not None:
            check_target(self.partial.resolved(specs), tensors, against=against)
            return
        check_tensors(specs, tensors, against=against, tied=tied)

    def check_same_history(self, key: str, m: Manifest) -> None:
        """SPEC §7 step 3: the version to reach must be in the held version's history (D7)."""
        if self.held is None:
            return
        held_key, held = self.held.key, self.held.manifest
        if m.lineage is not None and held.lineage is not None and m.lineage != held.lineage:
            raise history_replaced(self.url, self.version, f"its lineage is {m.lineage}, the held version's is {held.lineage}")
        if m.version == held.version and key != held_key:
            raise history_replaced(self.url, self.version, f"version {m.version} is now {key!r}, not the held {held_key!r}")

    def check_forward(self, key: str, m: Manifest) -> bool:
        """True when ``m`` is newer than the held version (False: current); raises if older."""
        self.check_same_history(key, m)
        version = self.version
        if version is not None and m.version == version:
            return False
        if version is not None and m.version < version:
            if self.head is not None and key == self.head.manifest:
                raise HeadRolledBackError(
                    f"HEAD of {self.url} names version {m.version} ({key!r}), older than version {version} this "
                    "subscriber holds (restored from a backup, a lagging mirror, or rolled back by a party with write "
                    "access): nothing was applied; a subscriber never goes backwards (pull() reads an older version)"
                )
            raise VersionNotFoundError(f"pull_into cannot go back from version {version} to {m.version}; use pull()")
        return True

    # --- moves ------------------------------------------------------------------------------

    def materialize(self, key: str, m: Manifest) -> dict[str, torch.Tensor]:
        """Version ``m`` as new CPU tensors, verified; it is held afterwards (Subscriber.pull)."""
        ms = self.history.anchor_chain(key, m)
        specs = layout(ms[0][1])
        plans = plan_from_anchor(ms, specs)  # checks the whole chain before allocating
        if self.partial is not None:
            part = self.partial
            res = part.resolved(specs)
            self.check_model_size(specs, m.version, res)
            out = part.empty(res, torch.empty)
            spare: dict[tuple[str, int], np.ndarray] = {}
            self.engine.materialize(part.narrow(plans, res), specs, out, lambda sp, t: slice_targets(sp, res, t, spare))
            part.spare = spare
        else:
            self.check_model_size(specs, m.version)
            out = allocate_members(specs, stored_dtype)  # a group's members share one buffer (design 007)
            self.engine.materialize(plans, specs, out)
        self.set_held(Held.of(ms))
        release_free_heap()  # the read threads' chunk-sized buffers of a whole version (deltastore._util.heap)
        return out

    def allocate(self, key: str, m: Manifest,
                 into: Callable[[int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Zeroed CPU tensors in the layout of version ``m``, or views of ``into``'s buffer
        (Subscriber.allocate)."""
        specs = layout(self.history.anchor_chain(key, m)[0][1])
        if self.partial is not None:  # the selection's tensors, sharded ones as their slice
            res = self.partial.resolved(specs)
            self.check_model_size(specs, m.version, res)
            return self.partial.empty(res, torch.zeros, into)
        self.check_model_size(specs, m.version)
        return allocate_members(specs, stored_dtype, zeros=True, into=into)

    def updated(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor],
                run: Callable[[Update], Any]) -> tuple[Update, Any]:
        """Plan and ``run(update)``; when a squash's segments turn out bad, plan again without
        it; when a pack or manifest is missing because the held version was just collected
        (HEAD's index now has a higher floor), plan again from the anchor."""
        error: BaseException | None = None
        for _ in range(MAX_REPLANS):
            upd = None
            floor = self.floor()
            try:
                upd = self.catchup.plan(self.held, key, m, tensors, self.index(), self.check_target)
                return upd, run(upd)
            except TargetModifiedError:
                raise
            except (IntegrityError, FormatError, NotFoundError) as e:
                error = e
                if upd is not None and upd.squash is not None:
                    self.catchup.refuse(upd.squash, e)
                    continue
                if isinstance(e, NotFoundError) and self.collected_since(floor):
                    continue
                raise
        assert error is not None
        raise error

    def fast_forward(self, key: str, m: Manifest, target: Target) -> VersionInfo | None:
        """Bring ``target`` in place to version ``m`` (Subscriber.pull_into); None when current."""
        if not self.check_forward(key, m):
            self.changed = {}
            return None
        tensors = module_targets(target)
        if self.partial is not None:
            return self._fast_forward_partial(self.partial, key, m, tensors)
        version = self.version
        upd, _ = self.updated(
            key, m, tensors, lambda u: self.engine.apply_in_place(u.plans, u.specs, tensors, u.base, version)
        )
        self.set_held(upd.held)
        self.changed = functools.partial(plan_spans, upd.plans, upd.specs)  # computed when asked
        return VersionInfo.from_manifest(m, key)

    def chunk_mismatches(self, specs: dict[str, TensorSpec], expected: dict[tuple[str, int], str],
                         tensors: dict[str, torch.Tensor], *, against: str, tied: Mapping[str, str] | None = None,
                         spare: Spare | None = None) -> list[tuple[str, int]]:
        """The chunks of ``tensors`` (a target, or a saved copy of one) whose bits do not hash to
        their ``expected`` digest, once ``tensors`` were checked against the layout ``specs``
        (:meth:`check_target`): for a partial subscriber the chunks its selection reads, with
        ``spare`` the bits of its edge chunks outside the selection.

        Raises:
            LayoutMismatchError: ``tensors`` do not fit the layout (or the selection).
        """
        self.check_target(specs, tensors, against=against, tied=tied)
        part = self.partial
        targets: Mapping[str, Any]
        if part is None:
            targets = targets_for(specs, tensors)
        else:
            res = part.resolved(specs)
            targets, expected = slice_targets(specs, res, tensors, spare or {}), part.narrow_digests(expected, res)
        return digest_mismatches(self.engine.pool, specs, expected, lambda n, a, b: targets[n].read(a, b))

    def adopt(self, key: str, m: Manifest, target: Target) -> VersionInfo:
        """Hold version ``m`` with ``target``'s bits, every chunk checked against its digest
        (Subscriber.adopt)."""
        if self.held is not None:
            raise ValueError(f"adopt starts a subscriber that holds nothing; this one holds version {self.version}")
        held = Held.of(self.history.anchor_chain(key, m))
        against = f"version {m.version} of {self.url}"
        edges = frozenset() if self.partial is None else self.partial.resolved(held.specs).edges
        if edges:
            name, index = min(edges)
            raise ValueError(
                f"adopt cannot check this selection of {against}: chunk {index} of {name!r} straddles it, and "
                "the target lacks the bits of that chunk outside it (pull_into loads the selection instead)")
        bad = self.chunk_mismatches(held.specs, held.digests, module_targets(target), against=against,
                                    tied=recorded_aliases(m.metadata))
        if bad:
            (name, index), more = bad[0], len(bad) - 1
            raise TargetModifiedError(
                f"the target does not hold {against}: tensor {name!r} chunk {index} does not match its digest"
                f"{f' ({more} more chunks do not)' if more else ''}; nothing was adopted")
        if self.partial is not None:
            self.partial.spare = {}
        self.set_held(held)
        self.changed = {}
        return VersionInfo.from_manifest(m, key)

    def _fast_forward_partial(self, part: Partial, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> VersionInfo:
        """``fast_forward`` of a partial target: the whole-target update, narrowed to the chunks
        the selection reads (plans, and the held digests the target must match)."""
        version = self.version

        def run(u: Update) -> None:
            res = part.resolved(u.specs)
            base = part.narrow_digests(u.base, res)
            spare = part.kept_spare(res, bool(u.base))
            self.engine.apply_in_place(part.narrow(u.plans, res), u.specs, tensors, base, version,
                                       lambda sp, t: slice_targets(sp, res, t, spare))
            part.spare = spare

        upd, _ = self.updated(key, m, tensors, run)
        self.set_held(upd.held)
        res = part.resolved(upd.specs)
        self.changed = changed_spans(part.narrow(upd.plans, res), res)
        return VersionInfo.from_manifest(m, key)

    def stage(self, key: str, m: Manifest, target: Target) -> StagedUpdate | None:
        """Prepare the update of ``target`` to version ``m`` without writing it (Subscriber.stage)."""
        if not self.check_forward(key, m):
            return None
        tensors = module_targets(target)
        before = self.engine.bytes_fetched
        version = self.version
        upd, (patches, fetch_s, decode_s, spare) = self.updated(
            key, m, tensors, lambda u: self.stage_plans(u.plans, u.specs, tensors, u.base, version)
        )
        return StagedUpdate(
            info=VersionInfo.from_manifest(m, key), from_version=version, patches=patches,
            bytes_fetched=self.engine.bytes_fetched - before, fetch_s=fetch_s, decode_s=decode_s,
            base_manifest=None if self.held is None else self.held.key, held=upd.held, owner=self, spare=spare,
        )

    def stage_plans(self, plans: list[ChunkPlan], specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
                    base: dict[tuple[str, int], str], held_version: int | None,
                    ) -> tuple[list[ChunkPatch], float, float, Spare | None]:
        """``plans`` staged against ``tensors`` (:meth:`ReadEngine.stage`): the patches, the
        seconds fetching and decoding, and a partial subscriber's spare bits after the swap
        (None for a whole target). A partial target's update is the whole target's, narrowed to
        the chunks the selection reads, each chunk's patch carried into the user's tensors."""
        part = self.partial
        if part is None:
            return (*self.engine.stage(plans, specs, tensors, base, held_version), None)
        res = part.resolved(specs)
        spare = part.kept_spare(res, bool(base))
        units, fetch_s, decode_s = self.engine.stage(part.narrow(plans, res), specs, tensors,
                                                     part.narrow_digests(base, res), held_version,
                                                     lambda sp, t: slice_targets(sp, res, t, spare))
        patches, after = part.user_patches(units, res, spare)
        return patches, fetch_s, decode_s, after

    def swap(self, staged: StagedUpdate, target: Target) -> float:
        """Write ``staged`` into ``target``; the reader then holds its version (Subscriber.swap)."""
        held_key = None if self.held is None else self.held.key
        if staged.owner is not self or staged.base_manifest != held_key or staged.from_version != self.version:
            raise StaleStageError(
                f"the update to version {staged.info.version} was staged against version {staged.from_version} "
                f"({staged.base_manifest!r}), but this subscriber holds {self.version} ({held_key!r}): stage it again"
            )
        try:
            if staged.replacements:  # prepared for a swap by rebinding (see follow's swap_mode)
                dt = staged.rebind(owners(target))
            else:
                dt = staged.swap(target_tensors(target))
        except IntegrityError as e:
            raise TargetModifiedError(str(e)) from None
        if self.partial is not None and staged.spare is not None:
            self.partial.spare = staged.spare
        self.set_held(staged.held)
        self.changed = {n: merge_spans(s) for n, s in staged.changed.items()}
        return dt

