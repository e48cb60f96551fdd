"""Mirrors (SPEC §16): a copy of a store in another bucket that is itself a valid store of the
same lineage, with the same signed bytes.

One :class:`Mirror` replicates a source store (SRC) into a destination store (DST). A sync:

1. reads SRC's HEAD (its bytes) and DST's HEAD; DST of another lineage, or holding a version that
   is not on SRC's chain, is refused (:class:`~deltastore.errors.MirrorLineageError`) before
   anything is written;
2. walks SRC's chain from its head down to the first version DST lacks (never below SRC's
   retention floor) and lists every object those versions need: packs, layouts, part
   manifests, serving streams (their manifests, packs and layouts), the squashes they name
   (hints, copied when present), the history index HEAD names and the chains of its pins;
3. copies each object DST lacks, create-only, after checking its bytes against the SHA-256 the
   naming object gives (a damaged SRC is never propagated): data first, then the manifests;
4. writes HEAD last, by compare-and-swap on the DST HEAD it read: SRC's HEAD bytes, so that
   lineage, versions and signatures are identical. A DST collected by its own ``deltastore gc``
   keeps its own history index (a HEAD that differs from SRC's only in ``index``, SPEC §4).

Killed at any point, DST is still a valid store at its previous head (nothing is visible before
the HEAD write, and every object written is immutable and named by its content); the next sync
finds what was copied and copies the rest. Two mirrors writing one DST never fork it: each HEAD
write is conditional on the HEAD the mirror planned from, the loser reads DST again and either
finds it current or plans again, and a mirror never moves DST's HEAD to an older version.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from deltastore.errors import (
    DeltastoreError,
    IntegrityError,
    MirrorLineageError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, digest_from_key, sha256_hex, stream_prefix
from deltastore.format.models import Head, Index, Manifest, ObjectRef, SquashRef, dump
from deltastore.format.parse import parse_head
from deltastore.storage.base import GetResult, IfMatch, ObjectMeta, PutMode, Store
from deltastore.storage.prefixed import PrefixedStore
from deltastore.write.commit import now, put_immutable, read_head_back

logger = logging.getLogger(__name__)

#: Objects copied at once: each copy is a GET from SRC and a PUT to DST of one object held in
#: memory (a pack is at most 64 MiB plus one segment), so a sync holds at most this many packs.
COPY_THREADS = 4
#: Passes of one sync whose HEAD write lost a race (another mirror, or DST's own GC, wrote HEAD
#: meanwhile): each pass re-reads DST and copies only what is still missing, so a few suffice.
CAS_ATTEMPTS = 5
#: Bytes of SRC's metadata objects (manifests, layouts, parts, indexes) a sync keeps after
#: reading them to walk the chain, so that copying them does not read them from SRC again
#: (origin egress); beyond it they are read again.
METADATA_CACHE_BYTES = 256 * 1024 * 1024
#: Where a mirror records the history index it last wrote to DST (SPEC §1.1: readers ignore
#: ``_deltastore/``, GC never deletes it): an index DST's HEAD names that is neither this one
#: nor SRC's was written by DST's own GC.
MIRROR_RECORD_KEY = "_deltastore/mirror.json"
#: Default seconds between polls of SRC's HEAD when following (a conditional GET each).
FOLLOW_INTERVAL_S = 2.0
#: Squashes are copied for manifests of versions ≥ head − this (SPEC §11 keeps those of the
#: last 8 versions' manifests): older ones are hints nobody keeps.
SQUASH_HINTS = 8


@dataclass(frozen=True)
class MirrorReport:
    """What one sync did.

    Attributes:
        src, dst: the stores' URLs.
        from_version: DST's version before the sync (0: empty or no HEAD).
        to_version: DST's version after it.
        source_version: SRC's version when the sync read it.
        versions: the versions whose objects this sync copied (or found copied), oldest first.
        objects_copied / bytes_copied: objects written to DST (and their bytes).
        objects_present: objects DST already held (an earlier, interrupted sync's work).
        head_written: this sync wrote DST's HEAD.
        own_index: DST keeps a history index of its own (its own GC), not SRC's.
        seconds: wall time of the sync.
    """

    src: str
    dst: str
    from_version: int
    to_version: int
    source_version: int
    versions: tuple[int, ...] = ()
    objects_copied: int = 0
    bytes_copied: int = 0
    objects_present: int = 0
    head_written: bool = False
    own_index: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["versions"] = list(self.versions)
        return out


@dataclass(frozen=True)
class _Obj:
    """One object to copy: its key, the SHA-256 (and size, for packs) its referrer names."""

    key: str
    sha256: str
    what: str
    size: int | None = None
    hint: bool = False  # missing on SRC is not an error (skip pointers, squashes)


@dataclass
class _Plan:
    data: dict[str, _Obj] = field(default_factory=dict)  # packs, layouts, parts: copied first
    docs: dict[str, _Obj] = field(default_factory=dict)  # manifests, squashes, the index: after

    def add(self, obj: _Obj, *, doc: bool = False) -> None:
        (self.docs if doc else self.data).setdefault(obj.key, obj)


class _Tee(Store):
    """SRC, remembering the bytes of the metadata objects read through it (bounded) so that a
    copy of them reads nothing again. Everything but ``get`` goes straight to SRC."""

    def __init__(self, inner: Store, budget: int = METADATA_CACHE_BYTES):
        self.inner = inner
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self._kept: dict[str, bytes] = {}
        self._budget = budget
        self._lock = threading.Lock()

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        with self._lock:
            data = self._kept.get(key)
        if data is None:
            data = self.inner.get(key, byte_range=byte_range)
            if byte_range is None and key.endswith(".json.zst") and len(data) <= self._budget:
                with self._lock:
                    self._budget -= len(data)
                    self._kept[key] = data
        return data if byte_range is None else data[byte_range[0]:byte_range[1]]

    def forget(self) -> None:
        with self._lock:
            self._budget += sum(len(d) for d in self._kept.values())
            self._kept.clear()

    def get_with_meta(self, key: str) -> GetResult:
        return self.inner.get_with_meta(key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        return self.inner.get_if_changed(key, etag)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        raise StorageError(f"a mirror never writes its source {self.url} (key {key!r})")

    def head(self, key: str) -> ObjectMeta:
        return self.inner.head(key)

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        raise StorageError(f"a mirror never deletes from its source {self.url} (key {key!r})")

    def close(self) -> None:
        """SRC belongs to the Mirror."""


class Mirror:
    """Replicates store SRC into store DST (see the module docstring and SPEC §16).

    Args:
        src: the source store (an open :class:`~deltastore.storage.base.Store`, or a URL).
        dst: the destination store (a Store or a URL; a local directory is created).
        storage_options: backend options for ``src`` (when a URL).
        dst_storage_options: backend options for ``dst`` (default: ``storage_options``).
        trusted_keys: Ed25519 public keys (as :class:`deltastore.Subscriber` takes them): every
            manifest copied must be signed by one of them, so that a mirror never spreads a
            version its readers would refuse (SignatureError, nothing written).
        threads: objects copied at once.

    Stores passed in stay open after :meth:`close`; stores opened from URLs are closed by it.

    Example::

        with Mirror("s3://us-east/run1", "s3://eu-west/run1") as m:
            report = m.sync()               # DST now holds SRC's head, verified
            m.follow(interval=2.0, stop=stop_event)   # and keeps it current
    """

    def __init__(self, src: Store | str, dst: Store | str, *, storage_options: Mapping[str, Any] | None = None,
                 dst_storage_options: Mapping[str, Any] | None = None, trusted_keys: Iterable[Any] | None = None,
                 threads: int = COPY_THREADS):
        from deltastore.storage import open_store

        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        keys = None
        if trusted_keys is not None:
            from deltastore.format.signing import TrustedKeys

            # a bad key fails before anything is opened
            keys = trusted_keys if isinstance(trusted_keys, TrustedKeys) else TrustedKeys(trusted_keys)
        self._owned: list[Store] = []
        opts = dict(storage_options or {})
        if isinstance(src, Store):
            self.src = src
        else:
            self.src = open_store(src, storage_options=opts, create=False)
            self._owned.append(self.src)
        try:
            if isinstance(dst, Store):
                self.dst = dst
            else:
                self.dst = open_store(dst, storage_options=dict(dst_storage_options if dst_storage_options is not None else opts))
                self._owned.append(self.dst)
        except BaseException:
            self.close()
            raise
        if self.src.url == self.dst.url:
            self.close()
            raise ValueError(f"a mirror's source and destination are the same store ({self.src.url})")
        self.threads = threads
        self._tee = _Tee(self.src)
        self._src_history = History(self._tee, None if keys is None else keys.verify)
        self._dst_history = History(self.dst)

    # --- one sync -------------------------------------------------------------------------

    def sync(self) -> MirrorReport:
        """Bring DST to SRC's head (see the module docstring).

        Returns:
            What was copied; ``to_version == source_version`` unless DST was already ahead.

        Raises:
            MirrorLineageError: DST holds another history (nothing written).
            IntegrityError: an object of SRC does not match the digest that names it (SRC is
                damaged; DST's HEAD is not moved).
            NotFoundError: an object SRC's versions need is missing from SRC (SRC is damaged,
                or its GC collected the versions while they were copied: sync again).
            SignatureError: with ``trusted_keys``, a manifest is not signed by one of them.
            StorageError: a read or write failed (sync again: what was copied stays).
        """
        try:
            res = self.src.get_with_meta(HEAD_KEY)
        except NotFoundError:
            got = self._dst_history.read_head()
            v = 0 if got is None else got[0].version
            logger.info("mirror: %s has no HEAD yet; nothing to copy to %s", self.src.url, self.dst.url)
            return MirrorReport(self.src.url, self.dst.url, v, v, 0)
        return self._sync(res.data)

    def _sync(self, src_raw: bytes) -> MirrorReport:
        t0 = time.perf_counter()
        src_head = parse_head(src_raw)
        copied = present = nbytes = 0
        versions: tuple[int, ...] = ()
        from_version: int | None = None
        try:
            for _ in range(CAS_ATTEMPTS):
                dst_raw, dst_head, dst_etag = self._read_dst_head()
                if from_version is None:
                    from_version = 0 if dst_head is None else dst_head.version
                own_index = self._own_index(src_head, dst_head)
                # SRC's HEAD bytes; with an index of DST's own, SRC's HEAD carrying that index
                new_raw = src_raw
                if own_index and dst_head is not None:
                    new_raw = dump(src_head.model_copy(update={"index": dst_head.index}))
                done = self._settled(src_head, dst_head, own_index)
                if done is not None or dst_raw == new_raw:
                    to = dst_head.version if dst_head is not None else 0
                    return MirrorReport(self.src.url, self.dst.url, from_version, to, src_head.version, versions,
                                        copied, nbytes, present, False, own_index, time.perf_counter() - t0)
                plan, versions = self._plan(src_head, dst_head, own_index)
                c, p, b = self._copy(plan)
                copied, present, nbytes = copied + c, present + p, nbytes + b
                if self._write_head(new_raw, dst_etag):
                    self._record(src_head, None if own_index else src_head.index)
                    logger.info("mirror %s → %s: version %d → %d (%d objects, %d bytes copied)", self.src.url,
                                self.dst.url, from_version, src_head.version, copied, nbytes)
                    return MirrorReport(self.src.url, self.dst.url, from_version, src_head.version, src_head.version,
                                        versions, copied, nbytes, present, True, own_index, time.perf_counter() - t0)
                logger.info("mirror %s → %s: DST's HEAD changed while copying; reading it again", self.src.url, self.dst.url)
            raise StorageError(
                f"mirror {self.src.url} → {self.dst.url}: DST's HEAD kept changing under {CAS_ATTEMPTS} HEAD writes "
                "(another writer rewrites it in a loop); nothing was committed by this sync, run it again"
            )
        finally:
            self._tee.forget()

    def _read_dst_head(self) -> tuple[bytes | None, Head | None, str | None]:
        """DST's HEAD as stored: its bytes (compared as bytes: a HEAD is rewritten only when its
        bytes differ), its parse and its ETag; all None when DST has none."""
        try:
            res = self.dst.get_with_meta(HEAD_KEY)
        except NotFoundError:
            return None, None, None
        return res.data, parse_head(res.data), res.meta.etag

    def _settled(self, src: Head, dst: Head | None, own_index: bool = False) -> str | None:
        """Why nothing is to be written (DST as new as SRC, or newer), else None; refuses a DST
        of another history."""
        if dst is None:
            return None
        if dst.lineage != src.lineage:
            raise MirrorLineageError(
                f"{self.dst.url} holds lineage {dst.lineage} (version {dst.version}), but {self.src.url} is lineage "
                f"{src.lineage}: it is not a mirror of it; nothing was written. Mirror into an empty store",
                head_version=dst.version, head_writer=dst.writer,
            )
        if dst.version > src.version:
            logger.warning("mirror: %s is at version %d, ahead of its source %s at %d (the source went back?); "
                           "a mirror never moves back, nothing written", self.dst.url, dst.version, self.src.url, src.version)
            return "ahead"
        if dst.version == src.version and dst.manifest != src.manifest:
            raise self._diverged(dst, src.manifest)
        if dst.version == src.version and (dst.epoch > src.epoch or (not own_index and self._newer_index(dst, src))):
            # another mirror wrote a later HEAD of this version (a claim, a GC) than the one read here
            logger.info("mirror: %s already holds a later HEAD of version %d than the one read from %s",
                        self.dst.url, dst.version, self.src.url)
            return "ahead"
        return None

    def _newer_index(self, dst: Head, src: Head) -> bool:
        """DST's HEAD names a later history index of SRC's than ``src`` does (a floor is never
        lowered, so an older SRC HEAD read by a slow sync must not replace it)."""
        if dst.index is None or (src.index is not None and dst.index.key == src.index.key):
            return False
        if src.index is None:
            return True  # SRC's HEAD carries its index forward: one without is older
        dst_index, src_index = self._dst_history.index(dst), self._src_history.index(src)
        return dst_index is not None and src_index is not None and dst_index.generation > src_index.generation

    def _diverged(self, dst: Head, src_key: str | None) -> MirrorLineageError:
        return MirrorLineageError(
            f"{self.dst.url} holds version {dst.version} as {dst.manifest!r}, but {self.src.url}'s version "
            f"{dst.version} is {src_key!r}: the two histories forked (a publisher wrote to the mirror, or the "
            "source's HEAD was restored and published on); nothing was written",
            head_version=dst.version, head_writer=dst.writer,
        )

    def _own_index(self, src: Head, dst: Head | None) -> bool:
        """DST's HEAD names a history index that its own GC wrote (neither SRC's current index,
        nor one a mirror wrote, nor one SRC holds): DST then keeps following its own retention.
        Not when DST fell below SRC's floor: the versions in between cannot be copied, so DST
        takes SRC's index, whose floor is then above DST's own (a floor never goes down)."""
        if dst is None or dst.index is None or dst.lineage != src.lineage:
            return False
        if dst.version < self._src_floor(src):
            return False
        if src.index is not None and dst.index.key == src.index.key:
            return False
        try:
            record = json.loads(self.dst.get(MIRROR_RECORD_KEY))
            if isinstance(record, dict) and record.get("index") == dst.index.key:
                return False
        except (NotFoundError, ValueError):
            pass
        return not self.src.exists(dst.index.key)

    def _src_floor(self, src: Head) -> int:
        """SRC's retention floor (SPEC §11): versions below it may be collected there."""
        index = self._src_history.index(src)
        return 1 if index is None else index.floor

    # --- what to copy ---------------------------------------------------------------------

    def _plan(self, src: Head, dst: Head | None, own_index: bool) -> tuple[_Plan, tuple[int, ...]]:
        plan = _Plan()
        history = self._src_history
        top = history.head_manifest(src)
        if top is None:  # SRC claimed but empty: only HEAD to write
            return plan, ()
        index = history.index(src)
        floor = 1 if index is None else index.floor
        held = 0 if dst is None or dst.manifest is None else dst.version
        low = max(held, floor, 1)
        chain = history.chain(*top, down_to=low)
        if held >= floor and held >= 1:
            if chain[0][0] != dst.manifest:  # type: ignore[union-attr]
                raise self._diverged(dst, chain[0][0])  # type: ignore[arg-type]
            chain = chain[1:]
        elif held:
            logger.info("mirror: %s holds version %d, below %s's retention floor %d: copying from the floor",
                        self.dst.url, held, self.src.url, floor)
        for key, m in chain:
            self._add_version(plan, key, m, hints=m.version >= src.version - SQUASH_HINTS)
        if (not own_index and index is not None and src.index is not None
                and (dst is None or dst.index is None or dst.index.key != src.index.key)):
            self._add_index(plan, src.index, index, floor)
        return plan, tuple(m.version for _, m in chain)

    def _add_version(self, plan: _Plan, key: str, m: Manifest, *, hints: bool = True) -> None:
        """Everything manifest ``m`` (stored under ``key``) needs, and the manifest itself."""
        self._add_manifest_refs(plan, "", m)
        for ref in m.streams:
            prefix = stream_prefix(ref.format)
            sm = History(PrefixedStore(self._tee, prefix)).manifest(ref.key[len(prefix):], ref.sha256)
            self._add_manifest_refs(plan, prefix, sm)
            plan.add(_Obj(ref.key, ref.sha256, f"{ref.format} stream manifest"), doc=True)
        if hints:
            for s in m.squashes:
                self._add_squash(plan, s)
        plan.add(_Obj(key, digest_from_key(key), "manifest"), doc=True)

    @staticmethod
    def _add_manifest_refs(plan: _Plan, prefix: str, m: Manifest) -> None:
        for b in m.blobs:
            plan.add(_Obj(prefix + b.key, b.sha256, "pack", b.size))
        if m.layout is not None:
            plan.add(_Obj(prefix + m.layout.key, m.layout.sha256, "layout"))
        for p in m.parts:
            plan.add(_Obj(prefix + p.key, p.sha256, "part manifest"))

    def _add_squash(self, plan: _Plan, ref: SquashRef) -> None:
        """A squash (SPEC §12) is a hint: copied when SRC holds it, skipped when it does not."""
        try:
            sq = self._src_history.squash(ref)
        except NotFoundError:
            return
        for b in sq.blobs:
            plan.add(_Obj(b.key, b.sha256, "squash pack", b.size, hint=True))
        if sq.layout is not None:
            plan.add(_Obj(sq.layout.key, sq.layout.sha256, "layout", hint=True))
        plan.add(_Obj(ref.key, ref.sha256, "squash manifest", hint=True), doc=True)

    def _add_index(self, plan: _Plan, ref: ObjectRef, index: Index, floor: int) -> None:
        """The history index and what it keeps beyond [floor, head]: pinned versions below the
        floor (their chains from their anchors) and registered squashes."""
        for pin in index.pins:
            if pin.version >= floor:
                continue
            m = self._src_history.manifest(pin.manifest)
            for key, mm in self._src_history.anchor_chain(pin.manifest, m):
                self._add_version(plan, key, mm, hints=False)
        for s in index.squashes:
            self._add_squash(plan, s)
        plan.add(_Obj(ref.key, ref.sha256, "history index"), doc=True)

    # --- copying --------------------------------------------------------------------------

    def _copy(self, plan: _Plan) -> tuple[int, int, int]:
        """Copy the plan's data objects, then its documents; returns (copied, present, bytes)."""
        copied = present = nbytes = 0
        with ThreadPoolExecutor(self.threads, thread_name_prefix="deltastore-mirror") as pool:
            for group in (plan.data, plan.docs):  # a manifest lands only after what it names
                for n in pool.map(self._copy_one, group.values()):
                    if n is None:
                        present += 1
                    elif n >= 0:
                        copied += 1
                        nbytes += n
        return copied, present, nbytes

    def _copy_one(self, obj: _Obj) -> int | None:
        """Copy one object unless DST holds it: None when present, -1 for a hint SRC lacks,
        else the bytes written."""
        try:
            meta = self.dst.head(obj.key)
        except NotFoundError:
            meta = None
        if meta is not None:
            if obj.size is not None and meta.size != obj.size:
                raise IntegrityError(
                    f"{obj.what} {obj.key!r} in {self.dst.url} has {meta.size} bytes, not the {obj.size} its manifest "
                    "names: the mirror's copy is damaged; delete it and run the mirror again"
                )
            return None
        try:
            data = self._tee.get(obj.key)
        except NotFoundError:
            if obj.hint:
                return -1
            raise NotFoundError(
                f"{obj.what} {obj.key!r} is missing from {self.src.url}, which a version being mirrored needs: the "
                "source is damaged, or its GC collected that version meanwhile (run the mirror again)"
            ) from None
        if sha256_hex(data) != obj.sha256 or (obj.size is not None and len(data) != obj.size):
            raise IntegrityError(
                f"{obj.what} {obj.key!r} in {self.src.url} does not match the SHA-256 its referrer names: the source "
                f"object is damaged; nothing of it was written to {self.dst.url} and DST's HEAD was not moved"
            )
        put_immutable(self.dst, obj.key, data, obj.what)
        return len(data)

    def _write_head(self, raw: bytes, etag: str | None) -> bool:
        """HEAD := ``raw`` if DST's HEAD is still ``etag`` (None: absent). True when DST's HEAD
        now holds ``raw`` (ours, or an identical write of another mirror); False when it moved
        elsewhere (plan again)."""
        mode: PutMode = IfMatch(etag) if etag is not None else "create"
        try:
            self.dst.put(HEAD_KEY, raw, mode=mode)
            return True
        except PreconditionFailedError as e:
            error: Exception = e
        except StorageError as e:  # 5xx, timeout: it may have landed; read back
            error = e
        current = read_head_back(self._dst_history, lambda last: StorageError(
            f"mirror: writing HEAD of {self.dst.url} failed ({error}) and HEAD could not be read back ({last}); "
            "DST holds either its previous head or the new one: run the mirror again"))
        if current is not None and current[0] == parse_head(raw):
            return True
        if not isinstance(error, PreconditionFailedError) and (current[1] if current is not None else None) == etag:
            raise error  # HEAD is as it was: the write failed, nothing was committed
        logger.debug("mirror: HEAD write to %s lost (%s)", self.dst.url, error)
        return False

    def _record(self, src: Head, index: ObjectRef | None) -> None:
        """Note the index this mirror wrote (advisory: see MIRROR_RECORD_KEY)."""
        doc = {"format": "deltastore.mirror", "schema": 1, "source": self.src.url, "lineage": src.lineage,
               "version": src.version, "index": None if index is None else index.key, "updated": now()}
        try:
            self.dst.put(MIRROR_RECORD_KEY, json.dumps(doc, sort_keys=True).encode(), mode="overwrite")
        except StorageError as e:
            logger.warning("mirror: could not write %s in %s: %s", MIRROR_RECORD_KEY, self.dst.url, e)

    # --- following ------------------------------------------------------------------------

    def follow(self, *, interval: float = FOLLOW_INTERVAL_S, stop: threading.Event | None = None,
               on_sync: Callable[[MirrorReport], None] | None = None) -> None:
        """Keep DST at SRC's head until ``stop`` is set: poll SRC's HEAD (a conditional GET,
        no body while it is unchanged) every ``interval`` seconds and sync when it moved.

        A failed sync (storage errors, a damaged or collected source object) is logged and
        tried again at the next poll; what it copied stays.

        Args:
            interval: seconds between polls.
            stop: ends the loop (after the sync in progress).
            on_sync: called with the report of every sync that ran.

        Raises:
            MirrorLineageError: DST holds another history (nothing written).
        """
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        stop = stop or threading.Event()
        etag: str | None = None
        while not stop.is_set():
            try:
                res = self.src.get_if_changed(HEAD_KEY, etag)
                if res is not None:
                    report = self._sync(res.data)
                    etag = res.meta.etag  # only after a complete sync: a failed one is retried
                    if on_sync is not None:
                        on_sync(report)
            except MirrorLineageError:
                raise
            except NotFoundError as e:
                if etag is None:
                    logger.info("mirror: waiting for %s to have a HEAD (%s)", self.src.url, e)
                else:
                    logger.warning("mirror %s → %s: %s; trying again in %gs", self.src.url, self.dst.url, e, interval)
                etag = None
            except DeltastoreError as e:
                logger.warning("mirror %s → %s failed: %s; trying again in %gs", self.src.url, self.dst.url, e, interval)
                etag = None
            stop.wait(interval)

    def close(self) -> None:
        """Close the stores this mirror opened from URLs."""
        for s in self._owned:
            s.close()
        self._owned = []

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mirror(src: Store | str, dst: Store | str, *, follow: bool = False, interval: float = FOLLOW_INTERVAL_S,
           stop: threading.Event | None = None, storage_options: Mapping[str, Any] | None = None,
           dst_storage_options: Mapping[str, Any] | None = None, trusted_keys: Iterable[Any] | None = None,
           on_sync: Callable[[MirrorReport], None] | None = None) -> MirrorReport | None:
    """Replicate store ``src`` into ``dst`` once, or keep doing it (``follow``).

    Args:
        src: source store or URL.
        dst: destination store or URL (a local directory is created).
        follow: keep DST current until ``stop`` is set (polling SRC every ``interval`` s).
        interval: seconds between polls of SRC's HEAD when following.
        stop: ends ``follow``.
        storage_options / dst_storage_options: backend options of the two URLs.
        trusted_keys: every manifest copied must be signed by one of these keys.
        on_sync: with ``follow``, called with each sync's report.

    Returns:
        The sync's :class:`MirrorReport`; None with ``follow``.

    Raises:
        MirrorLineageError: DST holds another history; nothing written.
        IntegrityError, NotFoundError, SignatureError, StorageError: see :meth:`Mirror.sync`.

    Example::

        from deltastore.fleet.mirror import mirror
        report = mirror("s3://us-east/run1", "s3://eu-west/run1")
        print(report.to_version, report.bytes_copied)
    """
    with Mirror(src, dst, storage_options=storage_options, dst_storage_options=dst_storage_options,
                trusted_keys=trusted_keys) as m:
        if not follow:
            return m.sync()
        m.follow(interval=interval, stop=stop, on_sync=on_sync)
        return None


__all__ = ["COPY_THREADS", "FOLLOW_INTERVAL_S", "MIRROR_RECORD_KEY", "Mirror", "MirrorReport", "mirror"]
