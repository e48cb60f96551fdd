"""Encoding one version (SPEC §5 steps 2-3): a state in, part-shaped results out.

:func:`encode_version` cuts a state into the chunks of its layout, encodes each on a thread
pool (a delta against the publisher's reference copy, a full segment for an anchor),
concatenates the segments into content-addressed packs uploaded as they fill, and returns the
manifest's parts (:class:`EncodedVersion`): tensor entries, stats and the pack list. It knows
nothing of HEAD, manifests or the commit protocol; the :class:`~deltastore.write.publisher.Publisher`
assembles and commits what it returns.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from deltastore import codec
from deltastore.codec.delta import encode_delta_advance
from deltastore.layout import grid
from deltastore.write.commit import commit_immutable, put_immutable
from deltastore.layout.groups import (
    MemberTable,
    copy_members,
    gather,
    host_bits,
    member_pointers,
    member_starts,
    member_tables,
)
from deltastore._util import kernels
from deltastore._util.jobs import grouped
from deltastore.format.keys import OBJECT_PREFIX, object_key, sha256_hex
from deltastore.format.models import BlobRef, ChunkEntry, SegmentRef, Stats, TensorEntry, untrack_entries
from deltastore.format.tables import unchecked_entry
from deltastore.storage.base import Store, StreamedPut
from deltastore.layout.tensors import TensorSpec, bits, state_digest, torch_dtype

logger = logging.getLogger(__name__)

Kind = Literal["anchor", "delta"]
#: A read-only bytes-like object (the buffer protocol: bytes, memoryview, a kernel's buffer).
Buffer = Any

#: Segments are concatenated into packs of about this size: few requests per version (S3 bills
#: per request and each costs a round trip) while a pack still uploads in a few seconds.
PACK_TARGET_BYTES = 64 * 1024 * 1024
#: Consecutive chunks are encoded as one thread job of about this size: each job costs a Future,
#: a hand-off and a wake-up of the caller, which small chunks (sharded ranks and slice-aligned
#: layouts cut many) would pay per chunk; a 16 MiB chunk stays a job of its own, and the last
#: job is short enough not to leave a thread idle at the end (design 006).
ENCODE_JOB_BYTES = 4 * 1024 * 1024
#: Jobs submitted and not yet packed, per encode thread: with many tiny tensors a short window
#: starves the threads; memory stays bounded (chunks ≤ 16 MiB).
IN_FLIGHT_PER_THREAD = 8
#: With a full window of a delta version, the caller waits until all but 1/this of it is packed:
#: it wakes once per half window, not per job, and the threads keep half a window queued. An
#: anchor waits for one job at a time: its results are full segments (~0.7× a chunk each), and
#: holding half a window of them done at once would raise the publisher's peak memory after an
#: anchor by about a tenth of the model.
WAIT_DIVISOR = 2
#: Packs uploading at once per pack stream: overlaps the network with encoding while holding
#: at most this many packs (× PACK_TARGET_BYTES) in memory.
UPLOADS_IN_FLIGHT = 2
#: A pack streamed to the store (:meth:`Store.begin_put`: local directories) is written in
#: pieces of at least this many bytes as it fills, by the encode thread packing the results.
STREAM_WRITE_BYTES = 1024 * 1024
#: Layouts whose per-layout work (:class:`_LayoutWork`) an encoder's :class:`LayoutWorks`
#: remembers: a publisher encodes one layout version after version (a few: a re-layout and back).
LAYOUT_WORK_MAX = 4


@dataclass(frozen=True)
class EncodedVersion:
    """What encoding one version produced: the manifest's tensors, stats and packs.

    Attributes:
        entries: one entry per tensor, in layout order, each with its chunks' segment refs.
        stats: bytes stored and what changed.
        blobs: the packs, all uploaded: delta packs (role ``d``) first, then full packs
            (role ``f``); a pack never holds both (SPEC §2, design 005 D2).
    """

    entries: tuple[TensorEntry, ...]
    stats: Stats
    blobs: tuple[BlobRef, ...]
    #: With ``encode_version(wait_stored=False)``: waits until the last packs are stored.
    pending: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def wait_stored(self) -> None:
        """Return once every pack in :attr:`blobs` is stored (at once when ``encode_version``
        waited); re-raises an upload's failure. Every upload has ended when this returns or
        raises."""
        if self.pending is not None:
            self.pending()


@dataclass(frozen=True)
class ChunkChange:
    """One chunk of a delta version that changed, as :func:`encode_version` encoded it (its
    ``changes`` argument): enough for a serving stream to reuse the segment of a tensor it
    serves unchanged, or to requantize only the elements that changed
    (:mod:`deltastore.write.requant`).

    Attributes:
        index, start, stop: the chunk's index and its elements ``[start, stop)`` of the tensor.
        delta, delta_sha256, digest: its delta segment, that segment's SHA-256, and the chunk's
            state digest.
        positions, old_values, new_values: the change list: each changed element's position
            in the chunk (uint32) and its old and new bits, in order (read-only bytes-like
            buffers, as the native kernel hands them over); None when not asked for
            (``encode_version(change_lists=)``).
    """

    index: int
    start: int
    stop: int
    delta: codec.Segment
    delta_sha256: str
    digest: str
    positions: Buffer | None
    old_values: Buffer | None
    new_values: Buffer | None


@dataclass(frozen=True, slots=True)
class AnchorChunk:
    """One chunk of an anchor version, as :func:`encode_version` encoded it (its ``anchors``
    argument): enough for a serving stream that keeps the tensor as the store stores it to take
    the chunk's segments instead of encoding them again.

    Attributes:
        index, start, stop: the chunk's index and its elements ``[start, stop)`` of the tensor.
        full, full_sha256: its full segment and that segment's SHA-256.
        delta, delta_sha256: its delta segment against the reference and that segment's
            SHA-256; None without a reference, or where the chunk did not change.
        digest: the chunk's state digest.
    """

    index: int
    start: int
    stop: int
    full: codec.Segment
    full_sha256: str
    delta: codec.Segment | None
    delta_sha256: str | None
    digest: str


#: A chunk encoder for one tensor, in place of comparing its new bits with the reference:
#: ``(index, start, stop, old)`` → of a delta version, ``(delta segment, state digest, the
#: segment's SHA-256 or None)`` of chunk ``index`` (elements ``[start, stop)``), or None when the
#: chunk did not change; of an anchor, the chunk's :class:`AnchorChunk`. ``old`` is the
#: reference chunk, to advance in place (None without a reference).
ChunkSource = Callable[[int, int, int, "np.ndarray | None"],
                       "tuple[codec.Segment, str, str | None] | AnchorChunk | None"]

#: Takes a changed chunk's change list on the encode thread that listed it, right after the
#: scan, while the list is in cache: ``(index, start, positions, old_values, new_values)`` as
#: :class:`ChunkChange` names them (``encode_version(sinks=)``).
ChangeSink = Callable[[int, int, Buffer, Buffer, Buffer], None]


@dataclass
class _Encoded:
    """One chunk's encoding result (mutable: its segments move into the pack writers).

    ``full_sha256``/``delta_sha256`` are the segments' SHA-256, taken on the encode thread while
    the bytes are in its cache (hashlib releases the GIL), not on the thread that packs them.
    """

    tensor: int
    index: int
    digest: str
    full: codec.Segment | None
    delta: codec.Segment | None
    full_sha256: str | None = None
    delta_sha256: str | None = None


class _PackWriter:
    """Concatenates segments of one role into content-addressed packs and uploads each when full.

    Packs go to ``objects/<attempt>/<sha256>.pack`` and record ``role``. Uploads run on ``uploader``
    threads (at most ``UPLOADS_IN_FLIGHT`` packs held at once), so encoding goes on while a
    pack travels; :meth:`finish` waits for every upload.

    The pack's SHA-256 is taken incrementally as segments are appended (each segment's bytes
    are read while recent in cache), never by re-reading the whole pack when it is flushed.
    Where the store streams writes (:meth:`Store.begin_put`, schema 3), a pack is written in
    pieces of :data:`STREAM_WRITE_BYTES` as it fills and only committed under its name when
    flushed; :meth:`abort` drops a pack left open by a failure.
    """

    def __init__(self, store: Store, uploader: Executor, *, attempt: str | None = None, role: Literal["f", "d"] | None = None):
        self.store = store
        self.uploader = uploader
        self.attempt = attempt
        self.role = role if attempt is not None else None
        self.blobs: list[BlobRef] = []
        # A store that streams writes (a local directory) gets each pack as it fills: finishing
        # the version then writes only the last piece, not a whole pack on the publish's tail
        # (design 006). Schema 3 only: the directory, objects/<attempt>/, is known before the
        # pack's name.
        self._directory = f"{OBJECT_PREFIX}{attempt}/" if attempt is not None else None
        self._stream: StreamedPut | None = None
        self._streams = self._directory is not None  # until the store says it does not
        self._buf = bytearray()  # segments appended in place (not yet streamed): no second copy to join them
        self._len = 0  # bytes of the open pack (streamed or in _buf)
        self._sha = hashlib.sha256()  # of the open pack, updated per segment
        self._uploads: deque[Future[None]] = deque()
        self.bytes_written = 0

    def add(self, seg: codec.Segment, sha256: str | None = None) -> SegmentRef:
        """Append ``seg`` (whose SHA-256 is ``sha256`` when the caller has it) and return its ref."""
        if self._len >= PACK_TARGET_BYTES:
            self.flush()
        data = seg.data
        # built without validation (no pydantic per chunk); the fields are ints and strs
        # made here, and encode_manifest's self-check proves them to be what a reader decodes
        ref = unchecked_entry(
            SegmentRef,
            blob=len(self.blobs),
            offset=self._len,
            length=len(data),
            sha256=sha256 if sha256 is not None else sha256_hex(data),
            codec=seg.codec,
            n_changed=int(seg.n_changed),
        )
        self._buf += data
        self._len += len(data)
        self._sha.update(data)
        if self._streams and len(self._buf) >= STREAM_WRITE_BYTES:
            self._write_out()
        return ref

    def _write_out(self) -> None:
        """Stream what ``_buf`` holds into the open pack (starting the write at the first)."""
        if self._stream is None:
            assert self._directory is not None
            self._stream = self.store.begin_put(self._directory)
            if self._stream is None:  # the store takes whole objects: keep buffering
                self._streams = False
                return
        self._stream.write(self._buf)
        self._buf.clear()

    def flush(self) -> None:
        if not self._len:
            return
        size, self._len = self._len, 0
        digest, self._sha = self._sha.hexdigest(), hashlib.sha256()
        assert self.attempt is not None, "packs are named under their commit attempt (objects/<attempt>/)"
        key = object_key(self.attempt, digest, ".pack")
        self.blobs.append(BlobRef(key=key, size=size, sha256=digest, role=self.role))
        self.bytes_written += size
        while len(self._uploads) >= UPLOADS_IN_FLIGHT:
            self._uploads.popleft().result()
        if self._stream is not None:
            # the last piece is written by the upload job, with the commit: the caller goes on
            # (the publisher builds its manifest meanwhile) and the piece's fresh pages are
            # taken off the thread that packs
            stream, self._stream = self._stream, None
            tail, self._buf = self._buf, bytearray()
            name = key[len(self._directory or ""):]
            self._uploads.append(self.uploader.submit(_end_stream, self.store, stream, tail, self._directory, name, size))
            return
        data, self._buf = self._buf, bytearray()
        self._uploads.append(self.uploader.submit(self._put, key, data))

    def _put(self, key: str, data: bytearray) -> None:
        put_immutable(self.store, key, data, "pack")

    def abort(self) -> None:
        """Drop the pack being streamed, if any (encoding failed: nothing of it is committed)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.abort()

    def finish(self) -> None:
        """Upload what is buffered and wait until every pack is stored (re-raising failures)."""
        self.flush()
        self.wait_stored()

    def wait_stored(self) -> None:
        """Wait until every pack flushed is stored (re-raising the first failure; every upload
        has ended when this returns or raises)."""
        try:
            while self._uploads:
                self._uploads[0].result()
                self._uploads.popleft()
        except BaseException:
            wait(self._uploads)
            self._uploads.clear()
            raise


