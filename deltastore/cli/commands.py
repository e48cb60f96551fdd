"""The commands of the ``deltastore`` CLI, one function each (``args`` in, exit code out).

Heavy modules (torch, safetensors, boto3) are imported inside the commands that need them.
Each command opens its store itself (:func:`deltastore.cli.common.open_store`): only ``publish``
may create a local store; every other command fails on a missing one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import uuid
from typing import Any

from deltastore.cli.common import (
    EXIT_NOTHING_TO_DO,
    EXIT_OK,
    EXIT_USAGE,
    byte_progress,
    counting_store,
    duration,
    emit_json,
    one_line,
    open_store,
    read_history,
    size,
    trusted_keys,
)
from deltastore.errors import ConflictError, DeltastoreError, InvalidStateDictError

logger = logging.getLogger(__name__)

#: A HEAD written less than this long ago by a publisher that is not a one-off CLI call means a
#: trainer probably still runs there: ``publish`` warns before fencing it, ``--no-takeover``
#: refuses. Trainers publish every few seconds to minutes; a dead one is quiet for longer.
LIVE_WRITER_S = 300.0
#: Prefix of the writer id of CLI publishes: a HEAD they wrote belongs to a process that has
#: exited, so it never counts as a live writer.
CLI_WRITER_PREFIX = "cli-"
#: File suffixes of PyTorch pickles, which deltastore does not load (unsafe, and not a state dict format).
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
#: ``pull --follow``'s default seconds between polls of HEAD.
FOLLOW_INTERVAL_S = 2.0
#: Reads of a checkpoint that is replaced while being read (a trainer's atomic save of its next
#: step) before giving up: a save takes far longer than a read, so a second read gets a whole file.
LOAD_ATTEMPTS = 3


def _info_json(info: Any) -> dict[str, Any]:
    return {
        "version": info.version, "step": info.step, "kind": info.kind, "parent": info.parent,
        "anchor": info.anchor, "bytes_stored": info.bytes_stored, "tensors_changed": info.tensors_changed,
        "elements_changed": info.elements_changed, "created": info.created, "writer": info.writer,
        "metadata": info.metadata, "manifest": info.manifest, "formats": list(info.formats),
        "stream_bytes": dict(info.stream_bytes),
    }


# --- publish ------------------------------------------------------------------------------------


def load_state(path: str) -> dict[str, Any]:
    """Read a ``.safetensors`` file, or raise a one-line error naming it (missing, a directory,
    a PyTorch pickle, truncated, or not safetensors at all)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; publish takes one .safetensors file")
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise InvalidStateDictError(
            f"{path} is a PyTorch pickle, not a .safetensors file; convert it first: python -c \"import torch; "
            f"from safetensors.torch import save_file; save_file(torch.load('{path}'), 'model.safetensors')\""
        )
    for _ in range(LOAD_ATTEMPTS):
        with open(path, "rb") as f:  # held open: its inode tells whether ``path`` moved on meanwhile
            before = os.fstat(f.fileno())
            try:
                state = _load_checked(path, f, before.st_size)
            except InvalidStateDictError:
                if _same_file(before, os.stat(path)):
                    raise
                state = None  # two files' bytes mixed into an unreadable one: read again
        if state is not None and _same_file(before, os.stat(path)):
            return state
        logger.warning("%s was replaced while it was read (a writer saved a newer one); reading it again", path)
    raise InvalidStateDictError(
        f"{path} was replaced while it was read, {LOAD_ATTEMPTS} times in a row; publish a file nobody is writing"
    )


