"""One version chain (SPEC §3, §5; design 005 D6/D7/D10): how every writer adds a version.

A :class:`VersionChain` is one writer's side of one store's history. It knows what the next
version needs of the one it builds on (a :class:`Tip`), decides anchors by the writer's
:class:`~deltastore.write.policy.AnchorPolicy`, writes or reuses the layout object, assembles
the manifest header (parent, kind, anchor, skip pointers, chain start, cumulative bytes,
lineage, epoch, attempt deadline), signs, stores the manifest and commits HEAD through the one
:class:`~deltastore.write.commit.CommitProtocol`. The Publisher, the ShardedPublisher's rank 0
and the federated BasedWriter all add versions through it; what crosses between them are the
frozen values below, never the chain's state::

    chain = VersionChain(store, writer_id, anchors=AnchorPolicy(), max_attempt_s=21600)
    chain.open(takeover=True)                  # read HEAD, refuse a signed store without a key, claim
    tip = chain.tip()                          # what HEAD's version passes on
    why = chain.anchor_reason(v, tip, has_base=True, requested=False)
    draft = chain.draft(v, "anchor" if why else "delta", has_base=True, tip=tip)
    ref = chain.layout_ref(draft.attempt, layout, tip)
    header = chain.header(draft, layout, ref, step=step, metadata={}, stats=stats, blobs=..., tensors=...)
    sealed = chain.seal(chain.sign(header), encode_manifest(...))
    chain.commit(draft, sealed, layout, deadline=deadline)   # manifest put, HEAD CAS, tip advanced
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from deltastore.errors import NotFoundError, SigningRequiredError
from deltastore.format.history import History
from deltastore.format.models import STREAMS_SCHEMA, BaseRef, Head, Layout, Manifest, ObjectRef, Stats, StreamRef
from deltastore.format.objects import encode_object
from deltastore.format.keys import (
    manifest_key,
    manifest_key_version,
    new_attempt_id,
    object_key,
    sha256_hex,
)
from deltastore.storage.base import Store
from deltastore.write.commit import CommitProtocol, now, put_immutable
from deltastore.write.policy import AnchorPolicy

logger = logging.getLogger(__name__)

#: Manifests whose skip-pointer links (key, parent key, ``back``) a chain keeps: the ``back``
#: list of version v is derived from those of v−1, v−2, v−4, … (design 005 D6), so the recent
#: ones are read from memory and only older levels cost a manifest read.
LINK_CACHE_ENTRIES = 64

Kind = Literal["anchor", "delta"]


@dataclass(frozen=True)
class Tip:
    """What the next version needs to know of the version it builds on (HEAD's).

    Attributes:
        version, key: the version and its manifest key.
        chained: it carries the chain fields (anchor, chain start, layout, byte counts), so the
            next version may be a delta on it; False (a based version, or a manifest lacking
            them): the next version starts a chain (design 005 D10) and the chain fields below
            are unused.
        chain_start, cum: its chain start and ``cum_delta_bytes``.
        layout, layout_ref: its layout and the object that holds it (a based version's too).
        anchor, anchor_key, anchor_full, anchor_cum: its anchor's version, manifest key, full
            bytes and ``cum_delta_bytes``.
        signed_by: the key id of its signature (None: unsigned).
        streams: its serving streams (SPEC §15): each stream's next version builds on its own.
    """

    version: int
    key: str
    chained: bool
    chain_start: int = 0
    cum: int = 0
    layout: Layout | None = None
    layout_ref: ObjectRef | None = None
    anchor: int = 0
    anchor_key: str | None = None
    anchor_full: int = 0
    anchor_cum: int = 0
    signed_by: str | None = None
    streams: tuple[StreamRef, ...] = ()


@dataclass(frozen=True)
class Draft:
    """A version being built on ``tip``: its place in the chain, fixed before any byte of it
    is written.

    Attributes:
        version: its number (HEAD's + 1).
        kind: ``"anchor"`` or ``"delta"``.
        has_base: its segments are deltas on ``tip``'s state (or an anchor written with one).
        attempt: the attempt id, its commit id: every object of the attempt is under it (D1).
        lineage: the store's lineage (a new one on an empty store).
        tip: the version it builds on (None: the store has none).
        base: a based version's base in another store (design 009; it starts its own chain).
    """

    version: int
    kind: Kind
    has_base: bool
    attempt: str
    lineage: str
    tip: Tip | None
    base: BaseRef | None = None

    @property
    def restarts(self) -> bool:
        """The chain of composable deltas restarts here: a version without a base, a based
        version, or one on a tip that carries no chain (design 005 D10)."""
        return self.base is not None or not self.has_base or self.tip is None or not self.tip.chained


@dataclass(frozen=True)
class Sealed:
    """A signed manifest and its stored bytes, under the key those bytes name."""

    manifest: Manifest
    data: bytes
    key: str
    digest: str


def next_tip(draft: Draft, layout: Layout, layout_ref: ObjectRef | None, *, delta_bytes: int, full_bytes: int,
             key: str, signed_by: str | None = None) -> Tip:
    """The tip once ``draft`` is committed (design 005 D7/D10 bookkeeping): what a chain keeps
    after a commit, and what a sharded rank 0 forecasts before one (``key`` unknown then: "")."""
    if draft.base is not None:
        return Tip(version=draft.version, key=key, chained=False, layout=layout, layout_ref=layout_ref, signed_by=signed_by)
    tip = draft.tip
    restart = draft.restarts
    cum = 0 if restart else tip.cum + delta_bytes  # type: ignore[union-attr]
    anchor = draft.kind == "anchor"
    assert anchor or tip is not None  # a delta builds on a tip
    return Tip(
        version=draft.version, key=key, chained=True, chain_start=draft.version if restart else tip.chain_start,  # type: ignore[union-attr]
        cum=cum, layout=layout, layout_ref=layout_ref, anchor=draft.version if anchor else tip.anchor,  # type: ignore[union-attr]
        anchor_key=key if anchor else tip.anchor_key,  # type: ignore[union-attr]
        anchor_full=full_bytes if anchor else tip.anchor_full,  # type: ignore[union-attr]
        anchor_cum=cum if anchor else tip.anchor_cum,  # type: ignore[union-attr]
        signed_by=signed_by,
    )


@dataclass(frozen=True)
class _Link:
    """A manifest's links, all the skip-pointer derivation needs of it."""

    version: int
    parent_key: str | None
    back: tuple[str, ...]


class VersionChain:
    """One writer's side of a store's chain of versions (see the module docstring).

    Args:
        store: the store (the caller owns it).
        writer_id: recorded in manifests and HEAD.
        anchors: when a version is an anchor.
        max_attempt_s: the attempt deadline, recorded (rounded up) in every manifest.
        signing_key: a loaded Ed25519 private key to sign every manifest with, or None.
        allow_unsigned: build unsigned versions on a signed one (else SigningRequiredError).

    Attributes:
        commits: the HEAD protocol (claim, CAS, lost responses, fencing) of this writer.
        history: the store's history (manifests, layouts, HEAD), cached.
    """

    def __init__(self, store: Store, writer_id: str, *, anchors: AnchorPolicy, max_attempt_s: float,
                 signing_key: Any = None, allow_unsigned: bool = False):
        self.store = store
        self.writer_id = writer_id
        self.anchors = anchors
        self.max_attempt_s = max_attempt_s
        self.signing_key = signing_key
        self.allow_unsigned = allow_unsigned
        self.history = History(store)
        self.commits = CommitProtocol(store, self.history, writer_id)
        self._tip: Tip | None = None
        self._links: dict[str, _Link] = {}  # bounded: LINK_CACHE_ENTRIES

    # --- HEAD -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def head(self) -> Head | None:
        """The HEAD this writer last wrote or read (None on an empty store)."""
        return self.commits.head

    @property
    def version(self) -> int:
        """The latest version known to be committed (0 for an empty store)."""
        return self.commits.version

    @property
    def epoch(self) -> int:
        """This writer's epoch (SPEC §4)."""
        return self.commits.epoch

    def open(self, *, takeover: bool) -> None:
        """Read HEAD; refuse to continue a signed store without a key (before the claim writes
        anything, unless ``allow_unsigned``); with ``takeover``, claim the store.

        Raises:
            SigningRequiredError: the head version is signed and this writer has no key.
            FencedError: another writer claimed the store between our read and our claim.
            CommitUnknownError: the claim's HEAD write failed and HEAD could not be read back.
        """
        self.commits.open(takeover=False)
        if self.signing_key is None and not self.allow_unsigned:
            self.require_key(self.tip())  # the tip read here is the one the first version needs
        if takeover:
            self.commits.claim()

    def prepare(self) -> bool:
        """Before building a version: raise if fenced, settle an earlier unknown outcome.
        True when HEAD moved under this writer (see :meth:`CommitProtocol.prepare`)."""
        moved = self.commits.prepare()
        if moved:
            self._tip = None
        return moved

    def tip(self) -> Tip | None:
        """The :class:`Tip` of HEAD's version: kept from this writer's last commit, else read
        (after a restart, a resume or another writer's commit). None: no version yet."""
        head = self.commits.head
        if head is None or head.manifest is None:
            self._tip = None
            return None
        if self._tip is not None and self._tip.key == head.manifest:
            return self._tip
        top = self.history.head_manifest(head)
        assert top is not None  # HEAD names a manifest
        key, m = top
        self._remember(key, m)
        self._tip = replace(self._tip_of(key, m), streams=tuple(m.streams))
        return self._tip

    def require_key(self, tip: Tip | None) -> None:
        """Refuse to build on a signed version ``tip`` without a key (unless
        ``allow_unsigned``): its unsigned successors would stop every subscriber that trusts the
        store's key.

        Raises:
            SigningRequiredError: nothing was written.
        """
        if tip is None or tip.signed_by is None or self.signing_key is not None or self.allow_unsigned:
            return
        raise SigningRequiredError(
            f"{self.url} is signed (version {tip.version}, {tip.key!r}, by key {tip.signed_by}) but this publisher has no "
            "signing_key: subscribers that trust that key would refuse its unsigned versions. Pass signing_key "
            "(the store's private key), or allow_unsigned=True to publish unsigned versions anyway; nothing was written"
        )

    def adopt(self, head: Head | None, *, epoch: int) -> None:
        """Take ``head`` as this chain's HEAD without reading or writing one: the chain of a
        serving stream (SPEC §15), whose versions its store's HEAD write commits. The next
        :meth:`header` builds on ``head``'s version, with ``epoch``."""
        if head is None or self._tip is None or self._tip.key != head.manifest:
            self._tip = None
        self.commits.head = head
        self.commits.epoch = epoch

    def land(self, draft: Draft, sealed: Sealed, layout: Layout) -> None:
        """Record ``sealed`` (already stored) as committed by its store's HEAD write, not by this
        chain (a serving stream's version, SPEC §15): the next version builds on it."""
        m = sealed.manifest
        self.commits.head = Head(version=draft.version, manifest=sealed.key, manifest_sha256=sealed.digest,
                                 commit_id=draft.attempt, writer=self.writer_id, epoch=self.commits.epoch,
                                 updated=m.created, lineage=draft.lineage, index=None)
        self._remember(sealed.key, m)
        self._tip = next_tip(draft, layout, m.layout, delta_bytes=m.stats.delta_bytes or 0,
                             full_bytes=m.stats.full_bytes or 0, key=sealed.key,
                             signed_by=None if m.signature is None else m.signature.key_id)

    # --- the next version -------------------------------------------------------------------

    def anchor_reason(self, version: int, tip: Tip | None, *, has_base: bool, requested: bool,
                      no_base: str = "no base") -> str | None:
        """Why ``version`` on ``tip`` must be an anchor (None: it is a delta), design 005
        D7/D10: ``requested``, no base (``no_base`` words why), a tip without a chain, then the
        anchor policy, counted from ``tip``'s anchor."""
        if requested:
            return "requested"
        if not has_base:
            return no_base
        if tip is None or not tip.chained:
            return "first version of a chain"  # every anchor span is homogeneous (D10)
        policy = self.anchors
        if policy.every is not None and version - tip.anchor >= policy.every:
            return f"every {policy.every} versions"
        if policy.rule == "cost":
            since = tip.cum - tip.anchor_cum  # delta bytes written since the anchor (C)
            if since > 0 and since >= policy.cost_ratio * tip.anchor_full:
                return f"{since} delta bytes since anchor {tip.anchor} ≥ {policy.cost_ratio:g} × its {tip.anchor_full} full bytes"
        return None

    def draft(self, version: int, kind: Kind, *, has_base: bool, tip: Tip | None, base: BaseRef | None = None,
              attempt: str | None = None) -> Draft:
        """A :class:`Draft` of ``version`` on ``tip``: a new attempt id (unless given) and the
        store's lineage (HEAD's, or a new one on an empty store)."""
        return Draft(version=version, kind=kind, has_base=has_base, attempt=attempt or new_attempt_id(),
                     lineage=self.commits.lineage_for_commit(), tip=tip, base=base)

    def layout_ref(self, attempt: str, layout: Layout, tip: Tip | None) -> ObjectRef:
        """The layout object of a version of ``layout``: ``tip``'s when equal (reused, SPEC §1),
        else a new one written under ``attempt``."""
        if tip is not None and tip.layout is not None and tip.layout == layout and tip.layout_ref is not None:
            return tip.layout_ref
        data = encode_object(layout)
        digest = sha256_hex(data)
        key = object_key(attempt, digest, ".layout.json.zst")
        put_immutable(self.store, key, data, "layout")
        return ObjectRef(key=key, sha256=digest)

    def header(self, draft: Draft, layout: Layout, layout_ref: ObjectRef, *, step: int | None,
               metadata: dict[str, Any], stats: Stats, **content: Any) -> Manifest:
        """The manifest of ``draft`` (unsigned): its chain fields from the draft and HEAD,
        ``stats`` with the cumulative delta bytes, and ``content`` (``blobs`` and ``tensors``,
        or a sharded version's ``parts``)."""
        head = self.commits.head
        version, tip = draft.version, draft.tip
        based = draft.base is not None
        restart = draft.restarts
        cum = 0 if restart else tip.cum + (stats.delta_bytes or 0)  # type: ignore[union-attr]
        parent_key = head.manifest if head is not None else None
        own_anchor = draft.kind == "anchor" or based  # a based version is its own chain's anchor
        if based:
            content["base"] = draft.base
        streamed = bool(content.get("streams")) or content.get("stream") is not None
        return Manifest(
            schema=STREAMS_SCHEMA if streamed else layout.schema_,
            version=version,
            parent=head.version if head is not None and head.version else None,
            parent_manifest=parent_key,
            kind=draft.kind,
            anchor=version if own_anchor else tip.anchor,  # type: ignore[union-attr]
            delta_base=head.version if draft.has_base and head is not None else None,
            step=step,
            created=now(),
            writer=self.writer_id,
            epoch=self.commits.epoch,
            commit_id=draft.attempt,
            metadata=metadata,
            stats=stats.model_copy(update={"cum_delta_bytes": cum}),
            lineage=draft.lineage,
            anchor_manifest=None if own_anchor else tip.anchor_key,  # type: ignore[union-attr]
            back=() if based else self.back_for(version, parent_key),  # a based version skips to nothing
            chain_start=version if restart else tip.chain_start,  # type: ignore[union-attr]
            layout=layout_ref,
            max_attempt_s=math.ceil(self.max_attempt_s),
            **content,
        )

    def sign(self, manifest: Manifest) -> Manifest:
        """``manifest`` signed with this writer's key (SPEC §3.1), or as it is without one."""
        if self.signing_key is None:
            return manifest
        from deltastore.format.signing import sign_manifest  # cryptography: loaded only by signing writers

        return sign_manifest(manifest, self.signing_key)

    @staticmethod
    def seal(manifest: Manifest, data: bytes) -> Sealed:
        """``manifest`` with its stored bytes ``data`` and the content-addressed key they get."""
        digest = sha256_hex(data)
        return Sealed(manifest, data, manifest_key(manifest.version, digest), digest)

    def commit(self, draft: Draft, sealed: Sealed, layout: Layout, *, deadline: float | None,
               stored: bool = False) -> bool:
        """Store the manifest (unless ``stored``) and make it HEAD by compare-and-swap (SPEC §5
        step 6), then advance the tip to it. Everything it names must be stored already.

        Returns:
            True when the version landed but another writer has already committed on top of
            it (the writer's reference copy is then not HEAD's state).

        Raises:
            What :meth:`CommitProtocol.commit` raises (nothing was committed, or the outcome is
            unknown); StorageError or IntegrityError from the manifest's upload.
        """
        m = sealed.manifest
        if not stored:
            put_immutable(self.store, sealed.key, sealed.data, "manifest")
        head = self.commits.head
        self.commits.commit(Head(
            version=draft.version,
            manifest=sealed.key,
            manifest_sha256=sealed.digest,
            commit_id=draft.attempt,
            writer=self.writer_id,
            epoch=self.commits.epoch,
            updated=m.created,
            lineage=draft.lineage,
            # HEAD's history index (GC's floor and pins, squashes) is carried over; a rebase
            # in commit() picks up a newer one (design 005 D4)
            index=head.index if head is not None else None,
        ), deadline=deadline)
        superseded, self.commits.superseded = self.commits.superseded, False
        self._remember(sealed.key, m)
        self._tip = replace(next_tip(draft, layout, m.layout, delta_bytes=m.stats.delta_bytes or 0,
                                     full_bytes=m.stats.full_bytes or 0, key=sealed.key,
                                     signed_by=None if m.signature is None else m.signature.key_id),
                            streams=tuple(m.streams))
        return superseded

    # --- skip pointers (design 005 D6) ------------------------------------------------------

    def back_for(self, version: int, parent_key: str | None) -> tuple[str, ...]:
        """``back`` of ``version``: the manifest keys of versions v−2, v−4, …, v−2^j ≥ 1.

        Derived from manifests, never remembered whole (the chain keeps O(log v) links of a
        few recent versions): key(v−2) is the parent's ``parent_manifest``, and for j ≥ 2
        key(v−2^j) is ``back[j−2]`` of version v−2^(j−1), whose key the step before found.
        The list stops early (a prefix) where a manifest is gone or has a shorter list.
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
                key = link.back[j - 2] if len(link.back) >= j - 1 else None
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

    def _remember(self, key: str, m: Manifest) -> None:
        self._links[key] = self._link_of(m)
        while len(self._links) > LINK_CACHE_ENTRIES:
            # the oldest version goes first: sources of the next back lists are the newest
            del self._links[min(self._links, key=lambda k: self._links[k].version)]

    def _link(self, key: str, *, keep: bool) -> _Link:
        """The links of manifest ``key``, read if not cached; ``keep``: cache what was read (a
        recent version, a source again soon; an old one is a source once per level)."""
        link = self._links.get(key)
        if link is not None:
            return link
        m = self.history.manifest(key)
        if keep:
            self._remember(key, m)
        return self._link_of(m)

    @staticmethod
    def _link_of(m: Manifest) -> _Link:
        return _Link(m.version, m.parent_manifest, m.back)

    def _tip_of(self, key: str, m: Manifest) -> Tip:
        """Read the :class:`Tip` of manifest ``m`` (its anchor's manifest and its layout)."""
        signed_by = None if m.signature is None else m.signature.key_id
        if m.base is not None and m.layout is not None:  # a based version: only its layout passes on
            return Tip(version=m.version, key=key, chained=False, layout=self.history.layout(m.layout),
                       layout_ref=m.layout, signed_by=signed_by)
        anchor_key = key if m.kind == "anchor" else m.anchor_manifest
        a = m if m.kind == "anchor" else (self.history.manifest(anchor_key) if anchor_key else None)
        if (a is None or m.chain_start is None or m.layout is None or m.stats.cum_delta_bytes is None
                or a.stats.full_bytes is None or a.stats.cum_delta_bytes is None):
            # Not what this writer writes: start over with an anchor rather than guess.
            logger.warning("manifest %s lacks the chain fields (anchor, chain_start, layout or byte counts): "
                           "the next version is an anchor", key)
            return Tip(version=m.version, key=key, chained=False, signed_by=signed_by)
        return Tip(
            version=m.version, key=key, chained=True, chain_start=m.chain_start, cum=m.stats.cum_delta_bytes,
            layout=self.history.layout(m.layout), layout_ref=m.layout, anchor=a.version, anchor_key=anchor_key,
            anchor_full=a.stats.full_bytes, anchor_cum=a.stats.cum_delta_bytes, signed_by=signed_by,
        )


__all__ = ["LINK_CACHE_ENTRIES", "Draft", "Sealed", "Tip", "VersionChain", "next_tip"]
