"""A store seen through a key prefix: every key is the inner store's ``prefix + key``.

Serving streams (SPEC §15) are store-shaped trees under ``streams/<format>/`` of their store: a
writer encodes a stream's packs, layouts and manifests through a :class:`PrefixedStore` with
the same code that writes the store's own, and the keys inside the stream's manifests are
relative to the stream's root, as a store's are to its own.
"""

from __future__ import annotations

from collections.abc import Iterator

from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store, StreamedPut


class PrefixedStore(Store):
    """The keys of ``inner`` under ``prefix`` (a key prefix ending in ``/``), with it removed.

    It shares ``inner``'s connections and capability flags and does not own it: :meth:`close`
    leaves ``inner`` open.

    Args:
        inner: the store.
        prefix: e.g. ``"streams/fp8-block128/"``.
        url: the URL this view reports (default: ``inner.url`` followed by ``#<prefix>``).
    """

    def __init__(self, inner: Store, prefix: str, *, url: str | None = None):
        if not prefix.endswith("/") or prefix.startswith("/"):
            raise ValueError(f"a key prefix ends with '/' and does not start with one, got {prefix!r}")
        self.inner = inner
        self.prefix = prefix
        self.url = url or f"{inner.url}#{prefix}"
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.conditional_writes_need_probe = inner.conditional_writes_need_probe

    def _meta(self, meta: ObjectMeta) -> ObjectMeta:
        return ObjectMeta(key=meta.key[len(self.prefix):], size=meta.size, etag=meta.etag,
                          last_modified=meta.last_modified)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        return self.inner.get(self.prefix + key, byte_range=byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        res = self.inner.get_with_meta(self.prefix + key)
        return GetResult(data=res.data, meta=self._meta(res.meta))

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        res = self.inner.get_if_changed(self.prefix + key, etag)
        return None if res is None else GetResult(data=res.data, meta=self._meta(res.meta))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        return self._meta(self.inner.put(self.prefix + key, data, mode=mode))

    def head(self, key: str) -> ObjectMeta:
        return self._meta(self.inner.head(self.prefix + key))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        for meta in self.inner.list(self.prefix + prefix):
            yield self._meta(meta)

    def delete(self, key: str) -> None:
        self.inner.delete(self.prefix + key)

    def begin_put(self, directory: str) -> StreamedPut | None:
        put = self.inner.begin_put(self.prefix + directory)
        return None if put is None else _PrefixedPut(put, self)

    def close(self) -> None:
        """Nothing to release: ``inner`` belongs to whoever opened it."""


class _PrefixedPut(StreamedPut):
    def __init__(self, put: StreamedPut, view: PrefixedStore):
        self._put = put
        self._view = view

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._put.write(data)

    def commit(self, name: str) -> ObjectMeta:
        return self._view._meta(self._put.commit(name))

    def abort(self) -> None:
        self._put.abort()


__all__ = ["PrefixedStore"]
