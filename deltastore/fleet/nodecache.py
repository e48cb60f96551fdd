"""One fetch per node: a directory of immutable objects shared by the worker processes of a host.

The ranks of a tensor-parallel engine, and several engines on one node, read the same packs of
every version. Through a :class:`NodeCacheStore` they read them from one cache directory
instead: the first process to need an object fetches it whole from the store, under a file lock,
into the directory; the others wait on that lock and read the file. Each object then leaves the
bucket once per node, however many processes read it.

Only immutable objects are cached (docs/SPEC.md §1): manifests, packs, layouts, part
manifests, squash manifests and history indexes, each named by the SHA-256 of its bytes, also
inside a serving stream's tree. ``HEAD``, heartbeats, GC records and anything else pass through
to the store untouched, so polling and every check of the read path see the store itself.

Layout of a cache directory::

    objects/<sha256><suffix>        a verified object, e.g. objects/3f…a9.pack
    locks/<sha256><suffix>.lock     held (flock) by the process fetching that object
    tmp/<name>.<pid>.<hex>.partial  an object being fetched
    evict.lock                      held by the process trimming the cache to its bound

Guarantees:

- *No partial or foreign file is ever served as an object.* A fetch streams the object into
  ``tmp/``, checks its SHA-256 against the digest its key names, fsyncs it and renames it into
  ``objects/`` (atomic on one filesystem). An object whose bytes do not match is not cached:
  :class:`~deltastore.errors.IntegrityError`.
- *A crashed fetcher costs nothing but its fetch.* The lock is ``flock(2)``: the kernel releases
  it when the holder dies, however it dies; the next process takes it, removes the leftover
  temporary file and fetches again.
- *A cached file damaged later is replaced, not served.* Each process hashes a file once before
  its first use (one SHA-256 pass per object and process, far cheaper than fetching it) and
  again whenever its size or modification time changed (a write into it); a file that fails is
  deleted and fetched again. Damage the checks cannot see (a bit flipped on disk after the
  check) is caught by the read path, which checks every segment's SHA-256 (SPEC §7.6) and
  retries: a process asked again for bytes it already served hashes the file first, so the retry
  replaces it. ``NodeCache(verify_reads=False)`` skips the first hash and trusts the disk: a
  damaged file then fails one read (IntegrityError, nothing applied) before it is replaced,
  in the process that read it.
- *Bounded.* After each fetch, least recently used files (by access time, set on every read)
  are deleted until the directory holds at most ``max_bytes``; a file being read (a shared ``flock``) is never deleted, and an object
  larger than the bound is read from the store without caching.
- *Never a reason to fail.* A cache directory that stops working (a full disk, permissions) is
  logged and the store is read directly; a holder that keeps the lock longer than
  ``lock_wait_s`` (a stalled fetch) is no reason to wait for ever: the waiter reads the store.

Locks are ``fcntl.flock`` (Linux, macOS): blocking semantics released by the kernel on exit, no
dependency. On a network filesystem (NFS) ``flock`` is emulated or local to the client: keep
the directory on a local disk (or a tmpfs) of the node.

Example::

    from deltastore.fleet.nodecache import NodeCache
    sub = Subscriber("s3://bucket/run1", node_cache="/dev/shm/deltastore")   # every rank
    sub = Subscriber(url, node_cache=NodeCache("/var/cache/ds-node", max_bytes=16 << 30))
"""

from __future__ import annotations

import collections
import glob
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deltastore._util.files import fsync_path
from deltastore.errors import DeltastoreError, IntegrityError, NodeCacheError
from deltastore.format.keys import CONTENT_KEY
from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store, StreamedPut, check_range

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the constructor says so
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Environment variable naming the node cache directory of every Subscriber that is not given
#: one (``node_cache=None``): an operator turns the cache on for workers built by integrations.
NODE_CACHE_ENV = "DELTASTORE_NODE_CACHE"
#: Environment variable bounding that directory, in bytes (default :data:`DEFAULT_MAX_BYTES`).
NODE_CACHE_MAX_BYTES_ENV = "DELTASTORE_NODE_CACHE_MAX_BYTES"

