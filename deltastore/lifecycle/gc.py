"""Garbage collection: retention by a floor and pins, deletion on the store's clock (SPEC §11).

One run (design 005 D3), each step completing or aborting without deleting:

1. Write the clock probe ``gc/<run-id>.json`` (create-only, it records the run's parameters);
   its last-modified time is "now" on the store's clock. Read HEAD, its index and the ledger.
2. Compute ``low = min(head − keep_last + 1, oldest version a live worker holds, oldest version
   that was head within the grace period)`` and ``floor = max(index floor, anchor(low))``.
   Pin ``keep_versions`` and raise the floor with one index-only HEAD write (before anything
   is deleted), and from then on use the index as committed (it may carry others' pins).
3. Mark: read every manifest of [floor, head], the chains of the pins, and the registered
   squashes. Any read that fails aborts.
4. Sweep: list the whole store. Candidates are keys under ``manifests/``, ``objects/`` and
   ``gc/`` that are neither kept nor younger than the grace period. A failed
   listing, or an object without a last-modified time, aborts.
5. Re-read HEAD: a changed lineage or schema aborts.
6. Delete packs and squashes, then manifests, then old indexes, then old run records; write
   ``gc/<run-id>-report.json``.

``dry_run`` does all of it but writes neither the index nor deletes (only the probe is written).
Killed at any point, a run has deleted only objects no kept version needs, and the floor was
committed before the first delete; the next run finishes the work.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from deltastore.errors import (
    AlreadyExistsError,
    CorruptObjectError,
    DeltastoreError,
    GCAbortedError,
    GCRefusedError,
    HistoryReplacedError,
    NotFoundError,
    StorageError,
    UnsupportedSchemaError,
    VersionCollectedError,
)
from deltastore.fleet.ledger import LIVE_TTL_S, read_ledger
from deltastore.fleet.target import read_target
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, MANIFEST_PREFIX, OBJECT_PREFIX, STREAMS_PREFIX, stream_prefix
from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S, Head, Index, Manifest, SquashManifest, SquashRef
from deltastore.lifecycle.index import (
    INDEX_SUFFIX,
    add_pins,
    effective_floor,
    index_content,
    normalize_index,
    opened_store,
    pinned,
    read_index,
    update_index,
)
from deltastore.storage.base import ObjectMeta, Store
from deltastore.storage.prefixed import PrefixedStore

logger = logging.getLogger(__name__)

#: Run records (the clock probe and the report) live here; old ones are collected too.
GC_PREFIX = "gc/"
#: The only prefixes GC ever deletes under (SPEC §11, §15); HEAD, workers/ and _deltastore/ never.
DELETABLE_PREFIXES = (OBJECT_PREFIX, MANIFEST_PREFIX, GC_PREFIX, STREAMS_PREFIX)
#: Slack for the store's clock error between stamping an object and stamping the probe, and for
#: one SDK request's own retry window (design 005 D3, CLOCK_MARGIN).
CLOCK_MARGIN_S = 600
#: Squashes named by manifests of versions ≥ head − this are kept (SPEC §11).
SQUASH_RETAIN = 8
#: The default grace period: a day (other systems use 3–7 days).
DEFAULT_GRACE_S = 86400.0
#: Deletion order (design 005 D3 step 6): data first, the documents that name it after, so
#: that a killed run never leaves a kept-looking manifest pointing at deleted packs.
_PHASES = ("packs", "manifests", "indexes", "records")
#: Deletes in flight: each is one request (S3 DeleteObject); a few at once hide the round trip
#: (10,000 objects at 20 ms each take 200 s one by one).
DELETE_THREADS = 8


@dataclass
class GCReport:
    """What one GC run kept and deleted (``to_json()`` is what ``--json`` prints and what
    ``gc/<run-id>-report.json`` holds).

    Attributes:
        run_id: this run's id (``gc/<run-id>.json`` is its probe).
        now: the store's clock at the start (the probe's last-modified time), RFC 3339.
        head_version: HEAD's version when the run read it.
        floor_before / floor_after: the index floor before and after (after = committed, or
            what would be committed in a dry run).
        pins: the pinned versions after the run.
        kept_objects / kept_bytes: listed objects kept because a kept version needs them.
        young_objects / young_bytes: other listed objects kept because they are younger than
            the grace period.
        deleted_objects / deleted_bytes: objects deleted (to be deleted, in a dry run).
        deleted: the deleted keys by kind (packs, manifests, indexes, records).
        missing: objects kept versions need that the listing did not show (a damaged store;
            GC deletes nothing they need either way, and says so).
        dry_run: nothing was committed or deleted.
        aborted_reason: why nothing was done (an empty store), else None.
    """

    run_id: str
    now: str
    head_version: int
    floor_before: int
    floor_after: int
    pins: list[int]
    keep_last: int
    grace_s: float
    kept_versions: list[int] = field(default_factory=list)
    kept_objects: int = 0
    kept_bytes: int = 0
    young_objects: int = 0
    young_bytes: int = 0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    deleted: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in _PHASES})
    missing: list[str] = field(default_factory=list)
    dry_run: bool = False
    aborted_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _kind(key: str) -> str:
    if key.startswith(MANIFEST_PREFIX) or (key.startswith(STREAMS_PREFIX) and f"/{MANIFEST_PREFIX}" in key):
        return "manifests"
    if key.startswith(GC_PREFIX):
        return "records"
    if key.startswith(OBJECT_PREFIX) and key.endswith(INDEX_SUFFIX):
        return "indexes"
    return "packs"  # packs, layouts, squash manifests, part manifests


def collect(store_or_url: Store | str, *, keep_last: int = 10, keep_versions: Iterable[int] = (),
            grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False,
            storage_options: Mapping[str, Any] | None = None, writer: str | None = None,
            unsafe_grace_ok: bool = False, ledger_ttl_s: float = LIVE_TTL_S) -> GCReport:
    """Collect what the retention rules no longer need (SPEC §11); see the module docstring.

    Args:
        store_or_url: an open store, or a URL (opened with ``storage_options``).
        keep_last: versions head − keep_last + 1 … head stay readable (≥ 1).
        keep_versions: versions to pin (persistently, in the index) before collecting.
        grace_s: nothing younger than this (store clock) is deleted; must be ≥ the largest
            ``max_attempt_s`` of the kept manifests + CLOCK_MARGIN_S (6 h 10 min by default).
        dry_run: compute and report only; writes nothing but the probe.
        writer: the id recorded in the index (default: host-pid-random).
        unsafe_grace_ok: skip the grace check (tests, with publishers of a short deadline).
        ledger_ttl_s: a heartbeat older than this (store clock) is not a live worker.

    Raises:
        GCRefusedError: the grace is too short, or the store gives no last-modified times.
        UnsupportedSchemaError: HEAD or a manifest is of a schema this deltastore does not read.
        VersionCollectedError: a ``keep_versions`` version is already below the floor.
        GCAbortedError: a listing or needed read failed, HEAD changed lineage or schema, or a
            delete failed; ``deleted`` says how many objects went before it stopped.
        HistoryReplacedError: HEAD's lineage changed while the index was being written.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be ≥ 1, got {keep_last}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be ≥ 0, got {grace_s}")
    keep = sorted({int(v) for v in keep_versions})
    with opened_store(store_or_url, dict(storage_options or {})) as store:
        return _Run(store, keep_last=keep_last, keep=keep, grace_s=float(grace_s), dry_run=dry_run,
                    writer=writer, unsafe_grace_ok=unsafe_grace_ok, ttl_s=ledger_ttl_s).run()


