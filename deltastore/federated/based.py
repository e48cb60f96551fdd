"""Based versions (design 009, SPEC §14): a version of a site store whose deltas apply to a
version of another store (the round's global version).

:class:`RoundBase` names such a base. :class:`BasedWriter` commits based versions to a site
store (its own HEAD, CAS, fencing and lineage; delta packs only). :func:`read_based` is the
aggregator's read: every check of SPEC §14 before a byte of the site is used, then the site's
changed chunks, each rebuilt on the base's bits and checked against its digest.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltastore.read.engine import ReadEngine
from deltastore.write.chain import VersionChain
from deltastore.write.commit import attempt_clock
from deltastore.write.encode import UPLOADS_IN_FLIGHT, LayoutWorks, encode_version
from deltastore.write.policy import AnchorPolicy, WriterPolicy, check_policy
from deltastore.errors import (
    CompressedVersionError,
    DeltastoreError,
    IntegrityError,
    LayoutMismatchError,
    SiteLayoutError,
    UnsupportedSchemaError,
    WrongBaseError,
)
from deltastore.format.history import History, VersionInfo
from deltastore._util.jobs import default_threads
from deltastore.format.models import BASE_SCHEMA, BaseRef, CompressionRef, Head, Layout, Manifest, layout_of
from deltastore.format.manifest import encode_manifest
from deltastore.read.plan import ChunkPlan, Step
from deltastore.storage.base import Store
from deltastore.storage.probe import require_atomic_writes
from deltastore.layout.tensors import TensorSpec, bits, check_layout, validate_state_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundBase:
    """A global version a round starts from: what a based version's ``base`` names, and the
    layout its deltas are computed on.

    Attributes:
        version, manifest, sha256, lineage: the global version, its manifest key, that
            manifest's SHA-256 (HEAD's ``manifest_sha256``) and the global store's lineage.
        specs: the version's layout (tensor name → spec), in layout order.
    """

    version: int
    manifest: str
    sha256: str
    lineage: str
    specs: Mapping[str, TensorSpec] = field(compare=False, repr=False)

    def ref(self) -> BaseRef:
        """The manifest field naming this base."""
        return BaseRef(version=self.version, manifest=self.manifest, sha256=self.sha256, lineage=self.lineage)

    @classmethod
    def of(cls, head: Head, layout: Layout) -> RoundBase:
        """The base a global HEAD names, with the layout of its version."""
        if head.manifest is None or head.manifest_sha256 is None or head.lineage is None:
            raise WrongBaseError(f"HEAD at version {head.version} names no manifest (or no lineage): not a round's base")
        return cls(head.version, head.manifest, head.manifest_sha256, head.lineage, specs_of(layout, what=head.manifest))


def specs_of(layout: Layout, *, what: str) -> dict[str, TensorSpec]:
    """The tensor specs of a layout object. Groups (design 007) are refused: the merge of a
    federated round works per tensor (design 009, "Not done")."""
    if layout.groups:
        raise SiteLayoutError(f"{what}: its layout groups small tensors (schema-4 groups); federated rounds "
                              "need an ungrouped global store (LayoutPolicy(group_small_tensors=False))")
    gridded = [n for n, c in zip(layout.name, layout.chunk_cols) if c]
    if gridded:  # design 011 D6: the merge and these specs know no column grid yet
        raise UnsupportedSchemaError(f"{what}: tensor {gridded[0]!r} has a column grid (chunk_cols > 0); "
                                     "a grid in a federated store is read from a later release")
    return {n: TensorSpec(n, dt, tuple(sh), rows)
            for n, dt, sh, rows in zip(layout.name, layout.dtype, layout.shape, layout.chunk_rows)}


def same_layout(a: Mapping[str, TensorSpec], b: Mapping[str, TensorSpec]) -> str | None:
    """None when the layouts are equal (names, dtypes, shapes, chunking, order); else the first
    tensor that differs, in words."""
    for (na, sa), (nb, sb) in zip(a.items(), b.items()):
        if (na, sa.dtype, sa.shape, sa.chunk_rows) != (nb, sb.dtype, sb.shape, sb.chunk_rows):
            return f"tensor {na!r} {sa.dtype}{list(sa.shape)}/{sa.chunk_rows} rows vs {nb!r} {sb.dtype}{list(sb.shape)}/{sb.chunk_rows} rows"
    if len(a) != len(b):
        return f"{len(a)} tensors vs {len(b)}"
    return None


class BasedWriter:
    """Commits based versions to one site store (SPEC §14, §5).

    The store keeps its own history: HEAD by compare-and-swap, a fencing claim on open (a
    restarted site fences its zombie), its lineage, a ``parent_manifest`` chain round after
    round, each version its own chain's start (design 009). Each version holds only delta packs
    against its base, and its layout object is written once and reused while the layout holds.
    Versions are added through the same :class:`~deltastore.write.chain.VersionChain` as a
    Publisher's.

    Args:
        store: the site store (opened by the caller, who closes it).
        writer_policy: ``writer_id`` (recorded in manifests and HEAD; default
            ``site-host-pid-random``), ``threads`` (encode threads), ``takeover`` (claim the
            store on open, default True), ``allow_unsafe_store`` and ``max_attempt_s`` (the
            attempt deadline, SPEC §5 step 3a), as for :class:`~deltastore.Publisher`; the other
            fields do not apply (a based version is never skipped nor resumed).
        signing_key: an Ed25519 private key (a ``cryptography`` key object, PEM bytes or a
            path) that signs every based version (SPEC §3.1), so that an aggregator holding
            the site's public key accepts only this site's versions (SPEC §14). None: unsigned.

    Raises:
        UnsafeStoreError: the store lacks atomic conditional writes.
        FencedError, CommitUnknownError: from the claim.
        ValueError: ``signing_key`` is not an Ed25519 private key.
    """

    def __init__(self, store: Store, *, writer_policy: WriterPolicy = WriterPolicy(), signing_key: Any = None):
        check_policy(writer_policy, WriterPolicy, "writer_policy")
        key = None
        if signing_key is not None:
            from deltastore.format.signing import load_private_key

            key = load_private_key(signing_key)  # a bad key fails before any IO
        require_atomic_writes(store, allow_unsafe_store=writer_policy.allow_unsafe_store)
        self.store = store
        self.writer_policy = writer_policy
        self.writer_id = writer_policy.writer_id or f"site-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.threads = writer_policy.threads or default_threads()
        # A site signs when given a key. Without one it may continue a signed site store: the
        # aggregator holding that site's keys refuses the unsigned versions (design 009 D9), and a
        # site store has no other readers to protect.
        self._chain = VersionChain(store, self.writer_id, anchors=AnchorPolicy(), max_attempt_s=writer_policy.max_attempt_s,
                                   signing_key=key, allow_unsigned=True)
        self._chain.open(takeover=writer_policy.takeover)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-site-encode")
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-site-upload")
        self._layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across rounds

    @property
    def version(self) -> int:
        """The site store's latest committed version (0 when empty)."""
        return self._chain.version

    def publish(self, state: Mapping[str, torch.Tensor], base: RoundBase, base_state: Mapping[str, torch.Tensor], *,
                step: int | None = None, metadata: Mapping[str, Any] | None = None,
                compression: CompressionRef | None = None) -> VersionInfo:
        """Commit ``state`` as a based version: deltas against ``base_state`` (the bits of
        ``base``, which the caller pulled and verified).

        Args:
            state: the site's result, in the base's dtypes and layout.
            base: the global version the round started from.
            base_state: that version's tensors (not modified).
            step, metadata: recorded in the manifest (e.g. ``{"num_examples": n}``).
            compression: how ``state`` was compressed (SPEC §14.1), recorded in the manifest
                so that readers know it is not the lossless result; None: lossless.

        Returns:
            The committed version's info.

        Raises:
            SiteLayoutError: ``state`` has another layout than ``base``.
            ConflictError, FencedError, CommitUnknownError, StorageError: from the commit
                (SPEC §5: a failed commit leaves HEAD as it was).
        """
        state = validate_state_dict(state)
        try:
            check_layout(base.specs, state, against=f"the round's base (global version {base.version})")
        except LayoutMismatchError as e:
            raise SiteLayoutError(f"site result for {self.store.url}: {e}") from None
        chain = self._chain
        chain.prepare()
        chain.commits.check_can_commit()
        layout = layout_of(dict(base.specs), schema=BASE_SCHEMA)
        draft = chain.draft(chain.version + 1, "delta", has_base=False, tip=None, base=base.ref())
        deadline = attempt_clock() + self.writer_policy.max_attempt_s
        # encode_version advances its reference in place: give it a copy of the base's bits.
        reference = {n: t.detach().to("cpu", copy=True) for n, t in base_state.items()}
        encoded = encode_version(
            {n: state[n] for n in base.specs}, dict(base.specs), kind="delta", reference=reference,
            pool=self._pool, uploader=self._uploader, store=self.store, threads=self.threads, attempt=draft.attempt,
            layouts=self._layout_works,
        )
        # the previous version's layout object when equal (SPEC §1), else a new one
        layout_ref = chain.layout_ref(draft.attempt, layout, chain.tip())
        more: dict[str, Any] = {} if compression is None else {"compression": compression}
        manifest = chain.header(draft, layout, layout_ref, step=step, metadata=dict(metadata or {}), stats=encoded.stats,
                                blobs=encoded.blobs, tensors=encoded.entries, **more)
        manifest = chain.sign(manifest)  # unchanged when this site has no key
        sealed = chain.seal(manifest, encode_manifest(manifest, layout))
        chain.commit(draft, sealed, layout, deadline=deadline)
        logger.info("site %s: version %d based on global version %d: %d bytes, %d elements changed",
                    self.store.url, draft.version, base.version, encoded.stats.bytes_stored, encoded.stats.elements_changed)
        return VersionInfo.from_manifest(manifest, sealed.key)

    def close(self) -> None:
        """Stop the threads (the store belongs to the caller)."""
        self._pool.shutdown(wait=True)
        self._uploader.shutdown(wait=True)


