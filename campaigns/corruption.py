"""Corruption campaign: damage objects in the bucket directly; readers must fail typed, never
apply wrong bits.

Each trial publishes a short history (versions 1–6, anchors at 1 and 4) to a fresh prefix, lets
worker A hold version 2, then damages one reachable object straight in the bucket: a manifest, a
pack (delta or full) or HEAD — one byte flipped, truncated, replaced by garbage of the same
length, emptied, or deleted — or deletes HEAD and publishes a new run under the same URL (an
operator's restore, a lifecycle rule). Then:

- worker A ``pull_into``\\ s its weights to the latest version: it returns the exact bits of the
  version it reports, or raises a DeltastoreError and its weights are still version 2's;
- a fresh worker ``pull()``\\ s the latest and one older version: exact bits or DeltastoreError;
- ``deltastore verify --all`` (the CLI, in process) fails with one line and exit code 1, since a
  reachable object is damaged (a flipped byte in HEAD may land in a field nothing can check, so
  there verify may pass); passing is a wrong answer, a traceback is a wrong error.

With ``--formats`` the history is published in those serving formats too, the damage may hit the
first format's stream (its manifests and packs), and both workers read that format, checked
against the reference derivation of each step.

Trials = damaged stores.  ``python -m campaigns.corruption --backend seaweedfs --trials 100``
"""

from __future__ import annotations

import contextlib
import io
import random
import time
import traceback
from typing import Any

from campaigns.common import ChainChecker, Tally, campaign_options, fresh_url, main, manifest_json, parser

#: Versions published before the damage; anchors at 1 and 4, so damage meets anchors (full and
#: delta packs) and deltas alike.
VERSIONS = 6
ANCHOR_EVERY = 3
#: The version worker A holds when the store is damaged: its fast-forward crosses an anchor.
HELD = 2
#: The trainer of the new run: restarted from the old run's first step (same checkpoint), so
#: the two runs share some chunks and differ in others.
NEW_RUN = 7
DAMAGES = ("flip", "truncate", "garbage", "empty", "delete")
#: What is damaged, and how often (HEAD is one object, packs and manifests are many).
TARGETS = {"manifest": 3, "delta pack": 3, "full pack": 3, "HEAD": 2, "new run": 1}
#: With ``--formats``, also the objects of the first format's stream.
STREAM_TARGETS = {"stream manifest": 3, "stream pack": 3}


def _damage(data: bytes, how: str, rng: random.Random) -> bytes | None:
    if how == "delete":
        return None
    if how == "empty" or not data:
        return b""
    if how == "flip":
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1 :]
    if how == "truncate":
        return data[: rng.randrange(len(data))]
    return bytes(rng.getrandbits(8) for _ in range(len(data)))


def cli(argv: list[str]) -> tuple[int | None, str, BaseException | None]:
    """Run the ``deltastore`` CLI in process: (exit code, stderr, exception that escaped main)."""
    from deltastore.cli import main as cli_main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            return cli_main(argv), err.getvalue(), None
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 1), err.getvalue(), None
        except BaseException as e:  # noqa: BLE001 - a traceback is what a user would see
            return None, err.getvalue(), e


def cli_args(server: Any) -> list[str]:
    return ["--endpoint-url", server.endpoint_url,
            "--storage-option", f"aws_access_key_id={server.access_key}",
            "--storage-option", f"aws_secret_access_key={server.secret_key}",
            "--storage-option", f"region_name={server.region}"]  # fmt: skip


def judge_cli(tally: Tally, what: str, code: int | None, stderr: str, exc: BaseException | None, *, must_fail: bool) -> None:
    """CLI contract: failures are one line on stderr and exit code 1, never a traceback."""
    if exc is not None:
        tally.wrong(f"CLI traceback {type(exc).__name__}", f"{what}: {''.join(traceback.format_exception_only(type(exc), exc)).strip()}")
        return
    lines = [l for l in stderr.splitlines() if l.strip()]
    if code == 0:
        if must_fail:
            tally.wrong("verify passed a damaged store", what)
        return
    tally.error(f"CLI exit {code}")
    if code != 1 or len(lines) > 1 or "Traceback" in stderr:
        tally.wrong("CLI error not one line / exit 1", f"{what}: exit {code}, stderr {stderr[:300]!r}")


