"""One rank of ``python -m benchmarks.sharded``: what each process of a configuration builds,
publishes and measures (its rows of the model, its publish times, CPU and memory), started by
the driver through :func:`rank_context` and reporting through a pickle in its output folder.

A rank holds only its rows of each tensor, as an FSDP job's process does: synthetic rows are
generated per block of :data:`BLOCK_ROWS` rows (seeded by tensor and block, so every
configuration publishes the same bits), real ones read from the cached workload's safetensors
files with ``pread``. :func:`run_rank` publishes them with a ``ShardedPublisher`` or, in the
configurations without the protocol, a ``Publisher`` of its own.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import pickle
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Tiny model of ``--workload fixed``: 8 tensors of bf16[64, 16] (16 KiB), so that encoding is
#: negligible and what is measured is the protocol (collectives, manifests, HEAD).
FIXED_TENSORS, FIXED_ROWS, FIXED_COLS = 8, 64, 16
#: Store methods counted per version in ``--workload fixed`` (reads, then writes).
READ_OPS = ("get", "get_if_changed", "head", "list")
WRITE_OPS = ("put", "delete")
#: Configurations whose every process is a Publisher of its own rows to a store of its own.
OWN_STORES = ("independent", "alone")
#: Rows generated (and changed) per seed: every rank's rows are whole blocks for 1, 2 and 4
#: ranks when rows is a multiple of 4 × this.
BLOCK_ROWS = 256


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: across fork+exec that keeps the
    parent's peak, so a spawned rank would report the benchmark driver's memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def block_rows(ti: int, block: int, step: int, cols: int, density: float) -> Any:
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


def shard_rows(ti: int, start: int, stop: int, step: int, cols: int, density: float) -> Any:
    import torch

    out = torch.empty(stop - start, cols, dtype=torch.bfloat16)  # filled block by block: no transient second copy
    for k, b in enumerate(range(start // BLOCK_ROWS, stop // BLOCK_ROWS)):
        out[k * BLOCK_ROWS:(k + 1) * BLOCK_ROWS] = block_rows(ti, b, step, cols, density)
    return out


def advance_rows(t: Any, ti: int, start: int, step: int, density: float) -> None:
    """Change ``t`` (rows from ``start``) from step−1 to ``step`` in place."""
    import torch

    for k in range(t.shape[0] // BLOCK_ROWS):
        b = start // BLOCK_ROWS + k
        flat = t[k * BLOCK_ROWS:(k + 1) * BLOCK_ROWS].view(-1)
        g2 = torch.Generator().manual_seed((ti * 1_000_003 + b) * 7919 + step)
        idx = torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=g2)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-4).to(torch.bfloat16)


def fsdp_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row tensor on ``rank`` as FSDP2 shards it
    (``torch.chunk`` on dimension 0: ceil(rows / world) per rank; the last may be short or empty)."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


class Source:
    """What one rank holds of the model at each step: its rows, built or read, and updated in place."""

    def __init__(self, cfg: dict[str, Any], rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.ranges: dict[str, tuple[int, int, int]] = {}  # name -> (start, stop, rows)

    def build(self) -> dict[str, Any]:
        import torch

        cfg, rank, world = self.cfg, self.rank, self.world
        if cfg["workload"] == "synthetic":
            rows = cfg["rows"]
            per = rows // world
            start, stop = rank * per, (rank + 1) * per
            shard = {f"layer{ti}.weight": shard_rows(ti, start, stop, 1, cfg["cols"], cfg["density"]) for ti in range(cfg["tensors"])}
            self.ranges = {k: (start, stop, rows) for k in shard}
            return shard
        if cfg["workload"] == "fixed":
            start, stop = fsdp_range(FIXED_ROWS, rank, world)
            shard = {f"t{i}": torch.full((stop - start, FIXED_COLS), float(i), dtype=torch.bfloat16) for i in range(FIXED_TENSORS)}
            self.ranges = {k: (start, stop, FIXED_ROWS) for k in shard}
            return shard
        path = rl_path(cfg["rl_workload"], 0)
        shard = {}
        for name, (dtype, shape, _) in safetensors_header(path)[0].items():
            start, stop = fsdp_range(shape[0], rank, world)
            shard[name] = torch.empty((stop - start, *shape[1:]), dtype=getattr(torch, dtype))
            self.ranges[name] = (start, stop, shape[0])
        self._read(path, shard)
        return shard

    def _read(self, path: Path, shard: dict[str, Any]) -> None:
        """Read this rank's rows of every tensor of ``path`` into ``shard``, in place. With
        pread, not safetensors' mmap: the mapped file's pages would count in this rank's RSS."""
        import torch

        header, data_start = safetensors_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, t in shard.items():
                _, shape, begin = header[name]
                start, stop, _ = self.ranges[name]
                if start == stop:
                    continue
                row_bytes = t.element_size() * math.prod(shape[1:])
                buf = memoryview(t.view(torch.uint8).reshape(-1).numpy())
                n = os.preadv(f.fileno(), [buf], data_start + begin + start * row_bytes)
                if n != (stop - start) * row_bytes:
                    raise OSError(f"{path}: short read of {name}")

    def advance(self, shard: dict[str, Any], step: int) -> None:
        """Bring ``shard`` to ``step`` in place (the trainer's optimizer step; not timed)."""
        cfg = self.cfg
        if cfg["workload"] == "synthetic":
            for ti, t in enumerate(shard.values()):
                advance_rows(t, ti, self.ranges[f"layer{ti}.weight"][0], step, cfg["density"])
        elif cfg["workload"] == "rl":
            self._read(rl_path(cfg["rl_workload"], step - 1), shard)

    def state(self, shard: dict[str, Any], sharded: bool) -> dict[str, Any]:
        from deltastore.write.sharded import Rows

        if not sharded:
            return shard
        return {k: Rows(t, self.ranges[k][0], self.ranges[k][2]) for k, t in shard.items()}


