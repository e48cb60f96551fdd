"""The read side of the metadata: HEAD, manifests, and walking the version chain (SPEC §7).

Manifests are immutable, so they are cached by key for the life of a :class:`History`. Every
walk along ``parent_manifest`` links checks invariant I2 on each link (SPEC §5): the parent is
version ``child.parent``, and a delta's anchor is its parent's anchor.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import CorruptObjectError, NotFoundError, VersionNotFoundError
from deltastore.manifest import (
    HEAD_KEY,
    MAX_HEAD_BYTES,
    MAX_MANIFEST_BYTES,
    Head,
    Manifest,
    parse_head,
    parse_manifest,
)
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
        )


#: Parsed manifests kept per History (least recently used go first): a catch-up walks one
#: anchor span (20 versions by default), and a Subscriber that follows for weeks must not keep
#: every manifest it ever read (a parsed chunk entry costs ~3 KB of Python objects).
MANIFEST_CACHE_ENTRIES = 64


class History:
    """Reads HEAD and manifests of one store, verifying and caching them.

    Args:
        store: the store to read.
        check: ``check(key, manifest)`` runs on every manifest before it is used or cached
            (a subscriber's signature check, SPEC §3.1) and raises to refuse it.
        max_manifest_bytes: refuse a manifest larger than this before parsing it.
        cache_entries: parsed manifests kept (least recently used evicted first).
    """

    def __init__(self, store: Store, check: Callable[[str, Manifest], None] | None = None, *,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES, cache_entries: int = MANIFEST_CACHE_ENTRIES):
        if cache_entries < 1:
            raise ValueError(f"cache_entries must be ≥ 1, got {cache_entries}")
        self.store = store
        self._check = check
        self.max_manifest_bytes = max_manifest_bytes
        self.cache_entries = cache_entries
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._lock = threading.Lock()
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
        """Fetch, verify and parse one manifest (cached, bounded)."""
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
        m = parse_manifest(data, key, expected_sha256, max_bytes=self.max_manifest_bytes)
        if self._check is not None:
            self._check(key, m)
        with self._lock:
            self._manifests[key] = m
            while len(self._manifests) > self.cache_entries:
                self._manifests.popitem(last=False)
        return m

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
        if p.version != m.parent:
            raise CorruptObjectError(
                f"manifest {key!r} (version {m.version}) links to {pkey!r}, which is version {p.version}, not {m.parent}"
            )
        if m.kind == "delta" and m.anchor != p.anchor:
            raise CorruptObjectError(
                f"manifest {key!r} (version {m.version}) says its anchor is version {m.anchor}, but its parent "
                f"{pkey!r} has anchor {p.anchor}: version {m.anchor} is not the anchor of this chain"
            )
        return pkey, p

    def find(self, version: int, head: Head) -> tuple[str, Manifest]:
        """The manifest of ``version`` on the chain ending at ``head`` (walking parent links)."""
        top = self.head_manifest(head)
        if top is None or not 1 <= version <= top[1].version:
            latest = 0 if top is None else top[1].version
            raise VersionNotFoundError(f"version {version} is not in {self.store.url} (latest is {latest})")
        key, m = top
        while m.version > version:  # cached manifests make a walk cheap; each link is checked
            key, m = self.parent(key, m)
        return key, m

    def chain(self, key: str, m: Manifest, *, down_to: int) -> list[tuple[str, Manifest]]:
        """Manifests from version ``down_to`` up to ``m`` (inclusive), oldest first."""
        out = [(key, m)]
        while m.version > down_to:
            if m.parent_manifest is None:
                raise VersionNotFoundError(f"version {down_to} is not on the chain of {key!r}")
            key, m = self.parent(key, m)
            out.append((key, m))
        out.reverse()
        return out

    def anchor_chain(self, key: str, m: Manifest) -> list[tuple[str, Manifest]]:
        """Manifests from ``m``'s anchor up to ``m``, oldest first; the first is an anchor."""
        ms = self.chain(key, m, down_to=m.anchor)
        akey, a = ms[0]
        if a.kind != "anchor" or a.version != m.anchor:
            raise CorruptObjectError(f"manifest {key!r} names version {m.anchor} as its anchor, but {akey!r} is a {a.kind}")
        return ms

    def log(self, head: Head, *, since: int = 1) -> list[VersionInfo]:
        """The versions from ``since`` to ``head`` on its chain, oldest first."""
        top = self.head_manifest(head)
        if top is None or top[1].version < since:
            return []
        return [VersionInfo.from_manifest(m, k) for k, m in self.chain(*top, down_to=max(1, since))]
