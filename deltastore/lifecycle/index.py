"""The history index: retention floor, pins and registered squashes (SPEC §11, design 005 D2/D4).

HEAD (schema 3) names one immutable index object. Changing it is an *index-only* HEAD write:
a new index object is written create-only under a fresh attempt, and HEAD is compare-and-swapped
with every field copied unchanged except ``index`` and ``updated`` (SPEC §4), so a publisher's
lost-response check (its ``commit_id`` on HEAD) keeps working and a publisher can rebase past it.

Several writers change the index (GC, the compactor, ``pin``/``unpin``). Each passes a
``mutate(head, index) -> index`` function to :func:`update_index`; when the CAS loses, HEAD is
read again and ``mutate`` runs again on the index HEAD now names, so concurrent changes merge
instead of overwriting each other. :func:`update_index` itself enforces the two rules no
writer may break: the floor never goes down, and squashes from below the floor (and not from a
pin) are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from deltastore.errors import (
    ConflictError,
    HistoryReplacedError,
    StorageError,
    UnsupportedSchemaError,
    VersionCollectedError,
    VersionNotFoundError,
)
from deltastore.format.history import History
from deltastore.format.keys import new_attempt_id, new_lineage, object_key, sha256_hex
from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S, Head, Index, ObjectRef, Pin, SquashRef
from deltastore.format.objects import encode_object
from deltastore.storage.base import Store
from deltastore.write.commit import attempt_clock, cas_head, now, put_immutable

logger = logging.getLogger(__name__)

#: The schema of HEADs this module writes (index-only writes exist from schema 3 on).
INDEX_SCHEMA = 3
#: Key suffix of index objects (``objects/<attempt>/<sha256>.index.json.zst``).
INDEX_SUFFIX = ".index.json.zst"
#: CAS tries of one index write: each loses only to another HEAD write landing during one
#: round trip, and index writes are rare (one per GC run, compaction round or pin).
INDEX_CAS_ATTEMPTS = 8

Mutate = Callable[[Head, "Index | None"], Index]


def read_index(history: History, head: Head) -> Index | None:
    """The index ``head`` names, verified against its digest and HEAD's lineage (None when
    HEAD names none); :meth:`History.index`, which caches it by key.

    Raises:
        NotFoundError: HEAD names an index that is missing (the store is damaged).
        IntegrityError / CorruptObjectError: its bytes are not the index HEAD promised, or
            its lineage is not HEAD's.
        UnsupportedSchemaError: an index of a schema this deltastore does not read.
    """
    return history.index(head)


def effective_floor(index: Index | None) -> int:
    """The retention floor: every version in [floor, head] is readable (1 without an index)."""
    return 1 if index is None else index.floor


def pinned(index: Index | None) -> set[int]:
    """The pinned versions (kept with everything needed to materialize them)."""
    return set() if index is None else {p.version for p in index.pins}


def normalize_index(new: Index, old: Index | None) -> Index:
    """Enforce what no index writer may change: the floor never goes down, pins are unique
    (sorted), and squashes whose ``from`` is below the floor and not pinned are dropped."""
    floor = max(new.floor, effective_floor(old))
    pins: dict[int, Pin] = {}
    for p in new.pins:
        pins.setdefault(p.version, p)
    keep_from = {v for v in pins}
    squashes = {}
    for s in new.squashes:
        if s.from_ >= floor or s.from_ in keep_from:
            squashes.setdefault(s.key, s)
    return new.model_copy(update={
        "floor": floor,
        "pins": tuple(pins[v] for v in sorted(pins)),
        "squashes": tuple(sorted(squashes.values(), key=lambda s: (s.from_, s.to, s.key))),
    })


def _same_content(a: Index, b: Index | None) -> bool:
    return b is not None and (a.floor, a.pins, a.squashes) == (b.floor, b.pins, b.squashes)


def update_index(store: Store, history: History, mutate: Mutate, *, writer: str,
                 max_attempt_s: float = DEFAULT_MAX_ATTEMPT_S) -> tuple[Head, Index]:
    """Replace HEAD's index by ``mutate(head, index)`` with an index-only HEAD write (SPEC §4, §11).

    ``mutate`` gets the current HEAD and its index (None when it has none) and returns the
    new index's content (``floor``, ``pins``, ``squashes``); ``lineage``, ``generation``,
    ``previous``, ``writer`` and ``created`` are filled in here. It may raise to refuse (a pin
    below the floor). When it returns the current content unchanged, nothing is written.

    Each try writes the index create-only under a fresh attempt id, then CASes HEAD copying
    every field but ``index`` and ``updated`` (:func:`~deltastore.write.commit.cas_head`, the
    one HEAD write of every writer). A failed CAS reads HEAD back: the write succeeded iff HEAD
    names our index (an unclear outcome: timeout, 5xx, 409); otherwise ``mutate`` runs again
    on the HEAD read back. An attempt older than ``max_attempt_s``
    (:func:`~deltastore.write.commit.attempt_clock`, counting suspended time) is abandoned
    before its CAS (SPEC §5 step 3a) and the next try starts afresh.

    Returns:
        ``(head, index)`` as committed (or as found, when nothing needed writing).

    Raises:
        VersionNotFoundError: the store has no HEAD.
        HistoryReplacedError: HEAD's lineage changed between tries (another history).
        UnsupportedSchemaError: HEAD is of a schema without an index (before schema 3).
        ConflictError: every try lost its CAS (or was abandoned at its deadline); HEAD's index
            is unchanged.
        StorageError: the index object could not be written, or HEAD could not be read back.
    """
    lineage0: str | None = None
    current = history.read_head()
    for attempt in range(INDEX_CAS_ATTEMPTS):
        if current is None:
            raise VersionNotFoundError(f"{store.url} has no HEAD: nothing to index")
        head, etag = current
        if head.schema_ < INDEX_SCHEMA or head.lineage is None:
            raise UnsupportedSchemaError(
                f"HEAD of {store.url} is schema {head.schema_}; the history index needs a schema-{INDEX_SCHEMA} HEAD "
                "with a lineage, which this deltastore's publishers write"
            )
        if lineage0 is None:
            lineage0 = head.lineage
        elif head.lineage != lineage0:
            raise HistoryReplacedError(
                f"HEAD of {store.url} changed lineage ({lineage0} → {head.lineage}) during an index write: another history"
            )
        old = read_index(history, head)
        proposed = normalize_index(mutate(head, old), old)
        if _same_content(proposed, old):
            assert old is not None
            return head, old
        started = attempt_clock()
        new = proposed.model_copy(update={
            "lineage": head.lineage,
            "generation": (old.generation + 1) if old is not None else 1,
            "previous": head.index,
            "writer": writer,
            "created": now(),
        })
        new = Index.model_validate(new.model_dump(by_alias=True))  # model_copy does not validate
        data = encode_object(new)
        digest = sha256_hex(data)
        key = object_key(new_attempt_id(), digest, INDEX_SUFFIX)
        put_immutable(store, key, data, "history index")
        limit = min(max_attempt_s, history.attempt_deadline(head))  # never longer than the publisher's
        if attempt_clock() - started > limit:
            logger.warning("index write %s took over %ss; abandoning the attempt", key, limit)
            current = history.read_head()
            continue
        ref = ObjectRef(key=key, sha256=digest)
        new_head = head.model_copy(update={"index": ref, "updated": now()})
        write = cas_head(store, history, new_head, etag, lambda error, last: _unreadable(store, error, last))
        if write.written:
            logger.info("history index of %s is now generation %d (floor %d, %d pins, %d squashes)",
                        store.url, new.generation, new.floor, len(new.pins), len(new.squashes))
            return new_head, new
        current = write.current
        if current is not None and current[0].index == ref:
            logger.warning("index write to %s failed (%s) but had landed", store.url, write.error)
            return current[0], new
        logger.info("index write to %s did not land (%s; try %d of %d); rebuilding on the HEAD read back",
                    store.url, write.error, attempt + 1, INDEX_CAS_ATTEMPTS)
    raise ConflictError(
        f"the history index of {store.url} could not be written in {INDEX_CAS_ATTEMPTS} tries (each lost its HEAD "
        "compare-and-swap to another writer, or outlived max_attempt_s); nothing was changed, try again"
    )


def _unreadable(store: Store, error: Exception, last: Exception | None) -> StorageError:
    return StorageError(
        f"an index write to {store.url} failed ({error}) and HEAD could not be read back ({last}); "
        "run again (an index write is idempotent in effect)"
    )


# --- pins -------------------------------------------------------------------------------------


def add_pins(versions: Iterable[int], *, history: History, note: str = "", by: str = "") -> Mutate:
    """A ``mutate`` that pins ``versions`` (SPEC §11: only a version ≥ floor may be pinned; one
    already pinned stays as it is).

    Raises (from the mutate): VersionCollectedError for a version below the floor and not
    pinned; VersionNotFoundError for one above head.
    """
    wanted = sorted(set(versions))

    def mutate(head: Head, index: Index | None) -> Index:
        floor, pins = effective_floor(index), pinned(index)
        new = list(index.pins) if index is not None else []
        for v in wanted:
            if v in pins:
                continue
            if v > head.version or v < 1:
                raise VersionNotFoundError(f"version {v} is not in {history.store.url} (latest is {head.version})")
            if v < floor:
                raise VersionCollectedError(
                    f"version {v} of {history.store.url} is below the retention floor {floor} and may already be "
                    f"collected; it cannot be pinned (pinned: {sorted(pins) or 'none'})",
                    version=v, floor=floor, pins=pins,
                )
            key, _ = history.find(v, head)
            new.append(Pin(version=v, manifest=key, note=note, by=by, at=now()))
        return index_content(index, head, pins=tuple(new))

    return mutate


def add_squashes(refs: Iterable[SquashRef]) -> Mutate:
    """A ``mutate`` that registers squashes (the compactor's, SPEC §12) next to those already in
    the index; one whose ``from`` is below the floor (and not pinned) is dropped on write."""
    new = tuple(refs)

    def mutate(head: Head, index: Index | None) -> Index:
        have = tuple(index.squashes) if index is not None else ()
        known = {s.key for s in have}
        return index_content(index, head, squashes=have + tuple(s for s in new if s.key not in known))

    return mutate


def index_content(index: Index | None, head: Head, **changes: object) -> Index:
    """``index`` with ``changes`` (a placeholder provenance: update_index fills it in)."""
    base = index if index is not None else Index(
        lineage=head.lineage or new_lineage(), generation=1, floor=1, writer="", created="",
    )
    return base.model_copy(update=changes)


def pin(store: Store | str, version: int, *, note: str = "", writer: str | None = None,
        storage_options: dict | None = None) -> Index:
    """Pin ``version``: GC keeps it (and what materializing it needs) below the floor.

    Raises:
        VersionCollectedError: ``version`` is below the floor (it may already be gone).
        VersionNotFoundError: ``version`` is not committed.
    """
    with opened_store(store, storage_options) as st:
        history = History(st)
        by = writer or default_writer()
        return update_index(st, history, add_pins([version], history=history, note=note, by=by),
                            writer=by)[1]


def unpin(store: Store | str, version: int, *, writer: str | None = None,
          storage_options: dict | None = None) -> Index | None:
    """Remove ``version``'s pin (nothing happens when it is not pinned). Returns the index."""
    with opened_store(store, storage_options) as st:
        history = History(st)

        def mutate(head: Head, index: Index | None) -> Index:
            if index is None:
                return index_content(None, head)
            return index_content(index, head, pins=tuple(p for p in index.pins if p.version != version))

        head = history.read_head()
        if head is None:
            raise VersionNotFoundError(f"{st.url} has no HEAD")
        if version not in pinned(read_index(history, head[0])):
            return read_index(history, head[0])
        return update_index(st, history, mutate, writer=writer or default_writer())[1]


def default_writer() -> str:
    from deltastore.fleet.ledger import default_worker_id

    return default_worker_id()


class opened_store:
    """A store given, or opened from a URL (and then closed on exit)."""

    def __init__(self, store: Store | str, storage_options: dict | None):
        self._given = store if isinstance(store, Store) else None
        self._url = None if self._given is not None else str(store)
        self._options = storage_options
        self._store: Store | None = None

    def __enter__(self) -> Store:
        if self._given is not None:
            return self._given
        from deltastore.storage import open_store

        self._store = open_store(self._url, storage_options=dict(self._options or {}))
        return self._store

    def __exit__(self, *exc: object) -> None:
        if self._store is not None:
            self._store.close()


__all__ = [
    "INDEX_SUFFIX",
    "add_pins",
    "add_squashes",
    "default_writer",
    "effective_floor",
    "index_content",
    "normalize_index",
    "opened_store",
    "pin",
    "pinned",
    "read_index",
    "unpin",
    "update_index",
]
