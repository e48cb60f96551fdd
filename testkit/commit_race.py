"""Publishers racing for HEAD on one store, and a worker checking every version they made.

Used by the backend tests (a few rounds) and by ``python -m benchmarks.cas_race`` (a thousand):
each round, ``publishers`` Publishers (each with its own store client) publish an edit of the
same version at once and are held at their HEAD write until all are there, so every round is
one contested compare-and-swap. Exactly one must win; the others must lose with a plain
ConflictError. Afterwards a Subscriber walks the log and ``pull_into`` s every version, which
must be bit-exact with what its winner published.

Example::

    outcome = race_publishers(target, rounds=4, publishers=4)
    assert outcome.clean, outcome
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from testkit.stores import HeadPutHook
from testkit.targets import StoreTarget
from testkit.tensors import small_state, sparse_edit

__all__ = ["RaceOutcome", "race_publishers"]

#: How long a publisher waits at HEAD for the others before writing anyway (one of them failed
#: before reaching HEAD: its round is still a race of the rest).
HEAD_MEET_TIMEOUT_S = 20.0
#: Versions between anchors: a publisher that lost a round reads the winner's version back,
#: from the latest anchor on; a fixed cadence keeps a round's cost flat over a thousand versions.
ANCHOR_EVERY = 20


@dataclass
class RaceOutcome:
    """What a race counted.

    Attributes:
        rounds: contested commits attempted (one per round).
        publishers: publishers racing in each round.
        double_wins: rounds in which more than one publisher committed (a forked history).
        no_wins: rounds in which nobody committed.
        conflicts: publishes that lost with a plain ConflictError (the expected answer).
        wrong_errors: exceptions other than a plain ConflictError, by type name.
        versions: versions in the store's log at the end.
        bit_exact: versions a worker pulled and found bit-exact with what their winner published.
        mismatches: versions that were not (version numbers).
        log_ok: the log is 1..versions, each the child of the one before, each by its round's winner.
        seconds: wall time of the races (not the check).
    """

    rounds: int
    publishers: int
    double_wins: int = 0
    no_wins: int = 0
    conflicts: int = 0
    wrong_errors: Counter[str] = field(default_factory=Counter)
    versions: int = 0
    bit_exact: int = 0
    mismatches: list[int] = field(default_factory=list)
    log_ok: bool = False
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        """No double win, no wrong error, a linear log, every version bit-exact."""
        return (
            self.double_wins == 0
            and not self.wrong_errors
            and self.log_ok
            and not self.mismatches
            and self.bit_exact == self.versions
        )


def race_publishers(target: StoreTarget, rounds: int, publishers: int = 4, *, rows: int = 16,
                    progress: Callable[[int], None] | None = None) -> RaceOutcome:
    """Race ``publishers`` publishers for ``rounds`` contested commits on ``target``, then check
    the store's log and every version's bits with a worker (see the module docstring).
    ``progress(rounds_done)`` is called after each round."""
    from deltastore import ConflictError, Publisher, Subscriber
    from deltastore.write.policy import AnchorPolicy, WriterPolicy

    outcome = RaceOutcome(rounds=rounds, publishers=publishers)
    at_head = threading.Barrier(publishers)
    start = threading.Barrier(publishers)

    def meet_at_head(key, data, mode, real_put):
        try:
            at_head.wait(timeout=HEAD_MEET_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass
        return real_put()

    stores = [HeadPutHook(target.open(), meet_at_head) for _ in range(publishers)]
    # takeover=False: the racers are peers, not a newer trainer fencing an older one;
    # skip_unchanged=False: every round must reach HEAD.
    pubs = [
        Publisher(target.url, store=store, writer_policy=WriterPolicy(takeover=False, threads=1, skip_unchanged=False),
                  anchor_policy=AnchorPolicy(every=ANCHOR_EVERY))
        for store in stores
    ]
    rng = np.random.default_rng(0)
    base = small_state(0, n=2, rows=rows)
    published: list[tuple[str, dict]] = []  # per committed version: (writer id, state)

    def attempt(i: int, state: dict):
        start.wait(timeout=HEAD_MEET_TIMEOUT_S)
        try:
            return pubs[i].publish(state, step=i)
        except Exception as e:  # counted: a ConflictError is the expected answer for losers
            return e

    began = time.monotonic()
    try:
        with ThreadPoolExecutor(publishers) as pool:
            for _ in range(rounds):
                at_head.reset()
                states = [sparse_edit(base, rng, 0.05) for _ in range(publishers)]
                results = list(pool.map(attempt, range(publishers), states))
                winners = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
                for r in results:
                    if type(r) is ConflictError:
                        outcome.conflicts += 1
                    elif isinstance(r, Exception):
                        outcome.wrong_errors[type(r).__name__] += 1
                if len(winners) > 1:
                    outcome.double_wins += 1
                if not winners:
                    outcome.no_wins += 1
                    continue
                w = winners[0]
                published.append((pubs[w].writer_id, states[w]))
                base = states[w]
                if progress is not None:
                    progress(len(published))
    finally:
        outcome.seconds = time.monotonic() - began
        for p in pubs:
            p.close()
        for s in stores:
            s.close()

    with Subscriber(target.url, storage_options=target.storage_options, threads=2) as sub:
        log = sub.log()
        outcome.versions = len(log)
        outcome.log_ok = (
            [i.version for i in log] == list(range(1, len(log) + 1))
            and [i.parent for i in log] == [None] + list(range(1, len(log)))
            and len(log) == len(published)
            and [i.writer for i in log] == [writer for writer, _ in published]
        )
        if log:
            held = sub.pull(1)
            for v in range(1, len(log) + 1):
                if v > 1:
                    sub.pull_into(held, version=v)
                if v - 1 < len(published) and _bits_equal(held, published[v - 1][1]):
                    outcome.bit_exact += 1
                else:
                    outcome.mismatches.append(v)
    return outcome


def _bits_equal(got: dict, want: dict) -> bool:
    import torch

    if set(got) != set(want):
        return False
    for name, tensor in want.items():
        other = got[name]
        if other.dtype != tensor.dtype or other.shape != tensor.shape:
            return False
        if not torch.equal(other.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)):
            return False
    return True
