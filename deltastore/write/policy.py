"""The writers' settings as values (SPEC §5, designs 005, 007, 010, 011).

:class:`Publisher <deltastore.write.publisher.Publisher>` and :class:`ShardedPublisher
<deltastore.write.sharded.ShardedPublisher>` take the same four frozen policies instead of long
argument lists; each one is validated once, when it is made, and may be shared by any number of
writers::

    from deltastore import AnchorPolicy, LayoutPolicy, Publisher, WriterPolicy

    writer = WriterPolicy(threads=4, writer_id="trainer-0")
    with Publisher("s3://bucket/run", anchor_policy=AnchorPolicy(every=50), writer_policy=writer) as pub:
        ...

- :class:`WriterPolicy`: who writes and how safely (ownership, resume, deadline, threads).
- :class:`AnchorPolicy`: when a version is a full snapshot instead of a delta.
- :class:`LayoutPolicy`: how a new layout cuts tensors into chunks (and groups small ones).
- :class:`AsyncPolicy`: what ``publish_async`` does when the store is slower than training.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S, DTYPE_WIDTHS
from deltastore.layout.groups import GROUP_MEMBER_MAX_BYTES, group_specs, tied_names
from deltastore.layout.tensors import (
    CHUNK_TARGET_BYTES,
    SLICE_CHUNK_MIN_BYTES,
    TensorSpec,
    dtype_name,
    grid_spec_for,
    spec_for,
)

logger = logging.getLogger(__name__)

#: ``AnchorPolicy("every")``: a full snapshot every this many versions bounds how much history
#: a new worker replays (the CLI's policy).
DEFAULT_ANCHOR_EVERY = 20
#: ``AnchorPolicy("cost")`` (design 005 D7): an anchor once the delta bytes written since the
#: last anchor reach this multiple of its full bytes. At 1 (ski rental) a new worker reads at
#: most twice an anchor's bytes and anchors are at most half of the bytes written.
DEFAULT_ANCHOR_COST_RATIO = 1.0
#: ``LayoutPolicy(group_small_tensors="auto")`` groups a layout with at least this many small
#: tensors: below it, per-tensor costs add well under 0.1 s per version and the store stays
#: schema 3; MoE experts and per-layer norms of large models run to thousands, where groups cut
#: publish and pull 10-40× (design 007).
GROUP_AUTO_MIN_TENSORS = 1000
#: Snapshots waiting behind the one being published, by default: one lets encoding of step
#: n overlap training of step n+1 while holding at most two snapshots (+ the reference copy).
DEFAULT_MAX_PENDING = 1

AnchorRule = Literal["cost", "every"]
ANCHOR_RULES: tuple[str, ...] = ("cost", "every")
AsyncMode = Literal["block", "latest"]
ASYNC_MODES: tuple[str, ...] = ("block", "latest")


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its own fields


@dataclass(frozen=True)
class WriterPolicy:
    """Who writes a store and how safely: ownership, resume, the attempt deadline, threads.

    Args:
        writer_id: id recorded in manifests and HEAD (default ``host-pid-random``; a
            ShardedPublisher adds ``-r<rank>``).
        threads: encode threads (default: all cores), ≥ 1.
        takeover: claim the store on open, fencing any older publisher (default True); an
            empty store is claimed too (HEAD at version 0 without a manifest).
        resume: when the store already has versions and the writer holds none (a restart, a
            CLI call, after a ConflictError), read the head version back so that the next
            version is a delta on it rather than a full anchor (default True). A
            ShardedPublisher reads back each rank's own rows (design 010 D11).
        skip_unchanged: a state bit-identical to the head version is not committed again
            (default True): no new version, no worker woken for nothing; ``publish`` returns
            the head's VersionInfo. ``step`` and ``metadata`` alone do not make a new version;
            ``anchor=True`` always commits. A ShardedPublisher commits every call.
        max_attempt_s: the attempt deadline (design 005 D3): a commit attempt whose HEAD write
            would be sent more than this many seconds after its first upload (on a clock that
            counts suspended time, :func:`deltastore.write.commit.attempt_clock`) is abandoned
            with CommitAbandonedError, since GC may have collected its objects. In (0, 6 h]
            (GC's grace period must exceed it); default 6 h.
        allow_unsafe_store: write to a store without atomic conditional writes (this writer
            promises to be the only one); otherwise an ``s3://`` endpoint is probed for
            If-None-Match/If-Match support (docs/SPEC.md §1.1).
        allow_unsigned: without a signing key, publish onto a store whose head version is
            signed (default False: SigningRequiredError before anything is written).

    Raises:
        ValueError: a value out of range (the message names the field).

    Example::

        WriterPolicy(threads=4, takeover=False, max_attempt_s=600)
    """

    writer_id: str | None = None
    threads: int | None = None
    takeover: bool = True
    resume: bool = True
    skip_unchanged: bool = True
    max_attempt_s: float = DEFAULT_MAX_ATTEMPT_S
    allow_unsafe_store: bool = False
    allow_unsigned: bool = False

    def __post_init__(self) -> None:
        if self.writer_id is not None and (not isinstance(self.writer_id, str) or not self.writer_id):
            raise ValueError(f"writer_id must be a non-empty string or None, got {self.writer_id!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an int ≥ 1 or None, got {self.threads!r}")
        if not (isinstance(self.max_attempt_s, (int, float)) and 0 < self.max_attempt_s <= DEFAULT_MAX_ATTEMPT_S):
            # GC's grace period (default 24 h) must exceed every writer's deadline by a clock
            # margin (design 005 D3); a writer cannot know the grace, so it stays ≤ 6 h.
            raise ValueError(f"max_attempt_s must be in (0, {DEFAULT_MAX_ATTEMPT_S}] seconds, got {self.max_attempt_s!r}")


@dataclass(frozen=True)
class AnchorPolicy:
    """When a version is written as an anchor (a full snapshot) rather than a delta.

    Besides this policy, the first version, a layout change, a version without a base and
    ``anchor=True`` are always anchors.

    Args:
        rule: ``"cost"`` (design 005 D7): once the delta bytes written since the last anchor
            reach ``cost_ratio`` × that anchor's full bytes; ``"every"``: every ``every``
            versions. Default: ``"every"`` when ``every`` is given, else ``"cost"``.
        cost_ratio: β of the cost rule (default 1.0), a finite number > 0.
        every: under ``"every"``, the cadence (default 20); under ``"cost"``, an optional cap:
            an anchor at the latest after this many versions (default None: no cap).

    Raises:
        ValueError: an unknown rule or a value out of range.

    Example::

        AnchorPolicy()                    # cost rule, β = 1
        AnchorPolicy(every=50)            # a snapshot every 50 versions
        AnchorPolicy("cost", every=500)   # cost rule, at least one anchor per 500 versions
    """

    rule: AnchorRule | None = None
    cost_ratio: float = DEFAULT_ANCHOR_COST_RATIO
    every: int | None = None

    def __post_init__(self) -> None:
        rule = self.rule if self.rule is not None else ("every" if self.every is not None else "cost")
        if rule not in ANCHOR_RULES:
            raise ValueError(f"anchor rule must be one of {ANCHOR_RULES}, got {self.rule!r}")
        _set(self, "rule", rule)
        if rule == "every" and self.every is None:
            _set(self, "every", DEFAULT_ANCHOR_EVERY)
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"anchor every must be an int ≥ 1, got {self.every!r}")
        ratio = self.cost_ratio
        if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"anchor cost_ratio must be a finite number > 0, got {ratio!r}")
        _set(self, "cost_ratio", float(ratio))


@dataclass(frozen=True)
class LayoutPolicy:
    """How a new layout cuts the tensors into chunks (SPEC §2). A resumed writer keeps the
    layout of the version it resumes from until a layout change (or ``resume=False``).

    Args:
        chunk_bytes: target chunk size (default 16 MiB), ≥ 1.
        slice_align: lay new layouts out for tensor-parallel readers of degree N dividing this
            (e.g. :data:`deltastore.layout.tensors.SLICE_ALIGN` = 8 for N = 1, 2, 4, 8): chunk
            edges fall on every 1/slice_align of a tensor's rows where they fit, so a partial
            Subscriber holding rows r/N reads about its share (docs/scale.md §5), at the cost
            of more, smaller chunks. Default None: chunks of about ``chunk_bytes``. A
            ShardedPublisher uses it for the column grid only (rows follow the pieces).
        column_slices: fnmatch patterns of the tensors tensor-parallel readers cut by columns
            (dimension 1), e.g. :data:`deltastore.layout.select.ROW_PARALLEL`; needs
            ``slice_align`` (the degree N). Each matched tensor of a new layout gets a column
            grid (design 011, SPEC §2): chunks of ``C/N`` columns, so a rank reading its
            columns reads only its own chunks. Not gridded (one INFO line names them): tensors
            of fewer than 2 dimensions or N columns, of at most N × 32 KiB, tied tensors. A
            whole reader pays about one extra copy of the gridded tensors per publish and two
            per ``pull_into`` (design 011 D8), so it is opt-in. Default: none.
        group_small_tensors: pack small tensors (≤ 256 KiB) of one dtype into shared ~4 MiB
            rows of new layouts (design 007): per-segment and per-entry costs are then paid per
            4 MiB, not per tensor. A store with groups is schema 4. ``"auto"`` (default): only
            a layout with at least :data:`GROUP_AUTO_MIN_TENSORS` small tensors; True: always;
            False: never. Gridded and tied tensors are never grouped. A ShardedPublisher never
            groups (True is refused there).

    Raises:
        ValueError: a value of the wrong type or range, or ``column_slices`` without
            ``slice_align``.

    Example::

        LayoutPolicy(slice_align=8, column_slices=ROW_PARALLEL)
    """

    chunk_bytes: int = CHUNK_TARGET_BYTES
    slice_align: int | None = None
    column_slices: tuple[str, ...] = ()
    group_small_tensors: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int ≥ 1, got {self.chunk_bytes!r}")
        align = self.slice_align
        if align is not None and (isinstance(align, bool) or not isinstance(align, int) or align < 1):
            raise ValueError(f"slice_align must be an int ≥ 1 or None, got {align!r}")
        patterns = self.column_slices
        if patterns is None:
            patterns = ()
        if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"column_slices must be a sequence of fnmatch patterns, got {patterns!r}")
        if patterns and align is None:
            raise ValueError("column_slices needs slice_align: the tensor-parallel degree (e.g. slice_align=8)")
        _set(self, "column_slices", tuple(patterns))
        if self.group_small_tensors not in (True, False, "auto"):
            raise ValueError(f'group_small_tensors must be True, False or "auto", got {self.group_small_tensors!r}')

    def units(self, state: Mapping[str, torch.Tensor],
              explicit: Mapping[str, TensorSpec] | None = None) -> dict[str, TensorSpec]:
        """The units of a new layout of ``state``: a spec per tensor (a column grid where
        ``column_slices`` asks), small ones grouped as ``group_small_tensors`` says.

        ``explicit``: tensor name → the spec to use instead (each with the tensor's dtype and
        shape; ValueError otherwise), e.g. a grid this policy would not choose; such a
        spec is never grouped when it has a grid.
        """
        specs = {n: spec_for(n, t, self.chunk_bytes, self.slice_align) for n, t in state.items()}
        gridded: frozenset[str] = frozenset()
        if self.column_slices:
            specs.update(self._grid_specs(state))
            gridded = frozenset(n for n, sp in specs.items() if sp.chunk_cols)
        if explicit:
            for n, sp in explicit.items():
                if n in specs:
                    if (sp.name, sp.dtype, sp.shape) != (n, specs[n].dtype, specs[n].shape):
                        raise ValueError(f"the explicit spec of {n!r} is {sp.dtype}{list(sp.shape)}, the tensor "
                                         f"{specs[n].dtype}{list(specs[n].shape)}")
                    specs[n] = sp
            gridded = frozenset(n for n, sp in specs.items() if sp.chunk_cols)
        if self.group_small_tensors == "auto":
            small = sum(1 for sp in specs.values() if 0 < sp.nbytes <= GROUP_MEMBER_MAX_BYTES)
            if small < GROUP_AUTO_MIN_TENSORS:
                return specs
        elif not self.group_small_tensors:
            return specs
        return group_specs(specs, self.chunk_bytes, exclude=tied_names(state) | gridded)

    def _grid_specs(self, state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
        """Column grids of a new layout (design 011 D6): the tensors matching ``column_slices``
        that can take one (:func:`~deltastore.layout.tensors.grid_spec_for`), except tied
        tensors (the read engine updates a storage shared by two names once, through its
        owner, which needs both chunked alike). The matched tensors left ungridded are logged
        once per layout."""
        assert self.slice_align is not None
        matched = [n for n in state if any(fnmatch.fnmatchcase(n, p) for p in self.column_slices)]
        if not matched:
            return {}
        tied = tied_names(state, max_bytes=None)
        out: dict[str, TensorSpec] = {}
        left: list[str] = []
        for n in matched:
            sp = None if n in tied else grid_spec_for(n, state[n], self.slice_align, self.chunk_bytes)
            if sp is None:
                left.append(n)
            else:
                out[n] = sp
        if left:
            logger.info("column_slices: %d of %d matched tensor(s) get no column grid (fewer than 2 dimensions or "
                        "%d columns, at most %d bytes, one column block, or tied): %s", len(left), len(matched),
                        self.slice_align, self.slice_align * SLICE_CHUNK_MIN_BYTES,
                        ", ".join(left[:20]) + (" …" if len(left) > 20 else ""))
        return out


@dataclass(frozen=True)
class AsyncPolicy:
    """What ``Publisher.publish_async`` does when the store is slower than training.

    Args:
        mode: ``"block"`` (default): at most ``max_pending`` snapshots wait behind the one
            being published; a further ``publish_async`` blocks (before copying anything)
            until one starts, and every call is published. ``"latest"``: ``publish_async``
            never waits; a newer snapshot replaces the newest one still waiting, which is never
            published (its Future raises VersionSkippedError). Either way at most
            ``max_pending + 1`` snapshots are alive at once (plus the reference copy).
        max_pending: snapshots that may wait behind the one being published (≥ 1; default 1:
            encoding step n overlaps training step n+1 with two snapshots alive).

    Raises:
        ValueError: an unknown mode or ``max_pending`` < 1.

    Example::

        AsyncPolicy("latest")  # never stall training; skip snapshots the store cannot keep up with
    """

    mode: AsyncMode = "block"
    max_pending: int = DEFAULT_MAX_PENDING

    def __post_init__(self) -> None:
        if self.mode not in ASYNC_MODES:
            raise ValueError(f"async mode must be one of {ASYNC_MODES}, got {self.mode!r}")
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"max_pending must be an int ≥ 1, got {self.max_pending!r}")


def check_dtype(dtype: torch.dtype | None) -> None:
    """Refuse a served ``dtype`` that is not a floating dtype deltastore stores (or None).

    Raises:
        ValueError: naming the dtype.
    """
    if dtype is not None and not (
        isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype_name(dtype) in DTYPE_WIDTHS
    ):
        raise ValueError(f"dtype must be a floating torch.dtype deltastore stores (e.g. torch.bfloat16) or None, got {dtype!r}")


def check_policy(value: object, cls: type, name: str) -> None:
    """Refuse a constructor argument that is not a ``cls`` (e.g. an old keyword's string)."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {cls.__name__}(...), got {value!r}")


__all__ = [
    "ANCHOR_RULES",
    "ASYNC_MODES",
    "DEFAULT_ANCHOR_COST_RATIO",
    "DEFAULT_ANCHOR_EVERY",
    "DEFAULT_MAX_PENDING",
    "GROUP_AUTO_MIN_TENSORS",
    "AnchorPolicy",
    "AsyncPolicy",
    "LayoutPolicy",
    "WriterPolicy",
    "check_dtype",
    "check_policy",
]