#: Default bound of a cache directory: dozens of versions' deltas of a 7B model (about 100 MB
#: each) or a small model's anchor; raise it to keep the anchors of large models.
DEFAULT_MAX_BYTES = 4 << 30
#: How long a process waits for another one's fetch of the same object before it reads the
#: store itself: longer than a whole anchor of a large model takes to arrive on a slow link,
#: short enough that a stalled fetcher does not stall the node.
DEFAULT_LOCK_WAIT_S = 600.0
#: Bytes of an object fetched per GET: what a fetch holds in memory, whatever the object's size
#: (the read path holds at most two 64 MiB batches, SPEC §7.8). An object that fits in one piece,
#: every delta pack in practice, costs one GET; a larger one costs a HEAD and one GET per piece.
FETCH_PIECE_BYTES = 64 << 20
#: First and longest pause between two tries of a busy lock: short at first, because the common
#: wait is another rank's fetch of one delta pack (tens of milliseconds).
LOCK_POLL_FIRST_S = 0.002
LOCK_POLL_MAX_S = 0.05
#: Objects whose served ranges each process remembers, to recognise a read path asking again
#: for bytes it was already given (its retry after a segment failed its SHA-256).
SERVED_MEMORY = 4096
#: Ranges remembered per object (a partial or range-part reader asks for many of one pack).
SERVED_RANGES_PER_OBJECT = 4096
#: Times one read tries to find its object in the cache (a file evicted or replaced between
#: the fill and the read) before it reads the store directly.
FILL_ATTEMPTS = 3

def cache_name(key: str) -> tuple[str, str] | None:
    """``(file name, SHA-256)`` under which ``key``'s object is cached, or None for a key that is
    not an immutable object's (HEAD, heartbeats, GC records, anything unknown).

    The name is the digest and the key's suffix, not the key: the same bytes under two attempts,
    in a mirror and in the origin, are one file.

    Example::

        cache_name("objects/" + "0" * 32 + "/" + "ab" * 32 + ".pack")   # ("abab….pack", "abab…")
        cache_name("HEAD")                                             # None
    """
    m = CONTENT_KEY.fullmatch(key)
    if m is None:
        return None
    digest = m.group("manifest") or m.group("object")
    suffix = m.group("msuffix") or m.group("osuffix")
    return digest + (".manifest.json.zst" if m.group("manifest") else suffix), digest


@dataclass(frozen=True)
class NodeCache:
    """Where and how big a node cache is (a value; :class:`NodeCacheStore` uses it).

    Attributes:
        path: the directory shared by the processes of one node (created if missing); on a
            local disk or tmpfs, not a network filesystem.
        max_bytes: the most bytes of objects it keeps (least recently used files go first).
        lock_wait_s: the longest a process waits for another one's fetch of an object before
            it reads the store itself.
        verify_reads: hash every cached file once per process before its first use (and
            after a write into it); False trusts the disk and leaves damage to the read path's
            segment checks, whose retry replaces the file.
    """

    path: str | os.PathLike[str]
    max_bytes: int = DEFAULT_MAX_BYTES
    lock_wait_s: float = DEFAULT_LOCK_WAIT_S
    verify_reads: bool = True

    def __post_init__(self) -> None:
        if not str(self.path):
            raise ValueError("a node cache needs a directory path, got ''")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive number of bytes, got {self.max_bytes!r}")
        if not self.lock_wait_s > 0:
            raise ValueError(f"lock_wait_s must be positive, got {self.lock_wait_s!r}")

    @classmethod
    def from_env(cls) -> NodeCache | None:
        """The node cache that ``DELTASTORE_NODE_CACHE`` (a directory) and
        ``DELTASTORE_NODE_CACHE_MAX_BYTES`` describe; None when the first is unset or empty.

        Raises:
            ValueError: ``DELTASTORE_NODE_CACHE_MAX_BYTES`` is not a positive integer.
        """
        path = os.environ.get(NODE_CACHE_ENV, "")
        if not path:
            return None
        raw = os.environ.get(NODE_CACHE_MAX_BYTES_ENV, "")
        try:
            max_bytes = int(raw) if raw else DEFAULT_MAX_BYTES
        except ValueError:
            raise ValueError(f"{NODE_CACHE_MAX_BYTES_ENV} must be a number of bytes, got {raw!r}") from None
        return cls(path, max_bytes=max_bytes)


