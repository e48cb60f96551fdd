"""Run several campaigns and write one Markdown table (for docs/reliability.md).

    python -m campaigns all --backend seaweedfs --trials crash=200,faults=200,races=120,corruption=100,hostile=200 \\
        --markdown reliability-table.md --json reliability.json

One server per backend is started and shared by the campaigns run on it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from campaigns.common import Tally

CAMPAIGNS = ("crash", "faults", "races", "corruption", "hostile")
#: Default trial counts: the sizes docs/reliability.md reports (≥ 200 kills and ≥ 200
#: faulted publishes on SeaweedFS).
DEFAULT_TRIALS = {"crash": 200, "faults": 200, "races": 120, "corruption": 100, "hostile": 200}


def _counter(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) or "0"


def markdown(tallies: list[Tally]) -> str:
    """The table, the commands that produced it, and one example per finding."""
    lines = [
        "| campaign | backend | trials | faults injected | versions lost | corrupt applies | errors surfaced | wrong errors | invariant violations | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tallies:
        faults = dict(t.faults)
        if t.campaign in ("corruption", "hostile") and len(faults) > 6:
            faults = {f"{len(faults)} kinds": sum(faults.values())}
        lines.append(
            f"| {t.campaign} | {t.backend} | {t.trials} | {_counter(faults)} | {t.versions_lost} | {t.corrupt_applies} | "
            f"{_counter(dict(t.errors))} | {_counter(dict(t.wrong_errors))} | {_counter(dict(t.invariant_violations))} | {t.seconds:.0f} |"
        )
    lines += ["", "Commands:", "", "```bash"] + [t.command for t in tallies] + ["```"]
    findings = [(t, cat, ex[0]) for t in tallies for cat, ex in sorted(t.examples.items())
                if cat.startswith(("wrong", "violation", "lost", "corrupt"))]  # fmt: skip
    if findings:
        lines += ["", "Findings (first example of each):", ""]
        lines += [f"- {t.campaign}/{t.backend}, {cat}: {ex}" for t, cat, ex in findings]
    return "\n".join(lines) + "\n"


def run_one(name: str, server: Any, trials: int, seed: int, extra: list[str] | None = None, *, grid: bool = False,
            formats: str | None = None) -> Tally:
    """Run campaign ``name`` on an already started server, with its own defaults (``grid`` and
    ``formats``: ``--grid`` and ``--formats``)."""
    module = importlib.import_module(f"campaigns.{name}")
    p = module.build_parser() if hasattr(module, "build_parser") else module.parser(name, trials, "")
    argv = ["--backend", server.kind, "--trials", str(trials), "--seed", str(seed), *(["--grid"] if grid else []),
            *(["--formats", formats] if formats else []), *(extra or [])]
    tally = module.run(server, p.parse_args(argv))
    tally.command = f"python -m campaigns.{name} " + " ".join(argv)
    return tally


def main(argv: list[str] | None = None) -> int:
    from testkit.servers import backend

    p = argparse.ArgumentParser(prog="python -m campaigns all", description=__doc__)
    p.add_argument("--backend", default="seaweedfs", help="moto, seaweedfs, or both comma-separated")
    p.add_argument("--campaigns", default=",".join(CAMPAIGNS), help=f"comma-separated subset of {','.join(CAMPAIGNS)}")
    p.add_argument("--trials", default="", help="NAME=N,... (defaults: " + ",".join(f"{k}={v}" for k, v in DEFAULT_TRIALS.items()) + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", action="store_true", help="publishers write column grids (campaigns.model.GRID_SPECS)")
    p.add_argument("--formats", metavar="NAMES",
                   help="publishers also publish these serving formats (comma-separated; campaigns.model.serving_formats)")
    p.add_argument("--markdown", metavar="OUT", help="write the Markdown table here")
    p.add_argument("--json", metavar="OUT", help="write every tally as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("deltastore").setLevel(logging.CRITICAL)
    logging.getLogger("urllib3").setLevel(logging.CRITICAL)
    trials = dict(DEFAULT_TRIALS)
    for item in filter(None, args.trials.split(",")):
        k, _, v = item.partition("=")
        trials[k] = int(v)
    tallies = []
    for kind in args.backend.split(","):
        with backend(kind) as server:
            for name in args.campaigns.split(","):
                tally = run_one(name, server, trials[name], args.seed, grid=args.grid, formats=args.formats)
                print(tally.summary(), flush=True)
                tallies.append(tally)
    table = markdown(tallies)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps([t.to_json() for t in tallies], indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
