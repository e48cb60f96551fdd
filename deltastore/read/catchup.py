"""Catching up (SPEC §7.5, design 005 D6): which path from the held version to a newer one.

Candidate paths from the held version h to version t: the chain ``(h, t]``; each usable squash
from h plus the chain from its ``to``; the anchor of t (its full segments, less the chunks
already at their digest at t, plus the chain after it). The cheapest by bytes is planned, per
chunk as :func:`deltastore.read.plan.plan_forward` does. Planning reads manifests (through
:class:`~deltastore.format.history.History`) and squash manifests, never a pack: the plan it
returns is a value that :class:`deltastore.read.engine.ReadEngine` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltastore.errors import (
    CorruptObjectError,
    FormatError,
    HistoryReplacedError,
    IntegrityError,
    NotFoundError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.format.history import History
from deltastore.format.models import Index, Manifest, SquashManifest, SquashRef
from deltastore.format.objects import decode_object
from deltastore.layout.tensors import TensorSpec
from deltastore.layout.tied import recorded_aliases
from deltastore.read.plan import (
    ChunkPlan,
    Manifests,
    chain_price,
    check_squash,
    digests,
    full_bytes,
    layout,
    plan_changed_from_anchor,
    plan_forward,
    plan_from_anchor,
    squash_as_manifest,
)

logger = logging.getLogger(__name__)

#: Chunk digests of a version: ``(unit, chunk index)`` → state digest.
Digests = dict[tuple[str, int], str]
#: Checks the user's tensors against a layout: ``check(specs, tensors, against=..., tied=...)``.
CheckTarget = Callable[..., None]


@dataclass(frozen=True)
class Held:
    """What a subscriber keeps of the version it holds: its manifest, the layout and one digest
    per chunk. Its size is the model's chunk count, whatever the number of versions followed
    (the manifests of the anchor span are not kept)."""

    key: str
    manifest: Manifest
    specs: dict[str, TensorSpec]
    digests: Digests

    @classmethod
    def of(cls, ms: Manifests) -> Held:
        """From an anchor's chain up to the held version (oldest first)."""
        key, m = ms[-1]
        return cls(key, m, layout(ms[0][1]), digests(ms))


@dataclass(frozen=True)
class Update:
    """A planned fast-forward: plans, the layout they use, the digests the target must hold
    first, what is held afterwards, and the squash it reads (None: none)."""

    plans: list[ChunkPlan]
    specs: dict[str, TensorSpec]
    base: Digests
    held: Held
    squash: SquashRef | None = None


def history_replaced(url: str, version: int | None, why: str) -> HistoryReplacedError:
    """The error for a store whose history is no longer the one the held ``version`` is of."""
    return HistoryReplacedError(
        f"the history of {url} was replaced (HEAD deleted or restored, then another run published): {why}; "
        f"this subscriber holds version {version} of the old history and nothing was applied. "
        "Open a new Subscriber or call pull() to read the new history"
    )


def relaid(fwd: Manifests, held: Held) -> bool:
    """An anchor in ``fwd`` was written without deltas and with another layout than the held one
    (a restarted publisher with other settings): it cannot be bridged chunk by chunk."""
    return any(mm.kind == "anchor" and mm.delta_base is None and layout(mm) != held.specs for _, mm in fwd)