@dataclass(frozen=True)
class NodeCacheStats:
    """What one :class:`NodeCacheStore` did so far (this process's share of the node's work).

    Attributes:
        fetched: objects this process fetched from the store into the cache.
        bytes_fetched: bytes of immutable objects read from the store (fetches, and reads
            that bypassed the cache).
        hits: reads served from a cached file.
        waited: reads that found the object after waiting for another process's fetch.
        verified: cached files hashed before a read (asked again, past their end, or
            ``verify_reads``).
        refetched: cached files found damaged, deleted and fetched again.
        bypassed: reads sent to the store directly (object above the bound, lock wait
            exceeded, cache directory failing).
        evicted: files this process deleted to keep the bound.
    """

    fetched: int = 0
    bytes_fetched: int = 0
    hits: int = 0
    waited: int = 0
    verified: int = 0
    refetched: int = 0
    bypassed: int = 0
    evicted: int = 0


#: What :meth:`NodeCacheStore._fill` found: the file is there, fetched by another process
#: (``_READY``) or by this one (``_FETCHED``).
_READY = "ready"
_FETCHED = "fetched"


class _Damaged:
    """A cached file that failed its check, by identity (so only that file is deleted)."""

    def __init__(self, ident: tuple[int, ...]):
        self.ident = ident