#: safetensors dtype names -> torch attribute names.
ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32"}


def safetensors_header(path: Path) -> tuple[dict[str, tuple[str, list[int], int]], int]:
    """``({name: (torch dtype name, shape, first data byte)}, where the data starts)``."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (ST_DTYPES[v["dtype"]], v["shape"], v["data_offsets"][0]) for k, v in header.items()}, 8 + n


def rl_path(name: str, step: int) -> Path:
    """The cached safetensors file of step ``step`` of the real workload ``name``."""
    from benchmarks.workload import step_path  # loads torch: not at this module's import

    return step_path(name, step)


def count_requests(store: Any, counts: dict[str, int]) -> None:
    """Count ``store``'s requests into ``counts`` (reads, writes) from now on."""
    for kind, ops in (("reads", READ_OPS), ("writes", WRITE_OPS)):
        for op in ops:
            real = getattr(store, op)

            def counted(*a: Any, _real: Any = real, _kind: str = kind, **k: Any) -> Any:
                counts[_kind] += 1
                return _real(*a, **k)

            setattr(store, op, counted)


def pin_cores(rank: int, threads: int) -> list[int]:
    """Pin this process (and the threads it starts) to ``threads`` cores of its own, rank r
    taking cores ``[r·threads, (r+1)·threads)`` (wrapping when the ranks need more cores than
    there are): N ranks of one encode thread then use N cores, and one rank cannot spill its
    main, upload and gloo threads onto a core another configuration's rank would need, as the
    processes of a training job on a node with cores per rank would not."""
    cores = sorted(os.sched_getaffinity(0))
    mine = sorted({cores[(rank * threads + i) % len(cores)] for i in range(threads)})
    os.sched_setaffinity(0, mine)
    return mine


