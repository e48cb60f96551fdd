"""The asynchronous pipeline end to end on a local SeaweedFS against its goals, in one run.

    python -m benchmarks.async_pipeline --workload rl-1e-6 [--workload tf265m-rl-1e-6]
        [--workers 1,4,8] [--versions 4] [--burst 3] [--json OUT]

For each workload (real fine-tuning checkpoints from :mod:`benchmarks.workload`) it starts
SeaweedFS (:func:`testkit.servers.seaweedfs`) and measures, side by side:

1. **Baselines** (one process, nothing else running): a synchronous *full-checkpoint upload*
   (the bf16 model serialized with safetensors and PUT as one object with boto3, the way a
   trainer without deltastore ships weights) and a synchronous ``Publisher.publish`` delta of
   the same versions.
2. **Trainer** (its own process): fp32 master weights (by default) updated in place from each
   checkpoint, ``Publisher(dtype=torch.bfloat16, async_policy="block", max_pending=1)``, and
   ``publish_async`` per version. It reports the time ``publish_async`` takes to return, the
   time until the version's Future resolves (committed, in the background), and its peak
   memory (VmHWM) above the RSS it had with only its own weights loaded, in units of the bf16
   model size: once *paced* (the next version only after every worker applied the last one)
   and once in a *burst* (versions back to back, so the bounded queue is full).
3. **Followers** (N processes): ``Subscriber.pull()`` once, then ``Subscriber.follow(target,
   pause=lock)`` into the same tensors; per version they report fetch, decode and pause
   (the critical section in which the target is written), and once a *full load* of the same
   model into the same target from a second full copy in memory, two ways:
   ``module.load_state_dict(state)`` on an ``nn.Module`` whose parameters are the target's
   tensors (the usual checkpoint), and a bare ``copy_`` of every tensor (the fastest a full
   load can be). The time from ``publish_async`` returning to all N workers having applied the
   version is taken from wall clocks on the same machine.
4. **Idle poll**: a follower with nothing new to fetch, its HTTP requests and body bytes
   counted with botocore event hooks on the wire.

Every follower's final tensors are checked bit for bit (SHA-256) against the trainer's last
published state. Results are printed as a table and, with ``--json``, written as one object.

Roles run as subprocesses of this module (``--role trainer|follower|baseline``); they talk to
the harness in JSON lines on stdout and take commands on stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.rss import reset_peak as _reset_peak
from benchmarks.rss import status_kb as _status_kb

logger = logging.getLogger(__name__)

#: Paced versions per run: enough for a median and a max, small enough for 2 cores and 8
#: followers of a 531 MB model in a few minutes.
DEFAULT_VERSIONS = 4
#: Back-to-back publishes that fill the bounded queue, to show the memory bound.
DEFAULT_BURST = 3
#: Follower poll interval: short, so that the latency measured is the pipeline's, not the
#: poll timer's (a real fleet polls every few seconds; add half the interval on average).
DEFAULT_INTERVAL_S = 0.2
#: Repetitions of the full-checkpoint upload (median taken).
BASELINE_REPS = 3
#: Repetitions of the snapshot probe: tens of milliseconds each, so more of them, to see past
#: another job's burst on a shared machine.
PROBE_REPS = 5
#: Repetitions of a follower's full load (median taken): it takes milliseconds, and one
#: repetition that meets another engineer's job on a shared machine would set the ratio.
FULL_LOAD_REPS = 7
#: How long the idle follower is watched for the idle-poll count.
IDLE_WATCH_S = 3.0
#: Give up on a run when a role says nothing for this long (a 531 MB model on 2 busy cores).
EVENT_TIMEOUT_S = 600.0
#: Snapshots allowed to wait behind the one being published (bounded memory).
MAX_PENDING = 1
#: Burst edits: every this-many-th element of each tensor is scaled by BURST_SCALE, about 2%
#: of the elements, as many as an RL step changes in bf16.
BURST_STRIDE = 50
BURST_SCALE = 1.01
#: The goals: publish_async returns within 5% of a full-checkpoint upload; a worker's
#: pause is within 10% of a full load of the same model into the same target.
RETURN_GOAL = 0.05
PAUSE_GOAL = 0.10


# --- small helpers shared by the roles ----------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout for the harness (roles only; stdout is their channel)."""
    with _EMIT_LOCK:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


