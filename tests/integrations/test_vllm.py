"""The vLLM worker extension, against a stand-in worker whose model records what
``load_weights`` receives (vLLM cannot run here)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from deltastore import Publisher
from deltastore.integrations.vllm import DeltastoreWorkerExtension
from deltastore.write.policy import WriterPolicy

#: A test never waits longer than this for the follow thread.
DEADLINE_S = 60.0


class _RecordingModel:
    """Stands in for a vLLM model: load_weights copies what it is given into its own
    (device-side) parameters and records the names, the thread and when."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        self.calls: list[list[str]] = []
        self.threads: set[int] = set()

    def load_weights(self, weights):
        names = []
        for n, t in weights:
            self.params[n].copy_(t)
            names.append(n)
        self.calls.append(names)
        self.threads.add(threading.get_ident())
        return set(names)


class _Worker(DeltastoreWorkerExtension):
    """What vLLM's --worker-extension-cls makes: a worker class with the extension mixed in."""

    def __init__(self, model):
        self.model_runner = SimpleNamespace(model=model)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g)}


def _wait_staged(w: _Worker, version: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        st = w.deltastore_status()
        assert st["error"] is None, st["error"]
        if st["staged"] is not None and st["staged"]["version"] >= version:
            return
        assert time.monotonic() < deadline, f"version {version} was not staged: {st}"
        time.sleep(0.02)


def _assert_model(model: _RecordingModel, state: dict[str, torch.Tensor]) -> None:
    for n, t in state.items():
        assert torch.equal(model.params[n], t.to(torch.bfloat16)), n


def test_worker_follows_and_reloads_only_changed_tensors(tmp_path) -> None:
    url = str(tmp_path / "store")
    v1 = _state(0)
    model = _RecordingModel({n: tuple(t.shape) for n, t in v1.items()})
    w = _Worker(model)
    with pytest.raises(RuntimeError, match="deltastore_start"):
        w.deltastore_sync()
    with Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1, step=10, metadata={"model_version": 1})
        w.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        assert w.deltastore_start(url)["staged"]["version"] == 1  # idempotent
        with pytest.raises(ValueError):
            w.deltastore_start(url + "-other")
        assert w.deltastore_version() is None and model.calls == []  # nothing loaded before a sync
        served = w.deltastore_sync()
        assert served["version"] == 1 and served["model_version"] == 1 and served["step"] == 10
        assert sorted(model.calls[-1]) == sorted(v1)  # the first version: every tensor
        _assert_model(model, v1)
        assert w.deltastore_sync() == served and len(model.calls) == 1  # nothing new: no reload

        v2 = {n: t.clone() for n, t in v1.items()}
        v2["model.norm.weight"][3] = 5.0
        pub.publish(v2, step=11, metadata={"model_version": 2})
        _wait_staged(w, 2)
        # Staged on the host while the engine serves: the engine's model is untouched until the sync.
        assert w.deltastore_version()["version"] == 1 and len(model.calls) == 1
        _assert_model(model, v1)
        served = w.deltastore_sync()
        assert served["model_version"] == 2 and model.calls[-1] == ["model.norm.weight"]
        _assert_model(model, v2)

        # Two versions between syncs: one reload of the union of what they changed.
        v3 = {n: t.clone() for n, t in v2.items()}
        v3["model.layers.0.mlp.up_proj.weight"][0, 0] = -1.0
        pub.publish(v3, metadata={"model_version": 3})
        v4 = {n: t.clone() for n, t in v3.items()}
        v4["model.embed_tokens.weight"][7] = 0.25
        pub.publish(v4, metadata={"model_version": 4})
        _wait_staged(w, 4)
        served = w.deltastore_sync()
        assert served["version"] == 4 and served["model_version"] == 4
        assert sorted(model.calls[-1]) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
        _assert_model(model, v4)
    # load_weights ran only in the RPC's thread (vLLM runs it between engine steps), never in
    # the follow thread.
    assert model.threads == {threading.get_ident()}
    w.deltastore_stop()
    w.deltastore_stop()  # idempotent
    with pytest.raises(RuntimeError):
        w.deltastore_version()


def test_follow_failure_is_reported_by_the_next_rpc(tmp_path) -> None:
    url = str(tmp_path / "store")
    v1 = _state(0)
    model = _RecordingModel({n: tuple(t.shape) for n, t in v1.items()})
    w = _Worker(model)
    with Publisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)
        w.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        w.deltastore_sync()
        bigger = {**v1, "model.norm.weight": torch.zeros(9)}
        pub.publish(bigger, anchor=True)  # a layout change the host copy cannot follow
        deadline = time.monotonic() + DEADLINE_S
        while w.deltastore_status()["error"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert "LayoutMismatchError" in w.deltastore_status()["error"]
    with pytest.raises(RuntimeError, match="LayoutMismatchError"):
        w.deltastore_sync()
    _assert_model(model, v1)  # the engine keeps serving the last good version
    w.deltastore_stop()


def test_start_on_an_empty_store_waits_and_sync_never_blocks_the_engine(tmp_path) -> None:
    url = str(tmp_path / "store")
    v1 = _state(3)
    model = _RecordingModel({n: tuple(t.shape) for n, t in v1.items()})
    w = _Worker(model)
    with Publisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)  # creates the store; the worker starts before the version it follows
        v2 = {n: t.clone() for n, t in v1.items()}
        v2["model.norm.weight"][0] = 9.0
        w.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        assert w.deltastore_sync()["version"] == 1
        f = w._deltastore
        with f.lock:  # the follow thread is writing the host copy (a swap, or a whole first load)
            t0 = time.monotonic()
            assert w.deltastore_sync()["version"] == 1  # returns at once with what is served
            assert w.deltastore_status()["served"]["version"] == 1  # status does not wait either
            assert time.monotonic() - t0 < 5.0
            pub.publish(v2)
        _wait_staged(w, 2)
        assert w.deltastore_sync(block=True)["version"] == 2
        _assert_model(model, v2)
    w.deltastore_stop()


def test_start_before_the_first_version(tmp_path) -> None:
    store = tmp_path / "store"
    v1 = _state(4)
    model = _RecordingModel({n: tuple(t.shape) for n, t in v1.items()})
    w = _Worker(model)
    with Publisher(str(store), writer_policy=WriterPolicy(threads=1)) as pub:  # an empty store: HEAD at version 0
        w.deltastore_start(str(store), interval=0.02, threads=1)
        time.sleep(0.2)
        st = w.deltastore_status()
        assert st["error"] is None and st["staged"] is None
        assert w.deltastore_sync() is None  # nothing to serve yet
        pub.publish(v1)
        _wait_staged(w, 1)
    assert w.deltastore_sync()["version"] == 1
    _assert_model(model, v1)
    w.deltastore_stop()
