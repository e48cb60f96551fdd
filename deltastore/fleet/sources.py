"""Reading one store through its mirrors (SPEC §16.1): the nearest copy serves the bytes, the
origin vouches for what is applied.

A :class:`Sources` is the store a ``Subscriber(url, mirrors=[...])`` reads: an ordered list of
sources, the mirrors nearest first and the origin (``url``) last. Two rules keep a worker from
applying anything the origin does not vouch for:

- **HEAD comes from the origin, or is vouched by it.** Each poll reads the mirrors' HEADs first,
  then the origin's (conditional GETs: no body while unchanged). A mirror's HEAD is used only
  when it is of the origin's lineage and names the origin's head manifest, or the manifest the
  origin's own chain has at that version (checked by walking the origin's chain down from its
  head, SPEC §7 step 3: a mirror behind the origin is an older head, never another history). A
  worker never goes back: a mirror behind the newest version already served is passed over.
  Otherwise the origin's HEAD is served. HEAD is not signed (SPEC §3.1), so a mirror's HEAD on
  its own proves nothing: a mirror could store a self-consistent forged manifest.
- **Every other object is named by its SHA-256** (manifests, packs, layouts, parts, indexes,
  squashes, streams: SPEC §1), reached from that vouched HEAD. Each is read from the first source
  that holds it and whose bytes match the digest in its key; a source that lacks it (behind) is
  passed over quietly, one that serves other bytes (corrupt, or a foreign object under that
  key) or fails is passed over with a warning naming the source and the object, and the origin
  is read last. A byte range of a pack is read from a mirror only after that mirror's whole
  object was read once and matched its digest (the first range read fetches it whole).
- **A mirror that stops is left behind.** A mirror still lacking a version the origin's HEAD
  named more than ``max_lag_s`` ago is passed over (with a warning) until it catches up: the
  fleet then reads the origin, as it would without mirrors.

Keys that are not content-addressed (``workers/`` heartbeats, ``gc/``, ``_deltastore/``, a fleet
target) are read from and written to the origin only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltastore.errors import DeltastoreError, NotFoundError, StorageError
from deltastore.fleet.deadlines import Deadlines, DeadlineStore
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, digest_from_key, is_content_key, sha256_hex
from deltastore.format.models import Head, dump
from deltastore.format.parse import parse_head
from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store, StreamedPut

logger = logging.getLogger(__name__)

#: (source, key) verdicts remembered: a worker reads a few objects per version, so this covers
#: weeks of versions' packs while bounding a Subscriber that follows for months.
VERDICTS_MAX = 4096
#: Mirror manifests vouched for (on the origin's chain), remembered by key.
VOUCHED_MAX = 256
#: Default seconds a mirror may lag: once the oldest origin version it lacks was first seen
#: this long ago, its HEAD is passed over and the worker reads the origin's (a stopped mirror
#: must not freeze the fleet). Long enough for a mirror to copy an anchor across regions.
MAX_MIRROR_LAG_S = 120.0
#: Origin head versions whose first sighting is remembered (to measure a mirror's lag).
SIGHTINGS_MAX = 64


@dataclass(frozen=True)
class SourceStats:
    """Bytes and objects each source served (for a benchmark or a dashboard).

    Attributes:
        url: the source.
        objects / bytes: content-addressed objects (or ranges) it served.
        refused: objects it served whose bytes did not match their digest (or that failed).
    """

    url: str
    objects: int
    bytes: int
    refused: int


class _Bounded:
    """A small thread-safe LRU set."""

    def __init__(self, entries: int):
        self._d: OrderedDict[Any, None] = OrderedDict()
        self._entries = entries
        self._lock = threading.Lock()

    def __contains__(self, item: Any) -> bool:
        with self._lock:
            if item in self._d:
                self._d.move_to_end(item)
                return True
            return False

    def add(self, item: Any) -> None:
        with self._lock:
            self._d[item] = None
            self._d.move_to_end(item)
            while len(self._d) > self._entries:
                self._d.popitem(last=False)


class _Content(Store):
    """The content-addressed keys of a :class:`Sources`, for walking the origin's chain (HEAD is
    never read through it)."""

    def __init__(self, sources: Sources):
        self._s = sources
        self.url = sources.url

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        return self._s.get(key, byte_range=byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        return self._s.get_with_meta(key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        return self._s.get_if_changed(key, etag)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        raise StorageError(f"{key!r}: the chain walk of {self.url} writes nothing")

    def head(self, key: str) -> ObjectMeta:
        return self._s.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self._s.list(prefix)

    def delete(self, key: str) -> None:
        raise StorageError(f"{key!r}: the chain walk of {self.url} deletes nothing")


@dataclass
class _Polled:
    """The last HEAD a source answered: its ETag, bytes and parse (None: no HEAD)."""

    etag: str | None = None
    raw: bytes | None = None
    head: Head | None = None
    failing: bool = False  # warned once about this source's HEAD until it answers again


class Sources(Store):
    """The origin store read through an ordered list of mirrors (see the module docstring).

    Args:
        origin: the store the publisher writes (the authority: HEAD and lineage).
        mirrors: mirrors of it, nearest first.
        owned: stores among these that :meth:`close` closes (those opened from URLs).
        max_lag_s: how long a mirror may lack a version the origin has before it is passed over.

    Example::

        sources = Sources.open(origin_store, ["s3://eu-west/run1"])
        sub = Subscriber(origin_store.url, store=sources)
    """

    def __init__(self, origin: Store, mirrors: Sequence[Store], *, owned: Sequence[Store] = (),
                 max_lag_s: float = MAX_MIRROR_LAG_S):
        if not max_lag_s > 0:
            raise ValueError(f"max_lag_s must be > 0, got {max_lag_s}")
        self.origin = origin
        self.mirrors = tuple(mirrors)
        self.url = origin.url
        self.atomic_conditional_writes = origin.atomic_conditional_writes
        self.conditional_writes_need_probe = origin.conditional_writes_need_probe
        self._owned = list(owned)
        self._lock = threading.Lock()
        self._head_lock = threading.Lock()
        self._polled = [_Polled() for _ in range(len(self.mirrors) + 1)]  # mirrors, then the origin
        self._served: tuple[bytes, str] | None = None  # the HEAD bytes last served and their ETag
        self._high = 0  # the newest version served: never serve an older one
        self._verified = _Bounded(VERDICTS_MAX)  # (mirror index, key) whose whole bytes matched
        self._refused = _Bounded(VERDICTS_MAX)  # (mirror index, key) that did not
        self._vouched = _Bounded(VOUCHED_MAX)  # mirror manifest keys on the origin's chain
        self._warned_lineage: set[tuple[int, str]] = set()
        self._key_locks: dict[tuple[int, str], threading.Lock] = {}
        self._stats = [[0, 0, 0] for _ in range(len(self.mirrors) + 1)]
        self.max_lag_s = max_lag_s
        self._sighted: OrderedDict[int, float] = OrderedDict()  # origin head version → first seen
        self._lagging: set[int] = set()  # mirrors passed over for lag (warned once)
        self._history = History(_Content(self))

    @classmethod
    def open(cls, origin: Store, mirrors: Sequence[Store | str], *, storage_options: Mapping[str, Any] | None = None,
             owns_origin: bool = False, max_lag_s: float = MAX_MIRROR_LAG_S,
             deadlines: Deadlines | None = None) -> Sources:
        """A :class:`Sources` over ``origin`` and ``mirrors`` (stores, or URLs opened read-only
        with ``storage_options``); ``owns_origin``: :meth:`close` closes ``origin`` too.
        ``deadlines``: every request to each source is bounded by them
        (:class:`~deltastore.fleet.deadlines.DeadlineStore`), so that a stalled mirror is a failed
        one and the next source serves.

        Raises:
            UnsupportedURLError: a mirror URL is malformed.
            ValueError: a mirror is the origin itself.
        """
        from deltastore.storage import open_store

        opened: list[Store] = []
        stores: list[Store] = []
        try:
            for m in mirrors:
                if isinstance(m, Store):
                    stores.append(m)
                    continue
                s = open_store(m, storage_options=dict(storage_options or {}), create=False)
                opened.append(s)
                stores.append(s)
            for s in stores:
                if s.url == origin.url:
                    raise ValueError(f"mirror {s.url} is the origin itself; list mirrors of it, nearest first")
        except BaseException:
            for s in opened:
                s.close()
            raise
        owned = [*opened, origin] if owns_origin else opened
        if deadlines is not None:
            origin, stores = DeadlineStore(origin, deadlines), [DeadlineStore(s, deadlines) for s in stores]
        return cls(origin, stores, owned=owned, max_lag_s=max_lag_s)

    # --- HEAD -----------------------------------------------------------------------------

    def _source_url(self, i: int) -> str:
        return self.mirrors[i].url if i < len(self.mirrors) else self.origin.url

    def _poll(self, i: int) -> _Polled:
        """Conditional GET of source ``i``'s HEAD; the origin's failures propagate, a mirror's
        are logged (once per outage) and leave it without a HEAD."""
        store = self.mirrors[i] if i < len(self.mirrors) else self.origin
        p = self._polled[i]
        try:
            res = store.get_if_changed(HEAD_KEY, p.etag)
            if res is not None:
                p.etag, p.raw, p.head = res.meta.etag, res.data, parse_head(res.data)
            p.failing = False
        except NotFoundError:
            p.etag = p.raw = p.head = None
        except DeltastoreError as e:
            if i == len(self.mirrors):
                raise
            if not p.failing:
                logger.warning("mirror %s: reading its HEAD failed (%s); reading from the next source until it answers",
                               store.url, e)
            p.failing = True
            p.etag = p.raw = p.head = None
        return p

    def _resolve_head(self) -> tuple[bytes, str]:
        """The HEAD to serve now and its ETag (see the module docstring). Raises NotFoundError
        when the origin has none."""
        with self._head_lock:
            mirrored = [self._poll(i) for i in range(len(self.mirrors))]  # before the origin: it is never behind them
            origin = self._poll(len(self.mirrors))
            if origin.head is None or origin.raw is None:
                raise NotFoundError(f"HEAD of {self.origin.url} does not exist (the store is empty)")
            if origin.head.version not in self._sighted:
                self._sighted[origin.head.version] = time.monotonic()
                while len(self._sighted) > SIGHTINGS_MAX:
                    self._sighted.popitem(last=False)
            raw = origin.raw
            for i, p in enumerate(mirrored):
                chosen = self._vouch(i, p, origin.head)
                if chosen is not None:
                    raw = chosen
                    break
            version = parse_head(raw).version
            self._high = max(self._high, version)
            # the origin's own head is on its chain: a mirror that reaches it later (the worker
            # holds it, the mirror is one version behind the origin) needs no walk to vouch for it
            self._vouched.add(origin.head.manifest)
            if self._served is None or self._served[0] != raw:
                self._served = (raw, '"' + hashlib.sha256(raw).hexdigest()[:32] + '"')
            return self._served

    def _vouch(self, i: int, p: _Polled, origin: Head) -> bytes | None:
        """The HEAD to serve from mirror ``i``'s HEAD, if the origin vouches for it, else None."""
        h = p.head
        if h is None or h.manifest is None:
            return None
        url = self.mirrors[i].url
        if h.lineage != origin.lineage:
            if (i, h.lineage) not in self._warned_lineage:
                self._warned_lineage.add((i, h.lineage))
                logger.warning("mirror %s serves lineage %s, not the origin %s's %s: not a mirror of it; reading from "
                               "the next source", url, h.lineage, self.origin.url, origin.lineage)
            return None
        if h.version > origin.version or h.version < self._high:
            return None  # ahead of the origin (it went back) or behind what this worker already has
        if h.manifest == origin.manifest and h.manifest_sha256 == origin.manifest_sha256:
            self._lagging.discard(i)
            return None  # the same head: the origin's HEAD (and its index) is served, bytes from the mirror
        lag = time.monotonic() - min((t for v, t in self._sighted.items() if v > h.version), default=time.monotonic())
        if lag > self.max_lag_s:
            if i not in self._lagging:
                self._lagging.add(i)
                logger.warning("mirror %s is at version %d, and has lacked a newer version of the origin %s for %.0fs: "
                               "reading the origin's head until it catches up", url, h.version, self.origin.url, lag)
            return None
        if h.manifest not in self._vouched:
            try:
                index = self._history.index(origin)
                if index is not None and h.version < index.floor:
                    return None  # the origin collected it: of no use
                key, _ = self._history.find(h.version, origin)
            except DeltastoreError as e:
                logger.warning("mirror %s: cannot check its head version %d against the origin %s (%s); reading "
                               "from the next source", url, h.version, self.origin.url, e)
                return None
            if key != h.manifest:
                logger.warning("mirror %s names %r as version %d, but the origin %s's chain has %r: not vouched; "
                               "reading from the next source", url, h.manifest, h.version, self.origin.url, key)
                return None
            self._vouched.add(h.manifest)
        logger.debug("mirror %s is behind the origin (version %d < %d): serving its head", url, h.version, origin.version)
        # the mirror's version, with the origin's index (retention is the origin's word)
        return dump(h.model_copy(update={"index": origin.index}))

    # --- content --------------------------------------------------------------------------

    def _count(self, i: int, n: int, refused: bool = False) -> None:
        with self._lock:
            s = self._stats[i]
            if refused:
                s[2] += 1
            else:
                s[0] += 1
                s[1] += n

    def _refuse(self, i: int, key: str, why: str) -> None:
        self._refused.add((i, key))
        self._count(i, 0, refused=True)
        logger.warning("mirror %s %s %r; reading it from the next source", self.mirrors[i].url, why, key)

    def _from_mirror(self, i: int, key: str, byte_range: tuple[int, int] | None) -> bytes | None:
        """``key`` (or a range of it) from mirror ``i``, checked; None when it cannot serve it."""
        if (i, key) in self._refused:
            return None
        store = self.mirrors[i]
        try:
            if byte_range is not None and (i, key) in self._verified:
                return store.get(key, byte_range=byte_range)
            with self._lock:
                lock = self._key_locks.setdefault((i, key), threading.Lock())
            try:
                with lock:  # one whole read per object when parallel ranges arrive first
                    if byte_range is not None and (i, key) in self._verified:
                        return store.get(key, byte_range=byte_range)
                    data = store.get(key)
                    if sha256_hex(data) != digest_from_key(key):
                        self._refuse(i, key, "served bytes that do not match the SHA-256 in the key of")
                        return None
                    self._verified.add((i, key))
            finally:
                with self._lock:
                    self._key_locks.pop((i, key), None)
            return data if byte_range is None else data[byte_range[0]:byte_range[1]]
        except NotFoundError:
            logger.debug("mirror %s lacks %r (behind): next source", store.url, key)
            return None
        except DeltastoreError as e:
            self._refuse(i, key, f"failed ({e}) to serve")
            return None

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if key == HEAD_KEY:
            raw = self._resolve_head()[0]
            return raw if byte_range is None else raw[byte_range[0]:byte_range[1]]
        if is_content_key(key):
            for i in range(len(self.mirrors)):
                data = self._from_mirror(i, key, byte_range)
                if data is not None:
                    self._count(i, len(data))
                    return data
            data = self.origin.get(key, byte_range=byte_range)
            self._count(len(self.mirrors), len(data))
            return data
        return self.origin.get(key, byte_range=byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        if key == HEAD_KEY:
            raw, etag = self._resolve_head()
            return GetResult(raw, ObjectMeta(HEAD_KEY, len(raw), etag))
        if is_content_key(key):
            data = self.get(key)
            return GetResult(data, ObjectMeta(key, len(data), f'"{digest_from_key(key)[:32]}"'))
        return self.origin.get_with_meta(key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        if key == HEAD_KEY or is_content_key(key):
            got = self.get_with_meta(key)
            return None if etag is not None and got.meta.etag == etag else got
        return self.origin.get_if_changed(key, etag)

    def head(self, key: str) -> ObjectMeta:
        if key == HEAD_KEY:
            raw, etag = self._resolve_head()
            return ObjectMeta(HEAD_KEY, len(raw), etag)
        if is_content_key(key):
            for i, m in enumerate(self.mirrors):
                if (i, key) in self._refused:
                    continue
                try:
                    return m.head(key)
                except DeltastoreError:
                    continue
        return self.origin.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.origin.list(prefix)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        """Writes (a worker's heartbeats) go to the origin."""
        return self.origin.put(key, data, mode=mode)

    def delete(self, key: str) -> None:
        self.origin.delete(key)

    def begin_put(self, directory: str) -> StreamedPut | None:
        return self.origin.begin_put(directory)

    def stats(self) -> list[SourceStats]:
        """What each source served so far: the mirrors in order, then the origin."""
        with self._lock:
            return [SourceStats(self._source_url(i), *s) for i, s in enumerate(self._stats)]

    def close(self) -> None:
        """Close the stores opened from URLs (and the origin when it was handed over)."""
        for s in self._owned:
            s.close()
        self._owned = []


__all__ = ["MAX_MIRROR_LAG_S", "SourceStats", "Sources"]
