"""The sharded publisher (SPEC §8, design 010): every rank publishes the rows it owns.

See :mod:`deltastore.write.sharded` for the steps of one publish; this module is the class the
ranks call. Planning lives in :mod:`~deltastore.write.sharded.planning`, a rank's part in
:mod:`~deltastore.write.sharded.part`, rank 0's commit in :mod:`~deltastore.write.sharded.coordinator`
and the collectives in :mod:`~deltastore.write.sharded.collectives`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import torch

from deltastore._util.jobs import default_threads
from deltastore.errors import (
    InvalidStateDictError,
    PartFailedError,
    ShardMismatchError,
    StorageError,
)
from deltastore.format.history import VersionInfo
from deltastore.format.models import Layout
from deltastore.layout.groups import tied_names, unit_reference
from deltastore.layout.tensors import TensorSpec, dtype_name, validate_state_dict
from deltastore.storage import open_store
from deltastore.storage.probe import require_atomic_writes
from deltastore.write.chain import VersionChain
from deltastore.write.commit import attempt_clock
from deltastore.write.encode import UPLOADS_IN_FLIGHT
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy, check_dtype, check_policy
from deltastore.write.publisher import metadata_of, step_of
from deltastore.write.sharded.collectives import (
    COORDINATOR,
    Collectives,
    error_of,
    exception_of,
    raise_reported,
)
from deltastore.write.sharded.coordinator import Coordinator
from deltastore.write.sharded.part import Part, RankPart
from deltastore.write.sharded.planning import (
    Claim,
    Plan,
    Report,
    Share,
    local_shard,
    plan_layout,
    preplan_holds,
    share_of,
)

logger = logging.getLogger(__name__)


class VersionFuture(Future):
    """The Future :meth:`ShardedPublisher.publish_async` returns. It is resolved by this rank's
    own next collective call (the outcome comes from rank 0 with it), so waiting for it with no
    timeout before that call would wait forever: that raises instead."""

    def result(self, timeout: float | None = None) -> Any:
        self._check(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check(timeout)
        return super().exception(timeout)

    def _check(self, timeout: float | None) -> None:
        if timeout is None and not self.done():
            raise InvalidStateError("this version's outcome reaches the ranks with their next publish_async, publish, "
                                    "flush or close (collectives): call flush() first, or pass a timeout")


class ShardedPublisher:
    """Publishes versions of a model whose rows are spread over the ranks of a process group.

    Create one on every rank with the same ``url``, ``group`` and policies; call
    :meth:`publish` on every rank for each version, in the same order (it is a collective).
    Each rank passes only what it holds: plain tensors (owned whole), :class:`Rows` (a row
    range of a larger tensor), or FSDP2 parameters (DTensors sharded on dimension 0; their
    ``to_local()`` rows are read, never gathered). Rows several ranks pass alike (replicas,
    buffers every rank holds) are published by the lowest of them. A rank keeps a reference
    copy of its own rows only.

    The version becomes visible by one HEAD compare-and-swap on rank 0, after every rank's part
    is stored; until then nothing is visible, whatever fails. Readers need nothing special: a
    :class:`~deltastore.read.subscriber.Subscriber` reads a sharded version whole, bit-exactly.
    :meth:`publish_async` returns once the rank's part is stored and lets rank 0 commit while
    the ranks encode the next version (design 010 D10).

    Args:
        url: the store URL (as for :class:`~deltastore.write.publisher.Publisher`).
        group: the ``torch.distributed`` process group (default: the world). Object
            collectives over it carry a few small Python objects per publish.
        storage_options: passed to the storage backend.
        dtype: as for Publisher: floating tensors are cast to it on every rank.
        signing_key: as for Publisher (rank 0 signs; a signed store without a key is refused
            on every rank).
        writer_policy: as for Publisher (:class:`~deltastore.write.policy.WriterPolicy`).
            Rank 0 claims the store (``takeover``) and probes it (``allow_unsafe_store``).
            ``writer_id`` defaults to ``host-pid-random-r<rank>`` and is recorded in the
            rank's part; ``threads`` are each rank's encode threads. ``resume``: when the ranks
            hold no reference copy of HEAD's version (a restarted job, or after a failure) and
            HEAD's layout is the one they plan now (same tensors, dtypes, shapes, row split and
            chunking), every rank reads back its own rows of HEAD's version, verified, so that
            the version is a delta (design 010 D11); if any rank fails to read, every rank drops
            what it read and the version is an anchor. ``skip_unchanged`` does not apply: every
            call commits a version.
        anchor_policy: as for Publisher (rank 0 decides anchors).
        layout_policy: ``chunk_bytes`` (chunk rows also divide every piece boundary, so no
            chunk crosses two ranks' rows), and ``slice_align`` with ``column_slices`` for the
            column grid only (design 011 D11): the tensors matching ``column_slices`` get the
            grid a Publisher gives them, chosen from their global shapes; row alignment stays
            the pieces'. Every rank must pass the same grid (ShardMismatchError at construction
            otherwise). Small tensors are never grouped (``group_small_tensors=True`` is refused).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError, TypeError: a bad ``dtype``, policy, or ``group_small_tensors=True``.
        ShardMismatchError: the ranks disagree on the column grid (nothing was written); from
            publish: on the layout, step or version.
        PartFailedError: another rank failed (here: to open the store); from publish: nothing
            was committed.
        Everything Publisher raises, on rank 0 and (re-raised by class) on the other ranks.

    Example::

        dist.init_process_group("gloo")
        fully_shard(model)
        pub = ShardedPublisher("s3://bucket/run", dtype=torch.bfloat16)
        for step in range(steps):
            train_step()
            pub.publish(model.state_dict(), step=step)  # every rank; DTensor shards, no gather
    """

    def __init__(
        self,
        url: str,
        *,
        group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        signing_key: Any = None,
        writer_policy: WriterPolicy = WriterPolicy(),
        anchor_policy: AnchorPolicy = AnchorPolicy(),
        layout_policy: LayoutPolicy = LayoutPolicy(),
    ):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ShardedPublisher needs torch.distributed initialised (init_process_group) on every rank")
        check_dtype(dtype)
        check_policy(writer_policy, WriterPolicy, "writer_policy")
        check_policy(anchor_policy, AnchorPolicy, "anchor_policy")
        check_policy(layout_policy, LayoutPolicy, "layout_policy")
        if layout_policy.group_small_tensors is True:
            raise ValueError("ShardedPublisher does not group small tensors (a sharded layout is per tensor): "
                             "pass LayoutPolicy(group_small_tensors=False) or leave it \"auto\"")
        self.collectives = Collectives(dist, group)
        self.group = group
        self.rank = self.collectives.rank
        self.world = self.collectives.world
        self.writer_policy = writer_policy
        self.anchor_policy = anchor_policy
        self.layout_policy = layout_policy
        self.writer_id = writer_policy.writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-r{self.rank}"
        self.dtype = dtype
        self.threads = writer_policy.threads or default_threads()
        self._coordinator: Coordinator | None = None
        # this rank's encode of an anchor without a base: its grid units' unit-order buffers and
        # specs, adopted as the reference copy once the version is committed (design 011 D3)
        self._fresh: tuple[Mapping[str, TensorSpec], dict[str, torch.Tensor]] | None = None
        self._closed = False
        self._reference: dict[str, torch.Tensor] | None = None  # this rank's rows of the held version
        self._held: tuple[int, str] | None = None  # (version, attempt) of the reference copy
        self._layout: Layout | None = None
        self._known: int | None = None
        # The layout planned from the last claims (and their digest): a trainer passes the same
        # claims every step, and planning is O(tensors × ranks) per version (every rank plans).
        self._planned: tuple[tuple[tuple[Claim, ...], ...], Layout, str] | None = None
        self._share: Share | None = None  # this rank's share of the layout planned last
        # publish_async (design 010 D10), every rank: the Futures it returned, by version, not
        # yet resolved, and its own error for a version whose part it failed to write.
        self._waiting: dict[int, VersionFuture] = {}
        self._own_errors: dict[int, BaseException] = {}
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-upload")
        error: tuple[str, str] | None = None
        self._open_error: BaseException | None = None
        try:
            self.store = None
            if self.rank == COORDINATOR:
                self._open_coordinator(url, storage_options, signing_key)
            else:
                self.store = open_store(url, storage_options=dict(storage_options or {}))
        except BaseException as e:  # noqa: BLE001 - every rank learns it below, then it is raised
            error = error_of(e)
            self._open_error = e
        # Every rank opens or none does: a rank left waiting in the first publish would hang.
        # The grid policy is a layout field every rank must agree on (design 011 D11).
        grid = (layout_policy.column_slices, layout_policy.slice_align if layout_policy.column_slices else None)
        opened = self.collectives.all_gather((error, grid))
        errors = [e for e, _ in opened]
        if any(errors):
            self._uploader.shutdown(wait=True)
            self._release()
            if self._open_error is not None:
                raise self._open_error
            raise_reported(next(e for e in errors if e is not None))
        grids = [g for _, g in opened]
        if any(g != grids[0] for g in grids):
            self._uploader.shutdown(wait=True)
            self._release()
            rank = next(r for r, g in enumerate(grids) if g != grids[0])
            (cols0, align0), (cols, align) = grids[0], grids[rank]
            raise ShardMismatchError(f"the ranks disagree on the column grid: rank 0 has column_slices={list(cols0)}, "
                                     f"slice_align={align0}, rank {rank} column_slices={list(cols)}, slice_align={align}; "
                                     "every rank must pass the same (nothing was written)")
        assert self.store is not None
        self.url = self.collectives.url = self.store.url
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-encode")
        self._part = RankPart(self.store, self.rank, self.writer_id, self.threads, self._pool, self._uploader)

    def _open_coordinator(self, url: str, storage_options: Mapping[str, Any] | None, signing_key: Any) -> None:
        """Rank 0: open and probe the store, claim it, refuse a signed one without a key."""
        key = None
        if signing_key is not None:
            from deltastore.format.signing import load_private_key

            key = load_private_key(signing_key)  # a bad key fails before any IO
        self.store = open_store(url, storage_options=dict(storage_options or {}))
        # the checks a Publisher makes before its first write (SPEC §1.1, §5)
        require_atomic_writes(self.store, allow_unsafe_store=self.writer_policy.allow_unsafe_store)
        chain = VersionChain(self.store, self.writer_id, anchors=self.anchor_policy,
                             max_attempt_s=self.writer_policy.max_attempt_s, signing_key=key,
                             allow_unsigned=self.writer_policy.allow_unsigned)
        chain.open(takeover=self.writer_policy.takeover)
        self._coordinator = Coordinator(chain, self.world, resume=self.writer_policy.resume, uploader=self._uploader)

    # --- publish ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest version this rank saw committed (0 before the first)."""
        return self._known or 0

    def publish(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None = None,
                metadata: Mapping[str, Any] | None = None, anchor: bool = False) -> VersionInfo:
        """Commit this rank's rows, with every other rank's, as the next version (a collective).

        Args:
            state_dict: what this rank holds: name → tensor, :class:`Rows` or DTensor (or an
                FSDP2-sharded ``nn.Module``). The tensors must not change while this runs.
            step: the trainer's step; every rank must pass the same.
            metadata: user JSON, taken from rank 0.
            anchor: write a full snapshot (any rank asking is enough).

        Returns:
            The committed version's VersionInfo (the same on every rank).

        Raises:
            ShardMismatchError: ranks disagree on a tensor's dtype/shape, who owns which rows,
                the step, or the version they hold; nothing was written.
            PartFailedError: another rank failed or was lost; nothing was committed.
            InvalidStateDictError, StorageError, ConflictError, FencedError, ...: as Publisher
                (this rank's own failure, or rank 0's commit outcome).
        """
        if self._waiting:  # every rank has the same ones: earlier publish_async calls report first
            self.flush()
        result = self._run(state_dict, step=step, metadata=metadata, anchor=anchor, asynchronous=False)
        assert isinstance(result, VersionInfo)
        return result

    def publish_async(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None = None,
                      metadata: Mapping[str, Any] | None = None, anchor: bool = False) -> Future[VersionInfo]:
        """Store this rank's rows of the next version and go on; rank 0 commits it in the
        background (a collective, design 010 D10).

        Runs :meth:`publish`'s steps up to rank 0 holding every part: when it returns, this
        rank's rows are encoded and uploaded, so the caller may change its tensors. Rank 0 then
        joins the parts and CASes HEAD on a thread of its own, one version at a time, in call
        order, while the ranks go on to the next version, which is planned on this one (a delta
        on it). The version becomes visible as with :meth:`publish`: once, when every part is
        stored, or never.

        The outcome reaches every rank with its next collective call on this publisher
        (``publish_async``, :meth:`publish`, :meth:`flush` or :meth:`close`): that call resolves
        the returned Future, and if the version failed it raises the failure (once; the call's
        own state is then not published) and every rank drops its reference copy, so the next
        version resumes from HEAD's (or is an anchor). A version planned on one that failed
        fails too (it was a delta on a version that is not in the store); its Future says so,
        and only the first failure is raised. Call :meth:`flush` (a collective) to wait for
        every outcome.

        Args:
            state_dict, step, metadata, anchor: as for :meth:`publish`.

        Returns:
            A Future of the committed version's VersionInfo, resolved on every rank by its next
            call on this publisher; ``result()`` without a timeout before then raises
            ``InvalidStateError`` (it would wait forever).

        Raises:
            What :meth:`publish` raises before it writes (bad input, ShardMismatchError, a plan
            failure), and an earlier version's failure (once). A failure while this rank
            encodes or uploads is this version's outcome, reported like a failed commit.
        """
        result = self._run(state_dict, step=step, metadata=metadata, anchor=anchor, asynchronous=True)
        assert isinstance(result, Future)
        return result

    def flush(self) -> None:
        """Wait until every :meth:`publish_async` version is committed or failed (a collective:
        rank 0 waits for its committer and tells every rank), and resolve their Futures.

        Raises:
            DeltastoreError: the first failure not yet raised (once).
        """
        if self._closed:
            raise StorageError(f"sharded publisher for {self.url} is closed")
        settled = self._coordinator.settle(block=True) if self._coordinator is not None else ()
        settled = self.collectives.broadcast(settled)
        failure = self._apply(settled)
        if failure is not None:
            raise failure

    def _run(self, state_dict: Mapping[str, Any] | torch.nn.Module, *, step: int | None, metadata: Mapping[str, Any] | None,
             anchor: bool, asynchronous: bool) -> VersionInfo | Future[VersionInfo]:
        if self._closed:
            raise StorageError(f"sharded publisher for {self.url} is closed")
        # The attempt deadline runs from before its first write (on rank 0: the layout object,
        # or its pre-plan, which writes nothing, made before step 1).
        deadline = attempt_clock() + self.writer_policy.max_attempt_s
        # --- 0: rank 0 collects the outcomes of earlier publish_async versions (D10) ---
        known = self._known  # what every rank reports: the outcomes below are applied after
        settled: tuple[tuple[int, Any], ...] = ()
        failure: BaseException | None = None
        coord = self._coordinator
        if coord is not None and coord.pending:
            settled = coord.settle(block=False)
            if any(outcome[0] != "ok" for _, outcome in settled):
                settled += coord.settle(block=True)  # the rest were planned on the failed one: they fail at once
            failure = self._apply(settled)
        # --- 1: what each rank holds (and, from rank 0, the plan of a steady-state version) ---
        local: dict[str, tuple[torch.Tensor, int]] = {}
        report: Report
        pre: Plan | None = None
        own_plan_error: BaseException | None = None
        try:
            step = step_of(step)
            meta = metadata_of(metadata) if self.rank == COORDINATOR else {}
            claims = []
            state = state_dict.state_dict() if isinstance(state_dict, torch.nn.Module) else state_dict
            if not isinstance(state, Mapping) or not state:
                raise InvalidStateDictError("expected a non-empty state dict (name → tensor, Rows or DTensor)")
            names: dict[torch.dtype, str] = {}
            given: dict[str, torch.Tensor] = {}  # as passed (before a cast): where ties are seen
            for name, value in state.items():
                t, start, shape = local_shard(name, value)
                given[name] = t
                if self.dtype is not None and t.is_floating_point():
                    t = t.detach().to(self.dtype)
                dt = t.dtype
                dname = names.get(dt) or names.setdefault(dt, dtype_name(dt))
                claims.append(Claim(name, dname, shape, start, start + (t.shape[0] if t.dim() else 1)))
                local[name] = (t, start)
            if self.layout_policy.column_slices:  # a tied tensor gets no grid (design 011 D6), on any rank
                tied = tied_names(given, max_bytes=None)
                claims = [dataclasses.replace(c, tied=True) if c.name in tied else c for c in claims]
            del given
            # One batched check of every local tensor (one scan, design 007's TensorScan), not
            # one call per tensor, paid per rank per version (design 010 D8).
            validate_state_dict({name: t for name, (t, _) in local.items()})
            if coord is not None and failure is None:
                try:
                    # on a version still being committed: planned on its forecast (D10)
                    preplan = coord.preplan_ahead if coord.pending else coord.preplan
                    pre = preplan(anchor=anchor, held=self._held, held_layout=self._layout)
                except Exception as e:  # noqa: BLE001 - raised on every rank after the layout checks
                    pre = Plan(error=error_of(e))
                    own_plan_error = e
            mine_claims = tuple(claims)
            last = self._planned
            same = last is not None and last[0][self.rank] == mine_claims  # then the digest says it
            if same:  # the stored tuple, equal: later comparisons with it (_share) are identity checks
                mine_claims = last[0][self.rank]  # type: ignore[union-attr]
            report = Report(self.rank, None if same else mine_claims, planned=last[2] if last is not None else None,
                             held=self._held, known=known, step=step, anchor=anchor, plan=pre, settled=settled)
        except Exception as e:  # noqa: BLE001 - told to every rank, raised below
            report = Report(self.rank, error=error_of(e), settled=settled)
            own: BaseException | None = e
        else:
            own = None
        reports: list[Report] = self.collectives.all_gather(report)
        if self.rank != COORDINATOR:
            failure = self._apply(reports[COORDINATOR].settled)
        if failure is not None:  # an earlier version failed: raised once, on every rank; this state is not published
            raise failure
        failed = [r for r in reports if r.error is not None]
        if failed:
            if own is not None:
                raise own
            raise_reported(failed[0].error, default=PartFailedError)  # type: ignore[arg-type]
        if all(r.claims is None for r in reports) and len({r.planned for r in reports}) == 1:
            # every rank: the claims of the layout every rank planned last (one digest)
            assert self._planned is not None
            layout = self._planned[1]
        else:
            reports = self._full_claims(reports, mine_claims)
            claimed = tuple(r.claims or () for r in reports)
            if self._planned is not None and self._planned[0] == claimed:
                layout = self._planned[1]
            else:
                policy = self.layout_policy  # the same verdict on every rank
                layout = plan_layout(reports, self.world, policy.chunk_bytes, policy.column_slices, policy.slice_align)
                self._planned = (claimed, layout, hashlib.sha256(repr(claimed).encode()).hexdigest())
        steps = {r.step for r in reports}
        if len(steps) > 1:
            raise ShardMismatchError(f"the ranks publish different steps {sorted(map(str, steps))}: every rank must "
                                     "call publish for the same step")
        known = {r.known for r in reports if r.known is not None}
        if len(known) > 1:
            raise ShardMismatchError(f"the ranks hold different versions {sorted(known)} of {self.url}: a rank missed a "
                                     "publish; nothing was written")
        share = self._share_of(layout, mine_claims, local)
        mine = {name: local[name][0] for name in share.specs}

        # --- 2: rank 0 plans the version (unless its pre-plan holds: no round trip then) ---
        plan: Plan | None = reports[COORDINATOR].plan
        if plan is not None and plan.error is not None:
            if self.rank == COORDINATOR:
                own = own_plan_error
        elif plan is None or not preplan_holds(plan, reports, self._layout, layout):
            plan = None
            if coord is not None:
                # Planning reads and writes the chain: the committer must be done with it.
                waited = coord.settle(block=True) if coord.pending else ()
                failure = self._apply(waited)
                try:
                    plan = Plan(settled=waited) if failure is not None else dataclasses.replace(
                        coord.plan(reports, layout, anchor=any(r.anchor for r in reports)), settled=waited)
                except Exception as e:  # noqa: BLE001
                    plan = Plan(error=error_of(e), settled=waited)
                    own = e
            plan = self.collectives.broadcast(plan)
            assert plan is not None
            if self.rank != COORDINATOR:
                failure = self._apply(plan.settled)
            if failure is not None:
                raise failure
        assert plan is not None
        if plan.error is not None:
            self._drop()
            if own is not None:
                raise own
            raise_reported(plan.error)
        if plan.resume is not None:  # --- 2b: every rank reads its rows of HEAD's version (D11) ---
            plan = self._resume_from(plan, layout, share)
            # Nothing of the attempt is written yet (a resume reuses HEAD's layout object), and
            # reading a large shard back takes a while: the attempt deadline runs from here.
            deadline = attempt_clock() + self.writer_policy.max_attempt_s

        # --- 3: encode and upload this rank's part ---
        result: tuple[str, Any]
        try:
            result = ("ok", self._write_part(plan, layout, mine, share))
        except Exception as e:  # noqa: BLE001
            result = ("error", error_of(e))
            own = e
        except BaseException as e:  # KeyboardInterrupt & co: tell the others, then leave
            self._drop()
            self.collectives.gather(("error", error_of(e)))
            raise

        # --- 4 and 5: rank 0 joins the parts and commits (publish_async: in the background) ---
        try:
            return self._conclude(plan, layout, mine, result, own, meta, step, deadline, asynchronous=asynchronous)
        except BaseException:
            # The version failed, or a rank was lost and its outcome is unknown here: encoding
            # advanced the reference to rows no committed version may hold (SPEC §5 step 7).
            self._drop()
            raise

    def _conclude(self, plan: Plan, layout: Layout, mine: Mapping[str, torch.Tensor], result: tuple[str, Any],
                  own: BaseException | None, meta: dict[str, Any], step: int | None, deadline: float, *,
                  asynchronous: bool) -> VersionInfo | Future[VersionInfo]:
        """Steps 4 and 5: the parts to rank 0, which commits (publish) or hands them to its
        committer (publish_async); raises the version's failure on every rank."""
        parts = self.collectives.gather(result)
        if asynchronous:
            return self._launch(plan, layout, mine, parts, own, meta, step, deadline)
        outcome: tuple[str, Any] = ("error", ("PartFailedError", "no outcome"))
        if self._coordinator is not None:
            assert parts is not None
            bad = [(r, p[1]) for r, p in enumerate(parts) if p[0] != "ok"]
            if bad:
                why = f"part {bad[0][0]} of version {plan.version} failed ({bad[0][1][0]}: {bad[0][1][1]}); nothing was committed"
                outcome = ("error", ("PartFailedError", why))
            else:
                try:
                    outcome = ("ok", self._coordinator.commit(plan, layout, [p[1] for p in parts], meta, step, deadline))
                except Exception as e:  # noqa: BLE001
                    outcome = ("error", error_of(e))
                    own = e
        outcome = self.collectives.broadcast(outcome)
        if outcome[0] != "ok":
            if own is not None:
                raise own
            raise_reported(outcome[1])
        info: VersionInfo = outcome[1]
        self._known = info.version
        self._held = (info.version, plan.attempt)
        self._layout = layout
        if not plan.has_base:  # an anchor without a base: these rows are the reference from now on
            self._reference = self._new_reference(mine)
        return info

    def _new_reference(self, mine: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reference copy after an anchor without a base: this rank's rows copied to the
        CPU, a grid unit in its unit order (the buffers its encode gathered into: no extra
        pass, design 011 D3)."""
        specs, gathered = self._fresh if self._fresh is not None else ({}, {})
        self._fresh = None
        out = unit_reference(mine, specs, owned=False, gathered=gathered) if specs else {}
        for n, t in mine.items():  # not reached for a part just encoded: its specs name every tensor
            if n not in out:
                out[n] = t.detach().to("cpu", copy=True)
        return out

    def _full_claims(self, reports: list[Report], mine: tuple[Claim, ...]) -> list[Report]:
        """``reports`` (in rank order) with every rank's claims: those sent as a digest are the
        claims of the layout planned last, which every rank holds when every report names the
        same digest; else (a rank planned another layout, or none) one more round sends every
        rank's claims. The choice depends on the reports only, so every rank makes it alike."""
        reports = sorted(reports, key=lambda r: r.rank)
        if all(r.claims is not None for r in reports):
            return reports
        digests = {r.planned for r in reports}
        if len(digests) == 1 and None not in digests:  # this rank's digest among them: _planned is that
            assert self._planned is not None
            last = self._planned[0]
            return [r if r.claims is not None else dataclasses.replace(r, claims=last[r.rank]) for r in reports]
        full = self.collectives.all_gather(mine)
        return [dataclasses.replace(r, claims=full[r.rank]) for r in reports]

    def _share_of(self, layout: Layout, claims: tuple[Claim, ...], local: Mapping[str, tuple[torch.Tensor, int]]) -> Share:
        """What this rank publishes of ``layout`` (:func:`~deltastore.write.sharded.planning.share_of`),
        made once per layout and claims, then reused (design 010 D8): every publish builds its
        claims anew from the tensors and compares them with the last ones anyway (to send a
        digest). The layout object is replaced whenever any rank's claims change."""
        last = self._share
        if last is not None and last.layout is layout and last.claims == claims:
            if last.claims is not claims:  # keep the tuple publish passes: the next check is by identity
                self._share = last = dataclasses.replace(last, claims=claims)
            return last
        self._share = share_of(layout, claims, local, self.rank)
        return self._share

    def _write_part(self, plan: Plan, layout: Layout, mine: Mapping[str, torch.Tensor], share: Share) -> Part:
        """Step 3: this rank's part, encoded on its reference copy (a delta) or without one."""
        reference = self._reference if plan.has_base else None
        if plan.has_base and (reference is None or set(reference) != set(mine)):
            raise ShardMismatchError(f"rank {self.rank} holds no reference copy of its rows for version {plan.version - 1}")
        gathered: dict[str, torch.Tensor] = {}  # grid units' reference buffers, filled by an anchor without a base
        self._fresh = None
        part = self._part.write(plan, layout, mine, share, reference, gathered)
        if reference is None:
            self._fresh = (share.specs, gathered)
        return part


    def _launch(self, plan: Plan, layout: Layout, mine: Mapping[str, torch.Tensor], parts: list[Any] | None,
                own: BaseException | None, meta: dict[str, Any], step: int | None, deadline: float) -> Future[VersionInfo]:
        """Step 5 of :meth:`publish_async`, every rank: hold the version as committed (the next
        one is planned on it; a failure reported later drops it) and return its Future; rank 0
        hands the parts to its committer thread."""
        future = VersionFuture()
        self._waiting[plan.version] = future
        if own is not None:  # this rank's part failed: its own error is the version's, for this rank
            self._own_errors[plan.version] = own
            self._drop()
        else:
            self._held = (plan.version, plan.attempt)
            self._layout = layout
            if not plan.has_base:  # the caller may change its tensors once this returns
                self._reference = self._new_reference(mine)
        if self._coordinator is not None:
            assert parts is not None
            self._coordinator.hand_over(plan, layout, parts, meta, step, deadline)
        return future

    def _apply(self, settled: Sequence[tuple[int, Any]]) -> BaseException | None:
        """Every rank: resolve the Futures of ``settled`` outcomes; a failure drops the
        reference copy (it holds rows of a version that is not in the store). Returns the
        first failure to raise (one planned on a failed version is only its Future's)."""
        first: BaseException | None = None
        for version, (status, value) in settled:
            future = self._waiting.pop(version, None)
            own = self._own_errors.pop(version, None)
            if status == "ok":
                self._known = value.version
                if future is not None:
                    future.set_result(value)
                continue
            self._drop()
            exc = own if own is not None else exception_of(value)
            if future is not None:
                future.set_exception(exc)
            if status == "error" and first is None:
                first = exc
        return first

    def _drop(self) -> None:
        """Forget the reference copy: encoding advances it in place, so after a failure it
        matches no version (SPEC §5 step 7); the next version resumes from HEAD's version
        (design 010 D11) or is an anchor."""
        self._reference = None
        self._held = None
        self._fresh = None

    def _resume_from(self, plan: Plan, layout: Layout, share: Share) -> Plan:
        """Step 2b, every rank: rebuild the reference copy of this rank's rows at the version
        ``plan.resume`` names (unless held already), then agree: the plan if every rank did, else
        the same version as an anchor, every rank having dropped what it read. No rank ever holds
        another version than the others (design 010 D11)."""
        point = plan.resume
        assert point is not None
        reference: dict[str, torch.Tensor] | None = None
        verdict: tuple[str, tuple[str, str] | None] = ("ok", None)
        fetched = 0
        try:
            if self._held != (point.version, point.commit_id) or self._reference is None:
                reference, fetched = self._part.read_rows(point, layout, share)
        except Exception as e:  # noqa: BLE001 - every rank learns it below: an anchor then
            verdict = ("failed", error_of(e))
        except BaseException as e:  # KeyboardInterrupt & co: the others give the version up, then leave
            self._drop()
            self.collectives.all_gather(("lost", error_of(e)))
            raise
        verdicts = self.collectives.all_gather(verdict)
        lost = [(rank, v[1]) for rank, v in enumerate(verdicts) if v[0] == "lost"]
        if lost:  # a rank is leaving: nothing was written, so the version is given up on every rank
            self._drop()
            raise PartFailedError(f"rank {lost[0][0]} of the sharded publisher of {self.url} stopped while reading its "
                                  f"rows back ({lost[0][1][0]}: {lost[0][1][1]}); nothing was written")
        failed = [(rank, v[1]) for rank, v in enumerate(verdicts) if v[0] == "failed"]
        if failed:
            self._drop()
            rank, (name, message) = failed[0]
            logger.warning("sharded version %d of %s: an anchor, not a delta on version %d: rank %d could not read its "
                           "rows back (%s: %s)", plan.version, self.url, point.version, rank, name, message)
            return dataclasses.replace(plan, kind="anchor", has_base=False, resume=None)
        if reference is not None:
            self._reference = reference
            logger.info("rank %d resumed from version %d of %s: its rows of %d tensors, %d bytes read", self.rank,
                        point.version, self.url, len(reference), fetched)
        self._held = (point.version, point.commit_id)
        self._layout = layout
        return dataclasses.replace(plan, resume=None)

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release threads and the store (not a collective). Idempotent.

        Rank 0 first waits for the versions its committer holds and resolves its Futures; the
        other ranks cannot learn those outcomes without a collective, so their unresolved
        Futures raise PartFailedError saying so (call :meth:`flush` on every rank before
        closing to learn them everywhere).

        Raises:
            DeltastoreError: on rank 0, a publish_async failure not yet raised (once).
        """
        self._close(raise_errors=True)

    def _close(self, *, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        try:
            if self._coordinator is not None and self._coordinator.pending:
                failure = self._apply(self._coordinator.settle(block=True))
            for version, future in self._waiting.items():
                future.set_exception(PartFailedError(
                    f"version {version} of {self.url}: its outcome had not reached rank {self.rank} when the publisher "
                    "closed (flush, a collective, reports it to every rank); HEAD says whether it was committed"))
            self._waiting.clear()
        finally:
            if self._coordinator is not None:
                self._coordinator.close()
            self._pool.shutdown(wait=True)
            self._uploader.shutdown(wait=True)
            self._release()
        if failure is not None:
            if raise_errors:
                raise failure
            logger.error("sharded publisher of %s closed with a failure not reported: %s", self.url, failure)

    def _release(self) -> None:
        self._reference = None
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None
        store, self.store = getattr(self, "store", None), None
        if store is not None:
            store.close()

    def __enter__(self) -> ShardedPublisher:  # noqa: PYI034 - as Publisher
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close(raise_errors=exc_type is None)
