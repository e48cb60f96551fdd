"""The ``deltastore`` command line: publish, pull, log, verify, status, inspect, gc, pin, unpin,
compact, keygen.

Errors print as one line naming the object and exit non-zero; set ``DELTASTORE_DEBUG=1`` for
the full traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from deltastore.errors import DeltastoreError

logger = logging.getLogger(__name__)

#: Exit codes: 1 for a failed operation (including a failed verify), 2 for bad usage.
EXIT_FAILED = 1
EXIT_USAGE = 2


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.storage_option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"deltastore: error: --storage-option expects KEY=VALUE, got {item!r}")
        opts[key] = value
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    return opts


def _cmd_publish(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file

    from deltastore.publish import Publisher

    if not os.path.exists(args.file):
        raise FileNotFoundError(f"{args.file}: no such file")
    state = load_file(args.file)
    metadata = json.loads(args.metadata) if args.metadata else None
    with Publisher(args.url, storage_options=_storage_options(args), anchor_every=args.anchor_every, signing_key=args.signing_key) as pub:
        info = pub.publish(state, step=args.step, metadata=metadata, anchor=args.anchor)
    print(f"published version {info.version} ({info.kind}) to {args.url}: {_size(info.bytes_stored)}, "
          f"{info.tensors_changed} tensors / {info.elements_changed} elements changed")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from deltastore.pull import Subscriber

    if args.follow:
        return _follow(args)
    with Subscriber(args.url, storage_options=_storage_options(args), trusted_keys=args.trusted_key) as sub:
        state = sub.pull(args.version)
        version = sub.version
    tmp = f"{args.out}.partial"
    save_file(state, tmp, metadata={"deltastore_url": args.url, "deltastore_version": str(version)})
    os.replace(tmp, args.out)  # never leave a half-written output under the real name
    print(f"pulled version {version} of {args.url} to {args.out} ({len(state)} tensors)")
    return 0


def _follow(args: argparse.Namespace) -> int:
    """``pull --follow``: keep OUT at the latest version until SIGINT/SIGTERM (then exit 0)."""
    import signal
    import threading
    import time

    from safetensors.torch import save_file

    from deltastore.errors import VersionNotFoundError
    from deltastore.pull import Subscriber

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:  # finish the current version, then end
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    with Subscriber(args.url, storage_options=_storage_options(args), trusted_keys=args.trusted_key) as sub:
        while True:  # wait for a first version: the layout to follow into
            try:
                target = sub.allocate()
                break
            except VersionNotFoundError:
                if stop.wait(args.interval):
                    return 0
        records = sub.follow(target, interval=args.interval, stop=stop, cache_dir=args.cache,
                             worker_id=args.worker_id, max_versions=args.max_versions)
        for rec in records:
            t0 = time.perf_counter()
            tmp = f"{args.out}.partial"
            save_file(target, tmp, metadata={"deltastore_url": args.url, "deltastore_version": str(rec.info.version)})
            os.replace(tmp, args.out)  # readers of OUT see one whole version or the next
            write_s = time.perf_counter() - t0
            if args.json:
                print(json.dumps({
                    "version": rec.info.version, "from_version": rec.from_version, "full_load": rec.full_load,
                    "bytes_fetched": rec.bytes_fetched, "fetch_s": round(rec.fetch_s, 6),
                    "decode_s": round(rec.decode_s, 6), "pause_s": round(rec.pause_s, 6),
                    "write_s": round(write_s, 6), "out": args.out,
                }, sort_keys=True), flush=True)
            else:
                how = "full load" if rec.full_load else f"from v{rec.from_version}"
                print(f"v{rec.info.version} ({how}): {_size(rec.bytes_fetched)} fetched, fetch {rec.fetch_s:.3f} s, "
                      f"decode {rec.decode_s:.3f} s, pause {rec.pause_s:.3f} s, wrote {args.out} in {write_s:.3f} s",
                      flush=True)
    return 0


def _cmd_log(args: argparse.Namespace) -> int:
    from deltastore.pull import Subscriber

    with Subscriber(args.url, storage_options=_storage_options(args), trusted_keys=args.trusted_key) as sub:
        infos = sub.log()
    for info in infos:
        if args.json:
            print(json.dumps({
                "version": info.version, "step": info.step, "kind": info.kind, "parent": info.parent,
                "anchor": info.anchor, "bytes_stored": info.bytes_stored, "tensors_changed": info.tensors_changed,
                "elements_changed": info.elements_changed, "created": info.created, "writer": info.writer,
                "metadata": info.metadata, "manifest": info.manifest,
            }, sort_keys=True))
        else:
            step = "-" if info.step is None else str(info.step)
            print(f"v{info.version:<6} {info.kind:<6} step {step:<8} {_size(info.bytes_stored):>10}  "
                  f"{info.tensors_changed:>6} tensors {info.elements_changed:>12} elements changed  {info.created}")
    if not infos and not args.json:
        print(f"{args.url}: no versions")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from deltastore.errors import IntegrityError
    from deltastore.pull import Subscriber

    with Subscriber(args.url, storage_options=_storage_options(args), trusted_keys=args.trusted_key) as sub:
        if sub.latest() is None:
            print(f"{args.url}: no versions to verify")
            return EXIT_FAILED
        # Every segment (full and delta) of every manifest checked, every chunk's digest.
        report = sub.verify(args.version, all_versions=args.all)
    bad = {p.version for p in report.problems}
    for p in report.problems:
        print(f"BAD version {p.version}: {p.message}")
    shown = report.versions if args.all else report.versions[-1:]
    for v in shown:
        if v not in bad:
            print(f"OK version {v}: {report.tensors[v]} tensors verified")
    if report.problems:
        first = report.problems[0]
        raise IntegrityError(
            f"{len(report.problems)} bad segment(s) or chunk(s) in {len(bad)} version(s) of {args.url}; "
            f"first, in version {first.version}: {first.message}"
        )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from deltastore.ledger import (
        fleet_status,
        oldest_live_version,
        parse_time,
        read_ledger,
    )
    from deltastore.pull import Subscriber

    with Subscriber(args.url, storage_options=_storage_options(args), trusted_keys=args.trusted_key) as sub:
        head = sub.latest()
        beats = read_ledger(sub.store)
        # Only the versions a lagging worker lacks first are needed (their commit times), not
        # the whole history: walk the chain down to the oldest of them, no further.
        behind = [b.version + 1 for b in beats if head is not None and b.version < head.version]
        infos = {i.version: i for i in sub.log(since=min(behind))} if behind else {}
    head_version = head.version if head else 0
    workers = fleet_status(beats, head_version, lambda v: parse_time(infos[v].created) if v in infos else None)
    head_age = None
    if head is not None and (t := parse_time(head.created)) is not None:
        from datetime import datetime, timezone

        head_age = (datetime.now(timezone.utc) - t).total_seconds()
    oldest = oldest_live_version(beats)
    if args.json:
        print(json.dumps({
            "url": args.url, "head_version": head_version, "head_age_s": head_age,
            "oldest_live_version": oldest,
            "workers": [{"worker": w.worker, "host": w.host, "version": w.version, "lag_versions": w.lag_versions,
                         "lag_s": w.lag_s, "last_seen_s": w.last_seen_s, "live": w.live} for w in workers],
        }, sort_keys=True))
        return 0
    if head is None:
        print(f"{args.url}: no versions")
    else:
        age = "" if head_age is None else f", {_duration(head_age)} old"
        print(f"{args.url}: head version {head_version}{age}; {len(workers)} worker(s), "
              f"{sum(w.live for w in workers)} live, oldest live version {oldest if oldest is not None else '-'}")
    for w in workers:
        lag = "current" if w.lag_versions == 0 else f"{w.lag_versions} behind" + (
            "" if w.lag_s is None else f" ({_duration(w.lag_s)})")
        state = "live" if w.live else "gone"
        print(f"  {w.worker:<32} v{w.version:<6} {lag:<24} seen {_duration(w.last_seen_s)} ago  {state}  {w.host}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from deltastore.errors import VersionNotFoundError
    from deltastore.history import History
    from deltastore.manifest import dump
    from deltastore.signing import TrustedKeys
    from deltastore.storage import open_store

    check = TrustedKeys(args.trusted_key).verify if args.trusted_key else None
    history = History(open_store(args.url, storage_options=_storage_options(args)), check)
    got = history.read_head()
    if got is None or got[0].manifest is None:
        raise VersionNotFoundError(f"{args.url}: no versions")
    head = got[0]
    key, m = history.resolve(head.version if args.version is None else args.version, head)
    if args.json:
        print(json.dumps(json.loads(dump(m)), indent=1, sort_keys=True))
        return 0
    layout = history.layout(m.layout) if m.layout is not None else None
    for line in _inspect_lines(key, m, layout):
        print(line)
    return 0


def _inspect_lines(key: str, m: Any, layout: Any) -> list[str]:
    """``deltastore inspect``: every field of a manifest, one fact per line."""
    out = [f"manifest        {key}", f"schema          {m.schema_}"]
    for name in ("version", "kind", "parent", "parent_manifest", "anchor", "anchor_manifest", "delta_base",
                 "chain_start", "step", "created", "writer", "epoch", "commit_id", "lineage", "state_digest",
                 "max_attempt_s"):
        value = getattr(m, name)
        if value is not None or m.schema_ >= 3:
            out.append(f"{name:<15} {'-' if value is None else value}")
    sig = m.signature
    out.append(f"signature       {'none' if sig is None else f'{sig.alg} key {sig.key_id}'}")
    out.append(f"metadata        {json.dumps(m.metadata, sort_keys=True)}")
    out.append("stats           " + ", ".join(f"{k}={v}" for k, v in m.stats.model_dump().items() if v is not None))
    out.append(f"back            {len(m.back)} skip pointer(s)")
    out += [f"  v{m.version - 2**j:<12} {k}" for j, k in enumerate(m.back, 1)]
    out.append(f"squashes        {len(m.squashes)}")
    out += [f"  {s.from_} -> {s.to}  {_size(s.bytes)}  {s.key}" for s in m.squashes]
    if layout is not None:
        out.append(f"layout          {m.layout.key} (sha256 {m.layout.sha256}), {len(layout.name)} tensor(s), parts {layout.parts}")
        for i, name in enumerate(layout.name):
            out.append(f"  [{i}] {name}  {layout.dtype[i]} {list(layout.shape[i])}  chunk_rows {layout.chunk_rows[i]}")
    else:
        out.append("layout          inline (schema 1/2: the tensors below carry it)")
    out.append(f"packs           {len(m.blobs)}")
    for i, b in enumerate(m.blobs):
        role = "" if b.role is None else f"role {b.role}  "
        size = f"{b.size} B" if b.size < 1024 else f"{_size(b.size)} ({b.size} B)"
        out.append(f"  [{i}] {role}{size}  {b.key}")
    listed = sum(len(t.chunks) for t in m.tensors)
    out.append(f"tensors         {len(m.tensors)} listed, {listed} chunk row(s)")
    for t in m.tensors:
        out.append(f"  {t.name}  {t.dtype} {list(t.shape)}  chunk_rows {t.chunk_rows}  ({len(t.chunks)} chunk(s) listed)")
        for c in t.chunks:
            out.append(f"    chunk {c.index}  digest {c.digest}")
            for which, seg in (("delta", c.delta), ("full", c.full)):
                if seg is not None:
                    out.append(f"      {which:<5} pack {seg.blob} @ {seg.offset} +{seg.length}  {seg.codec}  "
                               f"n_changed {seg.n_changed}  sha256 {seg.sha256}")
    return out


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _cmd_compact(args: argparse.Namespace) -> int:
    from deltastore.compact import compact

    if args.follow:
        return _compact_follow(args)
    report = compact(args.url, bases=args.base, storage_options=_storage_options(args), writer=args.writer,
                     register=not args.no_register)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
        return 0
    for s in report.squashes:
        ratio = s.chain_bytes / s.bytes if s.bytes else float("inf")
        print(f"squash {s.from_}→{s.to}: {_size(s.bytes)} replacing {_size(s.chain_bytes)} of deltas ({ratio:.2f}×), {s.key}")
    for base, why in report.skipped:
        print(f"no squash from {base}: {why}")
    where = "registered in the history index" if report.registered else "not registered"
    print(f"{len(report.squashes)} squash(es) to version {report.to} of {args.url}, {where}, in {report.seconds:.1f} s")
    return 0


def _compact_follow(args: argparse.Namespace) -> int:
    """``compact --follow``: one round (squashes to the new head) each time HEAD's version
    moves, one line per round, until SIGINT/SIGTERM (the current round is finished first)."""
    import signal
    import threading

    from deltastore.compact import ANCHOR_SQUASH_EVERY, compact
    from deltastore.history import History
    from deltastore.storage import open_store

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:  # finish the current round, then end
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    store = open_store(args.url, storage_options=_storage_options(args))
    try:
        history = History(store)
        done: int | None = None  # the head version of the last round
        while not stop.is_set():
            head = history.poll_head()  # a conditional GET; our own index writes move no version
            if head is not None and head.manifest is not None and head.version != done:
                done = head.version  # a failed round is not retried until HEAD moves again
                try:
                    report = compact(store, bases=args.base, to=head.version, writer=args.writer,
                                     register=not args.no_register, anchor_squash_every=ANCHOR_SQUASH_EVERY)
                except DeltastoreError as e:
                    logger.warning("compaction round to version %d of %s failed: %s", head.version, args.url, e)
                    if args.json:
                        print(json.dumps({"to": head.version, "error": _one_line(e)}, sort_keys=True), flush=True)
                    else:
                        print(f"version {head.version}: round failed: {_one_line(e)}", flush=True)
                else:
                    if args.json:
                        print(json.dumps(report.to_json(), sort_keys=True), flush=True)
                    else:
                        made = ", ".join(f"{s.from_}→{s.to} {_size(s.bytes)}" for s in report.squashes) or "nothing to squash"
                        print(f"version {report.to}: {len(report.squashes)} squash(es) ({made}), "
                              f"{'registered' if report.registered else 'not registered'}, {report.seconds:.1f} s", flush=True)
            stop.wait(args.interval)
    finally:
        store.close()
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from deltastore.signing import generate_key_files, key_id, load_public_key

    priv, pub = generate_key_files(args.private_key)
    print(f"wrote private key {priv} (mode 0600) and public key {pub} (key id {key_id(load_public_key(pub))})")
    return 0


# --- gc, pin, unpin (SPEC §11) -----------------------------------------------------------------


def _parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` or plain seconds, as seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            value = float(t[:-1]) * units[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 30m, 24h, 7d)") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _cmd_gc(args: argparse.Namespace) -> int:
    from deltastore.gc import collect

    report = collect(
        args.url, keep_last=args.keep_last, keep_versions=args.keep_version or (), grace_s=args.grace,
        dry_run=args.dry_run, storage_options=_storage_options(args), upgrade=args.upgrade,
    )
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
        return 0
    if report.aborted_reason:
        print(f"{args.url}: {report.aborted_reason}")
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    kept = report.kept_versions
    span = f"versions {kept[0]}-{kept[-1]}" if kept else "no versions"
    pins = ", ".join(map(str, report.pins)) or "none"
    print(f"{args.url}: head {report.head_version}, floor {report.floor_before} -> {report.floor_after}; "
          f"keeping {span}, pins: {pins}")
    print(f"  kept {report.kept_objects} objects ({_size(report.kept_bytes)}) needed by kept versions, "
          f"{report.young_objects} ({_size(report.young_bytes)}) younger than the grace period")
    parts = ", ".join(f"{len(keys)} {kind}" for kind, keys in report.deleted.items() if keys) or "nothing"
    print(f"  {verb} {report.deleted_objects} objects ({_size(report.deleted_bytes)} freed): {parts}")
    if args.verbose or report.dry_run:
        for keys in report.deleted.values():
            for key in keys:
                print(f"    {verb} {key}")
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    from deltastore.index import pin

    index = pin(args.url, args.version, note=args.note or "", storage_options=_storage_options(args))
    print(f"pinned version {args.version} of {args.url} (floor {index.floor}; pins: "
          f"{', '.join(str(p.version) for p in index.pins)})")
    return 0


def _cmd_unpin(args: argparse.Namespace) -> int:
    from deltastore.index import unpin

    index = unpin(args.url, args.version, storage_options=_storage_options(args))
    pins = ", ".join(str(p.version) for p in index.pins) if index is not None else ""
    print(f"version {args.version} of {args.url} is not pinned (pins: {pins or 'none'})")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltastore", description="Publish and pull model weights as verified deltas through object storage.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv for debug)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL or AWS)")
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="backend option, repeatable")
    sub = parser.add_subparsers(dest="command", required=True)
    trusted = (("--trusted-key",), {"action": "append", "metavar": "FILE",
               "help": "Ed25519 public key (PEM); every manifest must be signed by one (repeatable)"})

    p = sub.add_parser("publish", parents=[common], help="commit a safetensors file as the next version")
    p.add_argument("url")
    p.add_argument("file", help="a .safetensors file")
    p.add_argument("--step", type=int)
    p.add_argument("--metadata", help="JSON object stored with the version")
    p.add_argument("--anchor", action="store_true", help="write a full snapshot (also allows a layout change)")
    p.add_argument("--anchor-every", type=int, default=None,
                   help="a snapshot every N versions (default: once the deltas since the last snapshot reach its size)")
    p.add_argument("--signing-key", metavar="FILE", help="Ed25519 private key (PEM) to sign the manifest with")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser("pull", parents=[common], help="write a version to a safetensors file")
    p.add_argument("url")
    p.add_argument("out", help="output .safetensors path")
    p.add_argument("--version", type=int, help="default: the latest")
    p.add_argument("--follow", action="store_true", help="keep OUT at the latest version (one line per version) until Ctrl-C/SIGTERM")
    p.add_argument("--interval", type=float, default=2.0, help="with --follow: seconds between polls of HEAD (default 2)")
    p.add_argument("--cache", metavar="DIR", help="with --follow: worker cache directory, to restart without refetching")
    p.add_argument("--json", action="store_true", help="with --follow: one JSON object per version")
    p.add_argument("--max-versions", type=int, help="with --follow: stop after this many versions")
    p.add_argument("--worker-id", help="with --follow: the id of this worker's heartbeat (default host-pid-random)")
    p.add_argument(*trusted[0], **trusted[1])
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("log", parents=[common], help="list versions")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(*trusted[0], **trusted[1])
    p.set_defaults(func=_cmd_log)

    p = sub.add_parser("verify", parents=[common], help="re-read a version's chain and check every digest")
    p.add_argument("url")
    p.add_argument("--version", type=int, help="default: the latest")
    p.add_argument("--all", action="store_true", help="verify every version")
    p.add_argument(*trusted[0], **trusted[1])
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("status", parents=[common], help="head version and each following worker's lag")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(*trusted[0], **trusted[1])
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("inspect", parents=[common], help="print everything in one version's manifest")
    p.add_argument("url")
    p.add_argument("--version", type=int, help="default: the latest")
    p.add_argument("--json", action="store_true", help="the manifest as read (schema 3: tensors rebuilt from its layout), as JSON")
    p.add_argument(*trusted[0], **trusted[1])
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("compact", parents=[common], help="write squashed deltas to head for workers far behind")
    p.add_argument("url")
    p.add_argument("--base", type=int, action="append", metavar="V",
                   help="squash from version V (repeatable; default: versions live workers hold, and the latest anchor)")
    p.add_argument("--writer", help="the id recorded in the squashes and the index (default compactor-host-pid)")
    p.add_argument("--no-register", action="store_true", help="write the squashes without registering them in the index")
    p.add_argument("--json", action="store_true", help="one JSON object (with --follow: one per round, one a line)")
    p.add_argument("--follow", action="store_true",
                   help="keep compacting: one round each time HEAD's version moves, until Ctrl-C/SIGTERM "
                        "(the anchor squash every 8 versions)")
    p.add_argument("--interval", type=float, default=2.0, help="with --follow: seconds between polls of HEAD (default 2)")
    p.set_defaults(func=_cmd_compact)

    p = sub.add_parser("keygen", help="write a new Ed25519 key pair for signing manifests")
    p.add_argument("private_key", metavar="PRIVATE.pem", help="private key path (0600); the public key goes beside it as .pub")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("gc", parents=[common], help="delete history the retention rules no longer need (SPEC §11)")
    p.add_argument("url")
    p.add_argument("--keep-last", type=int, default=10, metavar="N", help="keep the last N versions readable (default 10)")
    p.add_argument("--keep-version", type=int, action="append", metavar="V", help="pin version V first (repeatable)")
    p.add_argument("--grace", type=_parse_duration, default=86400.0, metavar="DURATION",
                   help="never delete objects younger than this (store clock; e.g. 24h, 30m, 90s; default 24h, minimum 6h10m)")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; write nothing but the run record")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--upgrade", action="store_true", help="rewrite a schema-1/2 HEAD as schema 3 first (older publishers then stop)")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser("pin", parents=[common], help="keep version V through GC (recorded in the history index)")
    p.add_argument("url")
    p.add_argument("version", type=int)
    p.add_argument("--note", help="why it is pinned (kept in the index)")
    p.set_defaults(func=_cmd_pin)

    p = sub.add_parser("unpin", parents=[common], help="let GC collect a pinned version again")
    p.add_argument("url")
    p.add_argument("version", type=int)
    p.set_defaults(func=_cmd_unpin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltastore`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    debug = os.environ.get("DELTASTORE_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except (DeltastoreError, OSError, ValueError) as e:
        if debug:
            raise
        print(f"deltastore: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("deltastore: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    text = str(e) if str(e) else type(e).__name__
    return f"{type(e).__name__}: {' '.join(text.split())}"


if __name__ == "__main__":
    sys.exit(main())