def _end_stream(store: Store, stream: StreamedPut, tail: bytearray, directory: str | None, name: str, size: int) -> None:
    """An upload job: write a streamed pack's last piece, then commit it under ``name``."""
    assert directory is not None
    if tail:
        stream.write(tail)  # a failed write drops the temp file (StreamedPut.write)
    commit_immutable(store, stream, directory, name, size, "pack")


class _InOrder:
    """Job results consumed in job order by the encode threads themselves: the thread that
    finishes the next job in order consumes it and every later one already done (one consumer
    at a time), so that the caller does not wake per job to pack results (design 006).

    A job that raises, or a failing consume, stops consumption; :meth:`wait` raises the failure
    of the lowest job index on the caller's thread."""

    def __init__(self, consume: Callable[[list], None]):
        self._consume = consume
        self._cond = threading.Condition(threading.Lock())
        self._ready: dict[int, list] = {}
        self.consumed = 0  # jobs consumed, in order
        self._busy = False  # a thread is consuming
        self._failed: tuple[int, BaseException] | None = None
        self._want = 0  # the caller waits until this many are consumed

    def done(self, i: int, results: list) -> None:
        """Job ``i``'s results (on the thread that ran it)."""
        with self._cond:
            if self._failed is not None:
                return
            self._ready[i] = results
            if self._busy:
                return  # the consuming thread takes it in turn
            self._busy = True
        while True:
            with self._cond:
                res = self._ready.pop(self.consumed, None)
                if res is None or self._failed is not None:
                    self._busy = False
                    return
            try:
                self._consume(res)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by wait()
                self.fail(self.consumed, e)
                with self._cond:
                    self._busy = False
                return
            with self._cond:
                self.consumed += 1
                if self.consumed >= self._want:
                    self._cond.notify_all()

    def fail(self, i: int, e: BaseException) -> None:
        """Job ``i`` failed with ``e``: nothing more is consumed."""
        with self._cond:
            if self._failed is None or i < self._failed[0]:
                self._failed = (i, e)
            self._ready.clear()
            self._cond.notify_all()

    def wait(self, n: int) -> None:
        """Until ``n`` jobs are consumed; raises the failure of the lowest job index, if any."""
        with self._cond:
            self._want = n
            while self.consumed < n and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise self._failed[1]


