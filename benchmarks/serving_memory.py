"""Serving streams (SPEC §15): what a publisher holds in memory for each format it declares.

    python -m benchmarks.serving_memory [--workload tf125m-rl-1e-6] [--versions 3] [--repeats 2]
                                        [--out benchmarks/results/serving-memory.json]

Each configuration runs in a fresh interpreter, so that its resident size is its own: a
publisher of bf16 alone (today's publish), of bf16 + ``fp8-block128``, of bf16 + ``mxfp8``, and
of bf16 + both. The interpreter loads the workload's steps (benchmarks.workload: a Llama-shaped
decoder trained with full-parameter AdamW at lr 1e-6; its bf16 exports), then publishes the
first ``--versions`` of them in order to a local store on tmpfs (an anchor, then deltas),
reading its resident size after each publish (after a garbage collection) and its peak
(``VmHWM``) over all of them, both above the size it had before the first publish. The
configurations run in turn, ``--repeats`` times. Reported, per configuration (medians over the
repeats): what it held after each version and at its peak beyond the bf16-only publisher, in MB
and as a multiple of the model's bf16 bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rss import reset_peak, status_kb

RESULTS_DIR = Path(__file__).parent / "results"
CONFIGS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16",),
    "fp8-block128": ("bf16", "fp8-block128"),
    "mxfp8": ("bf16", "mxfp8"),
    "fp8-block128 + mxfp8": ("bf16", "fp8-block128", "mxfp8"),
}


def probe(workload: str, formats: tuple[str, ...], versions: int) -> dict[str, Any]:
    """One configuration in this interpreter: the resident size after each publish and the
    peak, above the size before the first (bytes)."""
    import torch

    from benchmarks.workload import load_workload
    from deltastore import Publisher

    torch.set_num_threads(2)
    # copies in this process's own memory: a state read from its cached file would add its
    # pages to the resident size when a publish first reads them
    states = [{n: t.clone() for n, t in s.items()} for s in load_workload(workload, versions)]
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    held: list[int] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        gc.collect()
        reset = reset_peak()
        base_kb = status_kb("VmRSS")
        with Publisher(d, formats=formats) as pub:
            for s in states[:versions]:
                pub.publish(s)
                gc.collect()
                held.append((status_kb("VmRSS") - base_kb) * 1024)
            peak = (status_kb("VmHWM") - base_kb) * 1024
    return {"formats": list(formats), "model_bytes": model_bytes, "held_bytes": held, "peak_bytes": peak,
            "peak_reset": reset}


def _run(workload: str, formats: tuple[str, ...], versions: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving_memory", "--probe", workload, str(versions),
                          *formats], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per configuration, and each beyond the bf16-only publisher's."""
    model = runs["bf16"][0]["model_bytes"]
    med: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        med[name] = {"held_bytes": [statistics.median(r["held_bytes"][i] for r in rs) for i in range(len(rs[0]["held_bytes"]))],
                     "peak_bytes": statistics.median(r["peak_bytes"] for r in rs)}
    base = med["bf16"]
    for name, m in med.items():
        m["held_beyond_bf16_bytes"] = [h - b for h, b in zip(m["held_bytes"], base["held_bytes"])]
        m["peak_beyond_bf16_bytes"] = m["peak_bytes"] - base["peak_bytes"]
        m["held_beyond_bf16_x_model"] = [round(x / model, 2) for x in m["held_beyond_bf16_bytes"]]
        m["peak_beyond_bf16_x_model"] = round(m["peak_beyond_bf16_bytes"] / model, 2)
    return {"model_bytes": model, "configs": med}


def markdown(res: dict[str, Any]) -> str:
    model = res["model_bytes"]
    versions = len(res["configs"]["bf16"]["held_bytes"])
    lines = [f"{res['workload']}: {model / 1e6:.0f} MB in bf16; {res['repeats']} runs per configuration (medians)", "",
             "| formats | " + " | ".join(f"held after version {v + 1}" for v in range(versions))
             + " | peak | beyond bf16 alone: held after each version (× the model) | peak (× the model) |",
             "|---|" + "---:|" * (versions + 3)]
    for name, m in res["configs"].items():
        held = " | ".join(f"{h / 1e6:.0f} MB" for h in m["held_bytes"])
        beyond = ", ".join(f"{h / 1e6:.0f} MB ({x:.2f}×)" for h, x in zip(m["held_beyond_bf16_bytes"],
                                                                       m["held_beyond_bf16_x_model"]))
        lines.append(f"| {name} | {held} | {m['peak_bytes'] / 1e6:.0f} MB | {beyond} | "
                     f"{m['peak_beyond_bf16_bytes'] / 1e6:.0f} MB ({m['peak_beyond_bf16_x_model']:.2f}×) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--probe":
        workload, versions, formats = argv[1], int(argv[2]), tuple(argv[3:])
        print(json.dumps(probe(workload, formats, versions)))
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tf125m-rl-1e-6")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "serving-memory.json")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, formats in CONFIGS.items():
            runs[name].append(_run(args.workload, formats, args.versions))
    res = {"workload": args.workload, "versions": args.versions, "repeats": args.repeats, **summary(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    print(md, end="")
    return res


if __name__ == "__main__":
    main()
