"""Followers converging to the fleet target (SPEC §1.2, §7.7): the follower's side of
:mod:`deltastore.fleet.target`.

:meth:`deltastore.Subscriber.follow` asks a :class:`TargetSteer` at each poll which version to
hold (:meth:`TargetSteer.goal`): the target's while one applies, else HEAD's. A move forward is
the usual staged fast-forward; a move *backwards*, which a subscriber otherwise never makes, is
staged here from the older version's anchor: only the chunks whose digest at the held version
differs from their digest at the goal are rebuilt (full segment of the anchor, then its
deltas), checked against that digest in a scratch buffer, and kept as patches, so the swap
writes the target all or nothing, with the same checks as any staged update (the target's
kept chunks against their held digests, every result against its digest).

A target a follower cannot use (unsigned or forged on a signed store, an older generation than
one it accepted, a version collected or missing, another layout) is logged once, reported in
the worker's heartbeat (``error``) and ignored: the follower keeps the version it holds.

The steer also reports the worker's progress (stage, goal, lag, last error) to its heartbeat
writer, when there is one.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, replace

import torch

from deltastore.errors import (
    CorruptObjectError,
    FormatError,
    LayoutMismatchError,
    NotFoundError,
    SignatureError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.fleet.ledger import STAGE_FETCHING, STAGE_STAGED, STAGE_SWAPPED, Progress
from deltastore.fleet.target import MAX_TARGET_BYTES, TARGET_KEY, FleetTarget, parse_target, verify_target
from deltastore.format.history import VersionInfo
from deltastore.format.models import Head, Manifest
from deltastore.read.catchup import Held
from deltastore.read.plan import layout, plan_changed_from_anchor
from deltastore.read.stage import StagedUpdate
from deltastore.read.streams import StreamView

from deltastore.read.reader import Reader

logger = logging.getLogger(__name__)


@dataclass
class _Memory:
    """What a subscriber's steer remembers between polls and between follow loops."""

    etag: str | None = None
    read: FleetTarget | None = None  # the target object last read (None: absent)
    problem_of_read: str | None = None  # why the object last read is unusable as such
    accepted: FleetTarget | None = None  # the last target followed (or cleared by)
    resolved: tuple[str, str, tuple[str, Manifest]] | None = None  # (target id, HEAD manifest, goal)
    logged: str | None = None  # the problem last logged (each is logged once)
    progress: Progress = field(default_factory=Progress)


#: Each subscriber's memory, dropped with its reader (the memory never refers to the reader).
_MEMORY: weakref.WeakKeyDictionary[Reader, _Memory] = weakref.WeakKeyDictionary()


