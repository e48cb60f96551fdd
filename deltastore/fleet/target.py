"""The fleet target (SPEC §1.2): the version an operator wants every follower to hold.

One small mutable object, ``_deltastore/target.json``, next to HEAD. ``deltastore target URL
VERSION`` writes it; every follower reads it at each poll (a conditional GET, no body while it
is unchanged) and converges to the version it names, backwards too, as long as that version
has not been collected (:mod:`deltastore.read.converge` moves the followers). It is written
only by compare-and-swap, each write one ``generation`` above the one it replaces, and on a
signed store it is signed like a manifest, so that a party who can write the bucket but holds
no signing key cannot move a fleet backwards with it.

Three kinds of target:

- a version (``hold`` false): followers move to it and stay there until the trainer commits a
  version newer than HEAD was when the target was set (the newest version wins again);
- a version with ``hold``: followers stay at it however far HEAD moves, until the next target;
- none (``version`` null, written by ``--latest``): followers track HEAD.

Nothing here imports torch: ``deltastore target`` and ``deltastore status`` move no tensors.

Example::

    from deltastore.fleet.target import read_target, write_target
    from deltastore.storage import open_store

    with open_store("s3://bucket/run1") as store:
        write_target(store, 812, hold=True, signing_key="ops.pem")   # the fleet goes back to 812
        print(read_target(store))
        write_target(store, None)                                    # --latest: follow HEAD again
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltastore.errors import (
    ConflictError,
    CorruptObjectError,
    NotFoundError,
    PreconditionFailedError,
    SignatureError,
    SigningRequiredError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.format.keys import LINEAGE_PATTERN, StoreKey, digest_from_key, new_attempt_id
from deltastore.format.models import Head, Signature, dump
from deltastore.format.parse import check_int, unsupported_schema, validate
from deltastore.storage.base import GetResult, IfMatch, Store

if TYPE_CHECKING:
    from deltastore.format.history import History
    from deltastore.format.signing import KeyLike, TrustedKeys

logger = logging.getLogger(__name__)

#: The target's key: under the store's own prefix (SPEC §1.1), never collected, never a version.
TARGET_KEY = "_deltastore/target.json"
TARGET_FORMAT = "deltastore.target"
TARGET_SCHEMA = 1
#: A target is a few hundred bytes; anything larger is refused unread (a hostile object must
#: not cost every follower of the fleet a large GET at every poll).
MAX_TARGET_BYTES = 16 * 1024
#: How much of an operator's note a target keeps.
MAX_NOTE_CHARS = 256


class TargetDocument(BaseModel):
    """The stored form of the target (SPEC §1.2): canonical JSON, plain (not compressed)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    format: Literal["deltastore.target"] = TARGET_FORMAT
    schema_: int = Field(TARGET_SCHEMA, alias="schema")
    generation: int = Field(ge=1)
    version: int | None = Field(None, ge=1)
    manifest: StoreKey | None = None
    manifest_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    lineage: str = Field(pattern=LINEAGE_PATTERN)
    hold: bool = False
    head_version: int = Field(ge=0)
    target_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    writer: str = Field(max_length=128)
    created: str = Field(max_length=64)
    note: str = Field("", max_length=MAX_NOTE_CHARS)
    signature: Signature | None = None


