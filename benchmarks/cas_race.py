"""Contested commits on the native GCS and Azure Blob backends: do racing publishers ever both win?

Each round, ``--publishers`` Publishers (own store clients) publish an edit of the same version
at once, held at their HEAD write until all are there: one contested compare-and-swap per round
(``ifGenerationMatch`` on GCS, ``If-Match`` on Azure). Exactly one must commit, the others must
lose with a plain ConflictError. Then a worker walks the log and ``pull_into`` s every version,
which must be bit-exact with what its winner published (testkit.commit_race).

Servers: fake-gcs-server (``--backend gcs``) and Azurite (``--backend azure``), started here
(testkit.cloud_servers). Neither throttles; real GCS sustains about one update per second to one
object, so the same race there is paced by 429s and the commit deadline, not by the publishers.

    python -m benchmarks.cas_race --backend gcs --commits 1000 [--publishers 4] [--json OUT]
    python -m benchmarks.cas_race --backend azure --commits 1000

Exits 1 when anything but "one winner per round, all versions bit-exact" was seen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cas_race", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gcs", "azure"], required=True)
    p.add_argument("--commits", type=int, default=1000, help="contested commits (rounds)")
    p.add_argument("--publishers", type=int, default=4, help="publishers racing in each round")
    p.add_argument("--json", metavar="OUT", help="write the outcome as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("deltastore").setLevel(logging.ERROR)

    from testkit.cloud_servers import azurite, fake_gcs
    from testkit.commit_race import race_publishers
    from testkit.targets import StoreTarget, unique_prefix

    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cas-race-")))
        server = stack.enter_context(fake_gcs(base) if args.backend == "gcs" else azurite(base))
        options = server.storage_options(retries=5)  # the library's default, as users run it
        target = StoreTarget(args.backend, server.url(unique_prefix()), options)
        began = time.monotonic()
        def progress(done: int) -> None:
            if done % 100 == 0:
                print(f"{done} commits, {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)

        outcome = race_publishers(target, rounds=args.commits, publishers=args.publishers, progress=progress)
        total = time.monotonic() - began
    report = {
        "backend": args.backend,
        "server": server.kind,
        "command": "python -m benchmarks.cas_race " + " ".join(sys.argv[1:] if argv is None else argv),
        "contested_commits": outcome.rounds,
        "publishers": outcome.publishers,
        "double_wins": outcome.double_wins,
        "rounds_without_a_winner": outcome.no_wins,
        "lost_with_conflict_error": outcome.conflicts,
        "wrong_errors": dict(outcome.wrong_errors),
        "versions": outcome.versions,
        "bit_exact_versions": outcome.bit_exact,
        "mismatched_versions": outcome.mismatches[:20],
        "log_linear": outcome.log_ok,
        "race_seconds": round(outcome.seconds, 1),
        "total_seconds": round(total, 1),
        "clean": outcome.clean,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if outcome.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