def read_checked(tally: Tally, oracle: Any, fmt: Any, what: str, fn: Any, step_of: Any) -> Any:
    """Run a read; exact bits (the oracle's, in serving format ``fmt`` unless None) or a
    DeltastoreError, else count it."""
    from deltastore import DeltastoreError

    try:
        state, version = fn()
    except DeltastoreError as e:
        tally.error(e)
        return None
    except Exception as e:  # noqa: BLE001
        tally.wrong(f"untyped {type(e).__name__}", f"{what}: {''.join(traceback.format_exception_only(type(e), e)).strip()}")
        return None
    why = oracle.differs_in(fmt, state, step_of(version))
    if why is not None:
        tally.corrupt(f"{what} returned version {version} with wrong bits: {why}")
    return state


def run(server: Any, args: Any) -> Tally:
    from campaigns.model import CHUNK_BYTES, Oracle, serving_formats, with_layout
    from deltastore import DeltastoreError, Publisher, Subscriber
    from deltastore.storage import open_store
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy

    tally = Tally("corruption", server.kind)
    rng = random.Random(args.seed)
    # Sparse steps (a few elements of one tensor): most chunks of two runs stay equal, as between
    # two fine-tuning runs from one checkpoint.
    options = campaign_options(server)
    formats = serving_formats(args.formats)
    fmt = formats[0] if formats else None
    weights = {**TARGETS, **(STREAM_TARGETS if fmt is not None else {})}
    targets = args.targets.split(",") if args.targets else list(weights)
    t0 = time.monotonic()
    for trial in range(args.trials):
        url = fresh_url(server, "corrupt")
        # Sparse steps (a few elements of one tensor): most chunks of two runs stay equal, as
        # between two fine-tuning runs from one checkpoint. Other bits every trial.
        oracle = Oracle(args.seed * 100_003 + trial, forks={NEW_RUN: (0, 0)}, sparse=True)

        with open_store(url, storage_options=options) as store:
            model = oracle.model(0)
            with with_layout(Publisher(url, store=store, writer_policy=WriterPolicy(threads=1),
                                       anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                                       layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), formats=formats),
                             args.grid) as pub:
                for k in range(VERSIONS):
                    pub.publish(model.state(k), step=model.step_id(k))
            links = ChainChecker(store, tally).check()
            step_of = {l.version: l.step for l in links}
            read_as = None if fmt is None else fmt.name
            worker = Subscriber(url, store=store, threads=1, format=read_as)
            target = worker.pull(HELD)
            held_step = step_of[HELD]

            # Every target once first (so that a short run covers them all), then at random.
            what = targets[trial] if trial < len(targets) else rng.choices(targets, weights=[weights[t] for t in targets])[0]
            how = rng.choice(DAMAGES)
            if what == "new run":
                how = "HEAD deleted,"
                store.delete("HEAD")
                other = oracle.model(NEW_RUN)
                with with_layout(Publisher(url, store=store, writer_policy=WriterPolicy(threads=1),
                                           anchor_policy=AnchorPolicy(every=50),
                                           layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), formats=formats),
                                 args.grid) as pub:
                    for k in range(VERSIONS):
                        pub.publish(other.state(k), step=other.step_id(k))
                new_links = ChainChecker(store, Tally("x", "x")).check()
                step_of = {l.version: l.step for l in new_links}
                key = "HEAD"
            else:
                victims = {
                    "HEAD": lambda: ["HEAD"],
                    "manifest": lambda: [l.key for l in links],
                    "delta pack": lambda: _packs(store, links, "delta"),
                    "full pack": lambda: _packs(store, links, "full"),
                    "stream manifest": lambda: _stream_objects(store, links, read_as)[0],
                    "stream pack": lambda: _stream_objects(store, links, read_as)[1],
                }[what]()
                if not victims:
                    what, victims = "manifest", [l.key for l in links]
                key = rng.choice(victims)
                damaged = _damage(store.get(key), how, rng)
                if damaged is None:
                    store.delete(key)
                else:
                    store.put(key, damaged, mode="overwrite")
            tally.faults[f"{how} {what}"] += 1
            label = f"trial {trial}: {how} {what} {key}"

            # Worker A fast-forwards in place.
            def forward():
                info = worker.pull_into(target)
                return target, (info.version if info else worker.version)

            before = tally.errors.total() + sum(tally.wrong_errors.values())
            read_checked(tally, oracle, fmt, f"{label}: pull_into from v{HELD}", forward, lambda v: step_of.get(v))
            if tally.errors.total() + sum(tally.wrong_errors.values()) > before:
                why = oracle.differs_in(fmt, target, held_step)
                if why is not None:
                    tally.corrupt(f"{label}: failed pull_into changed the weights: {why}")
            worker.close()

            # A fresh worker: the latest, and one older version.
            older = rng.randrange(1, VERSIONS)

            def fresh(version: int | None):
                with Subscriber(url, store=store, threads=1, format=read_as) as sub:
                    state = sub.pull(version)
                    return state, sub.version

            read_checked(tally, oracle, fmt, f"{label}: pull()", lambda: fresh(None), lambda v: step_of.get(v))
            read_checked(tally, oracle, fmt, f"{label}: pull({older})", lambda: fresh(older), lambda v: step_of.get(v))

            code, stderr, exc = cli(["verify", url, "--all", *cli_args(server)])
            judge_cli(tally, f"{label}: verify --all", code, stderr, exc, must_fail=what != "new run" and not (what == "HEAD" and how == "flip"))
            tally.trials += 1
            with contextlib.suppress(DeltastoreError):
                for m in store.list():
                    store.delete(m.key)
    tally.seconds = time.monotonic() - t0
    tally.extra["seconds_per_trial"] = round(tally.seconds / max(1, tally.trials), 3)
    return tally