_EMIT_LOCK = threading.Lock()


def _digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bits, in name order (bit-exactness check)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _nbytes(state: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _storage_options_from_env() -> dict[str, Any]:
    """What the roles pass to deltastore: endpoint and credentials come from AWS_* variables."""
    return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}


def _boto3_client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                        config=Config(s3={"addressing_style": "path"}))


def _read_step_into(state: dict[str, Any], workload: str, step: int) -> None:
    """Copy checkpoint ``step`` into ``state`` in place, as an optimizer step would."""
    from safetensors import safe_open

    from benchmarks.workload import step_path, ensure_workload

    path = step_path(workload, step)
    if not path.exists():
        ensure_workload(workload)
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            state[k].copy_(f.get_tensor(k))


def _load_step(workload: str, step: int, dtype: Any = None) -> dict[str, Any]:
    from benchmarks.workload import load_step

    sd = load_step(workload, step)
    return sd if dtype is None else {k: v.to(dtype) for k, v in sd.items()}


# --- role: baseline -----------------------------------------------------------------------


def _role_baseline(args: argparse.Namespace) -> None:
    """Full-checkpoint uploads and synchronous publishes of the same versions."""
    from safetensors.torch import save

    from deltastore import Publisher

    state = _load_step(args.workload, 0)
    client = _boto3_client()
    bucket = args.url[len("s3://"):].split("/", 1)[0]
    serialize_s, put_s = [], []
    for rep in range(BASELINE_REPS):
        t0 = time.perf_counter()
        blob = save(state)
        t1 = time.perf_counter()
        client.put_object(Bucket=bucket, Key=f"full-checkpoints/{args.workload}/{rep}.safetensors", Body=blob)
        t2 = time.perf_counter()
        serialize_s.append(t1 - t0)
        put_s.append(t2 - t1)
        del blob
    sync_s, sync_bytes = [], []
    with Publisher(args.url, storage_options=_storage_options_from_env()) as pub:
        pub.publish(state, step=0)
        for step in range(1, args.versions + 1):
            _read_step_into(state, args.workload, step)
            t0 = time.perf_counter()
            info = pub.publish(state, step=step)
            sync_s.append(time.perf_counter() - t0)
            sync_bytes.append(info.bytes_stored)
    _emit("baseline", model_bytes=_nbytes(state), full_serialize_s=serialize_s, full_put_s=put_s,
          sync_publish_s=sync_s, sync_publish_bytes=sync_bytes)


# --- role: snapshot probe -----------------------------------------------------------------


def _role_probe(args: argparse.Namespace) -> None:
    """Where publish_async's return time goes: the host snapshot into fresh memory (what
    ``snapshot()`` does on every call) against a copy into buffers allocated once."""
    import torch

    from deltastore.write.queue import snapshot

    masters = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.masters]
    state = _load_step(args.workload, 0, masters)
    fresh, reused = [], []
    for _ in range(PROBE_REPS):
        t0 = time.perf_counter()
        snap = snapshot(state, torch.bfloat16)
        fresh.append(time.perf_counter() - t0)
        del snap  # freed, as the publisher frees each snapshot once it is committed
    buffers = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    for t in buffers.values():
        t.zero_()  # touch the pages once, as a pool reused across versions would have
    for _ in range(PROBE_REPS):
        t0 = time.perf_counter()
        for k, t in state.items():
            buffers[k].copy_(t)
        reused.append(time.perf_counter() - t0)
    _emit("probe", snapshot_fresh_s=fresh, copy_into_buffers_s=reused, masters=args.masters)


# --- role: trainer ------------------------------------------------------------------------


