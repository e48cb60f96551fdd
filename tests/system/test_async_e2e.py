"""End to end: a trainer publishing with ``publish_async`` and two ``deltastore pull --follow``
worker processes (one with a local cache, one without) on a real SeaweedFS; every worker
bit-exact at every version.

The trainer is a thread of the test (fp32-master TinyTrainer exporting bf16 plus tensors of
every other dtype); right after each ``publish_async`` returns it scribbles over the tensors it
passed, so a version that is not the state *at the call* shows up as a mismatch. Workers are
real CLI processes that reach the store through its endpoint with credentials from AWS_*
variables, as a deployed worker would.

Each worker's OUT file is read whole through one open file (the CLI replaces it atomically, so
one open sees one version) and compared bit for bit with the trainer's state of the version
named in the file's metadata, continuously while the trainer publishes; paced versions are
also checked once every worker has reported them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from deltastore import Publisher
from deltastore.write.policy import AsyncPolicy, LayoutPolicy
from testkit.tensors import TinyTrainer, bits_differ, snapshot

pytestmark = pytest.mark.integration

#: Worker processes: the last one follows with a local cache, the others without.
WORKERS = 2
#: Versions published one at a time (each checked in every worker before the next).
PACED_VERSIONS = 5
#: Versions published back to back: the bounded queue blocks, workers may skip some.
BURST_VERSIONS = 4
#: Short poll interval: the test waits for each version in every worker.
POLL_INTERVAL_S = 0.1
#: Longest wait for one version to reach every worker (process start-up on busy 2-core CI).
VERSION_TIMEOUT_S = 30.0
#: Small chunks so that the tiny model spans several chunks per tensor (sparse and dense paths).
CHUNK_BYTES = 4096


def _scribble(state: Mapping[str, torch.Tensor]) -> None:
    """Overwrite every tensor in place, as an optimizer step right after the call would."""
    with torch.no_grad():
        for t in state.values():
            if t.numel():
                flat = t.view(-1)
                if t.dtype == torch.bool:
                    flat.logical_not_()
                else:
                    as_int = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                    as_int.bitwise_not_()


class _Worker:
    """One ``deltastore pull --follow --json`` process and the JSON objects it printed."""

    def __init__(self, name: str, url: str, out: Path, env: dict[str, str], endpoint: str, cache: Path | None):
        self.name, self.out = name, out
        cmd = [sys.executable, "-m", "deltastore", "pull", url, str(out), "--follow", "--json",
               "--interval", str(POLL_INTERVAL_S), "--worker-id", name, "--endpoint-url", endpoint]
        if cache is not None:
            cmd += ["--cache", str(cache)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.records: list[dict] = []
        self.other_lines: list[str] = []
        self.stderr: list[str] = []
        self._new = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                self.other_lines.append(line)
                continue
            self.records.append(rec)
            self._new.put(rec)

    def reported(self) -> list[int]:
        return [r["version"] for r in self.records if "version" in r]

    def wait_for(self, version: int, timeout: float = VERSION_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while version not in self.reported():
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers drain
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} before version {version}: "
                                     f"{self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not report version {version} within {timeout:.0f} s: "
                                     f"{self.describe()}")
            try:
                self._new.get(timeout=0.2)
            except queue.Empty:
                pass

    def describe(self) -> str:
        return (f"reported {self.reported()}; other stdout {self.other_lines[-5:]}; "
                f"stderr tail {''.join(self.stderr)[-1500:]!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: the way a user stops a follower
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _read_out(path: Path) -> tuple[int | None, dict[str, torch.Tensor]] | None:
    """(version in the metadata, tensors) of OUT through one open file; None before it exists.

    The bytes are read whole through one file object and parsed from memory. Not
    ``safe_open(framework="pt")``: it reads the header through one open and then maps the
    data by *name* (``torch.UntypedStorage.from_file``), so a worker replacing OUT in between
    gave the next version's bits under this version's tag (a false "not the published state").
    """
    from safetensors.torch import load

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
    version = meta.get("deltastore_version")
    return (int(version) if version is not None else None), load(data)


class _OutChecker:
    """Reads every worker's OUT in a loop and checks each version seen against the trainer's."""

    def __init__(self, workers: list[_Worker], expected: dict[int, dict[str, torch.Tensor]], lock: threading.Lock):
        self.workers, self.expected, self.lock = workers, expected, lock
        self.seen: dict[str, set[int]] = {w.name: set() for w in workers}
        self.errors: list[str] = []
        self.pending: list[tuple[str, int, dict[str, torch.Tensor]]] = []
        self.untagged = 0  # files without a version in their metadata (checked by the paced phase only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def check_now(self, w: _Worker, version: int | None = None) -> None:
        got = _read_out(w.out)
        if got is None:
            if version is not None:
                self.errors.append(f"{w.name}: {w.out} missing at version {version}")
            return
        tagged, tensors = got
        if tagged is None:
            self.untagged += 1
            tagged = version
        if tagged is None:
            return
        if version is not None and tagged != version:
            self.errors.append(f"{w.name}: OUT holds version {tagged}, expected {version}")
            return
        with self.lock:
            want = self.expected.get(tagged)
        if want is None:
            # Workers see a version as soon as HEAD moves, before its Future resolves here.
            self.pending.append((w.name, tagged, tensors))
            return
        self._compare(w.name, tagged, want, tensors)

    def resolve_pending(self) -> None:
        """Check the versions seen before the trainer knew their numbers (call at the end)."""
        for name, tagged, tensors in self.pending:
            want = self.expected.get(tagged)
            if want is None:
                self.errors.append(f"{name}: OUT names version {tagged}, which the trainer never published")
            else:
                self._compare(name, tagged, want, tensors)
        self.pending.clear()

    def _compare(self, name: str, tagged: int, want: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        diff = bits_differ(want, tensors)
        if diff is not None:
            self.errors.append(f"{name}: version {tagged} in OUT is not the published state: {diff}")
        self.seen[name].add(tagged)

    def _run(self) -> None:
        while not self._stop.is_set():
            for w in self.workers:
                self.check_now(w)
            self._stop.wait(0.05)

    def __enter__(self) -> _OutChecker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_out_reader_gets_tag_and_bits_of_one_file_when_out_is_replaced_mid_read(tmp_path: Path, monkeypatch) -> None:
    """The checker's reader against a worker replacing OUT while it reads (the race that once
    reported "version 6 in OUT is not the published state" with every worker right): the tag
    and the tensors come from the same file, whichever it is."""
    from safetensors.torch import save_file

    out, nxt = tmp_path / "w.safetensors", tmp_path / "w.safetensors.partial"
    save_file({"w": torch.full((8,), 6, dtype=torch.int32)}, str(out), metadata={"deltastore_version": "6"})
    save_file({"w": torch.full((8,), 7, dtype=torch.int32)}, str(nxt), metadata={"deltastore_version": "7"})
    from_file = torch.UntypedStorage.from_file

    def replaced_meanwhile(*args, **kwargs):  # safe_open(framework="pt") maps the data by name here
        if nxt.exists():
            os.replace(nxt, out)  # the worker's next version lands now (as the CLI writes it)
        return from_file(*args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", replaced_meanwhile)
    got = _read_out(out)
    assert got is not None
    tag, tensors = got
    assert tag is not None and tensors["w"].tolist() == [tag] * 8, f"tag {tag}, bits of {tensors['w'].tolist()}"


@pytest.mark.slow
def test_publish_async_trainer_and_follow_workers_stay_bit_exact(seaweedfs_server, tmp_path: Path) -> None:
    server = seaweedfs_server
    url = f"s3://{server.bucket}/e2e-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key,
               AWS_DEFAULT_REGION=server.region, DELTASTORE_DEBUG="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    trainer = TinyTrainer(seed=7, d_in=48, d_hidden=160, d_out=24)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    lock = threading.Lock()
    t_start = time.monotonic()

    def publish(pub: Publisher, state: dict[str, torch.Tensor], step: int):
        at_call = snapshot(state)
        fut = pub.publish_async(state, step=step)
        _scribble(state)  # the caller owns its tensors again as soon as the call returns
        return fut, at_call

    with Publisher(url, storage_options=server.storage_options(), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES),
                   async_policy=AsyncPolicy("block", max_pending=1)) as pub:
        fut, at_call = publish(pub, trainer.export(), 0)
        first = fut.result(timeout=VERSION_TIMEOUT_S)
        expected[first.version] = at_call
        workers = [
            _Worker(f"w{i}", url, tmp_path / f"w{i}.safetensors", env, server.endpoint_url,
                    cache=tmp_path / f"cache-w{i}" if i == WORKERS - 1 else None)
            for i in range(WORKERS)
        ]
        checker = _OutChecker(workers, expected, lock)
        try:
            for w in workers:
                w.wait_for(first.version)
                checker.check_now(w, first.version)
            with checker:
                for step in range(1, PACED_VERSIONS + 1):
                    fut, at_call = publish(pub, trainer.step(), step)
                    info = fut.result(timeout=VERSION_TIMEOUT_S)
                    with lock:
                        expected[info.version] = at_call
                    for w in workers:
                        w.wait_for(info.version)
                        checker.check_now(w, info.version)
                burst = []
                for step in range(PACED_VERSIONS + 1, PACED_VERSIONS + 1 + BURST_VERSIONS):
                    fut, at_call = publish(pub, trainer.step(), step)
                    burst.append((fut, at_call))
                pub.flush()
                for fut, at_call in burst:
                    info = fut.result(timeout=0)
                    with lock:
                        expected[info.version] = at_call
                last = max(expected)
                for w in workers:
                    w.wait_for(last)
                    checker.check_now(w, last)
        finally:
            for w in workers:
                w.stop()
    checker.resolve_pending()
    assert not checker.errors, "\n".join(checker.errors[:10])
    assert last == 1 + PACED_VERSIONS + BURST_VERSIONS, f"versions committed: {sorted(expected)}"
    for w in workers:
        versions = w.reported()
        assert versions == sorted(set(versions)), f"{w.name} reported versions out of order or twice: {versions}"
        assert set(range(1, PACED_VERSIONS + 2)) <= set(versions), f"{w.name} missed a paced version: {versions}"
        assert set(versions) <= set(expected), f"{w.name} reported versions never published: {versions}"
        assert set(range(1, PACED_VERSIONS + 2)) <= checker.seen[w.name], f"{w.name} OUT checks: {checker.seen[w.name]}"
        for rec in w.records:
            for key in ("fetch_s", "decode_s", "pause_s"):
                assert isinstance(rec.get(key), (int, float)), f"{w.name}: {key} missing in {rec}"
        assert w.proc.returncode in (0, 130, -signal.SIGINT), f"{w.name} ended with {w.proc.returncode}: {w.describe()}"
    assert time.monotonic() - t_start < 90, "the end-to-end run took too long"
