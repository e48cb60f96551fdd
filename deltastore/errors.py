"""The one error tree of deltastore.

Every error names the object it is about and, where there is one, what to do. Leaves also
inherit the closest builtin so that ``except KeyError`` and friends keep working::

    DeltastoreError
    ├── StorageError
    │   ├── UnsupportedURLError (ValueError)      unknown scheme / malformed URL
    │   ├── InvalidKeyError (ValueError)          a key that could escape the store's root
    │   ├── BucketNotFoundError                   the bucket (or root directory) does not exist
    │   ├── AccessDeniedError (PermissionError)   credentials missing or rejected
    │   ├── NotFoundError (KeyError)              an object is missing
    │   ├── PreconditionFailedError               a conditional write lost
    │   │   └── AlreadyExistsError (FileExistsError)   create-only target exists
    │   ├── ConcurrentWriteError                  409s on a write persisted through retries
    │   ├── UploadCorruptedError                  an upload kept arriving altered
    │   ├── UnsafeStoreError                      the endpoint ignores conditional writes
    │   ├── CommitUnknownError                    HEAD written, outcome unknown (HEAD unreadable)
    │   └── DeadlineExceededError (TimeoutError)  a poll, fetch or commit stalled past its deadline
    ├── ConflictError                             another writer committed first
    │   ├── FencedError                           this writer was superseded
    │   ├── HistoryReplacedError                  the store's history is not the one held
    │   └── MirrorLineageError                    a mirror's destination holds another history
    ├── CommitAbandonedError (TimeoutError)       an attempt passed its deadline before HEAD
    ├── IntegrityError (ValueError)               bytes disagree with their digest or size
    │   ├── CorruptObjectError                    unparseable / truncated object
    │   ├── SignatureError                        manifest unsigned / untrusted / bad signature
    │   │   └── UnsignedVersionError              an unsigned version on top of signed ones
    │   ├── TargetModifiedError                   the target no longer holds the version pulled
    │   └── WrongBaseError                        a site's result is against another base (federated)
    ├── FormatError (ValueError)                  something this version cannot read
    │   ├── UnsupportedSchemaError
    │   │   └── BaseElsewhereError                a based version read without its base's store
    │   ├── CompressedVersionError                a compressed site result read by a lossless reader
    │   ├── UnknownCodecError
    │   └── UnknownFormatError                    a serving format nobody defined or nobody published
    ├── InvalidStateDictError (ValueError)        a state dict deltastore cannot publish
    │   └── LayoutMismatchError                   names/shapes/dtypes differ from the base
    │       ├── ShardMismatchError                ranks of a sharded publish disagree (layout, step, version)
    │       ├── SiteLayoutError                   a site's result has another layout (federated)
    │       ├── SelectionError                    a partial pull's selection does not fit the layout
    │       └── AdapterMismatchError              an adapter whose config does not fit the base model
    ├── PartFailedError                           another rank of a sharded publish failed: nothing committed
    ├── QuorumError (TimeoutError)                a federated round missed its quorum by the deadline
    ├── SigningRequiredError (ValueError)         a publisher without a key on a signed store
    ├── VersionNotFoundError (LookupError)        no such version in the store
    │   ├── VersionCollectedError                 below the retention floor and not pinned
    │   └── HeadRolledBackError                   HEAD names a version older than the one held
    ├── WaitTimeoutError (TimeoutError)           no version (≥ the one asked for) appeared in time
    ├── GCAbortedError                            GC stopped before deleting (or partway): see why
    ├── GCRefusedError (ValueError)               GC will not run: unsafe grace, store without clock
    ├── StaleStageError (ValueError)              a staged update prepared for another held version
    ├── WorkerCacheError (OSError)                a worker cache directory unusable, or a save failed
    │   ├── NodeCacheError                        a node cache directory (fleet.nodecache) unusable
    │   └── SharedCopyError                       a shared host copy's directory unusable, or no room
    ├── VersionSkippedError                       an async publish replaced by a newer one
    ├── DevServerError (RuntimeError)             a local S3 server (deltastore.devserver) did not start
    ├── EngineUpdateError                         an inference engine refused a weight or adapter update
    ├── MetricsUnavailableError (ImportError)     metrics asked for without prometheus-client
    └── MetricsPortInUseError (OSError)           the metrics exporter's port is taken
"""

