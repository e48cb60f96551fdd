"""``deltastore aggregate GLOBAL --site NAME=URL ...``: run federated rounds (design 009).

Each round waits for the sites' based versions (all of them, or ``--quorum K`` by
``--deadline``), verifies and merges them (weighted average in fp32 of the changes; for LoRA
rounds ``--merge lora-fedavg|lora-stack``), publishes the next global version (and its serving
formats, ``--format NAME``) and prints one line per round (``--json``: one JSON object a line).

Everything that can be refused is refused before the global store is opened for writing: the
flags when they are parsed, the ``--init`` file, and an empty global store without ``--init``
(read without creating anything). Then the stores are opened, which creates missing local
directories, and the Aggregator takes the global store over: a run that fails later leaves
those behind.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from deltastore.cli.common import EXIT_OK, emit_json, nonnegative_int, open_store, options, poll_interval, positive_int, size


def site_arg(text: str) -> tuple[str, str]:
    """``--site NAME=URL``: a site's name (recorded in every global version) and its store."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url or "://" in name or "/" in name:
        raise argparse.ArgumentTypeError(
            f"wants NAME=URL, got {text!r} (e.g. --site a=s3://bucket/run/sites/a)"
        )
    from deltastore.errors import UnsupportedURLError
    from deltastore.storage import check_url

    try:
        check_url(url)
    except UnsupportedURLError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, url


def seconds(text: str) -> float:
    from deltastore.cli.commands import parse_duration

    return parse_duration(text)


def served_dtype(text: str) -> str:
    """``--dtype``: ``keep`` or a floating dtype deltastore stores, checked by name (no torch import)."""
    from deltastore.format.models import DTYPE_WIDTHS

    floats = [n for n in DTYPE_WIDTHS if n.startswith(("float", "bfloat"))]
    if text != "keep" and text not in floats:
        raise argparse.ArgumentTypeError(f"{text!r} is not a floating dtype deltastore stores: keep, {', '.join(floats)}")
    return text


def format_name(text: str) -> str:
    """``--format NAME``: a serving format deltastore defines (refused before any store is opened)."""
    from deltastore.errors import UnknownFormatError
    from deltastore.serving.formats import serving_format

    try:
        return serving_format(text).name
    except UnknownFormatError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a serving format: {', '.join(e.available)}") from None


def check_args(args: argparse.Namespace) -> None:
    """What no single flag can refuse: a site named twice, a quorum above the number of sites."""
    names = [name for name, _ in args.site]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"--site names must be unique; {', '.join(twice)} given more than once")
    if args.quorum is not None and args.quorum > len(names):
        raise argparse.ArgumentTypeError(f"--quorum {args.quorum} is more than the {len(names)} site(s) given")
    unknown = sorted({name for name, _ in args.site_key} - set(names))
    if unknown:
        raise argparse.ArgumentTypeError(f"--site-key names {', '.join(unknown)}, which no --site gives")
    if not 0 < args.late_weight <= 1:
        raise argparse.ArgumentTypeError(f"--late-weight must be in (0, 1], got {args.late_weight}")
    if args.merge == "lora-stack" and args.lora_config is None:
        raise argparse.ArgumentTypeError("--merge lora-stack folds the adapter into the base with its scaling: "
                                         "pass --lora-config adapter_config.json")
    if args.lora_config is not None and not args.merge.startswith("lora"):
        raise argparse.ArgumentTypeError("--lora-config is for --merge lora-fedavg or lora-stack")


