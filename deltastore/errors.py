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
    │   └── CommitUnknownError                    HEAD written, outcome unknown (HEAD unreadable)
    ├── ConflictError                             another writer committed first
    │   ├── FencedError                           this writer was superseded
    │   └── HistoryReplacedError                  the store's history is not the one held
    ├── IntegrityError (ValueError)               bytes disagree with their digest or size
    │   ├── CorruptObjectError                    unparseable / truncated object
    │   ├── SignatureError                        manifest unsigned / untrusted / bad signature
    │   └── TargetModifiedError                   the target no longer holds the version pulled
    ├── FormatError (ValueError)                  something this version cannot read
    │   ├── UnsupportedSchemaError
    │   └── UnknownCodecError
    ├── InvalidStateDictError (ValueError)        a state dict deltastore cannot publish
    │   └── LayoutMismatchError                   names/shapes/dtypes differ from the base
    ├── VersionNotFoundError (LookupError)        no such version in the store
    │   └── VersionCollectedError                 below the history index's floor, not pinned
    ├── StaleStageError (ValueError)              a staged update prepared for another held version
    └── VersionSkippedError                       an async publish replaced by a newer one
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


class TargetModifiedError(IntegrityError):
    """The target's bits are not those of the version the subscriber holds: someone else wrote
    it since it was pulled (a caller's bug, not the store's: pull() it again)."""


class FormatError(DeltastoreError, ValueError):
    """The store holds something this version of deltastore cannot read."""


class UnsupportedSchemaError(FormatError):
    """A HEAD or manifest has a schema version this deltastore does not know."""


class UnknownCodecError(FormatError):
    """A blob segment names a codec (or codec version) this deltastore does not know."""


# --- user input ---------------------------------------------------------------------------


class InvalidStateDictError(DeltastoreError, ValueError):
    """A state dict holds something that cannot be published (not a tensor, sparse, ...)."""


class LayoutMismatchError(InvalidStateDictError):
    """Tensor names, shapes or dtypes differ from the version this one is based on."""


class VersionNotFoundError(DeltastoreError, LookupError):
    """The requested version does not exist in the store (or the store is empty)."""


class VersionCollectedError(VersionNotFoundError):
    """The version was collected: it is below the history index's ``floor`` and not pinned
    (SPEC §11). Pull a version ≥ ``floor`` or one of ``pins``.

    Attributes:
        version: the version asked for.
        floor: the store's floor (every version from it to head is readable).
        pins: the pinned versions below the floor, which stay readable.
    """

    def __init__(self, message: str, *, version: int, floor: int, pins: tuple[int, ...] | list[int] = ()):
        super().__init__(message)
        self.version = version
        self.floor = floor
        self.pins = tuple(pins)


class VersionSkippedError(DeltastoreError):
    """An asynchronous publish was never made: a newer snapshot replaced it (policy "latest")."""


class StaleStageError(DeltastoreError, ValueError):
    """A staged update was prepared against another held version (or another subscriber's);
    swapping it would mix versions. Stage again."""


__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "BucketNotFoundError",
    "CommitUnknownError",
    "ConcurrentWriteError",
    "ConflictError",
    "CorruptObjectError",
    "DeltastoreError",
    "FencedError",
    "FormatError",
    "HistoryReplacedError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidStateDictError",
    "LayoutMismatchError",
    "NotFoundError",
    "PreconditionFailedError",
    "SignatureError",
    "StaleStageError",
    "StorageError",
    "TargetModifiedError",
    "UnknownCodecError",
    "UnsafeStoreError",
    "UnsupportedSchemaError",
    "UnsupportedURLError",
    "UploadCorruptedError",
    "VersionCollectedError",
    "VersionNotFoundError",
    "VersionSkippedError",
]
