"""``deltastore mirror SRC DST [--follow]``: replicate a store into another bucket (SPEC §16).

Each version's packs, layouts, streams and manifest are copied create-only, each checked against
the SHA-256 that names it, and DST's HEAD is written last by compare-and-swap with SRC's HEAD
bytes: DST is always a valid store of SRC's lineage, signed as SRC is. ``--follow`` polls SRC's
HEAD and keeps DST current until Ctrl-C/SIGTERM (the sync in progress is finished first).
"""

from __future__ import annotations

import argparse
from typing import Any

from deltastore.cli.common import EXIT_OK, emit_json, endpoint_url, open_store, poll_interval, size, storage_option, trusted_keys


def add_parser(add: Any, json_flag: Any) -> None:
    """Register ``mirror`` through the CLI's ``add(name, help, func)`` and ``json_flag``."""
    p = add("mirror", "replicate a store into another bucket (verified objects first, HEAD last)", cmd_mirror)
    p.add_argument("url", metavar="SRC", help="the store to copy (the origin, or another mirror of it)")
    p.add_argument("dst", metavar="DST",
                   help="the mirror: an empty store or an earlier mirror of SRC (a local directory is created)")
    p.add_argument("--follow", action="store_true",
                   help="keep DST at SRC's head (one line per sync) until Ctrl-C/SIGTERM")
    p.add_argument("--interval", type=poll_interval, default=2.0,
                   help="with --follow: seconds between polls of SRC's HEAD (default 2)")
    p.add_argument("--dst-endpoint-url", type=endpoint_url, metavar="URL",
                   help="S3 endpoint of DST when it differs from SRC's (--endpoint-url)")
    p.add_argument("--dst-storage-option", action="append", type=storage_option, metavar="KEY=VALUE",
                   help="backend option of DST, repeatable (default: SRC's --storage-option)")
    p.add_argument("--trusted-key", action="append", metavar="FILE",
                   help="Ed25519 public key (PEM): copy only manifests signed by one (repeatable)")
    json_flag(p, "one JSON object per sync, one a line")


def _dst_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with DST's endpoint and options in place of SRC's, where given."""
    out = argparse.Namespace(**vars(args))
    if args.dst_endpoint_url:
        out.endpoint_url = args.dst_endpoint_url
    if args.dst_storage_option:
        out.storage_option = args.dst_storage_option
    return out


def _emit(args: argparse.Namespace, report: Any) -> None:
    if args.json:
        emit_json(report.to_json())
    elif report.head_written and report.from_version == report.to_version:
        print(f"{report.dst}: version {report.to_version}, HEAD rewritten as the source's (a claim, or its GC's index)",
              flush=True)
    elif report.head_written:
        print(f"{report.dst}: version {report.from_version} → {report.to_version}, {report.objects_copied} objects "
              f"({size(report.bytes_copied)}) copied in {report.seconds:.1f} s", flush=True)
    else:
        print(f"{report.dst}: at version {report.to_version} (source at {report.source_version}), nothing to write",
              flush=True)


def cmd_mirror(args: argparse.Namespace) -> int:
    from deltastore.fleet.mirror import Mirror
    from deltastore.storage import check_url

    check_url(args.dst)
    keys = trusted_keys(args)
    src = open_store(args)
    try:
        dst = open_store(_dst_args(args), write=True, url=args.dst)
        try:
            with Mirror(src, dst, trusted_keys=keys) as m:
                if not args.follow:
                    _emit(args, m.sync())
                    return EXIT_OK
                import signal
                import threading

                stop = threading.Event()

                def on_signal(signum: int, frame: object) -> None:  # finish the sync in progress, then end
                    stop.set()

                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, on_signal)
                m.follow(interval=args.interval, stop=stop, on_sync=lambda r: _emit(args, r))
        finally:
            dst.close()
    finally:
        src.close()
    return EXIT_OK