def chunk_jobs(specs: Mapping[str, TensorSpec]) -> list[list[tuple[int, int, str]]]:
    """``(tensor index, chunk index, name)`` in layout order, consecutive chunks grouped into
    jobs of about :data:`ENCODE_JOB_BYTES`."""
    chunks = [(ti, ci, name) for ti, (name, spec) in enumerate(specs.items()) for ci in range(spec.n_chunks)]
    return grouped(chunks, lambda c: specs[c[2]].chunk_bytes(c[1]), ENCODE_JOB_BYTES)


@dataclass(frozen=True)
class _LayoutWork:
    """What :func:`encode_version` derives from a layout alone: made once per layout, not per
    version (chunk spans, dtype look-ups and sums add up per publish on models of many tensors)."""

    #: what it was made of: :data:`ENCODE_JOB_BYTES` and the layout, ``tuple(specs.items())``
    key: tuple[int, tuple[tuple[str, TensorSpec], ...]]
    #: :func:`chunk_jobs` of the layout, each chunk with its span: ``(tensor index, chunk
    #: index, name, start, stop)`` (read only)
    jobs: list[list[tuple[int, int, str, int, int]]]
    #: name → whether the dtype is floating (codec full/2 puts the exponent in one byte plane)
    floating: dict[str, bool]
    #: name → the tensors the unit holds: a group row counts its members (design 007 D3)
    tensors_in: dict[str, int]
    elements_total: int