#: The steps of a sharded publish timed by ``--step-cpu`` (main-thread CPU): attributes of the
#: ShardedPublisher, of its collectives and rank 0's coordinator, and, nested in them, functions
#: of the deltastore.write.sharded modules (label, owner, attribute).
STEP_TIMERS = (
    ("collectives", "collectives", "all_gather"), ("collectives", "collectives", "broadcast"),
    ("collectives", "collectives", "gather"), ("part", "pub", "_write_part"),
    ("encode_version", "part module", "encode_version"), ("encode_part", "part module", "encode_part"),
    ("commit", "coordinator", "commit"), ("join", "coordinator module", "join_parts"),
)


def time_steps(pub: Any, acc: dict[str, float]) -> None:
    """Wrap the steps of ``pub`` (a ShardedPublisher) in main-thread CPU timers adding into
    ``acc``: where a rank's own thread spends a version beyond the encode threads (design 010
    D8). Nested labels overlap: ``part`` holds ``encode_version`` and ``encode_part``,
    ``commit`` holds ``join``."""
    from deltastore.write.sharded import coordinator, part

    def timed(fn: Any, label: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.thread_time() - c0

        return wrapper

    owners = {"pub": pub, "collectives": pub.collectives, "coordinator": pub._coordinator, "part module": part,
              "coordinator module": coordinator}
    for label, owner, attr in STEP_TIMERS:
        target = owners[owner]
        if target is not None:  # the coordinator: rank 0 only
            setattr(target, attr, timed(getattr(target, attr), label))


def run_rank(rank: int, world: int, port: int, url: str, cfg: dict[str, Any], out: str) -> None:
    if cfg.get("pin"):
        pin_cores(rank, cfg["threads"])
    base_rss = rss_bytes()
    import torch
    import torch.distributed as dist

    from deltastore.write.sharded import ShardedPublisher
    from deltastore.write.policy import AnchorPolicy, WriterPolicy

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    sharded = cfg["mode"] in ("sharded", "preloaded", "pipelined")
    # the independent processes share a process group for the barrier only; "alone" runs them one after another
    grouped = (world > 1 or sharded) and cfg["mode"] != "alone"
    try:
        if grouped:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=600))
        source = Source(cfg, rank, world)
        base_rss = rss_bytes()  # after imports and the process group: what a trainer has anyway
        shard = source.build()
        result["shard_bytes"] = sum(t.numel() * t.element_size() for t in shard.values())
        marks = [("shard built", rss_bytes() - base_rss, peak_bytes() - base_rss)]
        times, requests, cpu, main_cpu, step_cpu = [], [], [], [], []
        acc: dict[str, float] = {}
        options = cfg.get("storage_options")
        if sharded:
            pub = ShardedPublisher(url, storage_options=options, writer_policy=WriterPolicy(threads=cfg["threads"]),
                                   anchor_policy=AnchorPolicy(every=1000))
        else:
            from deltastore import Publisher

            own = f"{url}-r{rank}" if cfg["mode"] in OWN_STORES else url
            pub = Publisher(own, storage_options=options, writer_policy=WriterPolicy(threads=cfg["threads"]),
                            anchor_policy=AnchorPolicy(every=1000))
        counts = {"reads": 0, "writes": 0, "collectives": 0}
        if cfg["workload"] == "fixed":
            count_requests(pub.store, counts)
            if sharded:
                for op in ("_all_gather", "_broadcast", "_gather"):
                    real = getattr(pub, op)

                    def counted(obj: Any, _real: Any = real) -> Any:
                        counts["collectives"] += 1
                        return _real(obj)

                    setattr(pub, op, counted)
        if cfg.get("step_cpu") and sharded:
            time_steps(pub, acc)
        if cfg["mode"] in ("preloaded", "pipelined"):
            with pub:
                back_to_back(pub, source, shard, cfg, result, marks, asynchronous=cfg["mode"] == "pipelined")
            result["peak_rss_above_base"] = peak_bytes() - result["base_rss"]
            return
        with pub:
            for step in range(1, cfg["steps"] + 2):
                if step > 1:
                    source.advance(shard, step)
                state = source.state(shard, sharded)
                if grouped:
                    dist.barrier()
                counts.update(reads=0, writes=0, collectives=0)
                acc.clear()
                t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
                info = pub.publish(state, step=step)
                times.append((info.kind, time.perf_counter() - t0, info.bytes_stored))
                cpu.append(time.process_time() - c0)
                main_cpu.append(time.thread_time() - m0)
                step_cpu.append(dict(acc))
                requests.append(dict(counts))
                if cfg["workload"] != "fixed":
                    marks.append((f"after v{info.version}", rss_bytes() - base_rss, peak_bytes() - base_rss))
        marks.append(("closed", rss_bytes() - base_rss, peak_bytes() - base_rss))
        result["marks"] = marks
        result["times"] = times
        result["requests"] = requests
        result["cpu"] = cpu  # this process's CPU seconds (all its threads) per publish
        result["main_cpu"] = main_cpu  # ... of the thread that called publish
        result["step_cpu"] = step_cpu  # ... of that thread in each timed step (--step-cpu)
        result["peak_rss_above_base"] = marks[-1][2]
    except BaseException as e:
        import traceback

        result["error"] = traceback.format_exc()
        raise SystemExit(str(e)) from e
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        if grouped and dist.is_initialized():
            dist.destroy_process_group()


