"""The rollout sidecar: its loop against scripted engines, the TRL worker wrapper's contract,
and the whole path end to end on CPU: TRL's real ``AsyncGRPOTrainer`` publishes through
``DeltastoreWeightTransfer``, the sidecar follows the store and syncs a stand-in ``vllm serve``
(a real local HTTP server whose worker runs the deltastore extension), and the rollout worker
tags its samples with the version that engine serves."""

from __future__ import annotations

import inspect
import queue
import threading
from typing import Any

import numpy as np
import pytest
import torch

import deltastore.integrations.rollout as rollout_module
from deltastore.errors import EngineUpdateError, WaitTimeoutError
from deltastore.integrations.hostcopy import ServedVersion
from deltastore.integrations.rollout import RolloutSidecar, ServedVersionWorker, build_engine, main
from deltastore.integrations.vllm import VLLMServerSync
from testkit.trl import tiny_async_grpo

DEADLINE_S = 60.0


def _sv(version: int, model_version: int | None = None) -> ServedVersion:
    return ServedVersion(version, None, model_version, f"manifests/{version:012d}")


class ScriptedEngine:
    """An EngineSync whose syncs serve the versions in ``script`` in turn (or raise them)."""

    def __init__(self, name: str, script: list[Any]):
        self.name, self.script = name, list(script)
        self.served: ServedVersion | None = None
        self.started = self.closed = 0

    def start(self, wait_s=None):
        self.started += 1

    def sync(self):
        step = self.script.pop(0) if self.script else self.served
        if isinstance(step, BaseException):
            raise step
        self.served = step
        return step

    def close(self):
        self.closed += 1


def test_sidecar_reports_the_lowest_version_and_survives_failed_syncs() -> None:
    a = ScriptedEngine("a", [_sv(1, 1), EngineUpdateError("refused"), _sv(3, 3)])
    b = ScriptedEngine("b", [None, _sv(2, 2), _sv(3, 3)])
    sidecar = RolloutSidecar([a, b], interval=60)
    heard: list[ServedVersion] = []
    sidecar.add_listener(heard.append)
    assert sidecar.sync_once() is None and heard == []  # b serves nothing yet: nothing to report
    assert sidecar.sync_once() == _sv(1, 1) and "a" in sidecar.failures  # a failed, keeps version 1
    assert sidecar.sync_once() == _sv(3, 3) and sidecar.failures == {}
    assert sidecar.sync_once() == _sv(3, 3)
    assert heard == [_sv(1, 1), _sv(3, 3)]  # once per change
    assert sidecar.wait_for(3, policy_version=3, timeout=0) == _sv(3, 3)
    with pytest.raises(WaitTimeoutError):
        sidecar.wait_for(4, timeout=0)
    sidecar.stop()
    sidecar.stop()
    assert a.closed == b.closed == 1


def test_sidecar_thread_stops_on_an_unexpected_error() -> None:
    engine = ScriptedEngine("e", [_sv(1, 1), ValueError("a bug")])
    with RolloutSidecar([engine], interval=0.01) as sidecar:
        with pytest.raises(RuntimeError, match="a bug"):
            sidecar.wait_for(2, timeout=DEADLINE_S)
        with pytest.raises(RuntimeError, match="ValueError"):
            sidecar.check()
    assert engine.started == 1 and engine.closed == 1


class _Inner:
    """The worker being wrapped: records what it is told."""

    def __init__(self):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.told: list[int] = []
        self.health_checks = 0
        self.started = self.stopped = False

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True

    def update_model_version(self, model_version: int) -> None:
        self.told.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        self.health_checks += 1


