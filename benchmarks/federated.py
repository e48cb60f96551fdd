"""Federated rounds : bytes per site per round against exchanging full checkpoints.

``python -m benchmarks.federated [--sites 3 --rounds 3 --steps 2 --lr 3e-6]`` runs
examples/federated.py's rounds (N site processes fine-tuning MiniLM on their own data, one
aggregator, a local moto server) and reports, in the same run:

- deltastore: a site's bytes up per round (its based version: packs, layout, manifest, HEAD)
  and down per round (the fast-forward to the next global version, after the first full pull),
  medians over sites and rounds, counted at the store interface of each process;
- full checkpoints: the size of a site's result as a safetensors file (what a site would upload,
  and what every site would download of the merged model, per round).

Goals: up ≤ 5 % and down ≤ 10 % of the model's bf16 bytes. Results go to
benchmarks/results/federated.{json,md}.

``--far`` (over the far-link proxy): every site's S3 traffic and the aggregator's
go through a link of their own (testkit/shaper.py; ``--mbit 100 --rtt-ms 80 --loss 0.001`` by
default), and each round is also run as an exchange of full safetensors checkpoints over the
same links (sites download the global checkpoint and upload their result, the aggregator
downloads every result and uploads the merge, with boto3's transfer manager). Reports the time
per round of both, side by side, into benchmarks/results/federated-far.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The goals, as fractions of the model's bf16 bytes.
UPLOAD_GOAL = 0.05
DOWNLOAD_GOAL = 0.10
#: --far's default link: the far link of benchmarks.scale (a cross-region or home-office path).
FAR_MBIT, FAR_RTT_MS, FAR_LOSS = 100.0, 80.0, 0.001


def far(args: argparse.Namespace, federated: object) -> int:
    """Time rounds over shaped links, deltastore against full checkpoints, in one run."""
    from statistics import median

    from testkit.shaper import Link

    link = Link(bytes_per_s=args.mbit * 1e6 / 8, rtt_s=args.rtt_ms / 1000, loss=args.loss)
    t0 = time.monotonic()
    r = federated.run(argparse.Namespace(sites=args.sites, rounds=args.rounds, steps=args.steps, lr=args.lr,  # type: ignore[attr-defined]
                                         verbose=False, link=link))
    rows = [
        "| round | | deltastore | full safetensors | full / deltastore |",
        "|---|---|---:|---:|---:|",
    ]
    per_round = []
    for t in r["timings"]:
        d, f = t["deltastore"], t["full"]
        site_d = median(p + u for p, u in zip(d["site_pull_s"], d["site_publish_s"]))
        site_f = median(p + u for p, u in zip(f["site_down_s"], f["site_up_s"]))
        row = {"round": t["round"], "site_transfer_s": (site_d, site_f), "aggregator_s": (d["agg_s"], f["agg_s"]),
               "end_to_end_s": (d["end_to_end_s"], f["end_to_end_s"])}
        per_round.append(row)
        for label, key in (("site pull + upload (median)", "site_transfer_s"), ("aggregator merge + publish", "aggregator_s"),
                           ("end to end", "end_to_end_s")):
            a, b = row[key]
            rows.append(f"| {t['round']} | {label} | {a:.1f} s | {b:.1f} s | {b / a:.1f}× |")
    steady = [x for x in per_round if x["round"] > 0] or per_round  # round 0's pull is the whole model
    ratio = {k: round(median(x[k][1] / x[k][0] for x in steady), 2) for k in ("site_transfer_s", "aggregator_s", "end_to_end_s")}
    out = {**r, "lr": args.lr, "steps_per_round": args.steps, "elapsed_s": round(time.monotonic() - t0, 1),
           "per_round": per_round, "full_over_deltastore_after_round_0": ratio}
    md = (f"{args.sites} sites, {args.rounds} rounds, {args.steps} AdamW steps per site per round at lr {args.lr:g}; "
          f"each site and the aggregator behind its own link of {args.mbit:g} Mbit/s, {args.rtt_ms:g} ms RTT, "
          f"{100 * args.loss:g} % loss; model {r['model_bytes']:,} B bf16; bit_exact {r['bit_exact']}\n\n"
          + "\n".join(rows) + "\n\nfull / deltastore after round 0 (medians): "
          + ", ".join(f"{k} {v}×" for k, v in ratio.items()) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "federated-far.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / "federated-far.md").write_text(md)
    print(md)
    print(json.dumps(out))
    return 0 if r["bit_exact"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="federated rounds: bytes per site per round")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--far", action="store_true", help="time rounds over shaped links, against full checkpoints")
    ap.add_argument("--mbit", type=float, default=FAR_MBIT, help="--far: each link's bandwidth, Mbit/s per direction")
    ap.add_argument("--rtt-ms", type=float, default=FAR_RTT_MS, help="--far: each link's round-trip time")
    ap.add_argument("--loss", type=float, default=FAR_LOSS, help="--far: each link's packet loss probability")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # testkit.shaper
    sys.path.insert(0, str(ROOT / "examples"))  # the example and its siblings (demo, worker)
    import federated  # examples/federated.py

    if args.far:
        return far(args, federated)
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