class CatchUp:
    """Plans one subscriber's updates: the path chosen, and the squashes that failed it.

    Args:
        history: the store's manifests (checked as the subscriber requires).
        url: the store, for messages.
        use_squashes: consider squash manifests at all (they are unsigned hints: a subscriber
            that requires signatures does not use them, SPEC §12).
    """

    def __init__(self, history: History, url: str, *, use_squashes: bool):
        self.history = history
        self.url = url
        self.use_squashes = use_squashes
        #: squashes that failed for the held version (cleared when it changes)
        self.bad_squashes: set[str] = set()
        self._collected_logged: int | None = None  # the held version last logged as collected

    def refuse(self, ref: SquashRef, error: BaseException) -> None:
        """Never plan through squash ``ref`` again for the held version (it failed: ``error``)."""
        logger.warning("squash %d→%d (%s) failed: %s; planning without it", ref.from_, ref.to, ref.key, error)
        self.bad_squashes.add(ref.key)

    def plan(self, held: Held | None, key: str, m: Manifest, tensors: dict[str, torch.Tensor],
             index: Index | None, check: CheckTarget) -> Update:
        """The plans that bring ``tensors`` from ``held`` (version h) to ``m`` (version t).

        The cheapest candidate path by bytes is planned. When h was collected (below the
        ``index``'s floor), only the anchor path (and squashes from a pinned h) remain; with
        nothing held, everything is planned from t's anchor. ``check`` (the subscriber's target
        check) runs first, against the layout the update starts from.
        """
        if held is None:
            ms = self.history.anchor_chain(key, m)
            specs = layout(ms[0][1])
            check(specs, tensors, against=f"version {m.version} of {self.url}", tied=recorded_aliases(m.metadata))
            return Update(plan_from_anchor(ms, specs), specs, {}, Held.of(ms))
        h = held.manifest.version
        check(held.specs, tensors, against=f"version {h} held by this subscriber",
              tied=recorded_aliases(held.manifest.metadata))
        floor = 1 if index is None else index.floor
        below = h < floor
        if below and self._collected_logged != h:
            logger.info("version %d was collected (floor %d); catching up from anchor %d", h, floor, m.anchor)
            self._collected_logged = h

        def between(low: int) -> Manifests:  # versions low+1 .. t, oldest first
            return [] if low >= m.version else self.history.chain(key, m, down_to=low + 1)

        cands: list[tuple[int, int, str, SquashRef | None]] = []  # (bytes, rank, path, squash)
        if not below:
            try:
                cands.append((chain_price(held.manifest, m, lambda: between(h)), 0, "chain", None))
            except VersionNotFoundError:
                # the chain starts after h: a serving stream published again after a pause
                # starts a new chain at an anchor (SPEC §15), which the anchor path reaches
                if m.anchor <= h:
                    raise
        pinned = index is not None and any(p.version == h for p in index.pins)
        for ref in self._squash_refs(index, m, h):
            if below and not (pinned and ref.to >= floor):
                continue
            try:
                to_m = between(ref.to - 1)[0][1] if ref.to < m.version else m
                cands.append((ref.bytes + chain_price(to_m, m, lambda r=ref: between(r.to)), 1, "squash", ref))
            except NotFoundError:
                if not below:
                    raise
        if m.anchor > h:
            a_m = self._anchor_of(m, between)
            cands.append((full_bytes(a_m) + chain_price(a_m, m, lambda: between(m.anchor)), 2, "anchor", None))
        if not cands:
            raise VersionNotFoundError(
                f"no way from version {h} to {m.version} of {self.url}: {h} was collected (floor {floor}) and "
                f"version {m.version}'s anchor {m.anchor} is not after it; pull() it"
            )
        cands.sort(key=lambda c: (c[0], c[1]))
        logger.debug("catch-up %d→%d candidates (bytes, path): %s", h, m.version, [(c[0], c[2]) for c in cands])
        for _, _, path, ref in cands:
            if path == "squash":
                assert ref is not None
                upd = self._plan_squash(ref, key, m, held, between)
                if upd is not None:
                    return upd
                continue
            if path == "chain":
                fwd = between(h)
                if fwd[0][1].parent_manifest != held.key:
                    raise history_replaced(self.url, h, f"version {fwd[0][1].version} does not follow the held "
                                                        f"manifest {held.key!r}")
                # An anchor written without deltas and with another chunking cannot be bridged
                # chunk by chunk: replace everything from it.
                if not relaid(fwd, held):
                    plans = plan_forward(fwd, held.specs, held.digests)
                    return Update(plans, held.specs, held.digests, Held(key, m, held.specs, {**held.digests, **digests(fwd)}))
            return self._plan_anchor(key, m, held, tensors, check)
        raise AssertionError("unreachable: the anchor path always plans")  # pragma: no cover

    def _anchor_of(self, m: Manifest, between: Callable[[int], Manifests]) -> Manifest:
        """``m``'s anchor manifest, to price the anchor path: one GET through
        ``anchor_manifest`` (schema 3), so that pricing reads no manifest of the chain in
        between (design 005 D6); the chain walk only without that pointer, or when it names
        another version (pricing is a hint; the anchor path checks every link it plans)."""
        if m.kind == "anchor" and m.version == m.anchor:
            return m
        if m.anchor_manifest is not None:
            a = self.history.manifest(m.anchor_manifest)
            if a.version == m.anchor and a.kind == "anchor" and a.lineage == m.lineage:
                return a
            logger.warning("version %d's anchor_manifest %r is version %d (%s), not its anchor %d; walking the chain",
                           m.version, m.anchor_manifest, a.version, a.kind, m.anchor)
        return between(m.anchor - 1)[0][1]

    def _plan_anchor(self, key: str, m: Manifest, held: Held, tensors: dict[str, torch.Tensor],
                     check: CheckTarget) -> Update:
        """From ``m``'s anchor: only the chunks whose held digest differs from their digest at
        ``m`` are fetched (the others are kept, checked against the held digests)."""
        ms = self.history.anchor_chain(key, m)
        specs = layout(ms[0][1])
        if specs != held.specs:  # another layout: everything from the anchor
            check(specs, tensors, against=f"version {m.version} of {self.url}", tied=recorded_aliases(m.metadata))
            return Update(plan_from_anchor(ms, specs), specs, {}, Held.of(ms))
        return Update(plan_changed_from_anchor(ms, specs, held.digests), specs, held.digests, Held.of(ms))

    def _squash_refs(self, index: Index | None, m: Manifest, h: int) -> list[SquashRef]:
        """Squashes from the held version ``h`` to at most ``m`` (the index's and ``m``'s own),
        except those that already failed for ``h``."""
        out: dict[str, SquashRef] = {}
        if not self.use_squashes:
            return []
        for ref in [*(index.squashes if index is not None else ()), *m.squashes]:
            if ref.from_ == h and h < ref.to <= m.version and ref.key not in self.bad_squashes:
                out.setdefault(ref.key, ref)
        return list(out.values())

    def _plan_squash(self, ref: SquashRef, key: str, m: Manifest, held: Held,
                     between: Callable[[int], Manifests]) -> Update | None:
        """Plan through squash ``ref`` then the chain after its ``to``; None (logged, and the
        squash not tried again for this held version) when it cannot be read or does not fit."""
        try:
            try:
                data = self.history.store.get(ref.key)
            except NotFoundError:
                raise NotFoundError(f"squash manifest {ref.key!r} is missing") from None
            sq: SquashManifest = decode_object(SquashManifest, data, ref.key, ref.sha256)
            check_squash(ref.key, sq, held.specs)
            tail = between(ref.to)
            to_key = tail[0][1].parent_manifest if tail else key
            if (sq.from_, sq.to) != (ref.from_, ref.to) or sq.from_manifest != held.key or sq.to_manifest != to_key:
                raise CorruptObjectError(
                    f"squash manifest {ref.key!r} is {sq.from_}→{sq.to} from {sq.from_manifest!r} to {sq.to_manifest!r}, "
                    f"not {ref.from_}→{ref.to} from the held {held.key!r} to {to_key!r}"
                )
            if sq.lineage is not None and m.lineage is not None and sq.lineage != m.lineage:
                raise CorruptObjectError(f"squash manifest {ref.key!r} belongs to lineage {sq.lineage}, not {m.lineage}")
            if relaid(tail, held):
                raise CorruptObjectError(f"the layout changes after version {ref.to}")
            ms = [(ref.key, squash_as_manifest(ref.key, sq, held.specs)), *tail]
            # planned inside the try: a squash whose tables do not fit is skipped like one that
            # cannot be read (a fault of the tail is raised again by the plan without it)
            plans = plan_forward(ms, held.specs, held.digests)
        except (StorageError, FormatError, IntegrityError) as e:
            if isinstance(e, StorageError) and not isinstance(e, NotFoundError):
                raise  # transient: the caller retries the whole update (a ref's key was checked when it was parsed)
            logger.warning("not using squash %d→%d (%s): %s; planning without it", ref.from_, ref.to, ref.key, e)
            self.bad_squashes.add(ref.key)
            return None
        logger.info("catching up %d→%d through squash %d→%d (%d bytes)", held.manifest.version, m.version, ref.from_, ref.to, ref.bytes)
        return Update(plans, held.specs, held.digests, Held(key, m, held.specs, {**held.digests, **digests(ms)}), ref)

