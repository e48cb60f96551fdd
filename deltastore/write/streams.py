"""A publisher's serving streams (SPEC §15): one chain per declared format, derived from each
version's state and committed by the version's one HEAD write.

Per version, :meth:`StreamWriter.build` derives the format's state dict
(:func:`deltastore.serving.formats.derive`; a delta version from the store's own delta where it
can, :mod:`deltastore.write.requant`), encodes it against the stream's previous version (its own
anchors, deltas and digests: the codec works on the quantized bytes and on the scales) into
packs under ``streams/<format>/objects/<attempt>/``, and stores the stream's manifest under
``streams/<format>/manifests/``, all before the store's manifest that names it (``streams``) is
written. Nothing of a stream is visible before that manifest's HEAD write: a failed or lost
attempt leaves unreferenced objects, as any attempt does.

A stream's version is an anchor when its store's version is one (so every stream's chain lies
within the versions its store's retention keeps, SPEC §11) and whenever the stream has no
base: its first version, a layout change, or a publisher that could not read the stream's
previous version back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from deltastore.errors import DeltastoreError, LayoutMismatchError
from deltastore.format.keys import stream_prefix
from deltastore.format.manifest import encode_manifest
from deltastore.format.models import Head, Layout, StreamRef, layout_of
from deltastore.layout.groups import unit_order, unit_reference
from deltastore.layout.tensors import TensorSpec, check_layout
from deltastore.serving.formats import ServingFormat, serving_format
from deltastore.storage.base import Store
from deltastore.storage.prefixed import PrefixedStore
from deltastore.write.chain import Draft, Sealed, VersionChain
from deltastore.write.commit import put_immutable
from deltastore.write.encode import AnchorChunk, ChangeSink, ChunkChange, ChunkSource, LayoutWorks, encode_version
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from deltastore.write.requant import Requantizer, anchor_sources, takes_store_chunks

logger = logging.getLogger(__name__)


def serving_formats(formats: Sequence[str | ServingFormat]) -> tuple[ServingFormat, ...]:
    """A publisher's ``formats`` argument as formats, each once, in the order given.

    Raises:
        UnknownFormatError: a name deltastore does not define (the message lists those it does).
        ValueError: a format named twice, or ``formats`` given as one string.
    """
    if isinstance(formats, (str, ServingFormat)):
        raise ValueError(f"formats is a list of formats, e.g. [{formats!r}], not one format")
    out = tuple(serving_format(f) for f in formats)
    names = [f.name for f in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"formats names {', '.join(map(repr, twice))} more than once")
    return out


def is_identity(fmt: ServingFormat, state: Mapping[str, torch.Tensor]) -> bool:
    """True when ``state`` already is in format ``fmt`` (``"bf16"`` and every floating tensor of
    ``state`` bfloat16), so its version is that format's and no stream is derived."""
    return fmt.name == "bf16" and all(t.dtype == torch.bfloat16 for t in state.values() if t.is_floating_point())


@dataclass
class StreamVersion:
    """One stream's version, stored but not yet committed (its store's HEAD write commits it)."""

    ref: StreamRef
    draft: Draft
    sealed: Sealed
    layout: Layout
    specs: dict[str, TensorSpec]
    #: the derived state, when the stream had no base (it becomes the reference once committed)
    state: dict[str, torch.Tensor] | None
    gathered: dict[str, torch.Tensor]
    #: kept tensors whose reference becomes the store's own once committed (same bits: the
    #: version's chunks of them are the store's)
    share: dict[str, torch.Tensor]
    #: of ``state``: kept tensors that are the caller's, whose reference becomes the store's own
    #: once committed (the store's reference holds the same bits, and its deltas carry their
    #: chunks from then on)
    passed: frozenset[str] = frozenset()