def _load_checked(path: str, f: Any, size_: int) -> dict[str, Any]:
    """The tensors of ``path`` (open as ``f``), after checking its header."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    header = f.read(n) if 0 < n <= min(size_ - 8, 100 * 2**20) else b""
    if not header.startswith(b"{"):
        raise InvalidStateDictError(f"{path} is not a .safetensors file (no safetensors header at its start)")
    try:
        entries = json.loads(header)
    except ValueError as e:
        raise InvalidStateDictError(f"{path} is not a readable .safetensors file: its header is not JSON ({e})") from None
    ends = [v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__" and isinstance(v, dict)]
    if 8 + n + max(ends, default=0) > size_:
        raise InvalidStateDictError(
            f"{path} is truncated: its header describes {8 + n + max(ends)} bytes, the file has {size_}"
        )
    from safetensors.torch import load_file

    try:
        # load_file reads the header through one open and maps the data by name: if ``path`` is
        # replaced in between, one file's offsets cut the other's bytes (the caller checks).
        return load_file(path)
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
        raise InvalidStateDictError(f"{path} is not a readable .safetensors file: {' '.join(str(e).split())}") from e


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """The same file, unmodified (an atomic save makes a new inode; an in-place one a new mtime)."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _live_writer(store: Any) -> tuple[Any, float] | None:
    """HEAD and its age when a publisher other than a CLI call wrote it within LIVE_WRITER_S."""
    from datetime import datetime, timezone

    from deltastore.format.history import History
    from deltastore.fleet.ledger import parse_time

    got = History(store).read_head()
    if got is None:
        return None
    head = got[0]
    when = parse_time(head.updated)
    if when is None or head.writer.startswith(CLI_WRITER_PREFIX):
        return None
    age = (datetime.now(timezone.utc) - when).total_seconds()
    return (head, age) if age < LIVE_WRITER_S else None


def cmd_publish(args: argparse.Namespace) -> int:
    from deltastore.write.policy import AnchorPolicy, WriterPolicy
    from deltastore.write.publisher import Publisher

    state = load_state(args.file)  # a bad file fails before the store is touched
    store = open_store(args, write=True)
    try:
        live = _live_writer(store)
        if live is not None:
            head, age = live
            what = (f"HEAD of {args.url} was written {age:.0f} s ago by publisher {head.writer} (epoch {head.epoch}), "
                    f"which may still be running")
            if args.no_takeover:
                raise ConflictError(f"{what}; --no-takeover refuses to fence it. Run without --no-takeover to take "
                                    f"the store over (that publisher's next publish then fails with FencedError)")
            logger.warning("%s; publishing fences it (its next publish fails with FencedError). "
                           "Use --no-takeover to refuse instead", what)
        writer = f"{CLI_WRITER_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with byte_progress("publish", quiet=args.quiet_total > 0) as add:
            policy = WriterPolicy(writer_id=writer, takeover=not args.no_takeover, skip_unchanged=not args.allow_empty,
                                  allow_unsafe_store=args.allow_unsafe_store, allow_unsigned=args.allow_unsigned)
            with Publisher(args.url, store=counting_store(store, add), signing_key=args.signing_key, writer_policy=policy,
                           anchor_policy=AnchorPolicy(every=args.anchor_every), formats=args.formats or ()) as pub:
                before = pub.version
                info = pub.publish(state, step=args.step, metadata=args.metadata, anchor=args.anchor)
    finally:
        store.close()
    skipped = info.version == before
    if args.json:
        emit_json({**_info_json(info), "url": args.url, "skipped": skipped})
    elif skipped:
        print(f"nothing to publish: {args.file} is identical to version {info.version} of {args.url} "
              f"(pass --allow-empty to commit it anyway)")
    else:
        print(f"published version {info.version} ({info.kind}) to {args.url}: {size(info.bytes_stored)}, "
              f"{info.tensors_changed} tensors / {info.elements_changed} elements changed")
    return EXIT_NOTHING_TO_DO if skipped else EXIT_OK


# --- pull ---------------------------------------------------------------------------------------


