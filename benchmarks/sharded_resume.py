"""A restarted ShardedPublisher's first version: resumed from the store, or an anchor (design 010 D11).

``python -m benchmarks.sharded_resume [--worlds 2] [--repeat 2]`` publishes the cached rl workload
(tf265m-rl-1e-6, 531 MB bf16; rows split among the ranks as FSDP2 splits them) as versions 1-3
with one set of rank processes' publishers, closes them, and opens new ones on the same store (a
restart): their first version (step 4) is timed, then one steady delta (step 5). Two modes,
interleaved per repeat so that a shared machine's load falls on both alike:

- ``resume``: ``ShardedPublisher(resume=True)`` (the default): every rank reads back its own rows
  of version 3, verified, and version 4 is a delta;
- ``anchor``: ``resume=False``: version 4 is an anchor (what a restart cost before D11).

Reported per mode and world size (medians over repeats): the first version's kind, its stored
bytes, its wall time (barrier to return on the last rank), the busiest rank's CPU seconds, the
pack bytes and GETs each rank read back, and each rank's RSS growth over that publish (the new
reference copy is one shard); the steady delta after it, for scale. The resumed version is
pulled whole by an unsharded Subscriber and compared with the model, bit for bit. The store is
a local directory (``--tmp``; tmpfs if you can): uploads and reads cost no network here, so the
figures are the CPU side; what a resume saves on S3 is the stored bytes column.
Results: benchmarks/results/sharded-resume.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.sharded import RESULTS, RL_WORKLOAD
from benchmarks.sharded_rank import Source, free_port, rank_context, rl_path, rss_bytes

#: Versions published before the restart: an anchor and two deltas, so that the resume reads a
#: chain (the anchor's rows plus every delta after it), as a restarted job does.
VERSIONS_BEFORE = 3


def _rank(rank: int, world: int, port: int, url: str, mode: str, rl_workload: str, out: str) -> None:
    import torch.distributed as dist

    from deltastore.write.sharded import ShardedPublisher
    from deltastore.write.policy import AnchorPolicy, WriterPolicy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    src = Source({"workload": "rl", "rl_workload": rl_workload}, rank, world)
    shard = src.build()
    res: dict[str, Any] = {"rank": rank, "shard_bytes": sum(t.numel() * t.element_size() for t in shard.values())}

    def publish(pub: Any, v: int) -> dict[str, Any]:
        if v > 1:
            src.advance(shard, v)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        info = pub.publish(src.state(shard, True), step=v)
        t1, c1 = time.perf_counter(), time.process_time()
        dist.barrier()
        return {"version": info.version, "kind": info.kind, "stored": info.bytes_stored, "wall_s": t1 - t0,
                "cpu_s": c1 - c0, "done_at": t1}

    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:
        for v in range(1, VERSIONS_BEFORE + 1):
            publish(pub, v)
    rss0 = rss_bytes()
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1, resume=mode == "resume"),
                          anchor_policy=AnchorPolicy(every=100)) as pub:
        reads: list[int] = []
        real = pub.store.get

        def get(key: str, **kw: Any) -> bytes:
            data = real(key, **kw)
            if key.endswith(".pack"):
                reads.append(len(data))
            return data

        pub.store.get = get  # type: ignore[method-assign]
        res["first"] = publish(pub, VERSIONS_BEFORE + 1)
        res["first"].update(pack_bytes_read=sum(reads), pack_gets=len(reads), rss_growth=rss_bytes() - rss0)
        res["steady"] = publish(pub, VERSIONS_BEFORE + 2)
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(res))
    dist.destroy_process_group()


def run(world: int, mode: str, rl_workload: str, tmp: Path) -> dict[str, Any]:
    """One restart on a fresh store; the first version after it checked bit for bit."""
    import torch
    from safetensors.torch import load_file

    from deltastore import Subscriber

    store = Path(tempfile.mkdtemp(dir=tmp))
    url = f"file://{store}/store"
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, url, mode, rl_workload, str(store))) for r in range(world)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{mode}, {world} ranks: a rank failed ({[p.exitcode for p in procs]})")
    ranks = [pickle.loads((store / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    with Subscriber(url) as sub:
        got = sub.pull(VERSIONS_BEFORE + 1)
    want = load_file(str(rl_path(rl_workload, VERSIONS_BEFORE)))  # step k's file is version k + 1's model
    if set(got) != set(want) or not all(
            torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for k, t in want.items()):
        raise AssertionError(f"{mode}, {world} ranks: version {VERSIONS_BEFORE + 1} is not the model published")
    first = [r["first"] for r in ranks]
    return {
        "mode": mode, "world": world, "kind": first[0]["kind"], "stored": first[0]["stored"],
        "wall_s": max(f["wall_s"] for f in first), "cpu_s_busiest_rank": max(f["cpu_s"] for f in first),
        "pack_bytes_read": [f["pack_bytes_read"] for f in first], "pack_gets": [f["pack_gets"] for f in first],
        "rss_growth": [f["rss_growth"] for f in first], "shard_bytes": [r["shard_bytes"] for r in ranks],
        "steady_wall_s": max(r["steady"]["wall_s"] for r in ranks), "steady_stored": ranks[0]["steady"]["stored"],
        "run_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a restarted ShardedPublisher's first version: resumed or an anchor")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--repeat", type=int, default=2, help="runs of each mode, interleaved")
    ap.add_argument("--rl-workload", default=RL_WORKLOAD)
    ap.add_argument("--tmp", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None,
                    help="where the stores go (default: /dev/shm when there is one)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for world in args.worlds:
            for mode in ("resume", "anchor"):
                runs.setdefault((mode, world), []).append(run(world, mode, args.rl_workload, args.tmp))
    mb = 1e6
    lines = [("| ranks | first version after a restart | stored | wall | busiest rank CPU | pack bytes read per rank "
              "| RSS growth per rank (first run) | steady delta after it |"),
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    for (mode, world), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("stored", "wall_s", "cpu_s_busiest_rank", "steady_wall_s")}
        row = {"mode": mode, "world": world, "kind": rs[0]["kind"], **med, "runs": rs}
        rows.append(row)
        reads = " / ".join(f"{b / mb:.0f} MB ({g} GETs)" for b, g in zip(rs[0]["pack_bytes_read"], rs[0]["pack_gets"]))
        rss = " / ".join(f"{b / mb:.0f} MB" for b in rs[0]["rss_growth"])
        lines.append(f"| {world} | {mode}: {rs[0]['kind']} | {med['stored'] / mb:.1f} MB | {med['wall_s']:.2f} s "
                     f"| {med['cpu_s_busiest_rank']:.2f} s | {reads} | {rss} | {med['steady_wall_s']:.2f} s |")
    lines.append(f"\nmedians of {args.repeat} interleaved runs; shard of rank 0: "
                 f"{rows[0]['runs'][0]['shard_bytes'][0] / mb:.0f} MB; load average {load0:.1f} at the start, "
                 f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs; bit-exact: yes")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded-resume.json").write_text(json.dumps({"load_average": load0, "rows": rows}, indent=2) + "\n")
    (args.out / "sharded-resume.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
