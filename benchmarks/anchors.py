"""When to write an anchor: the fixed cadence against the cost rule (design 005 D7), measured.

    python -m benchmarks.anchors [--steps 64] [--out benchmarks/results/anchors.json]

Publishes the same real fine-tuning steps (benchmarks.workload rl-1e-6 and rl-3e-6: MiniLM,
AdamW, bf16 exports) under each policy into an in-memory store and reports, per policy:
anchors written, bytes written per version (what the trainer uploads and the bucket stores
before GC), and what a worker starting from scratch fetches at each version (the anchor's full
bytes plus every delta since it: the mean and the worst over the run). The first version is an
anchor under every policy and is left out of the per-version figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.history import RESULTS_DIR, THREADS, workload_states
from deltastore.write.policy import AnchorPolicy, WriterPolicy

WORKLOADS = ("rl-1e-6", "rl-3e-6")
#: (label, anchor policy)
POLICIES: tuple[tuple[str, AnchorPolicy], ...] = (
    ("every 20 (before)", AnchorPolicy("every", every=20)),
    ("cost, β = 0.5", AnchorPolicy("cost", cost_ratio=0.5)),
    ("cost, β = 1 (default)", AnchorPolicy("cost", cost_ratio=1.0)),
    ("cost, β = 2", AnchorPolicy("cost", cost_ratio=2.0)),
)


def measure(name: str, steps: int) -> list[dict[str, Any]]:
    from deltastore import Publisher
    from deltastore.format.history import History

    states = [s for s in workload_states(name, steps)]
    rows = []
    for label, policy in POLICIES:
        written, fresh, anchors = [], [], 0
        with Publisher(f"memory://anchors-{name}-{len(rows)}", writer_policy=WriterPolicy(threads=THREADS),
                       anchor_policy=policy) as pub:
            since_anchor = 0
            for i, state in enumerate(states):
                info = pub.publish(state, step=i)
                stats = History(pub.store).manifest(info.manifest).stats
                if info.kind == "anchor":
                    anchors += 1
                    anchor_full, since_anchor = stats.full_bytes, 0
                else:
                    since_anchor += stats.delta_bytes
                if i == 0:
                    continue
                written.append(info.bytes_stored)
                fresh.append(anchor_full + since_anchor)
        rows.append({"workload": name, "policy": label, "versions": len(states), "anchors": anchors,
                     "written_per_version": statistics.mean(written), "fresh_mean": statistics.mean(fresh),
                     "fresh_max": max(fresh)})
        logging.info("%s %s: %d anchors, %.0f B written per version", name, label, anchors, rows[-1]["written_per_version"])
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| workload | policy | anchors in run | written per version | new worker fetches, mean | worst |",
           "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['workload']} | {r['policy']} | {r['anchors']} of {r['versions']} | "
                   f"{r['written_per_version'] / 1e6:.2f} MB | {r['fresh_mean'] / 1e6:.1f} MB | {r['fresh_max'] / 1e6:.1f} MB |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "anchors.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("deltastore").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    rows = [r for name in WORKLOADS for r in measure(name, args.steps)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