@dataclass(frozen=True)
class BasedResult:
    """A site's verified result: the chunks it changed, rebuilt on the base's bits.

    Attributes:
        site: the site's name; key: its manifest key; info: its version.
        chunks: ``(tensor, chunk index) → bits`` (unsigned integers of the dtype's width) of
            every chunk the site changed; every other chunk equals the base's.
        metadata: the manifest's user metadata (e.g. ``num_examples``).
        bytes_fetched: segment bytes read from the site store.
        compression: how the site compressed it (SPEC §14.1); None for a lossless result.
    """

    site: str
    key: str
    info: VersionInfo
    chunks: dict[tuple[str, int], np.ndarray]
    metadata: dict[str, Any]
    bytes_fetched: int
    compression: CompressionRef | None = None


def check_based(site: str, url: str, key: str, m: Manifest, layout: Layout, base: RoundBase, *,
                accept_compressed: bool = False) -> None:
    """SPEC §14's checks of a site version against the round's base, before any segment is read.

    Raises:
        CompressedVersionError: the version is compressed (SPEC §14.1) and ``accept_compressed``
            is False.
        WrongBaseError: the version is not based, or is based on another version than ``base``
            (key, SHA-256 or lineage differ).
        SiteLayoutError: its layout differs from the base's.
    """
    if m.base is None:
        raise WrongBaseError(f"site {site} ({url}): version {m.version} ({key!r}) is not a based version")
    if m.compression is not None and not accept_compressed:
        c = m.compression
        raise CompressedVersionError(
            f"site {site} ({url}): version {m.version} ({key!r}) is compressed ({c.method}, density {c.density:g}, "
            f"{c.bits} bits): a lossy approximation of the site's result, which this reader does not accept; "
            "opt in with ResultPolicy(accept_compressed=True) (deltastore aggregate --accept-compressed)")
    b = m.base
    if (b.version, b.manifest, b.sha256, b.lineage) != (base.version, base.manifest, base.sha256, base.lineage):
        raise WrongBaseError(
            f"site {site} ({url}): version {m.version} ({key!r}) is based on global version {b.version} "
            f"({b.manifest!r}, sha256 {b.sha256[:12]}…, lineage {b.lineage}), not on the round's base, global version "
            f"{base.version} ({base.manifest!r}, sha256 {base.sha256[:12]}…, lineage {base.lineage})"
        )
    try:
        specs = specs_of(layout, what=f"site {site} version {m.version}")
    except SiteLayoutError as e:
        raise SiteLayoutError(f"site {site} ({url}): {e}") from None
    diff = same_layout(specs, base.specs)
    if diff is not None:
        raise SiteLayoutError(f"site {site} ({url}): version {m.version} has another layout than global version "
                              f"{base.version}: {diff}")