def rank_context() -> Any:
    """The context ranks start from: a forkserver that imported torch and deltastore once, so
    a rank starts in milliseconds instead of importing torch again (seconds on two cores); each
    rank is still a fresh child of that server, with no thread or lock of this process. Ranks
    measure from their own barrier and their own base RSS, so the start method changes no
    figure. ``spawn`` where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "deltastore", "deltastore.write.sharded"])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def back_to_back(pub: Any, source: Source, shard: dict[str, Any], cfg: dict[str, Any], result: dict[str, Any],
                  marks: list[Any], *, asynchronous: bool) -> None:
    """``preloaded`` and ``pipelined``: every step's rows are read first (other tensors than
    the ones published before them, as a trainer's next step would write); the anchor is
    published, then every delta back to back, by ``publish`` (preloaded) or by
    ``publish_async`` and one ``flush`` (pipelined). Each delta's time is the loop's time over
    the deltas (publish_async returns before rank 0's commit: only the loop's end, after the
    flush, says when the versions are in). The two modes read the same steps the same way, so
    their ratio is what overlapping the commit gives."""
    import torch.distributed as dist

    states = []
    for step in range(1, cfg["steps"] + 2):
        if step > 1:
            source.advance(shard, step)
        states.append(source.state({k: t.clone() for k, t in shard.items()}, True))
    result["base_rss"] = base = rss_bytes()  # the preloaded steps are the trainer's memory, not the publisher's
    marks.append(("steps read", 0, peak_bytes() - base))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    info = pub.publish(states[0], step=1)
    times = [(info.kind, time.perf_counter() - t0, info.bytes_stored)]
    cpu = [time.process_time() - c0]
    dist.barrier()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    if asynchronous:
        futures = [pub.publish_async(state, step=i + 2) for i, state in enumerate(states[1:])]
        pub.flush()
        infos = [f.result() for f in futures]
    else:
        infos = [pub.publish(state, step=i + 2) for i, state in enumerate(states[1:])]
    n = len(infos)
    wall, proc, main = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n, (time.thread_time() - m0) / n
    for i in infos:
        times.append((i.kind, wall, i.bytes_stored))
        cpu.append(proc)
    marks.append(("closed", rss_bytes() - base, peak_bytes() - base))
    result.update(times=times, cpu=cpu, main_cpu=[cpu[0], *[main] * n], step_cpu=[{}] * (n + 1),
                  requests=[{}] * (n + 1), marks=marks)
