"""The crash, fault and race campaigns (campaigns/) on the native GCS and Azure Blob backends.

The campaigns are written against a server object (``kind``, ``bucket``, ``endpoint_url``,
``with_endpoint``, ``storage_options``, ``url``); testkit.cloud_servers' fake-gcs-server and
Azurite provide the same, so each campaign's own ``run`` is called here with one of them and
stores named ``gs://`` / ``az://``. The fault proxy (testkit.proxy) forwards HTTP as it is, so
the faults are the same as on S3: 5xx and resets not forwarded, answers truncated or dropped
after the server applied the request (lost responses), slow answers.

    python -m benchmarks.cloud_campaigns --backend gcs --trials crash=200,faults=200,races=120 [--json OUT]
    python -m benchmarks.cloud_campaigns --backend azure --trials crash=200,faults=200,races=120

Exits 1 when a campaign found a lost version, a corrupt apply, a wrong error or an invariant
violation.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Any

#: Campaigns run here and their full sizes (docs/reliability.md's for S3).
FULL_TRIALS = {"crash": 200, "faults": 200, "races": 120}
#: The --backend name of each server's URL scheme.
BACKEND_OF_SCHEME = {"gs": "gcs", "az": "azure"}


def run_campaign(name: str, server: Any, trials: int, seed: int = 0, extra: list[str] | None = None) -> Any:
    """Run campaign ``name`` on a started cloud server; returns its Tally."""
    module = importlib.import_module(f"campaigns.{name}")
    # The campaigns name their stores s3://BUCKET/...; the server object names its own scheme
    # (S3Server.url gives the same s3:// URL, so nothing changes for S3 meanwhile).
    original = module.fresh_url
    module.fresh_url = lambda srv, what: srv.url(f"{what}-{uuid.uuid4().hex[:10]}")
    argv = ["--trials", str(trials), "--seed", str(seed), *(extra or [])]
    try:
        tally = module.run(server, module.build_parser().parse_args(argv))
    finally:
        module.fresh_url = original
    backend = BACKEND_OF_SCHEME[server.scheme]
    tally.command = f"python -m benchmarks.cloud_campaigns --backend {backend} --trials {name}={trials} --seed {seed}"
    if extra:
        tally.command += " (campaign options: " + " ".join(extra) + ")"
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cloud_campaigns", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gcs", "azure"], required=True)
    p.add_argument("--trials", default="", help="NAME=N,... (defaults: " + ",".join(f"{k}={v}" for k, v in FULL_TRIALS.items()) + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write every tally as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for name in ("deltastore", "urllib3", "azure", "google"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    trials = dict(FULL_TRIALS)
    for item in filter(None, args.trials.split(",")):
        key, _, value = item.partition("=")
        trials[key] = int(value)

    from campaigns.report import markdown
    from testkit.cloud_servers import azurite, fake_gcs

    tallies = []
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cloud-campaigns-")))
        server = stack.enter_context(fake_gcs(base) if args.backend == "gcs" else azurite(base))
        for name, n in trials.items():
            if n <= 0:
                continue
            tally = run_campaign(name, server, n, args.seed)
            print(tally.summary(), flush=True)
            tallies.append(tally)
    print(markdown(tallies))
    if args.json:
        Path(args.json).write_text(json.dumps([t.to_json() for t in tallies], indent=1, sort_keys=True))
    return 0 if all(t.clean for t in tallies) else 1


if __name__ == "__main__":
    raise SystemExit(main())
