"""Reading one serving stream of a store (SPEC §15) as if it were a store of its own.

A stream of format F is a store-shaped tree under ``streams/F/`` without a HEAD of its own: the
store's HEAD names a manifest whose ``streams`` entry for F names F's manifest of the same
version. :class:`StreamView` presents that tree as a store whose HEAD is derived from the real
one at every read (same lineage, writer, epoch and ETag; ``version``, ``manifest`` and
``manifest_sha256`` from the entry: HEAD's version's, or the newest retained version's that has
one when a publisher stopped publishing F), so every reader path (pull, follow, stage, partial
pulls, verify, log) reads a stream with the code and the checks it reads a store with: the
stream's manifests are verified against their digests and signatures, and its chain is walked
by its own ``parent_manifest`` links (and, below a chain that starts after a pause in the
format, on from the version before it: :meth:`StreamView.earlier`).

Heartbeats (``workers/``) go to the store itself, so the fleet ledger sees every worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from deltastore.errors import CorruptObjectError, StorageError, UnknownFormatError
from deltastore.format.manifest import ServingHeader, parse_serving_header
from deltastore.format.keys import HEAD_KEY, MANIFEST_PREFIX, manifest_key_version, stream_prefix
from deltastore.format.history import History
from deltastore.format.models import Head, Index, StreamRef, dump, find_stream
from deltastore.format.parse import parse_head
from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store, StreamedPut

logger = logging.getLogger(__name__)

#: Keys that belong to the store, not to the stream: the fleet ledger and the store's own records.
_PASS_THROUGH = ("workers/", "_deltastore/")


class StreamView(Store):
    """Format ``fmt`` of ``inner`` as a read-only store (see the module docstring).

    When the store's versions are themselves of format ``fmt`` (their ``stream``, e.g. a bf16
    state published with ``formats=["bf16", ...]``), the view reads them as they are.

    When HEAD's version carries no stream of ``fmt`` (its publisher stopped publishing it), the
    view's HEAD is the newest retained version that does (SPEC §15, read path). Reading HEAD
    raises :class:`~deltastore.errors.UnknownFormatError` (listing the formats HEAD's version
    has) when none does, and CorruptObjectError when an entry names a manifest of another
    version.

    Args:
        inner: the store (not owned: :meth:`close` leaves it open).
        fmt: the serving format, e.g. ``"fp8-block128"``.
    """

    def __init__(self, inner: Store, fmt: str):
        self.inner = inner
        self.format = fmt
        self.prefix = stream_prefix(fmt)
        # as a PrefixedStore's: the keys its readers name (in errors too) are under this prefix
        self.url = f"{inner.url}#{self.prefix}"
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.conditional_writes_need_probe = inner.conditional_writes_need_probe
        self._headers: dict[str, ServingHeader] = {}  # the last manifest's, by key
        self._lock = threading.Lock()
        self._derived: tuple[str, bytes] | None = None  # (main HEAD's etag, the derived HEAD's bytes)
        # True: the store's versions are themselves of this format (their ``stream``), read as
        # they are; False: a stream under ``streams/<format>/``; None: no version read yet.
        self._own: bool | None = None
        # When HEAD's version lacked the format: HEAD's manifest key and the newest version's
        # below it with the format (None: none retained)
        self._carrier_of: tuple[str, str | None] | None = None
        self._carrier_header: tuple[str, ServingHeader] | None = None  # that version's
        # The store's HEAD last derived, its history index (read and cached by the store's
        # History), and the stream's reading of that index (stream_index) by the index's key
        self._store_head: Head | None = None
        self._store_history = History(self.inner)
        self._stream_index: tuple[str, Index] | None = None

    # --- HEAD ----------------------------------------------------------------------------------

    def _derive(self, res: GetResult) -> GetResult:
        """The stream's HEAD for the store's HEAD ``res`` (cached by ETag)."""
        with self._lock:
            if self._derived is not None and self._derived[0] == res.meta.etag:
                return GetResult(data=self._derived[1], meta=res.meta)
        head = parse_head(res.data)
        self._store_head = head
        if head.manifest is None:  # a claimed, empty store: the stream is empty too
            derived = head.model_copy(update={"index": None})
        else:
            key = head.manifest
            m = self._header(key, head.manifest_sha256)
            if not m.carries(self.format):
                key, m = self._carrier(head, m)
            if self._own is None:  # decided by the first version read, then fixed
                self._own = m.stream == self.format
            if self._own:  # (a version below HEAD is never taken for the store's own format)
                if m.stream != self.format:
                    raise unknown_format(self.format, self.inner.url, m)
                return res
            ref = m.stream_ref(self.format)
            if ref is None:
                raise unknown_format(self.format, self.inner.url, m)
            # The index (floor, pins, squashes) is the store's: its squashes are the store's own
            # state's, never a stream's, so the stream's HEAD names none.
            derived = head.model_copy(update={"version": m.version, "manifest": self._stream_key(key, m.version, ref),
                                              "manifest_sha256": ref.sha256, "index": None})
        data = dump(derived)
        with self._lock:
            self._derived = (res.meta.etag, data)
        return GetResult(data=data, meta=ObjectMeta(key=HEAD_KEY, size=len(data), etag=res.meta.etag,
                                                    last_modified=res.meta.last_modified))

    def _header(self, key: str, sha256: str | None) -> ServingHeader:
        """The serving header of the store's manifest ``key`` (its chunk table and layout unread)."""
        got = self._headers.get(key)
        if got is None:
            got = parse_serving_header(self.inner.get(key), key, sha256)
            self._headers = {key: got}  # one: HEAD's
        return got

    def _carrier(self, head: Head, top: ServingHeader) -> tuple[str, ServingHeader]:
        """The newest version at or below ``head``'s (whose manifest's header is ``top``) with
        a stream of the format: its manifest key and serving header. A publisher that stopped
        publishing the format left its versions readable; its readers read the last of them.

        A follower's next HEAD costs nothing more: the carrier of HEAD's parent is kept.
        Otherwise the stream's manifests are listed (one LIST per thousand keys), and the
        newest listed version down to the retention floor whose manifest on HEAD's chain has
        the stream is found through skip pointers (a few manifest reads each). Raises
        UnknownFormatError (listing HEAD's formats) when no retained version has the stream,
        and when the format was the store's own (its versions are read without a format).
        """
        if self._own:  # the store's own format, no longer declared: its state is read without a format
            raise unknown_format(self.format, self.inner.url, top)
        assert head.manifest is not None
        index = self._store_history.index(head)
        floor = 1 if index is None else index.floor
        last = self._carrier_of
        got = None
        if last is not None and last[0] in (head.manifest, top.parent_manifest):
            found = last[1]  # HEAD's, or its parent's (a follower's next version)
        else:
            got = self._search(head, top.version, floor)
            found = None if got is None else got[0]
        self._carrier_of = (head.manifest, found)
        if found is None or (manifest_key_version(found) or 0) < floor:  # (found before the floor rose)
            raise unknown_format(self.format, self.inner.url, top, searched=True)
        if self._carrier_header is None or self._carrier_header[0] != found:  # a new one: said once
            self._carrier_header = got or (found, parse_serving_header(self.inner.get(found), found))
            logger.warning("version %d of %s has no serving format %r (its formats: %s): reading %r at version %d, "
                           "the newest that has it", top.version, self.inner.url, self.format,
                           ", ".join(top.formats()) or "none", self.format, self._carrier_header[1].version)
        return found, self._carrier_header[1]

    def stream_index(self, head: Head) -> Index | None:
        """The history index a reader of the stream applies under ``head`` (a HEAD this view
        derived; :class:`~deltastore.format.history.History`'s ``index_source``): the store's
        index of the store HEAD last derived (SPEC §15 *Retention*). Its floor applies to the
        stream as it is; each pin that has the stream names the stream's manifest of its
        version (the others are dropped); its squashes are the store's own state's, so none.
        The store's own format (``stream``) reads the index as it is.

        Raises:
            IntegrityError, CorruptObjectError: the index, or a pinned manifest, is damaged.
        """
        store_head = self._store_head
        index = None if store_head is None else self._store_history.index(store_head)
        if index is None or self._own:
            return index
        assert store_head is not None and store_head.index is not None
        key = store_head.index.key
        cached = self._stream_index
        if cached is not None and cached[0] == key:
            return cached[1]
        pins = []
        for pin in index.pins:
            entry = parse_serving_header(self.inner.get(pin.manifest), pin.manifest).stream_ref(self.format)
            if entry is not None and entry.key.startswith(self.prefix):
                pins.append(pin.model_copy(update={"manifest": entry.key[len(self.prefix):]}))
        stream = index.model_copy(update={"pins": tuple(pins), "squashes": ()})
        self._stream_index = (key, stream)
        return stream

    def earlier(self, version: int) -> tuple[str, str] | None:
        """The stream's manifest key and SHA-256 of its newest version below ``version``, at or
        above the retention floor, on the chain of the store's HEAD last derived (None: none).
        History's ``earlier``: a stream published again after a pause starts a new chain at an
        anchor (SPEC §15, read path), and its versions from before the pause are read through
        the store's manifests, which name them.

        Raises:
            CorruptObjectError: a store manifest names a stream manifest of another version.
        """
        head = self._store_head
        if head is None or head.manifest is None or self._own:
            return None
        index = self._store_history.index(head)
        got = self._search(head, version, 1 if index is None else index.floor)
        if got is None:
            return None
        key, header = got
        ref = header.stream_ref(self.format)
        assert ref is not None  # (a version with the stream is what _search finds)
        return self._stream_key(key, header.version, ref), ref.sha256

    def _stream_key(self, key: str, version: int, ref: StreamRef) -> str:
        """The stream's manifest key (under the view) that the store's manifest ``key`` of
        ``version`` names in its entry ``ref`` for the format, checked to be of that version."""
        if not ref.key.startswith(self.prefix) or manifest_key_version(ref.key[len(self.prefix):]) != version:
            raise CorruptObjectError(
                f"manifest {key!r} of {self.inner.url} names {ref.key!r} as its {self.format} stream: "
                f"not a manifest of version {version} under {self.prefix}"
            )
        return ref.key[len(self.prefix):]

    def _search(self, head: Head, below: int, floor: int) -> tuple[str, ServingHeader] | None:
        """The newest version in ``[floor, below)`` on ``head``'s chain with a stream of the
        format: the store's manifest key and the serving header of that manifest (None: none).
        The stream's listed manifests name the candidate versions (an uncommitted attempt's too:
        each is checked on the chain). The manifests read are not kept: a follower searches once."""
        n = len(self.prefix)
        versions = sorted({v for meta in self.inner.list(self.prefix + MANIFEST_PREFIX)
                           if (v := manifest_key_version(meta.key[n:])) is not None and floor <= v < below},
                          reverse=True)
        history = History(self.inner)
        for v in versions:
            key, m = history.find(v, head)
            if find_stream(m.streams, self.format) is not None:
                return key, ServingHeader(version=m.version, stream=m.stream, streams=tuple(m.streams),
                                          parent_manifest=m.parent_manifest)
        return None

    def _key(self, key: str) -> str:
        return key if self._own or key.startswith(_PASS_THROUGH) else self.prefix + key

    def _meta(self, meta: ObjectMeta) -> ObjectMeta:
        key = meta.key[len(self.prefix):] if not self._own and meta.key.startswith(self.prefix) else meta.key
        return ObjectMeta(key=key, size=meta.size, etag=meta.etag, last_modified=meta.last_modified)

    # --- Store ----------------------------------------------------------------------------------

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if key == HEAD_KEY:
            data = self._derive(self.inner.get_with_meta(HEAD_KEY)).data
            return data if byte_range is None else data[byte_range[0]:byte_range[1]]
        return self.inner.get(self._key(key), byte_range=byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        if key == HEAD_KEY:
            return self._derive(self.inner.get_with_meta(HEAD_KEY))
        res = self.inner.get_with_meta(self._key(key))
        return GetResult(data=res.data, meta=self._meta(res.meta))

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        res = self.inner.get_if_changed(self._key(key) if key != HEAD_KEY else HEAD_KEY, etag)
        if res is None:
            return None
        return self._derive(res) if key == HEAD_KEY else GetResult(data=res.data, meta=self._meta(res.meta))

    def head(self, key: str) -> ObjectMeta:
        if key == HEAD_KEY:
            return self.inner.head(HEAD_KEY)  # its size bounds the derived HEAD's (same fields, shorter keys)
        return self._meta(self.inner.head(self._key(key)))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        for meta in self.inner.list(self._key(prefix)):
            yield self._meta(meta)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if not key.startswith(_PASS_THROUGH):
            raise StorageError(f"{self.url} is a serving format's view, read-only to its readers: cannot write {key!r}")
        return self.inner.put(key, data, mode=mode)

    def delete(self, key: str) -> None:
        if not key.startswith(_PASS_THROUGH):
            raise StorageError(f"{self.url} is a serving format's view, read-only to its readers: cannot delete {key!r}")
        self.inner.delete(key)

    def begin_put(self, directory: str) -> StreamedPut | None:
        return None

    def close(self) -> None:
        """Nothing to release: ``inner`` belongs to whoever opened it."""


def unknown_format(fmt: str, url: str, m: ServingHeader, *, searched: bool = False) -> UnknownFormatError:
    """The refusal of format ``fmt``, which version ``m`` of ``url`` does not carry (``searched``:
    nor does any retained version below it)."""
    have = m.formats()
    listed = ", ".join(repr(f) for f in have) if have else "none (only its own state: read it without a format)"
    below = ", nor does any earlier version it retains" if searched else ""
    return UnknownFormatError(
        f"version {m.version} of {url} has no serving format {fmt!r}{below}; its formats: {listed}", available=have,
    )


__all__ = ["StreamView", "unknown_format"]
