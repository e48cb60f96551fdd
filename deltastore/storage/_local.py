"""Local-filesystem store: a plain path or ``file:///path``.

Layout: the object ``a/b/c`` is the file ``<root>/a/b/c``. Beside the objects live temp files
(``.deltastore-tmp-*``, only while a write is in flight) and ``<root>/.deltastore-locks/``, one
lock file per key that was ever conditionally replaced. Both are hidden from :meth:`list`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from deltastore._util.files import fsync_path
from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    NotFoundError,
    StorageError,
)
from deltastore.storage._keys import (
    RESERVED_PREFIX,
    check_key,
    check_prefix,
)
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store, StreamedPut, check_if_match, check_range

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_TMP_PREFIX = RESERVED_PREFIX + "tmp-"
_LOCK_DIR = RESERVED_PREFIX + "locks"
#: The object's ETag is stored in an extended attribute of its own inode, so it is replaced
#: atomically together with the bytes and head()/list() need not re-read large files. (Earlier
#: releases kept an MD5 under ``user.deltastore.md5``; a process only ever compares ETags it
#: computed itself, so the two never meet: an object without this attribute is hashed.)
_ETAG_XATTR = "user.deltastore.etag"
#: Chunk size when hashing a file that has no ETag attribute (written by hand, or a filesystem
#: without user xattrs): large enough to amortize syscalls, small enough to be cache friendly.
_HASH_CHUNK = 4 * 1024 * 1024
_HAS_XATTR = hasattr(os, "getxattr") and hasattr(os, "setxattr")


def local_etag(data: bytes | memoryview) -> str:
    """A local object's ETag: the XXH3-128 hex of its bytes (32 hex digits, like an MD5's). An
    identifier for compare-and-swap, not a security measure; ETags never leave the process that
    computed them, so it need not match S3's MD5."""
    return xxhash.xxh3_128_hexdigest(data)