class _Run:
    def __init__(self, store: Store, *, keep_last: int, keep: list[int], grace_s: float, dry_run: bool,
                 writer: str | None, unsafe_grace_ok: bool, ttl_s: float):
        from deltastore.lifecycle.index import default_writer

        self.store = store
        self.history = History(store)
        self._streams: dict[str, History] = {}  # format → its stream's history (SPEC §15)
        self.keep_last, self.keep, self.grace_s = keep_last, keep, grace_s
        self.dry_run, self.unsafe_grace_ok, self.ttl_s = dry_run, unsafe_grace_ok, ttl_s
        self.writer = writer or default_writer()
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(4)
        self.probe_key = f"{GC_PREFIX}{self.run_id}.json"
        self.report_key = f"{GC_PREFIX}{self.run_id}-report.json"

    # --- step 1 --------------------------------------------------------------------------

    def _probe(self) -> datetime:
        """Write the run record and take its last-modified time as "now" (store clock)."""
        doc = {
            "format": "deltastore.lifecycle.gc-run", "run_id": self.run_id, "writer": self.writer,
            "keep_last": self.keep_last, "keep_versions": self.keep, "grace_s": self.grace_s,
            "dry_run": self.dry_run,
            "started_local": _iso(datetime.now(timezone.utc)),  # informative only: never compared
        }
        try:
            self.store.put(self.probe_key, json.dumps(doc, sort_keys=True).encode(), mode="create")
        except AlreadyExistsError:
            pass  # our own write (the run id is random), retried by the client after a lost response
        meta = self.store.head(self.probe_key)
        if meta.last_modified is None:
            raise GCRefusedError(
                f"{self.store.url} does not report last-modified times ({type(self.store).__name__}); GC ages objects "
                "on the store's clock and cannot run on it"
            )
        return meta.last_modified

    def run(self) -> GCReport:
        now = self._probe()
        cur = self.history.read_head()
        if cur is None or cur[0].manifest is None:
            return GCReport(run_id=self.run_id, now=_iso(now), head_version=0, floor_before=1, floor_after=1,
                            pins=[], keep_last=self.keep_last, grace_s=self.grace_s, dry_run=self.dry_run,
                            aborted_reason=f"{self.store.url} has no committed version: nothing to collect")
        head = cur[0]
        index = self._read(lambda: read_index(self.history, head), "the history index")
        floor_before = effective_floor(index)
        # Ages of manifests (for `recent`), from one listing of manifests/.
        manifest_ages = self._list(MANIFEST_PREFIX, now)
        chain = _Chain(self)
        top_key, top = self._read(lambda: self.history.head_manifest(head), "the head manifest")  # type: ignore[misc]
        chain.add(top_key, top)

        # --- step 2: the floor ---------------------------------------------------------------
        low = max(1, head.version - self.keep_last + 1)
        live = self._live_versions(now, head)
        target = self._target_version(head)
        if target is not None:
            live.append(target)
        if live:
            low = min(low, min(live))
        v = head.version  # `recent`: v−1 is recent while manifest(v) is younger than the grace
        while v > max(1, floor_before):
            age = manifest_ages.get(chain.key(v))
            if age is None:
                age = self._age_of(chain.key(v), now)
            if age >= self.grace_s:
                break
            chain.down_to(v - 1)
            v -= 1
        low = max(min(low, v), floor_before)
        for kv in self.keep:  # their manifests are needed for the pin records
            if floor_before <= kv <= head.version:
                chain.down_to(kv)
        chain.down_to(low)
        floor = max(floor_before, chain.manifest(low).anchor)

        # --- step 2b: the grace check against every writer's attempt deadline --------------
        self._check_grace(chain, floor, head.version)

        # --- step 2c: commit pins and floor (before deleting anything) ---------------------
        def mutate(h: Head, idx: Index | None) -> Index:
            if h.lineage != head.lineage:
                raise HistoryReplacedError(
                    f"HEAD of {self.store.url} now has lineage {h.lineage}, not {head.lineage}: another history; nothing was deleted"
                )
            pinned_idx = add_pins(self.keep, history=self.history, by=self.writer)(h, idx) if self.keep else index_content(idx, h)
            return normalize_index(pinned_idx.model_copy(update={"floor": max(floor, effective_floor(idx))}), idx)

        if self.dry_run:
            committed = mutate(head, index)
            committed_head = head
        else:
            committed_head, committed = update_index(self.store, self.history, mutate, writer=self.writer)
        floor = committed.floor  # another GC may have raised it further
        pins = sorted(pinned(committed))
        if committed_head.manifest != head.manifest:
            # Versions were committed meanwhile (and another GC may have raised the floor past
            # the head we read): keep what the committed HEAD's chain needs.
            head = committed_head
            chain = _Chain(self)
            chain.add(*self._read(lambda: self.history.head_manifest(committed_head), "the head manifest"))
            self._check_grace(chain, floor, head.version)  # the new versions' deadlines count too

        # --- step 3: mark ------------------------------------------------------------------
        kept: set[str] = {HEAD_KEY}
        if committed_head.index is not None:
            kept.add(committed_head.index.key)
        chain.down_to(floor)
        kept |= self._mark(chain, floor, head.version, committed)

        # --- step 4: sweep -----------------------------------------------------------------
        report = GCReport(run_id=self.run_id, now=_iso(now), head_version=head.version, floor_before=floor_before,
                          floor_after=floor, pins=pins, keep_last=self.keep_last, grace_s=self.grace_s,
                          kept_versions=[m.version for _, m in chain.between(floor, head.version)],
                          dry_run=self.dry_run)
        candidates: dict[str, list[ObjectMeta]] = {p: [] for p in _PHASES}
        listing = self._listing(now)
        listed = {m.key for m in listing}
        missing = {k for k in kept - listed if k != HEAD_KEY}
        if missing:
            missing = self._still_needed(missing, chain, floor, head.version)
        report.missing = sorted(missing)
        if report.missing:
            logger.warning("gc on %s: %d objects that kept versions need are missing (the store is damaged), first %s",
                           self.store.url, len(report.missing), report.missing[0])
        for meta in listing:
            if meta.key in kept:
                report.kept_objects += 1
                report.kept_bytes += meta.size
            elif meta.key == self.probe_key or (now - meta.last_modified).total_seconds() < self.grace_s:  # type: ignore[operator]
                report.young_objects += 1
                report.young_bytes += meta.size
            elif meta.key.startswith(DELETABLE_PREFIXES):
                candidates[_kind(meta.key)].append(meta)
        for phase in _PHASES:
            report.deleted[phase] = [m.key for m in candidates[phase]]
            report.deleted_objects += len(candidates[phase])
            report.deleted_bytes += sum(m.size for m in candidates[phase])

        # --- step 5: HEAD must still be the same history, in a schema we know -------------
        again = self._read(self.history.read_head, "HEAD")
        if again is None or again[0].lineage != committed_head.lineage or again[0].schema_ != committed_head.schema_:
            raise GCAbortedError(
                f"HEAD of {self.store.url} changed lineage or schema during GC ({committed_head.lineage} → "
                f"{None if again is None else again[0].lineage}); nothing was deleted"
            )
        if self.dry_run:
            logger.info("gc dry run on %s: would delete %d objects (%d bytes), floor %d → %d",
                        self.store.url, report.deleted_objects, report.deleted_bytes, floor_before, floor)
            return report

        # --- step 6: delete ----------------------------------------------------------------
        done = 0
        for phase in _PHASES:  # a phase ends before the next begins (data before documents)
            done = self._delete_all(candidates[phase], done)
        try:
            self.store.put(self.report_key, json.dumps(report.to_json(), sort_keys=True).encode(), mode="create")
        except AlreadyExistsError:
            pass  # our own write, retried by the client after a lost response
        except StorageError as e:  # the deletes are done: the record is informative
            logger.warning("gc on %s: could not write %s: %s", self.store.url, self.report_key, e)
        logger.info("gc on %s: deleted %d objects (%d bytes), kept %d, floor %d → %d",
                    self.store.url, report.deleted_objects, report.deleted_bytes, report.kept_objects, floor_before, floor)
        return report

    def _mark(self, chain: _Chain, floor: int, top: int, index: Index) -> set[str]:
        """What versions ``floor``..``top`` of ``chain`` (read down to ``floor``) and ``index``'s
        pins below the floor and squashes need (SPEC §11's marks)."""
        pins = pinned(index)
        kept: set[str] = set()
        for key, m in chain.between(floor, top):
            kept.add(key)
            kept.update(m.references())
            if m.version >= top - SQUASH_RETAIN:
                for s in m.squashes:
                    if s.from_ >= floor or s.from_ in pins:
                        kept.update(self._squash_needs(s))
        for p in index.pins:
            if p.version >= floor:
                continue
            kept.update(self._needs_materialize(p.manifest))
        for s in index.squashes:
            if s.from_ >= floor or s.from_ in pins:
                kept.update(self._squash_needs(s))
        return kept

    def _still_needed(self, missing: set[str], chain: _Chain, floor: int, top: int) -> set[str]:
        """Of ``missing`` (marked at ``floor``, absent from the listing), those the store's
        history still needs. Another GC may have raised the floor after this one committed its
        own and collected below it (two GCs serialize only their index writes): objects of
        versions below that floor are collected, not lost. Re-read HEAD's index once and mark
        again at its floor; if anything cannot be read, report them all (a false alarm, never
        a missed one)."""
        try:
            got = self.history.read_head()
            index = read_index(self.history, got[0]) if got is not None else None
        except DeltastoreError as e:
            logger.debug("gc on %s: re-reading the index to check %d missing objects failed: %s",
                         self.store.url, len(missing), e)
            return missing
        if index is None or index.floor <= floor:
            return missing
        try:
            now_needed = self._mark(chain, min(index.floor, top), top, index)
        except DeltastoreError as e:
            logger.debug("gc on %s: marking at the new floor %d failed: %s", self.store.url, index.floor, e)
            return missing
        gone = missing - now_needed
        if gone:
            logger.info("gc on %s: %d objects marked at floor %d were collected since by another GC (floor %d now)",
                        self.store.url, len(gone), floor, index.floor)
        return missing & now_needed

    def _delete_all(self, metas: list[ObjectMeta], done: int) -> int:
        """Delete ``metas`` a few at a time; the first failure stops the run (the rest are
        cancelled) with GCAbortedError. Returns the running count of deleted objects."""
        if not metas:
            return done
        with ThreadPoolExecutor(DELETE_THREADS, thread_name_prefix="deltastore-gc") as pool:
            futures = [pool.submit(self.store.delete, m.key) for m in metas]
            failure: tuple[str, BaseException] | None = None
            for meta, fut in zip(metas, futures):
                try:
                    fut.result()
                    done += 1
                except CancelledError:
                    continue
                except BaseException as e:  # noqa: BLE001 - a kill (KeyboardInterrupt) too: stop the rest
                    if failure is None:
                        failure = (meta.key, e)
                        for f in futures:
                            f.cancel()
        if failure is not None:
            key, e = failure
            if not isinstance(e, Exception):
                raise e
            raise GCAbortedError(
                f"deleting {key!r} from {self.store.url} failed ({e}); {done} objects were deleted, nothing kept "
                "was touched: run GC again to finish",
                deleted=done,
            ) from e
        return done

    # --- helpers -------------------------------------------------------------------------

    def _check_grace(self, chain: _Chain, floor: int, top: int) -> None:
        """Refuse a grace shorter than the kept manifests' attempt deadline + CLOCK_MARGIN_S."""
        deadline = max((m.max_attempt_s or DEFAULT_MAX_ATTEMPT_S) for _, m in chain.between(floor, top))
        if self.grace_s < deadline + CLOCK_MARGIN_S and not self.unsafe_grace_ok:
            raise GCRefusedError(
                f"grace {self.grace_s:g}s is shorter than the writers' attempt deadline {deadline}s + {CLOCK_MARGIN_S}s "
                f"(SPEC §11): GC could delete objects of an attempt that may still commit. Use --grace ≥ {deadline + CLOCK_MARGIN_S}s"
            )

    def _read(self, fn: Any, what: str) -> Any:
        """Run a needed read; any failure aborts the run (design 005 D3 step 3)."""
        try:
            return fn()
        except (UnsupportedSchemaError, VersionCollectedError, HistoryReplacedError):
            raise
        except GCAbortedError:
            raise
        except NotFoundError as e:
            raise GCAbortedError(f"GC of {self.store.url}: {what} is missing ({e}); the store is damaged, nothing was deleted") from e
        except Exception as e:
            raise GCAbortedError(f"GC of {self.store.url}: reading {what} failed ({e}); nothing was deleted") from e

    def _list(self, prefix: str, now: datetime) -> dict[str, float]:
        return {m.key: (now - m.last_modified).total_seconds() for m in self._listing(now, prefix)}  # type: ignore[operator]

    def _listing(self, now: datetime, prefix: str = "") -> list[ObjectMeta]:
        """A complete listing (every page), or an abort; every object must have an age."""
        metas = self._read(lambda: list(self.store.list(prefix)), f"the listing of {prefix or 'the store'}")
        for m in metas:
            if m.last_modified is None:
                raise GCRefusedError(f"{self.store.url} listed {m.key!r} without a last-modified time; GC cannot age it")
        return metas

    def _age_of(self, key: str, now: datetime) -> float:
        meta = self._read(lambda: self.store.head(key), f"manifest {key!r}")
        if meta.last_modified is None:
            raise GCRefusedError(f"{self.store.url} gives no last-modified time for {key!r}")
        return (now - meta.last_modified).total_seconds()

    def _live_versions(self, now: datetime, head: Head) -> list[int]:
        beats = self._read(lambda: read_ledger(self.store), "the ledger (workers/)")
        return [b.version for b in beats
                if b.live(now, self.ttl_s) and b.lineage in (None, head.lineage) and 1 <= b.version <= head.version]

    def _target_version(self, head: Head) -> int | None:
        """The fleet target's version while it applies (docs/fleet.md): kept like a live
        worker's, so that a fleet held at an older version can still move to it. A target that
        cannot be parsed keeps nothing and is logged (followers ignore it too)."""
        try:
            target = read_target(self.store)
        except (CorruptObjectError, UnsupportedSchemaError) as e:
            logger.warning("%s: the fleet target is unreadable (%s); it keeps no version", self.store.url, e)
            return None
        except Exception as e:
            raise GCAbortedError(f"GC of {self.store.url}: reading the fleet target failed ({e}); nothing was "
                                 "deleted") from e
        if target is None or not target.applies(head) or target.version is None:
            return None
        return target.version if 1 <= target.version <= head.version else None

    def _needs_materialize(self, key: str) -> set[str]:
        """Manifests anchor(p) … p with their layouts; the anchor's full packs (role ``f``), every
        pack of the deltas after it (SPEC §11)."""
        def walk() -> set[str]:
            m = self.history.manifest(key)
            out: set[str] = set()
            if m.base is not None:  # a based version (SPEC §14) is its own chain: its manifest, layout, packs
                out.add(key)
                if m.layout is not None:
                    out.add(m.layout.key)
                out.update(b.key for b in m.blobs)
                return out
            for k, mm in self.history.anchor_chain(key, m):
                out.add(k)
                out.update(self.stream_needs(mm))
                if mm.layout is not None:
                    out.add(mm.layout.key)
                for b in mm.blobs:
                    if mm.kind == "anchor" and b.role == "d":
                        continue
                    out.add(b.key)
            return out

        return self._read(walk, f"the chain of pinned manifest {key!r}")

    def stream_needs(self, m: Manifest) -> tuple[str, ...]:
        """The serving streams of manifest ``m`` (SPEC §15): each stream's manifest of that version
        and what it references (packs, layout), as keys of the store. A stream's chain back to
        its anchor lies within its store's (§15), so marking the streams of every kept version
        keeps every stream materializable."""
        out: list[str] = []
        for ref in m.streams:
            prefix = stream_prefix(ref.format)
            history = self._streams.get(ref.format)
            if history is None:
                history = self._streams[ref.format] = History(PrefixedStore(self.store, prefix))
            sm = self._read(lambda h=history, k=ref.key[len(prefix):], d=ref.sha256: h.manifest(k, d),
                            f"{ref.format} stream manifest {ref.key!r}")
            out.append(ref.key)
            out.extend(prefix + k for k in sm.references())
        return tuple(out)

    def _squash_needs(self, ref: SquashRef) -> set[str]:
        """The squash manifest, its packs and its layout (read through History: verified
        against the ref's digest and range)."""
        def read() -> set[str]:
            s: SquashManifest = self.history.squash(ref)
            refs = {ref.key, *s.references()}
            if s.layout is not None:
                refs.add(s.layout.key)
            return refs

        return self._read(read, f"squash manifest {ref.key!r}")