@dataclass(frozen=True)
class FleetTarget:
    """The fleet target as read from a store.

    Attributes:
        version: the version followers should hold; None: no target (followers track HEAD).
        manifest, manifest_sha256: that version's manifest key and SHA-256 (None with no version).
        lineage: the history the target was set in (HEAD's lineage then).
        hold: followers stay at ``version`` however far HEAD moves.
        head_version: HEAD's version when the target was set; without ``hold`` the target
            applies until HEAD moves past it.
        generation: above the generation of the target it replaced: the larger of that plus
            one and the writer's clock in milliseconds since 1970, so that it also outranks
            every earlier target when the object was deleted in between.
        target_id: a random id of this write (tells a lost response from a concurrent write).
        writer, created, note: who wrote it, when (RFC 3339, the writer's clock) and why.
        signed_by: the key id of its signature (None: unsigned).
        etag: the ETag of the object read (the compare-and-swap of the next write).
    """

    version: int | None
    manifest: str | None
    manifest_sha256: str | None
    lineage: str
    hold: bool
    head_version: int
    generation: int
    target_id: str
    writer: str
    created: str
    note: str
    signed_by: str | None
    etag: str
    document: TargetDocument

    @property
    def latest(self) -> bool:
        """No version is targeted: followers track HEAD (what ``--latest`` writes)."""
        return self.version is None

    def applies(self, head: Head) -> bool:
        """Whether the target is in force under ``head``: it names a version of HEAD's lineage,
        and holds or HEAD has not moved past the version it had when the target was set."""
        if self.version is None or head.manifest is None or head.lineage != self.lineage:
            return False
        return self.hold or head.version <= self.head_version

    def describe(self) -> str:
        """One line for logs and ``deltastore status``."""
        if self.version is None:
            return f"latest (generation {self.generation})"
        how = "hold" if self.hold else f"until a version after {self.head_version}"
        signed = "unsigned" if self.signed_by is None else f"signed by {self.signed_by}"
        return f"version {self.version} ({how}; generation {self.generation}, {signed})"


def goal_version(target: FleetTarget | None, head: Head) -> int:
    """The version followers of ``head`` should hold: the target's while it applies, else
    HEAD's (0 for an empty store)."""
    if target is not None and target.applies(head):
        assert target.version is not None
        return target.version
    return head.version


def parse_target(data: bytes, etag: str = "", key: str = TARGET_KEY) -> FleetTarget:
    """Parse a target object.

    Raises:
        CorruptObjectError: not a target (too large, not JSON, a field out of range, a version
            without its manifest or a manifest key of another version).
        UnsupportedSchemaError: a target of another schema.
    """
    if len(data) > MAX_TARGET_BYTES:
        raise CorruptObjectError(f"fleet target {key!r} is {len(data)} bytes, over the {MAX_TARGET_BYTES}-byte limit")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptObjectError(f"fleet target {key!r} is not JSON: rewrite it with `deltastore target`") from None
    if not isinstance(doc, dict) or doc.get("format") != TARGET_FORMAT:
        raise CorruptObjectError(f"fleet target {key!r} is not a {TARGET_FORMAT} object")
    if doc.get("schema") != TARGET_SCHEMA:
        raise unsupported_schema("fleet target", key, doc.get("schema"), (TARGET_SCHEMA,))
    d: TargetDocument = validate(TargetDocument, doc, "fleet target", key)
    for name in ("generation", "version", "head_version"):
        check_int(getattr(d, name), name, "fleet target", key)
    if d.version is None:
        if d.manifest is not None or d.manifest_sha256 is not None or d.hold:
            raise CorruptObjectError(f"fleet target {key!r} names no version but a manifest or a hold")
    else:
        from deltastore.format.keys import manifest_key_version

        if d.manifest is None or manifest_key_version(d.manifest) != d.version \
                or d.manifest_sha256 != digest_from_key(d.manifest):
            raise CorruptObjectError(
                f"fleet target {key!r}: {d.manifest!r} is not the manifest key of version {d.version} "
                f"with SHA-256 {d.manifest_sha256!r}"
            )
    return FleetTarget(
        version=d.version, manifest=d.manifest, manifest_sha256=d.manifest_sha256, lineage=d.lineage, hold=d.hold,
        head_version=d.head_version, generation=d.generation, target_id=d.target_id, writer=d.writer,
        created=d.created, note=d.note, signed_by=None if d.signature is None else d.signature.key_id, etag=etag,
        document=d,
    )


def read_target(store: Store) -> FleetTarget | None:
    """The store's fleet target (None when none was ever set). Not verified: see
    :func:`verify_target`.

    Raises:
        CorruptObjectError, UnsupportedSchemaError: the object is not a target.
        StorageError: the store could not be read.
    """
    try:
        got = store.get_with_meta(TARGET_KEY)
    except NotFoundError:
        return None
    return parse_target(got.data, got.meta.etag)