class NodeCacheStore(Store):
    """``inner`` with its immutable objects read through a node cache directory.

    Reads of immutable keys (see :func:`cache_name`) are served from ``<path>/objects/``, the
    first process to miss one fetching it whole for all; every other verb, and every other key,
    goes to ``inner`` unchanged. It shares ``inner``'s capability flags and URL and does not own
    it: :meth:`close` leaves ``inner`` open.

    Args:
        inner: the store (the origin, or a mirror list's store).
        cache: the cache (:class:`NodeCache`), or its directory with the defaults.

    Raises:
        NodeCacheError: the directory cannot be created or written, or this platform has no
            ``flock``.

    Example::

        store = NodeCacheStore(open_store("s3://bucket/run1"), NodeCache("/dev/shm/ds"))
        sub = Subscriber("s3://bucket/run1", store=store)
    """

    def __init__(self, inner: Store, cache: NodeCache | str | os.PathLike[str]):
        self.cache = cache if isinstance(cache, NodeCache) else NodeCache(cache)
        self.inner = inner
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.conditional_writes_need_probe = inner.conditional_writes_need_probe
        root = Path(self.cache.path)
        self._objects, self._locks, self._tmp = root / "objects", root / "locks", root / "tmp"
        self._evict_lock = root / "evict.lock"
        if fcntl is None:  # pragma: no cover
            raise NodeCacheError(f"node cache {root}: this platform has no flock(2); run without node_cache")
        try:
            for d in (self._objects, self._locks, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
            probe = self._tmp / f"probe.{os.getpid()}.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise NodeCacheError(
                f"node cache directory {root} cannot be used ({e.strerror or e}); "
                "pass a writable directory on a local disk, or no node cache"
            ) from e
        self._mutex = threading.Lock()
        self._served: collections.OrderedDict[str, list[tuple[int, int]]] = collections.OrderedDict()
        self._verified: collections.OrderedDict[tuple[int, ...], None] = collections.OrderedDict()
        self._too_large: set[str] = set()
        self._counts = dict.fromkeys(NodeCacheStats.__dataclass_fields__, 0)
        self._warned = False

    # --- the Store verbs ------------------------------------------------------------------------

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        named = cache_name(key)
        if named is None:
            return self.inner.get(key, byte_range=byte_range)
        check_range(byte_range)
        return self._read(key, *named, byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        named = cache_name(key)
        if named is None:
            return self.inner.get_with_meta(key)
        data = self._read(key, *named, None)
        # An immutable object has one version: its digest serves as its ETag.
        return GetResult(data=data, meta=ObjectMeta(key=key, size=len(data), etag=named[1]))

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        return self.inner.get_if_changed(key, etag)  # HEAD: the store's own ETags

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        return self.inner.put(key, data, mode=mode)

    def head(self, key: str) -> ObjectMeta:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def begin_put(self, directory: str) -> StreamedPut | None:
        return self.inner.begin_put(directory)

    def close(self) -> None:
        """Nothing to release: ``inner`` belongs to whoever opened it."""

    def stats(self) -> NodeCacheStats:
        """What this store did so far (this process only)."""
        with self._mutex:
            return NodeCacheStats(**self._counts)

    # --- reading --------------------------------------------------------------------------------

    def _count(self, **add: int) -> None:
        with self._mutex:
            for k, v in add.items():
                self._counts[k] += v

    def _read(self, key: str, name: str, digest: str, byte_range: tuple[int, int] | None) -> bytes:
        if name in self._too_large:
            return self._direct(key, byte_range)
        waited = False
        try:
            for _ in range(FILL_ATTEMPTS):
                got = self._from_file(name, digest, byte_range)
                if isinstance(got, bytes):
                    self._count(hits=1, waited=int(waited))
                    return got
                filled = self._fill(key, name, digest, got, byte_range)
                if isinstance(filled, bytes):
                    return filled
                if filled is None:  # lock wait exceeded, or the object is above the bound
                    break
                waited = filled == _READY
        except OSError as e:
            if isinstance(e, DeltastoreError):  # the store's own error (AccessDeniedError): not ours
                raise
            self._cache_failed(e)
        return self._direct(key, byte_range)

    def _direct(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range=byte_range)
        self._count(bypassed=1, bytes_fetched=len(data))
        return data

    def _cache_failed(self, e: OSError) -> None:
        if not self._warned:  # once per store: a full disk would otherwise log every read
            logger.warning("node cache %s failed (%s); reading %s directly until it works again",
                           self.cache.path, e, self.url)
            self._warned = True

    def _from_file(self, name: str, digest: str, byte_range: tuple[int, int] | None) -> bytes | _Damaged | None:
        """The range of the cached file (None: not cached; _Damaged: cached, failed its check)."""
        try:
            fd = os.open(self._objects / name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # an evictor never deletes a file under a shared lock
            st = os.fstat(fd)
            if st.st_nlink == 0:  # deleted between open and lock (evicted or replaced)
                return None
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # a write changes the last two
            start, stop = byte_range if byte_range is not None else (0, st.st_size)
            again = self._served_before(name, start, stop)
            with self._mutex:
                known_good = ident in self._verified
            # Bytes asked for again (the read path's retry after a segment failed its SHA-256), or
            # past the file's end (truncated): the file may be damaged, so it is hashed first.
            if again or ((stop > st.st_size or self.cache.verify_reads) and not known_good):
                self._count(verified=1)
                if _file_sha256(fd) != digest:
                    logger.warning("node cache file %s does not match its SHA-256; fetching it again",
                                   self._objects / name)
                    return _Damaged(ident[:2])
                self._mark_verified(ident)
            data = _pread(fd, start, min(stop, st.st_size))
            try:  # atime is the last use (eviction takes the oldest); mtime stays the last write
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            except OSError:
                pass  # another user's file in a shared directory: LRU order is a hint
            self._remember(name, start, stop)
            return data
        finally:
            os.close(fd)

    def _mark_verified(self, ident: tuple[int, ...]) -> None:
        with self._mutex:
            self._verified[ident] = None
            while len(self._verified) > SERVED_MEMORY:
                self._verified.popitem(last=False)

    def _served_before(self, name: str, start: int, stop: int) -> bool:
        with self._mutex:
            ranges = self._served.get(name)
            return ranges is not None and any(s < stop and start < e for s, e in ranges)

    def _remember(self, name: str, start: int, stop: int) -> None:
        with self._mutex:
            ranges = self._served.setdefault(name, [])
            self._served.move_to_end(name)
            ranges.append((start, stop))
            del ranges[:-SERVED_RANGES_PER_OBJECT]
            while len(self._served) > SERVED_MEMORY:
                self._served.popitem(last=False)

    # --- filling --------------------------------------------------------------------------------

    def _fill(self, key: str, name: str, digest: str, damaged: _Damaged | None,
              byte_range: tuple[int, int] | None) -> bytes | str | None:
        """Fetch ``key`` into the cache unless another process did: _READY or _FETCHED when the
        file is there to be read, the bytes asked for when this fetch kept them in memory (an
        object of one piece), None when the store must be read directly."""
        lock = self._acquire(name)
        if lock is None:
            logger.warning("node cache: another process has been fetching %s for over %.0f s; reading it from %s",
                           key, self.cache.lock_wait_s, self.url)
            return None
        try:
            path = self._objects / name
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None:
                if damaged is None or (st.st_dev, st.st_ino) != damaged.ident:
                    return _READY  # fetched by another process while this one waited
                path.unlink()
                self._count(refetched=1)
                with self._mutex:  # what was served came from the damaged file, not the next one
                    self._served.pop(name, None)
            self._remove_partials(name)
            data = self._fetch(key, name, digest, byte_range)
        finally:
            os.close(lock)  # releases the flock
        self._evict(keep=name)
        return data

    def _fetch(self, key: str, name: str, digest: str, byte_range: tuple[int, int] | None) -> bytes | str | None:
        """Stream ``key`` into ``tmp/``, check its SHA-256, rename it into ``objects/``."""
        first = self.inner.get(key, byte_range=(0, FETCH_PIECE_BYTES))
        self._count(bytes_fetched=len(first))
        if len(first) == FETCH_PIECE_BYTES:
            size = self.inner.head(key).size
            if size > self.cache.max_bytes:
                with self._mutex:
                    self._too_large.add(name)
                logger.info("node cache: %s (%d bytes) is larger than the cache (%d bytes); read from %s directly",
                            key, size, self.cache.max_bytes, self.url)
                start, stop = byte_range if byte_range is not None else (0, size)
                if stop <= len(first):
                    self._count(bypassed=1)
                    return first[start:stop]
                return None  # read directly (_direct)
        elif len(first) > self.cache.max_bytes:
            with self._mutex:
                self._too_large.add(name)
            self._count(bypassed=1)
            return _cut(first, byte_range)
        tmp = self._tmp / f"{name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                h = hashlib.sha256(first)
                _write_all(fd, first)
                offset = len(first)
                if offset == FETCH_PIECE_BYTES:
                    while offset < size:
                        piece = self.inner.get(key, byte_range=(offset, min(size, offset + FETCH_PIECE_BYTES)))
                        self._count(bytes_fetched=len(piece))
                        if not piece:
                            raise IntegrityError(f"object {key!r} of {self.url} ended at {offset} of its {size} bytes; "
                                                 "the object is truncated")
                        h.update(piece)
                        _write_all(fd, piece)
                        offset += len(piece)
                if h.hexdigest() != digest:
                    raise IntegrityError(f"object {key!r} of {self.url} does not match the SHA-256 its key names: "
                                         "the object is corrupt (nothing was cached)")
                os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self._objects / name)  # whole and verified, or not there at all
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        fsync_path(self._objects, strict=False)
        self._count(fetched=1)
        self._mark_verified((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))  # the bytes it checked
        if offset == len(first):  # one piece: serve it from memory, the file is for the others
            self._remember(name, *(byte_range or (0, len(first))))
            return _cut(first, byte_range)
        return _FETCHED

    def _acquire(self, name: str) -> int | None:
        """The fd holding ``locks/<name>.lock`` exclusively, or None after ``lock_wait_s``."""
        path = self._locks / f"{name}.lock"
        deadline = time.monotonic() + self.cache.lock_wait_s
        pause = LOCK_POLL_FIRST_S
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            os.close(fd)
                            return None
                        time.sleep(pause)
                        pause = min(pause * 1.5, LOCK_POLL_MAX_S)
                # An evictor may have deleted the lock file while this process waited on it:
                # a lock on a deleted file excludes nobody, so take the one at the path.
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    st = None
                fst = os.fstat(fd)
                if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _remove_partials(self, name: str) -> None:
        """Delete a crashed fetch's temporary files of ``name`` (the caller holds its lock)."""
        for p in self._tmp.glob(f"{glob.escape(name)}.*.partial"):
            try:
                p.unlink()
            except OSError:
                pass

    # --- eviction -------------------------------------------------------------------------------

    def _evict(self, keep: str) -> None:
        """Delete least recently used files until the cache holds at most ``max_bytes``."""
        try:
            guard = os.open(self._evict_lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._cache_failed(e)
            return
        try:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process is trimming it now
            files = []
            total = 0
            for entry in os.scandir(self._objects):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                total += st.st_size
                if entry.name != keep:
                    files.append((st.st_atime_ns, entry.name, st.st_size))
            for entry in os.scandir(self._tmp):  # a crashed fetch's leftovers count, and go
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    continue
                if total > self.cache.max_bytes:
                    total -= self._remove_orphan(entry.name)
            files.sort()
            evicted = 0
            for _, name, size in files:
                if total <= self.cache.max_bytes:
                    break
                if self._remove_unused(name):
                    total -= size
                    evicted += 1
            if evicted:
                self._count(evicted=evicted)
                logger.debug("node cache %s: evicted %d files", self.cache.path, evicted)
        except OSError as e:
            self._cache_failed(e)
        finally:
            os.close(guard)

    def _remove_unused(self, name: str) -> bool:
        """Delete ``objects/<name>`` unless a process is reading it; True when deleted."""
        path = self._objects / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # being read
            st, fst = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
                return False  # replaced since listed: not the least recently used one
            path.unlink()
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        self._remove_lock_file(name)
        return True

    def _remove_lock_file(self, name: str) -> None:
        """Delete ``locks/<name>.lock`` unless a process holds it (a fetch of it under way)."""
        path = self._locks / f"{name}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()  # while held: a waiter on it re-checks the path (_acquire)
        except (BlockingIOError, FileNotFoundError):
            pass
        finally:
            os.close(fd)

    def _remove_orphan(self, tmp_name: str) -> int:
        """Delete a temporary file whose fetcher is gone (its lock is free); its size, else 0."""
        if not tmp_name.endswith(".partial"):
            return 0
        name = tmp_name[: -len(".partial")].rsplit(".", 2)[0]  # <name>.<pid>.<hex>.partial
        path = self._tmp / tmp_name
        try:
            fd = os.open(self._locks / f"{name}.lock", os.O_RDWR)
        except FileNotFoundError:
            fd = None  # no lock file: nobody is fetching it (a fetcher holds its lock file open)
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = path.stat().st_size
            path.unlink()
            return size
        except (BlockingIOError, FileNotFoundError):
            return 0
        finally:
            if fd is not None:
                os.close(fd)


def with_node_cache(store: Store, node_cache: NodeCache | str | os.PathLike[str] | None) -> Store:
    """``store`` read through ``node_cache``; with None, through the cache that
    ``DELTASTORE_NODE_CACHE`` names, else ``store`` itself.

    Raises:
        NodeCacheError: the directory cannot be used.
        ValueError: a malformed bound (``max_bytes``, ``DELTASTORE_NODE_CACHE_MAX_BYTES``).
    """
    cache = node_cache if node_cache is not None else NodeCache.from_env()
    return store if cache is None else NodeCacheStore(store, cache)


def _cut(data: bytes, byte_range: tuple[int, int] | None) -> bytes:
    return data if byte_range is None else data[byte_range[0]:byte_range[1]]


def _pread(fd: int, start: int, stop: int) -> bytes:
    parts = []
    while start < stop:
        chunk = os.pread(fd, stop - start, start)
        if not chunk:
            break
        parts.append(chunk)
        start += len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _file_sha256(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 8 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


__all__ = ["NodeCache", "NodeCacheStats", "NodeCacheStore", "cache_name", "with_node_cache",
           "NODE_CACHE_ENV", "NODE_CACHE_MAX_BYTES_ENV", "DEFAULT_MAX_BYTES"]
