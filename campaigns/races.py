"""Races campaign: 3–4 publisher processes on one store, with takeover off and on, plus workers.

Each publisher process is a trainer of its own (its states differ, see campaigns.model) that
publishes as fast as it can. Checked, reading the store directly:

- no forks: HEAD's chain is linear and consecutive (I1–I3), and every publish that returned a
  version is on it, with that publisher's step;
- no step committed twice; a publish that raised committed nothing (a wrong error otherwise);
- losers get ConflictError or FencedError, never another error;
- every committed version reads back as exactly the bits its trainer published at that step;
- with takeover on, fencing holds: the epochs along the chain never go down, and no two
  writers commit under one epoch (a publisher whose claim did not happen keeps epoch 0);
- workers following the store never hold wrong bits.

Takeover off: all publishers run for the whole round, losing races with ConflictError. Takeover
on: rounds of publishers started together, each claiming the store (the first round on an empty
store); a fenced publisher stops, as a superseded trainer would.

With ``--rate`` the publishers reach the server through the fault-injecting proxy (e.g. lost
HEAD responses while another publisher claims the store: ``--rate 0.2 --methods PUT
--key-pattern 'HEAD$'``). With ``--formats`` and ``--format-churn`` every other publisher leaves
the workers' format (the first) out, so it is dropped and published again as the racers'
commits interleave.

Trials = publish attempts.  ``python -m campaigns.races --backend seaweedfs --trials 120``
"""

from __future__ import annotations

import os
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
from campaigns.model import STEP_BASE
from testkit.proxy import FaultPlan, FaultProxy

#: Publish attempts per process per takeover round: long enough for several to collide.
ATTEMPTS_PER_ROUND = 6
#: Bound on rounds per mode, whatever the attempts made.
MAX_ROUNDS = 50
#: A round that has not finished by then is killed and reported.
ROUND_TIMEOUT_S = 120.0


def racer(url: str, options: dict[str, Any], seed: int, trainer: int, takeover: bool, attempts: int,
          start_k: int, writer_id: str, log_path: str, go_path: str, grid: bool = False,
          formats: str | None = None) -> None:  # fmt: skip
    """Publish ``attempts`` times (steps ``start_k``…) as trainer ``trainer``; log each outcome."""
    import logging

    from campaigns.model import CHUNK_BYTES, Model, serving_formats, with_layout
    from deltastore import DeltastoreError, FencedError, Publisher
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy

    logging.getLogger("deltastore").setLevel(logging.CRITICAL)
    logging.getLogger("urllib3").setLevel(logging.CRITICAL)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(text: str) -> None:
        os.write(fd, f"{text}\n".encode())

    model = Model(seed, trainer)
    while not os.path.exists(go_path):  # start together: the point is to collide
        time.sleep(0.002)
    try:
        pub = with_layout(Publisher(url, storage_options=options,
                                    writer_policy=WriterPolicy(threads=1, takeover=takeover, writer_id=writer_id),
                                    anchor_policy=AnchorPolicy(every=4),
                                    layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES),
                                    formats=serving_formats(formats)), grid)  # fmt: skip
    except DeltastoreError as e:
        log(f"openerr {type(e).__name__}")
        return
    except Exception as e:  # noqa: BLE001
        log(f"untyped open {type(e).__name__}")
        return
    log(f"epoch {pub.epoch}")
    with pub:
        for i in range(attempts):
            k = start_k + i
            step = model.step_id(k)
            try:
                info = pub.publish(model.state(k), step=step)
            except FencedError:
                log(f"err {step} FencedError")
                return
            except DeltastoreError as e:
                log(f"err {step} {type(e).__name__}")
                continue
            except Exception as e:  # noqa: BLE001
                log(f"untyped {step} {type(e).__name__}")
                continue
            log(f"ok {step} {info.version} {info.step}")


def _round(ctx: Any, url: str, options: dict[str, Any], seed: int, n: int, takeover: bool, attempts: int,
           round_no: int, work: Path, tally: Tally, grid: bool = False,
           formats: str | None = None, churn: bool = False) -> list[tuple[str, list[list[str]]]]:  # fmt: skip
    go = work / f"go-{takeover}-{round_no}"
    procs = []
    for i in range(n):
        declared = ",".join(formats.split(",")[1:]) if churn and formats and i % 2 else formats
        trainer = round_no * n + i + 1
        writer = f"racer-{'t' if takeover else 'n'}{round_no}-{i}"
        log_path = work / f"{writer}.log"
        p = ctx.Process(target=racer, args=(url, options, seed, trainer, takeover, attempts, 0, writer, str(log_path), str(go),
                                            grid, declared), daemon=True)
        p.start()
        procs.append((p, writer, log_path))
    time.sleep(0.2)  # let every process reach the start line
    go.touch()
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    out = []
    for p, writer, log_path in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            tally.wrong("publisher hung", f"{writer} did not finish its round in {ROUND_TIMEOUT_S:.0f} s")
        lines = [l.split() for l in (log_path.read_text() if log_path.exists() else "").splitlines() if l.strip()]
        out.append((writer, lines))
    return out


