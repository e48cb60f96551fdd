"""Late results (design 009 D5): what a round does with a site result that arrived after the
round it was computed for had closed.

A *late result* is a site version based on the previous round's base that the previous round
did not merge. :class:`LatePolicy` says whether it is dropped (the default) or carried into
the open round with a staleness weight, as asynchronous federated methods (FedAsync, FedBuff)
do. Carrying translates the site's change onto the open round's base (:func:`carried_tensor`):
pure, tensors in, a tensor out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from deltastore.federated.merge import bit_pattern

LateMode = Literal["drop", "carry"]

#: FedAsync's polynomial staleness discount ``(1 + τ)^-a`` with ``a = 1`` at one round of
#: staleness, the only one carried: a late change counts half as much as a fresh one.
DEFAULT_LATE_WEIGHT = 0.5


@dataclass(frozen=True)
class LatePolicy:
    """What a round does with late results (design 009 D5).

    Attributes:
        mode: ``"drop"`` (default): a late result is reported and not merged; the site catches
            up at its next round. ``"carry"``: a late result is verified against the base it
            names (the previous round's, which the aggregator still holds) and merged into the
            open round as the change it made, with its weight scaled by ``weight``. Only
            results one round late are carried; older ones are dropped.
        weight: the staleness discount of a carried result, in (0, 1]: its weight (its
            ``num_examples``, or 1) is multiplied by it before the round's weights are
            normalised.

    Raises:
        ValueError: an unknown mode or a weight outside (0, 1].

    Example::

        Aggregator(global_url, sites, late=LatePolicy("carry", weight=0.5))
    """

    mode: LateMode = "drop"
    weight: float = DEFAULT_LATE_WEIGHT

    def __post_init__(self) -> None:
        if self.mode not in ("drop", "carry"):
            raise ValueError(f"LatePolicy.mode must be 'drop' or 'carry', got {self.mode!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) \
                or not 0 < self.weight <= 1:
            raise ValueError(f"LatePolicy.weight must be in (0, 1], got {self.weight!r}")


def carried_tensor(site: torch.Tensor, old_base: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """A late site tensor moved onto the open round's base: ``base + (site − old_base)`` in
    fp32, cast to ``base``'s dtype, where the site changed an element (bit for bit) of
    ``old_base``; ``base``'s bits everywhere else. Non-floating tensors take the site's value
    where it changed one. Deterministic, so every replay of a round merges the same bits.

    Args:
        site: the site's tensor (its late result, rebuilt on ``old_base``).
        old_base: the previous round's tensor the site trained from.
        base: the open round's tensor.

    Returns:
        A tensor of ``base``'s dtype and shape.
    """
    changed = bit_pattern(site) != bit_pattern(old_base)
    if not base.is_floating_point():
        return torch.where(changed, site, base)
    moved = (base.to(torch.float32) + (site.to(torch.float32) - old_base.to(torch.float32))).to(base.dtype)
    return torch.where(changed, moved, base)

