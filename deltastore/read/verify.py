"""Checking a store's versions whole (``Subscriber.verify``, ``deltastore verify``).

Unlike a pull, which reads only the segments one path needs, a check fetches every segment each
manifest lists, full and delta (an anchor's delta segments too), checks its SHA-256, decodes it,
and checks the chunk it produces against the recorded digest. Versions are replayed oldest
first, so a delta is applied to the verified state of its parent. Problems are collected, not
raised, so one run names every bad object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltastore import codec
from deltastore._util.jobs import grouped
from deltastore.errors import CorruptObjectError, DeltastoreError
from deltastore.layout.tensors import TensorSpec, state_digest
from deltastore.read.fetch import Fetcher, SegmentErrors, Segments, batched
from deltastore.read.plan import Manifests, Step, check_entries, layout

logger = logging.getLogger(__name__)

#: A chunk's segments to check, keyed by ``(unit, chunk index, "full" | "delta")``.
_Steps = dict[tuple[str, int, str], Step]


@dataclass(frozen=True)
class Problem:
    """One bad segment or chunk found by :meth:`Subscriber.verify`.

    Attributes:
        version: the version whose manifest lists it.
        manifest: that manifest's key.
        message: what is wrong, naming the tensor, chunk, segment and pack.
    """

    version: int
    manifest: str
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`Subscriber.verify` checked, and every problem it found.

    Attributes:
        url: the store.
        versions: the versions whose manifests were checked, oldest first.
        tensors: per version, the number of tensors in its layout.
        segments: segments fetched, SHA-256-checked and decoded.
        problems: every bad segment or chunk (empty when the store is sound).
        streams: with ``verify(streams=True)``, the report of each serving stream checked, by
            format (SPEC §15).
        ok: no problems, here or in a stream's report.
    """

    url: str
    versions: list[int]
    tensors: dict[int, int]
    segments: int
    problems: list[Problem]
    streams: dict[str, VerifyReport] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.streams.values())


def verify_chain(ms: Manifests, *, url: str, fetcher: Fetcher, pool: ThreadPoolExecutor,
                 check_size: Callable[[dict[str, TensorSpec], int], None]) -> VerifyReport:
    """Check every segment of the versions ``ms`` (oldest first, from an anchor).

    Args:
        ms: the manifests to check; the first is an anchor.
        url: the store, for the report.
        fetcher: reads the segments (each SHA-256-checked).
        pool: the decode threads.
        check_size: ``check_size(layout, version)`` refuses a layout too large to decode.
    """
    problems: list[Problem] = []
    tensors: dict[int, int] = {}
    state: dict[tuple[str, int], np.ndarray | None] = {}  # verified chunk bits; None: unknown
    specs: dict[str, TensorSpec] = {}
    n_segments = 0
    for key, m in ms:
        if m.kind == "anchor":
            if m.delta_base is None:
                state.clear()  # a new start: nothing carries over
            specs = layout(m)
            check_size(specs, m.version)
        tensors[m.version] = len(specs)
        try:
            check_entries(key, m, specs, m.anchor)
        except CorruptObjectError as e:
            problems.append(Problem(m.version, key, str(e)))
            continue
        items = [(t.name, c) for t in m.tensors for c in t.chunks]
        steps = {
            (name, c.index, which): Step(0, m.blobs[seg.blob], seg)
            for name, c in items
            for which, seg in (("full", c.full), ("delta", c.delta))
            if seg is not None
        }
        n_segments += len(steps)
        for batch in batched(items, lambda it: sum(seg.length for seg in (it[1].full, it[1].delta) if seg is not None)):
            errors: SegmentErrors = {}
            want = [steps[k] for name, c in batch for w in ("full", "delta") if (k := (name, c.index, w)) in steps]
            data = fetcher.fetch(want, errors)

            def check(group: list[tuple[str, Any]]) -> list[tuple[tuple[str, int], np.ndarray | None, list[str]]]:
                return [_verify_chunk(name, c, specs[name], state.get((name, c.index)), steps, data, errors) for name, c in group]

            groups = grouped(batch, lambda it: specs[it[0]].chunk_bytes(it[1].index))
            # All results first: the checks read ``state``, which is updated only after them.
            for results in list(pool.map(check, groups)):
                for k, raw, msgs in results:
                    state[k] = raw
                    problems.extend(Problem(m.version, key, msg) for msg in msgs)
    for p in problems:
        logger.error("version %d (%s): %s", p.version, p.manifest, p.message)
    return VerifyReport(url, [m.version for _, m in ms], tensors, n_segments, problems)


def _verify_chunk(
    name: str, c: Any, spec: TensorSpec, base: np.ndarray | None, steps: _Steps, data: Segments, errors: SegmentErrors,
) -> tuple[tuple[str, int], np.ndarray | None, list[str]]:
    """Check both segments of one chunk entry: ``(key, verified bits or None, problems)``.

    A delta segment is applied to ``base`` (the verified bits at the parent) and checked
    against the digest; with no verified base it is still decoded (onto zeros), which checks
    its structure but not its values.
    """
    a, b = spec.chunk_span(c.index)
    problems: list[str] = []
    result: np.ndarray | None = None
    for which in ("delta", "full"):
        st = steps.get((name, c.index, which))
        if st is None:
            continue
        what = f"chunk {name}[{c.index}] {which} segment ({st.ref.codec}) at {st.ref.offset} of pack {st.blob.key!r}"
        if st.where in errors:
            problems.append(f"{what}: {errors[st.where]}")
            continue
        try:
            if which == "full":
                raw = codec.decode_full(data[st.where], codec=st.ref.codec, dtype=spec.uint_dtype(), count=b - a)
                digest = state_digest(raw)
            else:
                raw = base.copy() if base is not None else np.zeros(b - a, dtype=spec.uint_dtype())
                _, digest = codec.apply_delta_digests(raw, data[st.where], codec=st.ref.codec, after=base is not None)
        except (DeltastoreError, ValueError) as e:
            problems.append(f"{what} does not decode: {type(e).__name__}: {e}")
            continue
        if which == "delta" and base is None:
            continue  # structure checked; values unknowable without a verified parent
        if digest != c.digest:
            problems.append(f"{what} does not reproduce the chunk's digest {c.digest}")
            continue
        result = raw
    return (name, c.index), result, problems
