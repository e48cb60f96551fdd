"""Any other filesystem fsspec knows (``gs://``, ``az://``, ``s3a://``, ``hf://``, ...).

fsspec has no compare-and-swap, so conditional writes here are check-then-write.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    UnsupportedURLError,
)
from deltastore.storage._keys import (
    RESERVED_PREFIX,
    check_key,
    check_prefix,
    content_etag,
    normalize_etag,
)
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store, check_if_match, check_range

logger = logging.getLogger(__name__)

#: ``info()`` fields that hold a server-side content version, in order of preference
#: (s3fs/adlfs "ETag"/"etag", gcsfs "md5Hash"). Without one, the ETag is the MD5 of the bytes.
_ETAG_FIELDS = ("ETag", "etag", "md5Hash")


class FsspecStore(Store):
    """A store over an fsspec filesystem, for URL schemes without a native backend.

    NOT safe for concurrent writers: ``"create"`` uses ``pipe_file(mode="create")``, which is
    atomic only where the filesystem implements it so (otherwise check-then-write), and
    ``IfMatch`` is always check-then-write, so two writers can both "win". Hence
    ``atomic_conditional_writes = False``; use it for a single publisher, or use ``s3://``.

    Args:
        fs: the fsspec filesystem.
        root: the path inside ``fs`` that keys are relative to.
        url: the URL to report in messages (defaults to ``protocol://root``).

    Example::

        store = FsspecStore.from_url("gs://bucket/run1")
    """

    atomic_conditional_writes = False
    conditional_writes_need_probe = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str | None = None):
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.url = url or f"{protocol}://{self.root.lstrip('/')}"
        # Object stores have no directories; a local filesystem needs them before a write.
        self._needs_parent_dirs = isinstance(fs, LocalFileSystem)

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None) -> FsspecStore:
        """Open ``url`` with ``fsspec.url_to_fs``.

        Raises:
            UnsupportedURLError: fsspec does not know the scheme, or its package is missing.
        """
        try:
            fs, root = fsspec.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            raise UnsupportedURLError(f"cannot open {url}: {_one_line(e)}") from e
        except ValueError as e:
            raise UnsupportedURLError(
                f"cannot open {url}: {_one_line(e)}; supported: a path, file://, memory://, s3://, "
                f"or any fsspec protocol"
            ) from e
        return cls(fs, root, url=url.rstrip("/"))

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _name(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _translate(self, e: Exception, op: str, key: str) -> StorageError:
        if isinstance(e, FileNotFoundError):
            return NotFoundError(f"{self._name(key)} does not exist")
        if isinstance(e, PermissionError):
            return AccessDeniedError(f"access denied for {op} on {self._name(key)}: check credentials")
        return StorageError(f"{op} on {self._name(key)} failed: {_one_line(e)}")

    def _info_etag(self, info: dict[str, Any]) -> str | None:
        for name in _ETAG_FIELDS:
            value = info.get(name)
            if value:
                return normalize_etag(str(value))
        return None

    def _read(self, key: str) -> GetResult:
        path = self._path(key)
        try:
            info = self.fs.info(path)
            if info.get("type") == "directory":
                raise FileNotFoundError(path)
            data = self.fs.cat_file(path)
            native = self._info_etag(info)
            if native is not None and self._info_etag(self.fs.info(path)) != native:
                # Replaced while we read: take the content digest of what we actually hold.
                native = None
        except Exception as e:  # fsspec implementations raise a zoo of types
            raise self._translate(e, "read", key) from e
        etag = native or content_etag(data)
        return GetResult(data=data, meta=ObjectMeta(key=key, size=len(data), etag=etag))

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        check_range(byte_range)
        path = self._path(key)
        try:
            if byte_range is None:
                return self.fs.cat_file(path)
            if byte_range[0] == byte_range[1]:
                self.head(key)
                return b""
            return self.fs.cat_file(path, start=byte_range[0], end=byte_range[1])
        except NotFoundError:
            raise
        except Exception as e:
            raise self._translate(e, "read", key) from e

    def get_with_meta(self, key: str) -> GetResult:
        return self._read(key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        if etag is not None and self.head(key).etag == etag:
            return None
        return self._read(key)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        path = self._path(key)
        data = bytes(data)
        try:
            if self._needs_parent_dirs:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            if mode == "create":
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError as e:
                    raise AlreadyExistsError(
                        f"{self._name(key)} already exists; create-only writes never replace an object"
                    ) from e
            elif isinstance(mode, IfMatch):
                try:
                    current: str | None = self.head(key).etag
                except NotFoundError:
                    current = None
                check_if_match(self._name(key), current, mode.etag)
                self.fs.pipe_file(path, data)
            elif mode == "overwrite":
                self.fs.pipe_file(path, data)
            else:
                raise ValueError(f"unknown put mode {mode!r}")
        except (PreconditionFailedError, ValueError):
            raise
        except Exception as e:
            raise self._translate(e, "write", key) from e
        try:
            native = self._info_etag(self.fs.info(path))
        except Exception:
            native = None
        return ObjectMeta(key=key, size=len(data), etag=native or content_etag(data))

    def head(self, key: str) -> ObjectMeta:
        path = self._path(key)
        try:
            info = self.fs.info(path)
            if info.get("type") == "directory":
                raise FileNotFoundError(path)
            etag = self._info_etag(info) or content_etag(self.fs.cat_file(path))
        except Exception as e:
            raise self._translate(e, "head", key) from e
        return ObjectMeta(key=key, size=int(info.get("size") or 0), etag=etag)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.root}/{base_rel}" if base_rel else self.root
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return iter(())
        except Exception as e:
            raise self._translate(e, "list", prefix) from e
        root = self.fs._strip_protocol(self.root).rstrip("/")
        keys = []
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            stripped = self.fs._strip_protocol(path)
            if not stripped.startswith(root + "/"):
                continue
            key = stripped[len(root) + 1 :]
            if key.startswith(prefix) and not any(
                part.startswith(RESERVED_PREFIX) for part in key.split("/")
            ):
                keys.append(key)
        keys.sort()
        return self._metas(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return
        except Exception as e:
            raise self._translate(e, "delete", key) from e


def _one_line(text: object) -> str:
    return " ".join(str(text).split())
