"""The performance goals in one run: every cost as a ratio to a memory copy of the same model.

    python -m benchmarks.perf                       # tf265m-rl-1e-6 (531 MB bf16), ~5-10 min
    python -m benchmarks.perf --quick               # a small synthetic model, seconds (the smoke test)
    python -m benchmarks.perf --modes native --rounds 3   # three publisher/worker rounds, calls pooled

On a transformer-shaped model with real AdamW steps (``benchmarks/workload.py``, cached in
``benchmarks/.cache``), each role in a fresh subprocess, on ``--threads`` threads (default:
every core, 2 here):

* **copy**: ``dst.copy_(src)`` of every tensor into preallocated tensors, median of
  ``COPY_REPEATS``, torch on one thread and on ``--threads``, the faster kept, in its own
  process: the denominator of every ratio;
* **paired copy**: the same copy (one of each thread count, the faster) timed again inside the
  publisher and the worker next to each delta publish and each delta ``pull_into``, with only
  the result digest between them (into a model-sized buffer the role holds from its start, so
  it is in none of the peaks): the "paired" ratios take the median over calls of each call's
  time over its own copy. This machine's speed drifts by tens of percent between processes and
  from minute to minute (consecutive copy processes: 29 and 37 ms); a pair shares the drift;
* **publisher**: the first publish (step 0, an anchor), a delta publish for each of steps
  1..N-1 (median), step N as a forced anchor (``anchor=True``: the steady-state anchor cost,
  reference held), peak RSS of the delta publishes;
* **worker**: ``pull`` of the first version, ``pull_into`` of each delta version (median) and of
  the forced anchor, ``pull`` of the last delta version (its anchor plus every delta), peak RSS
  of the delta ``pull_into`` calls; every result compared with the trainer's export (XXH3-128
  of every tensor, taken by the publisher role);
* **PULSE** (``benchmarks/peers.py``: COO int32 + new values, zstd-3) encode and decode+apply of
  the same steps (torch on one thread: ``PULSE_THREADS``);
* **anchor encode on one thread**: ZipNN (bf16 byte mode, one thread) against
  ``deltastore.codec.encode_full`` per tensor, time and size (and an XXH3-128 of the blob,
  so that ``same_bytes_as_numpy`` covers anchors as well as deltas);
* **sizes**: pack bytes each delta version stored against the order-0 entropy estimate
  (``peers.entropy_bytes``).

The publisher and worker run twice, with the native kernels (``deltastore._util.kernels``) and
with ``DELTASTORE_NATIVE=0`` (the numpy path), against separate stores, so both columns come
from one run on the same machine state. Where the kernels are not built (or not in this
revision) the native column says so and only the numpy path runs. The store is a local
directory on tmpfs (``/dev/shm`` when present), so no disk is timed.

Peak memory is VmHWM above the role's RSS before it loaded the model, in units of the model's
bytes (reset before each timed call through ``/proc/self/clear_refs``), so the publisher's figure
includes the trainer's own tensors (1×) and the reference copy (1×): the goal "model +
reference + 0.2×" is ≤ 2.2 here, the worker's "model + 0.2×" is ≤ 1.2.

Results go to ``benchmarks/results/perf.json`` and ``perf.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.rss import reset_peak as _reset_peak
from benchmarks.rss import status_kb as _status_kb

logger = logging.getLogger(__name__)

DEFAULT_WORKLOAD = "tf265m-rl-1e-6"
RESULTS = Path(__file__).resolve().parent / "results"
# The memory copy is timed this many times (median): it is the denominator of every ratio, and
# one copy of a 531 MB model takes ~0.1-0.3 s, so five cost ~1 s.
COPY_REPEATS = 5
# PULSE's encoder and decoder are timed on at most this many steps (median): they are
# baselines, and each step of the 531 MB model costs a load of two snapshots (~2-4 s here).
PULSE_STEPS = 3
# PULSE's encode and decode run with torch on one thread: the format is a single-threaded Python
# loop over tensors, and its torch ops on two OpenMP threads were slower on the shared machine.
PULSE_THREADS = 1
# Anchor encoders on one thread (ZipNN and ours) are timed this many times, fastest kept: on a
# shared machine the minimum is the least disturbed estimate; each takes 1-3 s on 531 MB.
ANCHOR_REPEATS = 2
# --quick: a synthetic model of this many transformer blocks (d_model QUICK_D), QUICK_STEPS
# AdamW steps: a few MB, enough to run every role and path in seconds.
QUICK_LAYERS = 2
QUICK_D = 256
QUICK_STEPS = 3
# A role that runs past this is a hang, not a slow machine (a full role takes ~1-2 min here).
ROLE_TIMEOUT_S = 900
# The goals, next to the figures (docs/benchmarks.md, "Performance").
GOALS = {
    "publish_over_copy": 2.0,
    "publish_over_copy_paired": 2.0,
    "pull_into_over_copy": 1.3,
    "pull_into_over_copy_paired": 1.3,
    "publisher_peak_over_model": 2.2,  # trainer state 1 + reference 1 + 0.2
    "worker_peak_over_model": 1.2,  # target 1 + 0.2
    "delta_over_h0": 0.85,
}


# --- helpers shared by the roles ----------------------------------------------------------


def _step_file(src: Path, step: int) -> Path:
    return src / f"step_{step:04d}.safetensors"


def _load(src: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(_step_file(src, step)))


def _load_into(src: Path, step: int, state: dict) -> None:
    """Overwrite ``state`` in place with ``step``'s tensors, as an optimizer step would."""
    from safetensors import safe_open

    with safe_open(str(_step_file(src, step)), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
            state[k].copy_(f.get_tensor(k))


def _model_bytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _digest(sd: dict) -> dict[str, str]:
    """XXH3-128 of every tensor's bytes: compares a result with the trainer's export without a
    second model-sized copy in the worker (which would sit in its heap and skew its peak RSS)."""
    import torch
    import xxhash

    return {k: xxhash.xxh3_128_hexdigest(t.contiguous().view(torch.int16).numpy().data) for k, t in sd.items()}


class Dur(float):
    """Wall seconds of one call, with ``cpu``: CPU seconds of every thread of this process
    over the same call. On a shared machine wall time includes waiting for a core; CPU time
    does not, so its ratios are the steadier of the two (both are reported)."""

    cpu: float


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> Dur:
    d = Dur(time.perf_counter() - t0[0])
    d.cpu = time.process_time() - t0[1]
    return d


def _with_cpu(out: dict) -> dict:
    """``out`` plus ``out["cpu"]``: the same timing keys in CPU seconds (lists as medians, under
    the name of the wall median: ``delta_s`` -> ``delta_median_s``, ``copy_all_s`` -> ``copy_s``)."""
    cpu = {}
    for k, v in out.items():
        if isinstance(v, Dur):
            cpu[k] = v.cpu
        elif isinstance(v, list) and v and all(isinstance(x, Dur) for x in v):
            cpu[k] = [x.cpu for x in v]
            cpu["copy_s" if k == "copy_all_s" else k[:-2] + "_median_s"] = statistics.median(cpu[k])
    out["cpu"] = cpu
    return out


def _time_copy(state: dict, threads: int) -> dict:
    """Median seconds of ``copy_`` of every tensor into preallocated ones, with torch on one
    thread and on ``threads``, the faster kept (and one clone).

    Both, because the faster depends on the machine: on an idle one two threads copy faster; on
    a shared one torch's OpenMP threads spin-wait for a descheduled partner, and a 531 MB copy
    on two threads measured 2.1 s of wall and 0.73 s of CPU time (load average 12), several
    times a one-thread copy. The denominator should be what a copy can cost, not that.
    """
    import torch

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # fault the pages in: a copy into fresh memory is not the point
        dst[k].copy_(v)
    by_threads: dict[int, list] = {}
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        times = by_threads[nt] = []
        for _ in range(COPY_REPEATS):
            times.append(_copy_into(state, dst))
    del dst
    best = min(by_threads, key=lambda nt: statistics.median(by_threads[nt]))
    t0 = _now()
    clone = {k: v.clone() for k, v in state.items()}
    clone_s = _since(t0)
    del clone
    torch.set_num_threads(threads)
    return {"copy_s": float(statistics.median(by_threads[best])), "copy_all_s": by_threads[best],
            "copy_threads": best, "clone_s": clone_s,
            "copy_median_s_by_threads": {nt: float(statistics.median(t)) for nt, t in by_threads.items()}}


def _resident_like(src: Path) -> dict:
    """Zero-filled tensors shaped as step 0's: every page written (resident, in the RSS the
    peaks are measured above) before the first paired copy writes into them."""
    import torch

    return {k: torch.zeros_like(v) for k, v in _load(src, 0).items()}


def _copy_into(src: dict, dst: dict) -> Dur:
    """The time of one ``copy_`` of every tensor of ``src`` into ``dst``."""
    t0 = _now()
    for k, v in src.items():
        dst[k].copy_(v)
    return _since(t0)


def _paired_copy(src: dict, dst: dict, threads: int) -> Dur:
    """One ``copy_`` of every tensor of ``src`` into ``dst`` (preallocated, faulted in), torch on
    one thread and on ``threads``, the faster: the denominator timed next to each measured call."""
    import torch

    best: Dur | None = None
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        d = _copy_into(src, dst)
        best = d if best is None or d < best else best
    torch.set_num_threads(threads)
    assert best is not None
    return best


def _copy(src: Path, threads: int) -> dict:
    """The denominator, in its own process: the roles' peaks never see its extra model copy."""
    state = _load(src, 0)
    return _with_cpu({"role": "copy", "model_bytes": _model_bytes(state), **_time_copy(state, threads)})


def native_status() -> dict:
    """Whether this process loaded the native kernels, and why not."""
    try:
        from deltastore._util import kernels
    except ImportError as e:
        return {"native": False, "why": f"no deltastore._util.kernels in this revision ({e})"}
    if os.environ.get("DELTASTORE_NATIVE") == "0":
        return {"native": bool(kernels.NATIVE), "why": "DELTASTORE_NATIVE=0"}
    if not kernels.NATIVE:
        return {"native": False, "why": "extension not built or not loadable"}
    isa = getattr(kernels._native, "scan_isa", None)  # the encode scan's instruction set
    return {"native": True, "why": "", **({"scan_isa": isa()} if isa is not None else {})}


# --- roles (each in a fresh interpreter) --------------------------------------------------


def _publisher(src: Path, url: str, steps: int, threads: int, work: Path, entropy: bool) -> dict:
    import torch

    from benchmarks import peers
    from deltastore import Publisher
    from deltastore.write.policy import WriterPolicy

    torch.set_num_threads(threads)  # the copy and PULSE use the cores deltastore's threads use
    dst = _resident_like(src)  # the paired copies' destination, resident before the baseline
    baseline = _status_kb("VmRSS")
    state = _load(src, 0)  # the trainer's tensors, updated in place per step
    model = _model_bytes(state)
    out: dict = {"role": "publisher", "model_bytes": model, "tensors": len(state), **native_status()}
    digests = [_digest(state)]  # what the worker must reach, per step
    delta_s, paired_s, peaks, stored = [], [], [], []
    with Publisher(url, writer_policy=WriterPolicy(threads=threads)) as pub:
        _reset_peak()
        t0 = _now()
        pub.publish(state, step=0)
        out["first_anchor_s"] = _since(t0)
        out["first_anchor_peak_over_model"] = (_status_kb("VmHWM") - baseline) * 1024 / model
        for s in range(1, steps):
            _load_into(src, s, state)
            # the paired copy before the digest, not right before the publish: timed just after
            # a copy, a publish measured 1-10 % slower (two in-process A/B runs); with the digest
            # between them, not (0.97)
            paired_s.append(_paired_copy(state, dst, threads))
            digests.append(_digest(state))
            _reset_peak()  # the benchmark's own file reads are not the publisher's memory
            t0 = _now()
            info = pub.publish(state, step=s)
            delta_s.append(_since(t0))
            peaks.append(_status_kb("VmHWM"))
            assert info.kind == "delta", info
            stored.append(info.bytes_stored)
        # The last step as a forced anchor: a steady-state anchor publish (reference held).
        _load_into(src, steps, state)
        digests.append(_digest(state))
        _reset_peak()
        t0 = _now()
        info = pub.publish(state, step=steps, anchor=True)
        out["anchor_s"] = _since(t0)
        out["anchor_peak_over_model"] = (_status_kb("VmHWM") - baseline) * 1024 / model
        out["anchor_bytes"] = info.bytes_stored
    del state, dst
    (work / "digests.json").write_text(json.dumps(digests))
    out.update(delta_s=delta_s, delta_median_s=statistics.median(delta_s), delta_bytes=stored, copy_paired_s=paired_s,
               peak_over_model=(max(peaks) - baseline) * 1024 / model)
    # Baseline encoder and sizes, after the publisher is gone (its memory is measured above).
    # PULSE's encoder is single-threaded Python around torch ops; on two torch threads the ops'
    # OpenMP spin-waits made it slower on this shared machine, so it runs on one (PULSE_THREADS).
    torch.set_num_threads(PULSE_THREADS)
    pulse = peers.FORMATS["pulse"]
    pulse_s, pulse_bytes, h0 = [], [], []
    for s in range(1, steps):
        if s > PULSE_STEPS and not entropy:
            break
        prev, new = _load(src, s - 1), _load(src, s)
        if s <= PULSE_STEPS:
            t0 = _now()
            blob = pulse.encode(prev, new)
            pulse_s.append(_since(t0))
            pulse_bytes.append(len(blob))
            (work / f"pulse_{s}.bin").write_bytes(blob)
        if entropy:
            h0.append(peers.entropy_bytes(prev, new))
        del prev, new
    out.update(pulse_encode_s=pulse_s, pulse_encode_median_s=statistics.median(pulse_s),
               pulse_bytes=pulse_bytes, h0_bytes=h0)
    return _with_cpu(out)


def _worker(src: Path, url: str, steps: int, threads: int, work: Path) -> dict:
    import torch

    from benchmarks import peers
    from deltastore import Subscriber

    torch.set_num_threads(threads)
    digests = json.loads((work / "digests.json").read_text())  # per step, from the publisher
    dst = _resident_like(src)  # the paired copies' destination, resident before the baseline
    baseline = _status_kb("VmRSS")
    out: dict = {"role": "worker", **native_status()}
    exact = True
    into_s, paired_s, peaks = [], [], []
    with Subscriber(url, threads=threads) as sub:
        _reset_peak()
        t0 = _now()
        target = sub.pull(1)
        out["first_pull_s"] = _since(t0)
        model = _model_bytes(target)
        out["model_bytes"] = model
        out["first_pull_peak_over_model"] = (_status_kb("VmHWM") - baseline) * 1024 / model
        paired_s.append(_paired_copy(target, dst, threads))  # before the digest (see the publisher)
        exact &= _digest(target) == digests[0]
        for v in range(2, steps + 1):  # version v holds step v - 1; versions 2..steps are deltas
            _reset_peak()
            t0 = _now()
            sub.pull_into(target, version=v)
            into_s.append(_since(t0))
            peaks.append(_status_kb("VmHWM"))
            if v < steps:  # the next pull_into's paired copy
                paired_s.append(_paired_copy(target, dst, threads))
            exact &= _digest(target) == digests[v - 1]
        _reset_peak()
        t0 = _now()
        sub.pull_into(target, version=steps + 1)  # the forced anchor (the last step)
        out["pull_into_anchor_s"] = _since(t0)
        out["pull_into_anchor_peak_over_model"] = (_status_kb("VmHWM") - baseline) * 1024 / model
        exact &= _digest(target) == digests[steps]
        del target  # (dst stays: the peaks below are measured above a baseline that holds it)
        _reset_peak()
        t0 = _now()
        latest = sub.pull(steps)  # the last delta version: the first anchor and every delta
        out["pull_chain_s"] = _since(t0)
        out["pull_chain_peak_over_model"] = (_status_kb("VmHWM") - baseline) * 1024 / model
        exact &= _digest(latest) == digests[steps - 1]
        del latest
    del dst
    out.update(pull_into_s=into_s, pull_into_median_s=statistics.median(into_s), copy_paired_s=paired_s,
               peak_over_model=(max(peaks) - baseline) * 1024 / model)
    torch.set_num_threads(PULSE_THREADS)
    pulse = peers.FORMATS["pulse"]
    pulse_s = []
    for s in range(1, min(steps - 1, PULSE_STEPS) + 1):
        target, blob = _load(src, s - 1), (work / f"pulse_{s}.bin").read_bytes()
        t0 = _now()
        pulse.decode_apply(target, blob)
        pulse_s.append(_since(t0))
        exact &= _digest(target) == digests[s]
        del target
    out.update(pulse_apply_s=pulse_s, pulse_apply_median_s=statistics.median(pulse_s), exact=exact)
    return _with_cpu(out)


def _anchor_codecs(src: Path, step: int) -> dict:
    """ZipNN's and deltastore's anchor encoders on one thread, on one snapshot: time and size."""
    import numpy as np
    import torch
    import xxhash

    from benchmarks import peers

    torch.set_num_threads(1)
    sd = _load(src, step)
    out: dict = {"role": "anchor", "model_bytes": _model_bytes(sd), **native_status()}
    for name in ("zipnn", "deltastore-anchor"):
        why = peers.unavailable(name)
        if why:
            out[name] = {"unavailable": why}
            continue
        if name == "zipnn":
            raw = np.concatenate([peers.u16(t) for t in sd.values()]).tobytes()  # not timed
            z = peers._zipnn(False)
            def enc(z=z, raw=raw) -> bytes:
                return bytes(z.compress(raw))
        else:
            def enc(fmt=peers.FORMATS[name]) -> bytes:
                return fmt.encode(sd, sd)
        times, blob = [], b""
        for _ in range(ANCHOR_REPEATS):
            t0 = _now()
            blob = enc()
            times.append(_since(t0))
        out[name] = {"encode_s": min(times), "encode_cpu_s": min(t.cpu for t in times), "bytes": len(blob),
                     "xxh3": xxhash.xxh3_128_hexdigest(blob)}  # kernels and numpy path: same bytes?
    return out


ROLES = {"copy", "publisher", "worker", "anchor", "probe"}


def _role_main(args: argparse.Namespace) -> dict:
    src, work = Path(args.src), Path(args.work)
    if args.role == "probe":
        return native_status()
    if args.role == "copy":
        return _copy(src, args.threads)
    if args.role == "publisher":
        return _publisher(src, args.url, args.steps, args.threads, work, args.entropy)
    if args.role == "worker":
        return _worker(src, args.url, args.steps, args.threads, work)
    return _anchor_codecs(src, args.steps)


# --- the driver -----------------------------------------------------------------------------


def _run_role(role: str, *, src: Path, url: str, steps: int, threads: int, work: Path,
              native: bool, entropy: bool = False) -> dict:
    env = dict(os.environ)
    if native:
        env.pop("DELTASTORE_NATIVE", None)
    else:
        env["DELTASTORE_NATIVE"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.perf", "--role", role, "--src", str(src), "--url", url,
           "--steps", str(steps), "--threads", str(threads), "--work", str(work)]
    if entropy:
        cmd.append("--entropy")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=ROLE_TIMEOUT_S,
                          cwd=Path(__file__).resolve().parent.parent, check=False)
    if proc.returncode:
        raise RuntimeError(f"perf role {role} (native={native}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quick_workload(dst: Path, *, layers: int = QUICK_LAYERS, d: int = QUICK_D, steps: int = QUICK_STEPS) -> Path:
    """A small Llama-shaped bf16 model (embedding, q/k/v/o, SwiGLU, RMSNorms, LM head) with
    real AdamW steps at lr 1e-6 on random gradients, written as ``step_XXXX.safetensors``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    vocab, ff = 4 * d, 3 * d
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d // 2, d),
                   p + "self_attn.v_proj.weight": (d // 2, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                   p + "mlp.down_proj.weight": (d, ff)}
    params = {k: torch.nn.Parameter(torch.ones(s) if k.endswith("norm.weight") else torch.randn(*s, generator=g) * 0.02)
              for k, s in shapes.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=0.0)
    dst.mkdir(parents=True, exist_ok=True)
    for step in range(steps + 1):
        if step:
            for k, p in params.items():
                p.grad = None if k.endswith("norm.weight") else torch.randn(p.shape, generator=g)
            opt.step()
        save_file({k: p.detach().bfloat16().contiguous() for k, p in params.items()}, str(_step_file(dst, step)))
    return dst


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _paired(times: list[float], copies: list[float] | None) -> float | None:
    """The median over calls of each call's time over the copy timed next to it."""
    if not copies or len(copies) != len(times):
        return None  # a result written before the paired copies were timed
    return statistics.median(t / c for t, c in zip(times, copies))


def summarize(mode: dict, copy: dict, clock: str = "wall") -> dict:
    """One mode's ratios from its roles' results and the memory copy's, in wall or CPU time."""
    pub, wk, anc = mode["publisher"], mode["worker"], mode["anchor"]
    if clock == "cpu":
        pub, wk, copy = ({**d, **d["cpu"]} for d in (pub, wk, copy))
    pc = wc = copy["copy_s"]
    h0 = pub.get("h0_bytes") or []
    return {
        "publish_over_copy": pub["delta_median_s"] / pc,
        "publish_over_copy_paired": _paired(pub["delta_s"], pub.get("copy_paired_s")),
        "publish_over_pulse": pub["delta_median_s"] / pub["pulse_encode_median_s"],
        "pulse_encode_over_copy": pub["pulse_encode_median_s"] / pc,
        "first_anchor_over_copy": pub["first_anchor_s"] / pc,
        "anchor_publish_over_copy": pub["anchor_s"] / pc,
        "anchor_over_delta_publish": pub["anchor_s"] / pub["delta_median_s"],
        "pull_into_over_copy": wk["pull_into_median_s"] / wc,
        "pull_into_over_copy_paired": _paired(wk["pull_into_s"], wk.get("copy_paired_s")),
        "pull_into_over_pulse": wk["pull_into_median_s"] / wk["pulse_apply_median_s"],
        "pulse_apply_over_copy": wk["pulse_apply_median_s"] / wc,
        "pull_into_anchor_over_copy": wk["pull_into_anchor_s"] / wc,
        "first_pull_over_copy": wk["first_pull_s"] / wc,
        "pull_chain_over_copy": wk["pull_chain_s"] / wc,
        "publisher_peak_over_model": pub["peak_over_model"],
        "worker_peak_over_model": wk["peak_over_model"],
        "delta_over_h0": (statistics.median(b / h for b, h in zip(pub["delta_bytes"], h0) if h)
                          if h0 else None),
        "exact": wk["exact"],
        **_anchor_ratios(anc, "encode_s" if clock == "wall" else "encode_cpu_s"),
    }


def _anchor_digest(anc: dict) -> str | None:
    """XXH3-128 of the deltastore anchor blob (None where the role did not record one)."""
    return anc.get("deltastore-anchor", {}).get("xxh3")


def _anchor_ratios(anc: dict, key: str) -> dict:
    z, a = anc.get("zipnn", {}), anc.get("deltastore-anchor", {})
    if key not in z or key not in a:
        return {}
    return {"anchor_encode_time_over_zipnn": a[key] / z[key], "anchor_size_over_zipnn": a["bytes"] / z["bytes"]}


# The timed calls a round adds to each role's lists, pooled over rounds (``run(rounds=)``).
_POOLED = {"publisher": ("delta_s", "copy_paired_s", "pulse_encode_s"),
           "worker": ("pull_into_s", "copy_paired_s", "pulse_apply_s")}


def _pool_rounds(first: dict, more: list[dict], role: str) -> dict:
    """``first`` (a role's result) with the timed calls of ``more`` rounds of the same role
    appended, in wall and CPU time, the medians taken again over all of them; peaks are the
    highest of any round, bit-exactness that of every round, and the publisher says whether
    every round stored the same delta bytes (``same_bytes_across_rounds``: the encoder is
    deterministic). The other figures (anchors, whole-version pulls) are the first round's.
    Each round's own paired median is kept in ``rounds_paired`` (the spread between rounds is
    the machine's drift)."""
    calls = "delta_s" if role == "publisher" else "pull_into_s"
    out = {**first, "cpu": dict(first["cpu"]),
           "rounds_paired": [_paired(r[calls], r.get("copy_paired_s")) for r in (first, *more)]}
    for key in _POOLED[role]:
        for d, src in ((out, first), (out["cpu"], first["cpu"])):
            d[key] = list(src[key])
        for r in more:
            out[key] += r[key]
            out["cpu"][key] += r["cpu"][key]
        median_key = key[:-2] + "_median_s"
        for d in (out, out["cpu"]):
            if median_key in d:
                d[median_key] = statistics.median(d[key])
    out["peak_over_model"] = max(r["peak_over_model"] for r in (first, *more))
    if role == "worker":
        out["exact"] = all(r["exact"] for r in (first, *more))
    else:
        out["same_bytes_across_rounds"] = all(r["delta_bytes"] == first["delta_bytes"] for r in more)
    return out


def run(*, workload: str = DEFAULT_WORKLOAD, steps: int | None = None, threads: int | None = None,
        quick: bool = False, out: Path | None = None, modes: tuple[str, ...] = ("numpy", "native"),
        rounds: int = 1, rounds_modes: tuple[str, ...] | None = None) -> dict:
    """Run every role in every mode; write ``out`` (.json and .md); return the results.

    ``rounds``: the publisher and the worker run this many times per mode (fresh processes and
    stores), their timed calls pooled (:func:`_pool_rounds`): a round's few delta publishes and
    ``pull_into`` calls (one per delta step) make a noisy median on a machine whose speed drifts.
    ``rounds_modes``: the modes that run ``rounds`` rounds (default: all); the others run one."""
    if rounds < 1:
        raise ValueError("rounds must be ≥ 1")
    threads = threads or len(os.sched_getaffinity(0))
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="ds-perf-", dir=shm if shm.is_dir() else None) as tmp:
        tmp = Path(tmp)
        if quick:
            workload = "quick-synthetic"
            steps = steps or QUICK_STEPS
            src = quick_workload(tmp / "src", steps=steps)
        else:
            from benchmarks.workload import WORKLOADS, ensure_workload

            steps = steps or WORKLOADS[workload].steps
            src = ensure_workload(workload, steps)
        if steps < 2:
            raise ValueError("perf needs ≥ 2 steps: deltas for steps 1..N-1, a forced anchor at N")
        probe = _run_role("probe", src=src, url="", steps=steps, threads=threads, work=tmp, native=True)
        copy = _run_role("copy", src=src, url="", steps=steps, threads=threads, work=tmp, native=True)
        res: dict = {
            "workload": workload, "steps": steps, "threads": threads, "quick": quick,
            "store": f"local directory on {'tmpfs (/dev/shm)' if shm.is_dir() else 'the temp dir'}", "rounds": rounds,
            "rounds_modes": list(rounds_modes) if rounds_modes is not None else None,
            "machine": _machine(), "native_probe": probe, "copy": copy, "modes": {},
        }
        for i, mode in enumerate(modes):
            native = mode == "native"
            if native and not probe["native"]:
                res["modes"][mode] = {"unavailable": probe["why"]}
                continue
            url = str(tmp / f"store-{mode}")
            work = tmp / f"work-{mode}"
            work.mkdir()
            t0 = _now()
            kw = {"src": src, "url": url, "steps": steps, "threads": threads, "work": work, "native": native}
            pub = _run_role("publisher", entropy=i == 0, **kw)
            wk = _run_role("worker", **kw)
            if rounds > 1 and (rounds_modes is None or mode in rounds_modes):
                more_pub, more_wk = [], []
                for r in range(1, rounds):
                    shutil.rmtree(url, ignore_errors=True)
                    kw_r = {**kw, "work": tmp / f"work-{mode}-r{r}"}
                    kw_r["work"].mkdir()
                    more_pub.append(_run_role("publisher", **kw_r))
                    more_wk.append(_run_role("worker", **kw_r))
                pub, wk = _pool_rounds(pub, more_pub, "publisher"), _pool_rounds(wk, more_wk, "worker")
            anc = _run_role("anchor", **kw)
            m = {"publisher": pub, "worker": wk, "anchor": anc, "wall_s": float(_since(t0))}
            if i:  # sizes and H0 do not depend on the mode (identical bytes): measured once
                first = res["modes"][modes[0]]["publisher"]
                pub["h0_bytes"] = first.get("h0_bytes")
                m["same_bytes_as_" + modes[0]] = (pub["delta_bytes"] == first["delta_bytes"]
                                                  and _anchor_digest(anc) == _anchor_digest(res["modes"][modes[0]]["anchor"]))
            m["ratios"] = summarize(m, res["copy"])
            m["ratios_cpu"] = summarize(m, res["copy"], "cpu")
            res["modes"][mode] = m
            shutil.rmtree(url, ignore_errors=True)
    res["goals"] = GOALS
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))
    return res