class TargetSteer:
    """Which version one follower holds, and how it moves there (see the module docstring).

    Args:
        reader: the follower's reader (its store, history, trusted keys and held version).
    """

    def __init__(self, reader: Reader):
        self.reader = reader
        # Kept per subscriber, across its follow loops: a loop started again must not forget
        # the generation it followed (an older signed target written back is a replay).
        self.memory = _MEMORY.get(reader)
        if self.memory is None:
            self.memory = _MEMORY[reader] = _Memory()
        #: The manifest key of the target's version that goal() returned last: the only
        #: version a move may go back to (HEAD rolled back is refused as ever, SPEC §3.1).
        self.back_to: str | None = None

    # --- which version ----------------------------------------------------------------------

    def goal(self, head: Head) -> tuple[str, Manifest] | None:
        """The version to hold under ``head``: the target's ``(key, manifest)`` while one
        applies, the held version's when the target is unusable (the follower keeps it), None
        to follow HEAD.

        A target that cannot be read (a storage error) counts as the one last read.
        """
        self.back_to = None
        target, problem = self._poll()
        held = self.reader.held
        keep = None if held is None else (held.key, held.manifest)
        if problem is None and target is None and self.memory.accepted is not None and self.reader.keys is not None \
                and self.memory.accepted.applies(head):
            # Only `--latest` clears a target in force (it writes one): a target that disappears
            # was deleted by someone without a key, or the bucket is being restored.
            problem = (f"the fleet target {TARGET_KEY!r} of {self.reader.url} is gone since generation "
                       f"{self.memory.accepted.generation}; keeping version {self.reader.version} (set one with `deltastore target`)")
        if problem is None and target is not None:
            problem = self._usable(target)
        if problem is not None:
            self._problem(problem)
            return keep
        if target is None or not target.applies(head):
            if target is not None and target.version is not None and target.lineage != head.lineage:
                self._problem(f"the fleet target of {self.reader.url} was set for another history (lineage "
                              f"{target.lineage}, HEAD's is {head.lineage}); following HEAD", error=False)
            else:
                self._clear()
            self.memory.accepted = target if target is not None else self.memory.accepted
            self._report(goal=head.version)
            return None
        try:
            got = self._resolve(target, head)
        except (VersionNotFoundError, CorruptObjectError, SignatureError, NotFoundError) as e:
            self._problem(f"the fleet target of {self.reader.url} ({target.describe()}) cannot be followed: "
                          f"{type(e).__name__}: {e}; keeping version {self.reader.version}")
            return keep
        self._clear()
        self.memory.accepted = target
        self._report(goal=got[1].version)
        self.back_to = got[0]
        return got

    def _poll(self) -> tuple[FleetTarget | None, str | None]:
        """The target object (a conditional GET), and why it is unusable as an object (None: usable)."""
        store = self.reader.store
        try:
            if self.memory.etag is None and store.head(TARGET_KEY).size > MAX_TARGET_BYTES:
                return None, f"the fleet target of {self.reader.url} is larger than {MAX_TARGET_BYTES} bytes: ignored"
            got = store.get_if_changed(TARGET_KEY, self.memory.etag)
        except NotFoundError:
            self.memory.etag, self.memory.read, self.memory.problem_of_read = None, None, None
            return None, None
        except StorageError as e:
            # The target is a hint beside HEAD: a failed read keeps what was last read (a
            # holding follower keeps holding) and is retried at the next poll.
            self._report(error=f"reading the fleet target: {type(e).__name__}: {e}")
            logger.debug("reading the fleet target of %s failed: %s", self.reader.url, e)
            return self.memory.read, self.memory.problem_of_read
        if got is not None:
            self.memory.etag = got.meta.etag
            try:
                self.memory.read, self.memory.problem_of_read = parse_target(got.data, got.meta.etag), None
            except (FormatError, CorruptObjectError) as e:
                self.memory.read, self.memory.problem_of_read = None, f"{e}; ignored"
            if self.memory.read is not None and self.reader.keys is not None:
                try:
                    verify_target(self.memory.read, self.reader.keys, self.reader.url)
                except SignatureError as e:
                    self.memory.read, self.memory.problem_of_read = None, str(e)
        return self.memory.read, self.memory.problem_of_read

    def _usable(self, target: FleetTarget) -> str | None:
        """Why a well-formed (and, with trusted keys, signed) target is not followed, or None."""
        last = self.memory.accepted
        if self.reader.keys is not None and last is not None and target.lineage == last.lineage \
                and target.generation < last.generation:
            return (f"the fleet target of {self.reader.url} is generation {target.generation}, older than generation "
                    f"{last.generation} this follower already followed (an old signed target written back): ignored, "
                    f"keeping version {self.reader.version}")
        return None

    def _resolve(self, target: FleetTarget, head: Head) -> tuple[str, Manifest]:
        """The target's version in HEAD's history (cached per target and HEAD)."""
        assert target.version is not None and head.manifest is not None
        if self.memory.resolved is not None and self.memory.resolved[:2] == (target.target_id, head.manifest):
            return self.memory.resolved[2]
        history = self.reader.history
        key, m = history.resolve(target.version, head)  # VersionCollectedError below the floor
        # A stream (SPEC §15) has manifests of its own at the same versions: the target names
        # the store's; the stream's manifest of that version is verified on its own.
        own = not _reads_a_stream(self.reader.store)
        if m.version != target.version or m.lineage != target.lineage or (own and key != target.manifest):
            raise VersionNotFoundError(f"version {target.version} of HEAD's history is {key!r} of lineage {m.lineage}, "
                                       f"not the target's {target.manifest!r}")
        self.memory.resolved = (target.target_id, head.manifest, (key, m))
        return key, m

    # --- moving -------------------------------------------------------------------------------

    def stage(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> StagedUpdate | None:
        """Stage the move of ``tensors`` from the held version to ``m``: forwards, or backwards
        when ``m`` is the target's version that :meth:`goal` returned (None: nothing to do, or a
        target of another layout, reported and kept from).

        Raises:
            The errors of :meth:`deltastore.Subscriber.stage` (HeadRolledBackError for an older
            version that is not the target's).
        """
        r = self.reader
        held = r.held
        self._report(stage=STAGE_FETCHING)
        try:
            if held is None or m.version >= held.manifest.version or key != self.back_to:
                staged = r.stage(key, m, tensors)  # forwards; an older HEAD is refused there
            else:
                staged = self._stage_back(key, m, tensors)
        except LayoutMismatchError as e:
            if held is None or key != self.back_to:
                self._report(stage=STAGE_SWAPPED)
                raise
            self._problem(f"the fleet target of {r.url} is version {m.version}, whose layout does not fit the "
                          f"tensors of version {held.manifest.version}: {e}; keeping version {held.manifest.version}")
            self._report(stage=STAGE_SWAPPED)
            return None
        except BaseException:
            self._report(stage=STAGE_SWAPPED)  # it still holds its version (the loop reports the error)
            raise
        self._report(stage=STAGE_STAGED if staged is not None else STAGE_SWAPPED)
        return staged

    def _stage_back(self, key: str, m: Manifest, tensors: dict[str, torch.Tensor]) -> StagedUpdate | None:
        """The staged update from the held version back to ``m`` (an older version of its
        history, checked by the caller): the chunks that differ, from ``m``'s anchor."""
        r = self.reader
        held = r.held
        assert held is not None
        r.check_same_history(key, m)
        ms = r.history.anchor_chain(key, m)
        specs = layout(ms[0][1])
        if specs != held.specs:
            raise LayoutMismatchError(f"version {m.version} of {r.url} has another layout than version "
                                      f"{held.manifest.version}")
        r.check_target(specs, tensors, against=f"version {held.manifest.version} held by this subscriber")
        plans = plan_changed_from_anchor(ms, specs, held.digests)
        before = r.engine.bytes_fetched
        patches, fetch_s, decode_s, spare = r.stage_plans(plans, specs, tensors, held.digests, held.manifest.version)
        logger.info("staged the move of %s back from version %d to %d (%d chunk(s) rebuilt)",
                    r.url, held.manifest.version, m.version, len(plans))
        return StagedUpdate(
            info=VersionInfo.from_manifest(m, key), from_version=held.manifest.version, patches=patches,
            bytes_fetched=r.engine.bytes_fetched - before, fetch_s=fetch_s, decode_s=decode_s,
            base_manifest=held.key, held=Held.of(ms), owner=r, spare=spare,
        )

    # --- reporting ----------------------------------------------------------------------------

    def applied(self) -> None:
        """A version was swapped in (or loaded whole): the worker holds it."""
        self._report(stage=STAGE_SWAPPED, error=None)

    def failed(self, error: BaseException) -> None:
        """A poll or a move failed (the loop keeps the version and retries): say so."""
        self._report(error=f"{type(error).__name__}: {error}")

    def _problem(self, message: str, *, error: bool = True) -> None:
        if message != self.memory.logged:
            logger.warning("%s", message)
            self.memory.logged = message
        if error:
            self._report(error=message)

    def _clear(self) -> None:
        if self.memory.logged is not None:
            self.memory.logged = None
            self._report(error=None)

    def _report(self, **changes: object) -> None:
        held = self.reader.version
        progress = replace(self.memory.progress, **changes)
        if progress.goal is not None and held is not None:
            progress = replace(progress, lag=abs(progress.goal - held))
        if progress.stage is None and held is not None:
            progress = replace(progress, stage=STAGE_SWAPPED)
        self.memory.progress = progress
        beats = self.reader.beats
        if beats is not None and not beats.closed:
            beats.report(progress)


def _reads_a_stream(store: object) -> bool:
    """Whether ``store`` is a serving stream's view, or a wrapper of one (a node cache)."""
    while store is not None:
        if isinstance(store, StreamView):
            return True
        store = getattr(store, "inner", None)
    return False


__all__ = ["TargetSteer"]
