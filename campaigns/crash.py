"""Crash campaign: kill -9 a publisher process at random moments, restart, check the store.

Each trial starts a publisher process (forked from a warm fork server) that opens the store
with takeover, resumes from HEAD and publishes successive steps until it is killed with SIGKILL
after a random delay (most kills land mid-publish; some during start-up). After each kill the
oracle reads the store directly: I1–I3 hold, every version the killed process saw succeed is on
the chain, no step is committed twice, and every new version reads back bit-exact. A worker
process follows the store with ``pull_into`` throughout and must never hold wrong bits.

Trials = kills.  ``python -m campaigns.crash --backend seaweedfs --trials 200``
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from campaigns.common import (
    ChainChecker,
    Followers,
    Tally,
    campaign_options,
    committed_as_asked,
    fresh_url,
    grid_tensors,
    main,
    mp_context,
    parser,
    scratch_dir,
    verify_versions,
)

#: A kill lands this long (uniformly random) after the publisher said it is ready: a few
#: small publishes' worth, so most kills interrupt one.
MAX_KILL_DELAY_S = 0.25
#: The same with ``--formats``: a restarted publisher reads each serving stream's head back before
#: its first publish, which then takes a few times longer, so kills wait longer to fall in
#: publishes rather than before every first commit.
MAX_KILL_DELAY_FORMATS_S = 0.6
#: Share of kills aimed at start-up (open, claim, resume) instead of the publish loop.
STARTUP_KILL_P = 0.15
#: A publisher that has not opened the store by then is killed anyway (and reported).
READY_TIMEOUT_S = 30.0
#: Snapshots every few versions, so kills also hit anchors.
ANCHOR_EVERY = 5


def _log(fd: int, text: str) -> None:
    os.write(fd, f"{time.monotonic():.4f} {text}\n".encode())


def publisher_process(url: str, options: dict[str, Any], seed: int, log_path: str, grid: bool = False,
                      formats: str | None = None) -> None:
    """Publish successive steps forever (until killed), logging each to ``log_path``; with
    ``formats`` (``--formats``), in those serving formats too."""
    import logging

    from campaigns.model import CHUNK_BYTES, Model, serving_formats, with_layout
    from deltastore import DeltastoreError, Publisher, Subscriber
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy

    logging.getLogger("deltastore").setLevel(logging.CRITICAL)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    model = Model(seed)
    while True:
        _log(fd, "open")
        pub = with_layout(Publisher(url, storage_options=options, writer_policy=WriterPolicy(threads=1, takeover=True),
                                    anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                                    layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES),
                                    formats=serving_formats(formats)), grid)  # fmt: skip
        with Subscriber(url, store=pub.store, threads=1) as sub:
            step = (sub.info(pub.version).step + 1) if pub.version else 0
        _log(fd, f"ready {pub.version} {pub.writer_id}")
        while True:
            _log(fd, f"begin {step}")
            try:
                info = pub.publish(model.state(step), step=step)
            except DeltastoreError as e:
                _log(fd, f"err {step} {type(e).__name__}")
                pub.close()
                break  # reopen: a restarted trainer continues from HEAD
            _log(fd, f"ok {step} {info.version} {info.step}")
            step += 1


def run(server: Any, args: Any) -> Tally:
    from campaigns.model import Oracle, serving_formats
    from deltastore.storage import open_store

    tally = Tally("crash", server.kind)
    formats = serving_formats(args.formats)
    rng = random.Random(args.seed)
    oracle = Oracle(args.seed)
    url = fresh_url(server, "crash")
    options = campaign_options(server)
    ctx = mp_context()
    t0 = time.monotonic()
    phases: dict[str, int] = {}
    acked: dict[int, int] = {}  # step -> version, as the killed processes saw them succeed
    with scratch_dir() as work, open_store(url, storage_options=options) as store:
        checker = ChainChecker(store, tally)
        followers = None
        checked = 0
        for trial in range(args.trials):
            log_path = str(work / f"pub-{trial}.log")
            p = ctx.Process(target=publisher_process, args=(url, options, args.seed, log_path, args.grid, args.formats),
                            daemon=True)
            p.start()
            if rng.random() < STARTUP_KILL_P and trial > 0:
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                # The first trial lets one version commit, so that every later kill meets a store
                # with history (claim, resume and deltas on the way).
                mark = " ok " if trial == 0 else " ready "
                deadline = time.monotonic() + READY_TIMEOUT_S
                while time.monotonic() < deadline and mark not in _read(log_path):
                    if not p.is_alive():
                        break
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, MAX_KILL_DELAY_FORMATS_S if formats else MAX_KILL_DELAY_S))
            p.kill()
            p.join()
            lines = [l.split()[1:] for l in _read(log_path).splitlines() if l.strip()]
            last = lines[-1][0] if lines else "nothing"
            phase = {"begin": "mid-publish", "open": "start-up", "ready": "start-up", "ok": "between publishes",
                     "err": "after an error", "nothing": "before start"}[last]  # fmt: skip
            phases[phase] = phases.get(phase, 0) + 1
            for l in lines:
                if l[0] == "ok" and committed_as_asked(oracle, tally, int(l[1]), int(l[2]), int(l[3])):
                    acked[int(l[1])] = int(l[2])
                elif l[0] == "err":
                    tally.error(l[2])
                    tally.note(f"publisher {l[2]}", f"trial {trial}: publish of step {l[1]} raised {l[2]} (no faults injected)")
            links = checker.check()
            # Start the worker once there is something to follow.
            if followers is None and links:
                followers = Followers(ctx, url, options, args.seed, 1, work, fmt=(formats or (None,))[0])
            tally.trials += 1
            new = [l for l in links if l.version > checked]
            verify_versions(store, new, oracle, tally, formats=formats)
            checked = max(checked, links[-1].version if links else 0)
        if followers is not None:
            time.sleep(0.3)
            followers.stop(tally)
        final = checker.check(full=True)
        tally.extra["grid_tensors"] = grid_tensors(store, final[-1]) if final else {}
    on_chain = {l.step: l.version for l in final}
    for step, version in acked.items():
        if on_chain.get(step) != version:
            tally.lost(f"publish of step {step} returned version {version}, chain has {on_chain.get(step)}")
    steps = [l.step for l in final]
    if len(steps) != len(set(steps)):
        tally.wrong("step committed twice", f"steps on chain: {len(steps)}, distinct {len(set(steps))}")
    tally.seconds = time.monotonic() - t0
    tally.faults["kill -9"] = args.trials
    tally.extra.update(kills_by_phase=phases, versions_committed=len(final), acked_publishes=len(acked),
                       seconds_per_trial=round(tally.seconds / max(1, tally.trials), 3))  # fmt: skip
    return tally


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def build_parser():
    return parser("crash", 200, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main("crash", run, build_parser()))