from __future__ import annotations


class DeltastoreError(Exception):
    """Base class of every error raised by deltastore."""


# --- storage -------------------------------------------------------------------------------


class StorageError(DeltastoreError):
    """An object store operation failed."""


class UnsupportedURLError(StorageError, ValueError):
    """The store URL has a scheme or form deltastore cannot open."""


class InvalidKeyError(StorageError, ValueError):
    """A key is empty, absolute, has ``.``/``..``/empty segments, or uses a reserved name."""


class BucketNotFoundError(StorageError):
    """The bucket (or the root directory of a local store) does not exist."""


class AccessDeniedError(StorageError, PermissionError):
    """The store rejected our credentials (or found none)."""


class NotFoundError(StorageError, KeyError):
    """An object does not exist in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class PreconditionFailedError(StorageError):
    """A conditional write (create-only or if-match) found the object in another state."""


class AlreadyExistsError(PreconditionFailedError, FileExistsError):
    """A create-only write found the key already present."""


class ConcurrentWriteError(StorageError):
    """The server kept answering 409 (``ConditionalRequestConflict``) to a write.

    Not a precondition failure: nothing says the object exists or changed, only that another
    write to the same key was in flight. The write did not happen (or its outcome is unknown);
    read the key back before deciding what to do.
    """


class UploadCorruptedError(StorageError):
    """An upload's bytes kept arriving altered: the server rejected its checksum (``BadDigest``)
    or stored other bytes than were sent, on every attempt."""

    @classmethod
    def stored_altered(cls, name: str, attempts: int, detail: str, removed: bool) -> UploadCorruptedError:
        """The server stored other bytes than were sent on each of ``attempts`` uploads of
        ``name`` (``detail``: the digests that differ); ``removed``: the damaged object was
        deleted (a create-only write's own object)."""
        return cls(f"{name} was stored with other bytes than were sent on each of {attempts} attempts ({detail}); "
                   + ("the damaged object was deleted" if removed else "the object there is damaged")
                   + "; check the network path and write it again")

    @classmethod
    def unreplaceable(cls, name: str, detail: str = "") -> UploadCorruptedError:
        """``name`` arrived altered and the rewrite of exactly that damaged object lost its
        condition (someone changed it meanwhile)."""
        why = f"({detail})" if detail else "(someone changed it meanwhile)"
        return cls(f"{name} arrived altered and could not be replaced with the right bytes {why}; "
                   "read it back before trusting it")


class UnsafeStoreError(StorageError):
    """The store's endpoint does not honour conditional writes, so concurrent publishers could
    fork history (see :func:`deltastore.storage.probe.require_atomic_writes`)."""
class CommitUnknownError(StorageError):
    """A HEAD write failed unclearly and HEAD could not be read back to tell whether it landed.

    The version may or may not be committed. The same publisher's next ``publish`` reads HEAD
    first and settles it (a landed version is counted once, a lost one is not counted), so a
    step is never lost or doubled; a reader sees either the old or the new HEAD, never a mix.

    Attributes:
        version: the version whose commit is in doubt.
        commit_id: the commit id stamped on that HEAD write.
    """

    def __init__(self, message: str, *, version: int | None = None, commit_id: str | None = None):
        super().__init__(message)
        self.version = version
        self.commit_id = commit_id


class DeadlineExceededError(StorageError, TimeoutError):
    """A phase of moving a version (a HEAD poll, a fetch, a commit) ran past its deadline
    (:class:`deltastore.fleet.deadlines.Deadlines`); the request was abandoned, and a follower
    keeps its version and retries with backoff.

    Attributes:
        phase: ``"poll"``, ``"fetch"``, ``"decode"``, ``"apply"``, ``"commit"`` or ``"round"``.
        object: what the phase was working on (a key of the store, a version).
        deadline_s: the deadline that passed, in seconds.
    """

    def __init__(self, message: str, *, phase: str = "", object: str = "", deadline_s: float = 0.0):
        super().__init__(message)  # keyword defaults: an error rebuilt from its message (pickle) still works
        self.phase = phase
        self.object = object
        self.deadline_s = deadline_s


# --- commit protocol ------------------------------------------------------------------------


class ConflictError(DeltastoreError):
    """Another writer committed to the store first; this commit was not made.

    Attributes:
        head_version: the version HEAD pointed to when the conflict was detected (or None).
        head_writer: the writer id recorded in that HEAD (or None).
    """

    def __init__(self, message: str, *, head_version: int | None = None, head_writer: str | None = None):
        super().__init__(message)
        self.head_version = head_version
        self.head_writer = head_writer


class FencedError(ConflictError):
    """A newer publisher took over this store; this publisher may no longer commit."""


class HistoryReplacedError(ConflictError):
    """The store's history is no longer the one this subscriber holds a version of.

    HEAD was deleted (or the store restored) and another run published under the same URL:
    its versions do not continue the held one, so nothing can be fast-forwarded. Open a new
    Subscriber or call ``pull()`` to read the new history.
    """


class MirrorLineageError(ConflictError):
    """A mirror's destination holds another history than its source (another lineage, or a
    version of the same lineage that is not on the source's chain): nothing was copied or
    written. Point the mirror at an empty store, or at a mirror of this source.
    """


class CommitAbandonedError(DeltastoreError, TimeoutError):
    """A commit attempt ran past its deadline (``max_attempt_s``, design 005 D3) before its HEAD
    write, so it was abandoned: HEAD was not written and nothing was committed.

    GC may collect the attempt's objects once they are older than its grace period, which
    exceeds the deadline; committing after the deadline could therefore name deleted objects.
    Publish again: the retry is a new attempt whose objects are written under new keys.

    Attributes:
        version: the version the abandoned attempt was for.
        commit_id: the abandoned attempt's id.
        elapsed_s: seconds since just before the attempt's first write.
    """

    def __init__(self, message: str, *, version: int | None = None, commit_id: str | None = None,
                 elapsed_s: float | None = None):
        super().__init__(message)
        self.version = version
        self.commit_id = commit_id
        self.elapsed_s = elapsed_s


# --- integrity and format -------------------------------------------------------------------


class IntegrityError(DeltastoreError, ValueError):
    """Bytes read (or produced by applying a delta) disagree with their recorded digest or size."""


class CorruptObjectError(IntegrityError):
    """An object cannot be parsed: truncated, garbled or inconsistent with its manifest."""


class SignatureError(IntegrityError):
    """A manifest lacks a valid signature by a trusted key (SPEC §3.1).

    Raised only by subscribers configured with ``trusted_keys``: the manifest is unsigned,
    names a key that is not trusted, or its signature does not verify.
    """


class UnsignedVersionError(SignatureError):
    """An unsigned manifest on a store whose earlier versions of the same history are signed
    by a trusted key: a publisher without the signing key published to a signed store (one
    that passed ``allow_unsigned=True``, or a release that did not refuse it)."""


class TargetModifiedError(IntegrityError):
    """The target's bits are not those of the version the subscriber holds: someone else wrote
    it since it was pulled (a caller's bug, not the store's: pull() it again)."""


class FormatError(DeltastoreError, ValueError):
    """The store holds something this version of deltastore cannot read."""


class UnsupportedSchemaError(FormatError):
    """A HEAD or manifest has a schema version this deltastore does not know."""


class BaseElsewhereError(UnsupportedSchemaError):
    """A based version (design 009) was read as if its store held its base: its segments
    apply to a version of another store. Read it with :mod:`deltastore.federated`."""


class CompressedVersionError(FormatError):
    """A based version is compressed (SPEC §14.1: a lossy approximation of a site's change) and
    its reader did not opt in to compressed results (``ResultPolicy(accept_compressed=True)``)."""


class UnknownCodecError(FormatError):
    """A blob segment names a codec (or codec version) this deltastore does not know."""


# --- user input ---------------------------------------------------------------------------


class UnknownFormatError(FormatError):
    """A serving format (SPEC §15) that deltastore does not define, or that the store's version
    does not carry; the message lists the formats that exist."""

    def __init__(self, message: str, *, available: tuple[str, ...] = ()):
        super().__init__(message)
        self.available = available


class InvalidStateDictError(DeltastoreError, ValueError):
    """A state dict holds something that cannot be published (not a tensor, sparse, ...)."""


class LayoutMismatchError(InvalidStateDictError):
    """Tensor names, shapes or dtypes differ from the version this one is based on."""


class ShardMismatchError(LayoutMismatchError):
    """The ranks of a sharded publish disagree (design 010): on a tensor's dtype or shape, on
    who owns which rows (a gap or an overlap), on the step, or on the version they hold.
    Raised on every rank; nothing was written."""


class AdapterMismatchError(LayoutMismatchError):
    """A LoRA adapter whose config or tensors do not fit the base model it is applied to."""


class PartFailedError(DeltastoreError):
    """Another rank of a sharded publish failed (or was lost) before the version was committed
    (design 010): nothing was committed; the rank that failed raised the cause itself."""


class SelectionError(LayoutMismatchError):
    """A partial pull's selection (deltastore.layout.select) does not fit the store's layout, or the
    target does not hold what it selects."""


class WrongBaseError(IntegrityError):
    """A site's result was computed against another base than the round's (design 009): it is
    refused, named, and the round goes on without it."""


class SiteLayoutError(LayoutMismatchError):
    """A site's result has another layout than the round's base (design 009): refused, named."""


class QuorumError(DeltastoreError, TimeoutError):
    """A federated round's deadline passed with fewer accepted site results than its quorum;
    nothing was published."""


class VersionNotFoundError(DeltastoreError, LookupError):
    """The requested version does not exist in the store (or the store is empty)."""


class SigningRequiredError(DeltastoreError, ValueError):
    """A publisher without a signing key was opened on (or about to publish to) a store whose
    head version is signed: its versions would be refused by every subscriber that trusts the
    store's key. Nothing was written. Pass the store's ``signing_key``, or ``allow_unsigned=True``
    to publish unsigned versions anyway."""


class HeadRolledBackError(VersionNotFoundError):
    """HEAD names an older version of the held history than the one this subscriber holds
    (restored from a backup, a lagging mirror, or rolled back by a party with write access).
    Nothing was applied: a subscriber never goes backwards (``pull(version)`` reads an older
    version on purpose)."""


class WaitTimeoutError(DeltastoreError, TimeoutError):
    """:meth:`Subscriber.wait_for_version <deltastore.Subscriber.wait_for_version>` waited its
    whole timeout and the store has no committed version (or none as new as asked for)."""


class VersionCollectedError(VersionNotFoundError):
    """The version was below the store's retention floor and not pinned: GC may have deleted
    it (SPEC §11). Pull the latest version, or a version ≥ ``floor``, or one of ``pins``.

    Attributes:
        version: the version asked for.
        floor: the index's floor (every version in [floor, head] is readable).
        pins: the pinned versions below the floor, sorted.
    """

    def __init__(self, message: str, *, version: int, floor: int, pins: tuple[int, ...] | list[int] | set[int] = ()):
        super().__init__(message)
        self.version = version
        self.floor = floor
        self.pins = tuple(sorted(pins))


class GCAbortedError(DeltastoreError):
    """A garbage-collection run stopped: a listing or a needed read failed, HEAD changed
    lineage or schema, or a delete failed. Nothing kept was touched; run GC again.

    Attributes:
        deleted: how many objects this run had deleted before stopping (0 when it aborted
            before its delete phase).
    """

    def __init__(self, message: str, *, deleted: int = 0):
        super().__init__(message)
        self.deleted = deleted


class GCRefusedError(DeltastoreError, ValueError):
    """GC refused to start: its grace period is shorter than the writers' attempt deadline
    plus the clock margin (SPEC §11), or the store cannot report last-modified times (GC ages
    objects on the store's clock). Nothing was deleted."""


class VersionSkippedError(DeltastoreError):
    """An asynchronous publish was never made: a newer snapshot replaced it (policy "latest")."""


class StaleStageError(DeltastoreError, ValueError):
    """A staged update was prepared against another held version (or another subscriber's);
    swapping it would mix versions. Stage again."""


class WorkerCacheError(DeltastoreError, OSError):
    """A worker cache directory (:class:`deltastore.read.cache.WorkerCache`) cannot be used (a file,
    not writable), or a state could not be saved in it (disk full). Saving removes its partial
    files first and keeps the previous cached version; a follower logs it and goes on."""


class NodeCacheError(WorkerCacheError):
    """A node cache directory (:class:`deltastore.fleet.nodecache.NodeCacheStore`) cannot be used:
    not creatable or not writable, or a platform without ``flock``. Raised when the cache is
    opened; a cache that fails later is logged and the store is read directly."""


class SharedCopyError(WorkerCacheError):
    """A shared host copy's directory (:mod:`deltastore.integrations.sharedcopy`) cannot be used:
    not creatable, a platform without ``flock``, another store's copy in it, or no room for the
    weights on its filesystem (raised before anything is mapped)."""


class DevServerError(DeltastoreError, RuntimeError):
    """A local S3 server of :mod:`deltastore.devserver` did not start; the message names the
    command and carries the tail of its log."""


class EngineUpdateError(DeltastoreError):
    """An inference engine (vLLM, SGLang) refused or failed a weight or adapter update.

    The helper that raised it left the engine serving what it served before (the message says
    which version), unless the message says the engine's state is unknown.
    """


class MetricsUnavailableError(DeltastoreError, ImportError):
    """Metrics were asked for (``metrics_port=``, ``--metrics-port``) but the
    ``prometheus-client`` package is not installed: ``pip install 'deltastore-weights[metrics]'``."""


class MetricsPortInUseError(DeltastoreError, OSError):
    """The metrics exporter could not listen on its port (another process holds it); nothing
    was fetched. Pick another port, or stop the other exporter."""


__all__ = [
    "AccessDeniedError",
    "AdapterMismatchError",
    "AlreadyExistsError",
    "BucketNotFoundError",
    "CommitUnknownError",
    "CompressedVersionError",
    "ConcurrentWriteError",
    "ConflictError",
    "CorruptObjectError",
    "DeadlineExceededError",
    "DeltastoreError",
    "DevServerError",
    "EngineUpdateError",
    "FencedError",
    "FormatError",
    "GCAbortedError",
    "GCRefusedError",
    "HeadRolledBackError",
    "HistoryReplacedError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidStateDictError",
    "LayoutMismatchError",
    "MetricsPortInUseError",
    "MetricsUnavailableError",
    "MirrorLineageError",
    "NodeCacheError",
    "SharedCopyError",
    "NotFoundError",
    "PreconditionFailedError",
    "SignatureError",
    "SigningRequiredError",
    "StaleStageError",
    "StorageError",
    "TargetModifiedError",
    "UnknownCodecError",
    "UnknownFormatError",
    "UnsafeStoreError",
    "UnsignedVersionError",
    "UnsupportedSchemaError",
    "UnsupportedURLError",
    "UploadCorruptedError",
    "VersionCollectedError",
    "VersionNotFoundError",
    "VersionSkippedError",
    "WaitTimeoutError",
    "WorkerCacheError",
]