class LayoutWorks:
    """The per-layout work (:class:`_LayoutWork`) of the last :data:`LAYOUT_WORK_MAX` layouts one
    encoder encoded: a publisher, a sharded rank or a federated site holds one and passes it to
    each :func:`encode_version` call. Found by equality of the specs (frozen values), which
    costs a pointer comparison per tensor when they are the very objects of the last call, as
    an encoder's are."""

    def __init__(self) -> None:
        self._works: deque[_LayoutWork] = deque(maxlen=LAYOUT_WORK_MAX)
        self._lock = threading.Lock()

    def __call__(self, specs: Mapping[str, TensorSpec]) -> _LayoutWork:
        items = tuple(specs.items())
        key = (ENCODE_JOB_BYTES, items)
        with self._lock:
            for work in self._works:
                if work.key == key:
                    return work
        work = _LayoutWork(
            key=key,
            jobs=[[(ti, ci, name, *specs[name].chunk_span(ci)) for ti, ci, name in group] for group in chunk_jobs(specs)],
            floating={n: torch_dtype(sp.dtype).is_floating_point for n, sp in items},
            tensors_in={n: len(sp.members) or 1 for n, sp in items},
            elements_total=sum(sp.numel for _, sp in items),
        )
        with self._lock:
            self._works.append(work)
        return work


