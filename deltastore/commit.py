"""The HEAD commit protocol (SPEC §5): claim, compare-and-swap, lost responses, fencing.

One :class:`CommitProtocol` per publisher holds what the protocol needs between commits: the
HEAD it last saw (and that HEAD's ETag, the CAS token), its writer id and its epoch. Lifecycle::

    proto = CommitProtocol(store, history, writer_id)
    proto.open(takeover=True)        # read HEAD; claim the store (epoch + 1) if asked
    ...                              # build a manifest on proto.head / proto.epoch
    proto.commit(new_head)           # CAS HEAD; a lost response counts as success
    proto.fenced                     # True once a newer publisher claimed the store

Everything here is metadata; packs and manifests are written by :mod:`deltastore.publish`.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone

from deltastore.errors import ConflictError, DeltastoreError, FencedError, PreconditionFailedError
from deltastore.history import History
from deltastore.manifest import HEAD_KEY, Head, dump
from deltastore.storage.base import IfMatch, Store

logger = logging.getLogger(__name__)

#: Tries to claim a store whose current publisher keeps committing: each try loses only to a
#: commit that landed during one HEAD round trip.
CLAIM_ATTEMPTS = 16


def now() -> str:
    """RFC 3339 UTC time with milliseconds, as HEAD and manifests record it."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_commit_id() -> str:
    """A unique id stamped on each HEAD write, to recognise it when read back."""
    return uuid.uuid4().hex


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

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def version(self) -> int:
        """The latest version known to be committed (0 for an empty store)."""
        return self.head.version if self.head else 0

    def open(self, *, takeover: bool) -> None:
        """Read HEAD; with ``takeover``, claim the store (fencing older publishers)."""
        current = self.history.read_head()
        self.head = current[0] if current else None
        self.head_etag = current[1] if current else None
        self.epoch = self.head.epoch if self.head else 0
        if takeover and self.head is not None:
            self.claim()

    def check_can_commit(self) -> None:
        """Raise FencedError once a newer publisher has claimed the store."""
        if self.fenced:
            raise FencedError(f"publisher {self.writer_id} was fenced from {self.url} by a newer publisher")

    def claim(self) -> None:
        """Take the store over: HEAD's epoch + 1 fences every older publisher (SPEC §5)."""
        for attempt in range(CLAIM_ATTEMPTS):
            assert self.head is not None and self.head_etag is not None
            claimed = self.head.model_copy(update={
                "epoch": self.head.epoch + 1,
                "writer": self.writer_id,
                "commit_id": new_commit_id(),
                "updated": now(),
            })
            try:
                self._cas_head(claimed)
                break
            except FencedError:
                raise  # another publisher claimed it first
            except ConflictError:
                # The publisher being replaced committed between our read and our CAS (it is
                # still running: the reason to take over). _cas_head re-read HEAD: claim that.
                if self.head is None or attempt == CLAIM_ATTEMPTS - 1:
                    raise
        self.epoch = claimed.epoch
        logger.info("claimed %s at version %d with epoch %d", self.url, claimed.version, claimed.epoch)

    def commit(self, head: Head) -> None:
        """Make ``head`` (a new version) current by CAS; see SPEC §5 step 6.

        Raises:
            ConflictError: another writer of our epoch committed first; nothing was committed.
            FencedError: a newer publisher claimed the store; nothing was committed.
        """
        self._cas_head(head, is_commit=True)

    def _cas_head(self, new: Head, *, is_commit: bool = False) -> None:
        """CAS HEAD to ``new``; ``is_commit`` for a new version (a claim reuses the old one)."""
        mode = IfMatch(self.head_etag) if self.head_etag is not None else "create"
        try:
            meta = self.store.put(HEAD_KEY, dump(new), mode=mode)
        except PreconditionFailedError:
            current = self.history.read_head()
            if current is not None and current[0].commit_id == new.commit_id:
                # Lost response: our write landed, a retry of it saw itself (SPEC §5 step 6).
                logger.warning("HEAD write for commit %s reported a conflict but had landed; treating as success", new.commit_id)
                self.head, self.head_etag = current
                return
            if is_commit and current is not None and self._landed_below(current[0], new):
                # Our write landed, its response was lost, and another writer has already
                # committed on top of it: a success, but our reference is not the head's.
                logger.warning("commit %s landed as version %d; %s has committed on top of it", new.commit_id, new.version, current[0].writer)
                self.head, self.head_etag = current
                self.superseded = True
                return
            self._on_conflict(current[0] if current else None, current[1] if current else None)
        self.head, self.head_etag = new, meta.etag

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
