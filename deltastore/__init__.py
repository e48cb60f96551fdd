"""deltastore: ship model weights from trainers to workers through object storage.

A :class:`Publisher` commits successive versions of a state dict to a store URL as small,
content-addressed, verified deltas; a :class:`Subscriber` anywhere polls, fetches only what
it lacks and fast-forwards its weights bit-exactly. Their settings are policies
(:class:`WriterPolicy`, :class:`AnchorPolicy`, :class:`LayoutPolicy`, :class:`AsyncPolicy`;
:class:`PollPolicy`, :class:`CachePolicy`, :class:`HeartbeatPolicy` for ``follow``). Every public
name is described in docs/api.md; the format is specified in docs/SPEC.md.
"""

from typing import TYPE_CHECKING, Any

from deltastore.errors import (
    AccessDeniedError,
    AdapterMismatchError,
    AlreadyExistsError,
    BucketNotFoundError,
    CommitAbandonedError,
    CommitUnknownError,
    CompressedVersionError,
    ConcurrentWriteError,
    ConflictError,
    CorruptObjectError,
    DeltastoreError,
    EngineUpdateError,
    FencedError,
    FormatError,
    HeadRolledBackError,
    HistoryReplacedError,
    IntegrityError,
    InvalidKeyError,
    InvalidStateDictError,
    LayoutMismatchError,
    NotFoundError,
    PartFailedError,
    PreconditionFailedError,
    ShardMismatchError,
    SignatureError,
    SigningRequiredError,
    StaleStageError,
    StorageError,
    TargetModifiedError,
    UnknownCodecError,
    UnknownFormatError,
    UnsafeStoreError,
    UnsignedVersionError,
    UnsupportedSchemaError,
    UnsupportedURLError,
    UploadCorruptedError,
    VersionNotFoundError,
    VersionSkippedError,
    WaitTimeoutError,
    WorkerCacheError,
)

if TYPE_CHECKING:
    from deltastore.lifecycle.gc import GCReport, collect
    from deltastore.format.history import VersionInfo
    from deltastore.write.policy import AnchorPolicy, AsyncPolicy, LayoutPolicy, WriterPolicy
    from deltastore.write.publisher import Publisher
    from deltastore.read.follow import CachePolicy, FollowRecord, HeartbeatPolicy, PollPolicy
    from deltastore.fleet.deadlines import Deadlines
    from deltastore.read.subscriber import Subscriber
    from deltastore.write.sharded import Rows, ShardedPublisher
    from deltastore.read.stage import StagedUpdate

__version__ = "0.2.0"

#: Public names whose modules import torch (~1.4 s), boto3 and pydantic: loaded on first
#: attribute access (PEP 562), so ``import deltastore`` and ``deltastore --help`` stay fast.
_LAZY = {
    "GCReport": "deltastore.lifecycle.gc",
    "collect": "deltastore.lifecycle.gc",
    "VersionInfo": "deltastore.format.history",
    "Publisher": "deltastore.write.publisher",
    "AnchorPolicy": "deltastore.write.policy",
    "AsyncPolicy": "deltastore.write.policy",
    "LayoutPolicy": "deltastore.write.policy",
    "WriterPolicy": "deltastore.write.policy",
    "FollowRecord": "deltastore.read.follow",
    "PollPolicy": "deltastore.read.follow",
    "CachePolicy": "deltastore.read.follow",
    "HeartbeatPolicy": "deltastore.read.follow",
    "Deadlines": "deltastore.fleet.deadlines",
    "Subscriber": "deltastore.read.subscriber",
    "StagedUpdate": "deltastore.read.stage",
    "ShardedPublisher": "deltastore.write.sharded",
    "Rows": "deltastore.write.sharded",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltastore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "AccessDeniedError",
    "AdapterMismatchError",
    "AlreadyExistsError",
    "AnchorPolicy",
    "AsyncPolicy",
    "BucketNotFoundError",
    "CachePolicy",
    "CommitAbandonedError",
    "CommitUnknownError",
    "CompressedVersionError",
    "ConcurrentWriteError",
    "ConflictError",
    "CorruptObjectError",
    "Deadlines",
    "DeltastoreError",
    "EngineUpdateError",
    "FencedError",
    "FollowRecord",
    "FormatError",
    "GCReport",
    "HeadRolledBackError",
    "HeartbeatPolicy",
    "HistoryReplacedError",
    "IntegrityError",
    "InvalidKeyError",
    "InvalidStateDictError",
    "LayoutMismatchError",
    "LayoutPolicy",
    "NotFoundError",
    "PartFailedError",
    "PollPolicy",
    "PreconditionFailedError",
    "Publisher",
    "Rows",
    "ShardMismatchError",
    "ShardedPublisher",
    "SignatureError",
    "SigningRequiredError",
    "StagedUpdate",
    "StaleStageError",
    "StorageError",
    "Subscriber",
    "TargetModifiedError",
    "UnknownCodecError",
    "UnknownFormatError",
    "UnsafeStoreError",
    "UnsignedVersionError",
    "UnsupportedSchemaError",
    "UnsupportedURLError",
    "UploadCorruptedError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionSkippedError",
    "WaitTimeoutError",
    "WorkerCacheError",
    "WriterPolicy",
    "collect",
]
