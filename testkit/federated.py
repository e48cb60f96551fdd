"""A federated round in miniature: the initial state, what a site trains, what the aggregator
serves, and the reference merge that every federated test compares with."""

from __future__ import annotations

import torch


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": (torch.randn(256, 32, generator=g) * 0.02).to(torch.bfloat16),
        "w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.zeros(64, dtype=torch.bfloat16),
        "step": torch.tensor([0, 1, 2], dtype=torch.int64),
    }


def trained(weights: dict[str, torch.Tensor], site: int, rnd: int) -> dict[str, torch.Tensor]:
    """A site's local training, deterministic: fp32 masters from the global bf16, a few rows
    moved (different rows per site and round), so most elements stay bit-identical."""
    out = {n: t.float() if t.is_floating_point() else t.clone() for n, t in weights.items()}
    g = torch.Generator().manual_seed(1000 * rnd + site)
    rows = torch.randint(0, 256, (6,), generator=g)
    out["emb"][rows] += torch.randn(6, 32, generator=g) * 0.01
    out["w"][site * 3 : site * 3 + 2] -= 0.003
    out["step"][site % 3] += 1
    return out


def served(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}


def reference_merge(base: dict[str, torch.Tensor], results: list[dict[str, torch.Tensor]], weights: list[float]
                    ) -> dict[str, torch.Tensor]:
    """The merge recomputed independently (element by element masks, plain torch)."""
    out = {}
    for n, b in base.items():
        if b.is_floating_point():
            delta = sum(w * (r[n].float() - b.float()) for r, w in zip(results, weights))
            merged = (b.float() + delta).to(b.dtype)
            same = torch.stack([r[n].view(torch.int16) == b.view(torch.int16) for r in results]).all(0)
            out[n] = torch.where(same, b, merged)
        else:
            o = b.clone()
            for r in reversed(results):  # the first site that changed an element wins
                o = torch.where(r[n] != b, r[n], o)
            out[n] = o
    return out
