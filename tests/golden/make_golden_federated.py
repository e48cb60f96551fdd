"""Write the federated golden stores under tests/golden/ (run once; the files are committed).

Written by deltastore at issue 11 (branch i11-fed, the first writer of based versions, schema
4's ``base`` field, design 009), with::

    python tests/golden/make_golden_federated.py        # from the repository root

It refuses to overwrite existing files unless ``--force`` is given: the files were written by
this release and must be read, bit for bit, by every later one (tests/test_federated_golden.py).
Inputs are deterministic; manifests carry random ids and times, so a second run gives other
bytes: never regenerate them.

``store-federated/global/``
    A global store: v1 an anchor (3 bf16 tensors and an int64 one), v2 the merge of round 1.
``store-federated/site-a/``, ``site-b/``
    Two site stores, each with v1 based on global v1 (round 1) and v2 based on global v2
    (round 2; no aggregation after it).
``store-federated-expected/``
    ``global-vN.safetensors`` and ``site-X-vN.safetensors``: every version as published.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def state0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "emb": (torch.randn(64, 16, generator=g) * 0.02).to(torch.bfloat16),
        "w": (torch.randn(32, 16, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.zeros(16, dtype=torch.bfloat16),
        "count": torch.tensor([0, 0], dtype=torch.int64),
    }


def trained(w: dict[str, torch.Tensor], site: int, rnd: int) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in w.items()}
    g = torch.Generator().manual_seed(100 * rnd + site)
    rows = torch.randint(0, 64, (4,), generator=g)
    out["emb"][rows] = (out["emb"][rows].float() + torch.randn(4, 16, generator=g) * 0.01).to(torch.bfloat16)
    out["b"][site] = torch.tensor(-0.0 if site else 0.5, dtype=torch.bfloat16)
    out["count"][site] += rnd + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    store, expected = HERE / "store-federated", HERE / "store-federated-expected"
    if (store.exists() or expected.exists()) and not args.force:
        print(f"{store} exists: golden files are written once (pass --force to overwrite)", file=sys.stderr)
        return 1
    for p in (store, expected):
        shutil.rmtree(p, ignore_errors=True)
    sys.path.insert(0, str(ROOT))
    from deltastore.federated import Aggregator, Site
    from deltastore.write.policy import LayoutPolicy, WriterPolicy

    g = store / "global"
    sites = {"a": store / "site-a", "b": store / "site-b"}
    for p in (g, *sites.values(), expected):
        p.mkdir(parents=True)
    with Aggregator(str(g), {k: str(v) for k, v in sites.items()}, dtype=torch.bfloat16, poll_interval_s=0.05,
                    writer_policy=WriterPolicy(threads=1, writer_id="golden-aggregator"),
                    layout_policy=LayoutPolicy(chunk_bytes=512)) as agg:
        agg.start(state0())
        save_file(agg.state(), str(expected / "global-v1.safetensors"))
        ss = {k: Site(str(g), str(v), dtype=torch.bfloat16,
                      writer_policy=WriterPolicy(threads=1, writer_id=f"golden-site-{k}")) for k, v in sites.items()}
        for rnd in range(2):
            for i, (k, s) in enumerate(ss.items()):
                r = s.run_round(lambda w, i=i, rnd=rnd: trained(w, i, rnd), num_examples=1 + i)
                save_file(trained(s.weights, i, rnd), str(expected / f"site-{k}-v{r.published.version}.safetensors"))
            if rnd == 0:
                report = agg.run_round()
                save_file(agg.state(), str(expected / f"global-v{report.published.version}.safetensors"))
        for s in ss.values():
            s.close()
    for p in store.rglob("*"):  # the local backend's lock directory is not part of the format
        if p.is_dir() and p.name.startswith("."):
            shutil.rmtree(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
