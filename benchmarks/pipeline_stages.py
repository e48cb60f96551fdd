"""Host memory and download per pipeline-parallel rank (docs/integrations.md, "Host memory per
rank"): what a rank following the store with its stage's selection holds and fetches, against
a rank holding the whole model.

    python -m benchmarks.pipeline_stages [--workload tf125m-rl-1e-6] [--steps 6] [--stages 1 2 4]
        [--out benchmarks/results/pipeline-stages]

The trainer publishes ``--steps`` versions of the workload (real fine-tuning states) to a tmpfs
store. For each pipeline degree P, rank r follows it as vLLM's ``deltastore_start(...,
pipeline_stage=True)`` does: the selection :func:`~deltastore.integrations.hostcopy.stage_selection`
makes from the layers the rank lacks (vLLM's layout: layers split as ``get_pp_indices`` splits
them, the embeddings on the first stage, the final norm and ``lm_head`` on the last). Each rank follows
every version (a full load, then staged updates), and its tensors are checked bit for bit
against the whole state's at the end. Reported per rank: bytes held (tensors plus the bits of
straddling chunks) and bytes fetched per delta version (median), as fractions of a whole rank's.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import load_workload
from deltastore import PollPolicy, Publisher, Subscriber
from deltastore.integrations.hostcopy import stage_selection
from deltastore.layout.select import Selection
from testkit.partial import expected_rows
from testkit.tensors import assert_bits_equal

RESULTS = Path(__file__).parent / "results"
LAYER = re.compile(r"^(.*\blayers\.)(\d+)\.")


def stage_missing(names: list[str], rank: int, stages: int) -> list[str]:
    """The module prefixes (trailing dot) a vLLM rank ``rank`` of ``stages`` lacks: the other
    stages' layers, the embeddings off the first stage, the rest off the last. Layers are split
    as vLLM's ``get_pp_indices`` does without ``VLLM_PP_LAYER_PARTITION``: equal shares, the
    remainder one each to the stages before the last, from the second-to-last back."""
    layers = sorted({int(m.group(2)) for n in names if (m := LAYER.match(n))})
    prefix = next(m.group(1) for n in names if (m := LAYER.match(n)))
    shares = [len(layers) // stages] * stages
    for i in range(len(layers) % stages):
        shares[-2 - i] += 1
    lo = sum(shares[:rank])
    hi = lo + shares[rank]
    missing = [f"{prefix}{i}." for i in layers[:lo] + layers[hi:]]
    for n in names:
        if LAYER.match(n) or stages == 1:
            continue
        first = "embed" in n
        if (first and rank != 0) or (not first and rank != stages - 1):
            missing.append(n.rsplit(".", 1)[0] + ".")
    return sorted(set(missing))


class Rank:
    """One rank following the store with its stage's selection, a version per :meth:`step`."""

    def __init__(self, url: str, stages: int, rank: int, sel: Selection | None):
        self.stages, self.rank, self.sel = stages, rank, sel
        self.sub = Subscriber(url, threads=2, select=sel)
        self.tensors: dict[str, torch.Tensor] | None = None
        self.fetched: list[int] = []

    def step(self) -> None:
        """Follow the version just published (a full load first, then a staged update)."""
        if self.tensors is None:
            self.tensors = self.sub.allocate()
        before = self.sub.bytes_fetched
        (rec,) = self.sub.follow(self.tensors, poll=PollPolicy(0.001, jitter=0.0), max_versions=1, heartbeat=None)
        self.fetched.append(self.sub.bytes_fetched - before)

    def held(self) -> int:
        """Bytes of the rank's tensors and of the bits of chunks straddling its selection."""
        assert self.tensors is not None
        part = self.sub._reader.partial
        spare = sum(v.nbytes for v in part.spare.values()) if part is not None else 0
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + spare


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_stages")
    p.add_argument("--workload", default="tf125m-rl-1e-6")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=str(RESULTS / "pipeline-stages"))
    a = p.parse_args(argv)
    states = load_workload(a.workload, a.steps)
    names = list(states[0])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        url = str(Path(d) / "store")
        ranks = [Rank(url, stages, rank, stage_selection(stage_missing(names, rank, stages)))
                 for stages in a.stages for rank in range(stages)]
        with Publisher(url) as pub:
            for s in states:
                pub.publish(s)
                for r in ranks:
                    r.step()
        whole_held = whole_fetch = None
        for r in ranks:
            assert r.tensors is not None
            assert_bits_equal(r.tensors, expected_rows(states[-1], r.sel or Selection()), f"rank {r.rank} of {r.stages}")
            per_version = statistics.median(r.fetched[1:])
            if r.sel is None:
                whole_held, whole_fetch = r.held(), per_version
            rows.append({"stages": r.stages, "rank": r.rank, "tensors": len(r.tensors), "held_bytes": r.held(),
                         "fetched_per_version_bytes": per_version})
            r.sub.close()
    for r in rows:
        r["held_fraction"] = r["held_bytes"] / whole_held if whole_held else None
        r["fetched_fraction"] = r["fetched_per_version_bytes"] / whole_fetch if whole_fetch else None
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"workload": a.workload, "steps": a.steps, "machine": platform.machine(), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["| stages | rank | tensors | held (MB) | × a whole rank | fetched per version (MB) | × a whole rank |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['stages']} | {r['rank']} | {r['tensors']} | {r['held_bytes'] / 1e6:.1f} | "
                     f"{r['held_fraction']:.3f} | {r['fetched_per_version_bytes'] / 1e6:.2f} | {r['fetched_fraction']:.3f} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(f"{a.workload}, {a.steps} versions, every rank bit-exact\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