def _role_trainer(args: argparse.Namespace) -> None:
    """Publishes with publish_async on the harness's commands (stdin): publish / burst / stop."""
    import torch

    from deltastore import Publisher
    from deltastore.write.policy import AsyncPolicy

    masters = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.masters]
    state = _load_step(args.workload, 0, masters)
    model_bytes = sum(t.numel() * 2 for t in state.values())  # served in bf16
    rss_state_kb = _status_kb("VmRSS")
    pub = Publisher(args.url, storage_options=_storage_options_from_env(), dtype=torch.bfloat16,
                    async_policy=AsyncPolicy("block", max_pending=MAX_PENDING))

    def on_done(step: int) -> Any:
        def done(fut: Any) -> None:
            t = time.time()
            if fut.exception() is not None:
                _emit("failed", step=step, error=f"{type(fut.exception()).__name__}: {fut.exception()}")
            else:
                _emit("committed", step=step, version=fut.result().version, t=t,
                      bytes_stored=fut.result().bytes_stored)
        return done

    def publish(step: int) -> None:
        t_call = time.time()
        fut = pub.publish_async(state, step=step)
        t_return = time.time()
        fut.add_done_callback(on_done(step))
        _emit("returned", step=step, t_call=t_call, t_return=t_return)

    publish(0)  # the first version: an anchor
    pub.flush()
    _emit("ready", model_bytes=model_bytes, rss_state_kb=rss_state_kb, hwm_anchor_kb=_status_kb("VmHWM"))
    phase_hwm: dict[str, int] = {}
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "publish":
            step = int(rest[0])
            _read_step_into(state, args.workload, step)
            _reset_peak()  # reading the checkpoint file is the benchmark's, not the publisher's
            publish(step)
            pub.flush()
            phase_hwm["paced"] = max(phase_hwm.get("paced", 0), _status_kb("VmHWM"))
        elif cmd == "burst":
            n, first = int(rest[0]), int(rest[1])
            _reset_peak()
            for i in range(n):
                with torch.no_grad():
                    for t in state.values():  # an in-place "optimizer step": no file read
                        t.view(-1)[i % BURST_STRIDE :: BURST_STRIDE].mul_(BURST_SCALE)
                publish(first + i)
            pub.flush()
            phase_hwm["burst"] = _status_kb("VmHWM")
            served = {k: v.to(torch.bfloat16) for k, v in state.items()}
            _emit("final", digest=_digest(served))
            del served
        elif cmd == "stop":
            break
    pub.close()
    _emit("stopped", hwm_kb=phase_hwm, rss_state_kb=rss_state_kb, model_bytes=model_bytes)


# --- role: follower -----------------------------------------------------------------------


def _module_over(tensors: Mapping[str, Any]) -> Any:
    """An ``nn.Module`` whose parameters *are* ``tensors`` (same storage), nested by the dots
    in their names, so that ``load_state_dict`` writes the same target the follower writes."""
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _role_follower(args: argparse.Namespace) -> None:
    """Pulls once, times a full load, then follows until "stop" on stdin."""
    import torch

    from deltastore import HeartbeatPolicy, PollPolicy, Subscriber

    rss_start_kb = _status_kb("VmRSS")  # the interpreter and torch, before any weights
    sub = Subscriber(args.url, storage_options=_storage_options_from_env())
    t0 = time.perf_counter()
    target = sub.pull()
    full_pull_s = time.perf_counter() - t0
    second = {k: v.clone() for k, v in target.items()}  # a full state dict already in memory
    module = _module_over(target)
    copies, loads = [], []
    for _ in range(FULL_LOAD_REPS):
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, t in target.items():
                t.copy_(second[k])
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        module.load_state_dict(second, strict=True)
        loads.append(time.perf_counter() - t0)
    del second, module
    _emit("ready", worker=args.worker_id, version=sub.version, full_pull_s=full_pull_s,
          full_copy_s=statistics.median(copies), full_load_state_dict_s=statistics.median(loads),
          model_bytes=_nbytes(target))
    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    engine = threading.Lock()  # what an inference engine would hold while generating
    for rec in sub.follow(target, poll=PollPolicy(args.interval), pause=engine, stop=stop,
                          heartbeat=HeartbeatPolicy(args.worker_id), swap_mode=args.swap_mode):
        _emit("applied", worker=args.worker_id, version=rec.info.version, t=time.time(),
              from_version=rec.from_version, bytes_fetched=rec.bytes_fetched, fetch_s=rec.fetch_s,
              decode_s=rec.decode_s, pause_s=rec.pause_s, full_load=rec.full_load)
    _emit("stopped", worker=args.worker_id, version=sub.version, digest=_digest(target),
          hwm_kb=_status_kb("VmHWM"), rss_start_kb=rss_start_kb)
    sub.close()