def signed_bytes(d: TargetDocument) -> bytes:
    """What a target's signature covers: its canonical JSON with ``signature`` null (as a
    manifest's, SPEC §3.1)."""
    return dump(d.model_copy(update={"signature": None}))


def verify_target(target: FleetTarget, keys: TrustedKeys, url: str = "") -> None:
    """Raise SignatureError unless ``target`` is signed by one of ``keys``.

    Raises:
        SignatureError: unsigned, signed by an untrusted key, or altered after signing; the
            message says what followers do with it (ignore it and keep their version).
    """
    where = f"the fleet target {TARGET_KEY!r} of {url}" if url else f"the fleet target {TARGET_KEY!r}"
    then = ("followers with trusted keys ignore it and keep their version; write it with "
            "`deltastore target --signing-key` (a key they trust)")
    sig = target.document.signature
    if sig is None:
        raise SignatureError(f"{where} is not signed, but this store's followers require signatures: {then}")
    if sig.key_id not in keys.key_ids:
        raise SignatureError(f"{where} is signed by key {sig.key_id}, which is not trusted (trusted: {keys.key_ids}): {then}")
    # TrustedKeys.verify checks any document whose signature covers its canonical JSON with
    # ``signature`` null, as a target's does; its message names a manifest, so ours replaces it.
    document: Any = target.document
    try:
        keys.verify(TARGET_KEY, document)
    except SignatureError:
        raise SignatureError(f"{where} has an invalid signature for key {sig.key_id}: it was altered after "
                             f"signing; {then}") from None


def sign_document(d: TargetDocument, signing_key: KeyLike) -> TargetDocument:
    """``d`` with an Ed25519 signature by ``signing_key`` (a key object, PEM bytes or a path)."""
    from deltastore.format.signing import key_id, load_private_key

    key = load_private_key(signing_key)
    value = base64.b64encode(key.sign(signed_bytes(d))).decode()
    return d.model_copy(update={"signature": Signature(alg="ed25519", key_id=key_id(key.public_key()), value=value)})


