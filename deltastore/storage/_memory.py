"""In-process store for tests: ``memory://name``.

Two opens of the same ``memory://name`` in one process share the same objects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

from deltastore.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError
from deltastore.storage._keys import check_key, check_prefix, content_etag
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store, check_range

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, tuple[bytes, ObjectMeta]] = field(default_factory=dict)


_BUCKETS: dict[str, _Bucket] = {}
_BUCKETS_LOCK = threading.Lock()


class MemoryStore(Store):
    """A process-global, thread-safe dict of bytes, named by ``memory://name``.

    Conditional writes are atomic (one lock per name). ETags are the hex MD5 of the content, as
    for single-part S3 objects. Meant for tests; nothing survives the process.

    Example::

        store = MemoryStore("memory://test")
        store.put("a/b", b"hi", mode="create")
    """

    atomic_conditional_writes = True

    def __init__(self, url: str):
        if not url.startswith("memory://"):
            url = f"memory://{url}"
        self.url = url
        name = url[len("memory://") :]
        with _BUCKETS_LOCK:
            self._bucket = _BUCKETS.setdefault(name, _Bucket())

    @classmethod
    def clear_all(cls) -> None:
        """Forget every named in-memory store of this process (for test isolation)."""
        with _BUCKETS_LOCK:
            for bucket in _BUCKETS.values():
                with bucket.lock:
                    bucket.objects.clear()

    def _lookup(self, key: str) -> tuple[bytes, ObjectMeta]:
        check_key(key)
        with self._bucket.lock:
            found = self._bucket.objects.get(key)
        if found is None:
            raise NotFoundError(f"{self.url}/{key} does not exist")
        return found

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        check_range(byte_range)
        data, _ = self._lookup(key)
        if byte_range is None:
            return data
        return data[byte_range[0] : byte_range[1]]

    def get_with_meta(self, key: str) -> GetResult:
        data, meta = self._lookup(key)
        return GetResult(data=data, meta=meta)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        data, meta = self._lookup(key)
        if etag is not None and meta.etag == etag:
            return None
        return GetResult(data=data, meta=meta)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        check_key(key)
        data = bytes(data)
        meta = ObjectMeta(
            key=key, size=len(data), etag=content_etag(data), last_modified=datetime.now(timezone.utc)
        )
        with self._bucket.lock:
            current = self._bucket.objects.get(key)
            if mode == "create":
                if current is not None:
                    raise AlreadyExistsError(
                        f"{self.url}/{key} already exists; create-only writes never replace an object"
                    )
            elif isinstance(mode, IfMatch):
                if current is None:
                    raise PreconditionFailedError(
                        f"{self.url}/{key} does not exist, so it cannot match ETag {mode.etag!r}"
                    )
                if current[1].etag != mode.etag:
                    raise PreconditionFailedError(
                        f"{self.url}/{key} changed: ETag is {current[1].etag!r}, expected "
                        f"{mode.etag!r}; re-read it and retry"
                    )
            elif mode != "overwrite":
                raise ValueError(f"unknown put mode {mode!r}")
            self._bucket.objects[key] = (data, meta)
        return meta

    def head(self, key: str) -> ObjectMeta:
        return self._lookup(key)[1]

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        with self._bucket.lock:
            metas = [meta for k, (_, meta) in self._bucket.objects.items() if k.startswith(prefix)]
        metas.sort(key=lambda m: m.key)
        return iter(metas)

    def delete(self, key: str) -> None:
        check_key(key)
        with self._bucket.lock:
            self._bucket.objects.pop(key, None)