def merge_of(args: argparse.Namespace) -> Any:
    """The merge ``--merge`` names (and ``--lora-config`` configures).

    Raises:
        ValueError: the adapter config cannot be read, or ``lora-stack`` cannot fold it.
    """
    from deltastore.federated import weighted_average

    if args.merge == "average":
        return weighted_average
    import json

    from deltastore.federated import LoraMerge

    mode = "stack" if args.merge == "lora-stack" else "fedavg"
    if args.lora_config is None:
        return LoraMerge(mode)
    try:
        with open(args.lora_config, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--lora-config {args.lora_config}: not a readable adapter_config.json ({e})") from None
    return LoraMerge.from_peft_config(config, mode)


def site_key_arg(text: str) -> tuple[str, str]:
    """``NAME=PUBLIC.pem`` of ``--site-key``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PUBLIC.pem, got {text!r}")
    return name, path


def add_parser(add: Any, json_flag: Any) -> None:
    """Register ``aggregate`` through the CLI's ``add(name, help, func)`` and ``json_flag``."""
    p = add("aggregate", "run federated rounds: merge the sites' results into the next global version", cmd_aggregate)
    p.add_argument("url", help="the global store (this aggregator is its only publisher)")
    p.add_argument("--site", type=site_arg, action="append", required=True, metavar="NAME=URL",
                   help="a site store and its name (repeatable; names unique)")
    p.add_argument("--init", metavar="FILE.safetensors", help="publish this state as version 1 when the global store is empty")
    p.add_argument("--rounds", type=nonnegative_int, default=1, help="rounds to run (default 1; 0: until Ctrl-C/SIGTERM)")
    p.add_argument("--quorum", type=positive_int, help="sites needed (default: all)")
    p.add_argument("--deadline", type=seconds, metavar="DURATION",
                   help="wait this long per round for every site (e.g. 10m); then --quorum must be met (default: "
                        "until --quorum sites are in, at most 1h)")
    p.add_argument("--dtype", type=served_dtype, default="bfloat16",
                   help="served dtype of floating tensors (default bfloat16; 'keep' keeps each)")
    p.add_argument("--interval", type=poll_interval, default=2.0,
                   help="seconds between polls of the site stores (default 2)")
    p.add_argument("--site-key", type=site_key_arg, action="append", default=[], metavar="NAME=PUBLIC.pem",
                   help="a site's Ed25519 public key (repeatable): that site's results must be signed by one of its "
                        "keys, else they are refused and named in the round's report")
    p.add_argument("--late", choices=("drop", "carry"), default="drop",
                   help="a result that arrives after its round closed: reported and dropped (default), or carried "
                        "into the next round at --late-weight")
    p.add_argument("--late-weight", type=float, default=0.5, metavar="W",
                   help="the staleness discount of a carried late result, in (0, 1] (default 0.5)")
    p.add_argument("--merge", choices=("average", "lora-fedavg", "lora-stack"), default="average",
                   help="how results become the next global version: the weighted average of the changes (default); "
                        "for a global store holding a PeftModel's state, lora-fedavg (A and B averaged each) or "
                        "lora-stack (the exact product folded into the base weights; needs --lora-config)")
    p.add_argument("--lora-config", metavar="adapter_config.json",
                   help="the adapter's PEFT config (lora_alpha, r, use_rslora, fan_in_fan_out), for --merge lora-*")
    p.add_argument("--format", type=format_name, action="append", dest="formats", metavar="NAME",
                   help="also publish each global version in this serving format (repeatable): bf16, fp8-block128, "
                        "mxfp8; the sites read the global store as published")
    p.add_argument("--accept-compressed", action="store_true",
                   help="merge compressed site results (the lossy opt-in tier of `site run --compressed`); "
                        "without it they are refused and named in the round's report")
    json_flag(p, "one JSON object per round, one a line")
    p.checks.append(check_args)


def _global_is_empty(args: argparse.Namespace) -> bool:
    """Whether the global store has no version yet, read without writing or creating anything
    (a local directory that does not exist is an empty store)."""
    from deltastore.errors import BucketNotFoundError
    from deltastore.format.history import History

    try:
        store = open_store(args)
    except BucketNotFoundError:
        if "://" in args.url and not args.url.startswith("file://"):
            raise  # a missing bucket is not an empty store
        return True
    try:
        got = History(store).read_head()
    finally:
        store.close()
    return got is None or not got[0].manifest


def cmd_aggregate(args: argparse.Namespace) -> int:
    from deltastore.errors import VersionNotFoundError

    initial = None
    if args.init:
        from deltastore.cli.commands import load_state

        initial = load_state(args.init)  # a bad file fails before any store is opened
    if initial is None and _global_is_empty(args):
        raise VersionNotFoundError(f"{args.url} has no version yet: the first round needs a global version 1")

    from deltastore.federated import Aggregator, LatePolicy, ResultPolicy
    from deltastore.layout.tensors import torch_dtype

    dtype = None if args.dtype == "keep" else torch_dtype(args.dtype)
    merge = merge_of(args)  # a bad adapter config fails before any store is opened
    opts = options(args)
    sites = dict(args.site)
    site_keys: dict[str, list[str]] = {}
    for name, path in args.site_key:
        site_keys.setdefault(name, []).append(path)
    with contextlib.ExitStack() as stack:
        # Opened like every command's store: an endpoint that is down or not S3 is reported at
        # once, not taken for a site that never reports.
        global_store = stack.enter_context(open_store(args, write=True))
        site_stores = {name: stack.enter_context(open_store(args, write=True, url=url)) for name, url in sites.items()}
        agg = stack.enter_context(Aggregator(args.url, sites, dtype=dtype, merge=merge, storage_options=opts,
                                             site_storage_options=opts, global_store=global_store,
                                             site_stores=site_stores, poll_interval_s=args.interval,
                                             results=ResultPolicy(site_keys=site_keys or None,
                                                                  accept_compressed=args.accept_compressed),
                                             late=LatePolicy(args.late, args.late_weight),
                                             formats=args.formats or ()))
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
                late = [f"{o.site} ({o.status})" for o in report.late]
                print(f"round on version {report.base}: published version {report.published.version} "
                      f"({size(report.published.bytes_stored)}) from {', '.join(report.accepted)}"
                      + (f"; refused: {', '.join(refused)}" if refused else "")
                      + (f"; missing: {', '.join(missing)}" if missing else "")
                      + (f"; late: {', '.join(late)}" if late else ""))
    return EXIT_OK
