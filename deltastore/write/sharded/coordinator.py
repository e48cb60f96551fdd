"""Rank 0 of a sharded publish (SPEC §8, design 010): plan each version on the store's chain,
join and commit the parts, and commit ``publish_async`` versions on a thread of its own.

The :class:`Coordinator` adds versions through the one :class:`~deltastore.write.chain.VersionChain`
(claim, fencing, anchors, skip pointers, signing, lost responses), as a Publisher does; it never
encodes a state itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from deltastore.format.history import VersionInfo
from deltastore.format.models import Head, Layout, Stats
from deltastore.format.manifest import encode_joined, join_parts
from deltastore.format.keys import new_attempt_id
from deltastore.write.chain import Draft, Tip, VersionChain, next_tip
from deltastore.write.commit import put_immutable
from deltastore.write.sharded.collectives import done, error_of
from deltastore.write.sharded.part import Part
from deltastore.write.sharded.planning import Plan, Report, Resume

logger = logging.getLogger(__name__)

#: Versions of ``publish_async`` rank 0 holds at once between the gather and HEAD (one
#: committing, one waiting): a store slower than the ranks makes the next call wait on rank 0,
#: instead of parts piling up (each holds its part manifests, and a deadline runs).
COMMITS_IN_FLIGHT = 2

#: A version's outcome as rank 0 tells it: ("ok", VersionInfo), ("error", reported error), or
#: ("after", reported error) for a version planned on one that failed.
Outcome = tuple[str, Any]


@dataclass(frozen=True)
class Forecast:
    """What the store will hold once the last version handed to the committer is committed:
    the version (and attempt) the next one builds on, and its tip (design 010 D10)."""

    version: int
    attempt: str
    lineage: str | None
    tip: Tip


def draft_of(plan: Plan, tip: Tip | None) -> Draft:
    """The chain's draft of ``plan`` on ``tip``."""
    return Draft(version=plan.version, kind=plan.kind, has_base=plan.has_base, attempt=plan.attempt,  # type: ignore[arg-type]
                 lineage=plan.lineage, tip=tip)  # type: ignore[arg-type]


