"""Host memory of the engine processes of one node, each with its own host copy and with one
shared copy (docs/integrations.md, "Host memory per rank").

    python -m benchmarks.shared_copy [--workload tf125m-rl-1e-6] [--steps 4] [--processes 4]
        [--out benchmarks/results/shared-copy]

The trainer publishes the workload's first state (real fine-tuning states) to a tmpfs store;
``--processes`` engine processes start a :class:`~deltastore.integrations.hostcopy.HostCopy`
each (``shared=None``, then ``shared=`` one directory on the tmpfs) and sync it into a stand-in
engine that keeps nothing; the trainer then publishes the other states, one at a time, each
served by every process before the next. With every process alive at the last version, each
reports its proportional set size (``Pss`` of ``/proc/self/smaps_rollup``: a page shared by n
processes counts 1/n in each, so the sum is what the node holds) and what it fetched. Reported:
the processes' summed PSS, the same for processes that only started a Python with deltastore and
torch imported (the floor every engine process pays anyway), and the difference as a multiple of
the model's bytes. Then the shared copy's leader is killed (SIGKILL): the seconds until another
process leads holding the last version, and the bytes it fetched to get there; then every process
is killed and one started again on the copy they left: the seconds from its start until it
serves the last version, and the bytes it fetched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
DEADLINE_S = 600.0


def pss_bytes() -> int:
    """This process's proportional set size."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def child(url: str, shared: str, last: int) -> int:
    """One engine process: follow ``url`` (``shared`` "-": a copy of its own) and sync until it
    serves ``last`` (0: follow nothing), then report and wait for stdin to close."""
    from deltastore.integrations.hostcopy import HostCopy

    class Engine:
        def apply(self, tensors: Any, version: Any) -> None:
            pass

    host = None
    if last:
        host = HostCopy(url, interval=0.05, shared=None if shared == "-" else shared)
        host.start()
        engine = Engine()
        served = None
        deadline = time.monotonic() + DEADLINE_S
        while served is None or served.version < last:
            assert time.monotonic() < deadline, "the store's last version was not served in time"
            host.check()
            served = host.sync(engine)
            if served is None or served.version < last:
                print(json.dumps({"served": None if served is None else served.version}), flush=True)
                time.sleep(0.05)
    print(json.dumps({"done": last, "pss": pss_bytes(),
                      "fetched": 0 if host is None else host.sub.bytes_fetched}), flush=True)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    if host is not None and host.shared is not None and not host.shared.leads:
        # a reader: say when it leads, holding the last version (the leader was killed)
        before = host.sub.bytes_fetched
        while not closed.wait(0.005):
            if host.shared.leads and host.sub.version == last and not (host.shared.state() or {}).get("writing"):
                print(json.dumps({"leads": time.monotonic(), "fetched": host.sub.bytes_fetched - before}), flush=True)
                break
    closed.wait()
    if host is not None:
        host.close()
    return 0