class LocalStore(Store):
    """Objects as files under a root directory; safe for concurrent processes on one host.

    Guarantees:

    - No reader observes a partially written object: every write goes to a temp file in the
      target's directory, is fsynced, then linked into place (``os.link`` for ``"create"``,
      which fails atomically when the target exists; ``os.replace`` otherwise).
    - ``IfMatch`` puts, overwrites and deletes of one key are serialized by an ``fcntl.flock``
      on a per-key lock file, so compare-and-swap is atomic across processes on this host (not
      across hosts sharing an NFS mount: use an object store for that).
    - ETags are the XXH3-128 hex of the content (:func:`local_etag`): content-determined, as S3's
      MD5 of a single-part object, at memory speed (MD5 was a third pass over every pack byte,
      about 9 % of a delta publish to tmpfs).

    The root directory is created when missing (``create=True``, the default used by
    :func:`open_store`): a local store needs no setup. Files under the root are assumed to be
    written only through this class. POSIX only.

    Example::

        store = LocalStore("/tmp/weights")
        meta = store.put("HEAD", b"{}", mode="create")
        store.put("HEAD", b'{"v": 1}', mode=IfMatch(meta.etag))
    """

    atomic_conditional_writes = True

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True):
        if fcntl is None:  # pragma: no cover
            raise StorageError("LocalStore needs POSIX fcntl locks; use a memory:// store on Windows")
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()
        if not self.root.is_dir():
            missing = BucketNotFoundError(
                f"local store root {self.root} is not a directory" if self.root.exists()
                else f"local store root {self.root} does not exist: nothing was published there"
            )
            if not create:
                raise missing
            # Several processes may open a new store at once: mkdir(exist_ok) succeeds for all of
            # them, and fails only when the path is something other than a directory.
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except FileExistsError:
                raise missing from None
            except PermissionError as e:
                raise AccessDeniedError(f"cannot create local store root {self.root}: {e.strerror}") from e
            logger.info("created local store root %s", self.root)

    # --- helpers ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _name(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _translate(self, key: str, e: OSError) -> StorageError:
        if isinstance(e, PermissionError):
            return AccessDeniedError(f"permission denied on {self._name(key)}: check file permissions")
        if isinstance(e, (IsADirectoryError, NotADirectoryError, FileExistsError)):
            return StorageError(
                f"{self._name(key)} collides with a directory of the same name; a local store cannot "
                f"hold both 'a' and 'a/b'"
            )
        return StorageError(f"I/O error on {self._name(key)}: {e}")

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock_dir = self.root / _LOCK_DIR
        lock_dir.mkdir(exist_ok=True)
        lock_path = lock_dir / hashlib.sha256(key.encode()).hexdigest()
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    @staticmethod
    def _open_tmp(directory: Path) -> tuple[Path, int]:
        """A new temp file in ``directory`` (made if missing), open for writing."""
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)

    @staticmethod
    def _seal(fd: int, etag: str) -> float:
        """Set a written temp file's ETag attribute and fsync it; its mtime (the linked object
        shares this inode)."""
        if _HAS_XATTR:
            with contextlib.suppress(OSError):  # no user xattrs here: head() will hash
                os.setxattr(fd, _ETAG_XATTR, etag.encode())
        os.fsync(fd)
        return os.fstat(fd).st_mtime

    def _link_new(self, tmp: Path, final: Path, key: str) -> None:
        """Link ``tmp`` as ``final``, create-only: AlreadyExistsError when ``key`` exists."""
        try:
            os.link(tmp, final)
        except FileExistsError as e:
            if final.is_dir():
                raise self._translate(key, e) from e
            raise AlreadyExistsError(
                f"{self._name(key)} already exists; create-only writes never replace an object"
            ) from e

    def _write_tmp(self, final: Path, data: memoryview, etag: str) -> tuple[Path, float]:
        tmp, fd = self._open_tmp(final.parent)
        try:
            view = data
            while view:
                view = view[os.write(fd, view) :]
            mtime = self._seal(fd, etag)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp, mtime

    @staticmethod
    def _etag_of_fd(fd: int, data: bytes | None = None) -> str:
        if _HAS_XATTR:
            try:
                value = os.getxattr(fd, _ETAG_XATTR).decode()
                if len(value) == 32:
                    return value
            except OSError:
                pass
        if data is not None:
            return local_etag(data)
        h = xxhash.xxh3_128()
        offset = 0
        while chunk := os.pread(fd, _HASH_CHUNK, offset):
            h.update(chunk)
            offset += len(chunk)
        return h.hexdigest()

    def _meta_of_fd(self, key: str, fd: int, data: bytes | None = None) -> ObjectMeta:
        st = os.fstat(fd)
        return ObjectMeta(
            key=key,
            size=st.st_size,
            etag=self._etag_of_fd(fd, data),
            last_modified=datetime.fromtimestamp(st.st_mtime, tz=timezone.utc),
        )

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[int]:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise NotFoundError(f"{self._name(key)} does not exist") from e
        except OSError as e:
            raise self._translate(key, e) from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotFoundError(f"{self._name(key)} does not exist (it is a directory)")
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _read_all(fd: int, size: int) -> bytes:
        parts = []
        offset = 0
        while chunk := os.pread(fd, max(size - offset, _HASH_CHUNK), offset):
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)

    # --- Store -----------------------------------------------------------------------------

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        check_range(byte_range)
        with self._open(key) as fd:
            try:
                if byte_range is None:
                    return self._read_all(fd, os.fstat(fd).st_size)
                start, stop = byte_range
                parts = []
                offset = start
                while offset < stop and (chunk := os.pread(fd, stop - offset, offset)):
                    parts.append(chunk)
                    offset += len(chunk)
                return b"".join(parts)
            except OSError as e:
                raise self._translate(key, e) from e

    def get_with_meta(self, key: str) -> GetResult:
        with self._open(key) as fd:
            try:
                data = self._read_all(fd, os.fstat(fd).st_size)
                return GetResult(data=data, meta=self._meta_of_fd(key, fd, data))
            except OSError as e:
                raise self._translate(key, e) from e

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        if etag is None:
            return self.get_with_meta(key)
        with self._open(key) as fd:
            try:
                # One fd throughout, so the ETag compared and the bytes returned are one version.
                if self._etag_of_fd(fd) == etag:
                    return None
                data = self._read_all(fd, os.fstat(fd).st_size)
                return GetResult(data=data, meta=self._meta_of_fd(key, fd, data))
            except OSError as e:
                raise self._translate(key, e) from e

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        final = self._path(key)
        if not (mode in ("create", "overwrite") or isinstance(mode, IfMatch)):
            raise ValueError(f"unknown put mode {mode!r}")
        data = memoryview(data).cast("B")  # any bytes-like; no copy of a large blob
        etag = local_etag(data)
        try:
            tmp, mtime = self._write_tmp(final, data, etag)
        except OSError as e:
            raise self._translate(key, e) from e
        try:
            if mode == "create":
                self._link_new(tmp, final, key)
            else:
                with self._locked(key):
                    if isinstance(mode, IfMatch):
                        try:
                            with self._open(key) as fd:
                                current: str | None = self._etag_of_fd(fd)
                        except NotFoundError:
                            current = None
                        check_if_match(self._name(key), current, mode.etag)
                    os.replace(tmp, final)
            fsync_path(final.parent)
        except StorageError:  # AlreadyExistsError is an OSError too (FileExistsError)
            raise
        except OSError as e:
            raise self._translate(key, e) from e
        finally:
            tmp.unlink(missing_ok=True)
        return ObjectMeta(
            key=key, size=data.nbytes, etag=etag, last_modified=datetime.fromtimestamp(mtime, tz=timezone.utc)
        )

    def begin_put(self, directory: str) -> StreamedPut:
        if not directory.endswith("/"):
            raise ValueError(f"begin_put takes a directory ending in '/', not {directory!r}")
        check_key(directory + "x")
        return _LocalStreamedPut(self, directory)

    def head(self, key: str) -> ObjectMeta:
        with self._open(key) as fd:
            try:
                return self._meta_of_fd(key, fd)
            except OSError as e:
                raise self._translate(key, e) from e

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names; the last segment is a name prefix.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root.joinpath(*base_rel.split("/")) if base_rel else self.root
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(RESERVED_PREFIX)]
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_parts = [] if rel_dir == "." else rel_dir.split(os.sep)
            for name in filenames:
                if name.startswith(RESERVED_PREFIX):
                    continue
                key = "/".join([*rel_parts, name])
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return self._metas(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked(key):
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                return
            except OSError as e:
                raise self._translate(key, e) from e


class _LocalStreamedPut(StreamedPut):
    """A create-only write streamed into a temp file of the target's directory, linked into
    place under its name at :meth:`commit` (the same steps and guarantees as ``put``: written,
    ETag attribute set, fsynced, linked create-only, directory fsynced). The temp file is
    opened at the first write."""

    def __init__(self, store: LocalStore, directory: str):
        self._store = store
        self._directory = directory
        self._dir = store.root.joinpath(*directory.rstrip("/").split("/"))
        self._tmp: Path | None = None
        self._fd = -1
        self._etag = xxhash.xxh3_128()
        self._size = 0
        self._done = False

    def _fail(self, e: OSError) -> StorageError:
        self.abort()
        return self._store._translate(self._directory, e)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise ValueError("this streamed write is committed or aborted")
        view = memoryview(data).cast("B")
        try:
            if self._fd < 0:
                self._tmp, self._fd = LocalStore._open_tmp(self._dir)
            self._etag.update(view)
            self._size += view.nbytes
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise self._fail(e) from e

    def commit(self, name: str) -> ObjectMeta:
        if self._done:
            raise ValueError("this streamed write is committed or aborted")
        try:  # whatever happens, the temp file is gone afterwards (linked, or dropped)
            return self._commit(name)
        finally:
            self.abort()

    def _commit(self, name: str) -> ObjectMeta:
        if "/" in name:
            raise ValueError(f"a streamed write's name has no '/': {name!r}")
        key = self._directory + name
        final = self._store._path(key)
        if self._fd < 0:
            self.write(b"")  # an empty object: its temp file is opened here
        etag = self._etag.hexdigest()
        assert self._tmp is not None
        try:
            try:
                mtime = LocalStore._seal(self._fd, etag)
            finally:
                os.close(self._fd)
                self._fd = -1
            self._store._link_new(self._tmp, final, key)
            fsync_path(final.parent)
        except StorageError:
            raise
        except OSError as e:
            raise self._store._translate(key, e) from e
        return ObjectMeta(key=key, size=self._size, etag=etag,
                          last_modified=datetime.fromtimestamp(mtime, tz=timezone.utc))

    def abort(self) -> None:
        self._done = True
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None