def _writer_id() -> str:
    return f"{socket.gethostname()[:64]}-{os.getpid()}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write_target(
    store: Store,
    version: int | None,
    *,
    history: History | None = None,
    hold: bool = False,
    signing_key: KeyLike | None = None,
    allow_unsigned: bool = False,
    note: str = "",
    writer: str | None = None,
) -> FleetTarget:
    """Set the fleet target of ``store`` (compare-and-swap on the target object).

    The version is checked first, through HEAD's history: it must exist and not be
    collected. Nothing is written when a check fails.

    Args:
        store: the store (written: ``_deltastore/target.json`` only).
        version: the version followers should hold; None clears the target (``--latest``):
            followers track HEAD again.
        history: the History to read HEAD and manifests through (default: an unchecked one
            of ``store``; pass one with a signature check to refuse unsigned versions).
        hold: followers stay at ``version`` however far HEAD moves (default: until a version
            newer than HEAD's current one is committed).
        signing_key: Ed25519 private key to sign the target with (needed on a signed store).
        allow_unsigned: write an unsigned target on a store whose HEAD version is signed
            (followers with trusted keys ignore it).
        note: why (kept in the target, at most 256 characters).
        writer: the writer's id (default ``host-pid``).

    Returns:
        The target written.

    Raises:
        VersionCollectedError: ``version`` is below the retention floor and not pinned.
        VersionNotFoundError: no such version, or the store is empty.
        SigningRequiredError: the store is signed and no ``signing_key`` was given.
        ConflictError: another target was written meanwhile (read it, then run again).
        StorageError: the write failed and its outcome could not be read back.

    Example::

        write_target(store, 812, hold=True, signing_key="ops.pem", note="813 regressed")
    """
    if version is None and hold:
        raise ValueError("hold needs a version: a target of 'latest' follows HEAD")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise ValueError(f"version must be a positive integer, got {version!r}")
    if history is None:
        from deltastore.format.history import History

        history = History(store)
    got = history.read_head()
    if got is None or got[0].manifest is None:
        raise VersionNotFoundError(f"{store.url} has no committed version: there is nothing to target yet")
    head = got[0]
    top = history.head_manifest(head)
    assert top is not None
    key = manifest = None
    if version is not None:
        key, m = history.resolve(version, head)  # VersionCollectedError below the floor (unless pinned)
        if m.version != version or m.lineage != head.lineage:
            raise VersionNotFoundError(f"version {version} of {store.url} is not in HEAD's history")
        manifest = key
    if signing_key is None and top[1].signature is not None and not allow_unsigned:
        raise SigningRequiredError(
            f"the versions of {store.url} are signed (version {head.version} by key {top[1].signature.key_id}), "
            "so its fleet target must be signed too: followers with trusted keys ignore an unsigned one. "
            "Pass signing_key (or allow_unsigned=True to write it anyway)"
        )
    current = _read_current(store)
    # Above the replaced one, and above any a follower may remember even when the object was
    # deleted in between: the writer's clock in milliseconds, when that is larger.
    generation = max(1 if current is None else current.generation + 1, int(time.time() * 1000))
    doc = TargetDocument(
        generation=generation,
        version=version, manifest=manifest, manifest_sha256=None if manifest is None else digest_from_key(manifest),
        lineage=head.lineage, hold=hold, head_version=head.version, target_id=new_attempt_id(),
        writer=writer or _writer_id(), created=_now(), note=note[:MAX_NOTE_CHARS],
    )
    if signing_key is not None:
        doc = sign_document(doc, signing_key)
    data = dump(doc)
    mode = "create" if current is None else IfMatch(current.etag)
    try:
        meta = store.put(TARGET_KEY, data, mode=mode)
    except PreconditionFailedError as e:
        return _settle(store, doc, e, conflict=True)
    except StorageError as e:
        return _settle(store, doc, e, conflict=False)
    logger.info("fleet target of %s set to %s", store.url, "latest" if version is None else version)
    return parse_target(data, meta.etag)


def _read_current(store: Store) -> FleetTarget | None:
    """The target a write replaces; an unreadable one is replaced too (logged): the operator's
    write is how a damaged target is repaired."""
    try:
        got: GetResult = store.get_with_meta(TARGET_KEY)
    except NotFoundError:
        return None
    try:
        return parse_target(got.data, got.meta.etag)
    except (CorruptObjectError, ValueError) as e:
        logger.warning("replacing the unreadable fleet target of %s: %s", store.url, e)
        from deltastore.format.keys import new_lineage

        # A stand-in at generation 1 whose ETag is the damaged object's, for the compare-and-swap.
        stand_in = TargetDocument(generation=1, lineage=new_lineage(), head_version=0, target_id=new_attempt_id(),
                                  writer="?", created="")
        return parse_target(dump(stand_in), got.meta.etag)


def _settle(store: Store, doc: TargetDocument, error: Exception, *, conflict: bool) -> FleetTarget:
    """A failed or refused write: ours if the object now carries our ``target_id`` (a retry of
    a write that landed, the lost-response case), else ConflictError or the error."""
    try:
        now = read_target(store)
    except (StorageError, CorruptObjectError):
        now = None
    if now is not None and now.target_id == doc.target_id:
        return now
    if conflict:
        by = "" if now is None else f" (generation {now.generation} by {now.writer}: {now.describe()})"
        raise ConflictError(f"the fleet target of {store.url} was changed by someone else meanwhile{by}; "
                            "nothing was written: look at it, then set it again") from None
    raise error


__all__ = [
    "MAX_TARGET_BYTES",
    "TARGET_KEY",
    "FleetTarget",
    "TargetDocument",
    "goal_version",
    "parse_target",
    "read_target",
    "sign_document",
    "verify_target",
    "write_target",
]
