"""The read side of the metadata: HEAD, manifests, layouts, the history index, squashes, and
walking the version chain (SPEC §7).

Manifests, layouts and squashes are immutable, so they are cached by key (LRU-bounded) for the
life of a :class:`History`. Every walk along ``parent_manifest`` links checks invariant I2 on
each link (SPEC §5): the parent is version ``child.parent``, and a delta's anchor is its
parent's anchor. Schema-3 manifests carry skip pointers (``back``): :meth:`History.find` reaches
any version in O(log distance) reads, and :meth:`History.chain` fetches a run of manifests in
parallel rounds; every manifest reached through ``back`` must be the version its position names.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import (
    BaseElsewhereError,
    CorruptObjectError,
    IntegrityError,
    NotFoundError,
    VersionCollectedError,
    VersionNotFoundError,
)
from deltastore.format.keys import HEAD_KEY, manifest_key_version
from deltastore.format.manifest import parse_manifest
from deltastore.format.models import (
    DEFAULT_MAX_ATTEMPT_S,
    Head,
    Index,
    Layout,
    Manifest,
    ObjectRef,
    PartRef,
    SquashManifest,
    SquashRef,
    untrack_entries,
)
from deltastore.format.objects import decode_object
from deltastore.format.parse import MAX_HEAD_BYTES, MAX_MANIFEST_BYTES, parse_head
from deltastore.storage.base import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionInfo:
    """What a committed version is, without its tensors.

    Attributes:
        version: 1 for the first version published to a store, then +1 per commit.
        step: the trainer's step passed to ``publish`` (or None).
        parent: the version this one was computed against (None for the first).
        kind: ``"anchor"`` (a full snapshot) or ``"delta"``.
        anchor: the anchor version this version's chain starts from.
        created: RFC 3339 time of the publish.
        writer: the publisher's id.
        metadata: the user metadata passed to ``publish``.
        bytes_stored: bytes of packs this version wrote.
        tensors_changed / elements_changed: how much changed since the parent.
        manifest: the manifest's key in the store.
        formats: the serving formats the version can be read in (SPEC §15): its own, then its
            streams' (empty when the publisher declared none).
        streams: the formats of its serving streams (``formats`` less the version's own).
        stream_bytes: each stream's pack bytes for this version, by format (``bytes_stored``
            counts the version's own packs only).
    """

    version: int
    step: int | None
    parent: int | None
    kind: str
    anchor: int
    created: str
    writer: str
    bytes_stored: int
    tensors_changed: int
    elements_changed: int
    manifest: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    formats: tuple[str, ...] = ()
    streams: tuple[str, ...] = ()
    stream_bytes: dict[str, int] = field(default_factory=dict, compare=False)  # compared through ``manifest``

    @classmethod
    def from_manifest(cls, m: Manifest, key: str) -> VersionInfo:
        return cls(
            version=m.version,
            step=m.step,
            parent=m.parent,
            kind=m.kind,
            anchor=m.anchor,
            created=m.created,
            writer=m.writer,
            bytes_stored=m.stats.bytes_stored,
            tensors_changed=m.stats.tensors_changed,
            elements_changed=m.stats.elements_changed,
            manifest=key,
            metadata=dict(m.metadata),
            formats=m.formats(),
            streams=tuple(s.format for s in m.streams),
            stream_bytes={s.format: s.bytes for s in m.streams},
        )


#: Parsed manifests kept per History (least recently used go first): a catch-up walks one
#: anchor span (20 versions by default), and a Subscriber that follows for weeks must not keep
#: every manifest it ever read (a parsed chunk entry costs ~3 KB of Python objects).
MANIFEST_CACHE_ENTRIES = 64
#: ... and at most about this many bytes of them (design 005 D8): 64 anchors of a large model
#: would otherwise hold gigabytes. The newest manifest is always kept.
MANIFEST_CACHE_BYTES = 64 * 1024 * 1024
#: Estimated memory of one parsed chunk entry with its segment references (pydantic objects),
#: and of a manifest's header: what the byte bound counts.
PARSED_CHUNK_BYTES = 3 * 1024
PARSED_HEADER_BYTES = 8 * 1024


def _parsed_bytes(m: Manifest) -> int:
    return PARSED_HEADER_BYTES + PARSED_CHUNK_BYTES * sum(len(t.chunks) for t in m.tensors)


#: Layouts kept per History: a store changes layout rarely, and a reader needs the layouts of
#: the versions it walks (one per anchor span at most).
LAYOUT_CACHE_ENTRIES = 8
#: Squash manifests kept per History: a reader uses one per catch-up.
SQUASH_CACHE_ENTRIES = 4
#: Parallel manifest GETs per round of :meth:`History.chain`: a round fetches the parent and
#: the skip pointers of the manifests of the previous round (at most ~log2(span) new keys each).
CHAIN_FETCH_THREADS = 8


class _LRU:
    """A small thread-safe LRU map of immutable objects by key."""

    def __init__(self, entries: int):
        self.entries = entries
        self._d: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            value = self._d.get(key)
            if value is not None:
                self._d.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.entries:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class History:
    """Reads HEAD and manifests of one store, verifying and caching them.

    Args:
        store: the store to read.
        check: ``check(key, manifest)`` runs on every manifest before it is used or cached
            (a subscriber's signature check, SPEC §3.1) and raises to refuse it.
        max_manifest_bytes: refuse a manifest larger than this before parsing it.
        index_source: ``index_source(head)`` gives the history index that applies under
            ``head`` instead of the one ``head`` names (a serving stream's reader: the store's
            floor and pins, read by :class:`~deltastore.read.streams.StreamView`).
        earlier: ``earlier(version)`` gives the manifest key and SHA-256 (None: not known) of
            the newest retained version below ``version`` when a chain starts there without a
            parent link although the history goes on below it (a serving format published again
            after a pause, SPEC §15: its new chain starts with an anchor), or None: the history
            starts there. :meth:`find`, :meth:`chains` and :meth:`log` go on through it.
        cache_entries: parsed manifests kept (least recently used evicted first).
        cache_bytes: and at most about this many bytes of them (the newest is always kept).
    """

    def __init__(self, store: Store, check: Callable[[str, Manifest], None] | None = None, *,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES, cache_entries: int = MANIFEST_CACHE_ENTRIES,
                 cache_bytes: int = MANIFEST_CACHE_BYTES, index_source: Callable[[Head], Index | None] | None = None,
                 earlier: Callable[[int], tuple[str, str | None] | None] | None = None):
        if cache_entries < 1:
            raise ValueError(f"cache_entries must be ≥ 1, got {cache_entries}")
        self.store = store
        self._check = check
        self._index_source = index_source
        self._earlier = earlier
        self.max_manifest_bytes = max_manifest_bytes
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._manifest_bytes = 0
        self._lock = threading.Lock()
        self._layouts = _LRU(LAYOUT_CACHE_ENTRIES)
        self._squashes = _LRU(SQUASH_CACHE_ENTRIES)
        self._index: tuple[str, Index] | None = None
        self._head: Head | None = None
        self._head_etag: str | None = None

    # --- HEAD ---------------------------------------------------------------------------

    def read_head(self) -> tuple[Head, str] | None:
        """Fetch HEAD unconditionally: ``(head, etag)``, or None when the store is empty."""
        try:
            res = self.store.get_with_meta(HEAD_KEY)
        except NotFoundError:
            return None
        head = parse_head(res.data)
        self._head, self._head_etag = head, res.meta.etag
        return head, res.meta.etag

    def poll_head(self) -> Head | None:
        """Conditional GET of HEAD: moves no body when it has not changed since the last poll.

        The first poll asks for HEAD's size before reading it, so an oversized object is
        refused unread (later polls are conditional GETs, whose bodies parse_head bounds).
        """
        try:
            if self._head_etag is None:
                size = self.store.head(HEAD_KEY).size
                if size > MAX_HEAD_BYTES:
                    raise CorruptObjectError(
                        f"HEAD of {self.store.url} is {size} bytes, over the {MAX_HEAD_BYTES}-byte limit: not a deltastore HEAD"
                    )
            res = self.store.get_if_changed(HEAD_KEY, self._head_etag)
        except NotFoundError:
            self._head = self._head_etag = None
            return None
        if res is not None:
            self._head, self._head_etag = parse_head(res.data), res.meta.etag
        return self._head

    # --- manifests ----------------------------------------------------------------------

    def manifest(self, key: str, expected_sha256: str | None = None) -> Manifest:
        """Fetch, verify and parse one manifest (cached, bounded).

        The manifest is returned with its tensors rebuilt from its layout object (fetched
        through :meth:`layout`): in memory, ``tensors`` and ``blobs`` as Manifest models them.
        """
        with self._lock:
            cached = self._manifests.get(key)
            if cached is not None:
                self._manifests.move_to_end(key)
        if cached is not None:
            return cached
        try:
            data = self.store.get(key)
        except NotFoundError:
            raise NotFoundError(
                f"manifest {key!r} is missing from {self.store.url}: the store was damaged (a reachable object was deleted)"
            ) from None
        try:
            m = parse_manifest(data, key, expected_sha256, layout=self.layout, max_bytes=self.max_manifest_bytes,
                               parts=self._part)
            if self._check is not None:
                self._check(key, m)
        except IntegrityError as e:
            raise self._named(e)
        untrack_entries(m.tensors)  # a cached manifest's chunk table
        with self._lock:
            if key not in self._manifests:
                self._manifests[key] = m
                self._manifest_bytes += _parsed_bytes(m)
            while len(self._manifests) > 1 and (
                len(self._manifests) > self.cache_entries or self._manifest_bytes > self.cache_bytes
            ):
                self._manifest_bytes -= _parsed_bytes(self._manifests.popitem(last=False)[1])
        return m

    def _named(self, e: IntegrityError) -> IntegrityError:
        """``e`` (about an object of this store), its message naming the store: a serving
        stream's keys are relative to its tree (``URL#streams/<format>/``)."""
        if e.args and isinstance(e.args[0], str) and self.store.url not in e.args[0]:
            e.args = (f"{e.args[0]} (in {self.store.url})", *e.args[1:])
        return e

    def unchecked(self, key: str) -> Manifest:
        """Fetch and parse manifest ``key`` without ``check`` and without caching it: to explain
        why another manifest was refused, never to use what it says."""
        return parse_manifest(self._object(key, "manifest"), key, None, layout=self.layout,
                              max_bytes=self.max_manifest_bytes, parts=self._part)

    def _part(self, ref: PartRef) -> bytes:
        """A part manifest's bytes (a sharded version, SPEC §8); parse_manifest verifies them.
        Not cached apart: the merged manifest is."""
        try:
            return self.store.get(ref.key)
        except NotFoundError:
            raise NotFoundError(
                f"part manifest {ref.key!r} (part {ref.part}) is missing from {self.store.url}: the store was damaged "
                "(a reachable object was deleted)"
            ) from None

    def _object(self, key: str, what: str) -> bytes:
        try:
            return self.store.get(key)
        except NotFoundError:
            raise NotFoundError(f"{what} {key!r} is missing from {self.store.url}") from None

    def layout(self, ref: ObjectRef) -> Layout:
        """The layout object ``ref`` names, verified against its SHA-256 (cached, bounded).

        Raises:
            NotFoundError: it is missing (the store was damaged: a manifest needs it).
            IntegrityError / CorruptObjectError / UnsupportedSchemaError: as decode_object;
                a sharded layout is UnsupportedSchemaError.
        """
        cached = self._layouts.get(ref.key)
        if cached is not None and cached[0] == ref.sha256:
            return cached[1]
        try:
            layout = decode_object(Layout, self._object(ref.key, "layout"), ref.key, ref.sha256)
        except IntegrityError as e:
            raise self._named(e)
        self._layouts.put(ref.key, (ref.sha256, layout))
        return layout

    def index(self, head: Head) -> Index | None:
        """The history index HEAD names (SPEC §11), or None when it names none (floor 1); with
        an ``index_source``, the one it gives."""
        if self._index_source is not None:
            return self._index_source(head)
        ref = head.index
        if ref is None:
            return None
        with self._lock:
            cached = self._index
        if cached is not None and cached[0] == ref.key:
            return cached[1]
        index: Index = decode_object(Index, self._object(ref.key, "history index"), ref.key, ref.sha256)
        if head.lineage is not None and index.lineage != head.lineage:
            raise CorruptObjectError(f"history index {ref.key!r} has lineage {index.lineage}, not HEAD's {head.lineage}")
        with self._lock:
            self._index = (ref.key, index)
        return index

    def squash(self, ref: SquashRef) -> SquashManifest:
        """The squash manifest ``ref`` names (SPEC §12), verified (cached, bounded). Squashes
        are hints: a caller treats NotFoundError as "no such squash"."""
        cached = self._squashes.get(ref.key)
        if cached is not None and cached[0] == ref.sha256:
            return cached[1]
        sq: SquashManifest = decode_object(SquashManifest, self._object(ref.key, "squash manifest"), ref.key, ref.sha256)
        if (sq.from_, sq.to) != (ref.from_, ref.to):
            raise CorruptObjectError(f"squash manifest {ref.key!r} squashes {sq.from_} → {sq.to}, not {ref.from_} → {ref.to}")
        if manifest_key_version(sq.from_manifest) != sq.from_ or manifest_key_version(sq.to_manifest) != sq.to:
            raise CorruptObjectError(f"squash manifest {ref.key!r} names manifests of other versions than {sq.from_} and {sq.to}")
        self._squashes.put(ref.key, (ref.sha256, sq))
        return sq

    def head_manifest(self, head: Head) -> tuple[str, Manifest] | None:
        if head.manifest is None:
            return None
        m = self.manifest(head.manifest, head.manifest_sha256)
        if m.version != head.version:
            raise CorruptObjectError(f"HEAD says version {head.version} but manifest {head.manifest!r} is version {m.version}")
        return head.manifest, m

    def parent(self, key: str, m: Manifest) -> tuple[str, Manifest]:
        """The manifest ``m`` (read from ``key``) links to, checked as a link of the chain (I2).

        Raises:
            VersionNotFoundError: ``m`` is the first version (it has no parent).
            CorruptObjectError: the parent is not version ``m.parent``, or a delta's anchor is
                not its parent's anchor.
        """
        if m.parent_manifest is None:
            raise VersionNotFoundError(f"version {m.version} ({key!r}) is the first of its chain")
        pkey = m.parent_manifest
        p = self.manifest(pkey)
        self._check_link(key, m, pkey, p)
        return pkey, p

    def _before(self, key: str, m: Manifest) -> tuple[str, Manifest]:
        """The newest version before the chain that starts at ``m`` (read from ``key``; it names
        no parent), through ``earlier``.

        Raises:
            VersionNotFoundError: none (the history starts at ``m``).
            CorruptObjectError: ``earlier`` named a manifest that is not a version below ``m``'s.
        """
        got = None if self._earlier is None else self._earlier(m.version)
        if got is None:
            raise VersionNotFoundError(f"version {m.version} ({key!r}) is the first of its chain")
        pkey, sha = got
        p = self.manifest(pkey, sha)
        if p.version >= m.version or manifest_key_version(pkey) != p.version:
            raise CorruptObjectError(f"manifest {pkey!r} (version {p.version}) was named as the version before the "
                                     f"chain that starts at {key!r} (version {m.version})")
        return pkey, p

    @staticmethod
    def _check_link(key: str, m: Manifest, pkey: str, p: Manifest) -> None:
        """I2 on one parent link."""
        if p.version != m.parent:
            raise CorruptObjectError(
                f"manifest {key!r} (version {m.version}) links to {pkey!r}, which is version {p.version}, not {m.parent}"
            )
        if m.kind == "delta" and m.base is None and m.anchor != p.anchor:  # a based version is its own anchor
            raise CorruptObjectError(
                f"manifest {key!r} (version {m.version}) says its anchor is version {m.anchor}, but its parent "
                f"{pkey!r} has anchor {p.anchor}: version {m.anchor} is not the anchor of this chain"
            )

    def skip(self, key: str, m: Manifest, j: int) -> tuple[str, Manifest] | None:
        """The manifest of version ``m.version − 2**j`` through ``m.back[j − 1]`` (j ≥ 1), or
        None when ``m`` has no such pointer or its object is missing (skip pointers are hints).

        Raises:
            CorruptObjectError: the manifest reached is not the version its position names, or
                is in ``m``'s anchor span with another anchor (I2).
        """
        if not 1 <= j <= len(m.back):
            return None
        bkey = m.back[j - 1]
        try:
            b = self.manifest(bkey)
        except NotFoundError:
            logger.info("skip pointer %r of %r is missing; walking parent links instead", bkey, key)
            return None
        self._check_skip(key, m, bkey, b, m.version - 2**j)
        return bkey, b

    @staticmethod
    def _check_skip(key: str, m: Manifest, bkey: str, b: Manifest, want: int) -> None:
        if b.version != want:
            raise CorruptObjectError(f"manifest {key!r} (version {m.version}) skips to {bkey!r}, which is version {b.version}, not {want}")
        if m.kind == "delta" and b.version >= m.anchor and b.anchor != m.anchor:
            raise CorruptObjectError(
                f"manifest {key!r} (version {m.version}, anchor {m.anchor}) skips to {bkey!r} (version {b.version}), "
                f"whose anchor is {b.anchor}: they cannot be on one chain"
            )

    def attempt_deadline(self, head: Head) -> float:
        """The attempt deadline every writer on this store keeps (SPEC §5 step 3a, §11): the
        head manifest's ``max_attempt_s`` (DEFAULT_MAX_ATTEMPT_S when it records none). GC's
        grace is checked against the largest of these, so a compactor or index writer that
        kept a longer deadline than the publisher could have its objects collected before it
        commits them."""
        top = self.head_manifest(head)
        recorded = top[1].max_attempt_s if top is not None else None
        return float(min(recorded or DEFAULT_MAX_ATTEMPT_S, DEFAULT_MAX_ATTEMPT_S))

    def resolve(self, version: int, head: Head) -> tuple[str, Manifest]:
        """The manifest of ``version`` as the history index allows (SPEC §7.4, §11): a version
        below the floor is read through its pin, or is collected.

        Raises:
            VersionCollectedError: ``version`` is below the index's floor and not pinned.
            VersionNotFoundError: no such version on HEAD's chain.
        """
        index = self.index(head)
        if index is not None and version < index.floor:  # learnt from the index, not from a 404
            pin = next((p for p in index.pins if p.version == version), None)
            if pin is None:
                pins = sorted(p.version for p in index.pins)
                raise VersionCollectedError(
                    f"version {version} of {self.store.url} was collected: the oldest readable version is {index.floor}"
                    + (f", and the pinned versions below it are {', '.join(map(str, pins))}" if pins else ""),
                    version=version, floor=index.floor, pins=pins,
                )
            m = self.manifest(pin.manifest)
            if m.version != version:
                raise CorruptObjectError(f"the index pins version {version} as {pin.manifest!r}, which is version {m.version}")
            return pin.manifest, m
        return self.find(version, head)

    def find(self, version: int, head: Head) -> tuple[str, Manifest]:
        """The manifest of ``version`` on the chain ending at ``head``: through skip pointers
        where manifests have them (O(log distance) reads), else parent links (each checked),
        and on to the chain before through ``earlier`` where a chain starts above ``version``."""
        top = self.head_manifest(head)
        if top is None or not 1 <= version <= top[1].version:
            latest = 0 if top is None else top[1].version
            raise VersionNotFoundError(f"version {version} is not in {self.store.url} (latest is {latest})")
        key, m = top
        while m.version > version:
            if m.parent_manifest is None and self._earlier is not None:
                start = m.version
                try:
                    key, m = self._before(key, m)
                except VersionNotFoundError:
                    raise VersionNotFoundError(f"version {version} is not in {self.store.url}: its first version is "
                                               f"{start}") from None
                if m.version < version:
                    raise VersionNotFoundError(f"version {version} is not in {self.store.url}: version {m.version} is "
                                               f"followed by a chain that starts at version {start}")
                continue
            distance = m.version - version
            j = min(distance.bit_length() - 1, len(m.back))  # the longest jump that does not overshoot
            hop = self.skip(key, m, j) if j >= 1 else None
            key, m = hop if hop is not None else self.parent(key, m)
        return key, m

    def chain(self, key: str, m: Manifest, *, down_to: int, to_start: bool = False) -> list[tuple[str, Manifest]]:
        """Manifests from version ``down_to`` up to ``m`` (inclusive), oldest first; with
        ``to_start``, from the chain's first version when it starts above ``down_to`` (a serving
        stream declared after the store's first version, SPEC §15).

        Manifests with skip pointers are fetched in parallel rounds (each round fetches the
        parents and skip targets the previous round named, within range); the result is then
        assembled along ``parent_manifest`` links, each checked (I2), so a wrong pointer can
        cost a fetch but never changes the answer.
        """
        fetched = self._prefetch(key, m, down_to)
        out = [(key, m)]
        while m.version > down_to:
            if m.parent_manifest is None:
                if to_start:
                    break
                raise VersionNotFoundError(f"version {down_to} is not on the chain of {key!r}")
            pkey = m.parent_manifest
            p = fetched.get(pkey)
            if p is None:
                key, m = self.parent(key, m)
            else:
                self._check_link(key, m, pkey, p)
                key, m = pkey, p
            out.append((key, m))
        out.reverse()
        return out

    def chains(self, key: str, m: Manifest, *, down_to: int) -> list[tuple[str, Manifest]]:
        """Manifests from version ``down_to`` up to ``m``, oldest first: :meth:`chain` with
        ``to_start``, and, where a chain starts above ``down_to`` and ``earlier`` names the
        version before it, the versions before it down to ``down_to`` (a serving format
        published again after a pause: the versions between its chains are not there)."""
        out = self.chain(key, m, down_to=down_to, to_start=True)
        while out[0][1].version > down_to and out[0][1].parent_manifest is None and self._earlier is not None:
            try:
                pkey, p = self._before(*out[0])
            except VersionNotFoundError:
                break
            if p.version < down_to:
                break
            out = self.chain(pkey, p, down_to=down_to, to_start=True) + out
        return out

    def _prefetch(self, key: str, m: Manifest, down_to: int) -> dict[str, Manifest]:
        """Manifests of versions [down_to, m.version) reachable through parent and skip
        pointers, fetched round by round in parallel (nothing when ``m`` has no skip pointers:
        a parent walk is then as fast)."""
        fetched: dict[str, Manifest] = {key: m}
        if not m.back or m.version - down_to < 2:
            return fetched
        seen_versions = {m.version}
        frontier = [(key, m)]
        with ThreadPoolExecutor(CHAIN_FETCH_THREADS, thread_name_prefix="deltastore-chain") as pool:
            while frontier:
                wanted: dict[str, tuple[str, Manifest, int]] = {}
                for k, x in frontier:
                    pointers = [(x.parent_manifest, x.version - 1, 0)] + [(b, x.version - 2**j, j) for j, b in enumerate(x.back, 1)]
                    for pk, v, j in pointers:
                        if pk is None or v < down_to or v in seen_versions or pk in fetched or pk in wanted:
                            continue
                        seen_versions.add(v)
                        wanted[pk] = (k, x, j)
                keys = list(wanted)
                results = list(pool.map(self._try_manifest, keys))
                frontier = []
                for pk, got in zip(keys, results):
                    if got is None:
                        continue
                    k, x, j = wanted[pk]
                    if j == 0:
                        self._check_link(k, x, pk, got)
                    else:
                        self._check_skip(k, x, pk, got, x.version - 2**j)
                    fetched[pk] = got
                    frontier.append((pk, got))
        return fetched

    def _try_manifest(self, key: str) -> Manifest | None:
        try:
            return self.manifest(key)
        except NotFoundError:
            return None  # a skip target may be missing; the parent walk reports what must exist

    def anchor_chain(self, key: str, m: Manifest) -> list[tuple[str, Manifest]]:
        """Manifests from ``m``'s anchor up to ``m``, oldest first; the first is an anchor."""
        ms = self.chain(key, m, down_to=m.anchor)
        akey, a = ms[0]
        if a.base is not None:  # its bits are another store's version plus its deltas (design 009)
            raise BaseElsewhereError(
                f"manifest {akey!r} is a based version: its segments apply to version {a.base.version} of another "
                f"store ({a.base.manifest!r}); read it with deltastore.federated, which is given that store"
            )
        if a.kind != "anchor" or a.version != m.anchor:
            raise CorruptObjectError(f"manifest {key!r} names version {m.anchor} as its anchor, but {akey!r} is a {a.kind}")
        return ms

    def latest(self) -> VersionInfo | None:
        """The newest committed version (None for an empty store), via a conditional GET."""
        head = self.poll_head()
        top = None if head is None else self.head_manifest(head)
        return None if top is None else VersionInfo.from_manifest(top[1], top[0])

    def log(self, head: Head | None = None, *, since: int = 1) -> list[VersionInfo]:
        """The versions from ``since`` to ``head`` (default: HEAD, polled) on its chain, oldest
        first; versions below the history index's floor were collected and are not listed."""
        if head is None:
            head = self.poll_head()
            if head is None:
                return []
        index = self.index(head)
        if index is not None:
            since = max(since, index.floor)
        top = self.head_manifest(head)
        if top is None or top[1].version < since:
            return []
        return [VersionInfo.from_manifest(m, k) for k, m in self.chains(*top, down_to=max(1, since))]
