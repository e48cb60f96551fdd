"""The HEAD commit protocol (SPEC §5): claim, compare-and-swap, lost responses, fencing.

One :class:`CommitProtocol` per publisher holds what the protocol needs between commits: the
HEAD it last saw (and that HEAD's ETag, the CAS token), its writer id and its epoch. Lifecycle::

    proto = CommitProtocol(store, history, writer_id)
    proto.open(takeover=True)        # read HEAD; claim the store (epoch + 1) if asked
    ...                              # build a manifest on proto.head / proto.epoch
    proto.prepare()                  # before each publish: fenced? an earlier outcome unknown?
    put_immutable(store, key, data)  # packs and the manifest (content-addressed, create-only)
    proto.commit(new_head, deadline=t)  # CAS HEAD (not past the attempt's deadline); an
                                     # unclear outcome is settled by reading HEAD; an
                                     # index-only HEAD change is rebased over (design 005 D4)
    proto.fenced                     # True once a newer publisher claimed the store

The rule (docs/design/001 and 004): a publish that committed never reports failure; one that
did not never leaves HEAD moved. Any HEAD write that fails other than cleanly is settled by
reading HEAD back (with retries) and looking for our commit id or our manifest; when HEAD cannot
be read, :class:`CommitUnknownError` says so and the next :meth:`CommitProtocol.prepare`
settles it before anything else is written.

Every HEAD write of every writer goes through :func:`cas_head` (one conditional PUT, and on any
failure one bounded read-back, :func:`read_head_back`): the publishers' commits and claims
here, and the index-only writes of :func:`deltastore.lifecycle.index.update_index`, which
decide the outcome by their own rule (success iff HEAD names their index).
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from deltastore.errors import (
    CommitAbandonedError,
    CommitUnknownError,
    ConflictError,
    DeltastoreError,
    FencedError,
    IntegrityError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
)
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, new_lineage
from deltastore.format.models import SCHEMA_VERSION, Head, dump
from deltastore.storage.base import IfMatch, ObjectMeta, Store, StreamedPut

logger = logging.getLogger(__name__)

#: Tries to claim a store whose current publisher keeps committing: each try loses only to a
#: commit that landed during one HEAD round trip.
CLAIM_ATTEMPTS = 16
#: Reads of HEAD to settle an unclear HEAD write: the storage client already retried each
#: request, so a few more spaced-out tries cover an outage of several seconds.
READBACK_ATTEMPTS = 6
#: First pause between those reads, doubled after each (0.2+0.4+...+3.2 s ≈ 6 s in all).
READBACK_BACKOFF_S = 0.2
#: HEAD writes retried over index-only HEAD changes (GC, compactor, pin: design 005 D4) in one
#: commit: those writers change HEAD a few times per GC run or compaction round, so 8 in a row
#: means something is rewriting HEAD in a loop; the commit then fails as a conflict.
REBASE_ATTEMPTS = 8


def _suspend_counting_clock() -> int | None:
    """The clock id that keeps counting while the machine is suspended, where there is one:
    Linux's ``CLOCK_BOOTTIME``; macOS's ``CLOCK_MONOTONIC`` (its ``time.monotonic`` stops
    during sleep). None elsewhere (Windows' ``time.monotonic`` already counts sleep)."""
    for name in ("CLOCK_BOOTTIME", "CLOCK_MONOTONIC" if sys.platform == "darwin" else ""):
        clock = getattr(time, name, None) if name else None
        if clock is not None:
            try:
                time.clock_gettime(clock)
            except OSError:  # a kernel without it (containers on very old hosts)
                continue
            return clock
    return None


_ATTEMPT_CLOCK = _suspend_counting_clock()


def attempt_clock() -> float:
    """Seconds on the clock that commit-attempt deadlines run on (SPEC §5 step 3a).

    It must count time the machine spends suspended: GC's grace period runs on the store's
    wall clock, so a publisher suspended for hours and then resumed must see its attempt as
    that old, or it could commit a HEAD naming packs GC has collected meanwhile.
    ``time.monotonic`` stops during suspend on Linux and macOS; this does not.
    """
    if _ATTEMPT_CLOCK is None:
        return time.monotonic()
    return time.clock_gettime(_ATTEMPT_CLOCK)


def now() -> str:
    """RFC 3339 UTC time with milliseconds, as HEAD and manifests record it."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def put_immutable(store: Store, key: str, data: bytes | bytearray, what: str) -> None:
    """Create-only upload of a content-addressed object (a pack or a manifest).

    The key names the SHA-256 of ``data``, so an object already there under it should hold our
    bytes: a precondition failure (another publisher uploaded the same content, or the SDK's
    retry of a request whose response was lost saw our own upload) is success once the object
    is read back as ``data``. Read back altered (our own first attempt may have landed damaged
    before its answer was lost: a server that stores a body whose checksum does not match), it is
    replaced under its ETag. An object of another size there is corrupt (IntegrityError); none
    there means the store answered a conflict for nothing (StorageError, nothing committed).
    """
    try:
        store.put(key, data, mode="create")
        return
    except PreconditionFailedError as e:
        error = e
    try:  # one read settles the usual case: our bytes
        if store.get(key) == data:
            logger.debug("%s %s already present (same content): %s", what, key, error)
            return
    except (NotFoundError, IntegrityError):  # gone, or failing the checksum stored with it
        pass
    meta = _settle_existing(store, key, len(data), what, error)  # gone or another size: a typed error
    logger.warning("%s %s in %s holds other bytes than its content address names: replacing it", what, key, store.url)
    store.put(key, data, mode=IfMatch(meta.etag))


def commit_immutable(store: Store, stream: StreamedPut, directory: str, name: str, size: int, what: str) -> None:
    """:func:`put_immutable` for bytes streamed through :meth:`Store.begin_put`: commit them
    as ``directory + name`` (``size`` bytes), an existing object of that size being success."""
    try:
        stream.commit(name)
        return
    except PreconditionFailedError as e:
        error = e
    _settle_existing(store, directory + name, size, what, error)


def _settle_existing(store: Store, key: str, size: int, what: str, error: PreconditionFailedError) -> ObjectMeta:
    """A create-only write of ``size`` bytes under a content-addressed ``key`` met an object
    there: its metadata when it has our size (it should hold our bytes), else a typed error."""
    try:
        meta = store.head(key)
    except NotFoundError:
        raise StorageError(
            f"uploading {what} {key!r} to {store.url} failed: the store reported a conflict ({error}) but holds no such object; "
            "nothing was committed, publish again"
        ) from error
    if meta.size != size:
        raise IntegrityError(
            f"{what} {key!r} in {store.url} has {meta.size} bytes, not the {size} its SHA-256 names: "
            "the stored object is corrupt; delete it and publish again"
        )
    logger.debug("%s %s already present (same size): %s", what, key, error)
    return meta


def new_commit_id() -> str:
    """A unique id stamped on each HEAD write, to recognise it when read back."""
    return uuid.uuid4().hex


def read_head_back(history: History, unreadable: Callable[[Exception | None], DeltastoreError]) -> tuple[Head, str] | None:
    """HEAD as stored now (None: there is none), read with bounded retries after a HEAD write
    whose outcome is unclear (SPEC §5 step 6).

    Args:
        history: the store's history (its HEAD is read uncached).
        unreadable: builds the error raised when HEAD stays unreadable, from the last read's
            error; each writer words it (a commit's outcome is unknown, an index write is to be
            run again).

    Raises:
        What ``unreadable`` returns, after :data:`READBACK_ATTEMPTS` failed reads.
    """
    delay = READBACK_BACKOFF_S
    last: Exception | None = None
    for attempt in range(READBACK_ATTEMPTS):
        if attempt:
            time.sleep(delay)
            delay *= 2
        try:
            return history.read_head()
        except (StorageError, IntegrityError) as e:  # 5xx, timeouts, truncated bodies
            last = e
            logger.info("reading HEAD back (try %d of %d) failed: %s", attempt + 1, READBACK_ATTEMPTS, e)
    raise unreadable(last) from last


@dataclass(frozen=True)
class HeadWrite:
    """The outcome of one conditional HEAD write (:func:`cas_head`).

    Attributes:
        etag: the new HEAD's ETag when the write was answered with success (the other fields
            are then unset).
        error: why the write failed: a precondition failure (``precondition``) or an unclear
            failure (5xx, timeout, reset: it may have landed).
        current: HEAD as read back after the failure (None: no HEAD), to settle the outcome.
    """

    etag: str | None = None
    error: Exception | None = None
    precondition: bool = False
    current: tuple[Head, str] | None = None

    @property
    def written(self) -> bool:
        return self.error is None


def cas_head(store: Store, history: History, new: Head, etag: str | None,
             unreadable: Callable[[Exception, Exception | None], DeltastoreError]) -> HeadWrite:
    """Write ``new`` as HEAD if HEAD's ETag is still ``etag`` (None: if there is no HEAD).

    Any failure is followed by reading HEAD back (:func:`read_head_back`), since even a
    precondition failure may be the storage client's retry of a write of ours that landed; the
    caller decides from :attr:`HeadWrite.current` whether it did.

    Args:
        unreadable: builds the error raised when HEAD cannot be read back, from the write's
            error and the last read's.

    Raises:
        What ``unreadable`` returns: the write failed and HEAD stayed unreadable.
    """
    mode = IfMatch(etag) if etag is not None else "create"
    try:
        meta = store.put(HEAD_KEY, dump(new), mode=mode)
    except PreconditionFailedError as e:
        error: Exception = e
        precondition = True
    except Exception as e:  # noqa: BLE001 - 5xx, timeout, reset, truncated read: unclear
        error, precondition = e, False
    else:
        return HeadWrite(etag=meta.etag)
    current = read_head_back(history, lambda last: unreadable(error, last))
    return HeadWrite(error=error, precondition=precondition, current=current)


class CommitProtocol:
    """One publisher's side of the HEAD protocol of one store.

    Attributes:
        head, head_etag: the HEAD this publisher last wrote or read (None on an empty store).
        epoch: this publisher's epoch (a claim raises it above every earlier publisher's).
        fenced: True once a newer publisher took the store over; no commit is tried after.
        superseded: set by :meth:`commit` when our version landed but another writer has
            already committed on top of it (so the publisher's reference copy is not HEAD's).
    """

    def __init__(self, store: Store, history: History, writer_id: str):
        self.store = store
        self.history = history
        self.writer_id = writer_id
        self.head: Head | None = None
        self.head_etag: str | None = None
        self.epoch = 0
        self.fenced = False
        self.superseded = False
        # A HEAD write whose outcome is unknown (HEAD could not be read back): settled first
        # by the next prepare(), so that its version is counted exactly once.
        self._pending: Head | None = None

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def version(self) -> int:
        """The latest version known to be committed (0 for an empty store)."""
        return self.head.version if self.head else 0

    def lineage_for_commit(self) -> str:
        """The lineage the next version carries: HEAD's, or a new one when HEAD has none (an
        empty store, or a schema-1 store): SPEC §5, *Lineage*. Call once per version."""
        if self.head is not None and self.head.lineage is not None:
            return self.head.lineage
        return new_lineage()

    def open(self, *, takeover: bool) -> None:
        """Read HEAD; with ``takeover``, claim the store (fencing older publishers).

        An empty store is claimed too, by creating HEAD at version 0 with no manifest (SPEC §4):
        otherwise two publishers opened on it would share epoch 0 and never fence each other.

        Raises:
            FencedError: another publisher claimed the store between our read and our claim.
        """
        current = self.history.read_head()
        self.head = current[0] if current else None
        self.head_etag = current[1] if current else None
        self.epoch = self.head.epoch if self.head else 0
        if takeover:
            self.claim()

    def check_can_commit(self) -> None:
        """Raise FencedError once a newer publisher has claimed the store."""
        if self.fenced:
            raise FencedError(f"publisher {self.writer_id} was fenced from {self.url} by a newer publisher")

    def head_is_current(self) -> bool:
        """Read HEAD: True when it still holds the version this publisher last wrote or read
        (an index-only change aside), i.e. a state equal to that version needs no commit.

        Raises:
            FencedError: a newer publisher has claimed the store.
            StorageError: HEAD could not be read.
        """
        self.check_can_commit()
        current = self.history.read_head()
        if current is None:
            return self.head is None
        head = current[0]
        if head.epoch > self.epoch:
            self.fenced = True
            raise FencedError(
                f"publisher {self.writer_id} (epoch {self.epoch}) was fenced from {self.url}: "
                f"publisher {head.writer} took over at epoch {head.epoch} (head version {head.version}); "
                "open a new Publisher to continue"
            )
        return self._index_only_change(head)

    def prepare(self) -> bool:
        """Before building a new version: raise if fenced, settle an earlier unknown outcome.

        Returns:
            True when :attr:`head` moved under the caller (our earlier commit had landed after
            all, or another writer committed): the caller's reference copy is stale.

        Raises:
            FencedError: a newer publisher claimed the store.
            CommitUnknownError: HEAD is still unreadable, so the earlier outcome is unknown.
        """
        self.check_can_commit()
        if self._pending is None:
            return False
        pending = self._pending
        current = read_head_back(self.history, lambda last: self._unknown(pending, None, last))  # raises while unreadable
        self._pending = None
        if self._landed(current, pending, is_commit=True):
            logger.warning("the commit of version %d (%s), reported unknown, had landed", pending.version, pending.commit_id)
            self._adopt_landed(current, pending)
            self.check_can_commit()
            return True
        if self._unchanged(current):
            logger.info("the commit of version %d (%s), reported unknown, had not landed", pending.version, pending.commit_id)
            return False
        if current is not None and current[0].epoch > self.epoch:
            self._on_conflict(*current)  # raises FencedError
        self.head, self.head_etag = current if current is not None else (None, None)  # None: HEAD deleted
        return True

    def claim(self) -> None:
        """Take the store over: HEAD's epoch + 1 fences every older publisher (SPEC §5)."""
        for attempt in range(CLAIM_ATTEMPTS):
            if self.head is None:
                claimed = Head(
                    version=0, manifest=None, manifest_sha256=None, commit_id=new_commit_id(),
                    writer=self.writer_id, epoch=1, updated=now(), lineage=new_lineage(),
                )
            else:
                claimed = self.head.model_copy(update={
                    "schema_": SCHEMA_VERSION,  # HEAD is written in this release's schema
                    "epoch": self.head.epoch + 1,
                    "writer": self.writer_id,
                    "commit_id": new_commit_id(),
                    "updated": now(),
                    "lineage": self.lineage_for_commit(),
                })
            try:
                self._cas_head(claimed)
                break
            except FencedError:
                raise  # another publisher claimed it first
            except ConflictError:
                # The publisher being replaced committed between our read and our CAS (it is
                # still running: the reason to take over). _cas_head re-read HEAD: claim that.
                if attempt == CLAIM_ATTEMPTS - 1:
                    raise
        self.epoch = claimed.epoch
        logger.info("claimed %s at version %d with epoch %d", self.url, claimed.version, claimed.epoch)

    def commit(self, head: Head, *, deadline: float | None = None) -> None:
        """Make ``head`` (a new version) current by CAS; see SPEC §5 step 6.

        When the CAS fails because another writer changed only HEAD's ``index`` (GC, the
        compactor, ``pin``: HEAD's version, manifest, commit id and epoch are still those of
        our base), the CAS is retried against the new HEAD carrying its ``index`` (design 005
        D4; at most :data:`REBASE_ATTEMPTS` times).

        Args:
            head: the new HEAD (its ``index`` is the base HEAD's).
            deadline: :func:`attempt_clock` value after which no HEAD write may be sent (the
                attempt's ``max_attempt_s`` after its first write, design 005 D3); None: none.

        Returns only when the version is committed (also when our write landed but its
        response was lost, or a retry of it failed); :attr:`head` is then the HEAD written
        (with the newer ``index`` after a rebase).

        Raises:
            CommitAbandonedError: the deadline passed before a HEAD write; nothing was
                committed, HEAD is as it was (a later publish is a new attempt).
            ConflictError: another writer of our epoch committed first (or HEAD's index kept
                changing); nothing was committed.
            FencedError: a newer publisher claimed the store; nothing was committed.
            CommitUnknownError: the write failed unclearly and HEAD could not be read back.
            StorageError: the write failed and HEAD is as it was; nothing was committed.
        """
        for attempt in range(REBASE_ATTEMPTS + 1):
            self._check_deadline(head, deadline)
            rebased = self._cas_head(head, is_commit=True, rebase=attempt < REBASE_ATTEMPTS)
            if rebased is None:
                return
            logger.info("HEAD's index changed under commit %s (version %d): retrying on the new index", head.commit_id, head.version)
            head = rebased
        raise AssertionError("unreachable: the last try does not rebase")  # pragma: no cover

    def _check_deadline(self, head: Head, deadline: float | None) -> None:
        if deadline is None:
            return
        late = attempt_clock() - deadline
        if late > 0:
            raise CommitAbandonedError(
                f"the commit attempt {head.commit_id} of version {head.version} to {self.url} ran {late:.1f} s past its "
                "deadline (max_attempt_s) before writing HEAD, so it was abandoned: GC may already have collected its "
                "objects. Nothing was committed; publish again (a new attempt)",
                version=head.version,
                commit_id=head.commit_id,
            )

    # --- internals -------------------------------------------------------------------------

    def _cas_head(self, new: Head, *, is_commit: bool = False, rebase: bool = False) -> Head | None:
        """CAS HEAD to ``new``; ``is_commit`` for a new version (a claim reuses the old one).

        Returns None once settled, or (with ``rebase``) ``new`` carrying the index of a HEAD
        that changed only its index, to be written next against :attr:`head_etag`."""
        try:
            write = cas_head(self.store, self.history, new, self.head_etag,
                             lambda error, last: self._unknown(new, error, last))
        except CommitUnknownError:
            if is_commit:
                self._pending = new  # settled first by the next prepare()
            raise
        if write.written:
            self.head, self.head_etag = new, write.etag
            return None
        assert write.error is not None
        return self._settle(new, write, is_commit=is_commit, rebase=rebase)

    def _settle(self, new: Head, write: HeadWrite, *, is_commit: bool, rebase: bool = False) -> Head | None:
        """Decide a failed HEAD write from HEAD as read back (SPEC §5 step 6); returns a head
        to retry with when only HEAD's index changed (design 005 D4, step 6a)."""
        current, error = write.current, write.error
        if self._landed(current, new, is_commit=is_commit):
            assert current is not None
            logger.warning("HEAD write for commit %s failed (%s) but had landed; treating as success", new.commit_id, error)
            self._adopt_landed(current, new)
            return None
        if is_commit and current is not None and not self._unchanged(current) and self._index_only_change(current[0]):
            # GC, the compactor or a pin rewrote HEAD's index and nothing else: our base is
            # still HEAD's version, so our commit stays valid on top of the new index (step 6a).
            self.head, self.head_etag = current
            if rebase:
                return new.model_copy(update={"index": current[0].index})
            raise ConflictError(
                f"HEAD's index in {self.url} changed {REBASE_ATTEMPTS + 1} times during the commit of version {new.version} "
                "(another writer rewrites it in a loop); nothing was committed, publish again",
                head_version=current[0].version,
                head_writer=current[0].writer,
            ) from error
        if self._unchanged(current):
            # Nothing landed and nobody else wrote: the store is as it was.
            if write.precondition:
                raise StorageError(
                    f"{self.url} refused the HEAD write of version {new.version} as a conflict ({error}), "
                    "but HEAD is unchanged (an HTTP 409 or a misbehaving endpoint); nothing was committed, publish again"
                ) from error
            assert error is not None
            raise error
        self._on_conflict(current[0] if current else None, current[1] if current else None)

    def _unknown(self, new: Head, error: Exception | None, last: Exception | None) -> CommitUnknownError:
        """The error of a HEAD write whose outcome cannot be settled: HEAD is unreadable."""
        cause = f" after: {error}" if error is not None else ""
        return CommitUnknownError(
            f"the outcome of the HEAD write of version {new.version} (commit {new.commit_id}) to {self.url} is unknown{cause}; "
            f"HEAD could not be read back ({last}). It may or may not be committed: the next publish by this "
            "publisher settles it first; a new publisher or reader sees one or the other, never a mix",
            version=new.version,
            commit_id=new.commit_id,
        )

    def _landed(self, current: tuple[Head, str] | None, new: Head, *, is_commit: bool) -> bool:
        """True when ``new`` is in HEAD's history: HEAD is it, names its manifest (a takeover
        copied it) or has it on its chain below (another writer committed on top)."""
        if current is None:
            return False
        head = current[0]
        if head.commit_id == new.commit_id:
            return True
        if not is_commit or new.manifest is None:
            return False
        return head.manifest == new.manifest or self._landed_below(head, new)

    def _adopt_landed(self, current: tuple[Head, str], new: Head) -> None:
        head = current[0]
        self.head, self.head_etag = current
        if head.commit_id != new.commit_id and head.manifest != new.manifest:
            # Another writer has already committed on top: our reference is not the head's.
            logger.warning("commit %s landed as version %d; %s has committed on top of it", new.commit_id, new.version, head.writer)
            self.superseded = True
        if head.epoch > new.epoch:
            # Committed, but a newer publisher has claimed the store since: fenced from now on.
            # (Compared with the epoch our write carried: a claim that landed is not a fence.)
            logger.warning("commit %s landed; publisher %s has since taken %s over (epoch %d)", new.commit_id, head.writer, self.url, head.epoch)
            self.fenced = True

    def _index_only_change(self, head: Head) -> bool:
        """``head`` differs from our base HEAD at most in ``index`` and ``updated`` (the fields
        an index-only writer may change, design 005 D4)."""
        base = self.head
        if base is None:
            return False
        return (head.version, head.manifest, head.commit_id, head.epoch) == (base.version, base.manifest, base.commit_id, base.epoch)

    def _unchanged(self, current: tuple[Head, str] | None) -> bool:
        """HEAD is still what our write was conditioned on."""
        if current is None:
            return self.head_etag is None
        return current[1] == self.head_etag

    def _landed_below(self, head: Head, new: Head) -> bool:
        """True when the version ``new`` commits is on ``head``'s chain, below it."""
        if new.manifest is None or head.version <= new.version or head.manifest == new.manifest:
            return False
        try:
            key, _ = self.history.find(new.version, head)
        except DeltastoreError:
            return False
        return key == new.manifest

    def _on_conflict(self, head: Head | None, etag: str | None) -> None:
        version = head.version if head else None
        writer = head.writer if head else None
        if head is not None and head.epoch > self.epoch:
            self.fenced = True
            raise FencedError(
                f"publisher {self.writer_id} (epoch {self.epoch}) was fenced from {self.url}: "
                f"publisher {writer} took over at epoch {head.epoch} (head version {version}); open a new Publisher to continue",
                head_version=version,
                head_writer=writer,
            )
        # Another publisher of the same epoch committed first. The caller's reference no longer
        # matches HEAD: the next publish resumes from the new head (or writes an anchor).
        self.head, self.head_etag = head, etag
        raise ConflictError(
            f"another writer ({writer}) committed version {version} to {self.url} first; nothing was committed, "
            "the next publish will build on that version",
            head_version=version,
            head_writer=writer,
        )