class StreamWriter:
    """The chain of one serving format of a publisher's store.

    Args:
        store: the publisher's store (the stream writes under ``streams/<format>/`` of it).
        fmt: the format.
        writer_id, anchors, max_attempt_s, signing_key: the publisher's (a stream's manifests
            are signed with the store's key).
        layout_policy: how the stream's layouts are chunked (the publisher's).
    """

    def __init__(self, store: Store, fmt: ServingFormat, *, writer_id: str, anchors: AnchorPolicy,
                 max_attempt_s: float, signing_key: Any, layout_policy: LayoutPolicy):
        self.store = store
        self.format = fmt
        self.prefix = stream_prefix(fmt.name)
        self.view = PrefixedStore(store, self.prefix)
        self.layout_policy = layout_policy
        # allow_unsigned: whether the store may be continued unsigned is the store's chain's call
        self.chain = VersionChain(self.view, writer_id, anchors=anchors, max_attempt_s=max_attempt_s,
                                  signing_key=signing_key, allow_unsigned=True)
        self._works = LayoutWorks()
        self._reference: dict[str, torch.Tensor] | None = None
        self._reference_bits: dict[str, np.ndarray] = {}
        self._reference_key: str | None = None  # the stream manifest whose state _reference is
        self._specs: dict[str, TensorSpec] | None = None
        self._layout: Layout | None = None
        # the quantized tensors of the last delta version's derived state, no longer in use once
        # it was encoded: the next version is derived into them (fresh pages cost about a third
        # of the quantization), so a quantizing stream holds one spare quantized state
        self._spare: dict[str, torch.Tensor] | None = None
        self._requant = Requantizer(fmt)
        self._reference_version: int | None = None  # the store's version _reference is derived from
        # kept tensors whose reference entry is the store's own reference tensor (advanced by the
        # store's encoder): a publisher holds one copy of the tensors both chains store alike
        self._shared: set[str] = set()

    @property
    def name(self) -> str:
        return self.format.name

    def change_lists(self, state: Mapping[str, torch.Tensor]) -> set[str]:
        """The tensors of ``state`` whose change lists (``encode_version(change_lists=)``) this
        stream's next version derives from: the bfloat16 ones it keeps, but those it already
        shares with the store (their chunks are the store's as they are). Its quantized
        tensors take theirs through :meth:`sinks`."""
        return self.kept(state) - self._shared

    def kept(self, state: Mapping[str, torch.Tensor]) -> set[str]:
        """The bfloat16 tensors of ``state`` this stream keeps as they are: its anchors take their
        chunks from the store's anchor (``encode_version(anchors=)``) where the layouts agree."""
        return {n for n, t in state.items() if t.dtype == torch.bfloat16 and not self.format.selects(n, t.shape)}

    def sinks(self, state: Mapping[str, torch.Tensor], version: int,
              store_specs: Mapping[str, TensorSpec] | None = None) -> dict[str, ChangeSink]:
        """The change sinks (``encode_version(sinks=)``) of the store's delta ``version`` of
        ``state`` (in the store's layout ``store_specs``), for this stream's quantized tensors,
        when its reference holds the state of ``version - 1`` (:meth:`Requantizer.prepare`);
        none otherwise. They may advance the reference: should the version fail, the caller
        calls :meth:`drop`."""
        if self._reference is None or self._specs is None or self._reference_version != version - 1:
            return {}
        return self._requant.prepare(state, self._reference, self._specs, store_specs, self._reference_bits)

    def drop(self, *, blocks: bool = True) -> None:
        """Forget the reference (an attempt failed: encoding advanced it past every version),
        and the requantizer's blocks of it unless ``blocks`` is False (they are of the version
        being derived)."""
        self._reference, self._reference_bits, self._reference_key = None, {}, None
        self._reference_version = None
        if blocks:
            self._requant.clear()
        self._shared = set()

    def _parent_head(self, parent: Head | None, parent_ref: StreamRef | None) -> Head | None:
        """The stream's HEAD at its store's HEAD ``parent`` (None: no stream there)."""
        if parent is None or parent_ref is None:
            return None
        return parent.model_copy(update={"manifest": parent_ref.key[len(self.prefix):],
                                         "manifest_sha256": parent_ref.sha256, "index": None})

    def build(self, state: Mapping[str, torch.Tensor], *, version: int, kind: str, draft: Draft,
              parent: Head | None, parent_ref: StreamRef | None, epoch: int, step: int | None,
              metadata: dict[str, Any], pool: Executor, uploader: Executor, threads: int,
              resume: bool, changes: Mapping[str, list[ChunkChange]] | None = None,
              store_specs: Mapping[str, TensorSpec] | None = None,
              store_reference: Mapping[str, torch.Tensor] | None = None,
              anchors: Mapping[str, list[AnchorChunk]] | None = None, store_has_base: bool = False) -> StreamVersion:
        """Derive, encode and store this stream's ``version`` (see the module docstring).

        Args:
            state: the store's state of ``version`` (as published).
            kind: the store's version's kind (an anchor there is an anchor here).
            draft: the store's version's draft (its attempt and lineage are the stream's).
            parent, parent_ref: HEAD before this version and its stream of this format (None:
                the store has no version, or its version has no such stream).
            epoch: the publisher's epoch.
            resume: read the stream's previous version back when this writer holds none.
            changes, store_specs: what the store's delta ``version`` changed
                (``encode_version(changes=)``) and its layout, when its reference was the state of
                ``version - 1``: the stream is then derived incrementally where it can be
                (:mod:`deltastore.write.requant`); None derives it in full.
            store_reference: the store's reference, advanced to ``version`` (a kept tensor whose
                chunks are the store's delta shares it from then on).
            anchors, store_has_base: of the store's anchor ``version``, its chunks of the tensors
                the stream keeps (``encode_version(anchors=)``), encoded against its reference
                where ``store_has_base``: the stream's anchor takes them where the layouts agree
                instead of encoding them again.

        Raises:
            InvalidStateDictError: a tensor the format cannot derive (named).
            StorageError, IntegrityError: writing the stream; nothing is committed.
        """
        spare, self._spare = self._spare, None
        head = self._parent_head(parent, parent_ref)
        self.chain.adopt(head, epoch=epoch)
        tip = self.chain.tip()
        if tip is None or self._reference_key != tip.key:
            self.drop()
        # the stream's reference is the state of the store's version the store's delta starts from
        based = (kind == "delta" and changes is not None and self._reference is not None
                 and self._reference_version == version - 1)
        got = self._requant.derive(
            state, pool=pool, reuse=spare, reference=self._reference if based else None,
            specs=self._specs if based else None, store_specs=store_specs, changes=changes if based else None,
            shared=self._shared, threads=threads)
        if got.stale:  # the sinks advanced the reference in part: it holds no version
            self.drop()
            got = self._requant.derive(state, pool=pool, reuse=spare)
        derived, sources, incremental, reused = got.state, got.sources, got.incremental, got.reused
        taken: dict[str, ChunkSource] = {}  # of an anchor: kept tensors' chunks, the store's
        if (kind == "anchor" and anchors is not None and store_specs is not None and store_has_base
                and self._reference is not None and self._specs is not None and self._reference_version == version - 1):
            # with a base here too (known once the layout is compared below): the store's deltas
            # are against the same bits, and cover the tensors whose reference is the store's
            taken = anchor_sources(state, self.format, self._specs, store_specs, anchors,
                                   reference=self._reference, shared=self._shared)
            reused = reused | set(taken)
        if self._shared and not self._shared <= reused:
            # a shared tensor the store's delta does not cover this time: its reference already
            # holds this version's bits, so there is nothing to diff it against; the stream reads
            # its previous version back (resume) or anchors. A state derived in full stands as it
            # is, and so do the blocks its derivation kept; nothing is taken from the store.
            self.drop(blocks=bool(incremental))
            if incremental:
                derived, sources, incremental, reused, _ = self._requant.derive(state, pool=pool)
            sources, reused, taken = {}, set(), {}
        del spare
        if self._reference is None and resume and tip is not None:
            self._resume(tip.version, derived)
        same_layout = False
        if self._specs is not None:
            try:
                check_layout(self._specs, derived, against=f"{self.name} version {version - 1} of {self.store.url}")
                same_layout = True
            except LayoutMismatchError:
                pass
        has_base = same_layout and self._reference is not None
        if incremental and not has_base:  # not reached (the layouts were compared): stand-ins hold old codes
            derived, sources, incremental, reused, _ = self._requant.derive(state, pool=pool)
        stream_kind = "anchor" if kind == "anchor" or not has_base else "delta"
        specs = self._specs if same_layout and self._specs is not None else self.layout_policy.units(derived)
        if kind == "anchor" and anchors is not None and store_specs is not None:
            if not has_base:  # the store's full segments, not its deltas (this anchor has no base)
                taken = anchor_sources(state, self.format, specs, store_specs, anchors, reference=None,
                                       shared=frozenset())
            sources = taken
        elif stream_kind == "anchor":  # the stream anchors on its own: every chunk is encoded here
            sources = {}
        if same_layout and self._layout is not None:
            layout = self._layout
        else:
            layout = layout_of(specs, schema=None)
        sdraft = replace(draft, kind=stream_kind, has_base=has_base, tip=tip)
        gathered: dict[str, torch.Tensor] = {}
        encoded = encode_version(
            derived, specs, kind=stream_kind, reference=self._reference if has_base else None, pool=pool,
            uploader=uploader, store=self.view, threads=threads, attempt=draft.attempt,
            reference_bits=self._reference_bits if has_base else None, gathered=gathered, layouts=self._works,
            wait_stored=False, sources=sources,
        )
        try:
            layout_ref = self.chain.layout_ref(draft.attempt, layout, tip)
            header = self.chain.header(sdraft, layout, layout_ref, step=step, metadata=metadata, stats=encoded.stats,
                                       blobs=encoded.blobs, tensors=encoded.entries).with_layout(layout)
            manifest = self.chain.sign(header)
            sealed = self.chain.seal(manifest, encode_manifest(manifest, layout))
        except BaseException:
            with contextlib.suppress(Exception):  # the first failure is the one reported
                encoded.wait_stored()
            raise
        encoded.wait_stored()
        put_immutable(self.view, sealed.key, sealed.data, "manifest")  # before anything names it
        ref = StreamRef(format=self.name, key=self.prefix + sealed.key, sha256=sealed.digest,
                        bytes=sealed.manifest.stats.bytes_stored)
        if has_base and self.format.scale_suffix is not None:
            # encoded against the reference (advanced in place): the derived tensors are free,
            # except an incremental tensor's stand-in (the reference's) and its scale (kept)
            held = incremental | {n + self.format.scale_suffix for n in incremental}
            self._spare = {n: t for n, t in derived.items()
                           if n not in held and (n not in state or self.format.selects(n, state[n].shape))}
        passed: frozenset[str] = frozenset()
        if not has_base:
            # Its tensors become the stream's reference, advanced in place by later deltas. A
            # tensor derive passed through (a kept bf16 tensor) is the caller's: once committed,
            # the store's reference stands for it where the store's deltas carry its chunks
            # (landed), and a copy elsewhere. The publisher holds one copy of it, not two.
            through = {n for n, t in derived.items() if n in state and _shares(t, state[n])}
            passed = frozenset(n for n in through if store_specs is not None
                               and takes_store_chunks(derived[n], specs.get(n), store_specs.get(n)))
            derived = {n: t.clone() if n in through and n not in passed else t for n, t in derived.items()}
        share = {} if store_reference is None or not has_base else {
            n: store_reference[n] for n in reused
            if n in store_reference and store_reference[n].dtype == torch.bfloat16
            and tuple(store_reference[n].shape) == tuple(specs[n].shape)}
        return StreamVersion(ref=ref, draft=sdraft, sealed=sealed, layout=layout, specs=specs,
                             state=None if has_base else derived, gathered=gathered, share=share, passed=passed)

    def landed(self, built: StreamVersion, *, superseded: bool,
               store_reference: Mapping[str, torch.Tensor] | None = None) -> None:
        """``built`` was committed by its store's HEAD write: the next version builds on it
        (unless ``superseded``: another writer is on top, so the next one reads it back).
        ``store_reference``: the store's reference, holding this version (the tensors a version
        without base passed through share it; without it, they are copied)."""
        self.chain.land(built.draft, built.sealed, built.layout)
        if built.state is not None:  # a delta advanced the reference while encoding
            self._reference = unit_reference(built.state, built.specs, owned=True, gathered=built.gathered)
            self._reference_bits = {}
            self._shared = set()
            # the caller's tensors: the store's copy of them, or our own (superseded: dropped below)
            for n in () if superseded else built.passed:
                own = store_reference.get(n) if store_reference is not None else None
                if own is not None and own.dtype == torch.bfloat16 and own.shape == self._reference[n].shape:
                    self._reference[n] = own
                    self._shared.add(n)
                else:
                    self._reference[n] = self._reference[n].clone()
        elif self._reference is not None:
            for n, t in built.share.items():  # equal bits: this version's chunks of it are the store's
                if self._reference.get(n) is not t:  # a bit view of the tensor it holds stays valid
                    self._reference[n] = t
                    self._reference_bits.pop(n, None)
                self._shared.add(n)
        self._specs, self._layout = built.specs, built.layout
        self._reference_key = None if superseded else built.sealed.key
        self._reference_version = built.draft.version
        if superseded:
            self.drop()

    def _resume(self, version: int, derived: Mapping[str, torch.Tensor]) -> None:
        """Read the stream's ``version`` back as the reference (a restarted publisher), if its
        layout is the derived state's; otherwise the next version is the stream's anchor."""
        from deltastore.read.subscriber import Subscriber  # the read path: loaded only when a stream resumes

        try:
            with Subscriber(self.store.url, store=self.store, format=self.name) as sub:
                reference = sub.pull(version)
                specs = sub.units()
        except DeltastoreError as e:
            logger.warning("%s stream of %s: version %d could not be read back (%s); its next version is an anchor",
                           self.name, self.store.url, version, e)
            return
        try:
            check_layout(specs, derived, against=f"{self.name} version {version} of {self.store.url}")
        except LayoutMismatchError:
            logger.info("%s stream of %s: not resuming from version %d, its layout differs", self.name,
                        self.store.url, version)
            return
        gathered = {n: unit_order(reference.pop(n), sp) for n, sp in specs.items() if sp.chunk_cols}
        self._reference = unit_reference(reference, specs, owned=True, gathered=gathered)
        self._reference_bits = {}
        tip = self.chain.tip()
        self._reference_key = None if tip is None else tip.key
        self._reference_version = version
        self._specs, self._layout = specs, None


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` share memory."""
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


__all__ = ["StreamVersion", "StreamWriter", "is_identity", "serving_formats"]
