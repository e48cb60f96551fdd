"""The column grid at Llama-3-8B shapes (design 011 D10 step 6, its chunk-target question).

    python -m benchmarks.grid_chunks [--rounds 4] [--out benchmarks/results/grid-chunks]

tf265m's row-parallel weights are small (its grid chunks are 256-704 KiB whatever the target),
so this runs the 8B shapes synthetically: two layers of ``o_proj`` (4096 × 4096) and
``down_proj`` (4096 × 14336) in bf16 (288 MiB, all of it gridded with
``column_slices=ROW_PARALLEL``), an anchor and six versions each changing 3 % of the elements
by one ulp (about what AdamW at lr 1e-6 does to these tensors per step). Three arms on a tmpfs
store, paired call by call in one interpreter (the order rotating): ``slice_align=8`` without a
grid (16 MiB target), and with the grid at a 16 MiB and a 4 MiB chunk target. Delta publish
and whole-worker ``pull_into`` seconds per call; every worker bit-exact at the end. Ratios are
medians of per-pair ratios with quartiles. Only the gridded tensors are in this model, so a
whole model's figures are diluted by its other tensors (30 % of Llama-3-8B's bytes are o and
down).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltastore import Publisher, Subscriber
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from deltastore.layout.select import ROW_PARALLEL
from deltastore.layout.tensors import bits

RESULTS = Path(__file__).parent / "results"
#: (label, chunk target, column_slices) of each arm; all with slice_align=8.
ARMS = (("no grid, 16 MiB", 16 << 20, None), ("grid, 16 MiB", 16 << 20, ROW_PARALLEL),
        ("grid, 4 MiB", 4 << 20, ROW_PARALLEL))
#: Fraction of elements a version changes (by one ulp, either way).
CHANGED = 0.03


def _states(versions: int, layers: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    s0 = {}
    for i in range(layers):
        s0[f"model.layers.{i}.self_attn.o_proj.weight"] = (torch.randn(4096, 4096, generator=g) * 0.02).bfloat16()
        s0[f"model.layers.{i}.mlp.down_proj.weight"] = (torch.randn(4096, 14336, generator=g) * 0.02).bfloat16()
    out = [s0]
    for _ in range(versions - 1):
        nxt = {}
        for n, t in out[-1].items():
            c = t.clone()
            b = bits(c)
            idx = rng.choice(b.size, size=int(b.size * CHANGED), replace=False)
            b[idx] += np.where(rng.random(idx.size) < 0.5, 1, -1).astype(b.dtype)
            nxt[n] = c
        out.append(nxt)
    return out


def _ratio(xs: list[float], ys: list[float]) -> dict[str, Any]:
    r = [x / y for x, y in zip(xs, ys)]
    return {"median": statistics.median(r), "quartiles": [float(q) for q in np.percentile(r, [25, 75])], "pairs": len(r)}


def run(rounds: int = 4, versions: int = 7) -> dict[str, Any]:
    states = _states(versions)
    labels = [a[0] for a in ARMS]
    calls: dict[str, dict[str, list[float]]] = {a: {"publish_s": [], "pull_into_s": []} for a in labels}
    chunks: dict[str, int] = {}
    for rnd in range(rounds):
        root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="grid-chunks-")
        order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]
        try:
            pubs = {a: Publisher(os.path.join(root, str(i)), anchor_policy=AnchorPolicy(every=1000),
                                 layout_policy=LayoutPolicy(slice_align=8, column_slices=cols, chunk_bytes=target)) for i, (a, target, cols) in enumerate(ARMS)}
            try:
                for v, s in enumerate(states):
                    for a in order if v % 2 == 0 else order[::-1]:
                        t = time.perf_counter()
                        pubs[a].publish(s)
                        if v:
                            calls[a]["publish_s"].append(time.perf_counter() - t)
            finally:
                for p in pubs.values():
                    p.close()
            subs = {a: Subscriber(os.path.join(root, str(i))) for i, a in enumerate(labels)}
            try:
                held = {a: subs[a].pull(1) for a in labels}
                chunks = {a: sum(u.n_chunks for u in subs[a].units().values()) for a in labels}
                for v in range(2, len(states) + 1):
                    for a in order if v % 2 == 0 else order[::-1]:
                        t = time.perf_counter()
                        subs[a].pull_into(held[a], v)
                        calls[a]["pull_into_s"].append(time.perf_counter() - t)
                for a in labels:
                    assert all(np.array_equal(bits(held[a][n]), bits(states[-1][n])) for n in states[-1]), a
            finally:
                for s in subs.values():
                    s.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    none, g16, g4 = labels
    return {
        "model_bytes": sum(t.numel() * t.element_size() for t in states[0].values()), "rounds": rounds,
        "versions": versions, "changed": CHANGED, "chunks": chunks,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end",
        "medians": {a: {m: statistics.median(v) for m, v in c.items()} for a, c in calls.items()},
        "ratios": {f"{x} / {y}": {m: _ratio(calls[x][m], calls[y][m]) for m in calls[x]}
                   for x, y in ((g16, none), (g4, none), (g4, g16))},
    }


def _md(res: dict[str, Any]) -> str:
    lines = ["# Column grid at Llama-3-8B shapes (benchmarks/grid_chunks.py)", "",
             (f"Two layers of o_proj and down_proj, bf16, {res['model_bytes'] / 2**20:.0f} MiB; {res['versions'] - 1} "
              f"versions changing {res['changed']:.0%} of elements; {res['rounds']} rounds, paired call by call; "
              f"{res['machine']}."), "",
             "| arm | chunks | delta publish s | pull_into s |", "|---|---|---|---|"]
    for a, m in res["medians"].items():
        lines.append(f"| {a} | {res['chunks'][a]} | {m['publish_s']:.3f} | {m['pull_into_s']:.3f} |")
    lines += ["", "| ratio | delta publish | pull_into |", "|---|---|---|"]
    for k, r in res["ratios"].items():
        cell = [f"{r[m]['median']:.2f} ({r[m]['quartiles'][0]:.2f}-{r[m]['quartiles'][1]:.2f}, {r[m]['pairs']} pairs)"
                for m in ("publish_s", "pull_into_s")]
        lines.append(f"| {k} | {cell[0]} | {cell[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "grid-chunks")
    args = ap.parse_args(argv)
    res = run(args.rounds)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_md(res))
    print(_md(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