def run(url: str, shared: str, processes: int, publish: Any,
        versions: int) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    """Start the processes, publish the versions one by one as they serve them, and return each
    process's report; with a shared copy, then kill its leader, then every process, start one
    again, and return the takeover's and the restart's figures too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.shared_copy", "--child", url, shared, str(versions)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    try:
        served = [0] * processes
        reports: list[dict[str, Any] | None] = [None] * processes

        def read(i: int) -> None:
            """One line of process ``i``: the version it serves, or its report."""
            line = procs[i].stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("an engine process ended early")
            d = json.loads(line)
            if "done" in d:
                reports[i], served[i] = d, d["done"]
            elif d["served"] is not None:
                served[i] = d["served"]

        for v in range(1, versions + 1):
            publish(v)
            for i in range(processes):
                while served[i] < v and reports[i] is None:
                    read(i)
        for i in range(processes):
            while reports[i] is None:
                read(i)
        out = [r for r in reports if r is not None]
        leaders = [i for i, r in enumerate(out) if r["fetched"]]
        if shared != "-" and len(leaders) == 1 and processes > 1:
            took = takeover(procs, leaders[0])
            for p in procs:  # then every process is killed, and one started again
                p.kill()
                p.wait(60)
            return out, {**took, **restart(url, shared, versions, env)}
        return out, None
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            p.wait(60)


def takeover(procs: list[subprocess.Popen[str]], leader: int) -> dict[str, float]:
    """Kill the leader (SIGKILL) and wait for another process to lead at the same version:
    the seconds from the kill, and the bytes the new leader fetched to get there."""
    lines: queue.Queue[str] = queue.Queue()
    for i, p in enumerate(procs):
        if i != leader:
            threading.Thread(target=lambda p=p: lines.put(p.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    t0 = time.monotonic()
    procs[leader].kill()
    while True:
        line = lines.get(timeout=DEADLINE_S)
        if line:
            d = json.loads(line)
            return {"takeover_s": d["leads"] - t0, "takeover_fetched_bytes": d["fetched"]}


def restart(url: str, shared: str, versions: int, env: dict[str, str]) -> dict[str, float]:
    """One engine process started on the copy killed processes left: the seconds until it
    serves the last version (its start, imports included), and the bytes it fetched."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.shared_copy", "--child", url, shared, str(versions)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        while True:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("the restarted engine process ended early")
            d = json.loads(line)
            if "done" in d:
                return {"restart_s": time.monotonic() - t0, "restart_fetched_bytes": d["fetched"]}
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shared_copy")
    p.add_argument("--workload", default="tf125m-rl-1e-6")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "shared-copy"))
    p.add_argument("--child", nargs=3, metavar=("URL", "SHARED", "LAST"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child[0], a.child[1], int(a.child[2]))

    from benchmarks.workload import load_workload
    from deltastore import Publisher

    states = load_workload(a.workload, a.steps)
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    tmp = "/dev/shm" if Path("/dev/shm").is_dir() else None
    rows: dict[str, Any] = {}
    for mode in ("floor", "own", "shared"):
        with tempfile.TemporaryDirectory(dir=tmp) as d:
            url = str(Path(d) / "store")
            with Publisher(url) as pub:
                shared = str(Path(d) / "copy") if mode == "shared" else "-"
                reports, took = run(url, shared, a.processes, lambda v: pub.publish(states[v - 1]),
                                    0 if mode == "floor" else len(states))
            rows[mode] = {"pss_bytes": [r["pss"] for r in reports], "fetched_bytes": [r["fetched"] for r in reports],
                          **(took or {})}
    floor = sum(rows["floor"]["pss_bytes"])
    for mode in ("own", "shared"):
        rows[mode]["above_floor_x_model"] = (sum(rows[mode]["pss_bytes"]) - floor) / model_bytes
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"workload": a.workload, "versions": len(states), "processes": a.processes, "model_bytes": model_bytes,
           "machine": platform.machine(), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["| host copies | summed PSS (MB) | above the floor, × the model | fetched per process (MB) |",
             "|---|---:|---:|---|"]
    for mode, label in (("floor", "none (Python, torch, deltastore imported)"), ("own", "one per process"),
                        ("shared", "one per node (`shared=`)")):
        r = rows[mode]
        above = f"{r['above_floor_x_model']:.2f}×" if "above_floor_x_model" in r else "–"
        fetched = ", ".join(f"{b / 1e6:.0f}" for b in r["fetched_bytes"])
        lines.append(f"| {label} | {sum(r['pss_bytes']) / 1e6:.0f} | {above} | {fetched} |")
    table = "\n".join(lines)
    took = rows["shared"]
    if "takeover_s" in took:
        table += (f"\n\nThe shared copy's leader killed (SIGKILL) at the last version: another process led, "
                  f"holding that version, {took['takeover_s']:.2f} s later, having fetched "
                  f"{took['takeover_fetched_bytes'] / 1e6:.0f} MB. Then every process killed, and one started "
                  f"again: it served the last version {took['restart_s']:.2f} s after its start, having fetched "
                  f"{took['restart_fetched_bytes'] / 1e6:.0f} MB.")
    out.with_suffix(".md").write_text(f"{a.workload}, {len(states)} versions, {a.processes} processes, "
                                      f"model {model_bytes / 1e6:.0f} MB\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