def encode_chunk(ti: int, ci: int, new: np.ndarray, old: np.ndarray | None, kind: Kind, floating: bool,
                 changes: list[tuple[Buffer, Buffer, Buffer]] | None = None) -> _Encoded | None:
    """One chunk: a delta against ``old`` (when given) and, for an anchor, a full segment.

    ``old`` (the reference copy's chunk) is advanced to ``new`` in the same pass.
    Returns None for an unchanged chunk of a delta version (it is not listed in the manifest).
    ``changes``: as for :func:`~deltastore.codec.delta.encode_delta_advance`.
    """
    digest = None
    if old is not None:
        # one pass: compare, code the changes, advance ``old`` to ``new``, hash ``new``
        delta, digest = encode_delta_advance(old, new, always_digest=kind == "anchor", changes=changes)
    else:
        delta = None
    if kind == "delta" and delta is None:
        return None
    full = codec.encode_full(new, float_bits=floating) if kind == "anchor" else None
    return _Encoded(ti, ci, digest if digest is not None else state_digest(new), full, delta,
                    full_sha256=sha256_hex(full.data) if full is not None else None,
                    delta_sha256=sha256_hex(delta.data) if delta is not None else None)


def encode_version(
    state: Mapping[str, torch.Tensor],
    specs: Mapping[str, TensorSpec],
    *,
    kind: Kind,
    reference: Mapping[str, torch.Tensor] | None,
    pool: Executor,
    uploader: Executor,
    store: Store,
    threads: int,
    attempt: str | None = None,
    reference_bits: dict[str, np.ndarray] | None = None,
    gathered: dict[str, torch.Tensor] | None = None,
    layouts: LayoutWorks | None = None,
    wait_stored: bool = True,
    changes: dict[str, list[ChunkChange]] | None = None,
    change_lists: Collection[str] | None = None,
    sources: Mapping[str, ChunkSource] | None = None,
    sinks: Mapping[str, Sequence[ChangeSink]] | None = None,
    anchors: dict[str, list[AnchorChunk]] | None = None,
) -> EncodedVersion:
    """Encode every chunk of ``state`` (a bounded number in flight) and upload the packs.

    Args:
        state: name → tensor, validated and of the layout ``specs`` (CPU or device tensors;
            a device tensor is copied to the host chunk by chunk).
        specs: the version's layout, in manifest order.
        kind: ``"anchor"`` (every chunk as a full segment, plus a delta where ``reference``
            has a base) or ``"delta"`` (changed chunks only).
        reference: the parent version's state as published (same layout), or None when there
            is no base (then ``kind`` must be ``"anchor"``). **Advanced in place**: each chunk
            encoded as a delta is overwritten with the new bits on the encode thread, while the
            chunk is hot in cache. After a failure (here or in the commit that follows) the
            reference matches no version and the caller MUST drop it (SPEC §5 step 7).
        pool: encode threads; ``threads`` is its size (it sets how many chunks are in flight).
        uploader: threads for pack uploads (at least ``2 × UPLOADS_IN_FLIGHT`` to overlap
            the delta and full pack streams); not ``pool``: the encode thread packing the
            results waits on uploads.
        store: where packs are uploaded (create-only, content-addressed).
        attempt: the commit attempt's id: packs go under ``objects/<attempt>/`` with their
            role (required).
        reference_bits: the caller's cache of bit views of ``reference``'s tensors (name →
            view), filled here as views are made and used by later calls with the same
            reference: the caller keeps it exactly as long as that reference dict and its
            tensors (a view is of a tensor's memory, and holds its storage). None: views
            are made per call.
        gathered: without a ``reference``, filled with a new 1-D CPU buffer per column-grid
            unit (design 011 D3): its chunks are gathered straight into their unit-order slots
            and encoded from there, so the buffer is the unit's reference copy for the next
            version (``groups.unit_reference`` adopts it) at no extra pass.
        layouts: the caller's :class:`LayoutWorks`, kept across its versions (the chunk jobs
            and spans of a layout, made once); None makes them anew.
        wait_stored: return once every pack is stored. False: return once the last packs are
            handed to ``uploader`` (their keys, sizes and digests known), so that the caller
            can build its manifest while they are stored; it MUST then call
            :meth:`EncodedVersion.wait_stored` before it writes anything that names them.
        changes: of a delta version with the native kernels, filled with one list per tensor
            stored as itself (not in a group row or a column grid): the :class:`ChunkChange` of
            each of its chunks that changed, in no particular order (an empty list: the tensor
            did not change).
        change_lists: the tensors whose :class:`ChunkChange` carry the change list (listing each
            changed element costs the scan a store per element); None: every one.
        sources: tensors (stored as themselves) whose chunks are encoded by the given
            :data:`ChunkSource` instead of from ``state`` (whose tensor then only gives the
            layout's shape and dtype).
        sinks: with ``changes``, tensors whose change lists are handed to the given
            :data:`ChangeSink` (each changed chunk's, on its encode thread); their
            :class:`ChunkChange` carry the lists only when ``change_lists`` names them too.
            A sink that raises fails the version.
        anchors: of an anchor version, the tensors (stored as themselves) named by its keys get
            the :class:`AnchorChunk` of each of their chunks appended, in no particular order.

    Returns:
        The :class:`EncodedVersion`; every pack it lists is stored (with ``wait_stored``).

    Raises:
        StorageError, IntegrityError: a pack upload failed; nothing was committed.
    """
    if kind == "delta" and reference is None:
        raise ValueError("a delta version needs a reference copy")
    if kind != "delta" or not kernels.NATIVE:
        changes = None  # gap planes come from the native kernel, of delta chunks
    if kind != "anchor":
        anchors = None
    plain = [n for n, sp in specs.items() if not sp.members and not sp.chunk_cols]
    if changes is not None:
        changes.update({n: [] for n in plain})
    if sources and not set(sources) <= set(plain):
        raise ValueError(f"sources name tensors not stored as themselves: {sorted(set(sources) - set(plain))}")
    names = list(specs)
    work = (layouts if layouts is not None else LayoutWorks())(specs)
    floating = work.floating

    # Bit views made once per tensor, on this thread (per-chunk torch calls on the encode
    # threads would queue for the GIL behind numpy), as the first job that needs them is
    # submitted: the first chunk is encoding after two views rather than after all of them
    # (a serial start that grows with the tensor count).
    # A device tensor is copied to the host chunk by chunk instead. Group members (design
    # 007) are read when their group's chunk is gathered: through a table of the members'
    # addresses (one native copy per chunk), or member by member when one is not a contiguous
    # CPU tensor. The tables are built on an encode thread, by the first group chunk job, so
    # that it overlaps the other threads' kernels: all at once, from the scan the caller's
    # checks made of ``state`` (groups.member_tables), not per member.
    new_bits: dict[str, np.ndarray] = {}
    ref_bits: dict[str, np.ndarray] = reference_bits if reference_bits is not None and reference is not None else {}
    tables: list[dict[str, MemberTable] | None] = []
    viewed: set[str] = set()

    unit_bufs: dict[str, np.ndarray] = {}  # column-grid units without a reference: their new slots

    def views(name: str) -> None:
        if name in viewed:
            return
        viewed.add(name)
        if not specs[name].members and state[name].is_cpu and not (sources and name in sources):
            new_bits[name] = bits(state[name])
        if reference is not None and name not in ref_bits:
            ref_bits[name] = bits(reference[name])
        elif reference is None and specs[name].chunk_cols:
            buf = torch.empty(specs[name].numel, dtype=torch_dtype(specs[name].dtype))
            unit_bufs[name] = bits(buf)
            if gathered is not None:
                gathered[name] = buf

    def table(spec: TensorSpec) -> np.ndarray | None:
        if not tables:  # a race builds the same tables twice, harmlessly
            # ``state`` is validated (contiguous) and of the layout's shapes
            tables.append(member_tables(specs, state))
        found = tables[0]
        if found is None:  # not reached: ``state`` holds the layout's tensors (checked before)
            return member_pointers(spec, [state[m.name] for m in spec.members], contiguous=True)
        return found[spec.name].ptrs

    def new_chunk(name: str, a: int, b: int) -> np.ndarray:
        """Elements [a, b) of tensor ``name``'s new bits (a view on the CPU)."""
        full = new_bits.get(name)
        if full is not None:
            return full[a:b]
        t = state[name]
        if t.device.type == "cpu":  # a group member: ``state`` holds ``t`` while its view is used
            return host_bits(t)[a:b]
        return bits(t.detach().reshape(-1)[a:b].cpu())

    def grid_chunk(spec: TensorSpec, ci: int, out: np.ndarray | None) -> np.ndarray:
        """Chunk ``ci`` of a column-grid unit in its C order (design 011 D3): one 2-D strided
        copy out of the natural tensor, into ``out`` (a reference slot) or a fresh buffer."""
        full = new_bits.get(spec.name)
        if full is not None:
            return grid.gather(full, spec, ci, out)
        r0, r1, e0, e1 = spec.chunk_block(ci)
        got = bits(state[spec.name].detach().reshape(spec.shape[0], spec.row_elems)[r0:r1, e0:e1].contiguous().cpu())
        if out is None:
            return got
        out[...] = got
        return out

    def job(ti: int, ci: int, name: str, a: int, b: int) -> _Encoded | None:
        spec = specs[name]  # chunk ``ci`` is elements [a, b) of it
        if sources and (source := sources.get(name)) is not None:
            got = source(ci, a, b, ref_bits[name][a:b] if reference is not None else None)
            if got is None:
                return None
            if isinstance(got, AnchorChunk):
                if kind != "anchor":
                    raise ValueError(f"{name!r} chunk {ci}: an anchor's chunk, in a delta version")
                if got.delta is not None and reference is None:
                    raise ValueError(f"{name!r} chunk {ci}: a delta segment, in an anchor without a reference")
                return _Encoded(ti, ci, got.digest, got.full, got.delta, full_sha256=got.full_sha256,
                                delta_sha256=got.delta_sha256)
            if kind != "delta":
                raise ValueError(f"{name!r} chunk {ci}: a delta's chunk, in an anchor")
            seg, digest, sha = got
            return _Encoded(ti, ci, digest, None, seg, delta_sha256=sha if sha is not None else sha256_hex(seg.data))
        # A group row's chunk is gathered from its members into one buffer (design 007 D5), a
        # grid chunk from its block (design 011 D3: into its reference slot for a new anchor).
        if spec.chunk_cols:
            new = grid_chunk(spec, ci, unit_bufs[name][a:b] if reference is None else None)
        elif not spec.members:
            new = new_chunk(name, a, b)
        elif (ptrs := table(spec)) is not None:
            new = np.empty(b - a, dtype=spec.uint_dtype())
            copy_members(new, ptrs, member_starts(spec), a, to_row=True)
        else:
            new = gather(spec, new_chunk, a, b)
        old = ref_bits[name][a:b] if reference is not None else None
        # encode_chunk advances ``old`` while the chunk is hot in cache (the caller drops the
        # reference on failure)
        record = changes.get(name) if changes is not None else None
        keep = record is not None and (change_lists is None or name in change_lists)
        to = sinks.get(name) if sinks and record is not None else None
        listed: list[tuple[Buffer, Buffer, Buffer]] | None = [] if keep or to else None
        enc = encode_chunk(ti, ci, new, old, kind, floating[name], listed)
        if anchors is not None and enc is not None and enc.full is not None and (kept := anchors.get(name)) is not None:
            kept.append(AnchorChunk(ci, a, b, enc.full, enc.full_sha256 or "", enc.delta, enc.delta_sha256, enc.digest))
        if record is not None and enc is not None and enc.delta is not None:
            lists = listed[0] if listed else (None, None, None)
            if to and listed:
                for sink in to:
                    sink(ci, a, *lists)
            record.append(ChunkChange(ci, a, b, enc.delta, enc.delta_sha256 or "", enc.digest,
                                      *(lists if keep else (None, None, None))))
        return enc

    # Delta and full segments go to separate packs, so a subscriber one version behind an
    # anchor range-reads the small delta packs without touching the snapshot.
    delta_packs = _PackWriter(store, uploader, attempt=attempt, role="d")
    full_packs = _PackWriter(store, uploader, attempt=attempt, role="f")
    window = threads * IN_FLIGHT_PER_THREAD

    # The chunk table is built as results are packed, while the threads encode (in layout
    # order, chunks by index, so a tensor's entry is complete when the next tensor's
    # first chunk arrives). A delta chunk's entry is final at once; a full segment's pack
    # index moves past the delta packs, whose number is known only at the end, so an anchor's
    # entries are built then.
    # Entries are built without validation (no pydantic per chunk on the hot path):
    # their fields are the layout's and the pack writers' ints and strs, and encode_manifest
    # proves them, field by field with their types, to be what a reader decodes.
    entries: list[TensorEntry] = []
    tensor_chunks: list[ChunkEntry] = []  # of tensor ``open_tensor``, not yet in ``entries``
    open_tensor = -1
    open_changed = False  # a chunk of ``open_tensor`` has a delta segment
    with_full: list[tuple[_Encoded, SegmentRef | None, SegmentRef]] = []
    elements_changed = 0
    tensors_changed = 0

    def close_tensor() -> None:
        nonlocal tensors_changed
        if not tensor_chunks:
            return
        spec = specs[names[open_tensor]]
        if open_changed:
            tensors_changed += work.tensors_in[spec.name]
        shape = spec.shape if type(spec.shape) is tuple else tuple(spec.shape)
        entries.append(unchecked_entry(TensorEntry, name=spec.name, dtype=spec.dtype, shape=shape,
                                       chunk_rows=int(spec.chunk_rows), chunks=tuple(tensor_chunks)))
        tensor_chunks.clear()

    def add_chunk(ti: int, index: int, digest: str, full: SegmentRef | None, delta: SegmentRef | None) -> None:
        nonlocal open_tensor, open_changed
        if ti != open_tensor:
            close_tensor()
            open_tensor, open_changed = ti, False
        if delta is not None:
            open_changed = True
        tensor_chunks.append(unchecked_entry(ChunkEntry, index=index, digest=digest, full=full, delta=delta))

    def consume(results: list[_Encoded | None]) -> None:
        nonlocal elements_changed
        for enc in results:
            if enc is None:
                continue
            d = delta_packs.add(enc.delta, enc.delta_sha256) if enc.delta is not None else None
            f = full_packs.add(enc.full, enc.full_sha256) if enc.full is not None else None
            enc.delta = enc.full = None  # the bytes now live in the pack writers only
            if d is not None:
                elements_changed += d.n_changed
            if f is None:
                add_chunk(enc.tensor, enc.index, enc.digest, None, d)
            else:  # every chunk of an anchor has a full segment: one path per version, in order
                with_full.append((enc, d, f))

    in_order = _InOrder(consume)

    def stored() -> None:
        try:
            delta_packs.wait_stored()
        finally:
            full_packs.wait_stored()

    def run_job(i: int, group: list) -> None:
        try:
            results = [job(*j) for j in group]
        except BaseException as e:  # noqa: BLE001 - raised by in_order.wait on the caller's thread
            in_order.fail(i, e)
            return
        in_order.done(i, results)

    # The results are packed in layout order by the encode threads (_InOrder); this thread
    # submits jobs, keeping at most ``window`` not yet packed (a delta: waits until half of
    # them are, so that it wakes once per half window, not per job; an anchor: one at a time,
    # its results being full segments: ~0.7x a chunk each).
    running: deque[Future[None]] = deque()  # submitted and maybe not ended (ended ones dropped:
    # a Future is ~11 objects the cyclic collector tracks, design 006 "The cyclic collector")
    # A delta whose every chunk comes from a source (a serving stream derived from the store's
    # delta: the sources hand out segments already encoded) is packed on this thread, in order:
    # a job per chunk would cost a thread hand-off each and nothing would run in parallel.
    inline = kind == "delta" and sources is not None and all(n in sources for n in names)
    try:
        n = len(work.jobs)
        for i, group in enumerate(work.jobs):
            for j in group:
                views(j[2])
            if inline:
                consume([job(*j) for j in group])
                continue
            running.append(pool.submit(run_job, i, group))
            if i + 1 - in_order.consumed > window:
                in_order.wait(i + 1 - (window // WAIT_DIVISOR if kind == "delta" else window))
                while running and running[0].done():
                    running.popleft()
        if not inline:
            in_order.wait(n)  # every result packed: no encode thread is in the pack writers now
        delta_packs.flush()
        full_packs.flush()
        if wait_stored:
            stored()
    except BaseException as e:
        # No encode thread is left in the pack writers (consumption stopped, every job ended);
        # then a pack being streamed is dropped (its temp file removed); packs already stored
        # are orphans of this attempt, collected as any failed attempt's (SPEC §11).
        in_order.fail(-1, e)
        for f in running:
            f.cancel()
        wait(running)
        delta_packs.abort()
        full_packs.abort()
        raise
    offset = len(delta_packs.blobs)  # full packs follow the delta packs in the manifest
    for enc, d, f in with_full:
        add_chunk(enc.tensor, enc.index, enc.digest, unchecked_entry(SegmentRef, **{**f.__dict__, "blob": f.blob + offset}), d)
    close_tensor()
    tensors_total = sum(work.tensors_in.values())
    if kind == "anchor" and reference is None:
        tensors_changed = tensors_total
        elements_changed = work.elements_total
    stats = Stats(
        bytes_stored=delta_packs.bytes_written + full_packs.bytes_written,
        tensors_changed=tensors_changed,
        elements_changed=elements_changed,
        tensors_total=tensors_total,
        elements_total=work.elements_total,
        delta_bytes=delta_packs.bytes_written if attempt is not None else None,
        full_bytes=full_packs.bytes_written if attempt is not None else None,
    )
    # the chunk table lives as long as the writer's last version: out of the collector's sets
    untrack_entries(entries)
    return EncodedVersion(entries=tuple(entries), stats=stats, blobs=tuple(delta_packs.blobs + full_packs.blobs),
                          pending=None if wait_stored else stored)
