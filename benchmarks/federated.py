"""Federated rounds (issue 11): bytes per site per round against exchanging full checkpoints.

``python -m benchmarks.federated [--sites 3 --rounds 3 --steps 2 --lr 3e-6]`` runs
examples/federated.py's rounds (N site processes fine-tuning MiniLM on their own data, one
aggregator, a local moto server) and reports, in the same run:

- deltastore: a site's bytes up per round (its based version: packs, layout, manifest, HEAD)
  and down per round (the fast-forward to the next global version, after the first full pull),
  medians over sites and rounds, counted at the store interface of each process;
- full checkpoints: the size of a site's result as a safetensors file (what a site would upload,
  and what every site would download of the merged model, per round).

Goals (issue 11): up ≤ 5 % and down ≤ 10 % of the model's bf16 bytes. Results go to
benchmarks/results/federated.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: Issue 11's goals, as fractions of the model's bf16 bytes.
UPLOAD_GOAL = 0.05
DOWNLOAD_GOAL = 0.10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="federated rounds: bytes per site per round")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "examples"))  # the example and its siblings (demo, worker)
    import federated  # examples/federated.py

    t0 = time.monotonic()
    r = federated.run(argparse.Namespace(sites=args.sites, rounds=args.rounds, steps=args.steps, lr=args.lr, verbose=False))
    model, full = r["model_bytes"], r["full_checkpoint_bytes"]
    up, down = r["upload_bytes_per_site_round"], r["download_bytes_per_site_round"]
    out = {
        **r, "lr": args.lr, "steps_per_round": args.steps, "elapsed_s": round(time.monotonic() - t0, 1),
        "upload_vs_full": round(full / up, 1), "download_vs_full": round(full / down, 1),
        "upload_goal_met": up <= UPLOAD_GOAL * model, "download_goal_met": down <= DOWNLOAD_GOAL * model,
    }
    rows = [
        "| per site per round | deltastore | full safetensors | full / deltastore | % of bf16 model (deltastore) | goal |",
        "|---|---|---|---|---|---|",
        f"| up | {up:,.0f} B | {full:,.0f} B | {full / up:.0f}× | {100 * up / model:.2f} % | ≤ {100 * UPLOAD_GOAL:.0f} % |",
        f"| down | {down:,.0f} B | {full:,.0f} B | {full / down:.0f}× | {100 * down / model:.2f} % | ≤ {100 * DOWNLOAD_GOAL:.0f} % |",
    ]
    md = (f"{args.sites} sites, {args.rounds} rounds, {args.steps} AdamW steps per site per round at lr {args.lr:g}; "
          f"model {model:,} B bf16; bit_exact {r['bit_exact']}\n\n" + "\n".join(rows) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "federated.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / "federated.md").write_text(md)
    print(md)
    print(json.dumps(out))
    return 0 if r["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