def read_based(site: str, history: History, engine: ReadEngine, key: str, m: Manifest, base: RoundBase,
               base_state: Mapping[str, torch.Tensor], *, accept_compressed: bool = False) -> BasedResult:
    """Check and read site version ``m`` (SPEC §14): base and layout, then every segment's
    SHA-256 and every rebuilt chunk's digest. Nothing is returned unless all pass. A compressed
    version (SPEC §14.1) is read only with ``accept_compressed``.

    Raises:
        CompressedVersionError: from :func:`check_based`.
        WrongBaseError, SiteLayoutError: from :func:`check_based`.
        IntegrityError: a segment or a rebuilt chunk fails its digest (named: site, chunk).
        NotFoundError, StorageError: a pack is missing or unreadable.
    """
    url = history.store.url
    assert m.layout is not None
    check_based(site, url, key, m, history.layout(m.layout), base, accept_compressed=accept_compressed)
    plans: list[ChunkPlan] = []
    for t in m.tensors:
        spec = base.specs[t.name]
        for c in t.chunks:
            assert c.delta is not None  # manifest checks: a based chunk has a delta segment
            plans.append(ChunkPlan(t.name, c.index, spec.chunk_span(c.index), c.digest,
                                   deltas=(Step(0, m.blobs[c.delta.blob], c.delta),)))
    before = engine.bytes_fetched
    chunks: dict[tuple[str, int], np.ndarray] = {}
    try:
        for batch, data, _ in engine.fetcher.batches(plans):
            for p in batch:
                a, b = p.span
                raw = bits(base_state[p.name].contiguous())[a:b].copy()
                chunks[(p.name, p.index)] = ReadEngine.replay(p, base.specs[p.name], data, raw)
    except IntegrityError as e:
        raise type(e)(f"site {site} ({url}) version {m.version} ({key!r}): {e}") from e
    except ValueError as e:
        if isinstance(e, DeltastoreError):
            raise
        raise IntegrityError(f"site {site} ({url}) version {m.version} ({key!r}): a segment does not decode: {e}") from e
    info = VersionInfo.from_manifest(m, key)
    return BasedResult(site, key, info, chunks, dict(m.metadata), engine.bytes_fetched - before, m.compression)