class Coordinator:
    """Rank 0's side of a sharded publisher.

    Args:
        chain: the store's version chain, opened (claimed) by the caller.
        world: the number of ranks (parts).
        resume: plan a delta on HEAD's version read back by every rank (design 010 D11).
        uploader: the threads that upload the part manifests and the version manifest.
    """

    def __init__(self, chain: VersionChain, world: int, *, resume: bool, uploader: ThreadPoolExecutor):
        self.chain = chain
        self.world = world
        self.resume = resume
        self.uploader = uploader
        self.url = chain.url
        # publish_async (design 010 D10): the versions handed to the committer thread (or failed
        # before it), in order, with the Future of each one's outcome; the forecast of the store
        # once they commit; whether one failed (those after it, planned on it, then fail too).
        self.pending: list[tuple[int, Future[Outcome]]] = []
        self._committer: ThreadPoolExecutor | None = None
        self._forecast: Forecast | None = None
        self._broken = False

    # --- planning ---------------------------------------------------------------------------

    def preplan(self, *, anchor: bool, held: tuple[int, str] | None, held_layout: Layout | None) -> Plan | None:
        """Before step 1: the plan step 2 would make in the steady state (the next version on
        the layout and base of the last one this rank committed, ``held`` on ``held_layout``),
        sent with rank 0's report so that step 2 needs no broadcast when every report confirms
        it (:func:`~deltastore.write.sharded.planning.preplan_holds`; design 010 D6). Writes
        nothing.

        Returns None when there is no such base (nothing committed yet, a failure dropped the
        reference, HEAD moved under us): step 2 then plans from the reports.
        Raises what :meth:`CommitProtocol.prepare` raises (fenced, an outcome still unknown).
        """
        chain = self.chain
        if chain.prepare():
            return None
        head = chain.head
        if held is None or held_layout is None or head is None or held != (head.version, head.commit_id):
            return None
        tip = chain.tip()
        if tip is None or tip.layout_ref is None or tip.layout != held_layout:
            return None
        version = chain.version + 1
        why = chain.anchor_reason(version, tip, has_base=True, requested=anchor)
        return Plan(version=version, attempt=new_attempt_id(), kind="anchor" if why else "delta", has_base=True,
                    lineage=chain.commits.lineage_for_commit(), layout_ref=tip.layout_ref, base=held)

    def preplan_ahead(self, *, anchor: bool, held: tuple[int, str] | None, held_layout: Layout | None) -> Plan | None:
        """Before step 1 while a version is being committed: the plan of the next one on it,
        from its forecast (the chain is the committer's meanwhile). None (then step 2 waits for
        the committer and plans from HEAD) unless every rank will hold the forecast version on
        its layout and no failure is known."""
        f = self._forecast
        if f is None or self._broken or held != (f.version, f.attempt) or held_layout is None or f.tip.layout != held_layout:
            return None
        version = f.version + 1
        why = self.chain.anchor_reason(version, f.tip, has_base=True, requested=anchor)
        return Plan(version=version, attempt=new_attempt_id(), kind="anchor" if why else "delta", has_base=True,
                    lineage=f.lineage, layout_ref=f.tip.layout_ref, base=(f.version, f.attempt), ahead=True)

    def plan(self, reports: Sequence[Report], layout: Layout, *, anchor: bool) -> Plan:
        """Step 2: read HEAD, decide the version, its kind and attempt; write a new layout."""
        chain = self.chain
        chain.prepare()
        head = chain.head
        head_key = head.manifest if head is not None else None
        tip = chain.tip()
        chain.require_key(tip)  # HEAD may have moved to a signed version since open; before any write
        version = chain.version + 1
        # A delta needs every rank's reference at HEAD's version and HEAD's layout.
        has_base = (
            head_key is not None and tip is not None and tip.layout == layout
            and all(r.held == (head.version, head.commit_id) for r in reports)  # type: ignore[union-attr]
        )
        resume = None
        if not has_base and self.resume and not anchor and head is not None and head_key is not None:
            resume = self.resume_point(head, tip, layout, version)
            has_base = resume is not None
        why = chain.anchor_reason(version, tip, has_base=has_base, requested=anchor)
        attempt = new_attempt_id()
        layout_ref = chain.layout_ref(attempt, layout, tip)
        logger.info("sharded version %d of %s: %s over %d parts%s%s", version, self.url, "anchor" if why else "delta",
                    self.world, f" ({why})" if why else "",
                    f" on version {resume.version}, resumed from the store" if resume is not None else "")
        return Plan(version=version, attempt=attempt, kind="anchor" if why else "delta", has_base=has_base,
                    lineage=chain.commits.lineage_for_commit(), layout_ref=layout_ref, resume=resume)

    def resume_point(self, head: Head, tip: Tip | None, layout: Layout, version: int) -> Resume | None:
        """HEAD's version, when the ranks may rebuild their reference copies from it (its
        layout is the one they plan now, and the version would be a delta on it); else None (an
        anchor), with one line saying why (design 010 D11)."""
        why = None
        if tip is None or not tip.chained or tip.layout is None:
            why = "it carries no chain of deltas to continue"
        elif tip.layout != layout:
            fields = ("parts", "name", "dtype", "shape", "piece_parts", "pieces", "chunk_rows", "chunk_cols")
            differ = next((f for f in fields if getattr(tip.layout, f) != getattr(layout, f)), "schema")
            why = (f"its layout differs from the one the ranks plan now (its {differ}: another world size, tensors, "
                   "row split or chunk size)")
        else:
            policy = self.chain.anchor_reason(version, tip, has_base=True, requested=False)
            if policy is not None:
                why = f"version {version} is an anchor anyway ({policy})"
        if why is not None:
            logger.info("sharded publisher of %s not resuming from version %d: %s", self.url, head.version, why)
            return None
        assert head.manifest is not None
        return Resume(version=head.version, commit_id=head.commit_id, manifest=head.manifest,
                      sha256=head.manifest_sha256, lineage=head.lineage)

    # --- commit (step 5) ------------------------------------------------------------------------

    def commit(self, plan: Plan, layout: Layout, parts: Sequence[Part], meta: dict[str, Any], step: int | None,
               deadline: float) -> VersionInfo:
        """Step 5: join and check the parts, write the version manifest, CAS HEAD."""
        # The part manifests go up first, in parallel (each rank's bytes came with step 4);
        # joining, signing and encoding the version manifest overlap them.
        uploads = [self.uploader.submit(put_immutable, self.chain.store, p.ref.key, p.data, f"part manifest {p.ref.part}")
                   for p in parts]
        try:
            return self._commit_parts(plan, layout, parts, meta, step, deadline, uploads)
        finally:
            for u in uploads:  # none outlives the attempt (an error in joining leaves them running)
                u.cancel()
            wait(uploads)

    def _commit_parts(self, plan: Plan, layout: Layout, parts: Sequence[Part], meta: dict[str, Any],
                      step: int | None, deadline: float, uploads: list[Future[None]]) -> VersionInfo:
        chain = self.chain
        draft = draft_of(plan, chain.tip())
        refs = [p.ref for p in parts]
        changed = {n for p in parts for n in p.changed}
        delta_bytes = sum(p.stats.delta_bytes or 0 for p in parts)
        full_bytes = sum(p.stats.full_bytes or 0 for p in parts)
        kind = plan.kind
        total = len(layout.name)
        stats = Stats(
            bytes_stored=delta_bytes + full_bytes, delta_bytes=delta_bytes, full_bytes=full_bytes,
            tensors_changed=total if kind == "anchor" and not plan.has_base else len(changed),
            elements_changed=sum(p.stats.elements_changed for p in parts),
            tensors_total=total, elements_total=sum(math.prod(s) for s in layout.shape),
        )
        assert plan.layout_ref is not None
        header = chain.header(draft, layout, plan.layout_ref, step=step, metadata=meta, stats=stats, parts=tuple(refs))
        datas = {p.ref.key: p.data for p in parts}
        early: bytes | None = None
        if chain.signing_key is None:
            # An unsigned sharded version is stored as its header and part list (SPEC §8), which
            # the join does not change: its bytes are known now, and their upload overlaps the
            # join as the part manifests' do (design 010 D9). If the join refuses the parts, the
            # manifest is an unreferenced object, as after a failed HEAD write (SPEC §5 step 6):
            # HEAD names it only after the join and every upload succeeded.
            early = encode_joined(header, layout, header)
            unsigned = chain.seal(header, early)
            uploads.append(self.uploader.submit(put_immutable, chain.store, unsigned.key, early, "manifest"))
        joined = join_parts(header, layout, datas)  # the reader's checks, before anything is visible
        manifest = chain.sign(joined)
        # Not encode_manifest: it would join every part again to check what join_parts checked.
        sealed = chain.seal(manifest, encode_joined(manifest, layout, joined))
        if early is not None and sealed.data != early:  # not reached: the join decodes the header as it is
            raise ValueError(f"sharded version {plan.version}: the joined version does not store as its header "
                             "did; nothing was committed")
        if early is None:
            put_immutable(chain.store, sealed.key, sealed.data, "manifest")
        for u in uploads:
            u.result()  # the manifest and every part manifest are stored before HEAD names the version
        # Superseded (landed, another writer on top) needs nothing here: no rank's reference is HEAD's then,
        # and the next plan reads HEAD.
        chain.commit(draft, sealed, layout, deadline=deadline, stored=True)
        logger.info("published sharded version %d (%s, %d parts): %d bytes (%d delta, %d full)", plan.version, kind,
                    len(refs), stats.bytes_stored, delta_bytes, full_bytes)
        return VersionInfo.from_manifest(manifest, sealed.key)

    # --- publish_async (design 010 D10) -----------------------------------------------------

    def hand_over(self, plan: Plan, layout: Layout, parts: list[Any], meta: dict[str, Any], step: int | None,
                  deadline: float) -> None:
        """Queue the version's commit (at most COMMITS_IN_FLIGHT at once), or record its failure
        when a part failed, for the next call to report."""
        bad = [(r, p[1]) for r, p in enumerate(parts) if p[0] != "ok"]
        if bad:
            why = f"part {bad[0][0]} of version {plan.version} failed ({bad[0][1][0]}: {bad[0][1][1]}); nothing was committed"
            self._broken = True  # nothing is planned on it
            self.pending.append((plan.version, done(("error", ("PartFailedError", why)))))
            return
        good = [p[1] for p in parts]
        try:
            forecast = self._forecast_after(plan, layout, good)
        except Exception as e:  # noqa: BLE001 - reading HEAD's tip failed: the version's outcome
            self._broken = True
            self.pending.append((plan.version, done(("error", error_of(e)))))
            return
        while sum(not f.done() for _, f in self.pending) >= COMMITS_IN_FLIGHT:
            wait([next(f for _, f in self.pending if not f.done())])
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltastore-commit")
        self._forecast = forecast
        self.pending.append((plan.version, self._committer.submit(
            self._commit_later, plan, layout, good, meta, step, deadline)))

    def _forecast_after(self, plan: Plan, layout: Layout, parts: Sequence[Part]) -> Forecast:
        """The store once ``plan`` commits. A plan made ahead builds on the forecast it was
        planned on; any other was planned with the committer idle, so HEAD's tip is read."""
        if plan.ahead:
            assert self._forecast is not None
            tip: Tip | None = self._forecast.tip
        else:
            tip = self.chain.tip()
        delta = sum(p.stats.delta_bytes or 0 for p in parts)
        full = sum(p.stats.full_bytes or 0 for p in parts)
        return Forecast(version=plan.version, attempt=plan.attempt, lineage=plan.lineage,
                        tip=next_tip(draft_of(plan, tip), layout, plan.layout_ref, delta_bytes=delta, full_bytes=full, key=""))

    def _commit_later(self, plan: Plan, layout: Layout, parts: Sequence[Part], meta: dict[str, Any],
                      step: int | None, deadline: float) -> Outcome:
        """The committer thread: step 5 of one version (the chain is this thread's until the
        main thread has taken every outcome). A version planned on one that failed is not
        committed: its base is not in the store."""
        if self._broken:
            return ("after", ("PartFailedError", f"version {plan.version} was planned on version {plan.version - 1}, "
                                                 "which was not committed; nothing was committed"))
        try:
            return ("ok", self.commit(plan, layout, parts, meta, step, deadline))
        except Exception as e:  # noqa: BLE001 - the version's outcome, reported by the next call
            self._broken = True
            logger.warning("sharded version %d of %s was not committed: %s: %s", plan.version, self.url, type(e).__name__, e)
            return ("error", error_of(e))

    def settle(self, *, block: bool) -> tuple[tuple[int, Outcome], ...]:
        """The outcomes of the queued versions, oldest first: those done (``block``: all,
        waiting for the committer). Once none is queued, a failure no longer taints the next
        plan (which reads HEAD again)."""
        out = []
        while self.pending:
            version, fut = self.pending[0]
            if not block and not fut.done():
                break
            out.append((version, fut.result()))
            self.pending.pop(0)
        if not self.pending:
            self._broken = False
        return tuple(out)

    def close(self) -> None:
        """Stop the committer thread (after the versions it holds)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)


__all__ = ["COMMITS_IN_FLIGHT", "Coordinator", "Forecast", "draft_of"]
