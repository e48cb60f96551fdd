"""Sharded publishing (issue 12 part 1): publish throughput with 1, 2 and 4 ranks, per-rank memory.

``python -m benchmarks.sharded [--tensors 8 --rows 4096 --cols 1024 --steps 4 --density 0.01]``
publishes the same bf16 model (``tensors`` × [rows, cols], rows split among the ranks as FSDP2
splits them) to a local file store, in one run per configuration:

- ``Publisher``: one process, the unsharded writer (the reference);
- ``ShardedPublisher`` with 1, 2 and 4 ranks (gloo over 127.0.0.1), one encode thread per rank,
  so that N ranks use N cores as an FSDP job's N processes would.

Each rank builds only its own rows (seeded per block of rows, so every configuration publishes
the same bits) and changes ``density`` of its elements per step. Reported per configuration:
the anchor's time, the median time of a delta publish (from a barrier to the committed HEAD),
throughput (model bytes / median delta time) and its ratio to one rank, and per rank the peak
RSS above the process's RSS before it built its rows, next to its shard's bytes (the
reference copy is one more shard). Goal (issue 12): 2 ranks ≥ 1.7× one rank.

Every configuration's last version is pulled by an unsharded Subscriber and compared with the
model rebuilt here, bit for bit. Results: benchmarks/results/sharded.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: Issue 12's goal: publish throughput with 2 ranks over 1 rank.
GOAL_2_OVER_1 = 1.7
#: Rows generated (and changed) per seed: every rank's rows are whole blocks for 1, 2 and 4
#: ranks when rows is a multiple of 4 × this.
BLOCK_ROWS = 256


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: across fork+exec that keeps the
    parent's peak, so a spawned rank would report the benchmark driver's memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _block(ti: int, block: int, step: int, cols: int, density: float) -> Any:
    """Rows [block·BLOCK_ROWS, …) of tensor ``ti`` at ``step`` (the same in every configuration)."""
    import torch

    g = torch.Generator().manual_seed(ti * 1_000_003 + block)
    t = (torch.randn(BLOCK_ROWS, cols, generator=g) * 0.02).to(torch.bfloat16)
    flat = t.view(-1)
    for s in range(1, step + 1):
        g2 = torch.Generator().manual_seed((ti * 1_000_003 + block) * 7919 + s)
        idx = torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=g2)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-4).to(torch.bfloat16)
    return t


def _rows(ti: int, start: int, stop: int, step: int, cols: int, density: float) -> Any:
    import torch

    out = torch.empty(stop - start, cols, dtype=torch.bfloat16)  # filled block by block: no transient second copy
    for k, b in enumerate(range(start // BLOCK_ROWS, stop // BLOCK_ROWS)):
        out[k * BLOCK_ROWS:(k + 1) * BLOCK_ROWS] = _block(ti, b, step, cols, density)
    return out


def _advance(t: Any, ti: int, start: int, step: int, density: float) -> None:
    """Change ``t`` (rows from ``start``) from step−1 to ``step`` in place."""
    import torch

    for k in range(t.shape[0] // BLOCK_ROWS):
        b = start // BLOCK_ROWS + k
        flat = t[k * BLOCK_ROWS:(k + 1) * BLOCK_ROWS].view(-1)
        g2 = torch.Generator().manual_seed((ti * 1_000_003 + b) * 7919 + step)
        idx = torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=g2)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-4).to(torch.bfloat16)


def _rank(rank: int, world: int, port: int, url: str, cfg: dict[str, Any], out: str) -> None:
    base_rss = _rss_bytes()
    import torch
    import torch.distributed as dist

    from deltastore.sharded import Rows, ShardedPublisher

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    sharded = cfg["mode"] == "sharded"
    try:
        if sharded:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=600))
        rows, cols, n = cfg["rows"], cfg["cols"], cfg["tensors"]
        per = rows // world
        start, stop = rank * per, (rank + 1) * per
        base_rss = _rss_bytes()  # after imports and the process group: what a trainer has anyway
        shard = {f"layer{ti}.weight": _rows(ti, start, stop, 1, cols, cfg["density"]) for ti in range(n)}
        result["shard_bytes"] = sum(t.numel() * t.element_size() for t in shard.values())
        marks = [("shard built", _rss_bytes() - base_rss, _peak_bytes() - base_rss)]
        times = []
        if sharded:
            pub = ShardedPublisher(url, threads=cfg["threads"], anchor_every=1000)
        else:
            from deltastore import Publisher

            pub = Publisher(url, threads=cfg["threads"], anchor_every=1000)
        with pub:
            for step in range(1, cfg["steps"] + 2):
                if step > 1:
                    for ti, t in enumerate(shard.values()):
                        _advance(t, ti, start, step, cfg["density"])
                state = {k: Rows(t, start, rows) for k, t in shard.items()} if sharded else shard
                if sharded:
                    dist.barrier()
                t0 = time.perf_counter()
                info = pub.publish(state, step=step)
                times.append((info.kind, time.perf_counter() - t0, info.bytes_stored))
                marks.append((f"after v{info.version}", _rss_bytes() - base_rss,
                              _peak_bytes() - base_rss))
        marks.append(("closed", _rss_bytes() - base_rss, _peak_bytes() - base_rss))
        result["marks"] = marks
        result["times"] = times
        result["peak_rss_above_base"] = marks[-1][2]
    except BaseException as e:
        import traceback

        result["error"] = traceback.format_exc()
        raise SystemExit(str(e)) from e
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        if sharded and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(world: int, mode: str, args: argparse.Namespace, tmp: Path, threads: int = 1) -> dict[str, Any]:
    url = f"file://{tmp}/store-{mode}-{world}-{threads}"
    out = tmp / f"out-{mode}-{world}-{threads}"
    out.mkdir()
    cfg = {"mode": mode, "rows": args.rows, "cols": args.cols, "tensors": args.tensors, "steps": args.steps,
           "density": args.density, "threads": threads}
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, url, cfg, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"{mode} world {world} rank {r['rank']} failed:\n{r['error']}")
    times = ranks[0]["times"]
    deltas = [t for kind, t, _ in times if kind == "delta"]
    model_bytes = args.tensors * args.rows * args.cols * 2
    _check(url, args)
    return {
        "mode": mode, "ranks": world, "threads_per_rank": threads,
        "anchor_s": round(times[0][1], 3), "anchor_mb_s": round(model_bytes / times[0][1] / 1e6, 1),
        "delta_median_s": round(statistics.median(deltas), 3),
        "delta_bytes_median": int(statistics.median(b for k, _, b in times if k == "delta")),
        "throughput_mb_s": round(model_bytes / statistics.median(deltas) / 1e6, 1),
        "per_rank": [{"rank": r["rank"], "shard_bytes": r["shard_bytes"], "peak_rss_above_base": r["peak_rss_above_base"]}
                     for r in ranks],
    }


def _check(url: str, args: argparse.Namespace) -> None:
    """The last version, pulled by an unsharded Subscriber, is the model rebuilt here."""
    import torch

    from deltastore import Subscriber

    with Subscriber(url) as sub:
        got = sub.pull()
    step = args.steps + 1
    for ti in range(args.tensors):
        want = _rows(ti, 0, args.rows, step, args.cols, args.density)
        if not torch.equal(got[f"layer{ti}.weight"].view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"{url}: layer{ti}.weight differs from the model published")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sharded publishing: throughput with 1, 2, 4 ranks; per-rank memory")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.rows % (4 * BLOCK_ROWS):
        ap.error(f"--rows must be a multiple of {4 * BLOCK_ROWS}")
    model_bytes = args.tensors * args.rows * args.cols * 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(run_config(1, "unsharded", args, Path(tmp)))
        for world in (1, 2, 4):
            rows.append(run_config(world, "sharded", args, Path(tmp)))
        rows.append(run_config(1, "sharded", args, Path(tmp), threads=2))
    one = next(r for r in rows if r["mode"] == "sharded" and r["ranks"] == 1 and r["threads_per_rank"] == 1)
    for r in rows:
        r["vs_1_rank"] = round(r["throughput_mb_s"] / one["throughput_mb_s"], 2)
        r["anchor_vs_1_rank"] = round(r["anchor_mb_s"] / one["anchor_mb_s"], 2)
    two = next(r for r in rows if r["mode"] == "sharded" and r["ranks"] == 2)
    out = {"model_bytes": model_bytes, "tensors": args.tensors, "shape": [args.rows, args.cols], "steps": args.steps,
           "density": args.density, "cpus": os.cpu_count(), "configs": rows,
           "two_over_one": two["vs_1_rank"], "goal_met": two["vs_1_rank"] >= GOAL_2_OVER_1, "bit_exact": True}
    header = (f"model: {args.tensors} × bf16[{args.rows}, {args.cols}] = {model_bytes:,} B; {args.steps} delta steps at "
              f"{100 * args.density:g} % changed; file store; {os.cpu_count()} CPUs (shared); every configuration bit-exact")
    lines = [
        header,
        "",
        "| writer | ranks × threads | anchor s (vs 1 rank) | delta s, median | delta: MB/s of model | delta vs 1 rank | per-rank peak RSS above base / shard |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = ", ".join(f"{p['peak_rss_above_base'] / 2**20:.0f}/{p['shard_bytes'] / 2**20:.0f} MiB" for p in r["per_rank"])
        lines.append(f"| {'Publisher' if r['mode'] == 'unsharded' else 'ShardedPublisher'} | {r['ranks']} × "
                     f"{r['threads_per_rank']} | {r['anchor_s']} ({r['anchor_vs_1_rank']}×) | {r['delta_median_s']} | {r['throughput_mb_s']} | "
                     f"{r['vs_1_rank']}× | {mem} |")
    lines.append("")
    lines.append(f"2 ranks / 1 rank: delta publish {two['vs_1_rank']}×, anchor {two['anchor_vs_1_rank']}× "
                 f"(goal ≥ {GOAL_2_OVER_1}×: {'met' if out['goal_met'] else 'not met'}); load average at the end "
                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / "sharded.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
