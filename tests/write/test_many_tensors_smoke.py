"""Smoke test of benchmarks/many_tensors.py on tiny shapes: it runs, every case ends bit-exact
(the benchmark asserts it), and the report has the rows and ratios the docs quote."""

from __future__ import annotations

import pytest

from benchmarks import many_tensors


def test_many_tensors_benchmark_runs_on_tiny_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(many_tensors, "MANY", (300, 64))
    monkeypatch.setattr(many_tensors, "FEW", (3, 6400))
    r = many_tensors.run(scale=1.0, repeats=1)
    many = r["cases"]["many"]
    assert many["deltastore"]["units"] == 300 and many["deltastore+groups"]["units"] < 300
    assert set(r["ratios"]) == {f"{i}/{op}" for i in ("deltastore", "deltastore+groups") for op in ("publish", "pull_into", "pull")} | {
        "pulse/publish", "pulse/pull_into"}
    assert all(v > 0 for v in r["ratios"].values())
    md = many_tensors.markdown(r)
    assert "deltastore+groups" in md and "ratio many / few" in md


def test_many_tensors_benchmark_can_skip_the_ungrouped_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-ungrouped: the grouped ratios are still measured against the few-tensor case."""
    monkeypatch.setattr(many_tensors, "MANY", (300, 64))
    monkeypatch.setattr(many_tensors, "FEW", (3, 6400))
    r = many_tensors.run(scale=1.0, repeats=1, ungrouped=False)
    assert "deltastore" not in r["cases"]["many"] and "deltastore" in r["cases"]["few"]
    assert {k for k in r["ratios"] if k.startswith("deltastore")} == {f"deltastore+groups/{op}" for op in ("publish", "pull_into", "pull")}
    assert "deltastore+groups" in many_tensors.markdown(r)


def test_many_tensors_benchmark_times_the_tensor_scan_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """--scan-ab: both modes measured, the kernel restored afterwards, the table reported."""
    from deltastore._util import kernels

    kernel = kernels.scan_tensors
    monkeypatch.setattr(many_tensors, "MANY", (300, 64))
    monkeypatch.setattr(many_tensors, "FEW", (3, 6400))
    r = many_tensors.run(scale=1.0, repeats=2, ungrouped=False, scan_ab=True)
    ab = r["cases"]["many"]["scan_ab"]
    assert set(ab) == {"native", "python"}
    assert all(v > 0 for m in ab.values() for v in m.values())
    assert kernels.scan_tensors is kernel
    assert "tensor scan" in many_tensors.markdown(r)
