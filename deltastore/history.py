"""The read side of the metadata: HEAD, manifests, and walking the version chain (SPEC §7).

Manifests are immutable, so they are cached by key for the life of a :class:`History`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltastore.errors import CorruptObjectError, NotFoundError, VersionNotFoundError
from deltastore.manifest import HEAD_KEY, Head, Manifest, parse_head, parse_manifest
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


class History:
    """Reads HEAD and manifests of one store, verifying and caching them.

    ``check(key, manifest)``, when given, runs on every manifest before it is used or cached
    (a subscriber's signature check, SPEC §3.1) and raises to refuse it.
    """

    def __init__(self, store: Store, check: Callable[[str, Manifest], None] | None = None):
        self.store = store
        self._check = check
        self._manifests: dict[str, Manifest] = {}
        self._by_version: dict[int, str] = {}
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
        """Conditional GET of HEAD: moves no body when it has not changed since the last poll."""
        try:
            res = self.store.get_if_changed(HEAD_KEY, self._head_etag)
        except NotFoundError:
            self._head = self._head_etag = None
            return None
        if res is not None:
            self._head, self._head_etag = parse_head(res.data), res.meta.etag
        return self._head

    # --- manifests ----------------------------------------------------------------------

    def manifest(self, key: str, expected_sha256: str | None = None) -> Manifest:
        """Fetch, verify and parse one manifest (cached)."""
        with self._lock:
            cached = self._manifests.get(key)
        if cached is not None:
            return cached
        try:
            data = self.store.get(key)
        except NotFoundError:
            raise NotFoundError(
                f"manifest {key!r} is missing from {self.store.url}: the store was damaged (a reachable object was deleted)"
            ) from None
        m = parse_manifest(data, key, expected_sha256)
        if self._check is not None:
            self._check(key, m)
        with self._lock:
            self._manifests[key] = m
            self._by_version[m.version] = key
        return m

    def head_manifest(self, head: Head) -> tuple[str, Manifest] | None:
        if head.manifest is None:
            return None
        m = self.manifest(head.manifest, head.manifest_sha256)
        if m.version != head.version:
            raise CorruptObjectError(f"HEAD says version {head.version} but manifest {head.manifest!r} is version {m.version}")
        return head.manifest, m

    def find(self, version: int, head: Head) -> tuple[str, Manifest]:
        """The manifest of ``version`` on the chain ending at ``head`` (walking parent links)."""
        top = self.head_manifest(head)
        if top is None or not 1 <= version <= top[1].version:
            latest = 0 if top is None else top[1].version
            raise VersionNotFoundError(f"version {version} is not in {self.store.url} (latest is {latest})")
        key, m = top
        while m.version > version:
            cached = self._by_version.get(version)
            if cached is not None and cached in self._manifests:
                return cached, self._manifests[cached]
            assert m.parent_manifest is not None  # checked by parse_manifest: version > 1 has a parent
            key, m = m.parent_manifest, self.manifest(m.parent_manifest)
        return key, m

    def chain(self, key: str, m: Manifest, *, down_to: int) -> list[tuple[str, Manifest]]:
        """Manifests from version ``down_to`` up to ``m`` (inclusive), oldest first."""
        out = [(key, m)]
        while m.version > down_to:
            if m.parent_manifest is None:
                raise VersionNotFoundError(f"version {down_to} is not on the chain of {key!r}")
            key, m = m.parent_manifest, self.manifest(m.parent_manifest)
            out.append((key, m))
        out.reverse()
        return out

    def log(self, head: Head) -> list[VersionInfo]:
        """Every version on the chain ending at ``head``, oldest first."""
        top = self.head_manifest(head)
        if top is None:
            return []
        return [VersionInfo.from_manifest(m, k) for k, m in self.chain(*top, down_to=1)]