def test_served_version_worker_passes_on_only_what_the_engines_serve() -> None:
    engine = ScriptedEngine("e", [None, _sv(4, 2), _sv(5, None)])
    sidecar = RolloutSidecar([engine], interval=60)
    inner = _Inner()
    w = ServedVersionWorker(inner, sidecar)
    assert w.rollout_buffer is inner.rollout_buffer and w.metrics_queue is inner.metrics_queue
    w.update_model_version(3)  # the trainer published its version 3: not the version served
    assert inner.told == [] and w.trainer_version == 3
    sidecar.sync_once()
    sidecar.sync_once()
    assert inner.told == [2]  # the served version's model_version
    assert inner.metrics_queue.get_nowait() == {"deltastore/serving_lag": 1.0}
    sidecar.sync_once()
    assert inner.told == [2, 5]  # no model_version in the metadata: its step, else its version
    w.check_health(10)
    assert inner.health_checks == 1
    sidecar.error = RuntimeError("follow died")
    with pytest.raises(RuntimeError, match="follow died"):
        w.check_health(10)


def test_served_version_worker_has_trls_rollout_worker_protocol(monkeypatch) -> None:
    pytest.importorskip("trl", minversion="1.16", reason="needs trl>=1.16 (pip install 'deltastore-weights[trl]')")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol

    methods = [n for n, v in vars(RolloutWorkerProtocol).items() if callable(v) and not n.startswith("_")]
    assert set(methods) == {"start", "stop", "update_model_version", "check_health"}
    for name in methods:
        theirs = list(inspect.signature(getattr(RolloutWorkerProtocol, name)).parameters)
        assert list(inspect.signature(getattr(ServedVersionWorker, name)).parameters) == theirs, name
    assert set(RolloutWorkerProtocol.__annotations__) == {"rollout_buffer", "metrics_queue"}


def test_command_line_builds_engines_and_refuses_bad_input(tmp_path) -> None:
    engine = build_engine("vllm", "http://127.0.0.1:9", "file:///tmp/x", interval=1.0, drain=True)
    assert isinstance(engine, VLLMServerSync) and engine.drain
    assert "pipeline_stage" not in engine._start_kwargs  # deltastore_start's default
    staged = build_engine("vllm", "http://127.0.0.1:9", "file:///tmp/x", interval=1.0, pipeline_stage=True)
    assert staged._start_kwargs["pipeline_stage"] is True
    with pytest.raises(ValueError, match="pipeline_stage is vLLM's"):
        build_engine("sglang", "http://127.0.0.1:9", "x", interval=1.0, work_dir=str(tmp_path), pipeline_stage=True)
    with pytest.raises(ValueError, match="unknown engine kind"):
        build_engine("tgi", "http://127.0.0.1:9", "x", interval=1.0)
    with pytest.raises(SystemExit):
        main(["--engine", "http://127.0.0.1:9", "--store", str(tmp_path), "--storage-option", "novalue"])


# --- end to end: TRL's trainer, the store, the sidecar, a stand-in vLLM server ---------------


class EngineWorker:
    """A rollout worker as TRL's ``AsyncRolloutWorker`` behaves: a thread that stamps each group
    with the model version it was last told, then generates it on the engine. Here generation
    asks the stand-in engine which version it serves (before and after the group), so the test
    can compare the stamp with the weights actually used."""

    def __init__(self, engine_worker: Any, vocab: int, group: int = 4):
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=2 * group)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0  # TRL's worker starts at 0: the launch weights, before the cold sync
        self.told: list[int] = []
        self.groups: list[tuple[int, int, int]] = []  # (stamp, served before, served after)
        self._engine, self._vocab, self._group = engine_worker, vocab, group
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _served(self) -> int:
        v = self._engine.deltastore_version()
        return 0 if v is None else v["model_version"]

    def _run(self) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        rng = np.random.default_rng(0)
        gid = 0
        try:
            while not self._stop.is_set():
                stamp, before = self.model_version, self._served()
                samples = [RolloutSample(
                    prompt=[{"role": "user", "content": "p"}], completion=[{"role": "assistant", "content": "c"}],
                    input_ids=rng.integers(5, self._vocab, size=10), completion_mask=np.array([0] * 4 + [1] * 6),
                    old_log_probs=np.full(10, -3.0, np.float32), advantage=adv, model_version=stamp, group_id=gid,
                    metrics={"reward": adv}) for adv in (-1.0, -0.5, 0.5, 1.0)[: self._group]]
                self.groups.append((stamp, before, self._served()))
                gid += 1
                for s in samples:
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(s, timeout=0.05)
                            break
                        except queue.Full:
                            continue
        except BaseException as e:  # noqa: BLE001 - reported by check_health
            self._error = e

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def update_model_version(self, model_version: int) -> None:
        self.told.append(model_version)
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout worker failed: {self._error!r}") from self._error