@dataclass(frozen=True)
class _Version:
    """What GC needs of one manifest (a parsed manifest costs ~3 KB per chunk entry: a chain of
    thousands of versions must not be held parsed)."""

    version: int
    anchor: int
    max_attempt_s: int | None
    squashes: tuple[Any, ...]
    refs: tuple[str, ...]

    def references(self) -> tuple[str, ...]:
        return self.refs


class _Chain:
    """HEAD's chain of manifests, read downwards on demand (each link checked by History)."""

    def __init__(self, run: _Run):
        self.run = run
        self.by_version: dict[int, tuple[str, _Version]] = {}
        self.lowest: int | None = None
        self._low: tuple[str, Manifest] | None = None  # the lowest, parsed: the next link starts there

    def add(self, key: str, m: Manifest) -> None:
        self.by_version[m.version] = (key, _Version(m.version, m.anchor, m.max_attempt_s, tuple(m.squashes),
                                                    tuple(m.references()) + self.run.stream_needs(m)))
        if self.lowest is None or m.version < self.lowest:
            self.lowest, self._low = m.version, (key, m)

    def down_to(self, version: int) -> None:
        assert self.lowest is not None and self._low is not None
        while self.lowest > version:
            key, m = self._low
            pkey, p = self.run._read(lambda key=key, m=m: self.run.history.parent(key, m), f"the parent of manifest {key!r}")
            self.add(pkey, p)

    def key(self, version: int) -> str:
        self.down_to(version)
        return self.by_version[version][0]

    def manifest(self, version: int) -> _Version:
        self.down_to(version)
        return self.by_version[version][1]

    def between(self, low: int, high: int) -> list[tuple[str, _Version]]:
        self.down_to(low)
        return [self.by_version[v] for v in range(low, high + 1)]


__all__ = ["CLOCK_MARGIN_S", "DEFAULT_GRACE_S", "GCReport", "collect"]
