"""deltastore: ship model weights from trainers to workers through object storage.

A :class:`Publisher` commits successive versions of a state dict to a store URL as small,
content-addressed, verified deltas; a :class:`Subscriber` anywhere polls, fetches only what
it lacks and fast-forwards its weights bit-exactly. The format is specified in docs/SPEC.md.
"""

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CommitAbandonedError,
    ConcurrentWriteError,
    CommitUnknownError,
    ConflictError,
    CorruptObjectError,
    DeltastoreError,
    FencedError,
    FormatError,
    HistoryReplacedError,
    IntegrityError,
    InvalidKeyError,
    InvalidStateDictError,
    LayoutMismatchError,
    NotFoundError,
    PreconditionFailedError,
    SignatureError,
    StaleStageError,
    StorageError,
    TargetModifiedError,
    UnknownCodecError,
    UnsafeStoreError,
    UnsupportedSchemaError,
    UnsupportedURLError,
    UploadCorruptedError,
    VersionNotFoundError,
    VersionSkippedError,
)
from deltastore.gc import GCReport, collect
from deltastore.history import VersionInfo
from deltastore.publish import Publisher
from deltastore.pull import FollowRecord, Subscriber
from deltastore.stage import StagedUpdate

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "BucketNotFoundError",
    "CommitAbandonedError",
    "ConcurrentWriteError",
    "CommitUnknownError",
    "ConflictError",
    "CorruptObjectError",
    "DeltastoreError",
    "FencedError",
    "FollowRecord",
    "FormatError",
    "GCReport",
    "HistoryReplacedError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidStateDictError",
    "LayoutMismatchError",
    "NotFoundError",
    "PreconditionFailedError",
    "Publisher",
    "SignatureError",
    "StagedUpdate",
    "StaleStageError",
    "StorageError",
    "Subscriber",
    "TargetModifiedError",
    "UnknownCodecError",
    "UnsafeStoreError",
    "UnsupportedSchemaError",
    "UnsupportedURLError",
    "UploadCorruptedError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionSkippedError",
    "collect",
]