def _check_out(path: str) -> None:
    """Fail before any download when OUT cannot be written."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; pull writes one .safetensors file (e.g. {os.path.join(path, 'model.safetensors')})")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output directory {parent} does not exist; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"output directory {parent} is not writable")


def _pull_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with ``pull``'s flags together (None: nothing), before any IO."""
    if args.follow:
        if args.version is not None:
            return "--version pulls one version and --follow keeps OUT at the latest one: pass one of them"
        if args.worker_id is not None:
            from deltastore.fleet.ledger import check_worker_id

            try:
                check_worker_id(args.worker_id)
            except ValueError as e:
                return f"--worker-id: {e}"
        return None
    for flag, value in (("--interval", args.interval), ("--cache", args.cache), ("--max-versions", args.max_versions),
                        ("--metrics-port", args.metrics_port),
                        ("--worker-id", args.worker_id), ("--on-history-replaced", args.on_history_replaced)):
        if value is not None:
            return f"{flag} is for --follow; a pull without --follow writes one version and exits"
    return None


def cmd_pull(args: argparse.Namespace) -> int:
    problem = _pull_usage(args)
    if problem is not None:
        print(f"deltastore: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from safetensors.torch import save_file

    from deltastore.read.subscriber import Subscriber

    _check_out(args.out)
    if args.follow:
        return _follow(args)
    store = open_store(args)
    try:
        with byte_progress("pull", quiet=args.quiet_total > 0) as add:
            with Subscriber(args.url, store=counting_store(store, add), trusted_keys=args.trusted_key,
                            format=args.format, node_cache=args.node_cache, mirrors=args.mirror) as sub:
                state = sub.pull(args.version)
                version = sub.version
    finally:
        store.close()
    tmp = f"{args.out}.partial"
    save_file(state, tmp, metadata={"deltastore_url": args.url, "deltastore_version": str(version)})
    os.replace(tmp, args.out)  # never leave a half-written output under the real name
    if args.json:
        emit_json({"url": args.url, "version": version, "out": args.out, "tensors": len(state),
                   "bytes": sum(t.numel() * t.element_size() for t in state.values())})
    else:
        print(f"pulled version {version} of {args.url} to {args.out} ({len(state)} tensors)")
    return EXIT_OK


def _missing_local_store(url: str) -> bool:
    """A local store URL whose directory does not exist (yet): nothing at that path at all."""
    if "://" in url and not url.startswith("file://"):
        return False
    return not os.path.lexists(os.path.expanduser(url.removeprefix("file://")))


def _follow(args: argparse.Namespace) -> int:
    """``pull --follow``: keep OUT at the latest version until SIGINT/SIGTERM (then exit 0).

    Started before the trainer, it waits (one stderr line) for the first version, and for a
    local store directory that does not exist yet, as for an empty prefix."""
    import signal
    import threading
    import time

    from safetensors.torch import save_file

    from deltastore.read.cache import WorkerCache
    from deltastore.errors import BucketNotFoundError, WaitTimeoutError
    from deltastore.read.follow import CachePolicy, HeartbeatPolicy, PollPolicy
    from deltastore.read.subscriber import Subscriber

    interval = args.interval if args.interval is not None else FOLLOW_INTERVAL_S
    if args.cache is not None:
        WorkerCache(args.cache)  # a cache path that cannot be a directory fails now, not after the wait
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:  # finish the current version, then end
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    said: list[bool] = []

    def waiting() -> None:  # once, however long the wait
        if not said and not args.quiet_total:
            print(f"deltastore: waiting for the first version of {args.url} (Ctrl-C stops)", file=sys.stderr, flush=True)
        said.append(True)

    while True:
        try:
            store = open_store(args)  # a non-S3 endpoint fails here instead of looking empty forever
            break
        except BucketNotFoundError:
            if not _missing_local_store(args.url):
                raise  # a bucket is made by whoever runs the store, never by a trainer; a file is no store
            waiting()  # a local store's directory appears with the trainer's first publish
            if stop.wait(interval):
                return EXIT_OK
    try:
        with Subscriber(args.url, store=store, trusted_keys=args.trusted_key, format=args.format,
                        node_cache=args.node_cache, mirrors=args.mirror) as sub:
            try:
                sub.wait_for_version(interval=interval, timeout=0)
            except WaitTimeoutError:  # nothing published yet: say so once, then wait without a word
                waiting()
                if sub.wait_for_version(interval=interval, stop=stop) is None:
                    return EXIT_OK
            target = sub.allocate()  # the layout to follow into
            records = sub.follow(target, poll=PollPolicy(interval), stop=stop,
                                 cache=CachePolicy(args.cache) if args.cache is not None else None,
                                 heartbeat=HeartbeatPolicy(args.worker_id), max_versions=args.max_versions,
                                 on_history_replaced=args.on_history_replaced, metrics_port=args.metrics_port)
            for rec in records:
                t0 = time.perf_counter()
                tmp = f"{args.out}.partial"
                save_file(target, tmp, metadata={"deltastore_url": args.url, "deltastore_version": str(rec.info.version)})
                os.replace(tmp, args.out)  # readers of OUT see one whole version or the next
                write_s = time.perf_counter() - t0
                if args.json:
                    emit_json({
                        "version": rec.info.version, "from_version": rec.from_version, "full_load": rec.full_load,
                        "bytes_fetched": rec.bytes_fetched, "fetch_s": round(rec.fetch_s, 6),
                        "decode_s": round(rec.decode_s, 6), "pause_s": round(rec.pause_s, 6),
                        "write_s": round(write_s, 6), "out": args.out,
                    })
                else:
                    how = "full load" if rec.full_load else f"from v{rec.from_version}"
                    print(f"v{rec.info.version} ({how}): {size(rec.bytes_fetched)} fetched, fetch {rec.fetch_s:.3f} s, "
                          f"decode {rec.decode_s:.3f} s, pause {rec.pause_s:.3f} s, wrote {args.out} in {write_s:.3f} s",
                          flush=True)
    finally:
        store.close()
    return EXIT_OK


# --- read-only commands -------------------------------------------------------------------------


def cmd_log(args: argparse.Namespace) -> int:
    if args.plot:
        from deltastore.cli.plot import pyplot

        pyplot()  # a missing matplotlib fails before any IO
    keys = trusted_keys(args)
    store = open_store(args)
    try:
        history = read_history(store, keys)
        infos = history.log()
        if args.plot:
            from deltastore.cli.plot import plot_history, points_of_history

            since = infos[0].version if infos else 1
            plot_history(*points_of_history(history, since=since), args.plot, title=args.url)
    finally:
        store.close()
    for info in infos:
        if args.json:
            emit_json(_info_json(info))
        else:
            step = "-" if info.step is None else str(info.step)
            streams = "".join(f"  + {f} {size(b)}" for f, b in info.stream_bytes.items())
            print(f"v{info.version:<6} {info.kind:<6} step {step:<8} {size(info.bytes_stored):>10}  "
                  f"{info.tensors_changed:>6} tensors {info.elements_changed:>12} elements changed  {info.created}"
                  f"{streams}")
    if not infos and not args.json:
        print(f"{args.url}: no versions")
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from deltastore.cli.fleet import cmd_ready, target_line

    if args.worker is not None:  # a readiness probe (deltastore.fleet.status)
        return cmd_ready(args)
    from deltastore.fleet.ledger import (
        LIVE_TTL_S,
        fleet_status,
        oldest_live_version,
        parse_time,
        read_ledger,
    )
    keys = trusted_keys(args)
    store = open_store(args)
    try:
        history = read_history(store, keys)  # versions and their times only: no Subscriber, no torch
        head = history.latest()
        beats = read_ledger(store)
        got = history.read_head()
        target_doc, target_text = target_line(store, None if got is None else got[0], keys)
        # Only the versions a lagging worker lacks first are needed (their commit times), not
        # the whole history: walk the chain down to the oldest of them, no further.
        behind = [b.version + 1 for b in beats if head is not None and b.version < head.version]
        infos = {i.version: i for i in history.log(since=min(behind))} if behind else {}
    finally:
        store.close()
    head_version = head.version if head else 0
    workers = fleet_status(beats, head_version, lambda v: parse_time(infos[v].created) if v in infos else None,
                           ttl_s=LIVE_TTL_S)
    head_age = None
    if head is not None and (t := parse_time(head.created)) is not None:
        from datetime import datetime, timezone

        head_age = (datetime.now(timezone.utc) - t).total_seconds()
    oldest = oldest_live_version(beats, ttl_s=LIVE_TTL_S)
    if args.json:
        emit_json({
            "url": args.url, "head_version": head_version, "head_age_s": head_age,
            "oldest_live_version": oldest, "live_ttl_s": LIVE_TTL_S, "fleet_target": target_doc,
            "workers": [{"worker": w.worker, "host": w.host, "version": w.version, "lag_versions": w.lag_versions,
                         "lag_s": w.lag_s, "last_seen_s": w.last_seen_s, "live": w.live, "state": w.state,
                         "stage": w.progress.stage, "goal": w.progress.goal, "goal_lag": w.progress.lag,
                         "last_error": w.progress.error, "serving_format": w.serving_format}
                        for w in workers],
        })
        return EXIT_OK
    if head is None:
        print(f"{args.url}: no versions")
    else:
        age = "" if head_age is None else f", {duration(head_age)} old"
        print(f"{args.url}: head version {head_version}{age}")
        print(target_text)
    if workers:
        stopped = sum(w.state == "stopped" for w in workers)
        print(f"{len(workers)} worker(s): {sum(w.live for w in workers)} live, {stopped} stopped, "
              f"{len(workers) - stopped - sum(w.live for w in workers)} gone; oldest live version "
              f"{oldest if oldest is not None else '-'} (live = following, heartbeat within {duration(LIVE_TTL_S)})")
    for w in workers:
        lag = "current" if w.lag_versions == 0 else f"{w.lag_versions} behind" + (
            "" if w.lag_s is None else f" ({duration(w.lag_s)})")
        stage = "" if w.progress.stage is None else f"  {w.progress.stage}" + (
            "" if w.progress.goal is None else f" (goal v{w.progress.goal})")
        error = "" if w.progress.error is None else f"  last error: {w.progress.error}"
        fmt = "" if w.serving_format is None else f"  reads {w.serving_format}"
        print(f"  {w.worker:<32} v{w.version:<6} {lag:<24} seen {duration(w.last_seen_s)} ago  {w.state:<7}  {w.host}"
              f"{fmt}{stage}{error}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from deltastore.errors import VersionNotFoundError
    from deltastore.format.models import dump

    keys = trusted_keys(args)
    store = open_store(args)
    try:
        history = read_history(store, keys)
        got = history.read_head()
        if got is None or got[0].manifest is None:
            raise VersionNotFoundError(f"{args.url}: no versions")
        head = got[0]
        key, m = history.resolve(head.version if args.version is None else args.version, head)
        if args.json:
            print(json.dumps(json.loads(dump(m)), indent=1, sort_keys=True))
            return EXIT_OK
        layout = history.layout(m.layout) if m.layout is not None else None
    finally:
        store.close()
    for line in _inspect_lines(key, m, layout):
        print(line)
    return EXIT_OK


def _inspect_lines(key: str, m: Any, layout: Any) -> list[str]:
    """``deltastore inspect``: every field of a manifest, one fact per line."""
    out = [f"manifest        {key}", f"schema          {m.schema_}"]
    for name in ("version", "kind", "parent", "parent_manifest", "anchor", "anchor_manifest", "delta_base",
                 "chain_start", "step", "created", "writer", "epoch", "commit_id", "lineage", "state_digest",
                 "max_attempt_s"):
        value = getattr(m, name)
        out.append(f"{name:<15} {'-' if value is None else value}")
    base = getattr(m, "base", None)
    if base is not None:  # a based version (design 009): its deltas apply to another store's version
        out.append(f"base            version {base.version} of another store: {base.manifest} (lineage {base.lineage})")
    comp = getattr(m, "compression", None)
    if comp is not None:  # a compressed site result (SPEC §14.1): lossy, read only by opted-in aggregators
        out.append(f"compression     {comp.method}: density {comp.density:g}, {comp.bits} bits, error feedback "
                   f"{'on' if comp.error_feedback else 'off'} (lossy site result)")
    sig = m.signature
    out.append(f"signature       {'none' if sig is None else f'{sig.alg} key {sig.key_id}'}")
    out.append(f"metadata        {json.dumps(m.metadata, sort_keys=True)}")
    out.append("stats           " + ", ".join(f"{k}={v}" for k, v in m.stats.model_dump().items() if v is not None))
    out.append(f"back            {len(m.back)} skip pointer(s)")
    out += [f"  v{m.version - 2**j:<12} {k}" for j, k in enumerate(m.back, 1)]
    out.append(f"squashes        {len(m.squashes)}")
    out += [f"  {s.from_} -> {s.to}  {size(s.bytes)}  {s.key}" for s in m.squashes]
    if layout is not None:
        out.append(f"layout          {m.layout.key} (sha256 {m.layout.sha256}), {len(layout.name)} tensor(s), parts {layout.parts}")
        for i, name in enumerate(layout.name):
            cols = layout.chunk_cols[i]  # a column grid (design 011): said only where there is one
            grid = f"  chunk_cols {cols}" if cols else ""
            out.append(f"  [{i}] {name}  {layout.dtype[i]} {list(layout.shape[i])}  chunk_rows {layout.chunk_rows[i]}{grid}")
    out.append(f"packs           {len(m.blobs)}")
    for i, b in enumerate(m.blobs):
        sz = f"{b.size} B" if b.size < 1024 else f"{size(b.size)} ({b.size} B)"
        out.append(f"  [{i}] role {b.role}  {sz}  {b.key}")
    listed = sum(len(t.chunks) for t in m.tensors)
    out.append(f"tensors         {len(m.tensors)} listed, {listed} chunk row(s)")
    for t in m.tensors:
        cols = m.chunk_cols(t.name) if hasattr(m, "chunk_cols") else 0
        grid = f"  chunk_cols {cols}" if cols else ""
        out.append(f"  {t.name}  {t.dtype} {list(t.shape)}  chunk_rows {t.chunk_rows}{grid}  ({len(t.chunks)} chunk(s) listed)")
        for c in t.chunks:
            out.append(f"    chunk {c.index}  digest {c.digest}")
            for which, seg in (("delta", c.delta), ("full", c.full)):
                if seg is not None:
                    out.append(f"      {which:<5} pack {seg.blob} @ {seg.offset} +{seg.length}  {seg.codec}  "
                               f"n_changed {seg.n_changed}  sha256 {seg.sha256}")
    return out


# --- maintenance --------------------------------------------------------------------------------


def cmd_compact(args: argparse.Namespace) -> int:
    from deltastore.lifecycle.compact import compact

    if args.follow:
        return _compact_follow(args)
    store = open_store(args)
    try:
        report = compact(store, bases=args.base, writer=args.writer, register=not args.no_register)
    finally:
        store.close()
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    for s in report.squashes:
        ratio = s.chain_bytes / s.bytes if s.bytes else float("inf")
        print(f"squash {s.from_}→{s.to}: {size(s.bytes)} replacing {size(s.chain_bytes)} of deltas ({ratio:.2f}×), {s.key}")
    for base, why in report.skipped:
        print(f"no squash from {base}: {why}")
    where = "registered in the history index" if report.registered else "not registered"
    print(f"{len(report.squashes)} squash(es) to version {report.to} of {args.url}, {where}, in {report.seconds:.1f} s")
    return EXIT_OK


def _compact_follow(args: argparse.Namespace) -> int:
    """``compact --follow``: one round (squashes to the new head) each time HEAD's version
    moves, one line per round, until SIGINT/SIGTERM (the current round is finished first)."""
    import signal
    import threading

    from deltastore.lifecycle.compact import ANCHOR_SQUASH_EVERY, compact
    from deltastore.format.history import History

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:  # finish the current round, then end
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    store = open_store(args)
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
                        emit_json({"to": head.version, "error": one_line(e)})
                    else:
                        print(f"version {head.version}: round failed: {one_line(e)}", flush=True)
                else:
                    if args.json:
                        emit_json(report.to_json())
                    else:
                        made = ", ".join(f"{s.from_}→{s.to} {size(s.bytes)}" for s in report.squashes) or "nothing to squash"
                        print(f"version {report.to}: {len(report.squashes)} squash(es) ({made}), "
                              f"{'registered' if report.registered else 'not registered'}, {report.seconds:.1f} s", flush=True)
            stop.wait(args.interval)
    finally:
        store.close()
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    from deltastore.format.signing import generate_key_files, key_id, load_public_key

    priv, pub = generate_key_files(args.private_key)
    kid = key_id(load_public_key(pub))
    if args.json:
        emit_json({"private_key": str(priv), "public_key": str(pub), "key_id": kid})
    else:
        print(f"wrote private key {priv} (mode 0600) and public key {pub} (key id {kid})")
    return EXIT_OK


def cmd_docs(args: argparse.Namespace) -> int:
    from deltastore._util import docs

    if args.name is None:
        names = docs.names()
        if not names:
            raise FileNotFoundError("this installation of deltastore carries no documentation (reinstall the package)")
        print("documents (deltastore docs NAME):")
        for n in names:
            print(f"  {n}")
        return EXIT_OK
    path = docs.find(args.name)
    if path is None:
        raise FileNotFoundError(f"no document named {args.name!r}; deltastore docs lists them")
    sys.stdout.write(path.read_text(encoding="utf-8"))
    return EXIT_OK


def parse_duration(text: str) -> float:
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


def cmd_gc(args: argparse.Namespace) -> int:
    from deltastore.lifecycle.gc import collect

    store = open_store(args)
    try:
        report = collect(store, keep_last=args.keep_last, keep_versions=args.keep_version or (), grace_s=args.grace,
                         dry_run=args.dry_run)
    finally:
        store.close()
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    if report.aborted_reason:
        print(f"{args.url}: {report.aborted_reason}")
        return EXIT_OK
    verb = "would delete" if report.dry_run else "deleted"
    kept = report.kept_versions
    span = f"versions {kept[0]}-{kept[-1]}" if kept else "no versions"
    pins = ", ".join(map(str, report.pins)) or "none"
    print(f"{args.url}: head {report.head_version}, floor {report.floor_before} -> {report.floor_after}; "
          f"keeping {span}, pins: {pins}")
    print(f"  kept {report.kept_objects} objects ({size(report.kept_bytes)}) needed by kept versions, "
          f"{report.young_objects} ({size(report.young_bytes)}) younger than the grace period")
    parts = ", ".join(f"{len(keys)} {kind}" for kind, keys in report.deleted.items() if keys) or "nothing"
    print(f"  {verb} {report.deleted_objects} objects ({size(report.deleted_bytes)} freed): {parts}")
    if args.verbose_total or report.dry_run:
        for keys in report.deleted.values():
            for key in keys:
                print(f"    {verb} {key}")
    return EXIT_OK


def _pins_json(args: argparse.Namespace, index: Any) -> dict[str, Any]:
    return {"url": args.url, "version": args.version, "floor": None if index is None else index.floor,
            "pins": [] if index is None else [{"version": p.version, "note": p.note} for p in index.pins]}


def cmd_pin(args: argparse.Namespace) -> int:
    from deltastore.lifecycle.index import pin

    store = open_store(args)
    try:
        index = pin(store, args.version, note=args.note or "")
    finally:
        store.close()
    if args.json:
        emit_json(_pins_json(args, index))
    else:
        print(f"pinned version {args.version} of {args.url} (floor {index.floor}; pins: "
              f"{', '.join(str(p.version) for p in index.pins)})")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    from deltastore.lifecycle.index import unpin

    store = open_store(args)
    try:
        index = unpin(store, args.version)
    finally:
        store.close()
    if args.json:
        emit_json(_pins_json(args, index))
    else:
        pins = ", ".join(str(p.version) for p in index.pins) if index is not None else ""
        print(f"version {args.version} of {args.url} is not pinned (pins: {pins or 'none'})")
    return EXIT_OK