# --- harness --------------------------------------------------------------------------------


class _Role:
    """A role subprocess: commands on stdin, JSON events on stdout, stderr to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], events: queue.Queue, logdir: Path):
        self.name = name
        self.log = logdir / f"{name}.log"
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.async_pipeline", *argv], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log_file, text=True, bufsize=1,
        )
        self._events = events
        self.stopping = False  # set once told to stop: its exit is then expected
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._events.put((self.name, json.loads(line)))
        self._events.put((self.name, {"event": "exit"}))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.stopping = self.stopping or line == "stop"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


class _Events:
    """All roles' events in arrival order; ``wait`` until a predicate holds, keeping the rest."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.seen: list[tuple[str, dict]] = []
        self.roles: dict[str, _Role] = {}

    def wait(self, what: str, pred: Any, timeout: float = EVENT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out waiting for {what}")
            try:
                name, ev = self.queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            role = self.roles.get(name)
            if ev["event"] == "failed" or (ev["event"] == "exit" and role is not None and not role.stopping):
                tail = role.log.read_text(errors="replace")[-3000:] if role else ""
                raise RuntimeError(f"{name}: {ev} while waiting for {what}\n--- {name}'s log ---\n{tail}")
            self.seen.append((name, ev))

    def of(self, event: str, name: str | None = None) -> list[dict]:
        return [ev for n, ev in self.seen if ev["event"] == event and (name is None or n == name)]


def _role_env(server: Any) -> dict[str, str]:
    """The roles' environment: the store's endpoint and credentials in AWS_* variables (never
    on the command line, which every user of the machine can read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=server.endpoint_url, AWS_ACCESS_KEY_ID=server.access_key,
               AWS_SECRET_ACCESS_KEY=server.secret_key, AWS_DEFAULT_REGION=server.region,
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
    return env


def _run_baseline(server: Any, workload: str, versions: int, logdir: Path) -> dict:
    events = _Events()
    role = _Role("baseline", ["--role", "baseline", "--workload", workload, "--versions", str(versions),
                              "--url", f"s3://{server.bucket}/sync-{workload}"],
                 _role_env(server), events.queue, logdir)
    events.roles["baseline"] = role
    role.stopping = True  # it exits on its own after reporting
    try:
        events.wait("the baselines", lambda: events.of("baseline"))
    finally:
        role.close()
    return events.of("baseline")[0]


def _run_probe(server: Any, workload: str, masters: str, logdir: Path) -> dict:
    events = _Events()
    role = _Role("probe", ["--role", "probe", "--workload", workload, "--masters", masters],
                 _role_env(server), events.queue, logdir)
    role.stopping = True
    events.roles["probe"] = role
    try:
        events.wait("the snapshot probe", lambda: events.of("probe"))
    finally:
        role.close()
    return events.of("probe")[0]


def _run_pipeline(server: Any, workload: str, n_workers: int, args: argparse.Namespace, logdir: Path) -> dict:
    """One trainer and ``n_workers`` followers on a fresh prefix; returns the raw events digested."""
    url = f"s3://{server.bucket}/async-{workload}-n{n_workers}-{int(time.time())}"
    env = _role_env(server)
    events = _Events()
    roles = events.roles
    try:
        roles["trainer"] = _Role("trainer", ["--role", "trainer", "--workload", workload, "--url", url,
                                             "--masters", args.masters], env, events.queue, logdir)
        events.wait("the trainer's first version", lambda: events.of("ready", "trainer"))
        workers = [f"w{i}" for i in range(n_workers)]
        for w in workers:  # one at a time: N full first loads at once would only measure memory
            roles[w] = _Role(w, ["--role", "follower", "--url", url, "--worker-id", w,
                                 "--interval", str(args.interval), "--swap-mode", args.swap_mode],
                             env, events.queue, logdir)
            events.wait(f"{w}'s first pull", lambda w=w: events.of("ready", w))

        def applied(w: str, step_version: int) -> bool:
            return any(ev["version"] >= step_version for ev in events.of("applied", w))

        versions: dict[int, int] = {}  # step -> version
        for step in range(1, args.versions + 1):
            roles["trainer"].send(f"publish {step}")
            events.wait(f"step {step} committed", lambda s=step: any(e["step"] == s for e in events.of("committed", "trainer")))
            v = next(e["version"] for e in events.of("committed", "trainer") if e["step"] == step)
            versions[step] = v
            events.wait(f"version {v} applied by every worker", lambda v=v: all(applied(w, v) for w in workers))
        first_burst = args.versions + 1
        roles["trainer"].send(f"burst {args.burst} {first_burst}")
        events.wait("the burst", lambda: events.of("final", "trainer"))
        last = max(e["version"] for e in events.of("committed", "trainer"))
        events.wait(f"version {last} applied by every worker", lambda: all(applied(w, last) for w in workers))
        for w in workers:
            roles[w].send("stop")
        roles["trainer"].send("stop")
        events.wait("every role stopped", lambda: all(events.of("stopped", n) for n in roles))
    finally:
        for role in roles.values():
            role.close()
    return _digest_run(events, workload, n_workers, versions, workers, last)


def _digest_run(events: _Events, workload: str, n: int, versions: dict[int, int], workers: list[str], last: int) -> dict:
    """Turn one run's events into the figures the goals are stated in."""
    returned = {e["step"]: e for e in events.of("returned", "trainer")}
    committed = {e["step"]: e for e in events.of("committed", "trainer")}
    paced = sorted(versions)
    ret_s = [returned[s]["t_return"] - returned[s]["t_call"] for s in paced]
    commit_s = [committed[s]["t"] - returned[s]["t_return"] for s in paced]
    burst = sorted(s for s in returned if s > max(paced))
    burst_ret_s = [returned[s]["t_return"] - returned[s]["t_call"] for s in burst]
    all_applied_s, first_applied_s = [], []
    records = []
    for s in paced:
        v = versions[s]
        times = []
        for w in workers:
            ev = next(e for e in events.of("applied", w) if e["version"] == v)
            times.append(ev["t"] - returned[s]["t_return"])
            records.append(ev)
        all_applied_s.append(max(times))
        first_applied_s.append(min(times))
    ready = {w: events.of("ready", w)[0] for w in workers}
    stopped = {w: events.of("stopped", w)[0] for w in workers}
    trainer_ready = events.of("ready", "trainer")[0]
    trainer_stop = events.of("stopped", "trainer")[0]
    final = events.of("final", "trainer")[0]["digest"]
    model = trainer_stop["model_bytes"]
    base_kb = trainer_stop["rss_state_kb"]
    full_copy = statistics.median(r["full_copy_s"] for r in ready.values())
    full_lsd = statistics.median(r["full_load_state_dict_s"] for r in ready.values())
    pauses = [r["pause_s"] for r in records]
    return {
        "workload": workload, "workers": n, "model_bytes": model, "versions": [versions[s] for s in paced],
        "publish_async_return_s": ret_s, "commit_after_return_s": commit_s,
        "burst_return_s": burst_ret_s,
        "trainer_peak_over_model": {k: (v - base_kb) * 1024 / model for k, v in trainer_stop["hwm_kb"].items()},
        "trainer_anchor_peak_over_model": (trainer_ready["hwm_anchor_kb"] - base_kb) * 1024 / model,
        "all_applied_s": all_applied_s, "first_applied_s": first_applied_s,
        "fetch_s": [r["fetch_s"] for r in records], "decode_s": [r["decode_s"] for r in records],
        "pause_s": pauses, "bytes_fetched": [r["bytes_fetched"] for r in records],
        "full_copy_s": full_copy, "full_load_state_dict_s": full_lsd, "full_pull_s": statistics.median(r["full_pull_s"] for r in ready.values()),
        "follower_peak_over_model": max(s["hwm_kb"] - s["rss_start_kb"] for s in stopped.values()) * 1024 / model,
        "exact": all(s["digest"] == final and s["version"] == last for s in stopped.values()),
    }


# --- idle poll ----------------------------------------------------------------------------


def _idle_poll(server: Any, url: str, interval: float) -> dict:
    """Follow an up-to-date store for IDLE_WATCH_S and count what goes over the wire."""
    from deltastore import PollPolicy, Subscriber
    from deltastore.storage import open_store

    store = open_store(url, storage_options=server.storage_options())
    wire: list[dict] = []
    counting = threading.Event()

    def before_send(request: Any, **_: Any) -> None:
        if counting.is_set():
            body = request.body
            size = len(body) if isinstance(body, (bytes, bytearray)) else (0 if body is None else -1)
            wire.append({"method": request.method, "path": request.url.split("?")[0].rsplit("/", 1)[-1],
                         "request_body": size})

    def after_call(http_response: Any, model: Any, **_: Any) -> None:
        if counting.is_set() and wire:
            wire[-1]["op"] = model.name
            wire[-1]["status"] = http_response.status_code
            wire[-1]["response_body"] = int(http_response.headers.get("content-length") or 0)

    events = store._client.meta.events  # the S3 backend's boto3 client: counted on the wire
    events.register("before-send.s3", before_send)
    events.register("after-call.s3", after_call)
    stop = threading.Event()
    first = threading.Event()
    sub = Subscriber(url, store=store)
    target = sub.pull()

    def run() -> None:
        for _ in sub.follow(target, poll=PollPolicy(interval), stop=stop, heartbeat=None):
            first.set()

    # The subscriber holds the head version: every poll from here on finds nothing new.
    thread = threading.Thread(target=run, daemon=True)
    time.sleep(interval)
    counting.set()
    thread.start()
    time.sleep(IDLE_WATCH_S)
    counting.clear()
    stop.set()
    thread.join(timeout=30)
    sub.close()
    store.close()
    heads = [w for w in wire if w["path"] == "HEAD" and w.get("op") == "GetObject"]
    return {
        "watched_s": IDLE_WATCH_S, "interval_s": interval, "polls": len(heads), "requests": len(wire),
        "requests_per_poll": len(wire) / max(1, len(heads)),
        "request_body_bytes": sum(max(0, w["request_body"]) for w in wire),
        "response_body_bytes": sum(w.get("response_body", 0) for w in wire),
        "statuses": sorted({w.get("status", 0) for w in wire}),
        "versions_applied_while_idle": int(first.is_set()),
    }


# --- report -------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summary(result: dict) -> str:
    la0, la1 = result.get("loadavg_start"), result.get("loadavg_end")
    lines = [f"machine: {result['machine']}",
             f"load average (1/5/15 min) at start {la0}, at end {la1}", ""]
    for wl, w in result["workloads"].items():
        b = w["baseline"]
        model = b["model_bytes"]
        put = _med(b["full_put_s"])
        full = _med([s + p for s, p in zip(b["full_serialize_s"], b["full_put_s"])])
        sync = _med(b["sync_publish_s"])
        lines.append(f"## {wl}: model {model / 1e6:.1f} MB bf16")
        lines.append(f"full-checkpoint upload: serialize+PUT {full:.3f} s (PUT alone {put:.3f} s); "
                     f"synchronous publish() delta median {sync:.3f} s "
                     f"({_med(b['sync_publish_bytes']) / 1e6:.2f} MB stored)")
        lines.append("| workers | publish_async return (median / max) | / full upload | / PUT alone | / sync publish | "
                     "committed after return | trainer peak paced / burst (× model) | burst return (max) |")
        lines.append("|---:|---|---:|---:|---:|---:|---|---:|")
        for r in w["runs"]:
            ret = _med(r["publish_async_return_s"])
            pk = r["trainer_peak_over_model"]
            lines.append(
                f"| {r['workers']} | {ret * 1e3:.1f} / {max(r['publish_async_return_s']) * 1e3:.1f} ms "
                f"| {100 * ret / full:.2f}% | {100 * ret / put:.2f}% | {100 * ret / sync:.2f}% "
                f"| {_med(r['commit_after_return_s']):.3f} s "
                f"| {pk.get('paced', float('nan')):.2f} / {pk.get('burst', float('nan')):.2f} "
                f"| {max(r['burst_return_s'] or [0]):.3f} s |")
        pooled = [x for r in w["runs"] for x in r["publish_async_return_s"]]
        lines.append(f"publish_async return, paced versions of every run pooled (the followers are idle while "
                     f"it runs): median {_med(pooled) * 1e3:.1f} ms (min {min(pooled) * 1e3:.1f}, max "
                     f"{max(pooled) * 1e3:.1f}) = {100 * _med(pooled) / full:.2f}% of the full-checkpoint upload, "
                     f"{100 * _med(pooled) / put:.2f}% of the PUT alone")
        pr = w.get("probe")
        if pr:
            lines.append(f"snapshot probe ({pr['masters']} → bf16): snapshot() into fresh memory "
                         f"{', '.join(f'{x * 1e3:.0f}' for x in pr['snapshot_fresh_s'])} ms; copy into buffers "
                         f"allocated once {', '.join(f'{x * 1e3:.0f}' for x in pr['copy_into_buffers_s'])} ms")
        lines.append("")
        lines.append("| workers | fetch (median) | decode (median) | pause (median / max) | full load_state_dict "
                     "/ copy_ | pause / load_state_dict | pause / copy_ | to first worker (median) | "
                     "to all workers (median / max) | bytes fetched/version | follower peak (× model) | bit-exact |")
        lines.append("|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---|")
        for r in w["runs"]:
            pause = _med(r["pause_s"])
            lines.append(
                f"| {r['workers']} | {_med(r['fetch_s']) * 1e3:.1f} ms | {_med(r['decode_s']) * 1e3:.1f} ms "
                f"| {pause * 1e3:.2f} / {max(r['pause_s']) * 1e3:.2f} ms "
                f"| {r['full_load_state_dict_s'] * 1e3:.1f} / {r['full_copy_s'] * 1e3:.1f} ms "
                f"| {100 * pause / r['full_load_state_dict_s']:.1f}% | {100 * pause / r['full_copy_s']:.1f}% "
                f"| {_med(r['first_applied_s']):.3f} s "
                f"| {_med(r['all_applied_s']):.3f} / {max(r['all_applied_s']):.3f} s "
                f"| {_med(r['bytes_fetched']) / 1e6:.2f} MB | {r['follower_peak_over_model']:.2f} "
                f"| {'yes' if r['exact'] else 'NO'} |")
        lines.append("")
    lines.append("goals (return: median of the pooled paced versions; pause: median, 1 worker, where no other "
                 "follower competes for the 2 cores):")
    for wl, w in result["workloads"].items():
        b = w["baseline"]
        full = _med([s + p for s, p in zip(b["full_serialize_s"], b["full_put_s"])])
        put = _med(b["full_put_s"])
        ret = _med([x for r in w["runs"] for x in r["publish_async_return_s"]])
        one = min(w["runs"], key=lambda r: r["workers"])
        pause = _med(one["pause_s"]) / one["full_load_state_dict_s"]
        pause_copy = _med(one["pause_s"]) / one["full_copy_s"]
        lines.append(f"  {wl}: publish_async return {100 * ret / full:.2f}% of the full-checkpoint upload "
                     f"({100 * ret / put:.2f}% of the PUT alone; goal ≤ {100 * RETURN_GOAL:.0f}%): "
                     f"{'met' if ret <= RETURN_GOAL * full else 'NOT met'}; pause {100 * pause:.1f}% of a full "
                     f"load_state_dict ({100 * pause_copy:.1f}% of a bare copy_; goal ≤ {100 * PAUSE_GOAL:.0f}%): "
                     f"{'met' if pause <= PAUSE_GOAL else 'NOT met'}")
    idle = result.get("idle_poll")
    if idle:
        ok = idle["requests_per_poll"] == 1 and idle["request_body_bytes"] == 0 and idle["response_body_bytes"] == 0
        lines.append(f"  idle poll one request, no body: {'met' if ok else 'NOT met'}")
    if idle:
        lines.append(f"idle poll: {idle['polls']} polls in {idle['watched_s']:.0f} s, {idle['requests']} requests "
                     f"({idle['requests_per_poll']:.2f} per poll), statuses {idle['statuses']}, "
                     f"request body {idle['request_body_bytes']} B, response body {idle['response_body_bytes']} B")
    return "\n".join(lines)


def _machine() -> str:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1])
    return (f"{len(os.sched_getaffinity(0))} cores ({cpu}), {mem / 1024 / 1024:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", help="default: rl-1e-6 (repeatable)")
    parser.add_argument("--workers", default="1,4,8", help="follower process counts (default 1,4,8)")
    parser.add_argument("--versions", type=int, default=DEFAULT_VERSIONS, help="paced versions per run")
    parser.add_argument("--burst", type=int, default=DEFAULT_BURST, help="back-to-back versions per run")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="follower poll interval (s)")
    parser.add_argument("--masters", choices=["fp32", "bf16"], default="fp32",
                        help="the trainer's weights (served as bf16 either way)")
    parser.add_argument("--swap-mode", choices=["inplace", "rebind"], default="inplace",
                        help="how followers swap a staged version in (Subscriber.follow's swap_mode)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--role", choices=["trainer", "follower", "baseline", "probe"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--worker-id", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.role:
        args.workload = (args.workload or ["rl-1e-6"])[0]
        roles = {"trainer": _role_trainer, "follower": _role_follower, "baseline": _role_baseline, "probe": _role_probe}
        roles[args.role](args)
        return 0

    from benchmarks.workload import WORKLOADS, ensure_workload
    from testkit.servers import seaweedfs

    workloads = args.workload or ["rl-1e-6"]
    for wl in workloads:
        if wl not in WORKLOADS:
            parser.error(f"unknown workload {wl!r}")
        steps = WORKLOADS[wl].steps
        if args.versions > steps:
            parser.error(f"{wl} has {steps} steps: --versions must be ≤ {steps}")
        ensure_workload(wl)
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    result: dict[str, Any] = {"machine": _machine(), "argv": sys.argv[1:], "workloads": {},
                              "loadavg_start": os.getloadavg()}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="async-bench-")))
        (tmp / "sw").mkdir()
        server = stack.enter_context(seaweedfs(tmp / "sw"))
        logdir = tmp / "logs"
        logdir.mkdir()
        try:
            for wl in workloads:
                t0 = time.perf_counter()
                entry: dict[str, Any] = {"baseline": _run_baseline(server, wl, args.versions, logdir),
                                         "probe": _run_probe(server, wl, args.masters, logdir), "runs": []}
                for n in counts:
                    entry["runs"].append(_run_pipeline(server, wl, n, args, logdir))
                    print(f"{wl}: {n} worker(s) done", file=sys.stderr)
                entry["wall_s"] = time.perf_counter() - t0
                result["workloads"][wl] = entry
                if "idle_poll" not in result:
                    result["idle_poll"] = _idle_poll(server, f"s3://{server.bucket}/sync-{wl}", args.interval)
        except Exception:
            for log in sorted(logdir.glob("*.log")):
                tail = log.read_text(errors="replace")[-2000:]
                if tail.strip():
                    print(f"--- {log.name} ---\n{tail}", file=sys.stderr)
            raise
    result["loadavg_end"] = os.getloadavg()
    print(_summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
