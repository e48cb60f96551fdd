"""Smoke test for the benchmark harness on a tiny synthetic state dict (no model needed)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import peers
from benchmarks.run import ENTROPY, bench_workload, table


def _sds(steps: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": (torch.randn(128, 96, generator=g) * 0.02).bfloat16(),
        "b": torch.randn(96, generator=g).bfloat16(),
        "frozen": torch.randn(4, 4, generator=g).bfloat16(),
        "special": torch.tensor([0.0, -0.0, float("inf"), float("nan")]).bfloat16(),
    }
    out = [sd]
    for _ in range(steps):
        new = {k: v.clone() for k, v in out[-1].items()}
        # A sparse update of a few ulps, as a small Adam step leaves after bf16 rounding.
        mask = torch.rand(new["w"].shape, generator=g) < 0.02
        bits = new["w"].view(torch.int16)
        bits[mask] += torch.randint(-2, 3, (int(mask.sum()),), generator=g, dtype=torch.int16)
        new["b"][::7] = (new["b"][::7].float() * 1.05).bfloat16()
        new["special"][0] = -0.0  # +0 -> -0 differs bitwise, equal as a float
        out.append(new)
    return out


@pytest.mark.parametrize("name", list(peers.FORMATS))
def test_format_round_trips_bit_exactly(name: str) -> None:
    why = peers.unavailable(name)
    if why:
        pytest.skip(why)
    fmt = peers.FORMATS[name]
    sds = _sds()
    for prev, new in zip(sds, sds[1:]):
        blob = fmt.encode(prev, new)
        assert isinstance(blob, bytes)
        out = fmt.decode_apply({k: v.clone() for k, v in prev.items()}, blob)
        for k in new:
            assert torch.equal(out[k].view(torch.int16), new[k].view(torch.int16)), (name, k)


def test_unchanged_step_round_trips() -> None:
    sd = _sds(0)[0]
    for name, fmt in peers.FORMATS.items():
        if peers.unavailable(name):
            continue
        out = fmt.decode_apply({k: v.clone() for k, v in sd.items()}, fmt.encode(sd, sd))
        assert all(torch.equal(out[k].view(torch.int16), sd[k].view(torch.int16)) for k in sd)


def test_entropy_estimate_is_positive_and_below_raw() -> None:
    prev, new = _sds(1)
    h = peers.entropy_bytes(prev, new)
    raw = sum(t.numel() * 2 for t in new.values())
    assert 0 < h < raw
    assert peers.entropy_bytes(prev, prev) == 0
    # Every sparse peer spends more than the order-0 estimate.
    assert len(peers.FORMATS["trl-sparse"].encode(prev, new)) > h


def test_harness_runs_on_synthetic_workload() -> None:
    formats = ["full", "trl-sparse", "pulse"]
    results = bench_workload("synthetic", _sds(), formats, rss=False)
    assert [r.format for r in results] == [ENTROPY, *formats]
    assert all(r.exact for r in results if r.format != ENTROPY)
    assert "trl-sparse" in table(results)
