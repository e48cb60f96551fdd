"""Deterministic model states: the oracle recomputes the exact bits of any published step.

A trainer ``t`` of seed ``s`` publishes, at its step ``k``, :meth:`Model.state` ``(k)``: step 0 is
random bits (NaN payloads, ``-0.0`` and subnormals included, as random bits give them), each
later step replaces about :data:`EDIT_FRACTION` of the elements of most tensors with new random
bits. The manifest records ``step = t * STEP_BASE + k``, so a version's expected bits follow from
its manifest alone (:class:`Oracle`), in any process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from deltastore.layout.tensors import TensorSpec, bits

#: Name, dtype, shape: every element width, a 0-d tensor, several chunks each at CHUNK_BYTES.
LAYOUT: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("w.bf16", "bfloat16", (64, 32)),
    ("w.f32", "float32", (40, 16)),
    ("b.f16", "float16", (48,)),
    ("i.i64", "int64", (30,)),
    ("m.u8", "uint8", (100,)),
    ("s.f32", "float32", ()),
)
#: Chunk size handed to Publisher: small, so that these tiny tensors span several chunks (the
#: unit of change detection, planning and rollback).
CHUNK_BYTES = 512
#: The layout of ``--grid`` (design 011): column grids, ragged both ways, chunks of about
#: CHUNK_BYTES. w.bf16 is 4 row blocks (20, 20, 20, 4) × 3 column blocks (12, 12, 8) of at most
#: 480 B; w.f32 is 2 row blocks (24, 16) × 4 column blocks (5, 5, 5, 1) of at most 480 B. The
#: tensors are below the public policy's size floor, so campaigns set the publisher's internal
#: hook (:func:`with_layout`); the oracle is unchanged (natural-order bits).
GRID_SPECS: dict[str, TensorSpec] = {
    "w.bf16": TensorSpec("w.bf16", "bfloat16", (64, 32), 20, (), 12),
    "w.f32": TensorSpec("w.f32", "float32", (40, 16), 24, (), 5),
}
#: Elements given new bits per step in a changed tensor: sparse, as in RL fine-tuning.
EDIT_FRACTION = 0.02
#: Probability that a tensor is left unchanged at a step (delta manifests then omit it).
UNCHANGED_P = 0.3
#: Steps of different trainers never collide: step = trainer * STEP_BASE + k.
STEP_BASE = 1_000_000
#: What ``--formats`` quantizes: the 2-D weights (``w.bf16``, and ``w.f32`` for FP8: MXFP8 needs a
#: last dimension of 32), since no LAYOUT name matches the engines' ``*.weight``.
FORMAT_INCLUDE = ("w.*",)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "int64": torch.int64, "uint8": torch.uint8}  # fmt: skip
_SIGNED = {np.uint8: None, np.uint16: np.int16, np.uint32: np.int32, np.uint64: np.int64}


def with_layout(pub: Any, grid: bool) -> Any:
    """``pub`` (a new Publisher), writing :data:`GRID_SPECS` when ``grid`` (``--grid``)."""
    if grid:
        pub._explicit_specs = GRID_SPECS
    return pub


def serving_formats(names: str | None) -> tuple[Any, ...]:
    """The serving formats of ``--formats`` (comma-separated names; empty: none), quantizing
    :data:`FORMAT_INCLUDE` where they quantize."""
    from deltastore.serving.formats import SCALE_SUFFIX, ServingFormat

    return tuple(ServingFormat(n, include=FORMAT_INCLUDE if n in SCALE_SUFFIX else None)
                 for n in (names.split(",") if names else ()))


def _width(dtype: str) -> int:
    return torch.empty((), dtype=_TORCH[dtype]).element_size()


class Model:
    """The states of one trainer; states are cached, so a sweep over steps costs O(steps)."""

    def __init__(self, seed: int, trainer: int = 0, fork: tuple[int, int] | None = None, *, sparse: bool = False):
        """``fork=(parent, k)``: a run restarted from trainer ``parent``'s step ``k`` (same bits
        up to ``k``, its own edits after), as when a new run starts from the same checkpoint.
        ``sparse``: each step edits a few elements of one tensor only (most chunks unchanged)."""
        self.seed, self.trainer, self.sparse = seed, trainer, sparse
        self._states: dict[int, dict[str, np.ndarray]] = {}
        if fork is not None:
            parent = Model(seed, fork[0], sparse=sparse)
            for k in range(fork[1] + 1):
                self._states[k] = parent.raw(k)

    def _rng(self, k: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.trainer, k])

    def raw(self, k: int) -> dict[str, np.ndarray]:
        """Unsigned bit patterns of step ``k`` (do not modify)."""
        if k in self._states:
            return self._states[k]
        if k == 0:
            rng = self._rng(0)
            out = {}
            for name, dtype, shape in LAYOUT:
                u = _UINT[_width(dtype)]
                out[name] = rng.integers(0, np.iinfo(u).max, size=shape, dtype=u, endpoint=True)
        else:
            start = max((s for s in self._states if s < k), default=None)
            if start is None:
                start = 0
                self.raw(0)
            for j in range(start + 1, k):
                self.raw(j)
            prev = self._states[k - 1]
            rng = self._rng(k)
            out = {}
            only = LAYOUT[int(rng.integers(0, len(LAYOUT)))][0] if self.sparse else None
            for name, _, _ in LAYOUT:
                a = prev[name].copy()
                flat = a.reshape(-1)
                if only is not None:
                    if name == only:
                        idx = rng.integers(0, flat.size, size=2)
                        flat[idx] = rng.integers(0, np.iinfo(a.dtype).max, size=2, dtype=a.dtype, endpoint=True)
                elif rng.random() >= UNCHANGED_P:
                    n = max(1, int(flat.size * EDIT_FRACTION))
                    idx = rng.integers(0, flat.size, size=n)
                    flat[idx] = rng.integers(0, np.iinfo(a.dtype).max, size=n, dtype=a.dtype, endpoint=True)
                out[name] = a
        self._states[k] = out
        return out

    def state(self, k: int) -> dict[str, torch.Tensor]:
        """The state dict a trainer publishes at its step ``k`` (fresh tensors)."""
        out = {}
        for name, dtype, shape in LAYOUT:
            a = self.raw(k)[name].copy()
            signed = _SIGNED[a.dtype.type]
            t = torch.from_numpy(a if signed is None else a.view(signed)).view(_TORCH[dtype])
            out[name] = t.reshape(shape)
        return out

    def step_id(self, k: int) -> int:
        return self.trainer * STEP_BASE + k


class Oracle:
    """Expected bits of any published ``step`` (= trainer * STEP_BASE + k) of one seed."""

    def __init__(self, seed: int, forks: Mapping[int, tuple[int, int]] | None = None, *, sparse: bool = False):
        self.seed, self.sparse = seed, sparse
        self.forks = dict(forks or {})
        self._models: dict[int, Model] = {}

    def model(self, trainer: int) -> Model:
        if trainer not in self._models:
            self._models[trainer] = Model(self.seed, trainer, self.forks.get(trainer), sparse=self.sparse)
        return self._models[trainer]

    def expected(self, step: int) -> dict[str, np.ndarray]:
        return self.model(step // STEP_BASE).raw(step % STEP_BASE)

    def same_bits(self, a: int, b: int) -> bool:
        """Whether steps ``a`` and ``b`` have bit-identical states (a step may change nothing:
        each tensor is left unchanged with probability :data:`UNCHANGED_P`)."""
        x, y = self.expected(a), self.expected(b)
        return all(np.array_equal(x[n], y[n]) for n in x)

    def differs_in(self, fmt: Any, state: Mapping[str, torch.Tensor], step: int | None) -> str | None:
        """None when ``state`` holds exactly the bits of serving format ``fmt`` (a
        ``ServingFormat``) of ``step``: the reference derivation of the step's state; else why
        not. ``fmt`` None: the bits as published (:meth:`differs`)."""
        from deltastore.serving.formats import derive

        if fmt is None:
            return self.differs(state, step)
        if step is None or step < 0:
            return f"version has no usable step ({step!r})"
        want = derive(self.model(step // STEP_BASE).state(step % STEP_BASE), fmt)
        if set(state) != set(want):
            return f"{fmt.name}: tensor names differ: {sorted(set(state) ^ set(want))}"
        for name, w in want.items():
            t = state[name]
            if t.dtype != w.dtype or t.shape != w.shape:
                return f"{fmt.name} {name}: {t.dtype}{list(t.shape)}, expected {w.dtype}{list(w.shape)}"
            if bits(t.detach().cpu().contiguous()).tobytes() != bits(w.contiguous()).tobytes():
                return f"{fmt.name} {name}: bits differ from the reference derivation of step {step}"
        return None

    def differs(self, state: Mapping[str, torch.Tensor], step: int | None) -> str | None:
        """None when ``state`` holds exactly the bits of ``step``; else why not."""
        if step is None or step < 0:
            return f"version has no usable step ({step!r})"
        exp = self.expected(step)
        if set(state) != set(exp):
            return f"tensor names differ: {sorted(set(state) ^ set(exp))}"
        for name, dtype, shape in LAYOUT:
            t = state[name]
            if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != shape:
                return f"{name}: {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}"
            got = bits(t.detach().cpu().contiguous()).reshape(-1)
            want = exp[name].reshape(-1)
            if got.tobytes() != want.tobytes():
                n = int(np.count_nonzero(got != want))
                return f"{name}: {n} element(s) differ in bits from step {step}"
        return None
