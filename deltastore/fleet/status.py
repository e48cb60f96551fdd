"""What ``deltastore status`` says of a fleet: the target in force and each worker's readiness.

A worker is *ready within N* (``deltastore status URL --worker ID --ready-within N``, the
readiness probe of docs/fleet.md) when all of these hold:

1. it has a heartbeat under ``workers/<ID>.json`` (SPEC §10) that is live: its state is not
   ``stopped`` and the store received it within the TTL (3 minutes by default);
2. its heartbeat's lineage is HEAD's (or not recorded);
3. the version it holds is at most N versions away from the *goal*: the fleet target's
   version while a target applies (SPEC §1.2), else HEAD's. Away in either direction: a
   worker still above a target that moved the fleet back is not at its goal either.

Nothing here imports torch (``deltastore status`` moves no tensors).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from deltastore.errors import CorruptObjectError, FormatError, SignatureError
from deltastore.fleet.ledger import LIVE_TTL_S, Heartbeat
from deltastore.fleet.target import FleetTarget, goal_version, read_target, verify_target
from deltastore.format.models import Head
from deltastore.storage.base import Store

if TYPE_CHECKING:
    from deltastore.format.signing import TrustedKeys


@dataclass(frozen=True)
class TargetState:
    """The fleet target as ``deltastore status`` sees it.

    Attributes:
        target: the target object read (None: none set, or unreadable).
        problem: why followers ignore it (unreadable, unsigned or forged with trusted keys);
            None when it is usable or absent.
        goal: the version followers should hold now (the target's while it applies, else HEAD's).
    """

    target: FleetTarget | None
    problem: str | None
    goal: int

    @property
    def applies(self) -> bool:
        """A usable target is in force (followers hold its version instead of HEAD's)."""
        return self.target is not None and self.problem is None and self.goal == self.target.version \
            and self.target.version is not None


def target_state(store: Store, head: Head | None, keys: TrustedKeys | None = None) -> TargetState:
    """Read ``store``'s fleet target and decide what it means under ``head``.

    With ``keys``, a target not signed by one of them is reported as a problem and counts as
    none (the goal is then HEAD's; followers holding a version keep it).

    Raises:
        StorageError: the target could not be read.
    """
    head_version = 0 if head is None else head.version
    try:
        target = read_target(store)
    except (CorruptObjectError, FormatError) as e:
        return TargetState(None, str(e), head_version)
    if target is None or head is None:
        return TargetState(target, None, head_version)
    if keys is not None:
        try:
            verify_target(target, keys, store.url)
        except SignatureError as e:
            return TargetState(target, str(e), head_version)
    return TargetState(target, None, goal_version(target, head))


@dataclass(frozen=True)
class Readiness:
    """Whether one worker is ready (see the module docstring).

    Attributes:
        worker: its id.
        ready: the verdict.
        version: the version its heartbeat says it holds (None: no heartbeat).
        goal: the version it should hold.
        distance: versions between ``version`` and ``goal`` (None: no heartbeat).
        reason: one line saying why (for the probe's log).
    """

    worker: str
    ready: bool
    version: int | None
    goal: int
    distance: int | None
    reason: str


def readiness(beats: Iterable[Heartbeat], worker: str, head: Head | None, goal: int, within: int, *,
              now: datetime | None = None, ttl_s: float = LIVE_TTL_S) -> Readiness:
    """Whether ``worker`` is live and holds ``goal`` give or take ``within`` versions.

    Args:
        beats: the ledger (:func:`deltastore.fleet.ledger.read_ledger`).
        worker: the worker's id.
        head: the store's HEAD (None: an empty store, where nobody is ready).
        goal: the version to hold (:attr:`TargetState.goal`).
        within: the versions of distance still called ready (0: exactly ``goal``).
        now, ttl_s: liveness as :meth:`Heartbeat.live` judges it.

    Example::

        r = readiness(read_ledger(store), "serve-3", head, target_state(store, head).goal, 1)
        sys.exit(0 if r.ready else 1)
    """
    if within < 0:
        raise ValueError(f"within must be 0 or more, got {within}")
    beat = next((b for b in beats if b.worker == worker), None)
    if head is None or head.manifest is None:
        return Readiness(worker, False, None if beat is None else beat.version, goal, None, "the store has no version yet")
    if beat is None:
        return Readiness(worker, False, None, goal, None, f"worker {worker!r} has no heartbeat (not started, or not following)")
    if beat.stopped:
        return Readiness(worker, False, beat.version, goal, None, f"worker {worker!r} stopped following")
    if not beat.live(now, ttl_s):
        return Readiness(worker, False, beat.version, goal, None,
                         f"worker {worker!r} was last heard from {beat.age_s(now):.0f} s ago (TTL {ttl_s:.0f} s)")
    if beat.lineage is not None and beat.lineage != head.lineage:
        return Readiness(worker, False, beat.version, goal, None,
                         f"worker {worker!r} holds version {beat.version} of another history (lineage {beat.lineage})")
    distance = abs(goal - beat.version)
    ok = distance <= within
    error = "" if beat.progress.error is None else f"; last error: {beat.progress.error}"
    # a worker of a serving format the trainer no longer publishes stays at its last version
    fmt = "" if beat.serving_format is None else f" of format {beat.serving_format}"
    reason = (f"worker {worker!r} holds version {beat.version}{fmt}, {distance} from version {goal} "
              f"({'within' if ok else 'more than'} {within}){error}")
    return Readiness(worker, ok, beat.version, goal, distance, reason)


__all__ = ["Readiness", "TargetState", "readiness", "target_state"]
