"""Merging a round's site results (design 009 D6). Pure: tensors in, tensors out.

A merge function is called once per tensor that at least one accepted site changed, as
``merge(name, base, results, weights)``: ``base`` is the round's global tensor, ``results`` one
tensor per accepted site (equal to ``base`` where the site changed nothing), ``weights`` the
sites' weights (summing to 1). It returns a tensor of ``base``'s dtype and shape.

A *state merge* (a :class:`StateMerge`) is called once per round, for merges that read several
tensors at once (LoRA's stacking merge, :mod:`deltastore.federated.lora`), as
``merge(base, sites, weights)``:
``base`` is the round's global state, ``sites`` one mapping per accepted site of the tensors
it changed (whole tensors, in ``base``'s dtype), ``weights`` as above. It returns the tensors
of the next global version that differ from ``base`` (each of its tensor's dtype and shape);
every tensor it leaves out stays ``base``'s. It must not modify ``base`` or ``sites`` (``base``
is the aggregator's own state).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

import torch

MergeFn = Callable[[str, torch.Tensor, Sequence[torch.Tensor], Sequence[float]], torch.Tensor]


class StateMerge(ABC):
    """A merge of a round's whole state (see the module docstring), given to an aggregator as
    its ``merge``: subclass it and define ``__call__``; its ``repr`` names it in the global
    version's metadata."""

    @abstractmethod
    def __call__(self, base: Mapping[str, torch.Tensor], sites: Sequence[Mapping[str, torch.Tensor]],
                 weights: Sequence[float]) -> Mapping[str, torch.Tensor]:
        """The tensors of the next global version that differ from ``base``."""


def weighted_average(name: str, base: torch.Tensor, results: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``base + Σ w_i (result_i − base)`` in fp32, cast to ``base``'s dtype; elements that no
    site changed (bit for bit) stay ``base``'s bits exactly (so ``-0.0`` and NaN payloads too,
    which ``x + 0.0`` would not keep).

    Non-floating tensors: where some site changed an element, the first site that changed it
    wins (averaging integers or booleans has no meaning worth guessing).
    """
    changed = torch.zeros(base.shape, dtype=torch.bool)
    for r in results:
        changed |= bit_pattern(r) != bit_pattern(base)
    if not base.is_floating_point():
        out = base.clone()
        taken = torch.zeros_like(changed)
        for r in results:
            mine = (bit_pattern(r) != bit_pattern(base)) & ~taken
            out[mine] = r[mine]
            taken |= mine
        return out
    b32 = base.to(torch.float32)
    acc = b32.clone()
    for r, w in zip(results, weights):
        acc += float(w) * (r.to(torch.float32) - b32)
    return torch.where(changed, acc.to(base.dtype), base)


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as integers of its width (compares NaNs and ±0 by bits)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width) if t.dtype != torch.bool else t.view(torch.uint8)