def test_trl_trainer_rollouts_carry_the_version_the_engine_serves(tmp_path, monkeypatch, vllm_server,
                                                                  vllm_parts) -> None:
    pytest.importorskip("trl", minversion="1.16", reason="needs trl>=1.16 (pip install 'deltastore-weights[trl]')")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from deltastore.integrations.trl import DeltastoreWeightTransfer

    url = str(tmp_path / "store")
    steps = 2
    trainer, ex = tiny_async_grpo(tmp_path, steps=steps, lr=1e-2, rollout_worker=_Inner(),
                                  weight_transfer=DeltastoreWeightTransfer(url), max_staleness=4)
    # The engine: a stand-in `vllm serve` whose one worker runs the extension on a model of the
    # served layout (what TRL sends: named_parameters, the tied lm_head absent), in bf16.
    shapes = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}
    engine_worker = vllm_parts.Worker(vllm_parts.RecordingModel(shapes))
    server = vllm_server([engine_worker])
    sidecar = RolloutSidecar([VLLMServerSync(server.url, url, interval=0.02, threads=1)], interval=0.05)
    worker = EngineWorker(engine_worker, vocab=len(ex.SPECIALS) + len(ex.WORDS))
    trainer.rollout_worker = ServedVersionWorker(worker, sidecar, own_sidecar=False)
    trainer.rollout_queue = worker.rollout_buffer
    sidecar.start()  # before the trainer's first version: the worker waits for one
    try:
        trainer.train()
        final = sidecar.wait_for(policy_version=trainer.model_version, timeout=DEADLINE_S)
    finally:
        sidecar.stop()
    assert trainer.model_version == steps + 1  # the cold sync, then one per step
    # The worker was told only versions the engine served, in order, ending at the trainer's.
    assert worker.told == sorted(set(worker.told)) and worker.told[-1] == final.model_version == steps + 1
    # Every group's stamp is a version the engine served when the group started or an older one:
    # TRL's staleness (trainer version - stamp) is never below the true one.
    assert worker.groups and all(stamp <= before <= after for stamp, before, after in worker.groups)
    assert {stamp for stamp, _, _ in worker.groups} <= {0, *worker.told}
    # The engine holds the trainer's final weights, bit for bit (served as bf16); its weight
    # version names the store version.
    for n, p in trainer.model.named_parameters():
        assert torch.equal(engine_worker.model_runner.model.params[n], p.detach().to(torch.bfloat16)), n
    assert server.weight_version == final.weight_version == str(final.version)


def test_command_line_passes_the_shared_host_copy(monkeypatch, tmp_path) -> None:
    seen = []

    def engine(*args, **kwargs):
        seen.append(kwargs["shared_host_copy"])
        raise RuntimeError("built")

    monkeypatch.setattr(rollout_module, "build_engine", engine)
    base = ["--engine", "http://127.0.0.1:9", "--store", str(tmp_path)]
    for extra in ([], ["--shared-host-copy"], ["--shared-host-copy", str(tmp_path / "copy")]):
        with pytest.raises(RuntimeError, match="built"):
            main(base + extra)
    assert seen == [False, True, str(tmp_path / "copy")]
    monkeypatch.undo()
    vllm = build_engine("vllm", "http://127.0.0.1:9", "file:///tmp/x", interval=1.0, shared_host_copy=True)
    assert vllm._start_kwargs["shared_host_copy"] is True
    assert "shared_host_copy" not in build_engine("vllm", "http://127.0.0.1:9", "x", interval=1.0)._start_kwargs
    sglang = build_engine("sglang", "http://127.0.0.1:9", str(tmp_path / "store"), interval=1.0,
                          work_dir=str(tmp_path / "work"), shared_host_copy=str(tmp_path / "copy"))
    try:
        assert str(sglang.host.shared.path) == str(tmp_path / "copy")
    finally:
        sglang.close()
    assert not (tmp_path / "copy").exists()
