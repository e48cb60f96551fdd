"""``deltastore aggregate GLOBAL --site NAME=URL ...``: run federated rounds (design 009).

Each round waits for the sites' based versions (all of them, or ``--quorum K`` by
``--deadline``), verifies and merges them (weighted average in fp32 of the changes), publishes
the next global version and prints one line per round (``--json``: one JSON object a line).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from deltastore.cli._util import EXIT_OK, emit_json, open_store, options, size


def site_arg(text: str) -> tuple[str, str]:
    """``NAME=URL`` (a bare URL is named by its position later)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        return "", text
    if not name or not url:
        raise argparse.ArgumentTypeError(f"--site wants NAME=URL or URL, got {text!r}")
    return name, url


def seconds(text: str) -> float:
    from deltastore.cli._commands import parse_duration

    return parse_duration(text)


def add_parser(add: Any, json_flag: Any) -> None:
    """Register ``aggregate`` through the CLI's ``add(name, help, func)`` and ``json_flag``."""
    p = add("aggregate", "run federated rounds: merge the sites' results into the next global version", cmd_aggregate)
    p.add_argument("url", help="the global store (this aggregator is its only publisher)")
    p.add_argument("--site", type=site_arg, action="append", required=True, metavar="NAME=URL",
                   help="a site store (repeatable; NAME defaults to site-<i>)")
    p.add_argument("--init", metavar="FILE.safetensors", help="publish this state as version 1 when the global store is empty")
    p.add_argument("--rounds", type=int, default=1, help="rounds to run (default 1; 0: until Ctrl-C/SIGTERM)")
    p.add_argument("--quorum", type=int, help="sites needed (default: all)")
    p.add_argument("--deadline", type=seconds, metavar="DURATION",
                   help="wait this long per round for every site (e.g. 10m); then --quorum must be met")
    p.add_argument("--dtype", default="bfloat16", help="served dtype of floating tensors (default bfloat16; 'keep' keeps each)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls of the site stores (default 2)")
    json_flag(p, "one JSON object per round, one a line")


def cmd_aggregate(args: argparse.Namespace) -> int:
    import torch

    from deltastore.federated import Aggregator

    sites = {name or f"site-{i}": url for i, (name, url) in enumerate(args.site)}
    if len(sites) != len(args.site):
        raise ValueError("--site names must be unique")
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype, None)
    if args.dtype != "keep" and not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float16, keep)")
    opts = options(args)
    with contextlib.ExitStack() as stack:
        # Opened like every command's store: an endpoint that is down or not S3 is reported at
        # once, not taken for a site that never reports.
        global_store = stack.enter_context(open_store(args, write=True))
        site_stores = {name: stack.enter_context(open_store(args, write=True, url=url)) for name, url in sites.items()}
        agg = stack.enter_context(Aggregator(args.url, sites, dtype=dtype, storage_options=opts,
                                             site_storage_options=opts, global_store=global_store,
                                             site_stores=site_stores, poll_interval_s=args.interval))
        initial = None
        if args.init:
            from deltastore.cli._commands import load_state

            initial = load_state(args.init)
        agg.start(initial)
        n = 0
        while args.rounds == 0 or n < args.rounds:
            report = agg.run_round(quorum=args.quorum, deadline_s=args.deadline)
            n += 1
            if args.json:
                emit_json(report.to_json())
            else:
                refused = [f"{o.site} ({o.error_type})" for o in report.sites if o.status == "refused"]
                missing = [o.site for o in report.sites if o.status == "missing"]
                print(f"round on version {report.base}: published version {report.published.version} "
                      f"({size(report.published.bytes_stored)}) from {', '.join(report.accepted)}"
                      + (f"; refused: {', '.join(refused)}" if refused else "")
                      + (f"; missing: {', '.join(missing)}" if missing else ""))
    return EXIT_OK
