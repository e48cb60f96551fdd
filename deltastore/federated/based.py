"""Based versions (design 009, SPEC §14): a version of a site store whose deltas apply to a
version of another store (the round's global version).

:class:`RoundBase` names such a base. :class:`BasedWriter` commits based versions to a site
store (its own HEAD, CAS, fencing and lineage; delta packs only). :func:`read_based` is the
aggregator's read: every check of SPEC §14 before a byte of the site is used, then the site's
changed chunks, each rebuilt on the base's bits and checked against its digest.
"""

from __future__ import annotations

import logging
import math
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
from deltastore.write.commit import CommitProtocol, attempt_clock, now, put_immutable
from deltastore.write.encode import UPLOADS_IN_FLIGHT, LayoutWorks, encode_version
from deltastore.errors import (
    DeltastoreError,
    IntegrityError,
    LayoutMismatchError,
    SiteLayoutError,
    UnsupportedSchemaError,
    WrongBaseError,
)
from deltastore.format.history import History, VersionInfo
from deltastore._util.jobs import default_threads
from deltastore.format.keys import manifest_key, new_attempt_id, object_key, sha256_hex
from deltastore.format.manifest import encode_manifest
from deltastore.format.models import (
    BASE_SCHEMA,
    DEFAULT_MAX_ATTEMPT_S,
    BaseRef,
    Head,
    Layout,
    Manifest,
    ObjectRef,
    layout_of,
)
from deltastore.format.objects import encode_object
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
                              "need an ungrouped global store (Publisher(group_small_tensors=False))")
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
    round. Each version holds only delta packs against its base, and its layout object is
    written once and reused while the layout holds.

    Args:
        store: the site store (opened by the caller, who closes it).
        writer_id: recorded in manifests and HEAD.
        takeover: claim the store on open (default True).
        allow_unsafe_store: see :class:`~deltastore.Publisher`.
        threads: encode threads.
        max_attempt_s: the attempt deadline (SPEC §5 step 3a).
    """

    def __init__(self, store: Store, *, writer_id: str | None = None, takeover: bool = True,
                 allow_unsafe_store: bool = False, threads: int | None = None,
                 max_attempt_s: float = DEFAULT_MAX_ATTEMPT_S):
        require_atomic_writes(store, allow_unsafe_store=allow_unsafe_store)
        self.store = store
        self.writer_id = writer_id or f"site-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.threads = threads or default_threads()
        self.max_attempt_s = max_attempt_s
        self._history = History(store)
        self._commits = CommitProtocol(store, self._history, self.writer_id)
        self._commits.open(takeover=takeover)
        self._layout: tuple[Layout, ObjectRef] | None = None  # the newest version's layout object
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="deltastore-site-encode")
        self._uploader = ThreadPoolExecutor(max_workers=2 * UPLOADS_IN_FLIGHT, thread_name_prefix="deltastore-site-upload")
        self._layout_works = LayoutWorks()  # the chunk jobs of the layouts encoded, kept across rounds

    @property
    def version(self) -> int:
        """The site store's latest committed version (0 when empty)."""
        return self._commits.version

    def publish(self, state: Mapping[str, torch.Tensor], base: RoundBase, base_state: Mapping[str, torch.Tensor], *,
                step: int | None = None, metadata: Mapping[str, Any] | None = None) -> VersionInfo:
        """Commit ``state`` as a based version: deltas against ``base_state`` (the bits of
        ``base``, which the caller pulled and verified).

        Args:
            state: the site's result, in the base's dtypes and layout.
            base: the global version the round started from.
            base_state: that version's tensors (not modified).
            step, metadata: recorded in the manifest (e.g. ``{"num_examples": n}``).

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
        self._commits.prepare()
        self._commits.check_can_commit()
        head = self._commits.head
        version = self.version + 1
        layout = layout_of(dict(base.specs), schema=BASE_SCHEMA)
        lineage = self._commits.lineage_for_commit()
        attempt = new_attempt_id()
        deadline = attempt_clock() + self.max_attempt_s
        # encode_version advances its reference in place: give it a copy of the base's bits.
        reference = {n: t.detach().to("cpu", copy=True) for n, t in base_state.items()}
        encoded = encode_version(
            {n: state[n] for n in base.specs}, dict(base.specs), kind="delta", reference=reference,
            pool=self._pool, uploader=self._uploader, store=self.store, threads=self.threads, attempt=attempt,
            layouts=self._layout_works,
        )
        layout_ref = self._layout_ref(attempt, layout, head)
        created = now()
        manifest = Manifest(
            schema_=BASE_SCHEMA,
            version=version,
            parent=head.version if head and head.version else None,
            parent_manifest=head.manifest if head and head.version else None,
            kind="delta",
            anchor=version,
            delta_base=None,
            step=step,
            created=created,
            writer=self.writer_id,
            epoch=self._commits.epoch,
            commit_id=attempt,
            metadata=dict(metadata or {}),
            blobs=encoded.blobs,
            tensors=encoded.entries,
            stats=encoded.stats.model_copy(update={"cum_delta_bytes": 0}),
            lineage=lineage,
            anchor_manifest=None,
            back=(),  # every based version starts its own chain: nothing to skip to (design 009)
            chain_start=version,
            layout=layout_ref,
            max_attempt_s=math.ceil(self.max_attempt_s),
            base=base.ref(),
        )
        data = encode_manifest(manifest, layout)
        digest = sha256_hex(data)
        mkey = manifest_key(version, digest)
        put_immutable(self.store, mkey, data, "manifest")
        self._commits.commit(Head(
            version=version, manifest=mkey, manifest_sha256=digest, commit_id=attempt, writer=self.writer_id,
            epoch=self._commits.epoch, updated=created, lineage=lineage, index=head.index if head else None,
        ), deadline=deadline)
        self._layout = (layout, layout_ref)
        logger.info("site %s: version %d based on global version %d: %d bytes, %d elements changed",
                    self.store.url, version, base.version, encoded.stats.bytes_stored, encoded.stats.elements_changed)
        return VersionInfo.from_manifest(manifest, mkey)

    def _layout_ref(self, attempt: str, layout: Layout, head: Head | None) -> ObjectRef:
        """The layout object of the new version: the previous version's when equal (it is
        needed by the manifest this write builds on, SPEC §1), else a new one."""
        if self._layout is None and head is not None and head.manifest:
            prev = self._history.head_manifest(head)
            if prev is not None and prev[1].layout is not None and prev[1].schema_ == BASE_SCHEMA:
                self._layout = (self._history.layout(prev[1].layout), prev[1].layout)
        if self._layout is not None and self._layout[0] == layout:
            return self._layout[1]
        data = encode_object(layout)
        digest = sha256_hex(data)
        key = object_key(attempt, digest, ".layout.json.zst")
        put_immutable(self.store, key, data, "layout")
        return ObjectRef(key=key, sha256=digest)

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
    """

    site: str
    key: str
    info: VersionInfo
    chunks: dict[tuple[str, int], np.ndarray]
    metadata: dict[str, Any]
    bytes_fetched: int


