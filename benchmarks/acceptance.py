"""Acceptance check on a real fine-tuning run: publish every checkpoint, read every one back.

    python -m benchmarks.acceptance --workload rl-3e-6 --url /tmp/acceptance-store
    python -m benchmarks.acceptance --url s3://bucket/prefix   # with AWS_ENDPOINT_URL etc.

For each bf16 checkpoint of the workload (MiniLM fine-tuned with AdamW, see workload.py):
publish it; then check that (1) a fresh Subscriber's ``pull(v)`` and (2) ``deltastore pull``
of every version are bit-identical to what was published, and (3) ``pull_into`` fast-forwards
every older version, in place, to the latest bit-exactly. Prints one line per check and exits
non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from benchmarks.workload import WORKLOADS, load_workload
from deltastore import Publisher, Subscriber
from deltastore.write.policy import AnchorPolicy
from deltastore.layout.tensors import bits

logger = logging.getLogger(__name__)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical: same names, dtypes, shapes and raw bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(bits(a[k].contiguous()), bits(b[k].contiguous()))
        for k in a
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="rl-3e-6", choices=sorted(WORKLOADS))
    parser.add_argument("--url", help="store URL (default: a fresh temporary directory)")
    parser.add_argument("--anchor-every", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    states = load_workload(args.workload)
    tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.mkdtemp(prefix="deltastore-acceptance-")
        url = str(Path(tmp) / "store")
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    failures = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {what}", flush=True)

    try:
        t0 = time.perf_counter()
        with Publisher(url, anchor_policy=AnchorPolicy(every=args.anchor_every)) as pub:
            for step, sd in enumerate(states):
                info = pub.publish(sd, step=step)
                print(f"published v{info.version} {info.kind:<6} {info.bytes_stored:>10} B "
                      f"({100 * info.bytes_stored / model_bytes:.2f}% of {model_bytes} B), "
                      f"{info.elements_changed} elements changed")
        print(f"published {len(states)} versions in {time.perf_counter() - t0:.1f} s")

        for v, sd in enumerate(states, start=1):
            with Subscriber(url) as sub:
                check(same(sub.pull(v), sd), f"Subscriber.pull({v}) bit-identical to step {v - 1}")
        with tempfile.TemporaryDirectory() as out_dir:
            for v, sd in enumerate(states, start=1):
                out = Path(out_dir) / f"v{v}.safetensors"
                rc = subprocess.run([sys.executable, "-m", "deltastore", "pull", url, str(out), "--version", str(v)],
                                    capture_output=True, text=True)
                check(rc.returncode == 0 and same(load_file(str(out)), sd),
                      f"deltastore pull --version {v} bit-identical{'' if rc.returncode == 0 else ': ' + rc.stderr.strip()}")
        for v in range(1, len(states)):
            with Subscriber(url) as sub:
                target = sub.pull(v)
                ptrs = {k: t.data_ptr() for k, t in target.items()}
                info = sub.pull_into(target)
                in_place = all(t.data_ptr() == ptrs[k] for k, t in target.items())
                check(info is not None and info.version == len(states) and in_place and same(target, states[-1]),
                      f"pull_into v{v} -> v{len(states)} in place, bit-identical")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print("ALL OK" if failures == 0 else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