def _machine() -> dict:
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    import numpy
    import torch

    return {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "load_avg_1m_at_start": load}


def _f(x, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return fmt.format(x)


ROWS = [
    # (label, ratio key, goal key or None)
    ("delta publish / copy", "publish_over_copy", "publish_over_copy"),
    ("delta publish / copy, paired", "publish_over_copy_paired", "publish_over_copy_paired"),
    ("delta publish / PULSE encode", "publish_over_pulse", None),
    ("PULSE encode / copy", "pulse_encode_over_copy", None),
    ("anchor publish (steady) / copy", "anchor_publish_over_copy", None),
    ("anchor publish / delta publish", "anchor_over_delta_publish", None),
    ("first publish (anchor) / copy", "first_anchor_over_copy", None),
    ("pull_into (delta) / copy", "pull_into_over_copy", "pull_into_over_copy"),
    ("pull_into (delta) / copy, paired", "pull_into_over_copy_paired", "pull_into_over_copy_paired"),
    ("pull_into / PULSE decode+apply", "pull_into_over_pulse", None),
    ("PULSE decode+apply / copy", "pulse_apply_over_copy", None),
    ("pull_into (anchor) / copy", "pull_into_anchor_over_copy", None),
    ("pull (first version) / copy", "first_pull_over_copy", None),
    ("pull (anchor + all deltas) / copy", "pull_chain_over_copy", None),
    ("anchor encode 1 thread / ZipNN (time)", "anchor_encode_time_over_zipnn", None),
    ("anchor size / ZipNN", "anchor_size_over_zipnn", None),
    ("publisher peak RSS / model", "publisher_peak_over_model", "publisher_peak_over_model"),
    ("worker peak RSS / model", "worker_peak_over_model", "worker_peak_over_model"),
    ("delta bytes / H0 (median)", "delta_over_h0", "delta_over_h0"),
    ("bit-exact", "exact", None),
]


def markdown(res: dict) -> str:
    """The results as a Markdown table: one row per figure, one column per mode, the goal."""
    modes = list(res["modes"])
    mach = res["machine"]
    lines = [f"# Performance: {res['workload']}, {res['steps']} steps, {res['threads']} threads",
             "", (f"Store: {res['store']}. Machine: {mach['cpus']} CPUs, {mach['platform']}, Python "
                  f"{mach['python']}, torch {mach['torch']}, numpy {mach['numpy']}; load average "
                  f"{_f(mach['load_avg_1m_at_start'])} at the start."), ""]
    m0 = next((m for m in res["modes"].values() if "publisher" in m), None)
    if m0:
        mb = m0["publisher"]["model_bytes"]
        lines.append(f"Model {mb / 1e6:.1f} MB bf16, {m0['publisher']['tensors']} tensors.")
        lines.append("")
    if res.get("rounds", 1) > 1:
        per = []
        for m, mm in res["modes"].items():
            if "publisher" in mm:
                per.append(f"{m}: publish {[_f(x) for x in mm['publisher'].get('rounds_paired', [])]}, "
                           f"pull_into {[_f(x) for x in mm['worker'].get('rounds_paired', [])]}")
        which = "per mode" if res.get("rounds_modes") is None else f"in {', '.join(res['rounds_modes'])}"
        lines.append(f"Rounds: {res['rounds']} (the publisher and the worker ran {res['rounds']} times {which}, "
                     "fresh processes and stores; the medians are over every round's calls). Each round's own "
                     "paired median (wall): " + "; ".join(per) + ".")
        lines.append("")
    lines.append("Ratios of wall time (what the goals are stated in) and of CPU time (every thread of the "
                 "role's process; steadier when other jobs share the cores). Sizes and memory are the same "
                 "in both.")
    lines.append("")
    lines.append("| figure | " + " | ".join(f"{m} (wall) | {m} (CPU)" for m in modes) + " | goal |")
    lines.append("|---" * (2 * len(modes) + 2) + "|")
    for label, key, goal in ROWS:
        cells = []
        for m in modes:
            for which in ("ratios", "ratios_cpu"):
                r = res["modes"][m].get(which)
                cells.append(_f(r.get(key)) if r else "n/a")
        g = f"≤ {GOALS[goal]}" if goal else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {g} |")
    lines.append("")
    lines.append("| absolute, ms (wall / CPU) | " + " | ".join(modes) + " |")
    lines.append("|---" * (len(modes) + 1) + "|")
    copy = res["copy"]
    lines.append("| memory copy (`copy_`, median) | " + " | ".join(
        f"{copy['copy_s'] * 1e3:.1f} / {copy['cpu']['copy_s'] * 1e3:.1f}" for _ in modes) + " |")
    for label, role, key in [("delta publish median", "publisher", "delta_median_s"),
                             ("PULSE encode median", "publisher", "pulse_encode_median_s"),
                             ("anchor publish", "publisher", "anchor_s"),
                             ("pull_into median", "worker", "pull_into_median_s"),
                             ("PULSE decode+apply median", "worker", "pulse_apply_median_s")]:
        cells = []
        for m in modes:
            d = res["modes"][m].get(role)
            cells.append(f"{d[key] * 1e3:.1f} / {d['cpu'][key] * 1e3:.1f}" if d else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for m in modes:
        mm = res["modes"][m]
        if "unavailable" in mm:
            lines.append(f"\n{m}: not run ({mm['unavailable']})")
            continue
        pub, anc = mm["publisher"], mm["anchor"]
        h0 = pub.get("h0_bytes") or []
        lines.append(f"\n{m}: delta bytes per version {pub['delta_bytes']}; H0 {[round(h) for h in h0]}; "
                     f"PULSE bytes {pub['pulse_bytes']}; anchor stored {pub['anchor_bytes']}; "
                     f"one-thread anchor encode: ZipNN {anc.get('zipnn')}, deltastore {anc.get('deltastore-anchor')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--steps", type=int, default=None, help="delta steps (default: the workload's)")
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--quick", action="store_true", help="a small synthetic model (smoke test)")
    parser.add_argument("--modes", nargs="+", default=["numpy", "native"], choices=["numpy", "native"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the publisher and the worker this many times per mode, pooling their calls")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (.json; .md next to it); default benchmarks/results/perf.json, "
                             "or perf-quick.json with --quick")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--entropy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        print(json.dumps(_role_main(args)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or RESULTS / ("perf-quick.json" if args.quick else "perf.json")
    res = run(workload=args.workload, steps=args.steps, threads=args.threads, quick=args.quick, out=out,
              modes=tuple(args.modes), rounds=args.rounds)
    print(markdown(res))
    print(f"written: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