def run(server: Any, args: Any) -> Tally:
    from campaigns.model import Oracle, serving_formats
    from deltastore.storage import open_store

    tally = Tally("races", server.kind)
    formats = serving_formats(args.formats)
    oracle = Oracle(args.seed)
    ctx = mp_context()
    n = args.publishers
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.takeover]
    t0 = time.monotonic()
    per_mode = max(n, args.trials // len(modes))
    versions_total = 0
    plan = FaultPlan(rate=args.rate, methods=frozenset(args.methods.split(",")) if args.methods else None,
                     key_pattern=args.key_pattern, seed=args.seed)  # fmt: skip
    with scratch_dir() as work, FaultProxy(server.endpoint_url, plan) as proxy:
        for takeover in modes:
            url = fresh_url(server, f"races-{'takeover' if takeover else 'plain'}")
            # The publishers go through the proxy (faults only with --rate); the oracle does not.
            options = campaign_options(server, proxy.endpoint_url)
            with open_store(url, storage_options=campaign_options(server)) as store:
                checker = ChainChecker(store, tally)
                followers = Followers(ctx, url, options, args.seed, args.workers, work, fmt=(formats or (None,))[0])
                results: list[tuple[str, list[list[str]]]] = []
                attempts = ATTEMPTS_PER_ROUND if takeover else max(1, per_mode // n)
                done, r = 0, 0
                # Rounds until the mode's share of attempts is made (fenced publishers stop early).
                while done < per_mode and r < MAX_ROUNDS:
                    out = _round(ctx, url, options, args.seed, n, takeover, attempts, r, work, tally, args.grid,
                                 args.formats, churn=args.format_churn)
                    done += sum(1 for _, lines in out for l in lines if l[0] in ("ok", "err", "untyped"))
                    results += out
                    checker.check()
                    r += 1
                time.sleep(0.3)
                followers.stop(tally)
                final = checker.check(full=True)
                tally.extra["grid_tensors"] = grid_tensors(store, final[-1]) if final else {}
                verify_versions(store, final, oracle, tally, formats=formats)
                _judge(final, results, takeover, tally, oracle)
                versions_total += len(final)
        tally.faults.update(proxy.snapshot())
    tally.seconds = time.monotonic() - t0
    tally.extra.update(publishers=n, versions_committed=versions_total,
                       seconds_per_trial=round(tally.seconds / max(1, tally.trials), 3))  # fmt: skip
    return tally


def _judge(final: list, results: list[tuple[str, list[list[str]]]], takeover: bool, tally: Tally, oracle: Any) -> None:
    mode = "takeover" if takeover else "no takeover"
    by_step = {}
    for l in final:
        if l.step in by_step:
            tally.wrong("step committed twice", f"{mode}: step {l.step} is versions {by_step[l.step].version} and {l.version}")
        by_step[l.step] = l
    for writer, lines in results:
        for l in lines:
            if l[0] == "ok":
                tally.trials += 1
                step, version = int(l[1]), int(l[2])
                if not committed_as_asked(oracle, tally, step, version, int(l[3])):
                    continue
                link = by_step.get(step)
                if link is None or link.version != version or link.writer != writer:
                    tally.lost(f"{mode}: {writer}'s publish of step {step} returned version {version}; chain has {link}")
            elif l[0] == "err":
                tally.trials += 1
                step, name = int(l[1]), l[2]
                tally.error(name)
                link = by_step.get(step)
                if link is not None and link.writer == writer:
                    tally.wrong(f"committed but raised {name}", f"{mode}: {writer} step {step} is version {link.version}")
                if name not in ("ConflictError", "FencedError"):
                    tally.wrong(f"loser got {name}", f"{mode}: {writer} step {step}")
            elif l[0] in ("untyped",):
                tally.trials += 1
                tally.wrong(f"untyped {l[-1]}", f"{mode}: {writer}: {' '.join(l)}")
            elif l[0] == "openerr":
                tally.error(f"open {l[1]}")
                tally.note(f"open {l[1]}", f"{mode}: {writer} could not open its Publisher: {l[1]}")
    if takeover:
        epochs = [(l.epoch, l.writer, l.version) for l in final]
        writers_of: dict[int, set[str]] = {}
        for e, w, _ in epochs:
            writers_of.setdefault(e, set()).add(w)
        for e, ws in sorted(writers_of.items()):
            if len(ws) > 1:
                tally.violation("fencing: one epoch, several writers", f"epoch {e} committed by {sorted(ws)}")
        for (e1, w1, v1), (e2, w2, v2) in zip(epochs, epochs[1:]):
            if e2 < e1:
                tally.violation("fencing: commit after being fenced", f"v{v2} by {w2} at epoch {e2} after v{v1} at epoch {e1}")
    trainers = {l.step // STEP_BASE for l in final}
    tally.extra[f"trainers_on_chain ({mode})"] = len(trainers)


def build_parser():
    p = parser("races", 120, __doc__ or "")
    p.add_argument("--publishers", type=int, default=3, help="publisher processes (default 3)")
    p.add_argument("--takeover", choices=["on", "off", "both"], default="both")
    p.add_argument("--workers", type=int, default=1, help="worker processes following the store")
    p.add_argument("--rate", type=float, default=0.0, help="fault probability per request (default 0: pure races)")
    p.add_argument("--methods", help="fault only these HTTP methods, e.g. PUT")
    p.add_argument("--key-pattern", help="fault only paths matching this regex, e.g. /HEAD$")
    p.add_argument("--format-churn", action="store_true",
                   help="with --formats: every other publisher leaves the workers' format (the first) out")
    return p


if __name__ == "__main__":
    raise SystemExit(main("races", run, build_parser()))