def check_based(site: str, url: str, key: str, m: Manifest, layout: Layout, base: RoundBase) -> None:
    """SPEC §14's checks of a site version against the round's base, before any segment is read.

    Raises:
        WrongBaseError: the version is not based, or is based on another version than ``base``
            (key, SHA-256 or lineage differ).
        SiteLayoutError: its layout differs from the base's.
    """
    if m.base is None:
        raise WrongBaseError(f"site {site} ({url}): version {m.version} ({key!r}) is not a based version")
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
               base_state: Mapping[str, torch.Tensor]) -> BasedResult:
    """Check and read site version ``m`` (SPEC §14): base and layout, then every segment's
    SHA-256 and every rebuilt chunk's digest. Nothing is returned unless all pass.

    Raises:
        WrongBaseError, SiteLayoutError: from :func:`check_based`.
        IntegrityError: a segment or a rebuilt chunk fails its digest (named: site, chunk).
        NotFoundError, StorageError: a pack is missing or unreadable.
    """
    url = history.store.url
    assert m.layout is not None
    check_based(site, url, key, m, history.layout(m.layout), base)
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
        for batch, data, _ in engine.fetch_batches(plans):
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
    return BasedResult(site, key, info, chunks, dict(m.metadata), engine.bytes_fetched - before)