def _packs(store: Any, links: list, which: str) -> list[str]:
    """Pack keys holding ``which`` ("delta"/"full") segments, on the chain."""
    out = set()
    for l in links:
        m = manifest_json(l.key, store.get(l.key))
        if "packs" in m:  # schema 3: every pack holds segments of one role
            out.update(p["key"] for p in m["packs"] if p["role"] == which[0])
            continue
        for t in m["tensors"]:
            for c in t["chunks"]:
                if c.get(which):
                    out.add(m["blobs"][c[which]["blob"]]["key"])
    return sorted(out)


def _stream_objects(store: Any, links: list, fmt: str) -> tuple[list[str], list[str]]:
    """The manifests and the pack keys of serving format ``fmt``'s stream, on the chain."""
    manifests, packs = [], set()
    for l in links:
        ref = next((r for r in manifest_json(l.key, store.get(l.key)).get("streams") or () if r["format"] == fmt), None)
        if ref is not None:
            manifests.append(ref["key"])
            prefix = ref["key"][: ref["key"].index("manifests/")]
            packs.update(prefix + p["key"] for p in manifest_json(ref["key"], store.get(ref["key"]))["packs"])
    return manifests, sorted(packs)


def build_parser():
    p = parser("corruption", 100, __doc__ or "")
    p.add_argument("--targets", help=f"comma-separated subset of: {', '.join([*TARGETS, *STREAM_TARGETS])} "
                                     "(default: all; the stream's with --formats)")
    return p


if __name__ == "__main__":
    raise SystemExit(main("corruption", run, build_parser()))
